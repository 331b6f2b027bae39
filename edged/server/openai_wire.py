"""OpenAI wire format: parse and validate request bodies, build responses, SSE chunks and msgpack frames.

Pure functions, no I/O: the routes call them, the tests read them as the specification.
Every validation failure raises `WireError`, which carries the HTTP status and the
OpenAI-style error body `{"error": {"message", "type", "param", "code"}}`.
"""
from __future__ import annotations

import json
import math
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack

from edged.engine.request import GenerationRequest, SamplingParams

MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 64
INT64_MAX = 2**63 - 1  # seeds and top_k are packed into int64 tensors
SHOWN_CHARS = 40  # a client's value echoed in an error message is cut to this
MAX_TIER_LEN = 64
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
SSE_DONE = b"data: [DONE]\n\n"
MSGPACK_CONTENT_TYPES = ("application/x-msgpack", "application/msgpack", "application/vnd.msgpack")


class WireError(Exception):
    """A request the server refuses; `status` is the HTTP status, `body()` the JSON error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str = "invalid_request_error",
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type
        self.headers = headers or []

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> WireError:
    return WireError(400, message, param=param, code=code)


# ---------------------------------------------------------------- parsing


@dataclass(slots=True)
class ParsedRequest:
    """A validated `/v1/chat/completions` or `/v1/completions` body, before tokenization."""

    kind: Literal["chat", "completion"]
    model: str | None = None
    messages: list[dict[str, str]] | None = None  # chat: normalized {"role", "content"[, "name"]}
    prompt: str | list[int] | None = None  # completion: text, or token ids
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None  # None: not given, the server picks what fits
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # The sampling fields the body set (temperature, top_p, top_k): the others take the model's
    # defaults in make_generation_request. null counts as not set, as with OpenAI.
    sampling_given: set[str] = field(default_factory=set)
    tier: str | None = None


def decode_json_body(body: bytes) -> dict[str, Any]:
    """Bytes -> JSON object. Invalid UTF-8, invalid JSON, NaN/Infinity and non-objects are 400s."""
    if not body:
        raise _bad("The request body is empty; expected a JSON object.", code="invalid_json")
    try:
        text = body.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise _bad(f"The request body is not valid UTF-8 (byte {e.start}).", code="invalid_encoding") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except _NonFiniteNumber as e:
        raise _bad(f"The request body is not valid JSON: {e} is not a JSON number.", code="invalid_json") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, int too long, nesting too deep
        raise _bad(f"The request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise _bad("The request body must be a JSON object.", code="invalid_json")
    return obj


class _NonFiniteNumber(ValueError):
    pass


def _reject_constant(name: str) -> Any:
    raise _NonFiniteNumber(name)


def parse_chat_request(body: bytes) -> ParsedRequest:
    obj = decode_json_body(body)
    p = ParsedRequest(kind="chat")
    p.messages = _messages(obj.get("messages", _MISSING))
    _common(obj, p, max_tokens_keys=("max_completion_tokens", "max_tokens"))
    for key in ("tools", "functions"):
        if obj.get(key):
            raise WireError(400, f"'{key}' is not supported by this server.", param=key, code="unsupported_parameter")
    rf = obj.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise _bad("'response_format' must be an object.", "response_format", "invalid_type")
        if rf.get("type", "text") != "text":
            raise WireError(400, "Only response_format type 'text' is supported.", param="response_format",
                            code="unsupported_parameter")
    if obj.get("logprobs") not in (None, False):
        raise WireError(400, "'logprobs' is not supported by this server.", param="logprobs",
                        code="unsupported_parameter")
    return p


def parse_completion_request(body: bytes) -> ParsedRequest:
    obj = decode_json_body(body)
    p = ParsedRequest(kind="completion")
    p.prompt = _prompt(obj.get("prompt", _MISSING))
    _common(obj, p, max_tokens_keys=("max_tokens",))
    if obj.get("echo") not in (None, False):
        raise WireError(400, "'echo' is not supported by this server.", param="echo", code="unsupported_parameter")
    if obj.get("suffix") not in (None, ""):
        raise WireError(400, "'suffix' is not supported by this server.", param="suffix", code="unsupported_parameter")
    if obj.get("logprobs") is not None:
        raise WireError(400, "'logprobs' is not supported by this server.", param="logprobs",
                        code="unsupported_parameter")
    best_of = obj.get("best_of")
    if best_of is not None and best_of != 1:
        raise WireError(400, "'best_of' must be 1: this server returns one choice.", param="best_of",
                        code="unsupported_value")
    return p


_MISSING: Any = object()


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise _bad(f"'{param}' must be a string, got {_json_type(value)}.", param, "invalid_type")
    _check_encodable(value, param)
    return value


def _check_encodable(value: str, param: str) -> None:
    # JSON escapes can smuggle lone surrogates ("\ud800") that no tokenizer accepts.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(f"'{param}' contains an invalid Unicode escape (lone surrogate).", param,
                   "invalid_encoding") from None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _messages(value: Any) -> list[dict[str, str]]:
    if value is _MISSING or value is None:
        raise _bad("'messages' is a required property.", "messages", "missing_required_parameter")
    if not isinstance(value, list):
        raise _bad(f"'messages' must be an array, got {_json_type(value)}.", "messages", "invalid_type")
    if not value:
        raise _bad("'messages' must contain at least one message.", "messages", "invalid_value")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"'{where}' must be an object, got {_json_type(m)}.", where, "invalid_type")
        role = m.get("role", _MISSING)
        if role is _MISSING:
            raise _bad(f"'{where}.role' is a required property.", f"{where}.role", "missing_required_parameter")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise _bad(f"'{where}.role' must be one of {sorted(CHAT_ROLES)}.", f"{where}.role", "invalid_value")
        msg = {"role": role, "content": _content(m.get("content", _MISSING), role, f"{where}.content")}
        name = m.get("name")
        if name is not None:
            msg["name"] = _text(name, f"{where}.name")
        out.append(msg)
    return out


def _content(value: Any, role: str, param: str) -> str:
    if value is _MISSING or value is None:
        if role == "assistant":  # an assistant turn that only made tool calls
            return ""
        raise _bad(f"'{param}' is a required property.", param, "missing_required_parameter")
    if isinstance(value, str):
        return _text(value, param)
    if not isinstance(value, list):
        raise _bad(f"'{param}' must be a string or an array of content parts, got {_json_type(value)}.", param,
                   "invalid_type")
    texts = []
    for j, part in enumerate(value):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _bad(f"'{where}' must be an object, got {_json_type(part)}.", where, "invalid_type")
        kind = part.get("type")
        if kind == "text":
            texts.append(_text(part.get("text"), f"{where}.text"))
        elif kind in ("image_url", "image", "input_image", "input_audio", "audio", "file", "video_url"):
            raise WireError(400, f"'{where}': content type '{kind}' is not supported; this model reads text only.",
                            param=f"{where}.type", code="unsupported_value")
        else:
            raise _bad(f"'{where}.type' must be 'text'.", f"{where}.type", "invalid_value")
    # vLLM joins text parts with newlines; do the same so templates see one string.
    return "\n".join(texts)


def _prompt(value: Any) -> str | list[int]:
    if value is _MISSING or value is None:
        raise _bad("'prompt' is a required property.", "prompt", "missing_required_parameter")
    if isinstance(value, str):
        return _text(value, "prompt")
    if not isinstance(value, list):
        raise _bad(f"'prompt' must be a string, an array of token ids or an array of one string, got "
                   f"{_json_type(value)}.", "prompt", "invalid_type")
    if not value:
        raise _bad("'prompt' must not be an empty array.", "prompt", "invalid_value")
    if all(_is_int(t) for t in value):
        return _token_ids(value, "prompt")
    if len(value) > 1:
        raise WireError(400, "Batched prompts are not supported: send one prompt per request.", param="prompt",
                        code="unsupported_value")
    only = value[0]
    if isinstance(only, str):
        return _text(only, "prompt[0]")
    if isinstance(only, list) and only and all(_is_int(t) for t in only):
        return _token_ids(only, "prompt[0]")
    raise _bad("'prompt' must be a string, an array of token ids or an array of one string.", "prompt",
               "invalid_type")


def _token_ids(value: list[int], param: str) -> list[int]:
    # The vocabulary bound is checked in make_generation_request, which knows the model.
    if any(t < 0 or t >= 1 << 31 for t in value):
        raise _bad(f"'{param}' token ids must be non-negative integers below 2^31.", param, "invalid_value")
    return list(value)


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """A client's value for an error message or a log line, cut so that echoing it costs nothing."""
    text = str(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _number(obj: dict, key: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(f"'{key}' must be a number, got {_json_type(v)}.", key, "invalid_type")
    if not _is_number(v):  # 1e999 parses as infinity
        raise _bad(f"'{key}' must be a finite number, got {shown(v)}.", key, "invalid_value")
    if v < lo or v > hi or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise _bad(f"'{key}' must be in {left}{lo:g}, {hi:g}], got {shown(v)}.", key, "invalid_value")
    return float(v)


def _int(obj: dict, key: str) -> int | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer() and abs(v) < 2**53:  # 16.0 from loosely typed clients
        v = int(v)
    if not _is_int(v):
        raise _bad(f"'{key}' must be an integer, got {_json_type(v)}.", key, "invalid_type")
    return v


def _int_in(obj: dict, key: str, lo: int, hi: int, hint: str = "") -> int | None:
    """An optional integer within lo..hi (both included); 400 naming the key otherwise."""
    v = _int(obj, key)
    if v is not None and not lo <= v <= hi:
        raise _bad(f"'{key}' must be in {lo}..{hi}{hint}, got {shown(v)}.", key, "invalid_value")
    return v


def _bool(obj: dict, key: str) -> bool:
    v = obj.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(f"'{key}' must be a boolean, got {_json_type(v)}.", key, "invalid_type")
    return v


def _common(obj: dict, p: ParsedRequest, max_tokens_keys: tuple[str, ...]) -> None:
    """Fields shared by chat and completions."""
    model = obj.get("model")
    if model is not None:
        p.model = _text(model, "model")

    p.stream = _bool(obj, "stream")
    so = obj.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad(f"'stream_options' must be an object, got {_json_type(so)}.", "stream_options", "invalid_type")
        p.include_usage = _bool(so, "include_usage")

    n = _int(obj, "n")
    if n is not None and n != 1:
        raise WireError(400, f"'n' must be 1: this server returns one choice per request, got {shown(n)}.",
                        param="n", code="unsupported_value")

    for key in max_tokens_keys:
        mt = _int(obj, key)
        if mt is None:
            continue
        if mt < 1:
            raise _bad(f"'{key}' must be at least 1, got {shown(mt)}.", key, "invalid_value")
        p.max_tokens = mt
        break

    s = p.sampling
    t = _number(obj, "temperature", 0.0, 2.0)
    if t is not None:
        s.temperature = t
        p.sampling_given.add("temperature")
    tp = _number(obj, "top_p", 0.0, 1.0, lo_open=True)
    if tp is not None:
        s.top_p = tp
        p.sampling_given.add("top_p")
    # Values above the vocabulary are clamped to it in make_generation_request.
    tk = _int_in(obj, "top_k", -1, INT64_MAX, " (0 or -1: off)")
    if tk is not None:
        s.top_k = max(tk, 0)
        p.sampling_given.add("top_k")
    s.seed = _int_in(obj, "seed", 0, INT64_MAX)
    s.stop = _stop(obj.get("stop"))
    sti = obj.get("stop_token_ids")  # vLLM extension
    if sti is not None:
        if not isinstance(sti, list) or not all(_is_int(t) and 0 <= t < 1 << 31 for t in sti):
            raise _bad("'stop_token_ids' must be an array of non-negative integers below 2^31.", "stop_token_ids",
                       "invalid_type")
        if len(sti) > MAX_STOP_TOKEN_IDS:
            raise _bad(f"'stop_token_ids' accepts at most {MAX_STOP_TOKEN_IDS} ids, got {len(sti)}.",
                       "stop_token_ids", "invalid_value")
        s.stop_token_ids = list(sti)
    s.ignore_eos = _bool(obj, "ignore_eos")  # vLLM extension

    for key in ("frequency_penalty", "presence_penalty"):
        v = _number(obj, key, -2.0, 2.0)
        if v:  # 0 and null are what every client sends by default
            raise WireError(400, f"'{key}' is not supported by this server (only 0).", param=key,
                            code="unsupported_parameter")
    if obj.get("logit_bias"):
        raise WireError(400, "'logit_bias' is not supported by this server.", param="logit_bias",
                        code="unsupported_parameter")

    tier = obj.get("tier")
    if tier is not None:
        p.tier = check_tier(tier, "tier")


def check_tier(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_TIER_LEN or not value.replace("-", "").replace(
            "_", "").isalnum() or not value.isascii():
        raise _bad(f"'{param}' must be a tier name (letters, digits, '-', '_').", param, "invalid_value")
    return value


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [_text(value, "stop")] if value else []
    if not isinstance(value, list):
        raise _bad(f"'stop' must be a string or an array of strings, got {_json_type(value)}.", "stop", "invalid_type")
    if len(value) > MAX_STOP_STRINGS:
        raise _bad(f"'stop' accepts at most {MAX_STOP_STRINGS} strings, got {len(value)}.", "stop", "invalid_value")
    out = []
    for i, s in enumerate(value):
        s = _text(s, f"stop[{i}]")
        if not s:
            raise _bad(f"'stop[{i}]' must not be empty.", f"stop[{i}]", "invalid_value")
        out.append(s)
    return out


def check_model(p: ParsedRequest, model_id: str) -> None:
    """A request may name our model or no model; any other name is a 404, as OpenAI does."""
    if p.model is not None and p.model != model_id:
        raise WireError(404, f"The model '{p.model}' does not exist; this server serves '{model_id}'.",
                        param="model", code="model_not_found")


def make_generation_request(
    p: ParsedRequest,
    prompt_token_ids: list[int],
    request_id: str,
    tier: str,
    max_model_len: int,
    default_max_tokens: int,
    max_tokens_limit: int | None = None,
    max_prompt_tokens: int | None = None,
    vocab_size: int | None = None,
    sampling_defaults: Mapping[str, float | int] | None = None,
) -> GenerationRequest:
    """Check the prompt against the context and the vocabulary, settle max_tokens, and fill the
    sampling fields the request left out from the model's `sampling_defaults` (temperature, top_p,
    top_k, max_tokens; a key absent there: SamplingParams' default, and `default_max_tokens`).

    Prompt >= context (or > max_prompt_tokens): 400 context_length_exceeded.
    A token id (prompt or stop_token_ids) outside the vocabulary: 400 naming the field; top_k above
    the vocabulary size is clamped to it (the same result: every token is a candidate).
    An explicit max_tokens over max_tokens_limit: 400; one that does not fit the context: 400 (as OpenAI).
    No max_tokens: min(the model's default or else default_max_tokens, limit, room left).
    """
    defaults = sampling_defaults or {}
    default_max_tokens = int(defaults.get("max_tokens", default_max_tokens))
    n = len(prompt_token_ids)
    what = "messages" if p.kind == "chat" else "prompt"
    if n == 0:
        raise _bad(f"The {what} rendered to zero tokens.", what, "invalid_value")
    if vocab_size is not None:
        _check_vocab(prompt_token_ids, vocab_size, what)
        _check_vocab(p.sampling.stop_token_ids, vocab_size, "stop_token_ids")
    if n >= max_model_len:
        raise WireError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your {what} resulted in "
            f"{n} tokens. Please reduce the length of the {what}.",
            param=what, code="context_length_exceeded")
    if max_prompt_tokens is not None and n > max_prompt_tokens:
        raise WireError(
            400, f"This server accepts prompts of at most {max_prompt_tokens} tokens. However, your {what} "
                 f"resulted in {n} tokens. Please reduce the length of the {what}.",
            param=what, code="context_length_exceeded")
    room = max_model_len - n
    if p.max_tokens is not None:
        if max_tokens_limit is not None and p.max_tokens > max_tokens_limit:
            raise _bad(f"'max_tokens' must be at most {max_tokens_limit} on this server, got {shown(p.max_tokens)}.",
                       "max_tokens", "invalid_value")
        if p.max_tokens > room:
            raise WireError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{shown(n + p.max_tokens)} tokens ({n} in the {what}, {shown(p.max_tokens)} in the completion). "
                f"Please reduce the length of the {what} or completion.",
                param="max_tokens", code="context_length_exceeded")
        max_tokens = p.max_tokens
    else:
        max_tokens = min(default_max_tokens, room)
        if max_tokens_limit is not None:
            max_tokens = min(max_tokens, max_tokens_limit)
        max_tokens = max(1, max_tokens)
    s = p.sampling
    given = p.sampling_given
    temperature = s.temperature if "temperature" in given else float(defaults.get("temperature", s.temperature))
    top_p = s.top_p if "top_p" in given else float(defaults.get("top_p", s.top_p))
    top_k = s.top_k if "top_k" in given else int(defaults.get("top_k", s.top_k))
    top_k = min(top_k, vocab_size) if vocab_size is not None else top_k
    sampling = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, seed=s.seed, max_tokens=max_tokens,
        stop=list(s.stop), stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos)
    return GenerationRequest(request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling=sampling,
                             tier=tier)


