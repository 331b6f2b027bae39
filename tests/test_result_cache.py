"""The persistent exact result cache: keys, LRU + TTL, live reconfigure, and surviving bad files and SIGKILL."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import select
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from edged.cache.result_cache import (
    FILENAME,
    CachedResult,
    ResultCache,
    db_path,
    is_cacheable,
    make_key,
    run_cache_command,
)
from edged.engine.request import SamplingParams
from helpers.cache_writer import expected_result

WRITER = Path(__file__).parent / "helpers" / "cache_writer.py"
GREEDY = {"temperature": 0, "top_p": 1.0, "top_k": 0, "seed": None, "max_tokens": 16}


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def result(n: int = 0, text_len: int = 100) -> CachedResult:
    return CachedResult([n, n + 1, n + 2], "x" * text_len, "stop", 5, 3)


def key(i: int) -> str:
    return make_key("m", [i], GREEDY)


def entry_size(cache: ResultCache, k: str) -> int:
    return raw(cache.path).execute("SELECT size FROM entries WHERE key = ?", (k,)).fetchone()[0]


def raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(str(path), isolation_level=None)


@pytest.fixture
def cache(tmp_path: Path):
    c = ResultCache.open(db_path(tmp_path), max_bytes=10_000_000, ttl_s=None, enabled=True)
    yield c
    c.close()


def corrupt_files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if ".corrupt-" in p.name)


# -- keys -------------------------------------------------------------------------------------


def test_key_changes_with_model_tokens_and_every_sampling_param() -> None:
    base = dataclasses.asdict(SamplingParams(temperature=0.0))
    k = make_key("m", [1, 2, 3], base)
    assert k == make_key("m", [1, 2, 3], dict(reversed(list(base.items()))))  # key order is irrelevant
    assert k == make_key("m", (1, 2, 3), SamplingParams(temperature=0.0))  # dataclass == its dict
    assert len(k) == 64 and int(k, 16) >= 0

    assert make_key("m2", [1, 2, 3], base) != k
    for tokens in ([1, 2], [1, 2, 3, 4], [3, 2, 1], [1, 2, 4], [0, 1, 2, 3]):
        assert make_key("m", tokens, base) != k, tokens

    changed = {
        "temperature": 0.5, "top_p": 0.9, "top_k": 40, "seed": 7, "max_tokens": 17,
        "stop": ["\n"], "stop_token_ids": [2], "ignore_eos": True,
    }
    assert changed.keys() == base.keys(), "a SamplingParams field is not covered by this test"
    seen = {k}
    for name, value in changed.items():
        kk = make_key("m", [1, 2, 3], {**base, name: value})
        assert kk not in seen, name
        seen.add(kk)
    assert make_key("m", [1, 2, 3], {**base, "frequency_penalty": 0.1}) != k  # unknown params count too


def test_key_spells_equal_numbers_once() -> None:
    assert make_key("m", [1], {"temperature": 0}) == make_key("m", [1], {"temperature": 0.0})
    assert make_key("m", [1], {"top_p": 1}) == make_key("m", [1], {"top_p": 1.0})
    assert make_key("m", [1], {"top_p": 0.95}) != make_key("m", [1], {"top_p": 0.9500001})
    assert make_key("m", [1], {"ignore_eos": True}) != make_key("m", [1], {"ignore_eos": 1})
    with pytest.raises(TypeError):
        make_key("m", [1.5], {})  # type: ignore[list-item]


def test_only_deterministic_requests_are_cacheable() -> None:
    assert is_cacheable({"temperature": 0})
    assert is_cacheable({"temperature": 0.0, "seed": None})
    assert is_cacheable({"temperature": 0.8, "seed": 1234})
    assert is_cacheable(SamplingParams(temperature=0.0))
    assert not is_cacheable({"temperature": 0.8})
    assert not is_cacheable({"temperature": 0.8, "seed": None})
    assert not is_cacheable({})  # OpenAI default temperature is 1
    assert not is_cacheable(SamplingParams())
    assert not is_cacheable({"temperature": 0, "n": 2})
    assert not is_cacheable({"temperature": 0, "logprobs": True})


# -- basic behaviour ----------------------------------------------------------------------------


def test_put_get_roundtrip_and_counters(cache: ResultCache) -> None:
    r = CachedResult([5, 6, 7], "héllo ✓", "length", 12, 3)
    assert cache.get(key(1)) is None
    cache.put(key(1), r)
    assert cache.get(key(1)) == r
    assert cache.get(key(2)) is None
    s = cache.stats()
    assert (s["entries"], s["hits"], s["misses"], s["errors"]) == (1, 1, 2, 0)
    assert s["bytes"] == entry_size(cache, key(1)) > 0
    assert s["path"] == str(cache.path) and cache.path.name == FILENAME
    assert raw(cache.path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_put_replaces_and_partial_results_are_not_stored(cache: ResultCache) -> None:
    cache.put(key(1), result(1))
    cache.put(key(1), result(2, text_len=300))
    assert cache.get(key(1)) == result(2, text_len=300)
    assert cache.stats()["entries"] == 1
    assert cache.stats()["bytes"] == entry_size(cache, key(1))
    for reason in ("cancelled", "error"):
        cache.put(key(9), CachedResult([1], "par", reason, 1, 1))
        assert cache.get(key(9)) is None


def test_ttl_expiry(tmp_path: Path) -> None:
    clock = Clock()
    c = ResultCache.open(db_path(tmp_path), max_bytes=None, ttl_s=60, enabled=True, clock=clock)
    c.put(key(1), result(1))
    clock.t += 59
    assert c.get(key(1)) == result(1)  # reading does not extend the TTL
    clock.t += 1
    assert c.get(key(1)) is None
    s = c.stats()
    assert (s["entries"], s["expired"], s["misses"]) == (0, 1, 1)
    assert raw(c.path).execute("SELECT COUNT(*) FROM entries").fetchone()[0] == 0

    c.put(key(2), result(2))
    clock.t += 61
    c.put(key(3), result(3))  # a put also sweeps out expired entries
    assert c.stats()["entries"] == 1
    assert c.get(key(3)) == result(3)
    c.close()


def test_lru_eviction_order_under_byte_cap(tmp_path: Path) -> None:
    clock = Clock()
    probe = ResultCache.open(tmp_path / "probe.sqlite3", None, None)
    probe.put(key(0), result(0))
    size = probe.stats()["bytes"]
    probe.close()

    c = ResultCache.open(db_path(tmp_path), max_bytes=3 * size, ttl_s=None, enabled=True, clock=clock)
    for i in (1, 2, 3):
        clock.t += 1
        c.put(key(i), result(i))
    clock.t += 1
    assert c.get(key(1)) is not None  # 1 is now the most recently used; 2 the least
    clock.t += 1
    c.put(key(4), result(4))
    assert c.get(key(2)) is None
    clock.t += 1
    c.put(key(5), result(5))  # next least recently used: 3
    assert c.get(key(3)) is None
    assert all(c.get(key(i)) is not None for i in (1, 4, 5))
    s = c.stats()
    assert (s["entries"], s["bytes"], s["evictions"]) == (3, 3 * size, 2)
    c.put(key(6), result(6, text_len=10 * size))  # bigger than the whole cap: not stored, evicts nothing
    assert c.get(key(6)) is None and c.stats()["entries"] == 3
    c.close()


def test_reconfigure_shrinks_expires_and_disables_at_once(tmp_path: Path) -> None:
    clock = Clock()
    c = ResultCache.open(db_path(tmp_path), max_bytes=None, ttl_s=None, enabled=True, clock=clock)
    for i in range(5):
        clock.t += 1
        c.put(key(i), result(i))
    size = entry_size(c, key(0))

    c.reconfigure(max_bytes=2 * size, ttl_s=None, enabled=True)
    assert c.stats()["entries"] == 2 and c.stats()["evictions"] == 3
    assert c.get(key(3)) is not None and c.get(key(4)) is not None
    assert raw(c.path).execute("SELECT COUNT(*) FROM entries").fetchone()[0] == 2

    clock.t += 100
    c.put(key(9), result(9))  # evicts 3 (least recently read)
    c.reconfigure(max_bytes=2 * size, ttl_s=50, enabled=True)
    assert c.stats()["entries"] == 1 and c.get(key(9)) == result(9)

    c.reconfigure(max_bytes=2 * size, ttl_s=50, enabled=False)
    assert not c.available and c.get(key(9)) is None
    c.put(key(10), result(10))  # ignored while disabled
    c.reconfigure(max_bytes=2 * size, ttl_s=50, enabled=True)
    assert c.get(key(9)) == result(9) and c.get(key(10)) is None
    c.close()


def test_disabled_cache_does_not_touch_the_disk(tmp_path: Path) -> None:
    c = ResultCache.open(db_path(tmp_path), max_bytes=None, ttl_s=None, enabled=False)
    c.put(key(1), result(1))
    assert c.get(key(1)) is None
    assert list(tmp_path.iterdir()) == []
    c.close()


def test_survives_reopen(tmp_path: Path) -> None:
    c = ResultCache.open(db_path(tmp_path), max_bytes=None, ttl_s=3600, enabled=True)
    for i in range(20):
        c.put(key(i), result(i))
    c.close()
    c = ResultCache.open(db_path(tmp_path), max_bytes=None, ttl_s=3600, enabled=True)
    assert c.stats()["entries"] == 20
    assert all(c.get(key(i)) == result(i) for i in range(20))
    c.close()
    assert c.get(key(1)) is None  # closed: a miss, not an exception


# -- bad files and rows ---------------------------------------------------------------------------


def _filled_file(tmp_path: Path) -> Path:
    path = db_path(tmp_path)
    c = ResultCache.open(path, max_bytes=None, ttl_s=None)
    for i in range(200):
        c.put(key(i), result(i, text_len=2000))
    c.close()
    return path


@pytest.mark.parametrize("damage", ["garbage", "garbage_with_header", "truncated", "directory"])
def test_bad_file_is_moved_aside_and_replaced(tmp_path: Path, damage: str, caplog) -> None:
    path = _filled_file(tmp_path)
    size = path.stat().st_size
    if damage == "garbage":
        path.write_bytes(random.Random(1).randbytes(size))
    elif damage == "garbage_with_header":
        path.write_bytes(path.read_bytes()[:100] + random.Random(2).randbytes(size - 100))
    elif damage == "truncated":
        with open(path, "r+b") as f:
            f.truncate(size // 2)
    else:
        path.unlink()
        path.mkdir()
        (path / "junk").write_text("x")

    with caplog.at_level(logging.WARNING, logger="edged.cache"):
        c = ResultCache.open(path, max_bytes=None, ttl_s=None)
    assert c.available and c.stats()["entries"] == 0
    moved = corrupt_files(tmp_path)
    assert [p.name.startswith(f"{FILENAME}.corrupt-") for p in moved] == [True]
    assert any("moved aside" in r.getMessage() for r in caplog.records)
    c.put(key(1), result(1))
    assert c.get(key(1)) == result(1)
    c.close()
    assert raw(path).execute("PRAGMA quick_check").fetchone()[0] == "ok"


def test_unusable_location_serves_without_cache(tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    c = ResultCache.open(blocker / FILENAME, max_bytes=None, ttl_s=None)
    assert not c.available
    c.put(key(1), result(1))
    assert c.get(key(1)) is None
    c.close()


@pytest.mark.parametrize(
    "tamper",
    [
        "UPDATE entries SET payload = CAST(substr(payload, 1, 10) || X'00' || substr(payload, 12) AS BLOB)",
        "UPDATE entries SET payload = substr(payload, 1, length(payload) - 5)",
        "UPDATE entries SET checksum = checksum + 1",
        "UPDATE entries SET payload = 'not a blob'",
    ],
)
def test_corrupt_row_is_a_miss_and_is_deleted(cache: ResultCache, tamper: str) -> None:
    cache.put(key(1), CachedResult(list(range(20)), "abcdefghijklmnop" * 4, "stop", 3, 20))
    cache.put(key(2), result(2))
    raw(cache.path).execute(tamper + " WHERE key = ?", (key(1),))
    assert cache.get(key(1)) is None
    assert cache.get(key(2)) == result(2)
    s = cache.stats()
    assert (s["corrupt"], s["entries"], s["errors"]) == (1, 1, 0)
    assert raw(cache.path).execute("SELECT COUNT(*) FROM entries WHERE key = ?", (key(1),)).fetchone()[0] == 0


def test_failures_are_misses_not_exceptions(cache: ResultCache) -> None:
    cache.put(key(1), result(1))
    cache._conn.close()  # type: ignore[union-attr]  # the connection breaks under us
    assert cache.get(key(1)) is None
    cache.put(key(2), result(2))
    assert cache.stats()["errors"] == 2


def test_corruption_found_while_serving_replaces_the_file(cache: ResultCache, monkeypatch) -> None:
    cache.put(key(1), result(1))
    def corrupt_read(k: str) -> None:
        err = sqlite3.DatabaseError("database disk image is malformed")
        err.sqlite_errorcode = 11  # SQLITE_CORRUPT
        raise err

    monkeypatch.setattr(cache, "_get", corrupt_read)
    assert cache.get(key(1)) is None
    monkeypatch.undo()
    assert cache.available and len(corrupt_files(cache.path.parent)) == 1
    cache.put(key(2), result(2))
    assert cache.get(key(2)) == result(2) and cache.get(key(1)) is None


# -- threads, asyncio, CLI ----------------------------------------------------------------------


def test_concurrent_threads(cache: ResultCache) -> None:
    def work(t: int) -> None:
        for i in range(50):
            cache.put(key(t * 1000 + i), result(i))
            assert cache.get(key(t * 1000 + i)) == result(i)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert cache.stats()["entries"] == 200 and cache.stats()["errors"] == 0


def test_async_wrappers_and_put_nowait(tmp_path: Path) -> None:
    c = ResultCache.open(db_path(tmp_path), max_bytes=None, ttl_s=None)

    async def main() -> None:
        await c.aput(key(1), result(1))
        assert await c.aget(key(1)) == result(1)
        assert await c.aget(key(2)) is None
        loop_thread = threading.get_ident()
        c.put_nowait(key(3), result(3))  # returns at once; written on the cache thread
        assert threading.get_ident() == loop_thread

    asyncio.run(main())
    c.close()  # waits for queued puts
    c = ResultCache.open(db_path(tmp_path), max_bytes=None, ttl_s=None)
    assert c.get(key(3)) == result(3)
    c.close()


def test_cli_stats_and_clear(tmp_path: Path, capsys) -> None:
    assert run_cache_command("stats", str(tmp_path)) == 0
    assert "no result cache" in capsys.readouterr().out
    c = ResultCache.open(db_path(tmp_path), max_bytes=None, ttl_s=None)
    for i in range(3):
        c.put(key(i), result(i))
    total = c.stats()["bytes"]
    c.close()

    assert run_cache_command("stats", str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "entries: 3\n" in out and f"bytes: {total}\n" in out
    assert run_cache_command("clear", str(tmp_path)) == 0
    assert "cleared 3 entries" in capsys.readouterr().out
    assert run_cache_command("stats", str(tmp_path)) == 0
    assert "entries: 0\n" in capsys.readouterr().out
    assert run_cache_command("bogus", str(tmp_path)) == 2


# -- crash safety ------------------------------------------------------------------------------

KILLS = 20
WRITER_CAP = 3_000_000


def _check_after_kill(path: Path, committed: list[str]) -> int:
    assert corrupt_files(path.parent) == [], "a killed writer must never leave a corrupt file"
    c = ResultCache.open(path, max_bytes=WRITER_CAP, ttl_s=None, enabled=True)
    try:
        assert c.available and corrupt_files(path.parent) == []
        conn = raw(path)
        assert conn.execute("PRAGMA quick_check").fetchall() == [("ok",)]
        keys = {k for (k,) in conn.execute("SELECT key FROM entries")}
        n, total = conn.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM entries").fetchone()
        conn.close()
        # Nothing committed is lost: the newest puts are far from LRU eviction (~80 entries fit).
        assert set(committed[-10:]) <= keys
        for k in keys:
            assert c.get(k) == expected_result(k), k
        s = c.stats()
        assert (s["corrupt"], s["errors"], s["hits"]) == (0, 0, len(keys))
        assert (s["entries"], s["bytes"]) == (n, total)
        assert total <= WRITER_CAP
        return len(committed)
    finally:
        c.close()


def test_sigkill_mid_write_never_corrupts(tmp_path: Path) -> None:
    """Each round kills the writer once it has committed a random number of puts (1..12): a moment
    in its work, not in wall-clock time, so a slower or faster machine kills at the same places."""
    path = db_path(tmp_path)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for i in range(KILLS):
        want = rng.randint(1, 12)
        proc = subprocess.Popen([sys.executable, str(WRITER), str(path), str(WRITER_CAP), "3"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        buf = b""
        try:
            fd = proc.stdout.fileno()  # type: ignore[union-attr]
            while buf.count(b"\n") < want + 1:  # "started", then `want` committed keys
                if not select.select([fd], [], [], 60)[0]:
                    break
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                buf += chunk
        finally:
            proc.kill()  # SIGKILL
            rest, err = proc.communicate(timeout=10)
        lines = (buf + rest).decode().split("\n")
        assert lines[0] == "started", f"writer did not start: {lines[0]!r} {err.decode()}"
        assert proc.returncode == -signal.SIGKILL, f"writer exited on its own: {proc.returncode} {err.decode()}"
        committed = lines[1:-1]  # the last piece is a line cut short by the kill, or ''
        assert len(committed) >= want, (want, committed, err.decode(), seed)
        _check_after_kill(path, committed)
