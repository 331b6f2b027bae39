"""config.yaml: the schema as dataclasses, validation with clear errors, and the diff for live reload.

The schema is the dataclasses below; each field's default is the built-in default and its metadata
holds the checks. `parse_config` walks a mapping against the schema, collecting every problem as a
`(key_path, reason)` pair before raising one `ConfigError`, so an operator sees all mistakes at once.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import ipaddress
import logging
import math
import os
import re
import stat
import sys
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger("edged.config")

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
MAX_CONFIG_BYTES = 1 * MiB  # a config is a few KiB; anything larger is refused before it is read


def _f(default: Any = MISSING, *, factory: Any = MISSING, **checks: Any) -> Any:
    """A schema field. checks: gt, ge, le (numbers), choices, size (bytes, "256MiB" accepted),
    path (~ and relative paths resolved), lower (case-folded), null_default (null = the default),
    check (a function value -> reason or None)."""
    return field(default=default, default_factory=factory, metadata=checks)


def default_state_dir() -> str:
    """$STATE_DIRECTORY under systemd (StateDirectory=edged), /var/lib/edged for root, else XDG."""
    if sd := os.environ.get("STATE_DIRECTORY"):
        return sd.split(":")[0]
    if os.geteuid() == 0:
        return "/var/lib/edged"
    if xdg := os.environ.get("XDG_STATE_HOME"):
        return str(Path(xdg) / "edged")
    try:
        return str(Path.home() / ".local/state/edged")
    except RuntimeError:  # no $HOME and no passwd entry
        return "/var/lib/edged"


def parse_listen(listen: str) -> tuple[str, int]:
    """"HOST:PORT" or "[IPv6]:PORT" -> (host, port); ValueError with the reason otherwise."""
    if m := re.fullmatch(r"\[([^\]]+)\]:(\d+)", listen):
        host, port = m.group(1), m.group(2)
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host!r} in brackets is not an IPv6 address") from None
    else:
        host, sep, port = listen.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError("must be HOST:PORT, e.g. 0.0.0.0:4433 or [::]:4433")
        if ":" in host:
            raise ValueError(f"IPv6 addresses need brackets, e.g. [{host}]:{port}")
        if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", host):
            raise ValueError("host must be an IP address or a host name, e.g. 0.0.0.0:4433")
    if not 0 <= int(port) <= 65535:  # 0: any free port (tests)
        raise ValueError("port must be 0..65535")  # the caller shows the value
    return host, int(port)


def _check_listen(value: str) -> str | None:
    try:
        parse_listen(value)
    except ValueError as e:
        return f"{e}, got {value!r}"
    return None


def _check_device(value: str) -> str | None:
    if re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        return None
    return f"must be one of auto, cpu, cuda, cuda:N; got {value!r}"


def _check_sha256(value: str) -> str | None:
    if re.fullmatch(r"[0-9a-fA-F]{64}", value):
        return None
    return ("must be the sha256 hex digest of the key (64 hex characters), never the key itself; "
            "make one with: printf %s KEY | sha256sum")


def _check_workers(value: str) -> str | None:
    if value == "auto" or (value.isdigit() and 1 <= int(value) <= 64):
        return None
    return f"must be auto or a number of worker processes from 1 to 64; got {value!r}"


def auto_workers(value: str, cores: int | None = None) -> int:
    """server.workers -> a count: auto is one per spare core (the engine core keeps one), 1 to 8."""
    if value != "auto":
        return int(value)
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, min(8, cores - 1))


def _check_name(value: str) -> str | None:
    if re.fullmatch(r"[A-Za-z0-9_-]{1,32}", value):
        return None
    return f"names are 1-32 letters, digits, '_' or '-'; got {value!r}"


# ----------------------------------------------------------------------------------------- schema


@dataclass(slots=True)
class QuicConfig:
    """server.quic: limits on QUIC connections (per worker process) and session tickets."""

    max_connections: int = _f(2048, gt=0)  # per worker; more: new connections refused
    max_connections_per_address: int = _f(256, gt=0)  # per worker, from one client IP (NATs share one)
    retry_above_handshakes_per_s: float = _f(200.0, ge=0)  # Retry (address validation) above this; 0: always
    retry_above_unvalidated_per_address: int = _f(8, gt=0)  # unproven handshakes in flight from one IP
    handshake_timeout_s: float = _f(10.0, gt=0)  # a handshake not complete by then is dropped
    idle_timeout_s: float = _f(60.0, gt=0)  # a connection silent this long is closed (new connections)
    ticket_lifetime_s: float = _f(86400.0, gt=0, le=86400)  # 0-RTT session tickets (aioquic announces 24 h)
    max_tickets: int = _f(100_000, gt=0)  # rows kept in <state_dir>/quic_tickets.sqlite, oldest dropped
    # reno-floor: New Reno whose window stays >= 10 datagrams (edged/server/quic_congestion.py says why)
    congestion_control: str = _f("reno-floor", choices=("reno-floor", "reno", "cubic"))
    # 1-RTT datagrams up to this size are sent twice while the connection is application-limited (a
    # token stream) and has lost a packet in the last duplicate_after_loss_s: quic_redundancy.py; 0: off
    duplicate_datagram_bytes: int = _f(1500, ge=0, le=1500)
    duplicate_delay_ms: float = _f(2.0, ge=0, le=100)  # the second copy this much later
    duplicate_after_loss_s: float = _f(30.0, ge=0)  # 0: copy whether or not the connection has lost any


@dataclass(slots=True)
class ServerConfig:
    listen: str = _f("0.0.0.0:4433", check=_check_listen)
    certfile: str | None = _f(None, path=True)  # None with keyfile None: self-signed under state_dir
    keyfile: str | None = _f(None, path=True)
    state_dir: str = _f(factory=default_state_dir, path=True, null_default=True)
    max_body_bytes: int = _f(1 * MiB, size=True, gt=0)
    max_concurrent_streams: int = _f(128, gt=0)  # per QUIC connection
    request_timeout_s: float = _f(600.0, gt=0)
    drain_timeout_s: float = _f(30.0, ge=0)
    # How often the supervisor checks config.yaml for edits (SIGHUP reloads at once); 0: SIGHUP only.
    config_poll_s: float = _f(2.0, ge=0)
    # Front-end worker processes sharing the UDP port (SO_REUSEPORT); "auto": see auto_workers.
    workers: str = _f("auto", check=_check_workers, int_ok=True)
    # HTTP/1.1 and HTTP/2 over TLS/TCP on the same address as HTTP/3 (clients without QUIC).
    tcp: bool = True
    # QUIC session tickets and 0-RTT (only replay-safe requests run before the handshake completes).
    zero_rtt: bool = True
    quic: QuicConfig = field(default_factory=QuicConfig)

    @property
    def host(self) -> str:
        return parse_listen(self.listen)[0]

    @property
    def port(self) -> int:
        return parse_listen(self.listen)[1]


@dataclass(slots=True)
class SamplingDefaultsConfig:
    """model.sampling_defaults: what a request that omits the field gets, over the model's own
    recommendation (generation_config.json, the embedded model's card); null keeps the model's."""

    temperature: float | None = _f(None, ge=0, le=2)
    top_p: float | None = _f(None, gt=0, le=1)
    top_k: int | None = _f(None, ge=0)  # 0: off
    max_tokens: int | None = _f(None, gt=0)  # over limits.max_tokens_default; capped by max_tokens_limit

    def as_dict(self) -> dict[str, float | int]:
        """The keys that are set (what with_overrides lays over the model's defaults)."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}


@dataclass(slots=True)
class ModelConfig:
    path: str | None = _f(None, path=True)  # None: the embedded default model
    served_name: str | None = None  # the id in /v1/models; None: the file name without extension
    tokenizer: str | None = _f(None, path=True)  # None: from the model file / its directory
    chat_template: str | None = _f(None, path=True)  # a Jinja file; None: the model's own
    quant: str = _f("auto", choices=("auto", "none", "w8", "w4"))
    group_size: int = _f(64, choices=(32, 64, 128))  # w4 group when edged quantizes
    dtype: str = _f("auto", choices=("auto", "float32", "float16", "bfloat16"))
    kv_cache_dtype: str = _f("auto", choices=("auto", "int8"))
    max_model_len: int | None = _f(None, gt=0)
    device: str = _f("auto", check=_check_device)
    gpu_memory_fraction: float = _f(0.85, gt=0, le=1)
    block_size: int = _f(16, choices=(8, 16, 32, 64, 128))
    max_num_seqs: int = _f(64, gt=0)
    max_batch_tokens: int = _f(2048, gt=0)
    cuda_graphs: bool = True
    sampling_defaults: SamplingDefaultsConfig = field(default_factory=SamplingDefaultsConfig)


@dataclass(slots=True)
class LimitsConfig:
    max_tokens_default: int = _f(256, gt=0)
    max_tokens_limit: int = _f(4096, gt=0)
    max_prompt_tokens: int | None = _f(None, gt=0)
    allow_special_tokens_in_prompt: bool = False  # /v1/completions text may write control tokens



@dataclass(slots=True)
class BatchWindow:
    """How long (ms) the batcher may hold a tier's new requests to batch them; adapted within bounds."""

    min: float = _f(0.0, ge=0)
    initial: float = _f(5.0, ge=0)
    max: float = _f(50.0, ge=0)


@dataclass(slots=True)
class TierConfig:
    weight: float = _f(1.0, gt=0)
    ttft_target_ms: float = _f(2000.0, gt=0)
    max_queue: int = _f(128, gt=0)
    batch_window_ms: BatchWindow = field(default_factory=BatchWindow)
    max_tokens: int | None = _f(None, gt=0)  # a per-tier cap under limits.max_tokens_limit
    # Time per output token after the first (pace); None: no pace promise. While a sequence of this
    # tier decodes, the scheduler keeps steps within it by deferring lower tiers' decodes.
    tpot_target_ms: float | None = _f(None, gt=0)


def default_tiers() -> dict[str, TierConfig]:
    return {
        "gold": TierConfig(8.0, 500.0, 64, BatchWindow(0.0, 2.0, 10.0), tpot_target_ms=40.0),
        "silver": TierConfig(4.0, 2000.0, 128, BatchWindow(0.0, 5.0, 25.0), tpot_target_ms=100.0),
        "bronze": TierConfig(1.0, 10000.0, 256, BatchWindow(0.0, 20.0, 100.0), tpot_target_ms=500.0),
    }


@dataclass(slots=True)
class SchedulerConfig:
    default_tier: str = "silver"
    batch_cap: int | None = _f(None, gt=0)  # None: from the PCIe topology
    step_token_budget: int | None = _f(None, gt=0)  # None: model.max_batch_tokens
    preemption: str = _f("recompute", choices=("recompute", "swap", "off"))
    transfer_budget_bytes: int | None = _f(None, size=True, gt=0)  # None: from measured bandwidth
    pin_threads: bool = True


@dataclass(slots=True)
class CacheConfig:
    enabled: bool = True
    max_bytes: int = _f(256 * MiB, size=True, ge=0)
    ttl_s: float = _f(86400.0, gt=0)
    prefix_cache: bool = True
    host_spill_bytes: int = _f(0, size=True, ge=0)


@dataclass(slots=True)
class ApiKey:
    name: str = ""
    sha256: str = _f("", lower=True, check=_check_sha256)
    tier: str | None = None  # None: scheduler.default_tier
    rate_limit_rps: float | None = _f(None, gt=0)
    burst: int | None = _f(None, gt=0)  # None: max(1, ceil(rate_limit_rps))


@dataclass(slots=True)
class AuthConfig:
    enabled: bool = False
    keys: list[ApiKey] = field(default_factory=list)
    metrics_requires_key: bool = False
    metrics_loopback_only: bool = True


@dataclass(slots=True)
class LoggingConfig:
    level: str = _f("info", lower=True, choices=("debug", "info", "warning", "error", "critical"))
    access_log: bool = True


@dataclass(slots=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    tiers: dict[str, TierConfig] = field(default_factory=default_tiers)
    cache: CacheConfig = field(default_factory=CacheConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# ----------------------------------------------------------------------------------------- errors


class ConfigError(ValueError):
    """Every problem found in one config: `errors` is a list of (key_path, reason)."""

    def __init__(self, errors: list[tuple[str, str]], source: str = "config") -> None:
        self.errors = errors
        self.source = source
        super().__init__(f"{source}: invalid config:\n  " + "\n  ".join(self.messages()))

    def messages(self) -> list[str]:
        return [f"{key}: {reason}" if key else reason for key, reason in self.errors]


# ---------------------------------------------------------------------------------------- parsing

_SIZE_UNITS = {"": 1, "b": 1, "k": KiB, "kib": KiB, "kb": 1000, "m": MiB, "mib": MiB, "mb": 1000**2,
               "g": GiB, "gib": GiB, "gb": 1000**3, "t": 1 << 40, "tib": 1 << 40, "tb": 1000**4}
_BAD = object()  # a value that failed; its error is already recorded


def parse_size(value: str) -> int:
    """"256MiB", "1.5 GiB", "512k" -> bytes (K/M/G alone are binary, as in systemd)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"must be a byte count like 268435456 or 256MiB, got {value!r}")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _show(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float, str)):
        return repr(v)
    return type(v).__name__


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


class _Parser:
    def __init__(self, base_dir: Path | None) -> None:
        self.base_dir = base_dir
        self.errors: list[tuple[str, str]] = []

    def err(self, path: str, reason: str) -> object:
        self.errors.append((path, reason))
        return _BAD

    def section(self, cls: type, data: Any, path: str) -> Any:
        if not isinstance(data, dict):
            self.err(path, f"must be a mapping of keys, got {_show(data)}")
            return cls()
        names = [f.name for f in fields(cls)]
        for key in data:
            if key not in names:
                near = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
                hint = f" (did you mean {near[0]!r}?)" if near else f"; known keys: {', '.join(names)}"
                self.err(_join(path, key), "unknown key" + hint)
        hints, kwargs = _hints(cls), {}
        for f in fields(cls):
            if f.name in data:
                value = self.value(hints[f.name], data[f.name], _join(path, f.name), f)
                if value is not _BAD:
                    kwargs[f.name] = value
        return cls(**kwargs)

    def value(self, tp: Any, v: Any, path: str, f: dataclasses.Field | None = None) -> Any:
        meta = f.metadata if f is not None else {}
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin in (typing.Union, types.UnionType):  # X | None
            if v is None:
                return None
            tp = next(a for a in args if a is not type(None))
            origin, args = typing.get_origin(tp), typing.get_args(tp)
        elif v is None and meta.get("null_default"):
            return f.default_factory() if f.default_factory is not MISSING else f.default
        if is_dataclass(tp):
            return self.section(tp, {} if v is None else v, path)
        if origin is dict:
            if not isinstance(v, dict):
                return self.err(path, f"must be a mapping, got {_show(v)}")
            out = {}
            for name, item in v.items():
                name = str(name)
                if reason := _check_name(name):
                    self.err(_join(path, name), reason)
                out[name] = self.value(args[1], {} if item is None else item, _join(path, name))
            return out
        if origin is list:
            if not isinstance(v, list):
                return self.err(path, f"must be a list, got {_show(v)}")
            return [self.value(args[0], item, f"{path}[{i}]") for i, item in enumerate(v)]
        return self.scalar(tp, v, path, meta)

    def scalar(self, tp: type, v: Any, path: str, meta: Any) -> Any:
        raw = v
        if tp is bool:
            if not isinstance(v, bool):
                return self.err(path, f"must be true or false, got {_show(v)}")
        elif tp is int:
            if meta.get("size") and isinstance(v, str):
                try:
                    v = parse_size(v)
                except ValueError as e:
                    return self.err(path, str(e))
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            if isinstance(v, bool) or not isinstance(v, int):
                return self.err(path, f"must be an integer, got {_show(v)}")
        elif tp is float:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                return self.err(path, f"must be a number, got {_show(v)}")
            v = float(v)
        elif tp is str:
            if meta.get("int_ok") and isinstance(v, int) and not isinstance(v, bool):
                v = str(v)
            if not isinstance(v, str):
                return self.err(path, f"must be a string, got {_show(v)}")
            if meta.get("lower"):
                v = v.lower()
            if meta.get("path"):
                p = Path(v).expanduser()
                if self.base_dir is not None and not p.is_absolute():
                    p = self.base_dir / p
                v = str(p)
        if (choices := meta.get("choices")) and v not in choices:
            return self.err(path, f"must be one of {', '.join(map(str, choices))}; got {_show(v)}")
        if tp in (int, float) and (reason := _range_reason(v, raw, meta, tp is int)):
            return self.err(path, reason)
        if (check := meta.get("check")) and (reason := check(v)):
            return self.err(path, reason)
        return v


def _range_reason(v: float, raw: Any, meta: Any, is_int: bool) -> str | None:
    gt, ge, le = meta.get("gt"), meta.get("ge"), meta.get("le")
    noun, got = ("integer" if is_int else "number"), _show(raw)
    if le is None and gt == 0 and v <= 0:
        return f"must be a positive {noun}, got {got}"
    if le is None and ge == 0 and v < 0:
        return f"must be a non-negative {noun}, got {got}"
    if (gt is not None and v <= gt) or (ge is not None and v < ge) or (le is not None and v > le):
        low = f"> {gt}" if gt is not None else f">= {ge}" if ge is not None else ""
        bounds = [b for b in (low, f"<= {le}" if le is not None else "") if b]
        return f"must be {' and '.join(bounds)}, got {got}"
    return None


def _cross_checks(c: Config) -> list[tuple[str, str]]:
    """Rules that span keys; run on the parsed config (fields that failed hold their defaults)."""
    errs: list[tuple[str, str]] = []
    known = ", ".join(sorted(c.tiers)) or "none defined"
    if not c.tiers:
        errs.append(("tiers", "at least one tier is required"))
    if c.scheduler.default_tier not in c.tiers:
        errs.append(("scheduler.default_tier", f"unknown tier {c.scheduler.default_tier!r} (tiers: {known})"))
    if c.limits.max_tokens_default > c.limits.max_tokens_limit:
        errs.append(("limits.max_tokens_default", f"must be <= limits.max_tokens_limit "
                     f"({c.limits.max_tokens_limit}), got {c.limits.max_tokens_default}"))
    if c.model.max_model_len and c.limits.max_prompt_tokens and c.limits.max_prompt_tokens >= c.model.max_model_len:
        errs.append(("limits.max_prompt_tokens",
                     f"must be < model.max_model_len ({c.model.max_model_len}), got {c.limits.max_prompt_tokens}"))
    if c.model.max_batch_tokens < c.model.max_num_seqs:
        errs.append(("model.max_batch_tokens",
                     f"must be >= model.max_num_seqs ({c.model.max_num_seqs}): every running sequence "
                     f"decodes one token per step; got {c.model.max_batch_tokens}"))
    budget = c.scheduler.step_token_budget
    if budget is not None and budget > c.model.max_batch_tokens:
        errs.append(("scheduler.step_token_budget",
                     f"must be <= model.max_batch_tokens ({c.model.max_batch_tokens}), got {budget}"))
    if c.scheduler.preemption == "swap" and c.cache.host_spill_bytes == 0:
        errs.append(("scheduler.preemption", "'swap' needs cache.host_spill_bytes > 0 (host memory to swap to)"))
    if (c.server.certfile is None) != (c.server.keyfile is None):
        errs.append(("server.certfile" if c.server.certfile is None else "server.keyfile",
                     "certfile and keyfile go together: set both, or neither for a self-signed certificate"))
    for name, t in c.tiers.items():
        w = t.batch_window_ms
        if not w.min <= w.initial <= w.max:
            errs.append((f"tiers.{name}.batch_window_ms",
                         f"needs min <= initial <= max, got {w.min}, {w.initial}, {w.max}"))
        if t.max_tokens is not None and t.max_tokens > c.limits.max_tokens_limit:
            errs.append((f"tiers.{name}.max_tokens",
                         f"must be <= limits.max_tokens_limit ({c.limits.max_tokens_limit}), got {t.max_tokens}"))
    if c.auth.enabled and not c.auth.keys:
        errs.append(("auth.keys", "auth is enabled but no keys are configured: every request would be refused"))
    names: set[str] = set()
    hashes: set[str] = set()
    for i, k in enumerate(c.auth.keys):
        p = f"auth.keys[{i}]"
        if not k.name:
            errs.append((f"{p}.name", "is required"))
        elif k.name in names:
            errs.append((f"{p}.name", f"duplicate key name {k.name!r}"))
        if not k.sha256:
            errs.append((f"{p}.sha256", "is required"))
        elif k.sha256 in hashes:
            errs.append((f"{p}.sha256", "duplicate: the same key is listed twice"))
        names.add(k.name)
        hashes.add(k.sha256)
        if k.tier is not None and k.tier not in c.tiers:
            errs.append((f"{p}.tier", f"unknown tier {k.tier!r} (tiers: {known})"))
        if k.burst is not None and k.rate_limit_rps is None:
            errs.append((f"{p}.burst", "needs rate_limit_rps"))
    return errs


def parse_config(mapping: Any, source: str = "config", base_dir: str | Path | None = None) -> Config:
    """A mapping (parsed YAML) -> Config, or ConfigError listing every problem.

    None or {} gives the defaults. Relative paths are taken relative to base_dir when given.
    """
    parser = _Parser(Path(base_dir) if base_dir is not None else None)
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, dict):
        raise ConfigError([("", f"the config must be a mapping of sections, got {_show(mapping)}")], source)
    config = parser.section(Config, mapping, "")
    failed = {key for key, _ in parser.errors}
    # A cross-check on a key that already failed would only repeat the problem.
    parser.errors += [(k, r) for k, r in _cross_checks(config) if k not in failed]
    if parser.errors:
        raise ConfigError(parser.errors, source)
    return config


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML would silently keep the last one)."""


def _mapping(loader: _Loader, node: yaml.MappingNode) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *anchor` keys may be overridden; that is not a duplicate
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.setdefault(key, key_node.start_mark.line)
        except TypeError:
            continue  # unhashable key: construct_mapping reports it
        if first != key_node.start_mark.line:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {first + 1})", key_node.start_mark)
    return loader.construct_mapping(node, deep=True)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def read_config_text(path: str | Path, limit: int = MAX_CONFIG_BYTES) -> str:
    """The text of a config file, refusing anything but a regular file of at most `limit` bytes.

    The size is checked before reading, and at most limit + 1 bytes are ever read (the file may
    grow in between). O_NONBLOCK: a FIFO put in its place cannot block the reader."""
    source = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError([("", "file not found")], source) from None
    except OSError as e:
        raise ConfigError([("", f"cannot read: {e.strerror or e}")], source) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError([("", "not a regular file")], source)
        if st.st_size > limit:
            raise ConfigError([("", _too_large(st.st_size, limit))], source)
        data = b""
        while len(data) <= limit and (chunk := os.read(fd, limit + 1 - len(data))):
            data += chunk
    except OSError as e:
        raise ConfigError([("", f"cannot read: {e.strerror or e}")], source) from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ConfigError([("", _too_large(len(data), limit))], source)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError([("", f"cannot read: not UTF-8 text (byte {e.start})")], source) from None


def _too_large(size: int, limit: int) -> str:
    return f"file is too large: {size} bytes, the limit is {limit} bytes ({limit // KiB} KiB)"


def load_config(path: str | Path | None, *, missing_ok: bool = True, empty_ok: bool = True) -> Config:
    """Read and validate a config file. None, an empty file (unless empty_ok=False), or (with
    missing_ok) an absent file give the defaults. Relative paths inside the file are relative to
    the file's directory."""
    if path is None:
        return Config()
    path = Path(path)
    source = str(path)
    try:
        text = read_config_text(path)
    except ConfigError as e:
        if missing_ok and e.errors == [("", "file not found")]:
            log.warning("config file %s not found; using the defaults", path)
            return Config()
        raise
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        raise ConfigError([("", _yaml_reason(e))], source) from None
    if data is None and not empty_ok:
        raise ConfigError([("", "the file is empty (no settings); write {} to mean the built-in defaults")],
                          source)
    return parse_config(data, source, base_dir=path.resolve().parent)


def _yaml_reason(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"YAML syntax error at {where}{problem}"


def to_dict(config: Config) -> dict[str, Any]:
    """The config as plain data; parse_config(to_dict(c)) == c."""
    return dataclasses.asdict(config)


def apply_overrides(config: Config, *, listen: str | None = None, state_dir: str | None = None,
                    model: str | None = None, log_level: str | None = None) -> Config:
    """Command-line flags win over the file: a new, validated Config (None leaves a key as is).
    The daemon re-applies the same overrides after every reload."""
    data = to_dict(config)
    for section, key, value in (("server", "listen", listen), ("server", "state_dir", state_dir),
                                ("model", "path", model), ("logging", "level", log_level)):
        if value is not None:
            data[section][key] = value
    return parse_config(data, "command line", base_dir=Path.cwd())


# ------------------------------------------------------------------------------------ live reload

# Keys (or prefixes) whose change takes effect only after a restart; everything else applies live.
RESTART_REQUIRED = ("model", "server.listen", "server.workers", "server.tcp", "server.certfile", "server.keyfile",
                    "server.state_dir", "server.quic.congestion_control", "server.quic.duplicate_datagram_bytes",
                    "server.quic.duplicate_delay_ms", "server.quic.duplicate_after_loss_s", "cache.host_spill_bytes",
                    "scheduler.pin_threads")


def needs_restart(key_path: str) -> bool:
    return any(key_path == k or key_path.startswith(k + ".") for k in RESTART_REQUIRED)


@dataclass(slots=True)
class ConfigDiff:
    live: list[str] = field(default_factory=list)
    restart_required: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.live or self.restart_required)


def _changed(a: Any, b: Any, path: str, out: list[str]) -> None:
    if is_dataclass(a) and type(a) is type(b):
        for f in fields(a):
            _changed(getattr(a, f.name), getattr(b, f.name), _join(path, f.name), out)
    elif isinstance(a, dict) and isinstance(b, dict):
        for k in [*a, *(k for k in b if k not in a)]:
            if k in a and k in b:
                _changed(a[k], b[k], _join(path, k), out)
            else:
                out.append(_join(path, k))  # a tier added or removed
    elif a != b:
        out.append(path)  # lists (auth.keys) compare whole


def diff_config(old: Config, new: Config) -> ConfigDiff:
    """The changed key paths, split into those that apply live and those that need a restart."""
    changed: list[str] = []
    _changed(old, new, "", changed)
    diff = ConfigDiff()
    for key in changed:
        (diff.restart_required if needs_restart(key) else diff.live).append(key)
    return diff


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


# Keys naming files read only at startup: a reload that changes one must name a file that exists,
# or the next restart would fail.
STARTUP_FILES = ("model.path", "model.tokenizer", "model.chat_template", "server.certfile", "server.keyfile")


def _missing_files(old: Config, new: Config) -> list[tuple[str, str]]:
    errs = []
    for key in STARTUP_FILES:
        value = _get(new, key)
        if value is not None and value != _get(old, key) and not os.path.exists(value):
            errs.append((key, f"no such file or directory: {value}"))
    return errs


def access_widened(old: Config, new: Config) -> list[str]:
    """The auth keys whose change opens the API or /metrics to more clients, as `key: old -> new`."""
    out = []
    for key in ("auth.enabled", "auth.metrics_requires_key", "auth.metrics_loopback_only"):
        if _get(old, key) and not _get(new, key):
            out.append(f"{key}: true -> false")
    return out


def reload_config(old: Config, path: str | Path | None,
                  overrides: dict[str, Any] | None = None) -> tuple[Config, ConfigDiff]:
    """Re-read the file for SIGHUP: returns (the config now in effect, the diff) and logs what changed.

    Fails closed: a file that is missing, unreadable, empty, too large or invalid raises ConfigError
    (logged as one warning); the caller keeps `old`. Keys that need a restart keep their running
    values (and are logged as such); one naming a file that does not exist rejects the reload.
    """
    try:
        loaded = Config() if path is None else load_config(path, missing_ok=False, empty_ok=False)
        new = apply_overrides(loaded, **(overrides or {}))
        if missing := _missing_files(old, new):
            raise ConfigError(missing, str(path))
        diff = diff_config(old, new)
        for key in diff.restart_required:  # keep what is running
            parent, _, name = key.rpartition(".")  # nested: model.sampling_defaults.temperature
            setattr(_get(new, parent), name, _get(old, key))
        effective = parse_config(to_dict(new), str(path))  # old model.* vs new policy must still agree
    except ConfigError as e:
        log.warning("config reload rejected, keeping the running config: %s: %s", e.source, "; ".join(e.messages()))
        raise
    except Exception as e:  # whatever went wrong, the running config stays
        log.exception("config reload failed, keeping the running config: %s", path)
        raise ConfigError([("", f"cannot reload: {e!r}")], str(path)) from e
    for key in diff.restart_required:
        log.warning("config key %s changed; it takes effect after a restart", key)
    if widened := access_widened(old, effective):
        log.warning("config reload widens access: %s", ", ".join(widened))
    if diff.live:
        log.info("config reloaded; changed: %s", ", ".join(diff.live))
    elif not diff:
        log.info("config reloaded; no changes")
    return effective, diff


# ------------------------------------------------------------------------------------ check-config


def warnings(config: Config) -> list[str]:
    """Valid but probably unintended settings (logged at startup, shown by check-config)."""
    out = []
    host = config.server.host
    if not config.auth.enabled and not is_loopback(host):
        out.append(f"auth.enabled is false and server.listen is {config.server.listen}: "
                   "anyone who can reach this port can use the API")
    if config.auth.enabled and not config.auth.metrics_loopback_only and not config.auth.metrics_requires_key:
        out.append("/metrics is open to every address without a key (auth.metrics_*)")
    return out


def is_loopback(host: str | None) -> bool:
    """A loopback name or address (127.0.0.0/8, ::1, and ::ffff:127.x from a dual-stack socket)."""
    if host == "localhost":
        return True
    try:
        addr = ipaddress.ip_address((host or "").strip("[]").split("%")[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


def check_config(path: str | Path) -> tuple[bool, list[str]]:
    """(valid?, messages): the errors as `key: reason` lines, or the warnings of a valid file."""
    try:
        config = load_config(path, missing_ok=False)
        if missing := _missing_files(Config(), config):
            raise ConfigError(missing, str(path))
    except ConfigError as e:
        return False, e.messages()
    return True, [f"warning: {w}" for w in warnings(config)]


def run_check_config(path: str) -> int:
    """`edged check-config FILE`: prints OK or the errors; returns the exit status (0 valid, 1 not)."""
    ok, messages = check_config(path)
    for m in messages:
        print(f"{path}: {m}", file=sys.stderr)
    if ok:
        print(f"{path}: OK")
    return 0 if ok else 1


def hash_api_key(key: str) -> str:
    """What goes into auth.keys[].sha256: the sha256 hex digest of the key (same as `printf %s KEY | sha256sum`)."""
    return hashlib.sha256(key.encode()).hexdigest()
