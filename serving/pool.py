"""ServerPool: requests that each name their method and sampling parameters, served by continuously batched loops.

A runtime Server decodes one batch with one method and one set of sampling parameters (one Drafter + Verifier
pair), so the pool keeps one Server per (method, sampling parameters) that requests use: every request of the same
kind joins the same running batch, between rounds; a seed is each request's own (Server.submit). A kind's server is
made when its first request comes and given back when another kind needs a new one while it has nothing to do (its
runners, and on engines their slots, go with it): at most `max_servers` kinds decode at once, the others' requests are
refused until one finishes. Counts of the servers given back stay in the pool's stats.

    pool = ServerPool(pipe, max_batch=8, default_method="sd")
    request = pool.submit(DecodeRequest.of("def f():", max_new_tokens=64, method="anpd", temperature=0.0))
    for piece in request.pieces(): ...
    pool.stats()            # {method: ServerStats summed over its servers, the given-back ones included}
    pool.close(cancel=True)
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import fields

from specrt.errors import InvalidRequestError, SpecrtError
from specrt.runtime.methods import METHODS
from specrt.runtime.options import DecodeRequest
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.server import Request, Server, ServerStats


class Refused(InvalidRequestError):
    """A request the pool will not take; `fields`: the DecodeRequest fields it is about (none: the pool's state)."""


def _sum(stats: list[ServerStats]) -> ServerStats:
    """Stats of several servers as one: counts and rounds added up."""
    rounds: Counter = Counter()
    for s in stats:
        rounds.update(s.rounds_by_batch)
    return ServerStats(dict(rounds), **{f.name: sum(getattr(s, f.name) for s in stats)
                                         for f in fields(ServerStats) if f.name != "rounds_by_batch"})


class ServerPool:
    def __init__(self, pipe, max_batch: int = 8, default_method: str = "sd", max_servers: int = 4):
        if default_method not in METHODS:
            raise InvalidRequestError(f"unknown method {default_method!r} (choose from {', '.join(METHODS)})")
        self.pipe, self.max_batch, self.default_method, self.max_servers = pipe, max_batch, default_method, max_servers
        self._servers: dict[tuple[str, SamplingParams], Server] = {}
        self._retired: dict[str, list[ServerStats]] = {}  # method -> final stats of servers given back
        self._lock = threading.Lock()
        self._closed = False
        # the default kind (greedy) made now: a bundle that cannot run the default method (`auto` without plan.json,
        # `ppd` without prompt tokens) is refused as the model loads, not at its first request
        self._servers[(default_method, SamplingParams())] = pipe.server(default_method, max_batch,
                                                                        sampling=SamplingParams())

    def submit(self, request: DecodeRequest) -> Request:
        """Queue one request on its kind's server (made now if it has none); raises Refused, naming the fields at fault,
        in this thread, before it reaches any batch."""
        if not isinstance(request, DecodeRequest):
            raise TypeError(f"ServerPool.submit takes a DecodeRequest, got {type(request).__name__}")
        key = (request.method or self.default_method, request.sampling)
        with self._lock:
            if self._closed:
                raise Refused("this pool is closed")
            server = self._servers.get(key)
            if server is None:
                try:
                    server = self._open(key)
                except SpecrtError as e:  # the method cannot run here (e.g. ppd without prompt tokens), or no room
                    raise Refused(str(e), fields=("method",)) from None
            try:
                return server.submit(request.prompt, request.max_new_tokens, request.seed)
            except InvalidRequestError as e:  # the prompt, against the bundle (the other fields were checked)
                raise Refused(str(e), fields=e.fields or ("prompt",)) from None

    def _open(self, key) -> Server:
        """A server for `key`, after giving back idle ones of other kinds (under _lock)."""
        for other, s in list(self._servers.items()):
            st = s.stats()
            if st.waiting == 0 and st.running == 0:
                self._give_back(other)
        if len(self._servers) >= self.max_servers:
            busy = ", ".join(f"{m} ({p.temperature=:g})" for m, p in self._servers)
            raise InvalidRequestError(f"{len(self._servers)} kinds of request are decoding ({busy}): a request of "
                                      "another method or sampling parameters waits until one of them is done")
        method, params = key
        server = self.pipe.server(method, self.max_batch, sampling=params)
        self._servers[key] = server
        return server

    def _give_back(self, key, cancel: bool = False) -> None:
        server = self._servers.pop(key)
        server.close(cancel=cancel)
        self._retired.setdefault(key[0], []).append(server.stats())

    def stats(self) -> dict[str, ServerStats]:
        """Per method, its servers' stats added up (the given-back ones' included)."""
        with self._lock:
            by_method: dict[str, list[ServerStats]] = {m: list(v) for m, v in self._retired.items()}
            for (method, _), server in self._servers.items():
                by_method.setdefault(method, []).append(server.stats())
        return {m: _sum(v) for m, v in by_method.items()}

    def close(self, cancel: bool = False) -> None:
        """Close every server, finishing what they hold (cancelling it first with `cancel`). Idempotent."""
        with self._lock:
            self._closed = True
            for key in list(self._servers):
                self._give_back(key, cancel)
