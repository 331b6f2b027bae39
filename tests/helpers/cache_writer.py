"""Writes result-cache entries as fast as it can until it is killed (test_result_cache.py's SIGKILL test).

usage: python tests/helpers/cache_writer.py DB_PATH MAX_BYTES THREADS

Prints "started" once the cache is open and a first entry is committed, then one line per
committed put (the key), and never stops. Every value is derived from its key (`expected_result`),
so a reader can verify any entry it finds. Exits 3 if it reads back a wrong value itself, 4 if a put
failed (put logs and swallows errors, so "committed" would be a lie).
"""
from __future__ import annotations

import hashlib
import os
import random
import sys
import threading

from edged.cache.result_cache import CachedResult, ResultCache, make_key


def expected_result(key: str) -> CachedResult:
    """The value stored under `key`: 16..2056 tokens and 1..61 KB of text, all from the key's bytes."""
    seed = bytes.fromhex(key)
    n_tok = 16 + seed[0] * 8
    text_len = 1000 + int.from_bytes(seed[1:3], "big") % 60000
    block = hashlib.sha512(seed).hexdigest()
    text = (block * (text_len // len(block) + 1))[:text_len]
    tokens = [seed[i % 32] * 1000 + i for i in range(n_tok)]
    return CachedResult(tokens, text, "length" if seed[3] & 1 else "stop", seed[4], n_tok)


_out = threading.Lock()


def _report(line: str) -> None:
    with _out:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _work(cache: ResultCache, tid: int) -> None:
    rng = random.Random(tid)
    written: list[str] = []
    i = 0
    while True:
        key = make_key("writer", [os.getpid(), tid, i], {"temperature": 0, "seed": None})
        cache.put(key, expected_result(key))
        if cache.errors:
            os._exit(4)
        _report(key)
        written.append(key)
        i += 1
        if i % 3 == 0:  # reads update last_access, so they write too
            probe = rng.choice(written)
            got = cache.get(probe)
            if got is not None and got != expected_result(probe):
                sys.stderr.write(f"writer read back a wrong value for {probe}\n")
                os._exit(3)


def main() -> None:
    path, max_bytes, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cache = ResultCache.open(path, max_bytes=max_bytes, ttl_s=None, enabled=True)
    if not cache.available:
        sys.stderr.write("writer could not open the cache\n")
        os._exit(2)
    first = make_key("writer", [os.getpid(), -1], {"temperature": 0})
    cache.put(first, expected_result(first))
    _report("started")
    for tid in range(threads):
        threading.Thread(target=_work, args=(cache, tid), daemon=True).start()
    threading.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    main()
