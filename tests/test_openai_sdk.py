"""The `openai` Python SDK, unchanged, against a real daemon over TLS/TCP (HTTP/1.1 and HTTP/2).

One daemon (the embedded model, greedy decoding, the result cache off so that every answer is
generated) with two API keys: one open, one limited to 1 request/s with a burst of 1. The text the
SDK streams must equal what HTTP/3 streams for the same request.
"""
from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Iterator

import httpx
import pytest

openai = pytest.importorskip("openai")

from edged.config import hash_api_key  # noqa: E402
from edged.server.h3_client import H3Client, chat_stream, iter_sse  # noqa: E402
from helpers.daemon import DaemonProcess, start_daemon  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

OPEN_KEY, RATE_KEY = "sdk-open-key", "sdk-limited-key"
CONFIG = f"""
server:
  workers: 1
cache:
  enabled: false
auth:
  enabled: true
  keys:
    - name: open
      sha256: {hash_api_key(OPEN_KEY)}
    - name: limited
      sha256: {hash_api_key(RATE_KEY)}
      rate_limit_rps: 1
      burst: 1
"""
MESSAGES = [{"role": "user", "content": "Name three colors."}]
PROMPT = "The capital of France is"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = start_daemon(tmp_path_factory.mktemp("sdk"), CONFIG)
    try:
        yield d
    finally:
        assert d.stop() == 0, d.log_text()[-3000:]


def sdk(d: DaemonProcess, key: str = OPEN_KEY, http2: bool = False) -> openai.OpenAI:
    """The SDK as its docs show it, with the daemon's certificate trusted (and no retries: a 429
    must surface, not be waited out)."""
    return openai.OpenAI(base_url=f"https://{d.host}:{d.port}/v1", api_key=key, max_retries=0,
                         http_client=httpx.Client(verify=ssl.create_default_context(cafile=d.ca_file), http2=http2,
                                                  timeout=120))


def h3_chat(d: DaemonProcess) -> str:
    async def go() -> str:
        async with H3Client(d.host, d.port, ca_file=d.ca_file) as c:
            parts = [t async for t in chat_stream(c, MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                                  headers={"authorization": f"Bearer {OPEN_KEY}"}, timeout=120)]
        return "".join(parts)
    return asyncio.run(go())


def h3_completion(d: DaemonProcess) -> str:
    async def go() -> str:
        async with H3Client(d.host, d.port, ca_file=d.ca_file) as c:
            rs = await c.stream("POST", "/v1/completions", {"content-type": "application/json",
                                                            "authorization": f"Bearer {OPEN_KEY}"},
                                json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                                            "stream": True}).encode(), timeout=120)
            out = []
            async for payload in iter_sse(rs):
                if payload != "[DONE]":
                    out += [ch["text"] for ch in json.loads(payload)["choices"]]
        return "".join(out)
    return asyncio.run(go())


def test_models(daemon):
    models = sdk(daemon).models.list()
    assert len(models.data) == 1 and models.data[0].object == "model"
    assert sdk(daemon).models.retrieve(models.data[0].id).id == models.data[0].id


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "h2"])
def test_chat_streaming_and_not_equal_http3(daemon, http2):
    client = sdk(daemon, http2=http2)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and text
    assert text == h3_chat(daemon)
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert full.choices[0].message.content == text and full.usage.completion_tokens <= MAX_TOKENS
    raw = client.chat.completions.with_raw_response.create(model=model, messages=MESSAGES, max_tokens=2)
    assert raw.headers["alt-svc"] == f'h3=":{daemon.port}"; ma=86400' and raw.headers["x-request-id"]
    assert raw.http_response.http_version == ("HTTP/2" if http2 else "HTTP/1.1")


def test_completions_streaming_and_not(daemon):
    client = sdk(daemon)
    model = client.models.list().data[0].id
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    text = "".join(ch.choices[0].text for ch in stream if ch.choices)
    assert text and text == h3_completion(daemon)
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert full.choices[0].text == text


def test_error_classes(daemon):
    with pytest.raises(openai.AuthenticationError) as e:
        sdk(daemon, key="wrong").models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"

    client = sdk(daemon)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=0)
    assert e.value.status_code == 400 and e.value.param == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)

    limited = sdk(daemon, key=RATE_KEY)
    limited.models.list()  # the burst of 1
    with pytest.raises(openai.RateLimitError) as e:
        limited.models.list()
    assert e.value.status_code == 429 and e.value.code == "rate_limit_exceeded"
    assert int(e.value.response.headers["retry-after"]) >= 1
