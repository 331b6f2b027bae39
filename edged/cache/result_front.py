"""The result cache in front of the engine: deterministic repeats are answered from disk."""
from __future__ import annotations

import logging
from typing import AsyncIterator, Callable

from edged.engine.client import TextDelta
from edged.engine.request import GenerationRequest
from edged.log import fields

from .result_cache import CachedResult, ResultCache, is_cacheable, make_key

log = logging.getLogger("edged.cache")


class ResultCacheFront:
    def __init__(self, cache: ResultCache, model_id: str) -> None:
        self.cache = cache
        self.model_id = model_id
        self.on_lookup: Callable[[bool], None] | None = None  # (hit): the lookup counters in /metrics

    async def lookup(self, gen: GenerationRequest) -> tuple[str | None, CachedResult | None]:
        """(key, hit): key None when the request is not cacheable or the cache is off."""
        if not self.cache.enabled or not is_cacheable(gen.sampling):
            return None, None
        key = make_key(self.model_id, gen.prompt_token_ids, gen.sampling)
        hit = await self.cache.aget(key)
        if self.on_lookup is not None:
            self.on_lookup(hit is not None)
        return key, hit

    @staticmethod
    async def replay(hit: CachedResult) -> AsyncIterator[TextDelta]:
        yield TextDelta(hit.text, list(hit.token_ids), hit.finish_reason, hit.prompt_tokens, hit.completion_tokens)

    async def recording(self, key: str, source: AsyncIterator[TextDelta]) -> AsyncIterator[TextDelta]:
        """Pass the engine's deltas through; store the whole result once it ends normally."""
        text: list[str] = []
        tokens: list[int] = []
        try:
            async for d in source:
                text.append(d.text)
                tokens.extend(d.token_ids)
                if d.finish_reason in ("stop", "length"):
                    self.cache.put_nowait(key, CachedResult(tokens, "".join(text), d.finish_reason,
                                                            d.prompt_tokens, d.completion_tokens))
                    log.debug("result cached %s", fields(key=key[:16], tokens=len(tokens)))
                yield d
                if d.finish_reason is not None:
                    return
        finally:
            await source.aclose()  # cancels the sequence if the client went away
