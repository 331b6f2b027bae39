"""TLS session tickets for QUIC resumption and 0-RTT: the server's shared store, the client's per-host file.

aioquic keeps resumption state on the server side: the ticket a client receives is 64 random bytes,
and the server looks its `SessionTicket` (resumption secret, cipher suite, lifetime) up again with
`session_ticket_fetcher`. aioquic draws those bytes itself and sends them before it calls
`session_ticket_handler`, so a self-contained encrypted ticket is not possible without patching it;
hence a store that every worker process shares and that survives a restart:

- SQLite in the state dir (`quic_tickets.sqlite`, mode 0600, WAL), rows bounded in number
  (oldest dropped) and in age (`ticket_lifetime_s`, shorter than aioquic's fixed 24 h: an older
  ticket is simply not found, and the client falls back to a full handshake).
- Tickets are single-use: a fetch deletes the row in the same statement. A replayed ClientHello
  (same ticket) therefore finds nothing and gets a full handshake with its 0-RTT data discarded,
  on any worker of this daemon. A client gets a fresh ticket on every connection.

The client side (`ClientTicketFile`) keeps the newest ticket per server in one file under the
user's state dir (mode 0600), for `edged chat`'s next run.
"""
from __future__ import annotations

import datetime as dt
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path

import msgpack
from aioquic.tls import CipherSuite, SessionTicket

from edged.log import fields

log = logging.getLogger("edged.server")

TICKETS_DB = "quic_tickets.sqlite"


def encode_ticket(t: SessionTicket) -> bytes:
    """A SessionTicket as msgpack (no pickle: the file is data, never code)."""
    return msgpack.packb([
        t.age_add, int(t.cipher_suite), t.not_valid_after.timestamp(), t.not_valid_before.timestamp(),
        t.resumption_secret, t.server_name, t.ticket, t.max_early_data_size,
        [[int(k), bytes(v)] for k, v in t.other_extensions],
    ], use_bin_type=True)


def decode_ticket(data: bytes) -> SessionTicket | None:
    """The ticket, or None when the bytes are not one (a corrupt or foreign row)."""
    try:
        (age_add, suite, after, before, secret, server_name, ticket, max_early, exts) = msgpack.unpackb(data, raw=False)
        utc = dt.UTC
        return SessionTicket(
            age_add=int(age_add), cipher_suite=CipherSuite(suite),
            not_valid_after=dt.datetime.fromtimestamp(after, utc), not_valid_before=dt.datetime.fromtimestamp(before, utc),
            resumption_secret=bytes(secret), server_name=server_name, ticket=bytes(ticket),
            max_early_data_size=max_early, other_extensions=[(int(k), bytes(v)) for k, v in exts])
    except (ValueError, TypeError, msgpack.UnpackException):
        return None


class TicketStore:
    """The server's tickets, shared by the workers through one SQLite file in the state dir."""

    def __init__(self, path: str | os.PathLike[str], lifetime_s: float, max_tickets: int) -> None:
        self.path = str(path)
        self.lifetime_s = lifetime_s
        self.max_tickets = max_tickets
        self._lock = threading.Lock()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)  # created private, before SQLite opens it
        os.close(fd)
        os.chmod(self.path, 0o600)
        # Called on the worker's event loop during handshakes: a write waits for another worker's
        # (WAL: microseconds) at most this long, then the ticket is skipped rather than the loop stalled.
        self._db = sqlite3.connect(self.path, timeout=0.25, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS tickets (id BLOB PRIMARY KEY, issued REAL NOT NULL, "
                         "data BLOB NOT NULL)")
        self._db.execute("CREATE INDEX IF NOT EXISTS tickets_issued ON tickets (issued)")
        for suffix in ("-wal", "-shm"):  # SQLite makes these with the umask's mode
            try:
                os.chmod(self.path + suffix, 0o600)
            except FileNotFoundError:
                pass
        self._since_trim = 0

    def add(self, ticket: SessionTicket) -> None:
        """aioquic's session_ticket_handler: a ticket was just issued."""
        now = time.time()
        # aioquic fixes the lifetime it announces at 24 h; ours may be shorter.
        ticket.not_valid_after = min(ticket.not_valid_after,
                                     dt.datetime.fromtimestamp(now + self.lifetime_s, dt.UTC))
        try:
            with self._lock:
                self._db.execute("INSERT OR REPLACE INTO tickets VALUES (?, ?, ?)",
                                 (ticket.ticket, now, encode_ticket(ticket)))
                self._since_trim += 1
                if self._since_trim >= max(1, self.max_tickets // 16):
                    self._trim(now)
        except sqlite3.Error as e:  # resumption is an optimisation: never fail a handshake over it
            log.warning("session ticket not stored %s", fields(error=repr(e)))

    def take(self, ticket_id: bytes) -> SessionTicket | None:
        """aioquic's session_ticket_fetcher: the ticket, removed (single use), or None."""
        try:
            with self._lock:
                row = self._db.execute("DELETE FROM tickets WHERE id = ? RETURNING issued, data",
                                       (bytes(ticket_id),)).fetchone()
        except sqlite3.Error as e:
            log.warning("session ticket lookup failed %s", fields(error=repr(e)))
            return None
        if row is None or time.time() - row[0] > self.lifetime_s:
            return None
        return decode_ticket(row[1])

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM tickets").fetchone()[0])

    def _trim(self, now: float) -> None:
        self._since_trim = 0
        self._db.execute("DELETE FROM tickets WHERE issued < ?", (now - self.lifetime_s,))
        self._db.execute("DELETE FROM tickets WHERE id IN (SELECT id FROM tickets ORDER BY issued DESC "
                         "LIMIT -1 OFFSET ?)", (self.max_tickets,))

    def close(self) -> None:
        with self._lock:
            self._db.close()


def default_client_state_dir() -> Path:
    """Where `edged chat` keeps its tickets: $XDG_STATE_HOME/edged, else ~/.local/state/edged."""
    if xdg := os.environ.get("XDG_STATE_HOME"):
        return Path(xdg) / "edged"
    return Path.home() / ".local" / "state" / "edged"


class ClientTicketFile:
    """The newest session ticket for one server (host:port), in `<dir>/quic-tickets/<host>_<port>`."""

    def __init__(self, directory: str | os.PathLike[str], host: str, port: int) -> None:
        safe = "".join(c if c.isalnum() or c in ".-" else "_" for c in host)
        self.path = Path(directory) / "quic-tickets" / f"{safe}_{port}"

    def load(self) -> SessionTicket | None:
        try:
            data = self.path.read_bytes()
        except OSError:
            return None
        ticket = decode_ticket(data)
        return ticket if ticket is not None and ticket.is_valid else None

    def save(self, ticket: SessionTicket) -> None:
        """aioquic's client session_ticket_handler; written atomically, mode 0600, directory 0700."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, encode_ticket(ticket))
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only home must not break a chat
            log.debug("session ticket not saved %s", fields(path=self.path, error=repr(e)))
