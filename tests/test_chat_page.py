"""The chat page at GET / (edged/server/chat_page.py, edged/server/static/chat.html) against the fake engine.

Served over HTTP/3 (H3Client) and over TLS/TCP (httpx, HTTP/1.1 and HTTP/2), public with auth on,
self-contained (nothing from another origin), with a CSP that allows only its own inline script
and style. Its script is checked with `node --check` and, under node, its non-DOM part (models,
streaming with TTFT and tokens/s, Stop, the bearer key, the metrics parser) is run against the
same server over HTTP/1.1. Without node those two are skipped, saying so.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import ssl
import subprocess
import tomllib
from pathlib import Path

import httpx
import pytest

from edged.server import chat_page
from edged.server.h3_client import H3Client
from edged.server.settings import ApiKeyPolicy, ServerSettings

from helpers.aio import run
from helpers.fake_engine import FakeEngine, ServerThread, expected_text, wait_until

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
HTML_FILE = ROOT / "edged" / "server" / "static" / "chat.html"
KEY = "k-chat-page"
NODE = shutil.which("node")
NO_NODE = "node is not installed on this machine: the page's script cannot be run here"
IDS = ["model", "prompt", "send", "stop", "log", "metrics", "metrics-status", "m-queue", "m-batch", "m-kv",
       "keybox", "key"]


@pytest.fixture(scope="module")
def srv(certs):
    with ServerThread(FakeEngine(), *certs, settings=ServerSettings(default_max_tokens=64), tcp=True) as st:
        yield st


@pytest.fixture(scope="module")
def auth_srv(certs):
    keys = {hashlib.sha256(KEY.encode()).hexdigest(): ApiKeyPolicy("page")}
    with ServerThread(FakeEngine(), *certs, settings=ServerSettings(api_keys=keys), tcp=True) as st:
        yield st


def h3_get(st: ServerThread, certs, path: str, headers: dict | None = None):
    async def go():
        async with H3Client("127.0.0.1", st.port, ca_file=certs[0]) as c:
            return await c.request("GET", path, headers or {}, timeout=10)
    return run(go())


def tcp_get(st: ServerThread, certs, proto: str, path: str) -> httpx.Response:
    with httpx.Client(verify=ssl.create_default_context(cafile=certs[0]), http1=proto == "http1",
                      http2=proto == "h2", timeout=10) as c:
        return c.get(f"https://127.0.0.1:{st.port}{path}")


def page_text() -> str:
    return HTML_FILE.read_text("utf-8")


def script() -> str:
    (js,) = chat_page.inline_blocks(page_text(), "script")
    return js


def assert_page_headers(status: int, headers) -> None:
    assert status == 200
    assert headers["content-type"] == "text/html; charset=utf-8"
    assert headers["cache-control"] == "no-cache"
    assert headers["content-security-policy"] == chat_page.content_security_policy(page_text())
    assert headers["x-content-type-options"] == "nosniff"


# ------------------------------------------------------------------ served on every transport

def test_page_over_http3(srv, certs):
    r = h3_get(srv, certs, "/")
    assert_page_headers(r.status, r.headers)
    assert r.body == HTML_FILE.read_bytes()
    assert int(r.headers["content-length"]) == len(r.body)
    assert h3_get(srv, certs, "/?from=bookmark").body == r.body  # a query string is still the page


@pytest.mark.parametrize("proto", ["http1", "h2"])
def test_page_over_tcp(srv, certs, proto):
    r = tcp_get(srv, certs, proto, "/")
    assert r.http_version == ("HTTP/2" if proto == "h2" else "HTTP/1.1")
    assert_page_headers(r.status_code, r.headers)
    assert r.content == HTML_FILE.read_bytes()
    assert r.headers["alt-svc"] == f'h3=":{srv.port}"; ma=86400'


def test_page_is_public_when_the_api_needs_a_key(auth_srv, certs):
    """The page loads without a key; the API it calls answers 401 until the page sends one."""
    r = h3_get(auth_srv, certs, "/")
    assert_page_headers(r.status, r.headers)
    assert tcp_get(auth_srv, certs, "http1", "/").status_code == 200
    assert h3_get(auth_srv, certs, "/v1/models").status == 401
    ok = h3_get(auth_srv, certs, "/v1/models", {"authorization": f"Bearer {KEY}"})
    assert ok.status == 200 and ok.json()["data"][0]["id"] == "fake-model"


def test_only_get(srv, certs):
    async def go():
        async with H3Client("127.0.0.1", srv.port, ca_file=certs[0]) as c:
            return await c.request("POST", "/", {"content-type": "application/json"}, b"{}", timeout=10)
    r = run(go())
    assert r.status == 405 and r.headers["allow"] == "GET"


# ------------------------------------------------------------------ the file itself

def test_page_is_self_contained():
    html = page_text()
    for needle in ("http://", "https://", "//cdn"):
        assert needle not in html, needle
    assert not re.search(r"<link\b", html, re.IGNORECASE), "no stylesheet, font or icon from anywhere"
    assert not re.search(r"\bsrc\s*=", html, re.IGNORECASE), "no external script, image or frame"
    assert not re.search(r"@import|url\(", html, re.IGNORECASE), "no CSS fetching anything"
    assert len(chat_page.inline_blocks(html, "script")) == 1 and len(chat_page.inline_blocks(html, "style")) == 1
    for element_id in IDS:
        assert f'id="{element_id}"' in html, element_id
    assert re.search(r'<select id="model"', html) and re.search(r'<button id="stop"', html)


def test_csp_allows_only_this_pages_inline_script_and_style():
    html = page_text()
    policy = dict(d.strip().split(" ", 1) for d in chat_page.content_security_policy(html).split(";"))
    assert policy["default-src"] == "'none'" and policy["connect-src"] == "'self'"
    assert policy["base-uri"] == policy["form-action"] == policy["frame-ancestors"] == "'none'"
    for kind in ("script", "style"):
        (block,) = chat_page.inline_blocks(html, kind)
        digest = base64.b64encode(hashlib.sha256(block.encode()).digest()).decode()
        assert policy[f"{kind}-src"] == f"'sha256-{digest}'"
    assert not re.search(r"unsafe|\*|http", " ".join(policy.values()))
    # What a hash-based CSP would block, so the page must not use it: inline handlers and style attributes.
    assert not re.search(r"\son[a-z]+\s*=", html) and not re.search(r"\sstyle\s*=", html)
    assert "\r" not in html  # browsers hash the script text with newlines as LF


def test_script_uses_the_api_as_specified():
    js = script()
    for needle in ('"/v1/chat/completions"', '"/v1/models"', '"/metrics"', "new AbortController()", ".abort()",
                   "Authorization: ", '"Bearer "', "sessionStorage", "stream_options", "include_usage",
                   ".getReader()", "TextDecoder", "edged_queue_depth", "edged_batch_size", "edged_kv_blocks",
                   "metrics need a key / loopback", "METRICS_EVERY_MS = 2000", "textContent"):
        assert needle in js, needle
    assert "innerHTML" not in js and "eval(" not in js  # model output is text, never markup


def test_package_data_ships_the_page():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data["edged.server"]
    assert any(HTML_FILE.relative_to(ROOT / "edged" / "server").match(p) for p in patterns)
    assert chat_page.page()[0] == HTML_FILE.read_bytes()  # read through importlib.resources


# ------------------------------------------------------------------ the script under node

@pytest.mark.skipif(NODE is None, reason=NO_NODE)
def test_script_parses_under_node(tmp_path):
    path = tmp_path / "chat.js"
    path.write_text(script(), "utf-8")
    r = subprocess.run([NODE, "--check", str(path)], check=False, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


METRICS_TEXT = """\
# HELP edged_queue_depth requests waiting per tier
# TYPE edged_queue_depth gauge
edged_queue_depth{tier="gold"} 2.0
edged_queue_depth{tier="silver"} 0.0
# HELP edged_batch_size sequences in the last engine step
# TYPE edged_batch_size gauge
edged_batch_size 5.0
# HELP edged_batch_size_limit a different family with the same prefix
edged_batch_size_limit 64.0
# HELP edged_kv_blocks KV cache blocks by state
# TYPE edged_kv_blocks gauge
edged_kv_blocks{state="used"} 12.0
edged_kv_blocks{state="free"} 52.0
"""

NODE_DRIVER = r"""
const BASE = process.env.EDGED_BASE, AUTH_BASE = process.env.EDGED_AUTH_BASE, KEY = process.env.EDGED_KEY;
const hi = (content) => ({ model: "fake-model", messages: [{ role: "user", content }] });
async function failure(p) {
  try { await p; return null; } catch (e) { return { name: e.name, status: e.status, message: e.message }; }
}
(async () => {
  const out = { models: await listModels(BASE, "") };
  const pieces = [];
  const chat = await streamChat({ base: BASE, body: hi("hi"), onText: (p) => pieces.push(p) });
  out.chat = { ...chat, pieces, stats: formatStats(chat) };
  const ctl = new AbortController();
  let n = 0;
  const stopped = await streamChat({ base: BASE, body: { ...hi("[slow]"), max_tokens: 200 }, signal: ctl.signal,
                                     onText: () => { if (++n === 3) ctl.abort(); } });
  out.stopped = { ...stopped, stats: formatStats(stopped) };
  out.noKeyModels = await failure(listModels(AUTH_BASE, ""));
  out.badKeyChat = await failure(streamChat({ base: AUTH_BASE, key: "wrong", body: hi("hi") }));
  out.keyModels = await listModels(AUTH_BASE, KEY);
  out.keyChat = await streamChat({ base: AUTH_BASE, key: KEY, body: hi("hi") });
  out.badRequest = await failure(streamChat({ base: BASE, body: { model: "fake-model", messages: [] } }));
  out.metrics = parseMetrics(process.env.EDGED_METRICS_TEXT);
  const feed = sseParser();
  out.sse = [...feed('data: {"a":1}\r\n\r\n: comment\n\ndata: [DO'), ...feed("NE]\n"), ...feed("\n")];
  console.log(JSON.stringify(out));
})().catch((e) => { console.error((e && e.stack) || e); process.exit(1); });
"""


@pytest.mark.skipif(NODE is None, reason=NO_NODE)
def test_script_streams_stops_and_authenticates_under_node(srv, auth_srv, certs, tmp_path):
    """The page's own functions (not a copy) against the daemon over HTTP/1.1: node's fetch is the client."""
    path = tmp_path / "drive.js"
    path.write_text(script() + "\n" + NODE_DRIVER, "utf-8")
    env = {**os.environ, "NODE_EXTRA_CA_CERTS": certs[0], "EDGED_KEY": KEY, "EDGED_METRICS_TEXT": METRICS_TEXT,
           "EDGED_BASE": f"https://127.0.0.1:{srv.port}", "EDGED_AUTH_BASE": f"https://127.0.0.1:{auth_srv.port}"}
    r = subprocess.run([NODE, str(path)], check=False, capture_output=True, text=True, timeout=45, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)

    assert out["models"] == ["fake-model"] and out["keyModels"] == ["fake-model"]
    chat = out["chat"]
    assert chat["text"] == expected_text() and "".join(chat["pieces"]) == expected_text()
    assert chat["finish"] == "stop" and not chat["stopped"] and chat["error"] is None
    assert chat["completionTokens"] == 6 and chat["promptTokens"] > 0 and not chat["approx"]  # from the usage chunk
    assert chat["ttftMs"] > 0 and chat["tokensPerS"] > 0
    assert "TTFT" in chat["stats"] and "tokens/s" in chat["stats"] and "6 tokens" in chat["stats"]

    stopped = out["stopped"]
    assert stopped["stopped"] and stopped["finish"] is None and stopped["approx"]
    assert 3 <= len(stopped["text"]) < 200 and set(stopped["text"]) == {"x"}
    assert "stopped" in stopped["stats"]
    slow = next(q for q in srv.engine.requests if "[slow]" in srv.engine.decode(q.prompt_token_ids))
    assert wait_until(lambda: slow.request_id in srv.engine.cancelled)  # Stop reached the engine

    assert out["noKeyModels"]["status"] == 401 and out["noKeyModels"]["name"] == "HttpError"
    assert out["badKeyChat"]["status"] == 401 and "API key" in out["badKeyChat"]["message"]
    assert out["keyChat"]["text"] == expected_text()
    assert out["badRequest"]["status"] == 400

    assert out["metrics"] == {"queue": {"gold": 2, "silver": 0}, "batch": 5, "kvUsed": 12, "kvFree": 52}
    assert out["sse"] == ['{"a":1}', "[DONE]"]


# A stand-in for the browser: just enough DOM for the page's init() (elements by the ids the page
# really has: any other id is null, as in a browser), sessionStorage, and fetch() on relative URLs
# sent to the daemon's origin. It goes before the page's script, which then boots as in a browser.
FAKE_BROWSER = r"""
const ORIGIN = process.env.EDGED_ORIGIN;
const PAGE_IDS = new Set(JSON.parse(process.env.EDGED_IDS));
const realFetch = fetch;
globalThis.fetch = (url, opts) => realFetch(ORIGIN + url, opts);
const store = new Map();
globalThis.sessionStorage = { getItem: (k) => (store.has(k) ? store.get(k) : null),
                              setItem: (k, v) => store.set(k, String(v)), removeItem: (k) => store.delete(k) };
