"""Server: requests that arrive over time, decoded in one continuously batched loop on a thread of its own.

    with pipe.server(method="sd", max_batch=8) as server:
        a = server.submit("def add(a, b):", max_new_tokens=64)     # returns at once: a Request
        b = server.submit([1, 2, 3], max_new_tokens=16)
        for piece in a.stream(): print(piece, end="")             # text as rounds are accepted
        b.result().stats                                           # a Generation (blocks until done)
        await asyncio.wrap_future(b.future)                        # the same, from asyncio
        b.cancel()                                                 # leaves the batch at the end of its round
        server.stats()                                             # rounds by batch size, tokens, queue: ServerStats

One method, its options and the sampling parameters are the server's (one Drafter + Verifier pair decodes the
batch); the prompt, max_new_tokens and seed are each request's. A request with a seed draws from a generator of its
own, so what it samples does not depend on what else shares its batch (the same tokens as `Pipeline.generate` of
that prompt alone with that seed); without one it draws from the server's. A request is checked when it is submitted, in the
caller's thread (a bad prompt raises there and never reaches the batch). Requests join the running batch
between rounds, first come first served, while it has fewer than `max_batch` sequences; each keeps its own
Stats, whose `seconds.finished` counts from its submission. A request that is cancelled, or whose round fails
(its exception is the request's), leaves without disturbing the others' tokens: every sequence of a batch is
decoded independently of the others (the lossless methods give each the tokens it gets alone). `close()`
finishes what was submitted, then stops the thread and gives back the runners; `close(cancel=True)` cancels
what has not finished first.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from specrt.errors import InvalidRequestError
from specrt.runtime.detokenize import TextStream
from specrt.runtime.options import DecodeOptions
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.scheduler import Scheduler, SeqState, Waiting


class Decoder(Protocol):
    """What a Server needs of the pipeline it serves (Pipeline is one): its public seam, nothing private."""

    def scheduler(self, method: str, options: dict, params: SamplingParams, batch_size: int,
                  padded: bool = False) -> tuple[Scheduler, int]: ...

    def sequences(self, prompts, max_new_tokens: list[int], slack: int) -> list[SeqState]: ...

    def generation(self, s: SeqState): ...

    def decode(self, ids) -> str: ...


@dataclass(frozen=True)
class Piece:
    """A request's text and tokens since its last piece."""

    text: str
    token_ids: list[int]


