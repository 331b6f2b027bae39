"""A real headless Chromium loads the chat page from a real daemon and gets its answer over HTTP/3.

One daemon (the embedded model with its own sampling defaults, which are greedy; the result cache off
so every answer is generated) and one Chromium (Debian's `chromium` package, driven by Playwright with
`executable_path`; `make install-test` installs both). Chromium trusts the daemon's self-signed
certificate by its SPKI hash and is allowed QUIC to 127.0.0.1 without being forced onto it for the
daemon's origin (tests/helpers/browser.py says why that takes a switch naming another port), so:

1. the first visit goes over TLS/TCP (h2), and the page's response carries `Alt-Svc: h3=":PORT"`;
2. Chromium then opens QUIC by itself, and on the second visit the page and its streamed
   `POST /v1/chat/completions` go over h3, as the browser's own network log (DevTools
   `Network.responseReceived`.protocol) says.

Each visit asks "What is the capital of France?" through the page's UI and must show an answer naming
Paris, and the page must log no console error or warning, no uncaught exception and no CSP violation
(its CSP allows its inline script and style by hash only).

`EDGED_BROWSER_SCREENSHOT=docs/chat-page.png` also saves a screenshot of the answered page (the one in
the README) on the second visit.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: make install-test")

from helpers.browser import NetworkResponse, PageRecorder, chromium_args, chromium_path
from helpers.daemon import DaemonProcess, start_daemon

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

CHROMIUM = chromium_path()
if CHROMIUM is None:
    pytest.skip("Debian's chromium is not installed: make install-test", allow_module_level=True)

CONFIG = """
server:
  workers: 1
cache:
  enabled: false
"""
QUESTION = "What is the capital of France?"
ANSWER_TIMEOUT_MS = 60_000
PAGE_READY_TIMEOUT_MS = 15_000
# Chromium opens QUIC beside the TCP connection it already uses once it has seen Alt-Svc; a request
# made before that connection is up still goes over TCP. Each reload is a new attempt, so a few bound
# the wait for the upgrade without sleeping.
MAX_RELOADS_FOR_H3 = 5
# Named in --origin-to-force-quic-on only to allow QUIC to the daemon's host: nothing listens there and
# the page never goes there.
QUIC_ALLOWLIST_PORT = 1
SCREENSHOT_ENV = "EDGED_BROWSER_SCREENSHOT"
VIEWPORT = {"width": 1120, "height": 560}  # the header fits on one line


@dataclass
class Answer:
    text: str
    meta: str


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = start_daemon(tmp_path_factory.mktemp("browser"), CONFIG)
    try:
        yield d
    finally:
        assert d.stop() == 0, d.log_text()[-3000:]


@pytest.fixture(scope="module")
def browser_page(daemon: DaemonProcess) -> Iterator[PageRecorder]:
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM,
                                    args=chromium_args(daemon.ca_file, daemon.host, QUIC_ALLOWLIST_PORT))
        try:
            page = browser.new_page(viewport=VIEWPORT)
            yield PageRecorder.attach(page)
        finally:
            browser.close()


@pytest.fixture(scope="module")
def first_visit(daemon: DaemonProcess, browser_page: PageRecorder) -> NetworkResponse:
    """The page loaded once (its script has listed the daemon's model); the document's response."""
    load_page(daemon, browser_page)
    (doc,) = browser_page.responses_to("/")
    return doc


def url(d: DaemonProcess) -> str:
    return f"https://{d.host}:{d.port}/"


def load_page(d: DaemonProcess, rec: PageRecorder, reload: bool = False) -> None:
    page = rec.page
    if reload:
        page.reload()
    else:
        page.goto(url(d))
    # The model list comes from the page's own script (GET /v1/models): proof that the script ran.
    sync_api.expect(page.locator("#model option")).to_have_count(1, timeout=PAGE_READY_TIMEOUT_MS)


def last_completion_log(d: DaemonProcess) -> str:
    return [ln for ln in d.lines if "request done" in ln and "/v1/chat/completions" in ln][-1]


# Stamps each stream read that carries a non-empty content delta (performance.now(), the page's clock).
WATCH_CONTENT_READS = """() => {
  window.__contentReads = [];
  const proto = ReadableStreamDefaultReader.prototype;
  if (proto.__edgedRead) return;
  proto.__edgedRead = proto.read;
  proto.read = async function () {
    const r = await proto.__edgedRead.call(this);
    if (!r.done && r.value && /"content":\\s*"[^"]/.test(new TextDecoder().decode(r.value)))
      window.__contentReads.push(performance.now());
    return r;
  };
}"""


def content_read_spread_ms(rec: PageRecorder) -> float:
    """From the first to the last stream read that handed the page content, since WATCH_CONTENT_READS."""
    stamps = rec.page.evaluate("() => window.__contentReads")
    return max(stamps) - min(stamps) if stamps else 0.0


def ask(rec: PageRecorder, question: str) -> Answer:
    """Type the question, press Send, wait until the page shows the answer's finish."""
    page = rec.page
    page.locator("#prompt").fill(question)
    page.locator("#send").click()
    answer = page.locator(".msg.assistant").last
    sync_api.expect(answer.locator(".meta")).to_contain_text("finish:", timeout=ANSWER_TIMEOUT_MS)
    return Answer(answer.locator(".body").inner_text(), answer.locator(".meta").inner_text())


