"""Every Prometheus metric, defined once; each process updates its own.

prometheus-client's multiprocess mode: the supervisor points PROMETHEUS_MULTIPROC_DIR at the
runtime dir before starting anyone, every process writes its figures to files there, and the
frontend's /metrics merges them. Import this module only after that variable is set.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess
from prometheus_client.exposition import generate_latest

# 10 ms to 60 s, for latencies users feel.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

# frontend
requests = Counter("surge_requests", "HTTP requests by endpoint and status",
                   ["endpoint", "status"])
ttft = Histogram("surge_time_to_first_token_seconds", "time to first token",
                 buckets=LATENCY_BUCKETS)
itl = Histogram("surge_inter_token_latency_seconds", "time between streamed pieces",
                buckets=LATENCY_BUCKETS)
e2e = Histogram("surge_request_latency_seconds", "end-to-end request latency",
                buckets=LATENCY_BUCKETS)
prompt_tokens = Counter("surge_prompt_tokens", "prompt tokens of finished requests")
generated_tokens = Counter("surge_generated_tokens", "tokens generated for finished requests")
open_connections = Gauge("surge_open_connections", "client connections open",
                         multiprocess_mode="livemax")
refused_connections = Counter("surge_refused_connections", "client connections refused over "
                              "max_connections")

# scheduler
queue_wait = Histogram("surge_queue_wait_seconds", "arrival to first scheduled step",
                       buckets=LATENCY_BUCKETS)
running = Gauge("surge_running_requests", "requests in the running batch",
                multiprocess_mode="livemax")
waiting = Gauge("surge_waiting_requests", "queued requests by priority and tenant",
                ["priority", "tenant"], multiprocess_mode="livemax")
batch_size = Histogram("surge_batch_size", "sequences per step", buckets=SIZE_BUCKETS)
step_tokens = Histogram("surge_step_tokens", "tokens per step", buckets=SIZE_BUCKETS)
kv_blocks_used = Gauge("surge_kv_cache_blocks_used", "KV blocks held by requests",
                       multiprocess_mode="livemax")
kv_blocks_total = Gauge("surge_kv_cache_blocks", "KV blocks in the cache",
                        multiprocess_mode="livemax")
prefix_queries = Counter("surge_prefix_cache_queried_tokens", "prompt tokens looked up")
prefix_hits = Counter("surge_prefix_cache_hit_tokens", "prompt tokens found in the cache")
preemptions = Counter("surge_preemptions", "sequences preempted for recompute")
queued_tokens = Gauge("surge_queued_prompt_tokens", "prompt tokens of queued requests",
                      multiprocess_mode="livemax")
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
policy = Gauge("surge_scheduling_policy", "1 for the policy in force", ["policy"],
               multiprocess_mode="livemax")

# workers
step_time = Histogram("surge_worker_step_seconds", "a worker's time per step",
                      ["rank"], buckets=STEP_BUCKETS)
device_memory = Gauge("surge_device_memory_bytes", "device memory allocated by torch",
                      ["rank"], multiprocess_mode="livemax")


def exposition() -> tuple[bytes, str]:
    """Every process's figures in Prometheus text format."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return generate_latest(registry), "text/plain; version=0.0.4; charset=utf-8"