class Request:
    """A submitted request: its future Generation, its tokens as they come, and a way to cancel it.

    Its tokens reach the consumer as Pieces: `pieces()` (blocking, one per round or per the rounds a slow consumer
    missed), or `poll()` (never blocking) from a consumer told of news by `listen(callback)`: one thread can serve
    many requests that way."""

    def __init__(self, server: "Server", seq: SeqState):
        self._server = server
        self._seq = seq
        self.future: Future = Future()  # -> Generation (asyncio: asyncio.wrap_future(request.future))
        self._lock = threading.Lock()
        self._pending: list[int] = []  # tokens emitted, not yet taken by the consumer (under _lock)
        self._ended = False  # no more tokens will come (under _lock)
        self._news = threading.Event()  # set when tokens or the end came since the consumer last took them
        self._listener = None
        # the consumer's side: every token taken, the text and tokens handed out so far, and whether the last piece was
        self._text = TextStream(server.pipe.decode)  # every token taken, decoded as it comes
        self._sent, self._exhausted = 0, False
        self._streamed = False

    @property
    def index(self) -> int:
        """The order it was submitted in (0, 1, ... per server)."""
        return self._seq.index

    def cancel(self) -> bool:
        """Ask it to stop; it leaves the batch at the end of the round (keeping the tokens it has) with
        finish_reason "cancelled". False if it had already finished."""
        if self.future.done():
            return False
        self._seq.cancelled = True  # first: a scheduler taking it from the queue now drops it
        if self._server._waiting.remove(self._seq):  # it never ran: finished here, at once
            self._seq.finished, self._seq.finish_reason = True, "cancelled"
            self._server._retire(self)
        return True

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None):
        """The Generation, once finished (raises what failed its round, or TimeoutError after `timeout` s)."""
        return self.future.result(timeout)

    @property
    def prompt_tokens(self) -> int:
        """Its prompt's length in tokens."""
        return self._seq.prompt_len

    @property
    def target_steps(self) -> int:
        """The target's decode steps it has taken part in so far (prefill excluded)."""
        return self._seq.stats.rounds

    def token_ids(self) -> list[int]:
        """The new tokens so far."""
        return [int(t) for t in self._seq.new_tokens]

    def stream(self, timeout: float | None = None) -> Iterator[str]:
        """Text pieces of its continuation as rounds are accepted (one consumer per request). `timeout`: seconds
        to wait for each piece before raising TimeoutError."""
        for piece in self.pieces(timeout):
            if piece.text:
                yield piece.text

    def pieces(self, timeout: float | None = None) -> Iterator[Piece]:
        """Its continuation as rounds are accepted: Pieces whose texts, and whose token ids, add up to the whole (the
        last may have no text: it carries the last tokens). A consumer slower than the rounds gets the rounds it
        missed as one piece, not a backlog of them. One consumer per request (stream, pieces or poll); `timeout`:
        seconds to wait for each round's tokens before raising TimeoutError; a failed round raises at the end."""
        if self._streamed:
            raise InvalidRequestError("a request's stream can be read once")
        self._streamed = True
        while not self._exhausted:
            if not self._news.wait(timeout):
                raise TimeoutError(f"no tokens of request {self.index} in {timeout} s")
            piece = self.poll()
            if piece is not None:
                yield piece
        self.future.result()  # a failed round raises here

    def poll(self) -> Piece | None:
        """The text and tokens accepted since the last piece, without waiting: None while nothing new reads as text
        (a multi-byte character split across rounds waits for its rest); after the end, the last piece once."""
        with self._lock:
            new, self._pending = self._pending, []
            ended = self._ended
            self._news.clear()  # with the take, so that no news is lost (_emit sets it after appending)
        if self._exhausted:
            return None
        text = self._text.add(new, final=ended) if (new or ended) else ""
        ids = self._text.ids
        if ended:
            self._exhausted = True
        elif not text:
            return None
        if not text and len(ids) <= self._sent:
            return None
        piece = Piece(text, ids[self._sent:])
        self._sent = len(ids)
        return piece

    @property
    def exhausted(self) -> bool:
        """Whether the consumer has taken the last piece (poll returns None from now on)."""
        return self._exhausted

    def listen(self, callback) -> None:
        """Call `callback(request)` whenever tokens or the end arrive (from the server's thread: keep it short, e.g. a
        queue put); at once if some are already waiting."""
        self._listener = callback
        if self._news.is_set():
            callback(self)

    def _emit(self, tokens: list[int]) -> None:
        if tokens:
            with self._lock:
                self._pending += tokens
            self._told()

    def _told(self) -> None:
        self._news.set()
        if self._listener is not None:
            self._listener(self)

    def _finish(self, error: BaseException | None = None) -> None:
        if self.future.done():
            return
        if error is None:
            self.future.set_result(self._server.pipe.generation(self._seq))
        else:
            self.future.set_exception(error)
        with self._lock:
            self._ended = True
        self._told()


class _Queue(Waiting):
    def __init__(self, server: "Server"):
        super().__init__()
        self._server = server

    def take(self, count: int) -> list[SeqState]:
        taken = super().take(count)
        with self._server._lock:
            self._server._running.update(s.index for s in taken)
        return taken

    def dropped(self, seq: SeqState) -> None:
        self._server._retire(self._server._requests[seq.index])


@dataclass(frozen=True)
class ServerStats:
    """What a server has done since it started (Server.stats())."""

    rounds_by_batch: dict[int, int]  # decode rounds by the number of sequences they held
    submitted: int  # requests
    finished: int  # of those, ended with their tokens ("eos", "length" or "cancelled")
    failed: int  # ended by an error in their round
    waiting: int  # queued, not yet in the batch
    running: int  # in the batch now
    generated_tokens: int  # new tokens of the ended requests
    target_calls: int  # target steps the ended requests took part in (prefill included)
    accepted_tokens: int  # drafted tokens the ended requests accepted

    @property
    def rounds(self) -> int:
        return sum(self.rounds_by_batch.values())