def assert_clean(rec: PageRecorder) -> None:
    assert rec.console_problems == []
    assert rec.csp_violations() == []


def test_the_first_visit_is_over_tcp_advertises_h3_and_the_page_answers_paris(daemon, browser_page, first_visit):
    rec = browser_page
    # Not h3: QUIC is not forced on this origin, the browser has to discover it.
    assert first_visit.protocol == "h2" and first_visit.status == 200
    assert first_visit.headers["alt-svc"] == f'h3=":{daemon.port}"; ma=86400'
    # The inline style applied (its CSP hash matched): the Send button has the page's accent colour.
    accent = rec.page.locator("#send").evaluate("b => getComputedStyle(b).backgroundColor")
    assert accent == "rgb(47, 111, 179)"
    assert rec.page.locator("#model").input_value() == "SmolLM2-135M-Instruct"

    rec.page.evaluate(WATCH_CONTENT_READS)
    answer = ask(rec, QUESTION)
    assert "Paris" in answer.text
    assert "TTFT" in answer.meta and "finish: stop" in answer.meta
    # A rate needs two arrivals: the page shows one whenever the browser handed it content in reads apart
    # (what the daemon logs is not enough: on a loaded 2-core box deltas it sent 13 ms apart came as one read)
    spread = content_read_spread_ms(rec)
    if spread >= 2:
        assert "tokens/s" in answer.meta, (answer.meta, spread, last_completion_log(daemon))
    assert_clean(rec)


def test_the_second_visit_streams_the_answer_over_h3_discovered_from_alt_svc(daemon, browser_page, first_visit):
    rec = browser_page
    for _ in range(MAX_RELOADS_FOR_H3):
        load_page(daemon, rec, reload=True)
        if rec.responses_to("/")[-1].protocol == "h3":
            break
    docs = rec.responses_to("/")
    assert docs[-1].protocol == "h3", [d.protocol for d in docs]

    answer = ask(rec, QUESTION)
    assert "Paris" in answer.text
    completion = rec.responses_to("/v1/chat/completions", "POST")[-1]
    assert completion.protocol == "h3"
    assert completion.status == 200 and completion.headers["content-type"].startswith("text/event-stream")
    # The icon every browser asks for is served (a 404 would be a console error).
    icons = rec.responses_to("/favicon.ico")
    assert icons and {(r.status, r.headers["content-type"]) for r in icons} == {(200, "image/svg+xml")}
    assert_clean(rec)

    if shot := os.environ.get(SCREENSHOT_ENV):
        rec.page.screenshot(path=shot)
