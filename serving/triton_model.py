"""specrt's decode loop as a Triton Inference Server Python-backend model (`specrt triton` copies this file to
<repo>/specrt/1/model.py; the Python that Triton runs it in must have specrt installed: `specrt serve` sees to it).

Decoupled: execute() hands each request to the decode loops and returns; one dispatcher thread answers every request
on its response sender as its rounds are accepted. Requests of the same method and sampling parameters decode
together in one continuously batched loop (serving/pool.py: a request joins the running batch between rounds).

    inputs    PROMPT          string [1]  the prompt text
              MAX_NEW_TOKENS  int32  [1]  optional, default 128
              METHOD          string [1]  optional, default the model's `method` parameter
              TEMPERATURE     fp32   [1]  optional, default 0 (greedy)
              TOP_K, TOP_P    int32, fp32 [1]  optional: sampling's top-k (0: off) and nucleus (1: off)
              SEED            int64  [1]  optional: the request's own sampler seed (else the loop's)
              STREAM          bool   [1]  optional, default false: responses as rounds are accepted (at most one per
                                          `stream_interval_ms`, longer beyond STREAMS_AT_INTERVAL streams: the
                                          rounds accepted meanwhile come as one piece),
                                          the last with FINISH_REASON; else one response with the whole
                                          continuation (what the HTTP `generate` endpoint takes)
    outputs   TEXT            string [1]  the continuation, or the piece of it
              TOKEN_IDS       int64  [-1] its token ids (a piece's: the tokens since the previous piece)
              FINISH_REASON   string [1]  "eos", "length" or "cancelled" on the last response, else ""
              PROMPT_TOKENS   int64  [1]  the prompt's tokens
              TARGET_STEPS    int64  [1]  the target's decode steps so far, prefill excluded: new tokens / TARGET_STEPS
                                          are the tokens each target call gave

A request with bad input gets an error response naming the input, and nothing else happens. A client that cancels
or disconnects (the response sender says so) leaves its batch at the end of the round. The model's counters go to
Triton's metrics endpoint (the Python backend's custom metrics, refreshed every POLL_SECONDS), per method:
specrt_generated_tokens_total, specrt_target_calls_total, specrt_accepted_tokens_total,
specrt_rounds_total{sequences="n"} (decode rounds by the sequences they held), and the gauges
specrt_tokens_per_target_call, specrt_queue_requests and specrt_running_sequences.

The model's parameters (config.pbtxt) say which bundle to load and how (every option of Pipeline.load: backend, device,
threads, quant, kv_update, packed_rows, verify), the method a request that names none gets, the sequences one batch
holds (max_batch) and the stream interval.
"""

from __future__ import annotations

import heapq
import json
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import triton_python_backend_utils as pb_utils

# input -> (keyword of DecodeRequest.of, Python type)
OPTIONAL = {"MAX_NEW_TOKENS": ("max_new_tokens", int), "METHOD": ("method", str), "TEMPERATURE": ("temperature", float),
            "TOP_K": ("top_k", int), "TOP_P": ("top_p", float), "SEED": ("seed", int), "STREAM": ("stream", bool)}
NAMES = {"prompt": "PROMPT", **{key: name for name, (key, _) in OPTIONAL.items()}}  # keyword -> input
POLL_SECONDS = 0.2  # how often cancellations are looked for (a round trip to the server each) and metrics refreshed
# streams answered at the stream interval; beyond them the interval grows with the streams, so that the responses sent
# per second stay those of this many: each is a round trip through Triton, and at 16 streams every 20 ms they cost
# the 2-core host a fifth of its throughput (`specrt bench serve`: 0.77x the in-process server at 20 ms, 0.88x at 50)
STREAMS_AT_INTERVAL = 4
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class BadInput(Exception):
    """A request's fault, said to its client (its message names the input)."""