globalThis.Option = class { constructor(text, value) { this.textContent = text; this.value = value; } };
class El {
  constructor(id) {
    this.id = id; this.children = []; this.listeners = {}; this.hidden = id === "keybox"; this.disabled = id === "stop";
    this._value = ""; this.textContent = ""; this.className = ""; this.scrollTop = 0; this.scrollHeight = 0;
    this.clientHeight = 0; const set = new Set(); this.classes = set;
    this.classList = { add: (c) => set.add(c), remove: (c) => set.delete(c), contains: (c) => set.has(c) };
  }
  get value() { return this._value; }
  set value(v) {
    if (this.id === "model" && !this.children.some((o) => o.value === v)) return;  // a select keeps an option
    this._value = v;
  }
  addEventListener(type, f) { (this.listeners[type] = this.listeners[type] || []).push(f); }
  append(...c) { this.children.push(...c); }
  replaceChildren(...c) {
    this.children = c;
    if (this.id === "model") this._value = c.length ? c[0].value : "";
  }
  focus() {}
  fire(type, ev = {}) {
    return Promise.all((this.listeners[type] || []).map((f) => f({ preventDefault() {}, ...ev })));
  }
}
const els = {};
globalThis.document = {
  hidden: false,
  getElementById: (id) => (PAGE_IDS.has(id) ? (els[id] = els[id] || new El(id)) : null),
  createElement: () => new El(null),
};
"""

BROWSER_DRIVER = r"""
const $ = (id) => els[id];
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
async function until(what, pred, ms = 10000) {
  const end = Date.now() + ms;
  while (!pred()) { if (Date.now() > end) throw new Error("timed out waiting for " + what + ": " + JSON.stringify(shown())); await sleep(10); }
}
const shown = () => $("log").children.map((d) => ({
  cls: [d.className, ...d.classes].join(" "), text: d.children[1].textContent, meta: d.children[2].textContent }));
