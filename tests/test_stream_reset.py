"""A client that resets its stream mid-generation frees that sequence's KV blocks at once."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from edged.engine.setup import EngineSettings, build_engine
from edged.models.loader import LoadedModel
from edged.server.h3_client import H3Client
from edged.server.h3_server import serve
from edged.server.routes import Router
from edged.server.settings import ServerSettings
from edged.server.tls import ensure_cert

pytestmark = pytest.mark.slow


def test_a_reset_stream_frees_its_kv_blocks_within_one_engine_step(loaded_model: LoadedModel,
                                                                    tmp_path: Path) -> None:
    engine = build_engine(loaded_model, EngineSettings(num_kv_blocks=256, max_num_seqs=8))
    blocks, counters = engine.engine.blocks, engine.engine.counters

    async def main() -> None:
        engine.start()
        cert, key = ensure_cert(tmp_path)
        server = await serve(Router(engine, ServerSettings()), "127.0.0.1", 0, cert, key)
        try:
            async with H3Client("127.0.0.1", server.port, ca_file=cert) as c:
                body = json.dumps({"messages": [{"role": "user", "content": "Tell me a long story."}],
                                   "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True})
                rs = await c.stream("POST", "/v1/chat/completions", {"content-type": "application/json"},
                                    body.encode())
                chunks = 0
                async for _ in rs:
                    chunks += 1
                    if chunks == 5:
                        break
                assert blocks.num_used > 0
                step_at_reset = counters.steps
                rs.reset()
                for _ in range(400):
                    if blocks.num_used == 0:
                        break
                    await asyncio.sleep(0.01)
                # The step in flight when the reset landed may finish; the cancel is applied before the next.
                assert blocks.num_used == 0
                assert counters.steps - step_at_reset <= 2
                assert not engine.engine.batcher.has_work()
        finally:
            server.close()
            engine.engine.stop()

    asyncio.run(main())
