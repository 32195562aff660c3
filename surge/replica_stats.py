"""Several data-parallel replicas' EngineStats as one: for /stats and `surge admin stats`."""

from __future__ import annotations

from typing import Any

# Figures that are not added up over replicas: the most recent / the worst of them (a request
# the server refuses counts in every replica's breaker).
_MAX = {"time", "overload_level", "queue_drain_s", "congested", "breaker_rejected"}
# The server's breaker is open only while every replica's is (server/breaker.Breakers).
_BREAKER = ("closed", "half-open", "open")


def total(replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """The sum of each running total and count over replicas (the worst of the levels), with
    each replica's own figures under "replicas"."""
    out: dict[str, Any] = {}
    for key, first in replicas[0].items():
        values = [r[key] for r in replicas if key in r]
        if key == "breaker":
            out[key] = min(values, key=_BREAKER.index)
        elif isinstance(first, str):  # the message's tag
            out[key] = first
        elif key in _MAX:
            out[key] = max(values)
        elif isinstance(first, dict):  # the forecast: rates by horizon
            out[key] = {h: sum(v.get(h, 0.0) for v in values) for h in first}
        else:
            out[key] = sum(values)
    out.pop("replica", None)
    out["replicas"] = replicas
    return out