const S = process.env.SCENARIO;
(async () => {
  const out = {};
  if (S === "auth") {  // the page finds out that it needs a key, takes one, and then all works
    await until("the key field", () => !$("keybox").hidden);
    out.keyNote = $("key-note").textContent;
    out.modelsBeforeKey = $("model").children.length;
    await until("the metrics note", () => $("metrics-status").textContent !== "");
    out.metricsBeforeKey = $("metrics-status").textContent;
    $("key").value = " " + process.env.EDGED_KEY + " ";
    await $("key-save").fire("click");
    out.stored = sessionStorage.getItem("edged.apiKey");
    await until("metrics with the key", () => $("m-batch").textContent === "5", 5000);
    out.queue = $("m-queue").children.map((li) => li.textContent);
    out.kv = $("m-kv").textContent;
    out.kvMeter = $("m-kv-meter").value;
  } else {
    await until("the metrics note", () => $("metrics-status").textContent !== "");
    out.metricsNote = $("metrics-status").textContent;
  }
  await until("the model list", () => $("model").children.length > 0);
  out.model = $("model").value;
  $("prompt").value = "hi-" + S;
  await $("send").fire("click");
  $("prompt").value = "again-" + S;
  await $("prompt").fire("keydown", { key: "Enter", shiftKey: false, isComposing: false });  // sends, unawaited
  await until("the second answer", () => $("log").children.length === 4 && !$("send").disabled);
  out.afterTwo = shown();
  $("max-tokens").value = "100";
  $("prompt").value = "[slow]-" + S;
  const pending = $("send").fire("click");
  await until("three streamed tokens", () => {
    const log = $("log").children;
    return log.length === 6 && log[5].children[1].textContent.length >= 3;
  });
  out.busy = { send: $("send").disabled, stop: $("stop").disabled };
  await $("stop").fire("click");
  await pending;
  out.afterStop = shown();
  out.idle = { send: $("send").disabled, stop: $("stop").disabled };
  await $("new-chat").fire("click");
  out.afterNewChat = $("log").children.length;
  $("max-tokens").value = "";
  $("prompt").value = "fresh-" + S;
  await $("send").fire("click");
  out.afterFresh = shown();
  console.log(JSON.stringify(out));
  process.exit(0);
})().catch((e) => { console.error((e && e.stack) || e); process.exit(1); });
"""


async def fake_metrics(req) -> None:
    """Stands in for the daemon's /metrics (Worker.metrics_route): with a key only."""
    from edged.server.openai_wire import WireError

    if req.header("authorization") != f"Bearer {KEY}":
        raise WireError(401, "/metrics is served to loopback clients or with an API key.", code="forbidden")
    req.respond(200, METRICS_TEXT.encode(), "text/plain; version=0.0.4; charset=utf-8")


