"""Render OpenAI `messages` into a prompt with the model's own jinja2 chat template (sandboxed).

`render_pieces` also says which parts of the prompt the template wrote (markup: its control tokens
count) and which a client wrote (message content and names: plain text, whatever they contain).
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger("edged.models")

# Used when the model ships no template: ChatML, what most instruct models and OpenAI servers assume.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Message keys passed through to the template besides role and content (tool calling).
_EXTRA_KEYS = ("name", "tool_calls", "tool_call_id")
# Client strings that render_pieces replaces by a marker to find where the template puts them.
_CLIENT_KEYS = ("content", "name")
_MARKER = re.compile("\ue000([0-9]+)\ue001")  # private-use code points: no template writes them


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which templates do not expect
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    # The same settings as transformers' apply_chat_template, so templates render identically.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@dataclass
class ChatTemplate:
    """A compiled chat template and the special tokens it may reference."""

    source: str | None = None  # None: the model has none, ChatML is used
    bos_token: str | None = None
    eos_token: str | None = None
    _compiled: jinja2.Template = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.source:
            log.info("the model has no chat template; using ChatML")
            self.source = CHATML_TEMPLATE
        try:
            self._compiled = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the model's chat template does not compile: {e}") from e

    def __reduce__(self) -> tuple:
        # Sent to worker processes: the source travels, each process compiles its own template.
        return (ChatTemplate, (self.source, self.bos_token, self.eos_token))

    @property
    def is_fallback(self) -> bool:
        return self.source == CHATML_TEMPLATE

    def render(self, messages: Any, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text for OpenAI-style messages; ValueError for malformed messages."""
        try:
            return self._compiled.render(messages=normalize_messages(messages),
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        # a template indexing past the messages or adding mismatched types fails on the input, not the server
        except (jinja2.exceptions.TemplateError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise ValueError(f"chat template rejected the messages: {e}") from e

    def render_pieces(self, messages: Any, special: re.Pattern[str] | None = None,
                      add_generation_prompt: bool = True) -> list[tuple[str, bool]]:
        """The prompt as (text, is_markup) pieces, which join to exactly `render(messages)`: the
        template's own text is markup, the clients' strings are not.

        The template is rendered a second time with each client string replaced by a marker; the
        text between markers is the template's. A template that rewrites client strings beyond
        trimming them cannot be split so: its prompt is one markup piece, refused (ValueError) if a
        client string contains a match of `special` (a special token's text) that would then count.
        """
        clean = normalize_messages(messages)
        text = self.render(clean, add_generation_prompt)
        values: list[str] = []

        def mark(value: Any) -> Any:
            if not isinstance(value, str) or not value:
                return value
            values.append(value)
            return f"\ue000{len(values) - 1}\ue001"

        marked = [{k: mark(v) if k in _CLIENT_KEYS else v for k, v in m.items()} for m in clean]
        parts = _MARKER.split(self.render(marked, add_generation_prompt))
        for client_text in (str, str.strip):  # as given, or trimmed by the template (Llama 3: `| trim`)
            pieces = [(part, True) if i % 2 == 0 else (client_text(values[int(part)]), False)
                      for i, part in enumerate(parts)]
            if "".join(piece for piece, _ in pieces) == text:
                return [p for p in pieces if p[0]]
        if special is not None and any(special.search(v) for v in values):
            raise ValueError("a message contains special-token text (such as a chat control token), which this "
                             "model's chat template cannot keep as plain text")
        return [(text, True)]


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate messages and flatten content parts to one string per message."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string")
        clean = {"role": role, "content": _content_text(message.get("content"), i)}
        clean.update({k: message[k] for k in _EXTRA_KEYS if message.get(k) is not None})
        out.append(clean)
    return out


def _content_text(content: Any, i: int) -> str:
    if content is None:  # an assistant message that only carries tool_calls
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"messages[{i}].content must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"messages[{i}].content[{j}] must be {{\"type\": \"text\", \"text\": <string>}}; "
                             "only text parts are supported")
        texts.append(part["text"])
    return "\n".join(texts)  # how vLLM joins text parts


def pick_template(value: str | list[dict[str, str]] | None) -> str | None:
    """A template from tokenizer_config.json / GGUF metadata: a string, or a list of named ones."""
    if value is None or isinstance(value, str):
        return value or None
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    return named.get("default") or next(iter(named.values()), None)
