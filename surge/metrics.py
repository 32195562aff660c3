"""Every Prometheus metric, defined once; each process updates its own.

prometheus-client's multiprocess mode: the supervisor points PROMETHEUS_MULTIPROC_DIR at the
runtime dir before starting anyone, every process writes its figures to files there, and the
frontend's /metrics merges them. Import this module only after that variable is set.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess
from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest

# 10 ms to 60 s, for latencies users feel.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

# Series about the served model carry its name, as vLLM's do, so dashboards built for vLLM
# can select by model_name.
MODEL = ["model_name"]
# A scheduler's series about its own engine also name its data-parallel replica ("0" with
# one), so each replica shows; vLLM's names sum them.
ENGINE = ["model_name", "replica"]
# Why a request (each choice of it) ended: the engine's stop / length, a client that left or
# cancelled (abort), or an error after it was accepted.
FINISHED_REASONS = ("stop", "length", "abort", "error")

# frontend
requests = Counter("surge_requests", "HTTP requests by endpoint and status",
                   ["endpoint", "status"])
ttft = Histogram("surge_time_to_first_token_seconds", "time to first token", MODEL,
                 buckets=LATENCY_BUCKETS)
itl = Histogram("surge_inter_token_latency_seconds", "time between streamed pieces", MODEL,
                buckets=LATENCY_BUCKETS)
e2e = Histogram("surge_request_latency_seconds", "end-to-end request latency", MODEL,
                buckets=LATENCY_BUCKETS)
prompt_tokens = Counter("surge_prompt_tokens", "prompt tokens of accepted requests (finished, "
                        "cancelled or failed)", MODEL)
request_success = Counter("surge_request_success", "requests (each choice) ended, by "
                          "finished_reason: stop, length, abort (the client left or "
                          "cancelled), error", ["model_name", "finished_reason"])
breaker_state = Gauge("surge_breaker_state", "the circuit breaker: 0 closed, 1 half-open, "
                      "2 open", multiprocess_mode="livemax")
breaker_transitions = Counter("surge_breaker_transitions", "circuit breaker moves, by the "
                              "state entered", ["state"])
breaker_rejected = Counter("surge_breaker_rejected_requests", "requests the open (or "
                           "half-open) breaker answered with 503 at once")
degraded_responses = Counter("surge_degraded_responses", "responses whose request the "
                             "degradation ladder capped (told in X-Surge-Degraded)", MODEL)
open_connections = Gauge("surge_open_connections", "client connections open",
                         multiprocess_mode="livemax")
refused_connections = Counter("surge_refused_connections", "client connections refused over "
                              "max_connections")
result_cache_hits = Counter("surge_result_cache_hits", "requests answered from the result cache")
result_cache_misses = Counter("surge_result_cache_misses", "cacheable requests the result cache "
                              "did not hold (computed by the engine)")
result_cache_bytes = Gauge("surge_result_cache_bytes", "bytes the memory result cache holds",
                           multiprocess_mode="livemax")
result_cache_stored_bytes = Counter("surge_result_cache_stored_bytes", "bytes of answers "
                                    "written to the result cache (either backend)")
result_cache_errors = Counter("surge_result_cache_errors", "result cache backend calls that "
                              "failed (Redis down, slow or refusing), by operation",
                              ["operation"])
batches = Gauge("surge_batches", "Batch API batches by state", ["state"],
                multiprocess_mode="livemax")
batch_lines = Counter("surge_batch_lines", "batch lines ended, by outcome: done (in the output "
                      "file); failed (answered with an error), invalid (refused when read), "
                      "cancelled or expired (never ran), all in the error file", ["outcome"])
webhook_deliveries = Counter("surge_webhook_deliveries", "webhook delivery attempts, by "
                             "result: delivered, retry, given_up", ["result"])

# scheduler
generated_tokens = Counter("surge_generated_tokens", "tokens generated, for every request "
                           "(cancelled ones too)", ENGINE)
queue_wait = Histogram("surge_queue_wait_seconds", "arrival to first scheduled step", ENGINE,
                       buckets=LATENCY_BUCKETS)
running = Gauge("surge_running_requests", "requests in the running batch", ENGINE,
                multiprocess_mode="livemax")
waiting = Gauge("surge_waiting_requests", "queued requests by priority and tenant",
                ["model_name", "priority", "tenant", "replica"], multiprocess_mode="livemax")
batch_size = Histogram("surge_batch_size", "sequences per step", buckets=SIZE_BUCKETS)
step_tokens = Histogram("surge_step_tokens", "tokens per step", buckets=SIZE_BUCKETS)
kv_blocks_used = Gauge("surge_kv_cache_blocks_used", "KV blocks held by requests", ENGINE,
                       multiprocess_mode="livemax")
kv_blocks_total = Gauge("surge_kv_cache_blocks", "KV blocks in the cache", ENGINE,
                        multiprocess_mode="livemax")
kv_usage = Gauge("surge_kv_cache_usage_ratio", "share of the KV blocks held by requests "
                 "(0 to 1)", ENGINE, multiprocess_mode="livemax")
prefix_queries = Counter("surge_prefix_cache_queried_tokens", "prompt tokens looked up", ENGINE)
prefix_hits = Counter("surge_prefix_cache_hit_tokens", "prompt tokens found in the cache",
                      ENGINE)
preemptions = Counter("surge_preemptions", "sequences preempted for recompute", ENGINE)
queued_tokens = Gauge("surge_queued_prompt_tokens", "prompt tokens of queued requests",
                      ["replica"], multiprocess_mode="livemax")
rejected = Counter("surge_rejected_requests", "requests refused at arrival or ended in the "
                   "queue, by tenant and the limit that said no", ["tenant", "limit"])
tenant_running = Gauge("surge_tenant_running_requests", "requests in the batch by tenant",
                       ["tenant"], multiprocess_mode="livemax")
tenant_served = Counter("surge_tenant_served_tokens", "prompt and generated tokens computed "
                        "for each tenant (fair sharing divides these by the weight)", ["tenant"])
tenant_limit = Gauge("surge_tenant_limit", "each tenant's weight, default priority, quotas, "
                     "rates and timeout (0: none)", ["tenant", "limit"],
                     multiprocess_mode="livemax")
live_parameter = Gauge("surge_live_parameter", "the live numeric parameters "
                       "(booleans as 0/1)", ["name"], multiprocess_mode="livemax")
spec_proposed = Counter("surge_spec_proposed_tokens", "speculative tokens proposed for "
                        "verification")
spec_accepted = Counter("surge_spec_accepted_tokens", "speculative tokens the model accepted")
spec_verifications = Counter("surge_spec_verifications", "sequence-steps that verified "
                             "proposals")
spec_acceptance = Gauge("surge_spec_acceptance_rate", "accepted / proposed tokens since start",
                        multiprocess_mode="livemax")
spec_accepted_length = Gauge("surge_spec_mean_accepted_length", "tokens gained per "
                             "verification: accepted ones plus the model's own",
                             multiprocess_mode="livemax")
overload_level = Gauge("surge_overload_level", "degradation steps in force (0: none)",
                       multiprocess_mode="livemax")
congested = Gauge("surge_congested", "1 while a congestion signal is over its threshold",
                  multiprocess_mode="livemax")
degraded = Counter("surge_degraded_requests", "new requests the degradation ladder capped or "
                   "refused, by tenant table and step", ["tenant", "action"])
overload_signal = Gauge("surge_overload_signal", "the congestion signals at the last "
                        "judgement (ttft_p95_s, queue_drain_s, kv_use)", ["signal"],
                        multiprocess_mode="livemax")
# For autoscalers and balancers (scheduler/signals.py; README: recommended targets)
queue_drain = Gauge("surge_queue_drain_seconds", "estimated seconds to drain the waiting queue "
                    "at the measured rate", multiprocess_mode="livemax")
arrival_rate = Gauge("surge_arrival_rate", "requests a second that arrived over the last "
                     "forecast interval", multiprocess_mode="livemax")
forecast_arrival_rate = Gauge("surge_forecast_arrival_rate", "requests a second expected "
                              "horizon_s seconds ahead (Holt-Winters, daily season)",
                              ["horizon_s"], multiprocess_mode="livemax")
capacity_tokens = Gauge("surge_capacity_tokens_per_second", "the most tokens a second "
                        "generated over 10 s within the capacity window",
                        multiprocess_mode="livemax")
capacity_requests = Gauge("surge_capacity_requests_per_second", "the most requests a second "
                          "finished over 10 s within the capacity window",
                          multiprocess_mode="livemax")
policy = Gauge("surge_scheduling_policy", "1 for the policy in force", ["policy"],
               multiprocess_mode="livemax")

# workers
step_time = Histogram("surge_worker_step_seconds", "a worker's time per step",
                      ["rank"], buckets=STEP_BUCKETS)
# Busy: preparing, computing and finishing steps; idle: waiting for a plan or, with pipeline
# stages, for a neighbouring stage's hidden states (idle share = idle / (busy + idle)).
worker_busy = Counter("surge_worker_busy_seconds", "a worker's time computing steps", ["rank"])
worker_idle = Counter("surge_worker_idle_seconds", "a worker's time waiting for a plan or a "
                      "neighbouring pipeline stage, counted at each step's end", ["rank"])
device_memory = Gauge("surge_device_memory_bytes", "device memory allocated by torch",
                      ["rank"], multiprocess_mode="livemax")
moe_expert_tokens = Counter("surge_moe_expert_tokens", "tokens routed to each expert of a "
                            "mixture-of-experts model, summed over its MoE layers", ["expert"])


# Our name -> vLLM's, for --metrics-compat vllm (and the README's table). Labels other than
# these are summed away, as vLLM's series have only them.
VLLM_NAMES = {
    "surge_running_requests": "vllm:num_requests_running",
    "surge_waiting_requests": "vllm:num_requests_waiting",
    "surge_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
    "surge_prompt_tokens": "vllm:prompt_tokens",
    "surge_generated_tokens": "vllm:generation_tokens",
    "surge_request_success": "vllm:request_success",
    "surge_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "surge_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "surge_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "surge_queue_wait_seconds": "vllm:request_queue_time_seconds",
    "surge_preemptions": "vllm:num_preemptions",
    "surge_prefix_cache_queried_tokens": "vllm:prefix_cache_queries",
    "surge_prefix_cache_hit_tokens": "vllm:prefix_cache_hits",
}
_VLLM_LABELS = {"model_name", "finished_reason", "le"}


def frontend_series(model_name: str) -> None:
    """The frontend's per-model series at 0 from the start, so panels never read "No data"."""
    for series in (ttft, itl, e2e, prompt_tokens):
        series.labels(model_name)
    for reason in FINISHED_REASONS:
        request_success.labels(model_name, reason)


def _renamed(family: Metric, name: str) -> Metric:
    """The family under vLLM's name, summed over the labels vLLM's series do not have."""
    sums: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for sample in family.samples:
        labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k in _VLLM_LABELS))
        key = (sample.name[len(family.name):], labels)
        sums[key] = sums.get(key, 0.0) + sample.value
    out = Metric(name, family.documentation, family.type)
    for (suffix, labels), value in sums.items():
        out.add_sample(name + suffix, dict(labels), value)
    return out


class _WithVllmNames:
    """A registry's families, then the mapped ones again under vLLM's names."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            yield family
            if family.name in VLLM_NAMES:
                yield _renamed(family, VLLM_NAMES[family.name])


def exposition(compat: str = "none") -> tuple[bytes, str]:
    """Every process's figures in Prometheus text format (compat 'vllm': also under vLLM's
    names)."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    source: Any = _WithVllmNames(registry) if compat == "vllm" else registry
    return generate_latest(source), "text/plain; version=0.0.4; charset=utf-8"