@pytest.mark.skipif(NODE is None, reason=NO_NODE)
@pytest.mark.parametrize("scenario", ["open", "auth"])
def test_page_boots_chats_stops_and_asks_for_a_key_in_a_fake_browser(scenario, srv, auth_srv, certs, tmp_path):
    """The whole script, init() included, in node with a minimal stand-in DOM: the buttons and fields
    the page wires up, the conversation kept across turns, Stop, New chat, the key and the metrics panel."""
    st = auth_srv if scenario == "auth" else srv
    if scenario == "auth":
        st.server.router.add("GET", "/metrics", fake_metrics, public=True)
    ids = re.findall(r'\bid="([^"]+)"', page_text())
    path = tmp_path / "browser.js"
    path.write_text(FAKE_BROWSER + "\n" + script() + "\n" + BROWSER_DRIVER, "utf-8")
    env = {**os.environ, "NODE_EXTRA_CA_CERTS": certs[0], "EDGED_KEY": KEY, "EDGED_IDS": json.dumps(ids),
           "EDGED_ORIGIN": f"https://127.0.0.1:{st.port}", "SCENARIO": scenario}
    r = subprocess.run([NODE, str(path)], check=False, capture_output=True, text=True, timeout=45, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)

    if scenario == "auth":
        assert "API key" in out["keyNote"] and out["modelsBeforeKey"] == 0
        assert out["metricsBeforeKey"] == "metrics need a key / loopback"
        assert out["stored"] == KEY
        assert out["queue"] == ["gold: 2", "silver: 0"] and out["kv"] == "12 / 64 (19%)"
        assert out["kvMeter"] == pytest.approx(12 / 64)
    else:
        assert out["metricsNote"] == "metrics unavailable (HTTP 404)"  # no /metrics on this test server
    assert out["model"] == "fake-model"

    two = out["afterTwo"]
    assert [m["cls"].split()[1] for m in two] == ["user", "assistant"] * 2
    assert [m["text"] for m in two] == [f"hi-{scenario}", expected_text(), f"again-{scenario}", expected_text()]
    for answer in two[1::2]:
        assert "TTFT" in answer["meta"] and "tokens/s" in answer["meta"] and "finish: stop" in answer["meta"]
        assert "pending" not in answer["cls"]

    def prompt_of(marker: str) -> tuple[str, object]:
        req = next(q for q in reversed(st.engine.requests)
                   if st.engine.decode(q.prompt_token_ids).endswith(f"<user>{marker}<assistant>"))
        return st.engine.decode(req.prompt_token_ids), req

    text, _ = prompt_of(f"again-{scenario}")  # the page sends the conversation so far
    assert text == f"<user>hi-{scenario}<assistant>{expected_text()}<user>again-{scenario}<assistant>"

    assert out["busy"] == {"send": True, "stop": False} and out["idle"] == {"send": False, "stop": True}
    stopped = out["afterStop"][5]
    assert "stopped" in stopped["meta"] and 3 <= len(stopped["text"]) < 100
    _, slow = prompt_of(f"[slow]-{scenario}")
    assert slow.sampling.max_tokens == 100
    assert wait_until(lambda: slow.request_id in st.engine.cancelled)  # Stop cancelled it in the engine

    assert out["afterNewChat"] == 0 and [m["text"] for m in out["afterFresh"]] == [f"fresh-{scenario}", expected_text()]
    text, fresh = prompt_of(f"fresh-{scenario}")
    assert text == f"<user>fresh-{scenario}<assistant>"  # New chat forgot the history
    assert fresh.sampling.max_tokens != 100  # an emptied field leaves the server's default
