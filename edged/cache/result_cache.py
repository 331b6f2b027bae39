"""Persistent exact result cache: a deterministic request -> its finished generation, in SQLite.

Key: `make_key(model_id, prompt_token_ids, sampling)`, a sha256 over a canonical JSON of all three.
Only requests that always give the same tokens are cached (`is_cacheable`: greedy or seeded).

Storage: `<state_dir>/result_cache.sqlite3` (`db_path(state_dir)`), WAL journal, synchronous=NORMAL.
In WAL mode NORMAL never corrupts the file; a power loss can drop the last few commits (they
were not fsynced yet), a killed process loses nothing it committed. FULL would fsync every put,
which costs milliseconds on the eMMC/SD storage of edge nodes for data we can always recompute.
Each row holds a crc32 of key + payload, checked on every read: a bad row is a miss and is
deleted. A file that cannot be opened or fails `PRAGMA quick_check` is moved aside to
`<name>.corrupt-<UTC timestamp>` and a fresh one is created.

Size cap: `max_bytes` counts payload bytes (the file is larger by a small per-row overhead);
past it, least recently read entries are evicted in the same transaction as the put.
TTL counts from when the entry was written; an expired entry is a miss and is deleted.

Threads: every method is thread-safe (one connection behind a lock, one short transaction per
call). `get`/`put` do disk I/O, so the asyncio loop should use `aget` / `put_nowait`, which run
on this cache's own single worker thread; `stats()` never touches the disk. `get`, `put`,
`aget`, `aput`, `put_nowait` and `reconfigure` never raise on a cache failure: they log
(rate-limited), count an error, and behave as a miss.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import operator
import os
import sqlite3
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from edged.log import fields

log = logging.getLogger("edged.cache")

FILENAME = "result_cache.sqlite3"
SCHEMA_VERSION = 1
KEY_VERSION = 1
# A cancelled or failed generation is partial: never serve it again.
UNCACHEABLE_FINISH = frozenset({"cancelled", "error"})
MAX_PENDING_PUTS = 64  # put_nowait drops beyond this many queued writes (slow disk)
WARN_INTERVAL_S = 30.0

# SQLite primary result codes (sqlite3 exposes them only on 3.11+ as exception attributes).
_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_NOMEM, _SQLITE_READONLY = 5, 6, 7, 8
_SQLITE_CORRUPT, _SQLITE_FULL, _SQLITE_NOTADB = 11, 13, 26
# Errors that say nothing about the file itself: never move a cache aside for these.
_NOT_THE_FILES_FAULT = {_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_NOMEM, _SQLITE_READONLY, _SQLITE_FULL}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    checksum INTEGER NOT NULL,
    created_at REAL NOT NULL,
    last_access REAL NOT NULL,
    payload BLOB NOT NULL          -- last: the small columns stay on the row's first page
);
CREATE INDEX IF NOT EXISTS entries_by_access ON entries (last_access);
CREATE INDEX IF NOT EXISTS entries_by_created ON entries (created_at);
CREATE TABLE IF NOT EXISTS totals (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    entries INTEGER NOT NULL,
    bytes INTEGER NOT NULL
);
INSERT OR IGNORE INTO totals VALUES (0, 0, 0);
CREATE TRIGGER IF NOT EXISTS entries_ins AFTER INSERT ON entries BEGIN
    UPDATE totals SET entries = entries + 1, bytes = bytes + NEW.size WHERE id = 0;
END;
CREATE TRIGGER IF NOT EXISTS entries_del AFTER DELETE ON entries BEGIN
    UPDATE totals SET entries = entries - 1, bytes = bytes - OLD.size WHERE id = 0;
END;
CREATE TRIGGER IF NOT EXISTS entries_upd AFTER UPDATE OF size ON entries BEGIN
    UPDATE totals SET bytes = bytes - OLD.size + NEW.size WHERE id = 0;
END;
"""

