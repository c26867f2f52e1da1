"""Who may talk to a fleet: the loopback test, API-key checks and keeping keys out of text.

Shared by the servers jaxrl starts (``server.py``), servers started elsewhere
(``external.py``) and the HTTP client, so all three apply the same rules.
"""

from __future__ import annotations

import ipaddress

# The key of a fleet started outside jaxrl (ExternalServers, `jaxrl align run --server-url`).
EXTERNAL_API_KEY_ENV = "JAXRL_SGLANG_API_KEY"
REDACTED = "<api-key redacted>"


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost; False for any other address or name (0.0.0.0 included)."""
    host = host.strip().strip("[]")
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything, so treat it as reachable


def valid_key(key) -> bool:
    """True for "" and for printable characters without spaces (what a Bearer header can carry)."""
    return isinstance(key, str) and all(c.isprintable() and not c.isspace() for c in key)


def auth_headers(api_key: str) -> dict[str, str]:
    """The headers that carry ``api_key`` as SGLang's ``--api-key`` expects it; none for ""."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def redact(text: str, api_key: str) -> str:
    """``text`` with every occurrence of ``api_key`` replaced (SGLang logs its ``server_args``, key included)."""
    return text.replace(api_key, REDACTED) if api_key else text