def _value(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    array = tensor.as_numpy()
    if array.size != 1:
        raise BadInput(f"{name} must hold one value, got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadInput(f"{name} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    return value.item()


def _inputs(error) -> str:
    """The inputs an error is about (SpecrtError.fields), as the request names them."""
    return ", ".join(NAMES.get(k, k) for k in error.fields) or "request"


def parse(request):
    """(the DecodeRequest, whether to stream) of a request; raises BadInput naming the input."""
    from specrt.errors import InvalidRequestError
    from specrt.runtime.options import DecodeRequest

    prompt = _value(request, "PROMPT")
    if prompt is None:
        raise BadInput("the request has no PROMPT")
    kwargs = {}
    for name, (key, kind) in OPTIONAL.items():
        value = _value(request, name)
        if value is None:
            continue
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise BadInput(f"{name} must be {kind.__name__}, got {value!r}")
        kwargs[key] = value
    stream = kwargs.pop("stream", False)
    try:
        return DecodeRequest.of(prompt, **kwargs), stream
    except InvalidRequestError as e:
        raise BadInput(f"{_inputs(e)}: {e}") from None


@dataclass
class _Live:
    """A request being answered."""

    handle: object  # the runtime Request
    sender: object  # its response sender
    stream: bool
    next_send: float = 0.0  # no streamed response before this time.perf_counter()
    held: bool = False  # waiting out its interval (in the dispatcher's heap, once)


class TritonPythonModel:
    def initialize(self, args):
        from specrt.runtime.pipeline import Pipeline
        from specrt.serving.pool import ServerPool
        from specrt.serving.triton import pipeline_options

        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.pipe = Pipeline.load(params["bundle"], **pipeline_options(params))
        pb_utils.Logger.log_info(f"specrt: {params['bundle']} loaded on {self.pipe.machine.describe()}")
        self.pool = ServerPool(self.pipe, int(params.get("max_batch") or 8), params.get("method") or "sd")
        self.stream_interval = float(params.get("stream_interval_ms") or 0) / 1000
        self.live: dict[int, _Live] = {}  # id of the runtime Request -> what answering it needs
        self.lock = threading.Lock()  # over `live`, the final sends and the watcher's questions
        self.news: queue.SimpleQueue = queue.SimpleQueue()  # runtime Requests with tokens or their end
        self.stop = threading.Event()
        self.metrics = _Metrics()
        self.threads = [threading.Thread(target=f, name=f"specrt-{f.__name__.strip('_')}", daemon=True)
                        for f in (self._dispatch, self._watch)]
        for t in self.threads:
            t.start()

    def execute(self, requests):
        from specrt.serving.pool import Refused

        for request in requests:
            sender = request.get_response_sender()
            try:
                decode, stream = parse(request)
                try:
                    handle = self.pool.submit(decode)
                except Refused as e:
                    raise BadInput(f"{_inputs(e)}: {e}") from None
            except BadInput as e:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))), flags=FINAL)
                continue
            with self.lock:
                self.live[id(handle)] = _Live(handle, sender, stream)
            handle.listen(self.news.put)  # called from the decode loop's thread: a put, nothing more
        return None

    def _dispatch(self) -> None:
        """Answer every request from this one thread: as their rounds are accepted, each streamed one gets a response
        (at most one per stream interval: the rounds accepted meanwhile go out as one piece), each at its end its last
        one, with the final flag. Every send is a round trip to the server, made here, not on the decode loop."""
        held: list[tuple[float, int]] = []  # (when, id) of streamed requests waiting out their interval
        while not self.stop.is_set():
            wait = max(0.0, held[0][0] - time.perf_counter()) if held else POLL_SECONDS
            ready = set()
            try:
                ready.add(id(self.news.get(timeout=wait)))
                while True:
                    ready.add(id(self.news.get_nowait()))
            except queue.Empty:
                pass
            while held and held[0][0] <= time.perf_counter():
                key = heapq.heappop(held)[1]
                if key in self.live:
                    self.live[key].held = False
                ready.add(key)
            for key in ready:
                live = self.live.get(key)
                if live is None or live.held:
                    continue
                if live.stream and live.next_send > time.perf_counter() and not live.handle.done():
                    heapq.heappush(held, (live.next_send, key))
                    live.held = True
                    continue
                self._answer(key, live)

    def _answer(self, key: int, live: "_Live") -> None:
        handle, sender = live.handle, live.sender
        try:
            if live.stream:
                piece = handle.poll()
                if not handle.exhausted:
                    if piece is not None:
                        # no question first (a cancelled request's responses are dropped; the watcher takes it out
                        # of its batch)
                        sender.send(_response(piece.text, piece.token_ids, handle))
                        with self.lock:  # execute() adds requests from Triton's thread
                            streams = sum(lv.stream for lv in self.live.values())
                        live.next_send = time.perf_counter() + self.stream_interval * max(
                            1.0, streams / STREAMS_AT_INTERVAL)
                    return
                done = handle.result()
                last = _response(piece.text if piece else "", piece.token_ids if piece else [], handle,
                                 done.finish_reason)
            elif not handle.done():
                return
            else:
                done = handle.result()
                last = _response(done.text, done.token_ids, handle, done.finish_reason)
        except Exception as e:  # a failed round (or send): the request's error, the others go on
            handle.cancel()
            last = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"decoding failed: {e}"))
        # a sender is not asked anything once its final response is sent (Triton frees what it asks about: asking then
        # crashes the server): the final send and the watcher's questions take turns under the lock
        with self.lock:
            self.live.pop(key, None)
            if not sender.is_cancelled():
                sender.send(last, flags=FINAL)

    def _watch(self) -> None:
        """Cancel the requests whose clients went away; refresh the metrics."""
        while not self.stop.wait(POLL_SECONDS):
            with self.lock:
                gone = [live.handle for live in self.live.values() if live.sender.is_cancelled()]
            for handle in gone:
                handle.cancel()
            self.metrics.update(self.pool.stats())

    def finalize(self):
        self.pool.close(cancel=True)
        self.stop.set()
        for t in self.threads:
            t.join()