_UPSERT = """
INSERT INTO entries (key, size, checksum, created_at, last_access, payload)
VALUES (?, ?, ?, ?, ?, ?)
ON CONFLICT (key) DO UPDATE SET size = excluded.size, checksum = excluded.checksum,
    created_at = excluded.created_at, last_access = excluded.last_access, payload = excluded.payload
"""


# ---------------------------------------------------------------------------------------------
# Keys


def _sampling_dict(sampling: Mapping[str, Any] | Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(sampling) and not isinstance(sampling, type):
        return dataclasses.asdict(sampling)
    return dict(sampling)


def _canon(v: Any) -> Any:
    """JSON-ready value with one spelling per meaning: 0 == 0.0, tuples are lists, numpy scalars are numbers."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return int(v) if math.isfinite(v) and v.is_integer() else v
    if isinstance(v, Mapping):
        return {str(k): _canon(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_canon(x) for x in v]
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return _canon(dataclasses.asdict(v))
    if hasattr(v, "item"):  # numpy scalar
        return _canon(v.item())
    raise TypeError(f"cannot use {type(v).__name__} in a result cache key")


def make_key(model_id: str, prompt_token_ids: Iterable[int], sampling: Mapping[str, Any] | Any) -> str:
    """sha256 hex of model id + prompt token ids + every sampling parameter (dict or SamplingParams).

    Pass the full parameter set (e.g. the engine's SamplingParams) so that defaults are explicit.
    """
    doc = {
        "v": KEY_VERSION,
        "model": str(model_id),
        "prompt": [operator.index(t) for t in prompt_token_ids],
        "sampling": _canon(_sampling_dict(sampling)),
    }
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def is_cacheable(sampling: Mapping[str, Any] | Any) -> bool:
    """True for requests that always yield the same single completion: greedy or seeded, n == 1,
    no logprobs (the cache does not store them)."""
    s = _sampling_dict(sampling)
    if s.get("logprobs") or s.get("top_logprobs"):
        return False
    if s.get("n", 1) not in (1, None):
        return False
    if s.get("seed") is not None:
        return True
    t = s.get("temperature", 1.0)
    return t is not None and t == 0


# ---------------------------------------------------------------------------------------------
# Values


@dataclass(slots=True)
class CachedResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


def _encode(r: CachedResult) -> bytes:
    return msgpack.packb(
        [[int(t) for t in r.token_ids], r.text, r.finish_reason, int(r.prompt_tokens), int(r.completion_tokens)],
        use_bin_type=True,
    )


def _decode(payload: bytes) -> CachedResult:
    toks, text, finish, prompt, completion = msgpack.unpackb(payload, raw=False)
    if not (isinstance(toks, list) and all(type(t) is int for t in toks)):
        raise ValueError("token_ids")
    if not (isinstance(text, str) and isinstance(finish, str) and type(prompt) is int and type(completion) is int):
        raise ValueError("fields")
    return CachedResult(toks, text, finish, prompt, completion)


def _checksum(key: str, payload: bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(key.encode("utf-8")))


class _Corrupt(Exception):
    pass


def _errcode(e: BaseException) -> int | None:
    code = getattr(e, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def db_path(state_dir: str | os.PathLike[str]) -> Path:
    return Path(state_dir) / FILENAME


# ---------------------------------------------------------------------------------------------
# The cache


class ResultCache:
    """See the module docstring. Build with `ResultCache.open(...)`."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_bytes: int | None,
        ttl_s: float | None,
        enabled: bool = True,
        *,
        clock: Callable[[], float] = time.time,
        busy_timeout_s: float = 1.0,
    ) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes  # None: no cap
        self.ttl_s = ttl_s  # None or <= 0: no expiry
        self.enabled = enabled
        self._clock = clock
        self._busy_timeout_s = busy_timeout_s
        self._lock = threading.Lock()  # guards the connection and the counters below but `dropped`
        self._conn: sqlite3.Connection | None = None
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edged-cache")
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._last_warn = -math.inf
        self._suppressed = 0
        # Counters (process-local) and the last seen totals: stats() reads them without I/O.
        self.hits = self.misses = self.evictions = self.expired = 0
        self.corrupt = self.errors = self.dropped = 0
        self._entries = self._bytes = 0

    @classmethod
    def open(cls, path: str | os.PathLike[str], max_bytes: int | None, ttl_s: float | None, enabled: bool = True,
             **options: Any) -> ResultCache:
        """Open (or create) the cache file at `path` (see `db_path`). Never raises on a bad file:
        it is moved aside; if even a fresh file cannot be made, the cache runs unavailable
        (every get is a miss). With enabled=False the file is not touched until enabled."""
        cache = cls(path, max_bytes, ttl_s, enabled, **options)  # options: clock, busy_timeout_s
        if enabled:
            with cache._lock:
                cache._conn = cache._connect()
        return cache

    # -- public, sync --------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self._conn is not None

    def get(self, key: str) -> CachedResult | None:
        """The entry for `key` (and mark it recently used), or None: absent, expired, bad row,
        cache disabled or failing."""
        if self._conn is None:
            return None
        try:
            with self._lock:
                return self._get(key)
        except Exception as e:  # the daemon must keep serving
            self._failed("get", e, miss=True)
            return None

    def put(self, key: str, result: CachedResult) -> None:
        """Store `result` under `key` (replacing), then expire and evict down to the cap, all in one
        transaction. Cancelled/errored results and results larger than the whole cap are skipped."""
        if self._conn is None or result.finish_reason in UNCACHEABLE_FINISH:
            return
        try:
            payload = _encode(result)
            if self.max_bytes is not None and len(payload) > self.max_bytes:
                return  # could never fit
            with self._lock:
                self._put(key, payload)
        except Exception as e:
            self._failed("put", e)

    def stats(self) -> dict[str, Any]:
        """Counters and the last known totals; no disk access, safe on the loop thread."""
        return {
            "path": str(self.path),
            "enabled": self.enabled,
            "available": self._conn is not None,
            "entries": self._entries,
            "bytes": self._bytes,
            "max_bytes": self.max_bytes,
            "ttl_s": self.ttl_s,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "expired": self.expired,
            "corrupt": self.corrupt,
            "errors": self.errors,
            "dropped": self.dropped,
        }

    def clear(self) -> int:
        """Delete every entry and shrink the file; returns how many were removed.
        Unlike get/put this raises (sqlite3.Error, RuntimeError if not open): an operator asked."""
        with self._lock:
            conn = self._require_conn()
            with _transaction(conn):
                n = conn.execute("DELETE FROM entries").rowcount
            self._refresh_totals(conn)
            self._shrink_file(conn)
        log.info("result cache cleared %s", fields(path=self.path, entries=n))
        return n

    def reconfigure(self, max_bytes: int | None, ttl_s: float | None, enabled: bool) -> None:
        """Live reload: apply a new cap/TTL at once (evicting and expiring now), or enable/disable.
        Enabling opens the file (quick_check reads all of it): call it off the loop thread."""
        try:
            with self._lock:
                if self._closed:
                    return
                changed = (max_bytes, ttl_s, enabled) != (self.max_bytes, self.ttl_s, self.enabled)
                self.max_bytes, self.ttl_s, self.enabled = max_bytes, ttl_s, enabled
                if not enabled:
                    if self._conn is not None:
                        self._conn.close()
                        self._conn = None
                elif self._conn is None:
                    self._conn = self._connect()  # applies the new cap and TTL as it opens
                else:
                    conn = self._conn
                    with _transaction(conn):
                        removed = self._expire_all(conn, self._clock()) + self._evict(conn)
                    self._refresh_totals(conn)
                    if removed:
                        self._shrink_file(conn)
            if changed:
                log.info("result cache reconfigured %s", fields(max_bytes=max_bytes, ttl_s=ttl_s, enabled=enabled))
        except Exception as e:
            self._failed("reconfigure", e)

    def close(self) -> None:
        """Finish queued puts, then close the file. Later calls are misses / no-ops."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.close()
                except sqlite3.Error as e:
                    log.warning("result cache close failed %s", fields(path=self.path, error=e))
                self._conn = None

    def __enter__(self) -> ResultCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public, for the asyncio loop -----------------------------------------------------------

    async def aget(self, key: str) -> CachedResult | None:
        """`get` on the cache's worker thread; the loop only awaits."""
        if self._conn is None:
            return None
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self.get, key)
        except RuntimeError:  # executor shut down: closing
            return None

    async def aput(self, key: str, result: CachedResult) -> None:
        if self._conn is None:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self.put, key, result)
        except RuntimeError:
            return

    def put_nowait(self, key: str, result: CachedResult) -> None:
        """Queue a put on the worker thread and return at once (from any thread). Drops the
        write when MAX_PENDING_PUTS are already queued, so a stalled disk cannot grow memory."""
        if self._conn is None or result.finish_reason in UNCACHEABLE_FINISH:
            return
        with self._pending_lock:
            if self._pending >= MAX_PENDING_PUTS:
                self.dropped += 1
                return
            self._pending += 1
        try:
            self._executor.submit(self._queued_put, key, result)
        except RuntimeError:  # closing
            with self._pending_lock:
                self._pending -= 1

    def _queued_put(self, key: str, result: CachedResult) -> None:
        try:
            self.put(key, result)
        finally:
            with self._pending_lock:
                self._pending -= 1

    # -- operations (called with self._lock held) -----------------------------------------------

    def _get(self, key: str) -> CachedResult | None:
        conn = self._conn
        if conn is None:
            return None
        row = conn.execute("SELECT checksum, created_at, payload FROM entries WHERE key = ?", (key,)).fetchone()
        if row is None:
            self.misses += 1
            return None
        checksum, created_at, payload = row
        now = self._clock()
        result = None
        if self._is_expired(created_at, now):
            self.expired += 1
        else:
            result = self._verify(key, checksum, payload)
            if result is None:
                self.corrupt += 1
                log.warning("result cache row failed its checksum, deleted %s", fields(key=key[:16]))
        if result is None:
            conn.execute("DELETE FROM entries WHERE key = ?", (key,))
            self._refresh_totals(conn)
            self.misses += 1
            return None
        conn.execute("UPDATE entries SET last_access = ? WHERE key = ?", (now, key))
        self.hits += 1
        return result

    def _put(self, key: str, payload: bytes) -> None:
        conn = self._conn
        if conn is None:
            return
        now = self._clock()
        with _transaction(conn):
            conn.execute(_UPSERT, (key, len(payload), _checksum(key, payload), now, now, payload))
            self._expire_all(conn, now)
            self._evict(conn, keep=key)
        self._refresh_totals(conn)

    def _is_expired(self, created_at: float, now: float) -> bool:
        ttl = self.ttl_s
        return ttl is not None and ttl > 0 and now - created_at >= ttl

    @staticmethod
    def _verify(key: str, checksum: Any, payload: Any) -> CachedResult | None:
        if not isinstance(payload, bytes) or checksum != _checksum(key, payload):
            return None
        try:
            return _decode(payload)
        except Exception:  # any decode failure is a bad row
            return None

    def _expire_all(self, conn: sqlite3.Connection, now: float) -> int:
        if not self.ttl_s or self.ttl_s <= 0:
            return 0
        n = conn.execute("DELETE FROM entries WHERE created_at <= ?", (now - self.ttl_s,)).rowcount
        self.expired += n
        return n

    def _evict(self, conn: sqlite3.Connection, keep: str | None = None) -> int:
        """Delete least recently read entries until the payload total fits max_bytes."""
        if self.max_bytes is None:
            return 0
        (total,) = conn.execute("SELECT bytes FROM totals WHERE id = 0").fetchone()
        excess = total - self.max_bytes
        if excess <= 0:
            return 0
        victims: list[tuple[str]] = []
        cur = conn.execute("SELECT key, size FROM entries ORDER BY last_access, rowid")
        try:
            while excess > 0 and (rows := cur.fetchmany(256)):
                for k, size in rows:
                    if k == keep:
                        continue
                    victims.append((k,))
                    excess -= size
                    if excess <= 0:
                        break
        finally:
            cur.close()
        conn.executemany("DELETE FROM entries WHERE key = ?", victims)
        self.evictions += len(victims)
        return len(victims)

    def _refresh_totals(self, conn: sqlite3.Connection) -> None:
        self._entries, self._bytes = conn.execute("SELECT entries, bytes FROM totals WHERE id = 0").fetchone()

    @staticmethod
    def _shrink_file(conn: sqlite3.Connection) -> None:
        conn.execute("PRAGMA incremental_vacuum").fetchall()  # must be stepped to the end
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()

    def _require_conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError(f"result cache {self.path} is not open")
        return self._conn

    # -- opening and recovery (called with self._lock held) -------------------------------------

    def _connect(self) -> sqlite3.Connection | None:
        """A checked connection; a bad file is moved aside once and replaced. None: unavailable."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            log.error("result cache unavailable %s", fields(path=self.path, error=e))
            return None
        for attempt in (1, 2):
            try:
                return self._connect_checked()
            except (sqlite3.Error, _Corrupt, OSError) as e:
                transient = isinstance(e, sqlite3.Error) and _errcode(e) in _NOT_THE_FILES_FAULT
                if transient or attempt == 2 or not self._move_aside(str(e)):
                    log.error("result cache unavailable, serving without it %s", fields(path=self.path, error=e))
                    return None
        return None

    def _connect_checked(self) -> sqlite3.Connection:
        if self.path.is_dir():
            raise _Corrupt("a directory is in its place")
        conn = sqlite3.connect(
            str(self.path), timeout=self._busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        try:
            # Check before writing anything, so that a file moved aside is as we found it.
            check = conn.execute("PRAGMA quick_check").fetchall()
            if check != [("ok",)]:
                raise _Corrupt("quick_check: " + "; ".join(str(r[0]) for r in check[:3]))
            conn.execute("PRAGMA auto_vacuum = INCREMENTAL")  # takes effect on a new file only
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                log.warning("result cache: WAL unavailable %s", fields(path=self.path, journal_mode=mode))
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("PRAGMA journal_size_limit = 8388608")
            self._ensure_schema(conn)
            self._reconcile_totals(conn)
            return conn
        except BaseException:
            conn.close()
            raise

    def _ensure_schema(self, conn: sqlite3.Connection) -> None:
        (version,) = conn.execute("PRAGMA user_version").fetchone()
        if version == SCHEMA_VERSION:
            return
        with _transaction(conn):
            if version != 0:
                log.info("result cache schema changed, starting empty %s", fields(old=version, new=SCHEMA_VERSION))
                conn.execute("DROP TABLE IF EXISTS entries")
                conn.execute("DROP TABLE IF EXISTS totals")
            for stmt in _split_sql(_SCHEMA):
                conn.execute(stmt)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _reconcile_totals(self, conn: sqlite3.Connection) -> None:
        """The trigger-kept totals must match the rows; fix them if not (cheap next to quick_check)."""
        with _transaction(conn):
            n, total = conn.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM entries").fetchone()
            if (n, total) != tuple(conn.execute("SELECT entries, bytes FROM totals WHERE id = 0").fetchone()):
                log.info("result cache totals rebuilt %s", fields(entries=n, bytes=total))
                conn.execute("UPDATE totals SET entries = ?, bytes = ? WHERE id = 0", (n, total))
            if self.enabled:
                self._expire_all(conn, self._clock())
                self._evict(conn)
        self._refresh_totals(conn)

    def _move_aside(self, reason: str) -> bool:
        if not os.path.lexists(self.path):  # nothing to move: the directory failed (read-only, full, gone)
            return False
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while os.path.lexists(target):
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
            n += 1
        try:
            if os.path.lexists(self.path):
                os.replace(self.path, target)
            # The WAL belongs to the old file: left behind it would be replayed into the new one.
            for suffix in ("-wal", "-shm", "-journal"):
                side = Path(f"{self.path}{suffix}")
                if os.path.lexists(side):
                    os.replace(side, Path(f"{target}{suffix}"))
        except OSError as e:
            log.error("result cache: cannot move bad file aside %s", fields(path=self.path, error=e))
            return False
        log.warning(
            "result cache file unusable, moved aside, starting empty %s",
            fields(path=self.path, moved_to=target.name, reason=reason),
        )
        return True

    def _failed(self, op: str, e: BaseException, miss: bool = False) -> None:
        """Log (rate-limited) and count a failure; a corrupt file is replaced by a fresh one."""
        with self._lock:
            self.errors += 1
            if miss:
                self.misses += 1
            if _errcode(e) in (_SQLITE_CORRUPT, _SQLITE_NOTADB) and self._conn is not None and not self._closed:
                log.warning("result cache corrupt during %s %s", op, fields(path=self.path, error=e))
                try:
                    self._conn.close()
                except sqlite3.Error:
                    pass
                self._conn = None
                if self._move_aside(str(e)):
                    self._conn = self._connect()
                return
            now = time.monotonic()
            if now - self._last_warn < WARN_INTERVAL_S:
                self._suppressed += 1
                return
            self._last_warn = now
            suppressed, self._suppressed = self._suppressed, 0
            log.warning(
                "result cache %s failed, treated as a miss %s",
                op,
                fields(path=self.path, error=f"{type(e).__name__}: {e}", suppressed_since_last=suppressed),
            )


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE ... COMMIT, ROLLBACK on error (the connection itself runs in autocommit)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
        raise
    conn.execute("COMMIT")


def _split_sql(script: str) -> list[str]:
    """Split the schema into statements (triggers contain ';' inside BEGIN ... END)."""
    stmts, buf = [], ""
    for line in script.splitlines():
        buf += line + "\n"
        if sqlite3.complete_statement(buf):
            stmts.append(buf.strip())
            buf = ""
    return [s for s in stmts if s]


# ---------------------------------------------------------------------------------------------
# CLI: `edged cache stats | clear`


def run_cache_command(action: str, state_dir: str) -> int:
    """`edged cache stats` prints the cache's totals; `edged cache clear` empties it. Exit code."""
    path = db_path(state_dir)
    if action not in ("stats", "clear"):
        sys.stderr.write(f"edged cache: unknown action {action!r} (expected stats or clear)\n")
        return 2
    if not os.path.lexists(path):
        sys.stdout.write(f"no result cache at {path}\n" if action == "stats" else f"nothing to clear at {path}\n")
        return 0
    # No cap, no TTL: looking at the cache must not evict from it.
    cache = ResultCache.open(path, max_bytes=None, ttl_s=None, enabled=True)
    try:
        if not cache.available:
            sys.stderr.write(f"edged cache: cannot open {path} (see the log)\n")
            return 1
        if action == "clear":
            before = cache.stats()
            n = cache.clear()
            sys.stdout.write(f"cleared {n} entries ({before['bytes']} bytes) from {path}\n")
            return 0
        s = cache.stats()
        on_disk = sum(os.path.getsize(f"{path}{x}") for x in ("", "-wal") if os.path.isfile(f"{path}{x}"))
        for k, v in (("path", path), ("entries", s["entries"]), ("bytes", s["bytes"]), ("file_bytes", on_disk)):
            sys.stdout.write(f"{k}: {v}\n")
        return 0
    except sqlite3.Error as e:
        sys.stderr.write(f"edged cache {action}: {e}\n")
        return 1
    finally:
        cache.close()
