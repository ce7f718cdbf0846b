"""The OpenAI API's side of `specrt serve --openai-port`: requests read and checked, stop strings, and the objects
answered (serving/openai_server.py runs them through the Triton-served decode loop).

    req = read_request(body, chat=False, model="specrt")     # raises ApiError (an OpenAI error object, 4xx)
    req.inputs                                                 # the decode-loop model's inputs (bar PROMPT)
    stop = StopText(req.stop)
    stop.add(piece) -> text that may go out now; stop.hit: the stop string met (the text is cut before it)

Requests follow the OpenAI API reference (Completions and Chat Completions): `model`, `prompt` or `messages`,
`max_tokens` (chat: or `max_completion_tokens`), `temperature` (default 1, as OpenAI's), `top_p`, `seed`, `stop`
(a string or up to 4), `n` (1 only), `stream` and `stream_options.include_usage`; and one extension, `method` (any
of specrt's methods; the server's default otherwise) and `return_token_ids` (each choice also carries its tokens' ids, as
vLLM's extension of that name). Fields that would change what is answered in ways specrt does
not do (logprobs, echo, best_of, suffix, logit_bias, penalties, tools, a response_format other than text) are
refused by name rather than ignored; fields that do not change the answer (user, metadata, store, ...) are ignored,
as vLLM does. Answers carry `usage` and, as an extension that OpenAI's clients ignore, `speculation`: the method,
the target's decode steps and the tokens each gave.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

MAX_STOPS = 4  # OpenAI's limit
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat's default is the served model's (128)
# fields refused unless at the value that changes nothing: name -> that value (a callable where several do)
UNSUPPORTED = {"echo": lambda v: v in (None, False), "logprobs": lambda v: v in (None, False, 0),
               "top_logprobs": lambda v: v in (None, 0), "best_of": lambda v: v in (None, 1),
               "suffix": lambda v: v in (None, ""), "logit_bias": lambda v: not v,
               "presence_penalty": lambda v: v in (None, 0), "frequency_penalty": lambda v: v in (None, 0),
               "tools": lambda v: not v, "functions": lambda v: not v, "tool_choice": lambda v: v in (None, "none"),
               "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text")}
# a served input named in a refusal -> the request field it came from
FIELD_OF_INPUT = {"PROMPT": "prompt", "MAX_NEW_TOKENS": "max_tokens", "METHOD": "method", "TEMPERATURE": "temperature",
                  "TOP_P": "top_p", "SEED": "seed"}
FINISH = {"eos": "stop", "length": "length", "cancelled": "stop"}
# what Triton answers while the decode-loop model's stub is dead, or the model is being reloaded (serve.Revive)
UNAVAILABLE = ("is not healthy", "has no available versions", "Model version not ready")


class ApiError(Exception):
    """An OpenAI error object: {"error": {"message", "type", "param", "code"}} with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param)


@dataclass(frozen=True)
class ApiRequest:
    chat: bool
    model: str
    prompt: str | None  # completions: the prompt text
    messages: list | None  # chat: the conversation (rendered through the chat template by the server)
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    method: str | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool = False  # an extension (vLLM's name): each choice also carries its tokens' ids
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def inputs(self) -> dict:
        """The decode-loop model's inputs, PROMPT aside (the server sets it)."""
        out = {"TEMPERATURE": self.temperature, "TOP_P": self.top_p}
        for name, value in (("MAX_NEW_TOKENS", self.max_tokens), ("SEED", self.seed), ("METHOD", self.method)):
            if value is not None:
                out[name] = value
        return out


