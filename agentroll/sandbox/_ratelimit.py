"""Pure pieces of the docker sandbox: a creation rate limit and the reaper's verdict.

Invariants: ``TokenBucket.reserve`` hands out at most ``burst`` creations at once and
``rate`` per second after that, in call order; ``reap_reason`` keeps a container unless it
is past its TTL or its owner, on this host, is provably gone (unreadable labels: kept, and
reported).  No I/O and no clock of their own (callers pass ``now``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping


class TokenBucket:
    """``reserve(now)`` returns how long the caller must wait before its creation."""

    def __init__(self, rate: float, burst: int, now: float) -> None:
        if not rate > 0:
            raise ValueError(f"creation rate must be > 0 per second, got {rate}")
        if burst < 1:
            raise ValueError(f"creation burst must be >= 1, got {burst}")
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._last = now

    def reserve(self, now: float) -> float:
        now = max(now, self._last)  # a clock that steps back does not mint tokens
        self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= 1.0
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate


# Labels every container of this project carries (values are strings).
LABEL = "agentroll.sandbox"
LABEL_OWNER = "agentroll.owner"  # "<host>~<pid space>:<pid>:<start ticks>" (_owner.HOST)
LABEL_CREATED = "agentroll.created_at"  # unix seconds
LABEL_TTL = "agentroll.ttl"  # seconds; 0 = none
LABEL_RUN = "agentroll.run"
LABEL_EPISODE = "agentroll.episode"


def reap_reason(
    labels: Mapping[str, str],
    *,
    now: float,
    host: str,
    owner_alive: Callable[[int, str], bool],
) -> str | None:
    """Why a project container should be removed now (``None``: keep it).

    ``owner_alive(pid, start_ticks)`` says whether that process still runs on this host
    (same pid and same start time, so a reused pid does not count).
    """
    try:
        created = float(labels.get(LABEL_CREATED, "0"))
        ttl = float(labels.get(LABEL_TTL, "0"))
    except ValueError:
        return None
    if ttl > 0 and now > created + ttl:
        return f"past its TTL ({ttl:.0f} s)"
    owner = labels.get(LABEL_OWNER, "")
    parts = owner.rsplit(":", 2)
    if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
        return None  # another machine's, or unreadable: only its TTL can end it
    if not owner_alive(int(parts[1]), parts[2]):
        return f"its owner (pid {parts[1]}) is gone"
    return None