def _response(text: str, token_ids: list[int], handle, finish: str = ""):
    """A response with a piece of text (and its tokens) of the request `handle`; the last says why it ended."""
    prompt, steps = handle.prompt_tokens, handle.target_steps
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("TEXT", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("TOKEN_IDS", np.asarray(token_ids, dtype=np.int64)),
        pb_utils.Tensor("FINISH_REASON", np.array([finish.encode()], dtype=np.object_)),
        pb_utils.Tensor("PROMPT_TOKENS", np.array([prompt], dtype=np.int64)),
        pb_utils.Tensor("TARGET_STEPS", np.array([steps], dtype=np.int64))])


class _Metrics:
    """specrt's counters in Triton's metrics endpoint (the Python backend's custom metrics), per method."""

    COUNTERS = {"generated_tokens": "new tokens of the requests that ended",
                "target_calls": "target steps the ended requests took part in (prefill included)",
                "accepted_tokens": "drafted tokens the ended requests accepted"}

    def __init__(self):
        family = pb_utils.MetricFamily
        self.counters = {k: family(f"specrt_{k}_total", help, family.COUNTER) for k, help in self.COUNTERS.items()}
        self.rounds = family("specrt_rounds_total", "decode rounds, by the sequences they held", family.COUNTER)
        self.gauges = {"tokens_per_target_call": family("specrt_tokens_per_target_call", "new tokens per target step "
                                                        "of the requests that ended", family.GAUGE),
                       "waiting": family("specrt_queue_requests", "requests waiting for a place in a batch",
                                         family.GAUGE),
                       "running": family("specrt_running_sequences", "sequences in a batch now", family.GAUGE)}
        self.metrics: dict[tuple, object] = {}
        self.sent: dict[tuple, float] = {}  # each metric's value as the server has it (a message to it per change)

    def _metric(self, family, labels: dict):
        key = (id(family), *sorted(labels.items()))
        if key not in self.metrics:
            self.metrics[key] = family.Metric(labels=labels)
        return key, self.metrics[key]

    def _count(self, family, labels: dict, total: float) -> None:
        key, metric = self._metric(family, labels)
        delta = total - self.sent.get(key, 0)
        if delta > 0:
            metric.increment(delta)
            self.sent[key] = total

    def _set(self, family, labels: dict, value: float) -> None:
        key, metric = self._metric(family, labels)
        if self.sent.get(key) != value:
            metric.set(value)
            self.sent[key] = value

    def update(self, stats: dict) -> None:
        """Push one snapshot of the pool's stats: gauges first, so that a scrape that sees a request's tokens counted
        also sees it gone from the batch (each value is a message of its own to the server)."""
        for method, st in stats.items():
            labels = {"method": method}
            per_call = st.generated_tokens / st.target_calls if st.target_calls else 0.0
            for k, value in (("tokens_per_target_call", per_call), ("waiting", st.waiting), ("running", st.running)):
                self._set(self.gauges[k], labels, float(value))
            for k, family in self.counters.items():
                self._count(family, labels, getattr(st, k))
            for n, rounds in st.rounds_by_batch.items():
                self._count(self.rounds, {**labels, "sequences": str(n)}, rounds)
