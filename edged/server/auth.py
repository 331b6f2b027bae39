"""API keys: the `Authorization: Bearer KEY` header and the key's policy (rate limits are counted
once for the whole daemon, in the engine core: edged/scheduler/rate_limit.py).

Keys are stored as sha256 hex digests (config `auth.keys[].sha256`). A presented key matches only
byte for byte: the header may carry RFC 9110 whitespace (space, tab) around it, nothing else is
trimmed, so a key with a no-break space or a vertical tab in front is a different key.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")

_OWS = " \t"  # RFC 9110 5.6.3: the only whitespace a header value may carry around its content


def bearer_key(header: str | None) -> str | None:
    """KEY of `Bearer KEY` (the scheme is case-insensitive, RFC 6750); None for any other scheme.
    The key is taken as sent: no trimming beyond spaces and tabs."""
    scheme, sep, rest = (header or "").strip(_OWS).partition(" ")
    if not sep or scheme.lower() != "bearer":
        return None
    return rest.lstrip(" ") or None


def key_digest(key: str) -> str:
    """sha256 hex of the key's bytes as they came over the wire (header values are decoded as
    latin-1, so this round trip gives back the client's bytes, e.g. the UTF-8 of `printf %s KEY`)."""
    try:
        raw = key.encode("latin-1")
    except UnicodeEncodeError:  # not from a header: a str the caller built
        raw = key.encode("utf-8", "surrogatepass")
    return hashlib.sha256(raw).hexdigest()


def lookup(header: str | None, keys: Mapping[str, T]) -> T | None:
    """The value stored under the digest of the header's Bearer key, or None."""
    key = bearer_key(header)
    return None if key is None else keys.get(key_digest(key))
