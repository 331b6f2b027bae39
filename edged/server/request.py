"""One HTTP request as the router sees it, whatever carried it (HTTP/3, HTTP/2 or HTTP/1.1).

`HttpRequest` holds what the router reads and writes (method, path, headers, body, the fields of
its access-log record) and the response methods (respond / start / write / finish / abort). It
also runs the request side that every transport shares: the body limit (413), the body timeout
(408), dispatching the handler task and cancelling it when the client goes away. The transport
subclasses (h3_server.RequestStream, tcp_server.H11Request / H2Request) only implement the
`_send_*` / `_reset` hooks that put bytes on their wire.
"""
from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from edged.log import fields
from edged.server import openai_wire as wire
from edged.server.settings import ApiKeyPolicy, ServerSettings

if TYPE_CHECKING:
    from edged.server.h3_server import EdgedServer

__all__ = ["HttpRequest", "RequestHandler", "merge_headers"]

log = logging.getLogger("edged.server")

REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


class RequestHandler(Protocol):
    """What the transports call; the router (routes.py) implements it. No transport imports it."""

    settings: ServerSettings
    draining: bool

    async def handle(self, req: HttpRequest) -> None: ...

    def rejected(self, req: HttpRequest, err: wire.WireError) -> None: ...


def merge_headers(raw: Iterable[tuple[bytes, bytes]]) -> tuple[dict[str, str], dict[str, str]]:
    """(headers, pseudo-headers): names lower-cased, repeated headers joined with ", "."""
    headers: dict[str, str] = {}
    pseudo: dict[str, str] = {}
    for k, v in raw:
        name = k.decode("latin-1").lower()
        value = v.decode("latin-1")
        if name.startswith(":"):
            pseudo[name] = value
        elif name in headers:
            headers[name] += ", " + value
        else:
            headers[name] = value
    return headers, pseudo


