"""Typed configuration: a msgspec Struct per concern; defaults < TOML < SURGE_* < flags."""

from __future__ import annotations

import typing
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from surge.config_frontend import BatchConfig, PoolConfig, ResultCacheConfig, RoutingConfig
from surge.config_overload import OverloadConfig


class ModelConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    model: Annotated[
        str,
        Meta(description="'default' (bundled SmolLM2-135M-Instruct), a .gguf file, "
             "or a Hugging Face folder with config.json and *.safetensors"),
    ] = "default"
    tokenizer: Annotated[
        str | None, Meta(description="take the tokenizer and chat template from here instead "
                         "of the model: 'default', a .gguf file, or a folder of Hugging Face "
                         "tokenizer files (same vocabulary as the model)")
    ] = None
    served_model_name: Annotated[
        str | None, Meta(description="model id shown by /v1/models (default: from the file)")
    ] = None
    device: Annotated[
        Literal["auto", "cpu", "cuda"], Meta(description="where the model runs")
    ] = "auto"
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        Meta(description="serving dtype; auto picks bfloat16 where the hardware has it"),
    ] = "auto"
    tensor_parallel_size: Annotated[
        int, Meta(ge=0, description="ranks the model is split over, one process per GPU "
                  "(0: one per visible GPU; 1 on the CPU, where gloo joins any number)")
    ] = 0
    pipeline_parallel_size: Annotated[
        int, Meta(ge=1, description="stages the decoder layers are split over, in order, each "
                  "its own worker (or tensor-parallel group): P x tensor_parallel_size workers, "
                  "each holding the KV cache of its own layers")
    ] = 1
    pipeline_layers: Annotated[
        str | None, Meta(description="layers of each pipeline stage, comma-separated counts "
                         "that sum to the model's layers (default: as even as possible)")
    ] = None
    data_parallel_size: Annotated[
        int, Meta(ge=1, description="independent engine replicas (a scheduler and its workers "
                  "each, on devices of their own; on the CPU the cores are split) behind one "
                  "frontend, which routes each request by its prompt's prefix and the load")
    ] = 1
    enable_expert_parallel: Annotated[
        bool, Meta(description="mixture-of-experts models over several ranks: each rank holds "
                   "whole experts (an even share of them) instead of a slice of every expert")
    ] = False
    devices: Annotated[
        str | None, Meta(description="comma-separated CUDA devices for the ranks, as "
                         "CUDA_VISIBLE_DEVICES names them (indices, GPU-... or MIG-... UUIDs)")
    ] = None
    quantization: Annotated[
        Literal["none", "int8", "int4", "fp8"],
        Meta(description="weight-only quantization of the decoder layers' linear layers at "
             "load: int8 per output channel, int4 in groups (--quant-group-size), fp8 e4m3 per "
             "output channel"),
    ] = "none"
    quant_group_size: Annotated[
        int, Meta(ge=16, description="input columns sharing one int4 scale and offset (32 on a "
                  "Q4_1 GGUF keeps the file's own 4-bit values)")
    ] = 32
    quant_activation_bits: Annotated[
        Literal[8, 16],
        Meta(description="int4 and int8 weights on the cpu kernels with AVX-512 VNNI, past 4 "
             "rows (batched decode, prefill chunks): the bits each block of 32 activations is "
             "rounded to for the integer sums. 8 rounds as llama.cpp does (Q8_1): faster "
             "products (about bf16's speed at 64 rows, faster past 256) that change about 1 in "
             "50 of the model's next-token picks; 16 changes none. Other CPUs and devices keep "
             "16 bits or the activations' dtype"),
    ] = 16
    quantize_lm_head: Annotated[
        bool, Meta(description="quantize the LM head too, to the layers' mode (the embedding "
                   "always stays); without it, int4 on the cpu kernels runs a GGUF's Q8_0 head "
                   "on the file's own 8-bit values, other set-ups the head unquantized")
    ] = False
    cuda_graph_max_batch: Annotated[
        int, Meta(ge=0, description="on CUDA, decode-only steps up to this many sequences "
                  "replay CUDA graphs captured at start (padded to the next captured size); "
                  "0 runs every step eagerly")
    ] = 256
    pack_weights: Annotated[
        bool, Meta(description="on the CPU in bfloat16, run linear layers on weights reordered "
                   "for oneDNN (identical results, faster; costs a copy of a tied LM head); "
                   "with the cpu kernel backend on a CPU without AMX, hold each weight in the "
                   "C++ panel layout for every product on AVX-512 BF16 (the weights' memory "
                   "once), else keep oneDNN's copy beside the plain weight for products past "
                   "the small-row ones (the weights' memory twice)")
    ] = True
    kernel_backend: Annotated[
        Literal["auto", "reference", "cpu", "triton"],
        Meta(description="compute kernels: auto picks triton on CUDA and, on the CPU, the C++ "
             "kernels where they built (else the PyTorch reference); reference, cpu (paged "
             "attention in place, fused RMSNorm, rotary with the KV store, SiLU*mul, bf16 "
             "products on AMX or vector units, int8 and int4 in fp32) or triton force one "
             "(A/B runs, debugging)"),
    ] = "auto"
    deterministic: Annotated[
        bool, Meta(description="batch-invariant attention (CPU only): a token's result does "
                   "not depend on what else is in its step, so recovery and batching give "
                   "the same bf16 answers as a request run alone; slower steps")
    ] = False

    @property
    def group_size(self) -> int:
        """Workers of one replica: its pipeline stages times its tensor-parallel ranks."""
        return self.pipeline_parallel_size * self.tensor_parallel_size



class ServerConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    host: Annotated[str, Meta(description="address the HTTP server binds")] = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535, description="HTTP port")] = 8000
    log_level: Annotated[
        Literal["debug", "info", "warning", "error"], Meta(description="log verbosity")
    ] = "info"
    log_json: Annotated[bool, Meta(description="write logs as JSON lines")] = False
    metrics_compat: Annotated[
        Literal["none", "vllm"], Meta(description="vllm: /metrics also exports the mapped "
                                      "series under vLLM's names (vllm:num_requests_running, "
                                      "...), so dashboards built for vLLM work unchanged")
    ] = "none"
    max_body_bytes: Annotated[
        int, Meta(ge=1024, description="largest request body; larger ones get 413")
    ] = 4 * 2**20
    body_timeout_s: Annotated[
        float, Meta(gt=0, description="a client that takes longer to send its body gets 408")
    ] = 30.0
    drain_timeout_s: Annotated[
        float, Meta(ge=0, description="on SIGTERM, how long requests in flight may take to "
                    "finish before they end with an error")
    ] = 30.0
    max_prompt_tokens: Annotated[
        int, Meta(ge=0, description="longest prompt accepted, in tokens (0: the context "
                  "window)")
    ] = 0
    api_key: Annotated[
        str | None, Meta(description="one API key every /v1/ request must carry (tenant "
                         "'default'), as vLLM's --api-key; works beside --api-keys-file")
    ] = None
    max_choices: Annotated[
        int, Meta(ge=1, description="most choices one request may ask for: its prompts times "
                  "n, each an engine request (more get 400)")
    ] = 256
    api_keys_file: Annotated[
        str | None, Meta(description="JSON file of API keys (salted hashes) and their tenants, "
                         "managed with `surge admin keys`; unset: no keys, one tenant")
    ] = None
    metrics_auth: Annotated[
        Literal["keys", "public"],
        Meta(description="who may read /metrics and /stats: keys (with an API keys file or a "
             "metrics key, only the metrics key or a key of the admin tenant; else anyone) "
             "or public (anyone)"),
    ] = "keys"
    metrics_key: Annotated[
        Annotated[str, Meta(min_length=16)] | None,
        Meta(description="a Bearer token for /metrics and /stats only (a Prometheus scrape "
             "key, 16+ characters); prefer SURGE_METRICS_KEY or the file to a flag, which "
             "the process list shows"),
    ] = None
    admin_tenant: Annotated[
        str, Meta(description="keys of this tenant may also read /metrics and /stats (\"\": "
                  "none)")
    ] = "admin"
    header_timeout_s: Annotated[
        float, Meta(gt=0, description="a connection whose request headers are not complete "
                    "this long after it opened, or after the request's first byte, is closed "
                    "(with a 408 if the request had begun)")
    ] = 10.0
    keepalive_timeout_s: Annotated[
        float, Meta(gt=0, description="an idle keep-alive connection (no request after the "
                    "last answer) is closed after this long")
    ] = 15.0
    otlp_traces_endpoint: Annotated[
        str | None, Meta(description="export one OpenTelemetry trace span per request to this "
                         "OTLP/HTTP URL (e.g. http://collector:4318/v1/traces); unset: off")
    ] = None
    max_connections: Annotated[
        int, Meta(ge=0, description="open client connections; more are answered 503 and "
                  "closed (0: 4096, or the open-file limit less 256 when that is lower)")
    ] = 0


class SchedulerConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    max_num_seqs: Annotated[
        int, Meta(ge=1, description="most sequences in one step's batch")
    ] = 128
    max_num_batched_tokens: Annotated[
        int, Meta(ge=1, description="most tokens (prefill + decode) in one step; a longer "
                  "prompt is prefilled in chunks, so this bounds the decode stall it causes")
    ] = 512
    block_size: Annotated[int, Meta(ge=1, le=1024, description="tokens per KV block")] = 16
    prefix_cache: Annotated[
        bool, Meta(description="reuse the KV blocks of shared prompt prefixes")
    ] = True
    async_scheduling: Annotated[
        bool, Meta(description="plan step N+1 while the worker runs step N")
    ] = True
    batch_wait_ms: Annotated[
        float, Meta(ge=0, le=1000, description="when idle, wait this long for more arrivals "
                    "before the first step (0: never wait)")
    ] = 0.0
    length_bucketing: Annotated[
        bool, Meta(description="admit waiting prompts of similar length together (less "
                   "padding in decode attention); the oldest request still goes first")
    ] = False
    kv_cache_memory: Annotated[
        str,
        Meta(description="KV cache budget per GPU (on the CPU, for all ranks together): bytes "
             "with a unit (e.g. 96MiB, 2GiB) or a fraction of free device memory (e.g. 0.8)"),
    ] = "1GiB"
    policy: Annotated[
        Literal["fcfs", "priority", "sjf"],
        Meta(description="order of the waiting queue: fcfs (arrival), priority (lower value "
             "first, then arrival), sjf (shortest predicted job first); tenants share by "
             "weight under each"),
    ] = "priority"
    priority_preemption: Annotated[
        bool, Meta(description="with policy=priority, a waiting request may preempt running "
                   "ones of a less urgent class when the batch or the KV cache is full")
    ] = True
    priority_aging_s: Annotated[
        float, Meta(ge=0, description="each this many seconds in the queue makes a request one "
                    "class more urgent (with sjf: halves its predicted length), so nothing "
                    "starves; 0: no aging")
    ] = 10.0
    interactive_step_ms: Annotated[
        float, Meta(ge=0, description="with policy=priority, while requests of more than one "
                    "class have arrived in the last 10s, size each step from its measured cost "
                    "to take at most this long and plan one step at a time, so an urgent "
                    "arrival waits for a short step, not a long batch one (costs the less "
                    "urgent classes throughput); 0: off")
    ] = 0.0
    max_queued_requests: Annotated[
        int, Meta(ge=0, description="requests allowed to wait in the queue; more get 429 with "
                  "Retry-After (0: unbounded)")
    ] = 1024
    max_queued_tokens: Annotated[
        int, Meta(ge=0, description="prompt tokens allowed to wait in the queue; more get 429 "
                  "with Retry-After (0: unbounded)")
    ] = 1_048_576


class SpeculativeConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    speculative_method: Annotated[
        Literal["off", "ngram", "draft"],
        Meta(description="propose tokens for the model to verify in one forward: ngram "
             "(prompt lookup in the prompt and output so far) or draft (a small model, "
             "--draft-model / --draft-layers); off: one token per step"),
    ] = "off"
    num_speculative_tokens: Annotated[
        int, Meta(ge=1, le=16, description="tokens proposed per sequence and step")
    ] = 4
    ngram_max: Annotated[
        int, Meta(ge=1, description="longest suffix of the sequence looked up (ngram)")
    ] = 4
    ngram_min: Annotated[
        int, Meta(ge=1, description="shortest suffix looked up before giving up (ngram)")
    ] = 2
    draft_model: Annotated[
        str | None, Meta(description="the draft: a .gguf file, a Hugging Face folder or "
                         "'default', with the target's vocabulary (unset: the target itself, "
                         "cut to --draft-layers)")
    ] = None
    draft_layers: Annotated[
        int, Meta(ge=0, description="keep only the draft's first N layers (plus its final "
                  "norm and head); 0: all of them")
    ] = 0
    speculative_max_batch: Annotated[
        int, Meta(ge=0, description="speculate only while at most this many sequences decode "
                  "(larger batches are compute-bound, where verifying rejected tokens costs "
                  "more than it saves)")
    ] = 8
    speculative_min_acceptance: Annotated[
        float, Meta(ge=0, le=1, description="a sequence whose recent share of accepted "
                    "proposals falls below this pauses speculating for a while")
    ] = 0.3

    @property
    def has_draft(self) -> bool:
        """Whether the workers load a draft model (then 'draft' can be switched on live)."""
        return self.draft_model is not None or self.draft_layers > 0

    def problem(self) -> str | None:
        """What makes this combination unusable, if anything (checked at start and on set)."""
        if self.speculative_method == "draft" and not self.has_draft:
            return ("speculative_method=draft needs a draft loaded at start: give "
                    "--draft-model PATH or --draft-layers N (the target's first N layers)")
        if self.ngram_min > self.ngram_max:
            return f"ngram_min={self.ngram_min} is above ngram_max={self.ngram_max}"
        return None


class TenantConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    """One [tenants.NAME] table; a tenant without one gets these defaults. 0 means no limit."""

    weight: Annotated[float, Meta(gt=0, description="share of service when backlogged")] = 1.0
    priority: Annotated[int, Meta(description="priority of requests that give none")] = 0
    # A tenant's requests may ask to be less urgent than its priority, not more, unless this
    # lets them: the body's priority is the client's, the tenant's the operator's.
    min_priority: Annotated[int | None, Meta(
        description="most urgent priority its requests may ask for (unset: its priority)")] = None
    max_concurrent: Annotated[int, Meta(ge=0, description="requests queued or running")] = 0
    max_queued: Annotated[int, Meta(ge=0, description="requests waiting in the queue")] = 0
    requests_per_min: Annotated[float, Meta(ge=0, description="token bucket of requests")] = 0
    tokens_per_min: Annotated[
        float, Meta(ge=0, description="token bucket of prompt + generated tokens")
    ] = 0
    timeout_s: Annotated[
        float, Meta(ge=0, description="deadline to start for requests that give no timeout")
    ] = 0
    # The degradation ladder (OverloadConfig) takes these steps for the tenant, least
    # important tenant first: cap new requests' max_tokens, then refuse new work with 429.
    degrade: Annotated[
        Literal["never", "cap", "refuse", "cap-then-refuse"],
        Meta(description="how this tenant's new requests may degrade under overload"),
    ] = "never"
    degrade_max_tokens: Annotated[
        int, Meta(ge=1, description="max_tokens of new requests while capped")
    ] = 64
    # Batch webhooks: the frontend takes edits (surge admin set, reload) for events from then on.
    webhook_urls: Annotated[
        str, Meta(description="space-separated URLs that receive this tenant's batch events")
    ] = ""
    webhook_secret: Annotated[
        str, Meta(description="Standard Webhooks secret (whsec_<base64>) the events are "
                  "signed with; without one no event is sent")
    ] = ""
    webhook_from_metadata: Annotated[
        bool, Meta(description="a batch may name one more receiver in metadata.webhook_url")
    ] = False


class AutoscaleConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    """The signals autoscalers and balancers read (metrics, `surge admin capacity`)."""

    capacity_window_s: Annotated[
        float, Meta(gt=0, description="capacity is the best rate (tokens/s, requests/s) "
                    "served over 10 s spans within this window")
    ] = 600.0
    forecast_interval_s: Annotated[
        float, Meta(gt=0, description="arrivals are counted per interval of this length; "
                    "each closed one updates the forecast")
    ] = 60.0
    forecast_season_s: Annotated[
        float, Meta(ge=0, description="the length of the repeating pattern the forecast "
                    "learns (a day); 0: level and trend only")
    ] = 86400.0
    forecast_alpha: Annotated[
        float, Meta(gt=0, le=1, description="Holt-Winters smoothing of the level")
    ] = 0.3
    forecast_beta: Annotated[
        float, Meta(ge=0, le=1, description="Holt-Winters smoothing of the trend")
    ] = 0.05
    forecast_gamma: Annotated[
        float, Meta(ge=0, le=1, description="Holt-Winters smoothing of the season")
    ] = 0.3


class SupervisorConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    max_worker_restarts: Annotated[
        int, Meta(ge=0, description="worker restarts allowed within a minute before surge "
                  "gives up (requests then end with 503)")
    ] = 3


class SurgeConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    supervisor: SupervisorConfig = msgspec.field(default_factory=SupervisorConfig)
    speculative: SpeculativeConfig = msgspec.field(default_factory=SpeculativeConfig)
    overload: OverloadConfig = msgspec.field(default_factory=OverloadConfig)
    cache: ResultCacheConfig = msgspec.field(default_factory=ResultCacheConfig)
    batch: BatchConfig = msgspec.field(default_factory=BatchConfig)
    routing: RoutingConfig = msgspec.field(default_factory=RoutingConfig)
    autoscale: AutoscaleConfig = msgspec.field(default_factory=AutoscaleConfig)
    # Tables of named tenants; set in the TOML file or live (`surge admin set
    # tenants.NAME.FIELD=VALUE`), not by flags.
    tenants: dict[str, TenantConfig] = {}
    # Data-parallel replica pools, likewise (`surge admin set pools.NAME.FIELD=VALUE`).
    pools: dict[str, PoolConfig] = {}


# The sections made of named tables, and the type of each table.
TABLES: dict[str, type[Struct]] = {"tenants": TenantConfig, "pools": PoolConfig}
# The sections whose options are flags and SURGE_* variables.
SECTIONS: dict[str, type[Struct]] = {
    name: hint for name, hint in typing.get_type_hints(SurgeConfig).items()
    if isinstance(hint, type) and issubclass(hint, Struct)
}


class ConfigError(ValueError):
    """A configuration value is missing, malformed or out of range."""
