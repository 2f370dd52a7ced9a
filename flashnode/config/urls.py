"""The coordinator's URL: written with its scheme and port explicit (``normalise_url``), and
whether a URL's host is this machine (``is_loopback``: plain http is allowed only there).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit


def normalise_url(value: str) -> str:
    """A coordinator URL with its scheme and port explicit: ``https://host:443[/path]``.

    Raises ValueError, in the owner's words, for anything that is not an http(s) URL.
    """
    text = value.strip()
    if "://" not in text:
        raise ValueError(
            f"{value!r} is not a URL: write it with its scheme, e.g. https://{text or 'host'}"
        )
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        raise ValueError(f"{value!r} is not a URL (bad port)") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} is not an http(s) URL")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{value!r} must not carry credentials, a query or a fragment")
    host = parts.hostname.lower().rstrip(".")
    if ":" in host:
        host = f"[{host}]"
    port = port or (443 if scheme == "https" else 80)
    return f"{scheme}://{host}:{port}{parts.path.rstrip('/')}"


def is_loopback(host: str) -> bool:
    """Whether a URL's host is this machine (plain http is allowed only there)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