class HttpRequest:
    """One request: headers and body in, response out. The route handler only sees this object."""

    http_version: str  # "h1" | "h2" | "h3", set by each transport's subclass (the metrics' protocol label)

    def __init__(self, server: EdgedServer, loop: asyncio.AbstractEventLoop, method: str, target: str,
                 headers: dict[str, str]) -> None:
        self.server = server
        self._loop = loop
        self.method = method
        self.path, _, self.query = target.partition("?")
        self.headers = headers
        rid = headers.get("x-request-id", "")
        self.request_id = rid if REQUEST_ID_RE.fullmatch(rid) else uuid.uuid4().hex
        self.body = bytearray()
        self.api_key: ApiKeyPolicy | None = None  # set by the router when API keys are configured
        self.status: int | None = None
        self.headers_sent = False
        self.finished = False  # the response ended cleanly
        self.closed = False  # nothing more can be written (finished, reset, or connection gone)
        self.cancel_reason: str | None = None
        # what the router fills in for its access log / metrics record
        self.tier: str | None = None
        self.outcome: str | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.ttft: float | None = None
        self.cache_hit = False  # answered from the result cache
        self.response_headers: list[tuple[str, str]] = []  # added to whatever response is sent
        self.task: asyncio.Task[None] | None = None
        self.started = loop.time()
        self._dispatched = False
        self._body_timer: asyncio.TimerHandle | None = None

    @property
    def settings(self) -> ServerSettings:
        return self.server.settings

    def header(self, name: str) -> str | None:
        return self.headers.get(name)

    def clock(self) -> float:
        """The event loop's monotonic clock, the one `started` is on."""
        return self._loop.time()

    def elapsed(self) -> float:
        """Seconds since the request's headers arrived."""
        return self._loop.time() - self.started

    @property
    def peer_host(self) -> str | None:
        """The client's IP address (for loopback-only routes such as /metrics)."""
        host = self._peer_address()
        if host is None:
            return None
        return host[7:] if host.startswith("::ffff:") else host

    # ---- transport hooks

    def _peer_address(self) -> str | None:
        raise NotImplementedError

    def _send_headers(self, status: int, headers: list[tuple[str, str]], end_stream: bool) -> None:
        """Queue the response head; raises if the stream can no longer be written."""
        raise NotImplementedError

    def _send_data(self, data: bytes, end_stream: bool) -> None:
        """Queue body bytes; raises if the stream can no longer be written."""
        raise NotImplementedError

    def _flush(self) -> None:
        """Get what was queued onto the wire (soon)."""

    def _reset(self) -> None:
        """End the stream abnormally (the client sees an incomplete response)."""
        raise NotImplementedError

    def _stop_reading(self) -> None:
        """Ask the client to stop sending the request body (after a 413/408)."""

    def _forget(self) -> None:
        """The transport no longer routes events to this request."""

    def _dispatched_hook(self) -> None:
        """The handler task started."""

    def _backlog(self) -> int:
        """Bytes written to this stream that the client has not taken yet (for the stall log line)."""
        return 0

    def _backlogged(self) -> bool:
        """Whether a write should wait for the client before producing more."""
        return False

    async def _wait_writable(self, timeout: float) -> bool:
        """Wait until not backlogged; False after `timeout` seconds without progress."""
        return True

    # ---- request side (called by the transport)

    def on_headers(self, stream_ended: bool) -> None:
        if not self.method or not self.path.startswith("/"):
            self._reject(wire.WireError(400, "Missing or malformed :method / :path.", code="invalid_request"))
            return
        cl = self.headers.get("content-length", "")
        if cl.isdigit() and int(cl) > self.settings.max_body_bytes:
            self._reject(self._too_large(), stop_reading=True)
            return
        if stream_ended:
            self._dispatch()
        else:
            self._body_timer = self._loop.call_later(self.settings.body_timeout_s, self._body_timed_out)

    def on_data(self, data: bytes, stream_ended: bool) -> None:
        if self._dispatched or self.closed:
            return
        self.body += data
        if len(self.body) > self.settings.max_body_bytes:
            self.body = bytearray()
            self._reject(self._too_large(), stop_reading=True)
            return
        if stream_ended:
            self._dispatch()

    def on_end(self) -> None:
        if not self._dispatched and not self.closed:
            self._dispatch()

    @property
    def dispatched(self) -> bool:
        return self._dispatched

    def _too_large(self) -> wire.WireError:
        return wire.WireError(413, f"The request body exceeds {self.settings.max_body_bytes} bytes.",
                              code="request_too_large")

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if not self._dispatched and not self.closed:
            self._reject(wire.WireError(408, "Timed out waiting for the request body.", code="request_timeout"),
                         stop_reading=True)

    def _reject(self, err: wire.WireError, stop_reading: bool = False) -> None:
        """Answer before any handler ran (bad framing, too large, too slow)."""
        self._cancel_body_timer()
        self.respond_error(err)
        self.server.router.rejected(self, err)
        if stop_reading:
            self._stop_reading()
        self._forget()

    def _dispatch(self) -> None:
        self._cancel_body_timer()
        self._dispatched = True
        server = self.server
        self.task = self._loop.create_task(server.router.handle(self))
        server._tasks.add(self.task)
        self.task.add_done_callback(self._task_done)
        self._dispatched_hook()

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.server._tasks.discard(task)
        self._forget()
        if not task.cancelled() and task.exception() is not None:
            log.error("handler crashed %s", fields(rid=self.request_id, error=repr(task.exception())))
        if not self.closed:  # the handler returned without ending the response: never leave it hanging
            self.abort()

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def cancel(self, reason: str) -> None:
        """The client went away (reset, connection lost) or the server is stopping: stop the handler.

        reason "shutdown" leaves the stream open so the handler can write a final error event.
        """
        if self.cancel_reason is not None or self.finished:
            return
        self.cancel_reason = reason
        self._cancel_body_timer()
        if reason != "shutdown":
            if not self.closed and reason != "connection_lost":
                self._reset()
            self.closed = True
        if self.task is not None and not self.task.done():
            log.info("request cancelled %s", fields(rid=self.request_id, reason=reason))
            self.task.cancel()
        elif not self._dispatched:
            self._forget()

    # ---- response side (called by the route handler)

    def _base_headers(self, content_type: str, extra: list[tuple[str, str]]) -> list[tuple[str, str]]:
        h = [("server", "edged"), ("x-request-id", self.request_id), ("content-type", content_type)]
        if self.settings.worker:
            h.append(("x-edged-worker", self.settings.worker))
        h += [(k.lower(), v) for k, v in [*self.response_headers, *extra]]
        return h

    def respond(self, status: int, body: bytes, content_type: str = "application/json",
                headers: list[tuple[str, str]] | None = None) -> bool:
        """Send a whole response at once. False if the stream can no longer be written."""
        if self.headers_sent or self.closed:
            return False
        hdrs = self._base_headers(content_type, (headers or []) + [("content-length", str(len(body)))])
        try:
            self._send_headers(status, hdrs, end_stream=not body)
            if body:
                self._send_data(body, end_stream=True)
        except Exception as e:  # the peer stopped the stream under us
            log.debug("respond failed %s", fields(rid=self.request_id, error=repr(e)))
            self.closed = True
            return False
        self.status = status
        self.headers_sent = self.finished = self.closed = True
        self._flush()
        return True

    def respond_json(self, status: int, obj: Any, headers: list[tuple[str, str]] | None = None) -> bool:
        return self.respond(status, wire.json_bytes(obj), "application/json", headers)

    def respond_error(self, err: wire.WireError) -> bool:
        return self.respond_json(err.status, err.body(), err.headers)

    def start(self, status: int, content_type: str, headers: list[tuple[str, str]] | None = None) -> bool:
        """Send the response headers of a streamed response."""
        if self.headers_sent or self.closed:
            return False
        try:
            self._send_headers(status, self._base_headers(content_type, headers or []), end_stream=False)
        except Exception as e:
            log.debug("start failed %s", fields(rid=self.request_id, error=repr(e)))
            self.closed = True
            return False
        self.status = status
        self.headers_sent = True
        self._flush()
        return True

    async def write(self, data: bytes) -> bool:
        """Send a body chunk; waits while the client is behind. False: the stream is gone, stop producing."""
        if self.closed:
            return False
        try:
            self._send_data(data, end_stream=False)
        except Exception as e:
            log.debug("write failed %s", fields(rid=self.request_id, error=repr(e)))
            self.closed = True
            return False
        self._flush()
        if self._backlogged():
            if not await self._wait_writable(self.settings.send_stall_timeout_s):
                log.warning("client stalled %s", fields(rid=self.request_id, unacked=self._backlog()))
                self.abort()
                return False
        return not self.closed

    def finish(self, data: bytes = b"") -> bool:
        """End the response (optionally with a last chunk)."""
        if self.closed:
            return False
        try:
            self._send_data(data, end_stream=True)
        except Exception as e:
            log.debug("finish failed %s", fields(rid=self.request_id, error=repr(e)))
            self.closed = True
            return False
        self.finished = self.closed = True
        self._flush()
        return True

    def abort(self) -> None:
        """Reset the stream: the client sees the response end abnormally."""
        if not self.closed:
            self.closed = True
            self._reset()
