"""Routing and the endpoint handlers: OpenAI completions (JSON, SSE, msgpack), models, health.

Each handler gets an `HttpRequest` (request.py; from HTTP/3, HTTP/2 or HTTP/1.1) whose body is
complete, validates it with openai_wire, asks the engine, and writes the response. Validation errors are answered before any
engine work; errors after a stream started become a final `{"error": ...}` event and `[DONE]`.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

from edged.log import fields
from edged.server import auth, chat_page
from edged.server import openai_wire as wire
from edged.server.openai_wire import ParsedRequest, WireError

if TYPE_CHECKING:
    from edged.cache.result_front import ResultCacheFront
    from edged.engine.client import EngineClient
    from edged.engine.request import GenerationRequest
    from edged.server.request import HttpRequest as RequestStream  # any transport's request
    from edged.server.settings import ServerSettings

log = logging.getLogger("edged.server")

Handler = Callable[["RequestStream"], Awaitable[None]]
PUBLIC_PATHS = frozenset({"/healthz"})  # no API key needed
SHOWN_PATH_CHARS = 128  # a path echoed in an error body or a log line is cut to this


def shown_path(path: str) -> str:
    return wire.shown(path, SHOWN_PATH_CHARS)


@dataclass(slots=True)
class RequestRecord:
    """One finished completion request, or any rejected request: the access log line and what
    `Router.observers` (metrics) receive."""

    request_id: str
    path: str
    status: int | None  # None: no response was sent (the client went away first)
    outcome: str  # "stop" | "length" | "error" | "cancelled" | "timeout" | "shutdown" | "client_gone" | "rejected"
    tier: str | None = None
    code: str | None = None  # the error code of a rejection
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None  # from the request's headers to the first delta
    duration_s: float = 0.0
    protocol: str = "h3"  # "h1" | "h2" | "h3"


class Router:
    """Path -> method -> handler; `add()` lets the daemon mount more (e.g. GET /metrics)."""

    def __init__(self, engine: EngineClient, settings: ServerSettings,
                 sampling_defaults: Mapping[str, float | int] | None = None) -> None:
        self.engine = engine
        self.settings = settings
        # The model's sampling defaults (the core's ModelInfo; an in-process engine may carry them):
        # what a request that omits temperature / top_p / top_k / max_tokens gets.
        if sampling_defaults is None:
            sampling_defaults = getattr(engine, "sampling_defaults", None)
        self.sampling_defaults: dict[str, float | int] = dict(sampling_defaults or {})
        self.created = wire.now()
        self.draining = False
        self.result_cache: ResultCacheFront | None = None  # set by the daemon when the cache is configured
        self.health_check: Callable[[], bool] | None = None  # set by the daemon: False -> 503
        self.observers: list[Callable[[RequestRecord], None]] = []  # e.g. metrics; called on the loop
        self.routes: dict[str, dict[str, Handler]] = {}
        self.public_paths: set[str] = set(PUBLIC_PATHS)
        self._inflight: set[str] = set()  # engine request ids: unique even when clients reuse x-request-id
        self._suffix = itertools.count(1)
        self.add("POST", "/v1/chat/completions", self.chat_completions)
        self.add("POST", "/v1/completions", self.completions)
        self.add("GET", "/v1/models", self.models)
        self.add("GET", "/healthz", self.healthz)
        chat_page.mount(self)  # GET /: the chat page

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
                raise WireError(404, f"No route for {shown_path(req.path)}.", code="not_found")
            handler = methods.get(req.method)
            if handler is None:
                allow = ", ".join(sorted(methods))
                raise WireError(405, f"Method {wire.shown(req.method)} is not allowed on {shown_path(path)}; "
                                     f"use {allow}.",
                                code="method_not_allowed", headers=[("allow", allow)])
            if self.draining and path != "/healthz":
                raise WireError(503, "The server is shutting down.", type="server_error", code="shutting_down",
                                headers=[("retry-after", str(self.settings.drain_retry_after_s))])
            if self.settings.api_keys is not None and path not in self.public_paths:
                await self._authenticate(req)
            await handler(req)
        except WireError as e:
            if not req.respond_error(e) and not req.closed:
                req.abort()
            if req.outcome is None:  # refused before any generation (validation, auth, admission)
                req.outcome = "rejected"
                self.rejected(req, e)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("request failed %s", fields(rid=req.request_id, path=shown_path(req.path), error=repr(e)))
            if not req.headers_sent:
                req.respond_error(WireError(500, f"Internal server error (request id {req.request_id}).",
                                            type="server_error", code="internal_error"))
            else:
                req.abort()
            req.outcome = req.outcome or "error"
        finally:
            if req.tier is not None and req.outcome != "rejected":  # a completion that reached the engine
                self._record(RequestRecord(
                    req.request_id, shown_path(req.path), req.status, self._outcome(req), req.tier, None,
                    req.prompt_tokens, req.completion_tokens, req.ttft, self._elapsed(req), req.http_version))

    def rejected(self, req: RequestStream, err: WireError) -> None:
        """A request refused before generation (also called by the protocol for 408/413)."""
        self._record(RequestRecord(req.request_id, shown_path(req.path) or "-", err.status, "rejected", req.tier,
                                   err.code, duration_s=self._elapsed(req), protocol=req.http_version),
                     param=err.param)

    @staticmethod
    def _outcome(req: RequestStream) -> str:
        if req.outcome is not None:
            return req.outcome
        if req.cancel_reason is not None:
            return "shutdown" if req.cancel_reason == "shutdown" else "client_gone"
        return "client_gone"  # a write failed: the stream was reset or the client stalled

    @staticmethod
    def _elapsed(req: RequestStream) -> float:
        return req.elapsed()

    def _record(self, rec: RequestRecord, **extra: Any) -> None:
        level = logging.INFO if self.settings.access_log else logging.DEBUG
        if rec.outcome == "rejected":
            log.log(level, "request rejected %s", fields(rid=rec.request_id, path=rec.path, status=rec.status,
                                                          code=rec.code, protocol=rec.protocol, **extra))
        else:
            log.log(level, "request done %s", fields(
                rid=rec.request_id, path=rec.path, protocol=rec.protocol, tier=rec.tier,
                status=rec.status if rec.status else "-",
                outcome=rec.outcome, prompt_tokens=rec.prompt_tokens, completion_tokens=rec.completion_tokens,
                ttft_ms=round(rec.ttft_s * 1000, 1) if rec.ttft_s is not None else "-",
                duration_ms=round(rec.duration_s * 1000, 1)))
        for observer in self.observers:
            try:
                observer(rec)
            except Exception:
                log.exception("request observer failed %s", fields(rid=rec.request_id))

    async def _authenticate(self, req: RequestStream) -> None:
        """Bearer key -> policy (keys are stored as sha256 hex digests); then its rate limit, counted
        once for the whole daemon by the engine core."""
        policy = auth.lookup(req.header("authorization"), self.settings.api_keys or {})
        if policy is None:
            raise WireError(401, "Missing or invalid API key (send 'Authorization: Bearer KEY').",
                            code="invalid_api_key", headers=[("www-authenticate", "Bearer")])
        req.api_key = policy
        rps = float(policy.rate_limit_rps or 0)
        if rps <= 0:
            return
        wait = await self.engine.rate_limit(policy.name, rps, policy.burst or max(1, math.ceil(rps)))
        if wait is not None:
            raise WireError(429, f"Rate limit of {policy.rate_limit_rps:g} requests/s exceeded for key "
                                 f"'{policy.name}'.", type="rate_limit_error", code="rate_limit_exceeded",
                            headers=[("retry-after", str(int(wait)))])

    # ---- small endpoints

    async def healthz(self, req: RequestStream) -> None:
        if self.draining:
            req.respond_json(503, {"status": "draining"})
        elif self.health_check is not None and not self.health_check():
            req.respond_json(503, {"status": "unhealthy"})
        else:
            req.respond_json(200, {"status": "ok"})

    def shown_sampling_defaults(self) -> dict[str, float | int]:
        """What a request without sampling fields gets now (limits are live: computed per call)."""
        st = self.settings
        return wire.effective_sampling_defaults(self.sampling_defaults, st.default_max_tokens, st.max_tokens_limit)

    async def models(self, req: RequestStream) -> None:
        req.respond_json(200, wire.models_response(self.engine.model_id, self.created, self.engine.max_model_len,
                                                   self.shown_sampling_defaults()))

    async def model(self, req: RequestStream) -> None:
        name = req.path[len("/v1/models/"):].rstrip("/")
        if name != self.engine.model_id:
            raise WireError(404, f"The model '{name}' does not exist.", param="model", code="model_not_found")
        req.respond_json(200, wire.model_object(self.engine.model_id, self.created, self.engine.max_model_len,
                                                self.shown_sampling_defaults()))

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
        if isinstance(p.prompt, str):  # on the loop: see chat_completions
            if self.settings.allow_special_tokens_in_prompt:
                prompt_ids = self.engine.encode_with_special_tokens(p.prompt)
            else:  # control tokens written in the text stay text
                prompt_ids = self.engine.encode(p.prompt)
        else:
            prompt_ids = list(p.prompt or [])
        await self._complete(req, p, tier, prompt_ids)

    def _tier(self, req: RequestStream, p: ParsedRequest) -> str:
        """An API key's tier wins; else the x-edged-tier header, else the body's "tier", else default_tier."""
        st = self.settings
        if req.api_key is not None:
            return req.api_key.tier or st.default_tier
        h = req.header("x-edged-tier")
        if h:
            tier = wire.check_tier(h.strip(), "x-edged-tier")
        else:
            tier = p.tier or st.default_tier
        if st.tiers is not None and tier != st.default_tier and tier not in st.tiers:
            raise WireError(400, f"Unknown tier '{tier}'; known: {', '.join(st.tiers)}.",
                            param="x-edged-tier" if h else "tier", code="invalid_value")
        return tier

    def _engine_id(self, rid: str) -> str:
        eid = rid
        while eid in self._inflight:
            eid = f"{rid}.{next(self._suffix)}"
        return eid

    async def _complete(self, req: RequestStream, p: ParsedRequest, tier: str, prompt_ids: list[int]) -> None:
        st = self.settings
        limit = st.max_tokens_limit
        cap = st.tier_max_tokens.get(tier)
        if cap is not None:
            limit = cap if limit is None else min(limit, cap)
        eid = self._engine_id(req.request_id)
        gen = wire.make_generation_request(p, prompt_ids, eid, tier, self.engine.max_model_len,
                                           st.default_max_tokens, limit, st.max_prompt_tokens,
                                           getattr(self.engine, "vocab_size", None), self.sampling_defaults)
        req.tier, req.prompt_tokens = tier, len(prompt_ids)
        self._inflight.add(eid)
        try:
            agen = await self._generation(req, gen)
            async with asyncio.timeout(st.request_timeout_s) as deadline:
                if p.stream:
                    await self._stream(req, p, gen, agen)
                else:
                    await self._collect(req, p, gen, agen)
        except TimeoutError:
            if not deadline.expired():
                raise
            # The handlers' cleanup already cancelled the sequence; end the response with an error.
            msg = f"Generation exceeded the server's request timeout of {st.request_timeout_s:g} s."
            req.outcome = "timeout"
            if not req.headers_sent:
                raise WireError(504, msg, type="server_error", code="request_timeout") from None
            packed = wire.wants_msgpack(req.header("accept"))
            enc = wire.msgpack_frame if packed else wire.sse_event
            req.finish(enc(wire.error_body(msg, type="server_error", code="request_timeout")) +
                       (wire.MSGPACK_DONE if packed else wire.SSE_DONE))
        finally:
            self._inflight.discard(eid)

    async def _generation(self, req: RequestStream, gen: GenerationRequest) -> AsyncIterator[Any]:
        """The deltas of a request: replayed from the result cache on a hit (no engine work, no
        admission), else from the engine once it admitted the request (recorded into the cache when
        the request is deterministic). A refusal (SLA admission: 429/503) is raised here, before any
        response header went out."""
        front = self.result_cache
        key, hit = await front.lookup(gen) if front is not None else (None, None)
        if key is not None:
            req.response_headers.append(("x-edged-cache", "hit" if hit else "miss"))
        if hit is not None:
            req.cache_hit = True
            return front.replay(hit)
        try:
            agen = await self.engine.submit(gen)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise self._engine_error(req, e) from None
        return agen if key is None else front.recording(key, agen)

    async def _collect(self, req: RequestStream, p: ParsedRequest, gen: GenerationRequest, agen: Any) -> None:
        """Non-streaming: gather every delta, answer one body."""
        texts: list[str] = []
        last = None
        try:
            async for d in agen:
                self._progress(req, d)
                if d.text:
                    texts.append(d.text)
                last = d
                if d.finish_reason is not None:
                    break
        except asyncio.CancelledError:
            if req.cancel_reason == "shutdown":
                req.outcome = "shutdown"
                req.respond_error(WireError(503, "The server is shutting down.", type="server_error",
                                            code="shutting_down"))
                return
            raise
        except Exception as e:
            err = self._engine_error(req, e)
            if last is not None or err.code == "internal_error":  # else refused by admission: a rejection
                req.outcome = "error"
            raise err from None
        finally:
            await self._release(agen, gen, finished=last is not None and last.finish_reason is not None)
        if last is None or last.finish_reason is None:
            req.outcome = "error"
            raise WireError(500, "The engine ended the request without a result.", type="server_error",
                            code="internal_error")
        req.outcome = last.finish_reason
        if last.finish_reason in ("error", "cancelled"):
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

    @staticmethod
    def _progress(req: RequestStream, d: Any) -> None:
        if req.ttft is None:
            req.ttft = req.elapsed()
        req.prompt_tokens, req.completion_tokens = d.prompt_tokens, d.completion_tokens

    async def _stream(self, req: RequestStream, p: ParsedRequest, gen: GenerationRequest, agen: Any) -> None:
        """Streaming: headers at once, a chunk per delta, a final chunk, optional usage, [DONE]."""
        packed = wire.wants_msgpack(req.header("accept"))
        enc = wire.msgpack_frame if packed else wire.sse_event
        done = wire.MSGPACK_DONE if packed else wire.SSE_DONE
        rid = wire.response_id(p.kind, req.request_id)
        created = wire.now()
        model = self.engine.model_id

        def chunk(**kw: Any) -> bytes:
            return enc(wire.stream_chunk(p.kind, rid, created, model, include_usage=p.include_usage, **kw))

        def error_event(message: str, code: str | None, type: str = "server_error") -> bytes:
            return enc(wire.error_body(message, type=type, code=code))

        finished = False
        try:
            if not req.start(200, "application/x-msgpack" if packed else "text/event-stream",
                             [("cache-control", "no-cache")]):
                return
            if p.kind == "chat" and not await req.write(chunk(role=True)):
                return
            try:
                async for d in agen:
                    self._progress(req, d)
                    if d.finish_reason in ("error", "cancelled"):
                        finished = True
                        req.outcome = d.finish_reason
                        msg = d.error or f"The request was {d.finish_reason} by the server."
                        tail = error_event(msg, d.finish_reason)
                        break
                    if d.text and not await req.write(chunk(text=d.text)):
                        return
                    if d.finish_reason is not None:
                        finished = True
                        req.outcome = d.finish_reason
                        tail = chunk(text="" if p.kind == "completion" else None, finish_reason=d.finish_reason)
                        if p.include_usage:
                            tail += enc(wire.usage_chunk(p.kind, rid, created, model, d.prompt_tokens,
                                                         d.completion_tokens))
                        break
                else:
                    req.outcome = "error"
                    tail = error_event("The engine ended the stream without a result.", "internal_error")
            except asyncio.CancelledError:
                raise
            except Exception as e:
                req.outcome = "error"
                err = self._engine_error(req, e)
                tail = error_event(err.message, err.code, err.type)
            req.finish(tail + done)
        except asyncio.CancelledError:
            if req.cancel_reason != "shutdown":
                raise
            req.outcome = "shutdown"
            if req.headers_sent:
                req.finish(error_event("The server is shutting down.", "shutting_down") + done)
            else:
                req.respond_error(WireError(503, "The server is shutting down.", type="server_error",
                                            code="shutting_down"))
        finally:
            await self._release(agen, gen, finished)

    async def _release(self, agen: Any, gen: GenerationRequest, finished: bool) -> None:
        """Close the delta stream: it cancels the sequence if the engine has not finished it."""
        try:
            await agen.aclose()
        except (Exception, asyncio.CancelledError) as e:  # a stream closed mid-step
            log.debug("stream close failed %s", fields(rid=gen.request_id, error=repr(e)))

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
        return WireError(500, f"Internal error while generating (request id {req.request_id}).",
                         type="server_error", code="internal_error")
