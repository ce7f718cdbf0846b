"""Chat templates: a tokenizer's own Jinja template turning messages into the prompt text its model was tuned on.

    template = ChatTemplate.of(tokenizer_dir)              # raises NoChatTemplate where the tokenizer has none
    text = template.render([{"role": "user", "content": "Hi"}])   # the assistant's turn opened at the end

Rendered as transformers renders it (`apply_chat_template`): a sandboxed Jinja environment with trim_blocks and
lstrip_blocks, loop controls, the `tojson` filter, `raise_exception` and `strftime_now`, `{% generation %}` blocks
rendered as their body, and the tokenizer's special tokens (`bos_token`, `eos_token`, ...) as variables. The text it
gives is encoded without adding special tokens (the template writes them). The template is read from the tokenizer
directory's `chat_template.jinja` (what transformers 5 saves), else `chat_template.json`, else the `chat_template`
key of `tokenizer_config.json` (a string, or named templates of which "default" is used); or from a file of the
caller's (`specrt serve --chat-template`, as vLLM's flag).

One home for chat: the runtime's `Pipeline.chat`, `specrt generate --chat`, the OpenAI-compatible server, the chat
prompts of the benches and of the draft's teacher corpus all render through it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from specrt.errors import InvalidRequestError, SpecrtError

ROLES = ("system", "user", "assistant", "tool", "developer")


class NoChatTemplate(SpecrtError):
    """The tokenizer has no chat template (and none was given)."""


def _source(tokenizer_dir: Path) -> tuple[str, str] | None:
    """(template, where it came from) of a tokenizer directory, or None."""
    jinja = tokenizer_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), str(jinja)
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = tokenizer_dir / name
        if not path.is_file():
            continue
        value = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(value, list):  # named templates: [{"name": ..., "template": ...}]
            value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
        if isinstance(value, str) and value.strip():
            return value, f"{path} (chat_template)"
    return None


def _special_tokens(tokenizer_dir: Path) -> dict[str, str]:
    """bos_token, eos_token, ... of tokenizer_config.json (strings, or AddedToken dicts with "content")."""
    path = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    out = {}
    for key, value in config.items():
        if key.endswith("_token"):
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                out[key] = value
    return out


def _environment():
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (marks the assistant's tokens for training masks): its body."""
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return nodes.Scope(parser.parse_statements(("name:endgeneration",), drop_needle=True))

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def check_messages(messages) -> list[dict]:
    """The messages as the template reads them: dicts of a known role and text content (a string, or a list of
    {"type": "text", "text": ...} parts, joined). Raises InvalidRequestError naming what is wrong."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {\"role\": ..., \"content\": ...}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise InvalidRequestError(f"messages[{i}] must have a role, one of {', '.join(ROLES)}; got "
                                      f"{m.get('role') if isinstance(m, dict) else m!r}")
        content = m.get("content")
        if isinstance(content, list):
            kinds = {p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content}
            if kinds - {"text"}:
                raise InvalidRequestError(f"messages[{i}].content: only text parts are supported, got "
                                          f"{', '.join(sorted(map(str, kinds - {'text'})))}")
            content = "".join(p.get("text", "") for p in content)
        if content is None and m["role"] == "assistant":
            content = ""
        if not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        out.append({**m, "content": content})
    return out


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # the Jinja template
    origin: str  # where it was read from
    special: dict = field(default_factory=dict)  # bos_token, eos_token, ... as the template reads them

    @classmethod
    def of(cls, tokenizer_dir, template: Path | None = None) -> "ChatTemplate":
        """The template of a tokenizer directory, or of the file `template` (with the directory's special tokens)."""
        tokenizer_dir = Path(tokenizer_dir)
        if template is not None:
            found = (Path(template).read_text(encoding="utf-8"), str(template))
        else:
            found = _source(tokenizer_dir)
        if found is None:
            raise NoChatTemplate(f"the tokenizer in {tokenizer_dir} has no chat template (no chat_template.jinja, and "
                                 "none in tokenizer_config.json): it is not a chat model's tokenizer")
        return cls(found[0], found[1], _special_tokens(tokenizer_dir))

    def render(self, messages, add_generation_prompt: bool = True, **variables) -> str:
        """The prompt text of a conversation; the assistant's turn opened after it (add_generation_prompt)."""
        from jinja2.exceptions import TemplateError

        messages = check_messages(messages)
        try:
            compiled = _compiled(self.source)
            return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **{**self.special, "tools": None, "documents": None, **variables})
        except TemplateError as e:
            raise InvalidRequestError(f"the chat template refused the messages: {e}") from None


_CACHE: dict[str, object] = {}


def _compiled(source: str):
    """The template compiled once per source (compiling costs milliseconds; rendering microseconds)."""
    compiled = _CACHE.get(source)
    if compiled is None:
        compiled = _CACHE[source] = _environment().from_string(source)
    return compiled
