"""Request checks for a server that runs without an API key, and API-key matching.

Without a key, any web page the user opens could otherwise drive a loopback server: a cross-origin `POST` with
`Content-Type: text/plain` (or a form) needs no CORS preflight, and a DNS-rebinding page reaches 127.0.0.1
under its own host name. So a keyless server serves only requests whose `Host` is a loopback name or address
(or exactly the bind address) and whose POST bodies are declared `application/json` (which a page can only
send cross-origin after a preflight the server never answers). A request with a valid key is trusted.

The checks are pure: they take header values and return the `APIError` to answer with, or None.
"""

from __future__ import annotations

import hmac
import ipaddress

from turbospec.server.protocol import APIError

LOOPBACK_NAMES = ("localhost",)
BODY_METHODS = ("POST",)


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def is_loopback(name: str) -> bool:
    """True for `localhost`, 127.0.0.0/8 and ::1 (a bare name or address: no port, no brackets)."""
    name = name.strip().lower().rstrip(".")
    if name in LOOPBACK_NAMES:
        return True
    ip = _ip(name.strip("[]"))
    return ip is not None and ip.is_loopback


def host_name(header: str) -> str | None:
    """The name or address in a `Host` header, lower-case, without port or IPv6 brackets; None if malformed."""
    h = header.strip().lower()
    if h.startswith("["):  # [v6]:port
        addr, sep, rest = h[1:].partition("]")
        if not sep or (rest and not (rest.startswith(":") and rest[1:].isdigit())) or _ip(addr) is None:
            return None
        return addr
    name, sep, port = h.rpartition(":")
    if not sep:
        name = h
    elif not port.isdigit():
        return None
    name = name.rstrip(".")
    if not name or any(c.isspace() or c in "/@[]:" for c in name):
        return None
    return name


def check_host(header: str | None, bind_host: str) -> APIError | None:
    """403 unless `Host` names a loopback address or exactly the address the server was bound to."""
    name = host_name(header) if header else None
    bind = bind_host.strip().lower().strip("[]").rstrip(".")
    if name is not None and (is_loopback(name) or name == bind):
        return None
    shown = (header or "")[:100]
    return APIError(403, f"Host {shown!r} is not allowed: without an API key the server answers only loopback "
                         f"Host names (localhost, 127.0.0.1, [::1]) or its --host address",
                    "permission_error", None, "host_not_allowed")


def check_content_type(method: str, header: str | None) -> APIError | None:
    """415 for a POST whose body is not declared `application/json` (parameters such as charset allowed)."""
    if method.upper() not in BODY_METHODS:
        return None
    if (header or "").split(";", 1)[0].strip().lower() == "application/json":
        return None
    return APIError(415, f"Content-Type must be application/json, got {(header or '(none)')[:100]!r}",
                    "invalid_request_error", None, "unsupported_media_type")


def check_keyless(method: str, host: str | None, content_type: str | None, bind_host: str) -> APIError | None:
    """The checks a request to a keyless server must pass (Host first, then Content-Type)."""
    return check_host(host, bind_host) or check_content_type(method, content_type)


def binds_beyond_loopback(bind_host: str) -> bool:
    """True when a server bound to `bind_host` may be reachable from other machines."""
    return not is_loopback(bind_host)


def match_key(token: str, keys: tuple[bytes, ...]) -> int | None:
    """The index of the key equal to `token`, or None. Compares against every key with `hmac.compare_digest`
    (no early exit), so the time taken does not reveal which key or how much of it matched."""
    given = token.encode()
    found = None
    for i, key in enumerate(keys):
        if hmac.compare_digest(given, key) and found is None:
            found = i
    return found


def key_label(index: int) -> str:
    """A short stable name for the `index`-th configured key (its position, never the key)."""
    return f"key{index}"