def _number(body: dict, name: str, default, low: float, high: float, integer: bool = False, open_low: bool = False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise bad(name, f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if value < low or value > high or (open_low and value == low):
        raise bad(name, f"{name} must be in {'(' if open_low else '['}{low}, {high}], got {value!r}")
    return value


def read_request(body, chat: bool, model: str) -> ApiRequest:
    """A request body (parsed JSON) of /v1/chat/completions (chat) or /v1/completions, checked field by field."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    if not isinstance(body.get("model"), str):
        raise bad("model", "model is required: a string (GET /v1/models lists the one served)")
    if body["model"] != model:
        raise ApiError(404, f"the model {body['model']!r} does not exist: this server serves {model!r}", "model",
                       "model_not_found")
    for name, default in UNSUPPORTED.items():
        if name in body and not default(body[name]):
            raise bad(name, f"{name} is not supported by this server (specrt serves text, one choice, no "
                            f"logprobs), got {body[name]!r}")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise bad("n", f"n must be 1 (one choice per request), got {n!r}")
    prompt = messages = None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad("messages", "messages must be a non-empty list of {\"role\": ..., \"content\": ...}")
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            what = ("a list of prompts" if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) else
                    "token ids" if isinstance(prompt, list) else repr(prompt))
            raise bad("prompt", f"prompt must be one string (one prompt per request), got {what}")
        limit, name = body.get("max_tokens", COMPLETION_MAX_TOKENS), "max_tokens"
    max_tokens = _number({name: limit}, name, None, 1, 2**31 - 1, integer=True)
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else () if stop is None else None
    if stops is None or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", f"stop must be a non-empty string or a list of up to {MAX_STOPS}, got {stop!r}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", f"stream must be true or false, got {stream!r}")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise bad("stream_options", "stream_options is an object, and only with stream: true")
    method = body.get("method")
    if method is not None and not isinstance(method, str):
        raise bad("method", f"method must be a string (one of specrt's methods), got {method!r}")
    token_ids = body.get("return_token_ids", False)
    if not isinstance(token_ids, bool):
        raise bad("return_token_ids", f"return_token_ids must be true or false, got {token_ids!r}")
    return ApiRequest(chat, model, prompt, messages, max_tokens,
                      float(_number(body, "temperature", 1.0, 0, 2)), float(_number(body, "top_p", 1.0, 0, 1, open_low=True)),
                      _number(body, "seed", None, -(2**63), 2**63 - 1, integer=True), method, stops, stream,
                      bool((options or {}).get("include_usage", False)), token_ids)


def served_error(message: str, chat: bool) -> ApiError:
    """What the decode loop answered instead of text, as an OpenAI error: the request's fault (naming its field) where
    the loop named an input, else the server's."""
    names = message.split(":", 1)[0].replace(" ", "").split(",") if ":" in message else []
    fields = [FIELD_OF_INPUT[n] for n in names if n in FIELD_OF_INPUT]
    if not fields:
        first = message.split(" ", 1)[0]
        fields = [FIELD_OF_INPUT[first]] if first in FIELD_OF_INPUT else []
    if not fields and any(s in message for s in UNAVAILABLE):
        return ApiError(503, f"the model is not available now (its process died and is being reloaded): {message}",
                        kind="server_error")
    if not fields:
        return ApiError(500, f"the model failed: {message}", kind="server_error")
    param = ",".join("messages" if chat and f == "prompt" else f for f in fields)
    return bad(param, message)


class StopText:
    """A completion's text as it comes, cut where a stop string first appears (across pieces too); what may go out
    holds back a tail that could still begin one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.text, self.sent, self.hit, self.cut = stops, "", 0, None, None

    def add(self, piece: str, final: bool = False) -> str:
        """Take a piece; return the text that may be sent now (all of it once `final`)."""
        if self.hit is None and piece:
            start = max(0, len(self.text) - max((len(s) for s in self.stops), default=1) + 1)
            self.text += piece
            found = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
            if found:
                self.cut, self.hit = min(found)
                self.text = self.text[: self.cut]
        hold = 0 if (final or self.hit is not None) else max(
            (k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        out = self.text[self.sent: len(self.text) - hold]
        self.sent += len(out)
        return out


def tokens_through(decode, ids: list[int], end: int) -> int:
    """The fewest of `ids` whose text reaches `end` characters (binary search: a prefix's text only grows)."""
    low, high = 0, len(ids)
    while low < high:
        mid = (low + high) // 2
        if len(decode(ids[:mid])) >= end:
            high = mid
        else:
            low = mid + 1
    return low


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def speculation(method: str, generated: int, steps: int) -> dict:
    return {"method": method, "target_steps": steps,
            "tokens_per_target_call": round(generated / steps, 3) if steps else None}


def choice(req: ApiRequest, text: str | None, finish: str | None, delta: bool = False, first: bool = False,
           token_ids: list[int] | None = None) -> dict:
    """One choice of an answer (delta: of a streamed chunk); with return_token_ids, the ids of its tokens."""
    if not req.chat:
        out = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    elif not delta:
        out = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}
    else:
        content = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        out = {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish}
    if req.return_token_ids and not first:
        out["token_ids"] = list(token_ids or [])
    return out


def answer(req: ApiRequest, choices: list, chunk: bool = False, **extra) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if req.chat else "text_completion"
    return {"id": ("chatcmpl-" if req.chat else "cmpl-") + req.id, "object": kind, "created": req.created,
            "model": req.model, "choices": choices, **extra}
