"""The model families surge serves: each checkpoint's config read into LlamaConfig's switches (the
model is gpu_workers/llama.py), and what its weights need at load. No torch here: the supervisor
reads a model's family before it starts any process."""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec
from msgspec import Struct

from surge.model_files import ModelFiles, context_length, gguf_metadata, gguf_rope, hf_config

# Hugging Face model_type values, and GGUF general.architecture values.
HF_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "mixtral",
               "qwen3_moe")
GGUF_FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3",
                 "qwen3moe")  # Mixtral and Mistral are "llama"
# Their RMSNorms multiply by (1 + w): the weights are stored as w.
_PLUS_ONE_NORMS = ("gemma2", "gemma3_text")
# MLP activations (hidden_act / hidden_activation) -> LlamaConfig.activation.
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# Rope scaling types (rope_type) kernels/rotary.py implements.
SCALINGS = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")


class LlamaConfig(Struct, kw_only=True):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None
    max_position_embeddings: int
    tie_word_embeddings: bool
    # The other families' differences; the defaults are Llama's.
    qkv_bias: bool = False  # Qwen2: biases on the query, key and value projections
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each head's query and key
    sandwich_norms: bool = False  # Gemma: the attention's and the MLP's outputs are normed too
    activation: str = "silu"  # of the MLP's gate; Gemma: "gelu_tanh" (GeGLU)
    embed_scale: float = 1.0  # Gemma: the embeddings are multiplied by sqrt(hidden_size)
    attn_scale: float = 0.0  # 0: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5
    attn_softcap: float = 0.0  # Gemma 2: scores become softcap * tanh(score / softcap)
    final_softcap: float = 0.0  # Gemma 2/3: the same on the logits
    sliding_window: int = 0  # keys a windowed layer's query sees, itself included
    window_layers: list[bool] = msgspec.field(default_factory=list)  # per layer; empty: none
    local_rope_theta: float = 0.0  # Gemma 3: the windowed layers' rotary base (0: one rope)
    # Mixtral, Qwen3-MoE: each layer's MLP is num_experts gated MLPs of moe_intermediate_size
    # columns, experts_per_token of them per token (0 experts: a dense MLP).
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    moe_renormalize: bool = False  # the top-k weights rescaled to sum to 1 (Mixtral's way)
    dense_layers: list[int] = msgspec.field(default_factory=list)  # Qwen3-MoE's mlp_only_layers

    @property
    def reach(self) -> int:
        """How far back every layer attends, in tokens (0: some layer sees the whole context):
        KV blocks further back than that can be given back."""
        return self.sliding_window if self.window_layers and all(self.window_layers) else 0


class UnsupportedModel(ValueError):
    """A checkpoint of a family (or with a feature) surge does not implement."""


class Family(NamedTuple):
    cfg: LlamaConfig
    norm_offset: float  # added to every RMSNorm weight as it is loaded (Gemma's 1 + w)


def architecture(files: ModelFiles) -> str:
    """The checkpoint's model_type, or its GGUF architecture; refused unless surge serves it."""
    if files.gguf_file:
        arch = str(gguf_metadata(files.path)["general.architecture"])
        supported = GGUF_FAMILIES
    else:
        arch = str(hf_config(files.folder).get("model_type"))
        supported = HF_FAMILIES
    if arch not in supported:
        kind = "GGUF architecture" if files.gguf_file else "model_type"
        raise UnsupportedModel(f"{files.path}: {kind} {arch!r} is not supported; surge serves "
                               f"{', '.join(supported)}")
    return arch


def unsplit(total: int, size: int, what: str) -> str | None:
    """Why `total` heads or columns do not split evenly over `size` tensor-parallel ranks (None:
    they do); the supervisor asks before any worker starts, each rank as it loads."""
    if total % size:
        return (f"{what} ({total}) do not split evenly over --tensor-parallel-size {size}; "
                f"pick a size that divides it")
    return None


def too_many_layers(draft_layers: int, num_layers: int) -> str | None:
    """Why --draft-layers cannot cut the model (None: it can)."""
    if not 0 < draft_layers <= num_layers:
        return (f"--draft-layers {draft_layers}: the model has {num_layers} layers; give 1 to "
                f"{num_layers} (0: all)")
    return None


