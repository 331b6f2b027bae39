"""The OpenAI wire format: what each bad body gets, how responses and chunks are shaped, msgpack framing."""
from __future__ import annotations

import json

import msgpack
import pytest

from edged.server import openai_wire as wire
from edged.server.openai_wire import WireError

MSGS = [{"role": "user", "content": "hi"}]


def chat(**kw):
    body = {"model": "m", "messages": MSGS}
    body.update(kw)
    return json.dumps(body).encode()


def refused(fn, body: bytes) -> WireError:
    with pytest.raises(WireError) as ei:
        fn(body)
    return ei.value


# ---- body decoding

@pytest.mark.parametrize("body, code", [
    (b"", "invalid_json"),
    (b"{", "invalid_json"),
    (b"[1, 2]", "invalid_json"),
    (b'"just a string"', "invalid_json"),
    (b"null", "invalid_json"),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "invalid_encoding"),
    (b'{"temperature": NaN, "messages": []}', "invalid_json"),
    (b'{"temperature": Infinity}', "invalid_json"),
    (b"[" * 100_000 + b"]" * 100_000, "invalid_json"),  # nesting too deep
    (b'{"max_tokens": ' + b"9" * 5000 + b"}", "invalid_json"),  # int too long to parse
])
def test_undecodable_bodies_are_400(body, code):
    e = refused(wire.parse_chat_request, body)
    assert (e.status, e.code) == (400, code)
    assert e.body()["error"]["type"] == "invalid_request_error"


def test_utf8_bom_is_accepted():
    p = wire.parse_chat_request(b"\xef\xbb\xbf" + chat())
    assert p.messages == MSGS


# ---- chat body validation

