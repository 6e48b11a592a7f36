"""Network helpers shared by the HTTP servers (no I/O here)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether ``host`` (``localhost`` or an address) reaches this machine only; a bind to
    anything else needs a token."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
