"""OpenAI-compatible routes in front of the Triton-served bundle (`specrt serve --openai-port`, default 9000).

    GET  /v1/models                  the served model
    POST /v1/completions             a prompt's continuation          (stream: server-sent events, then [DONE])
    POST /v1/chat/completions        a conversation's reply, through the tokenizer's chat template
    GET  /health                     200 while Triton says the decode-loop model is ready, else 503

A FastAPI app run by uvicorn on a thread of the `specrt serve` process. Every request goes to the tritonserver as one
gRPC stream (tritonclient's asyncio client), so Triton's scheduling, instances and metrics stay in charge; a client
that goes away, or a stop string met, cancels its request there (it leaves its batch at the end of the round).
Requests are read and answered as serving/openai_api.py says.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request  # FastAPI reads the routes' annotations: Request must be a module name
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException

from specrt.errors import SpecrtError
from specrt.serving.client import ServedError, outputs, request_tensors
from specrt.serving.openai_api import (FINISH, ApiError, ApiRequest, StopText, answer, choice, read_request,
                                       served_error, speculation, tokens_through, usage)
from specrt.serving.triton import DECODE_MODEL


@dataclass(frozen=True)
class Served:
    """What the routes serve: the model's name, where its decode loop listens, and what renders and counts text."""

    name: str  # the model id clients name
    grpc_url: str  # host:port of the tritonserver's gRPC endpoint
    method: str  # the method a request that names none gets (the served model's default)
    tokenizer_dir: Path
    chat_template: Path | None = None  # a template file instead of the tokenizer's own


class TritonStream:
    """The decode-loop model's responses to one request, over one gRPC stream of a shared asyncio client."""

    def __init__(self, url: str):
        from tritonclient.grpc.aio import InferenceServerClient

        self.url = url
        self.client = InferenceServerClient(url)
        self.calls: dict[int, object] = {}  # the gRPC calls in flight, by id
        self.lost: set[int] = set()  # of those, the ones whose model's process died (fail_in_flight)

    def fail_in_flight(self) -> None:
        """End every request in flight with a 503 (call in the client's event loop): their model's stub process died,
        and Triton sends them nothing more."""
        self.lost.update(self.calls)
        for call in self.calls.values():
            call.cancel()

    async def responses(self, prompt: str, inputs: dict) -> AsyncIterator[dict]:
        """outputs() of each response as it comes, to the one with a FINISH_REASON; raises ServedError with what the
        decode loop answered instead, ApiError (503) where the server cannot be reached. Leaving early (a stop string,
        a client gone) cancels the request."""
        done = asyncio.Event()
        tensors = request_tensors(prompt, inputs)

        async def requests():
            yield {"model_name": DECODE_MODEL, "inputs": tensors}
            await done.wait()  # the stream stays open until its answer is in

        call = self.client.stream_infer(requests())
        self.calls[id(call)] = call
        finished = False
        try:
            async for result, error in call:
                if error is not None:
                    raise ServedError(error.message())
                out = outputs(result)
                finished = bool(out["FINISH_REASON"])
                yield out
                if finished:
                    return
        except ServedError:
            raise
        except (asyncio.CancelledError, Exception) as e:
            if isinstance(e, asyncio.CancelledError) and id(call) not in self.lost:
                raise
            if await self._lost(call):  # cancelled by fail_in_flight, or its stream broke as its stub died
                raise ApiError(503, "the model's process died while this request ran: it has been reloaded, send the "
                                    "request again", kind="server_error") from None
            if await self._live():
                raise ApiError(503, f"the decode loop's stream broke: {e}", kind="server_error") from None
            raise ApiError(503, f"the Triton server cannot be reached: {e}", kind="server_error") from None
        finally:
            self.calls.pop(id(call), None)
            self.lost.discard(id(call))
            done.set()  # the request stream ends: an answered call closes by itself
            if not finished:  # left early: the request is cancelled in Triton (cancelling costs grpc a traceback)
                call.cancel()

    async def _lost(self, call, grace: float = 3) -> bool:
        """Whether fail_in_flight marks the call lost within `grace` seconds of its stream breaking while the server
        lives: a stub's death can break a stream before it is seen (serve.Revive looks twice a second)."""
        if id(call) in self.lost:
            return True
        if not await self._live():
            return False
        for _ in range(round(grace / 0.05)):
            await asyncio.sleep(0.05)
            if id(call) in self.lost:
                return True
        return False

    async def _live(self) -> bool:
        """Whether the server answers liveness, asked on a channel of its own: the shared one can be down for a while
        with the stream it carried ("Stream removed (Socket closed)" as a stub died: its reconnection backs off)."""
        from tritonclient.grpc.aio import InferenceServerClient

        probe = InferenceServerClient(self.url)
        try:
            return await probe.is_server_live()
        except Exception:
            return False
        finally:
            await probe.close()

    async def ready(self) -> bool:
        try:
            return await self.client.is_server_ready() and await self.client.is_model_ready(DECODE_MODEL)
        except Exception:
            return False