@pytest.mark.parametrize("body, param, code", [
    ({"model": "m"}, "messages", "missing_required_parameter"),
    ({"messages": None}, "messages", "missing_required_parameter"),
    ({"messages": "hi"}, "messages", "invalid_type"),
    ({"messages": {"role": "user"}}, "messages", "invalid_type"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"messages": ["hi"]}, "messages[0]", "invalid_type"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "missing_required_parameter"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": 3, "content": "hi"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": 42}]}, "messages[0].content", "invalid_type"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]", "invalid_type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages[0].content[0].text",
     "invalid_type"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type", "unsupported_value"),
    ({"messages": [{"role": "user", "content": [{"type": "weird"}]}]}, "messages[0].content[0].type",
     "invalid_value"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content", "invalid_encoding"),
    ({"messages": MSGS, "model": 7}, "model", "invalid_type"),
    ({"messages": MSGS, "stream": "yes"}, "stream", "invalid_type"),
    ({"messages": MSGS, "stream_options": []}, "stream_options", "invalid_type"),
    ({"messages": MSGS, "stream_options": {"include_usage": 1}}, "include_usage", "invalid_type"),
    ({"messages": MSGS, "temperature": "hot"}, "temperature", "invalid_type"),
    ({"messages": MSGS, "temperature": True}, "temperature", "invalid_type"),
    ({"messages": MSGS, "temperature": -0.1}, "temperature", "invalid_value"),
    ({"messages": MSGS, "temperature": 2.5}, "temperature", "invalid_value"),
    ({"messages": MSGS, "top_p": 0}, "top_p", "invalid_value"),
    ({"messages": MSGS, "top_p": 1.01}, "top_p", "invalid_value"),
    ({"messages": MSGS, "top_p": None, "top_k": -2}, "top_k", "invalid_value"),
    ({"messages": MSGS, "top_k": 1.5}, "top_k", "invalid_type"),
    ({"messages": MSGS, "seed": "42"}, "seed", "invalid_type"),
    ({"messages": MSGS, "seed": 2**70}, "seed", "invalid_value"),
    ({"messages": MSGS, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"messages": MSGS, "max_tokens": -5}, "max_tokens", "invalid_value"),
    ({"messages": MSGS, "max_tokens": "10"}, "max_tokens", "invalid_type"),
    ({"messages": MSGS, "max_tokens": 10.5}, "max_tokens", "invalid_type"),
    ({"messages": MSGS, "max_tokens": True}, "max_tokens", "invalid_type"),
    ({"messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
    ({"messages": MSGS, "n": 2}, "n", "unsupported_value"),
    ({"messages": MSGS, "n": "1"}, "n", "invalid_type"),
    ({"messages": MSGS, "stop": 5}, "stop", "invalid_type"),
    ({"messages": MSGS, "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"messages": MSGS, "stop": ["a", 1]}, "stop[1]", "invalid_type"),
    ({"messages": MSGS, "stop": ["a", ""]}, "stop[1]", "invalid_value"),
    ({"messages": MSGS, "stop_token_ids": [1, -1]}, "stop_token_ids", "invalid_type"),
    ({"messages": MSGS, "frequency_penalty": 0.5}, "frequency_penalty", "unsupported_parameter"),
    ({"messages": MSGS, "presence_penalty": 3}, "presence_penalty", "invalid_value"),
    ({"messages": MSGS, "logit_bias": {"1": 5}}, "logit_bias", "unsupported_parameter"),
    ({"messages": MSGS, "logprobs": True}, "logprobs", "unsupported_parameter"),
    ({"messages": MSGS, "tools": [{"type": "function"}]}, "tools", "unsupported_parameter"),
    ({"messages": MSGS, "response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter"),
    ({"messages": MSGS, "tier": "gold tier"}, "tier", "invalid_value"),
    ({"messages": MSGS, "tier": 1}, "tier", "invalid_value"),
    ({"messages": MSGS, "ignore_eos": "no"}, "ignore_eos", "invalid_type"),
])
def test_bad_chat_bodies_are_400_with_param_and_code(body, param, code):
    e = refused(wire.parse_chat_request, json.dumps(body).encode())
    assert e.status == 400
    assert (e.param, e.code) == (param, code), e.message
    err = e.body()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_chat_defaults_and_fields():
    p = wire.parse_chat_request(chat())
    assert p.kind == "chat" and p.model == "m" and not p.stream and p.max_tokens is None
    assert p.sampling.temperature == 1.0 and p.sampling.top_p == 1.0 and p.sampling.stop == []
    p = wire.parse_chat_request(chat(
        stream=True, stream_options={"include_usage": True}, max_tokens=16.0, temperature=0, top_p=0.5, top_k=-1,
        seed=7, stop="###", n=1, frequency_penalty=0, presence_penalty=None, tier="gold", user="u1",
        response_format={"type": "text"}, unknown_field={"ignored": True}))
    assert p.stream and p.include_usage and p.max_tokens == 16 and p.tier == "gold"
    s = p.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.stop) == (0.0, 0.5, 0, 7, ["###"])
    assert s.deterministic


def test_max_completion_tokens_wins_over_max_tokens():
    p = wire.parse_chat_request(chat(max_tokens=50, max_completion_tokens=10))
    assert p.max_tokens == 10


def test_model_is_optional():
    p = wire.parse_chat_request(json.dumps({"messages": MSGS}).encode())
    assert p.model is None
    wire.check_model(p, "anything")


def test_content_parts_are_joined_and_assistant_may_have_no_content():
    p = wire.parse_chat_request(chat(messages=[
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "user", "content": "q", "name": "bob"}]))
    assert p.messages == [{"role": "system", "content": "a\nb"}, {"role": "assistant", "content": ""},
                          {"role": "user", "content": "q", "name": "bob"}]


def test_unknown_model_is_404():
    p = wire.parse_chat_request(chat(model="gpt-4"))
    with pytest.raises(WireError) as ei:
        wire.check_model(p, "m")
    assert (ei.value.status, ei.value.code, ei.value.param) == (404, "model_not_found", "model")


# ---- completions

@pytest.mark.parametrize("body, param, code", [
    ({}, "prompt", "missing_required_parameter"),
    ({"prompt": 5}, "prompt", "invalid_type"),
    ({"prompt": []}, "prompt", "invalid_value"),
    ({"prompt": ["a", "b"]}, "prompt", "unsupported_value"),
    ({"prompt": [1, -3]}, "prompt", "invalid_value"),
    ({"prompt": [{"x": 1}]}, "prompt", "invalid_type"),
    ({"prompt": "x", "echo": True}, "echo", "unsupported_parameter"),
    ({"prompt": "x", "best_of": 3}, "best_of", "unsupported_value"),
    ({"prompt": "x", "logprobs": 2}, "logprobs", "unsupported_parameter"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "invalid_value"),
])
def test_bad_completion_bodies_are_400(body, param, code):
    e = refused(wire.parse_completion_request, json.dumps(body).encode())
    assert (e.status, e.param, e.code) == (400, param, code), e.message


@pytest.mark.parametrize("prompt, expected", [
    ("hello", "hello"), (["hello"], "hello"), ([1, 2, 3], [1, 2, 3]), ([[4, 5]], [4, 5])])
def test_completion_prompt_forms(prompt, expected):
    assert wire.parse_completion_request(json.dumps({"prompt": prompt}).encode()).prompt == expected


# ---- context length and max_tokens

def test_context_checks():
    p = wire.parse_chat_request(chat())
    # prompt fills the context: 400 context_length_exceeded
    e = refused(lambda _: wire.make_generation_request(p, [1] * 100, "r", "default", 100, 64), b"")
    assert (e.status, e.code, e.param) == (400, "context_length_exceeded", "messages")
    assert "100 tokens" in e.message
    # no max_tokens: min(default, room)
    g = wire.make_generation_request(p, [1] * 90, "r", "gold", 100, 64)
    assert g.sampling.max_tokens == 10 and g.tier == "gold" and g.request_id == "r"
    g = wire.make_generation_request(p, [1] * 10, "r", "default", 100, 64)
    assert g.sampling.max_tokens == 64
    # explicit max_tokens that does not fit: 400, as OpenAI
    p2 = wire.parse_chat_request(chat(max_tokens=11))
    e = refused(lambda _: wire.make_generation_request(p2, [1] * 90, "r", "default", 100, 64), b"")
    assert (e.code, e.param) == ("context_length_exceeded", "max_tokens")
    assert wire.make_generation_request(p2, [1] * 89, "r", "default", 100, 64).sampling.max_tokens == 11
    # server limits: max_tokens_limit caps explicit and default values, max_prompt_tokens the prompt
    e = refused(lambda _: wire.make_generation_request(p2, [1] * 10, "r", "default", 100, 64, 10), b"")
    assert (e.status, e.code, e.param) == (400, "invalid_value", "max_tokens")
    assert wire.make_generation_request(p, [1] * 10, "r", "default", 100, 64, 20).sampling.max_tokens == 20
    e = refused(lambda _: wire.make_generation_request(p, [1] * 31, "r", "default", 100, 64, None, 30), b"")
    assert e.code == "context_length_exceeded"
    # zero tokens
    e = refused(lambda _: wire.make_generation_request(p, [], "r", "default", 100, 64), b"")
    assert e.code == "invalid_value"


def test_generation_request_copies_sampling():
    p = wire.parse_chat_request(chat(temperature=0.3, top_p=0.9, top_k=40, seed=1, stop=["a", "b"],
                                     stop_token_ids=[2], ignore_eos=True, max_tokens=5))
    s = wire.make_generation_request(p, [1, 2], "r", "default", 100, 64).sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.max_tokens, s.stop, s.stop_token_ids, s.ignore_eos) == \
        (0.3, 0.9, 40, 1, 5, ["a", "b"], [2], True)


# ---- responses and chunks

def test_chat_response_shape():
    r = wire.completion_response("chat", "chatcmpl-1", 123, "m", "hi", "stop", 5, 2)
    assert r == {"id": "chatcmpl-1", "object": "chat.completion", "created": 123, "model": "m",
                 "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": None,
                              "finish_reason": "stop"}],
                 "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}


