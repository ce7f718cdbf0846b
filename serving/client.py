"""Clients of a served bundle (`specrt serve`): HTTP `generate` with a JSON body, and gRPC streaming.

    from specrt.serving.client import GrpcStream, HttpClient, http_generate
    http_generate("http://127.0.0.1:8000", "def f():", MAX_NEW_TOKENS=32)   # {"TEXT", "TOKEN_IDS", "FINISH_REASON"}
    with HttpClient("http://127.0.0.1:8000") as c:                       # one kept-alive connection
        for piece in c.stream("def f():", MAX_NEW_TOKENS=32): ...        # generate_stream's events
    with GrpcStream("127.0.0.1:8001") as s:
        for piece in s.generate("def f():", MAX_NEW_TOKENS=32):           # one dict per response, as they come
            print(piece["TEXT"], end="")

Inputs are the decode-loop model's (serving/triton_model.py), by name. A refusal or a failed request raises
ServedError with the server's message. gRPC needs tritonclient[grpc]; HTTP needs nothing.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator

import numpy as np

from specrt.errors import SpecrtError
from specrt.serving.triton import DECODE_INPUTS, DECODE_MODEL

NUMPY = {"INT32": np.int32, "INT64": np.int64, "FP32": np.float32, "BOOL": np.bool_}


class ServedError(SpecrtError):
    """What the server answered instead of a result."""


class HttpClient:
    """Requests over one keep-alive HTTP connection (made again if the server closed it): `generate` (one response)
    and `stream` (`generate_stream`'s server-sent events, STREAM on); a light client, as curl is (no gRPC stack)."""

    def __init__(self, url: str, timeout: float = 300, model: str = DECODE_MODEL):
        from urllib.parse import urlsplit

        u = urlsplit(url)
        self.host, self.port, self.timeout, self.model = u.hostname, u.port, timeout, model
        self.conn = None

    def _post(self, endpoint: str, body: dict):
        import http.client

        data = json.dumps(body)
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                self.conn.request("POST", f"/v2/models/{self.model}/{endpoint}", data,
                                  {"Content-Type": "application/json"})
                r = self.conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()  # a kept-alive connection the server had closed: once more on a new one
                if attempt:
                    raise
                continue
            if r.status != 200:
                raise ServedError(json.loads(r.read() or b"{}").get("error", f"HTTP {r.status}"))
            return r

    def generate(self, prompt: str, **inputs) -> dict:
        """One request to the `generate` endpoint; returns the response's outputs."""
        return _outputs(json.loads(self._post("generate", {"PROMPT": prompt, **inputs}).read()))

    def stream(self, prompt: str, **inputs) -> Iterator[dict]:
        """One request to `generate_stream`: its responses as they come."""
        r = self._post("generate_stream", {"PROMPT": prompt, "STREAM": True, **inputs})
        try:
            for line in r:
                if line.startswith(b"data: "):
                    yield _outputs(json.loads(line[6:]))
        except BaseException:
            self.close()  # a stream read partly leaves the connection unusable
            raise

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def __enter__(self) -> "HttpClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _outputs(out: dict) -> dict:
    if "error" in out:
        raise ServedError(out["error"])
    ids = out.get("TOKEN_IDS", [])
    out["TOKEN_IDS"] = [ids] if isinstance(ids, int) else ids  # JSON gives a one-element tensor as its element
    return out


def http_generate(url: str, prompt: str, timeout: float = 300, **inputs) -> dict:
    """One request to the `generate` endpoint on a connection of its own."""
    with HttpClient(url, timeout) as c:
        return c.generate(prompt, **inputs)


def http_stream(url: str, prompt: str, timeout: float = 300, **inputs) -> Iterator[dict]:
    """One streamed request on a connection of its own."""
    with HttpClient(url, timeout) as c:
        yield from c.stream(prompt, **inputs)


class GrpcStream:
    """One gRPC bidirectional stream to the server, one request at a time on it (tritonclient routes a stream's errors
    to no request in particular)."""

    def __init__(self, url: str, model: str = DECODE_MODEL):
        import tritonclient.grpc as grpcclient

        self.model = model
        self.client = grpcclient.InferenceServerClient(url)
        self.responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))
        self._count = 0

    def send(self, prompt: str, **inputs) -> str:
        """Send one request (its inputs by name; wrong types are sent as given); returns its id."""
        self._count += 1
        rid = str(self._count)
        self.client.async_stream_infer(self.model, request_tensors(prompt, inputs), request_id=rid,
                                       enable_empty_final_response=True)
        return rid

    def receive(self, timeout: float = 300) -> Iterator[dict]:
        """The responses of the request in flight, as they come: dicts of outputs(); the last
        has "final" True."""
        while True:
            result, error = self.responses.get(timeout=timeout)
            if error is not None:
                raise ServedError(error.message() if hasattr(error, "message") else str(error))
            final = result.get_response().parameters["triton_final_response"].bool_param
            out = {"final": final}
            if result.as_numpy("TEXT") is not None:
                out.update(outputs(result))
            yield out
            if final:
                return

    def generate(self, prompt: str, timeout: float = 300, **inputs) -> Iterator[dict]:
        self.send(prompt, **inputs)
        return self.receive(timeout)

    def close(self, cancel: bool = False) -> None:
        """End the stream; `cancel`: cancel its request in flight (what a client that goes away does)."""
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()

    def __enter__(self) -> "GrpcStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def request_tensors(prompt: str, inputs: dict) -> list:
    """The decode-loop model's input tensors (tritonclient InferInputs, for its sync and asyncio gRPC clients) of a
    prompt and inputs by name; an array is sent as it is (a test of a wrong dtype), values as the model declares them."""
    import tritonclient.grpc as grpcclient

    def tensor(name, array, kind):
        t = grpcclient.InferInput(name, list(array.shape), kind)
        t.set_data_from_numpy(array)
        return t

    tensors = [tensor("PROMPT", np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES")]
    for name, value in inputs.items():
        if isinstance(value, np.ndarray):
            tensors.append(tensor(name, value, {np.dtype(v): k for k, v in NUMPY.items()}.get(value.dtype, "BYTES")))
        elif DECODE_INPUTS.get(name) == "STRING":
            tensors.append(tensor(name, np.array([str(value).encode()], dtype=np.object_), "BYTES"))
        else:
            kind = DECODE_INPUTS[name]
            tensors.append(tensor(name, np.array([value], dtype=NUMPY[kind]), kind))
    return tensors


def outputs(result) -> dict:
    """The decode-loop model's outputs of one gRPC response (a tritonclient InferResult)."""
    return {"TEXT": result.as_numpy("TEXT")[0].decode("utf-8"),
            "TOKEN_IDS": [int(t) for t in result.as_numpy("TOKEN_IDS")],
            "FINISH_REASON": result.as_numpy("FINISH_REASON")[0].decode(),
            **{name: int(result.as_numpy(name)[0]) for name in ("PROMPT_TOKENS", "TARGET_STEPS")}}


def joined(responses) -> dict:
    """A streamed request's responses as one: the whole TEXT and TOKEN_IDS, and the FINISH_REASON."""
    parts = [r for r in responses if "TEXT" in r]
    return {"TEXT": "".join(r["TEXT"] for r in parts), "TOKEN_IDS": [t for r in parts for t in r["TOKEN_IDS"]],
            "FINISH_REASON": parts[-1]["FINISH_REASON"] if parts else ""}