class Server:
    def __init__(self, pipe: Decoder, method: str, max_batch: int, params: SamplingParams, seed: int, options: dict):
        """Made by Pipeline.server, which checks max_batch and seed."""
        self.pipe = pipe
        self.params = params
        self.max_batch = max_batch
        self._scheduler, self._slack = pipe.scheduler(method, options, self.params, max_batch)
        self._rng = np.random.default_rng(seed)
        self._waiting = _Queue(self)
        self._requests: dict[int, Request] = {}  # submitted, not yet finished (changed under _lock)
        self._running: set[int] = set()  # of those, the ones the scheduler took into the batch
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._closing = False
        self._submitted = 0
        self._rounds: Counter = Counter()  # sequences in a round -> rounds (changed under _lock)
        self._ended = Counter()  # finished, failed, generated_tokens, target_calls, accepted_tokens
        self._thread = threading.Thread(target=self._loop, name="specrt-server", daemon=True)
        self._thread.start()

    def submit(self, prompt: str | Sequence[int], max_new_tokens: int = 128, seed: int | None = None) -> Request:
        """Queue one request (a string or token ids); returns at once. `seed`: the request's own sampler seed
        (None: it draws from the server's). Raises InvalidRequestError for a bad prompt, limit or seed, in this
        thread, and after close()."""
        started = time.perf_counter()
        if seed is not None:
            DecodeOptions(seed=seed)  # checked as generate checks it
        (seq,) = self.pipe.sequences([prompt], [max_new_tokens], self._slack)  # raises for bad input
        seq.rng = None if seed is None else np.random.default_rng(seed)
        with self._lock:
            if self._closing:
                raise InvalidRequestError("this server is closed: submit to a new one")
            index = self._submitted
            seq.index, seq.started = index, started
            request = Request(self, seq)
            self._requests[index] = request
            self._submitted += 1
            self._waiting.put(seq)
            self._wakeup.notify()
        return request

    def stats(self) -> ServerStats:
        with self._lock:
            e = self._ended
            return ServerStats(dict(self._rounds), self._submitted, e["finished"], e["failed"], self._waiting.pending(),
                               len(self._running), e["generated_tokens"], e["target_calls"], e["accepted_tokens"])

    def close(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop taking requests; finish the submitted ones (cancel them first with `cancel=True`), then stop
        the thread and give back the runners. Idempotent."""
        with self._lock:
            self._closing = True
            if cancel:
                for r in self._requests.values():
                    r._seq.cancelled = True
            self._wakeup.notify()
        self._thread.join(timeout)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.close(cancel=exc[0] is not None)

    def _retire(self, request: Request, error: BaseException | None = None) -> None:
        """The request is over (finished, cancelled, or failed with `error`): deliver it."""
        with self._lock:
            self._requests.pop(request.index, None)
            self._running.discard(request.index)
            s = request._seq.stats
            if error is not None:
                self._ended["failed"] += 1
            else:
                self._ended.update(finished=1, generated_tokens=len(request._seq.new_tokens),
                                   target_calls=s.target_calls, accepted_tokens=s.accepted)
        request._finish(error)

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._waiting.pending() and not self._closing:
                        self._wakeup.wait()
                    if not self._waiting.pending():  # closing, nothing left
                        return
                self._run()
        finally:
            self._scheduler.close()

    def _round(self, num_seqs: int) -> None:
        with self._lock:
            self._rounds[num_seqs] += 1

    def _run(self) -> None:
        """One scheduler run: until no request is live and none waits. A failed round fails the requests in the
        batch; the server goes on with the next ones."""
        try:
            for seq, appended in self._scheduler.run(self._waiting, self.params, self._rng, self.max_batch,
                                                     on_round=self._round):
                request = self._requests[seq.index]
                request._emit(appended)
                if seq.finished:
                    self._retire(request)
        except Exception as e:  # the batch's requests get the error; the server thread goes on
            with self._lock:
                failed = [self._requests[i] for i in self._running if i in self._requests]
            for r in failed:
                self._retire(r, e)