def test_completion_response_shape():
    r = wire.completion_response("completion", "cmpl-1", 1, "m", "hi", "length", 5, 2)
    assert r["object"] == "text_completion"
    assert r["choices"] == [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "length"}]


def test_chat_chunk_shapes():
    first = wire.stream_chunk("chat", "c", 1, "m", role=True)
    assert first == {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}]}
    mid = wire.stream_chunk("chat", "c", 1, "m", text="x")
    assert mid["choices"][0]["delta"] == {"content": "x"} and "usage" not in mid
    last = wire.stream_chunk("chat", "c", 1, "m", finish_reason="stop", include_usage=True)
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    assert last["usage"] is None
    u = wire.usage_chunk("chat", "c", 1, "m", 3, 4)
    assert u["choices"] == [] and u["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_completion_chunk_shape():
    c = wire.stream_chunk("completion", "cmpl-1", 1, "m", text="x")
    assert c == {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                 "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": None}]}


def test_sse_event_is_utf8_json():
    ev = wire.sse_event({"a": "✓"})
    assert ev == 'data: {"a":"✓"}\n\n'.encode()
    assert wire.SSE_DONE == b"data: [DONE]\n\n"


def test_models_response():
    r = wire.models_response("m", 5, 4096)
    assert r == {"object": "list", "data": [{"id": "m", "object": "model", "created": 5, "owned_by": "edged",
                                             "max_model_len": 4096}]}


# ---- msgpack framing

def test_msgpack_round_trip_in_pieces():
    objs = [wire.stream_chunk("chat", "c", 1, "m", role=True), wire.stream_chunk("chat", "c", 1, "m", text="é✓"),
            {"done": True}]
    stream = b"".join(wire.msgpack_frame(o) for o in objs[:-1]) + wire.MSGPACK_DONE
    first = msgpack.packb(objs[0], use_bin_type=True)
    assert stream[:4] == len(first).to_bytes(4, "big") and stream[4:4 + len(first)] == first
    assert stream.endswith(wire.MSGPACK_DONE) and msgpack.unpackb(wire.MSGPACK_DONE[4:]) == {"done": True}
    got, rest = [], b""
    for i in range(0, len(stream), 7):  # arbitrary split points
        frames, rest = wire.decode_msgpack_frames(rest + stream[i:i + 7])
        got += frames
    assert got == objs and rest == b""


@pytest.mark.parametrize("accept, expected", [
    (None, False), ("text/event-stream", False), ("application/x-msgpack", True),
    ("application/json, application/msgpack;q=0.9", True)])
def test_wants_msgpack(accept, expected):
    assert wire.wants_msgpack(accept) is expected
