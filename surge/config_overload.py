"""The overload section: the frontend's circuit breaker and the scheduler's degradation
ladder; surge/config.py gathers it into SurgeConfig."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct


class OverloadConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    """The circuit breaker (frontend) and the degradation ladder (scheduler); all live."""

    breaker_failures: Annotated[
        int, Meta(ge=0, description="engine failures (worker deaths) within breaker_window_s "
                  "that open the circuit breaker: new requests then get 503 at once; 0: off")
    ] = 3
    breaker_window_s: Annotated[
        float, Meta(gt=0, description="the sliding window the breaker counts failures over")
    ] = 60.0
    breaker_cooldown_s: Annotated[
        float, Meta(gt=0, description="how long an open breaker refuses everything before it "
                    "lets probe requests through (half-open)")
    ] = 30.0
    breaker_probes: Annotated[
        int, Meta(ge=1, description="requests let through at once while half-open; that many "
                  "finishing closes the breaker, one engine failure opens it again")
    ] = 2
    ttft_slo_s: Annotated[
        float, Meta(ge=0, description="congested when the time-to-first-token p95 of the last "
                    "ladder interval is above this; 0: not a signal")
    ] = 0.0
    max_queue_drain_s: Annotated[
        float, Meta(ge=0, description="congested when the waiting queue would take longer than "
                    "this to drain at the measured rate; 0: not a signal")
    ] = 0.0
    max_kv_use: Annotated[
        float, Meta(ge=0, le=1, description="congested when this fraction of the KV cache is in "
                    "use; 0: not a signal")
    ] = 0.0
    ladder_interval_s: Annotated[
        float, Meta(gt=0, description="how often the signals are judged: the ladder moves at "
                    "most one step per interval")
    ] = 2.0
    ladder_recover: Annotated[
        float, Meta(gt=0, lt=1, description="a step is undone only when every signal is below "
                    "this fraction of its threshold (hysteresis)")
    ] = 0.7
    ladder_calm_intervals: Annotated[
        int, Meta(ge=1, description="judgements in a row that must find the engine calm "
                  "before a step is undone (an interval without arrivals proves little)")
    ] = 3
