"""Routing and the endpoint handlers: OpenAI completions (JSON, SSE, msgpack), models, health.

Each handler gets a `RequestStream` (h3_server.py) whose body is complete, validates it with
openai_wire, asks the engine, and writes the response. Validation errors are answered before any
engine work; errors after a stream started become a final `{"error": ...}` event and `[DONE]`.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from edged.log import fields
from edged.server import openai_wire as wire
from edged.server.openai_wire import ParsedRequest, WireError

if TYPE_CHECKING:
    from edged.engine.request import GenerationRequest
    from edged.server.h3_server import RequestStream, ServerSettings

log = logging.getLogger("edged.server")

Handler = Callable[["RequestStream"], Awaitable[None]]
PUBLIC_PATHS = frozenset({"/healthz"})  # no API key needed


class Router:
    """Path -> method -> handler; `add()` lets the daemon mount more (e.g. GET /metrics)."""

    def __init__(self, engine: Any, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.created = wire.now()
        self.draining = False
        self.health_check: Callable[[], bool] | None = None  # set by the daemon: False -> 503
        self.routes: dict[str, dict[str, Handler]] = {}
        self.public_paths: set[str] = set(PUBLIC_PATHS)
        self._inflight: set[str] = set()  # engine request ids: unique even when clients reuse x-request-id
        self._suffix = itertools.count(1)
        self.add("POST", "/v1/chat/completions", self.chat_completions)
        self.add("POST", "/v1/completions", self.completions)
        self.add("GET", "/v1/models", self.models)
        self.add("GET", "/healthz", self.healthz)

    def add(self, method: str, path: str, handler: Handler, public: bool = False) -> None:
        """Mount `handler` (an `async def h(req: RequestStream)`); public: no API key needed."""
        self.routes.setdefault(path, {})[method.upper()] = handler
        if public:
            self.public_paths.add(path)

    async def handle(self, req: RequestStream) -> None:
        """Entry point of every request task; never raises except cancellation."""
        path = req.path.rstrip("/") or "/"
        try:
            methods = self.routes.get(path)
            if methods is None and path.startswith("/v1/models/"):
                methods = {"GET": self.model}
            if methods is None:
                raise WireError(404, f"No route for {req.path}.", code="not_found")
            handler = methods.get(req.method)
            if handler is None:
                allow = ", ".join(sorted(methods))
                raise WireError(405, f"Method {req.method} is not allowed on {path}; use {allow}.",
                                code="method_not_allowed", headers=[("allow", allow)])
            if self.draining and path != "/healthz":
                raise WireError(503, "The server is shutting down.", type="server_error", code="shutting_down",
                                headers=[("retry-after", str(self.settings.drain_retry_after_s))])
            if self.settings.api_keys is not None and path not in self.public_paths:
                self._authenticate(req)
            await handler(req)
        except WireError as e:
            log.info("request rejected %s", fields(rid=req.request_id, method=req.method, path=req.path,
                                                       status=e.status, code=e.code, param=e.param))
            if not req.respond_error(e) and not req.closed:
                req.abort()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("request failed %s", fields(rid=req.request_id, path=req.path, error=repr(e)))
            if not req.headers_sent:
                req.respond_error(WireError(500, "Internal server error.", type="server_error", code="internal_error"))
            else:
                req.abort()

    def _authenticate(self, req: RequestStream) -> None:
        auth = req.header("authorization") or ""
        scheme, _, key = auth.partition(" ")
        keys = self.settings.api_keys or {}
        if scheme.lower() != "bearer" or key.strip() not in keys:
            raise WireError(401, "Missing or invalid API key (send 'Authorization: Bearer KEY').",
                            code="invalid_api_key", headers=[("www-authenticate", "Bearer")])
        req.auth_tier = keys[key.strip()]

    # ---- small endpoints

    async def healthz(self, req: RequestStream) -> None:
        if self.draining:
            req.respond_json(503, {"status": "draining"})
        elif self.health_check is not None and not self.health_check():
            req.respond_json(503, {"status": "unhealthy"})
        else:
            req.respond_json(200, {"status": "ok"})

    async def models(self, req: RequestStream) -> None:
        req.respond_json(200, wire.models_response(self.engine.model_id, self.created, self.engine.max_model_len))

    async def model(self, req: RequestStream) -> None:
        name = req.path[len("/v1/models/"):].rstrip("/")
        if name != self.engine.model_id:
            raise WireError(404, f"The model '{name}' does not exist.", param="model", code="model_not_found")
        req.respond_json(200, wire.model_object(self.engine.model_id, self.created, self.engine.max_model_len))

    # ---- completions

    async def chat_completions(self, req: RequestStream) -> None:
        p = wire.parse_chat_request(bytes(req.body))
        wire.check_model(p, self.engine.model_id)
        tier = self._tier(req, p)  # before tokenizing: a bad tier costs nothing
        try:
            # On the loop thread: templating + tokenizing a chat is well under a millisecond per KB
            # with the Rust tokenizer, and bodies are capped by max_body_bytes.
            prompt_ids = self.engine.render_chat(p.messages)
        except ValueError as e:
            raise WireError(400, f"Invalid messages: {e}", param="messages", code="invalid_value") from None
        await self._complete(req, p, tier, prompt_ids)

    async def completions(self, req: RequestStream) -> None:
        p = wire.parse_completion_request(bytes(req.body))
        wire.check_model(p, self.engine.model_id)
        tier = self._tier(req, p)
        if isinstance(p.prompt, str):
            prompt_ids = self.engine.encode(p.prompt)  # on the loop: see chat_completions
        else:
            prompt_ids = list(p.prompt or [])
        await self._complete(req, p, tier, prompt_ids)

    def _tier(self, req: RequestStream, p: ParsedRequest) -> str:
        """An API key's tier wins; else the x-edged-tier header, else the body's "tier", else "default"."""
        if req.auth_tier is not None:
            return req.auth_tier
        h = req.header("x-edged-tier")
        tier = wire.check_tier(h, "x-edged-tier") if h else (p.tier or "default")
        known = self.settings.tiers
        if known is not None and tier != "default" and tier not in known:
            raise WireError(400, f"Unknown tier '{tier}'; known: {', '.join(known)}.", param="tier",
                            code="invalid_value")
        return tier

    def _engine_id(self, rid: str) -> str:
        eid = rid
        while eid in self._inflight:
            eid = f"{rid}.{next(self._suffix)}"
        return eid

    async def _complete(self, req: RequestStream, p: ParsedRequest, tier: str, prompt_ids: list[int]) -> None:
        eid = self._engine_id(req.request_id)
        gen = wire.make_generation_request(p, prompt_ids, eid, tier, self.engine.max_model_len,
                                           self.settings.default_max_tokens)
        self._inflight.add(eid)
        try:
            if p.stream:
                await self._stream(req, p, gen)
            else:
                await self._collect(req, p, gen)
        finally:
            self._inflight.discard(eid)

    async def _collect(self, req: RequestStream, p: ParsedRequest, gen: GenerationRequest) -> None:
        """Non-streaming: gather every delta, answer one body."""
        loop = asyncio.get_running_loop()
        agen = self.engine.generate(gen)
        texts: list[str] = []
        last = None
        finished = False
        ttft = None
        try:
            async for d in agen:
                if ttft is None:
                    ttft = loop.time() - req.started
                if d.text:
                    texts.append(d.text)
                last = d
                if d.finish_reason is not None:
                    finished = True
                    break
        except asyncio.CancelledError:
            if req.cancel_reason == "shutdown":
                req.respond_error(WireError(503, "The server is shutting down.", type="server_error",
                                            code="shutting_down"))
                self._log_done(req, gen, "shutdown", last, ttft)
                return
            raise
        except Exception as e:
            raise self._engine_error(req, e) from None
        finally:
            await self._release(agen, gen, finished)
        if last is None or last.finish_reason is None:
            raise WireError(500, "The engine ended the request without a result.", type="server_error",
                            code="internal_error")
        if last.finish_reason in ("error", "cancelled"):
            self._log_done(req, gen, last.finish_reason, last, ttft)
            status = 500 if last.finish_reason == "error" else 503
            raise WireError(status, last.error or f"The request was {last.finish_reason} by the server.",
                            type="server_error", code=last.finish_reason)
        body = wire.completion_response(p.kind, wire.response_id(p.kind, req.request_id), wire.now(),
                                        self.engine.model_id, "".join(texts), last.finish_reason,
                                        last.prompt_tokens, last.completion_tokens)
        if wire.wants_msgpack(req.header("accept")):
            req.respond(200, wire.msgpack_bytes(body), "application/x-msgpack")
        else:
            req.respond_json(200, body)
        self._log_done(req, gen, last.finish_reason, last, ttft)

    async def _stream(self, req: RequestStream, p: ParsedRequest, gen: GenerationRequest) -> None:
        """Streaming: headers at once, a chunk per delta, a final chunk, optional usage, [DONE]."""
        loop = asyncio.get_running_loop()
        packed = wire.wants_msgpack(req.header("accept"))
        enc = wire.msgpack_frame if packed else wire.sse_event
        done = wire.MSGPACK_DONE if packed else wire.SSE_DONE
        rid = wire.response_id(p.kind, req.request_id)
        created = wire.now()
        model = self.engine.model_id

        def chunk(**kw: Any) -> bytes:
            return enc(wire.stream_chunk(p.kind, rid, created, model, include_usage=p.include_usage, **kw))

        agen = self.engine.generate(gen)
        # Run the generator's first step before the headers go out: an engine that refuses at once
        # (admission: queue full, deadline unreachable) still gets a proper 429/503.
        first = asyncio.ensure_future(agen.__anext__())
        finished = False
        last = None
        ttft = None
        try:
            await asyncio.sleep(0)
            if first.done() and not first.cancelled() and first.exception() is not None:
                exc = first.exception()
                if not isinstance(exc, StopAsyncIteration):
                    raise self._engine_error(req, exc)
            if not req.start(200, "application/x-msgpack" if packed else "text/event-stream",
                             [("cache-control", "no-cache")]):
                return
            if p.kind == "chat" and not await req.write(chunk(role=True)):
                return
            try:
                d = await first
                while True:
                    if ttft is None:
                        ttft = loop.time() - req.started
                    last = d
                    if d.finish_reason in ("error", "cancelled"):
                        finished = True
                        msg = d.error or f"The request was {d.finish_reason} by the server."
                        await req.write(enc(wire.error_body(msg, type="server_error", code=d.finish_reason)))
                        break
                    if d.text and not await req.write(chunk(text=d.text)):
                        return
                    if d.finish_reason is not None:
                        finished = True
                        tail = chunk(text="" if p.kind == "completion" else None, finish_reason=d.finish_reason)
                        if p.include_usage:
                            tail += enc(wire.usage_chunk(p.kind, rid, created, model, d.prompt_tokens,
                                                         d.completion_tokens))
                        if not await req.write(tail):
                            return
                        break
                    d = await agen.__anext__()
            except StopAsyncIteration:
                await req.write(enc(wire.error_body("The engine ended the stream without a result.",
                                                    type="server_error", code="internal_error")))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                err = self._engine_error(req, e)
                await req.write(enc(wire.error_body(err.message, type=err.type, code=err.code)))
            req.finish(done)
            self._log_done(req, gen, last.finish_reason if last else "error", last, ttft)
        except asyncio.CancelledError:
            if req.cancel_reason == "shutdown" and req.headers_sent and not req.closed:
                req.finish(enc(wire.error_body("The server is shutting down.", type="server_error",
                                               code="shutting_down")) + done)
                self._log_done(req, gen, "shutdown", last, ttft)
                return
            if req.cancel_reason == "shutdown" and not req.headers_sent:
                req.respond_error(WireError(503, "The server is shutting down.", type="server_error",
                                            code="shutting_down"))
                return
            raise
        finally:
            if not first.done():
                first.cancel()
                await asyncio.wait([first])
            await self._release(agen, gen, finished)

    async def _release(self, agen: Any, gen: GenerationRequest, finished: bool) -> None:
        """Cancel an unfinished sequence and close the generator (which also cancels it)."""
        if not finished:
            try:
                self.engine.cancel(gen.request_id)
            except Exception as e:
                log.warning("engine cancel failed %s", fields(rid=gen.request_id, error=repr(e)))
        try:
            await agen.aclose()
        except (Exception, asyncio.CancelledError) as e:  # a generator closed mid-step
            log.debug("generator close failed %s", fields(rid=gen.request_id, error=repr(e)))

    def _engine_error(self, req: RequestStream, exc: BaseException) -> WireError:
        """Map an exception from engine.generate: `http_status` (+`retry_after`, `code`) attributes choose
        the status (admission: 429/503); ValueError is a 400; anything else a logged 500."""
        status = getattr(exc, "http_status", None) or getattr(exc, "status", None)
        if isinstance(status, int) and 400 <= status < 600:
            headers = []
            retry = getattr(exc, "retry_after", None)
            if retry is not None:
                headers.append(("retry-after", str(max(1, int(round(float(retry)))))))
            kind = "invalid_request_error" if status < 500 and status != 429 else "server_error"
            if status == 429:
                kind = "rate_limit_error"
            return WireError(status, str(exc) or "Request refused.", type=kind, code=getattr(exc, "code", None),
                             headers=headers)
        if isinstance(exc, ValueError):
            return WireError(400, str(exc), code="invalid_value")
        log.error("engine error %s", fields(rid=req.request_id, error=repr(exc)), exc_info=exc)
        return WireError(500, "Internal error while generating.", type="server_error", code="internal_error")

    def _log_done(self, req: RequestStream, gen: GenerationRequest, finish: str, last: Any,
                  ttft: float | None) -> None:
        loop = asyncio.get_running_loop()
        log.info("request done %s", fields(
            rid=req.request_id, path=req.path, tier=gen.tier, status=req.status, finish=finish,
            prompt_tokens=getattr(last, "prompt_tokens", len(gen.prompt_token_ids)),
            completion_tokens=getattr(last, "completion_tokens", 0),
            ttft_ms=round(ttft * 1000, 1) if ttft is not None else "-",
            duration_ms=round((loop.time() - req.started) * 1000, 1)))