def read_family(files: ModelFiles) -> Family:
    arch = architecture(files)
    if files.gguf_file:
        return Family(config_from_gguf(gguf_metadata(files.path)), 0.0)
    from transformers import AutoConfig

    # transformers fills each family's defaults (layer types, rope parameters) as its own
    # implementation reads them.
    config = AutoConfig.from_pretrained(files.folder)
    return Family(config_from_hf(config), 1.0 if arch in _PLUS_ONE_NORMS else 0.0)


def config_from_hf(c: Any) -> LlamaConfig:
    """A transformers config (PretrainedConfig) of one of HF_FAMILIES -> LlamaConfig."""
    kind = c.model_type
    heads = c.num_attention_heads
    rope = dict(c.rope_parameters or {})
    local_theta = 0.0
    if kind == "gemma3_text":  # one rope per layer type
        local_theta = rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    kind_of_rope = rope.get("rope_type", "default")
    if kind_of_rope in ("dynamic", "longrope"):
        # What the table needs that Hugging Face reads from the config itself.
        rope.setdefault("original_max_position_embeddings", getattr(
            c, "original_max_position_embeddings", None) or c.max_position_embeddings)
        if kind_of_rope == "longrope" and not rope.get("factor"):
            rope["factor"] = c.max_position_embeddings / rope["original_max_position_embeddings"]
    if kind_of_rope not in SCALINGS:
        raise UnsupportedModel(f"{kind}: rope scaling {rope['rope_type']!r} is not supported "
                               f"({', '.join(SCALINGS)})")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModel(f"{kind}: partial rotary embeddings are not supported")
    if kind in ("llama", "mistral") and (getattr(c, "attention_bias", False)
                                         or getattr(c, "mlp_bias", False)):
        raise UnsupportedModel(f"{kind}: attention_bias / mlp_bias are not supported")
    act = getattr(c, "hidden_activation", None) or c.hidden_act
    if act not in _ACTIVATIONS:
        raise UnsupportedModel(f"{kind}: MLP activation {act!r} is not supported")
    window = getattr(c, "sliding_window", None) or 0
    types = getattr(c, "layer_types", None)
    # Mistral and Phi-3 name no layer types: a window, when set, is every layer's.
    windowed = ([t == "sliding_attention" for t in types] if types
                else [bool(window)] * c.num_hidden_layers)
    gemma = kind.startswith("gemma")
    return LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_layers=c.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=rope.get("rope_theta", 10000.0),
        rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
        max_position_embeddings=context_length(c.max_position_embeddings, rope),
        tie_word_embeddings=c.tie_word_embeddings,
        qkv_bias=kind == "qwen2" or (kind in ("qwen3", "qwen3_moe") and c.attention_bias),
        qk_norm=kind in ("qwen3", "qwen3_moe", "gemma3_text"),
        sandwich_norms=gemma,
        activation=_ACTIVATIONS[act],
        embed_scale=c.hidden_size**0.5 if gemma else 1.0,
        attn_scale=c.query_pre_attn_scalar**-0.5 if gemma else 0.0,
        attn_softcap=(getattr(c, "attn_logit_softcapping", None) or 0.0) if gemma else 0.0,
        final_softcap=(getattr(c, "final_logit_softcapping", None) or 0.0) if gemma else 0.0,
        sliding_window=window if any(windowed) else 0,
        window_layers=windowed if window and any(windowed) else [],
        local_rope_theta=local_theta,
        **_experts_from_hf(c),
    )


def _experts_from_hf(c: Any) -> dict:
    """Mixtral's and Qwen3-MoE's experts as LlamaConfig's MoE fields (none for other families)."""
    if c.model_type == "mixtral":
        return dict(num_experts=c.num_local_experts, experts_per_token=c.num_experts_per_tok,
                    moe_intermediate_size=c.intermediate_size, moe_renormalize=True)
    if c.model_type != "qwen3_moe":
        return {}
    # A layer is sparse unless listed in mlp_only_layers, and only every decoder_sparse_step-th.
    dense = [i for i in range(c.num_hidden_layers)
             if i in c.mlp_only_layers or (i + 1) % c.decoder_sparse_step]
    return dict(num_experts=c.num_experts, experts_per_token=c.num_experts_per_tok,
                moe_intermediate_size=c.moe_intermediate_size,
                moe_renormalize=c.norm_topk_prob, dense_layers=dense)