def _check_vocab(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise _bad(f"'{param}' contains token id {bad}, outside this model's vocabulary (0..{vocab_size - 1}).",
                   param, "invalid_value")


# ---------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_id(kind: str, request_id: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id


def completion_response(kind: str, rid: str, created: int, model: str, text: str, finish_reason: str | None,
                        prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The non-streaming body of either endpoint."""
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens)}


def stream_chunk(kind: str, rid: str, created: int, model: str, *, text: str | None = None, role: bool = False,
                 finish_reason: str | None = None, include_usage: bool = False) -> dict[str, Any]:
    """One streamed chunk, shaped as OpenAI's (`usage: null` on every chunk when usage was asked for)."""
    if kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = text or ""
        elif text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(kind: str, rid: str, created: int, model: str, prompt_tokens: int,
                completion_tokens: int) -> dict[str, Any]:
    """The final chunk of `stream_options.include_usage`: no choices, the usage."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def models_response(model_id: str, created: int, max_model_len: int,
                    sampling_defaults: Mapping[str, float | int] | None = None) -> dict[str, Any]:
    return {"object": "list", "data": [model_object(model_id, created, max_model_len, sampling_defaults)]}


def model_object(model_id: str, created: int, max_model_len: int,
                 sampling_defaults: Mapping[str, float | int] | None = None) -> dict[str, Any]:
    """The model; `sampling_defaults` (an edged extension, as vLLM's `max_model_len` is one): what a
    request that omits those fields gets (effective_sampling_defaults)."""
    obj: dict[str, Any] = {"id": model_id, "object": "model", "created": created, "owned_by": "edged",
                           "max_model_len": max_model_len}
    if sampling_defaults is not None:
        obj["sampling_defaults"] = dict(sampling_defaults)
    return obj


def effective_sampling_defaults(sampling_defaults: Mapping[str, float | int] | None, default_max_tokens: int,
                                max_tokens_limit: int | None) -> dict[str, float | int]:
    """Every default a request without temperature / top_p / top_k / max_tokens gets, as
    make_generation_request settles them (max_tokens before the room left in the context and any
    tier cap)."""
    d = sampling_defaults or {}
    base = SamplingParams()
    max_tokens = int(d.get("max_tokens", default_max_tokens))
    if max_tokens_limit is not None:
        max_tokens = min(max_tokens, max_tokens_limit)
    return {"temperature": float(d.get("temperature", base.temperature)), "top_p": float(d.get("top_p", base.top_p)),
            "top_k": int(d.get("top_k", base.top_k)), "max_tokens": max_tokens}


def now() -> int:
    return int(time.time())


# ---------------------------------------------------------------- encodings


def json_bytes(obj: Any) -> bytes:
    # ensure_ascii=False: UTF-8 on the wire, like OpenAI; surrogates were rejected on input.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


def sse_event(obj: Any) -> bytes:
    return b"data: " + json_bytes(obj) + b"\n\n"


def msgpack_bytes(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def msgpack_frame(obj: Any) -> bytes:
    """4-byte big-endian length, then the msgpack of `obj`."""
    payload = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(payload)) + payload


MSGPACK_DONE = msgpack_frame({"done": True})


def decode_msgpack_frames(buf: bytes | bytearray) -> tuple[list[Any], bytes]:
    """Split a byte buffer into complete frames; return (objects, the incomplete rest)."""
    out = []
    view = memoryview(buf)
    pos = 0
    while len(view) - pos >= 4:
        (size,) = struct.unpack_from(">I", view, pos)
        if len(view) - pos - 4 < size:
            break
        out.append(msgpack.unpackb(view[pos + 4:pos + 4 + size], raw=False))
        pos += 4 + size
    return out, bytes(view[pos:])


def wants_msgpack(accept: str | None) -> bool:
    if not accept:
        return False
    accept = accept.lower()
    return any(ct in accept for ct in MSGPACK_CONTENT_TYPES)
