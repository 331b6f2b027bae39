"""Headless Chromium (Debian's `chromium`, driven by Playwright for Python) that trusts one self-signed
certificate over TCP and QUIC, and records what the page did: every response with the protocol
Chromium used for it (DevTools `Network.responseReceived`), console errors and warnings, uncaught
exceptions and CSP violations.

Chromium refuses QUIC to a server whose certificate does not chain to a built-in root
(ERR_QUIC_CERT_ROOT_NOT_KNOWN, seen as a "certificate unknown" TLS alert in its net-log), even when
`--ignore-certificate-errors-spki-list` accepts that certificate for TLS over TCP, unless the *host* is
named in `--origin-to-force-quic-on` (`ProofVerifierChromium`'s hostnames_to_allow_unknown_roots_ is
filled from that switch, host only). So to let a test prove Alt-Svc discovery, the switch names the
daemon's host on another port (nothing listens there and the page never goes there): QUIC is allowed
for the host, never forced for the daemon's origin, which is reached over TCP first and upgrades to
h3 only through its `Alt-Svc` header.
"""
from __future__ import annotations

import base64
import hashlib
import shutil
from dataclasses import dataclass, field
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

# Records each `securitypolicyviolation` of every document the page loads (run before the page's
# own script; DevTools-injected scripts are not subject to the page's CSP).
CSP_RECORDER = """
window.__cspViolations = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.__cspViolations.push(e.violatedDirective + " blocked " + (e.blockedURI || "inline"));
});
"""


def chromium_path() -> str | None:
    """Debian's launcher (/usr/bin/chromium), if the package is installed."""
    return shutil.which("chromium")


def spki_sha256_b64(cert_file: str) -> str:
    """What `--ignore-certificate-errors-spki-list` takes: base64 of the SHA-256 of the certificate's
    SubjectPublicKeyInfo (DER)."""
    with open(cert_file, "rb") as f:
        cert = x509.load_pem_x509_certificate(f.read())
    spki = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(spki).digest()).decode()


def chromium_args(cert_file: str, host: str, unused_port: int) -> list[str]:
    """Trust `cert_file` for TLS and QUIC on `host`, without forcing QUIC on any origin the test uses
    (see the module docstring for why the force switch names `unused_port`)."""
    return [
        f"--ignore-certificate-errors-spki-list={spki_sha256_b64(cert_file)}",
        f"--origin-to-force-quic-on={host}:{unused_port}",
        "--enable-quic",
    ]


@dataclass
class NetworkResponse:
    url: str
    method: str
    status: int
    protocol: str  # as Chromium reports it: "http/1.1", "h2", "h3"
    headers: dict[str, str]


@dataclass
class PageRecorder:
    """What one Playwright page did, gathered from DevTools and Playwright events."""
    page: Any  # playwright.sync_api.Page
    responses: list[NetworkResponse] = field(default_factory=list)
    console_problems: list[str] = field(default_factory=list)
    _methods: dict[str, str] = field(default_factory=dict)

    @classmethod
    def attach(cls, page: Any) -> PageRecorder:
        rec = cls(page)
        page.add_init_script(CSP_RECORDER)
        page.on("console", rec._on_console)
        page.on("pageerror", lambda exc: rec.console_problems.append(f"uncaught: {exc}"))
        cdp = page.context.new_cdp_session(page)
        cdp.on("Network.requestWillBeSent", rec._on_request)
        cdp.on("Network.responseReceived", rec._on_response)
        cdp.send("Network.enable")
        return rec

    def _on_console(self, msg: Any) -> None:
        if msg.type in ("error", "warning"):
            self.console_problems.append(f"{msg.type}: {msg.text}")

    def _on_request(self, event: dict[str, Any]) -> None:
        self._methods[event["requestId"]] = event["request"]["method"]

    def _on_response(self, event: dict[str, Any]) -> None:
        r = event["response"]
        self.responses.append(NetworkResponse(
            r["url"], self._methods.get(event["requestId"], "?"), r["status"], r.get("protocol", ""),
            {k.lower(): v for k, v in r["headers"].items()}))

    def responses_to(self, path: str, method: str = "GET") -> list[NetworkResponse]:
        return [r for r in self.responses if r.url.split("?")[0].endswith(path) and r.method == method]

    def csp_violations(self) -> list[str]:
        return self.page.evaluate("window.__cspViolations || []")
