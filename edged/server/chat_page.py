"""GET /: the chat page (static/chat.html), on every transport the router serves.

One HTML file with its script and style inline: no build step and nothing fetched from elsewhere,
since an edge node may be offline. The page talks to the daemon that served it (/v1/models,
streamed /v1/chat/completions, /metrics) and sends the API key it is given as a bearer token, so
the page itself is public and needs no key.

The file is read once, through importlib.resources (it is package data), and served from memory
with a content-security-policy that allows exactly this page's inline script and style (by their
sha256) and connections to its own origin, nothing else.
"""
from __future__ import annotations

import base64
import hashlib
import re
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edged.server.routes import Router

PATH = "/"
CONTENT_TYPE = "text/html; charset=utf-8"
# Browsers ask every origin for /favicon.ico whatever the page says; without it each visit logs a
# 404 in the console. A page `<link rel="icon">` cannot replace it: a data: URL is blocked by the
# page's img-src 'self', and any other URL is a second request anyway.
FAVICON_PATH = "/favicon.ico"
FAVICON_TYPE = "image/svg+xml"
FAVICON = (b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16">'
           b'<rect width="16" height="16" rx="3" fill="#2f6fb3"/>'
           b'<path d="M4 8.5h8M11.5 8.5a3.5 3.5 0 1 0-1 2.5" fill="none" stroke="#fff" stroke-width="1.8"/></svg>')
FAVICON_HEADERS = [
    ("cache-control", "public, max-age=86400"),
    ("content-security-policy", "default-src 'none'"),  # an SVG opened on its own runs nothing
    ("x-content-type-options", "nosniff"),
]
_INLINE = {kind: re.compile(rf"<{kind}>(.*?)</{kind}>", re.DOTALL) for kind in ("script", "style")}


def inline_blocks(html: str, kind: str) -> list[str]:
    """The text of each inline `<script>` or `<style>` element (written without attributes)."""
    return _INLINE[kind].findall(html)


def csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def content_security_policy(html: str) -> str:
    """Only this page's own inline script and style run; fetch() reaches only the daemon itself."""
    scripts = " ".join(csp_hash(s) for s in inline_blocks(html, "script")) or "'none'"
    styles = " ".join(csp_hash(s) for s in inline_blocks(html, "style")) or "'none'"
    return "; ".join([
        "default-src 'none'",
        f"script-src {scripts}",
        f"style-src {styles}",
        "connect-src 'self'",
        "img-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ])


@lru_cache(maxsize=1)
def page() -> tuple[bytes, list[tuple[str, str]]]:
    """The page's bytes and its response headers, read once."""
    body = resources.files("edged.server").joinpath("static").joinpath("chat.html").read_bytes()
    headers = [
        ("cache-control", "no-cache"),
        ("content-security-policy", content_security_policy(body.decode("utf-8"))),
        ("x-content-type-options", "nosniff"),
        ("referrer-policy", "no-referrer"),
    ]
    return body, headers


async def serve_page(req: Any) -> None:
    body, headers = page()
    req.respond(200, body, CONTENT_TYPE, list(headers))


async def serve_favicon(req: Any) -> None:
    req.respond(200, FAVICON, FAVICON_TYPE, list(FAVICON_HEADERS))


def mount(router: Router) -> None:
    """`GET /` (public: the page asks for a key itself when the API wants one) and its icon."""
    router.add("GET", PATH, serve_page, public=True)
    router.add("GET", FAVICON_PATH, serve_favicon, public=True)