# llama.cpp's fixed choices for Gemma, which its GGUF files do not carry: which layers are
# windowed (every layer but each pattern-th), the window when none is given (Gemma 2), the
# windowed layers' rotary base (Gemma 3), and the layer count of the 27B models, whose queries
# are scaled by (hidden / heads) ** -0.5 instead of head_dim ** -0.5.
_GGUF_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6}
_GGUF_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Architectures whose attention.sliding_window surge applies to every layer (llama.cpp's
# converter writes none for Mistral; Phi-3's is applied as transformers does, which llama.cpp
# leaves off).
_GGUF_WINDOWED = ("llama", "phi3")


def config_from_gguf(meta: dict) -> LlamaConfig:
    arch = meta["general.architecture"]

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(key("attention.key_length", key("rope.dimension_count", hidden // heads)))
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedModel(f"GGUF {arch}: partial rotary embeddings are not supported")
    layers = int(key("block_count"))
    vocab = key("vocab_size")
    experts = int(key("expert_count", 0))
    ff = int(key("feed_forward_length"))
    gemma = arch in _GGUF_WINDOW_PATTERN
    window = int(key("attention.sliding_window", 4096 if arch == "gemma2" else 0))
    if gemma:
        windowed = [(i + 1) % _GGUF_WINDOW_PATTERN[arch] != 0 for i in range(layers)]
    else:
        windowed = [bool(window) and arch in _GGUF_WINDOWED] * layers
    scaled_by = hidden // heads if layers == _GGUF_27B_LAYERS.get(arch) else head_dim
    rope = _gguf_rope_scaling(arch, meta)
    return LlamaConfig(
        vocab_size=int(vocab) if vocab is not None else 0,  # filled from the embedding if absent
        hidden_size=hidden,
        intermediate_size=ff,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope,
        # As for a config.json: a yarn scaling stretches the length served (vLLM's count).
        max_position_embeddings=context_length(int(key("context_length")), rope or {}),
        tie_word_embeddings=True,  # corrected by the loader when output.weight exists
        qkv_bias=False,  # set by the loader when attn_q.bias exists
        qk_norm=arch in ("qwen3", "qwen3moe", "gemma3"),
        sandwich_norms=gemma,
        activation="gelu_tanh" if gemma else "silu",
        embed_scale=hidden**0.5 if gemma else 1.0,
        attn_scale=scaled_by**-0.5 if gemma else 0.0,
        attn_softcap=float(key("attn_logit_softcapping", 0.0)),
        final_softcap=float(key("final_logit_softcapping", 0.0)),
        sliding_window=window if any(windowed) else 0,
        window_layers=windowed if any(windowed) else [],
        local_rope_theta=float(key("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else 0.0,
        num_experts=experts,
        experts_per_token=int(key("expert_used_count", 0)),
        moe_intermediate_size=int(key("expert_feed_forward_length", ff)) if experts else 0,
        # llama.cpp renormalises both families' top-k weights unless the file says otherwise.
        moe_renormalize=bool(key("expert_weights_norm", True)),
    )


def _gguf_rope_scaling(arch: str, meta: dict) -> dict | None:
    """rope.scaling.* as a Hugging Face rope_parameters dict (None: no scaling)."""
    scaling = gguf_rope(meta, arch)
    if not scaling:
        return None
    kind = scaling["rope_type"]
    if kind not in ("linear", "yarn"):
        raise UnsupportedModel(f"GGUF {arch}: rope scaling {kind!r} is not supported "
                               f"(linear, yarn)")
    if kind == "yarn":
        for name, field in (("attn_factor", "attention_factor"),
                            ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if f"{arch}.rope.scaling.{name}" in meta:
                scaling[field] = float(meta[f"{arch}.rope.scaling.{name}"])
    return scaling