def make_app(served: Served):
    """The FastAPI app of the routes."""
    from tokenizers import Tokenizer

    from specrt.chat import ChatTemplate, NoChatTemplate
    from specrt.errors import InvalidRequestError

    tokenizer = Tokenizer.from_file(str(served.tokenizer_dir / "tokenizer.json"))
    try:
        template = ChatTemplate.of(served.tokenizer_dir, served.chat_template)
    except NoChatTemplate as e:
        template, no_template = None, str(e)
    state: dict = {}

    async def lifespan(app):
        state["triton"] = TritonStream(served.grpc_url)  # made in the server's event loop, which it is bound to
        state["loop"] = asyncio.get_running_loop()
        yield
        await state["triton"].client.close()

    app = FastAPI(title="specrt", lifespan=lifespan)
    app.state.specrt = state
    created = int(time.time())
    model_card = {"id": served.name, "object": "model", "created": created, "owned_by": "specrt"}

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        code = "not_found" if e.status_code == 404 else None
        return JSONResponse(ApiError(e.status_code, str(e.detail), code=code).body(), status_code=e.status_code)

    @app.get("/health")
    async def health():
        ok = await state["triton"].ready()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != served.name:
            raise ApiError(404, f"the model {name!r} does not exist: this server serves {served.name!r}", "model",
                           "model_not_found")
        return model_card

    async def body_of(request: Request):
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not JSON: {e}") from None

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = read_request(await body_of(request), chat=False, model=served.name)
        return await run(req, req.prompt)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = read_request(await body_of(request), chat=True, model=served.name)
        if template is None:
            raise ApiError(400, f"{no_template}: start the server with --chat-template FILE, or use /v1/completions",
                           "messages", "no_chat_template")
        try:
            prompt = template.render(req.messages)
        except InvalidRequestError as e:
            raise ApiError(400, str(e), "messages") from None
        return await run(req, prompt)

    async def run(req: ApiRequest, prompt: str):
        inputs = {**req.inputs, "STREAM": bool(req.stream or req.stop)}  # stop strings are looked for as text comes
        responses = state["triton"].responses(prompt, inputs)
        try:
            first = await anext(responses)  # a refusal answers with its status, before any event is sent
        except ServedError as e:
            raise served_error(str(e), req.chat) from None
        if req.stream:
            return EventSourceResponse(events(req, first, responses), ping=15)
        return JSONResponse(await whole(req, first, responses))

    async def pieces(req: ApiRequest, first: dict, responses) -> AsyncIterator[tuple[str, list, dict, str | None]]:
        """(text that may go out, its new token ids, the response, finish_reason or None) per response, cut at a stop
        string (which ends the request: leaving the stream cancels it)."""
        stop, ids, sent, out = StopText(req.stop), [], 0, first
        try:
            while True:
                ids += out["TOKEN_IDS"]
                final = bool(out["FINISH_REASON"])
                text = stop.add(out["TEXT"], final)
                # the tokens counted are those up to a stop string's end
                count = len(ids) if stop.hit is None else tokens_through(decode, ids, stop.cut + len(stop.hit))
                finish = "stop" if stop.hit is not None else FINISH.get(out["FINISH_REASON"]) if final else None
                yield text, ids[sent:count], {**out, "COMPLETION_TOKENS": count}, finish
                sent = count
                if finish:
                    return
                out = await anext(responses)
        except ServedError as e:
            raise served_error(str(e), req.chat) from None
        finally:
            await responses.aclose()  # cancels the request where it had not ended (a stop string, a client gone)

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    def extras(req: ApiRequest, out: dict) -> dict:
        return {"usage": usage(out["PROMPT_TOKENS"], out["COMPLETION_TOKENS"]),
                "speculation": speculation(req.method or served.method, out["COMPLETION_TOKENS"], out["TARGET_STEPS"])}

    async def whole(req: ApiRequest, first: dict, responses) -> dict:
        text, ids, out, finish = [], [], None, None
        async for piece, new, out, finish in pieces(req, first, responses):
            text.append(piece)
            ids += new
        return answer(req, [choice(req, "".join(text), finish, token_ids=ids)], **extras(req, out))

    async def events(req: ApiRequest, first: dict, responses):
        send = (lambda obj: {"data": json.dumps(obj, ensure_ascii=False)})
        try:
            if req.chat:
                yield send(answer(req, [choice(req, "", None, delta=True, first=True)], chunk=True))
            ids = []  # tokens of text held back (a partial character, a possible stop string) go with the next chunk
            async for piece, new, out, finish in pieces(req, first, responses):
                ids += new
                if piece or finish:
                    more = extras(req, out) if finish else {}
                    usage_now = more.pop("usage", None)
                    yield send(answer(req, [choice(req, piece, finish, delta=True, token_ids=ids)], chunk=True, **more))
                    ids = []
                    if finish and req.include_usage:
                        yield send(answer(req, [], chunk=True, usage=usage_now))
        except ApiError as e:  # after the first event the status is sent: the error goes as an event
            yield send(e.body())
        yield {"data": "[DONE]"}

    return app


class OpenAIServer:
    """The app served by uvicorn on a thread of its own; start() returns once it listens."""

    def __init__(self, served: Served, host: str, port: int):
        import uvicorn

        self.app = make_app(served)
        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="specrt-openai", daemon=True)
        self.url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}/v1"
        self.model = served.name

    def start(self, timeout: float = 30) -> "OpenAIServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise SpecrtError(f"the OpenAI-compatible server did not start on {self.url} (is the port taken? "
                                  "--openai-port picks another, 0 turns it off)")
            time.sleep(0.05)
        return self

    def fail_in_flight(self, timeout: float = 5) -> None:
        """End the requests in flight with a 503 (from any thread but the server's event loop, which it waits on):
        their model's process died (serve.Revive). Returns once they are marked lost, so that the reload that follows
        cannot break their streams first (a request whose stream broke would say the server cannot be reached; one
        whose stub was replaced would wait forever)."""
        state = self.app.state.specrt
        if "loop" in state:
            async def fail():
                state["triton"].fail_in_flight()

            try:
                asyncio.run_coroutine_threadsafe(fail(), state["loop"]).result(timeout)
            except (concurrent.futures.TimeoutError, RuntimeError):  # the loop is stuck or closed: reload all the same
                pass

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
