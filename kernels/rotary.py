"""Rotary position embedding, Hugging Face (rotate-half) layout (reference)."""

import math

import torch


def rotary_cache(
    head_dim: int, max_positions: int, theta: float, scaling: dict | None = None
) -> torch.Tensor:
    """[max_positions, 2 * head_dim] float32: per position (c, c, -s, s), the factors of (x1, x2)
    and of (x2, x1) in a rotation (see apply_rotary_)."""
    # float32 throughout, as the Hugging Face reference computes it, so angles match to an ulp.
    shape = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    positions = torch.arange(max_positions, dtype=torch.float32)
    inv_freq, factor = _frequencies(1.0 / theta**shape, theta, shape, positions, scaling or {})
    freqs = positions[:, None] * inv_freq  # inv_freq: [half] or, per position, [P, half]
    cos, sin = freqs.cos() * factor, freqs.sin() * factor
    return torch.cat([cos, cos, -sin, sin], dim=-1)


def _frequencies(inv_freq: torch.Tensor, theta: float, shape: torch.Tensor,
                 positions: torch.Tensor, scaling: dict) -> tuple[torch.Tensor, float]:
    """The scaled inverse frequencies ([half], or [P, half] where they depend on the position)
    and the factor on cos and sin."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(is_mid, mid, scaled), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, theta, shape, scaling)
    # dynamic and longrope change with the sequence's length: Hugging Face recomputes them as a
    # sequence grows past the original context. Position p is rotated as when its sequence was
    # p + 1 long, which is exactly Hugging Face's generation of one sequence whose prompt fits
    # the original context (a longer prompt is rotated there as a whole by its full length).
    old_len = scaling["original_max_position_embeddings"]
    lengths = (positions + 1).clamp(min=old_len)[:, None]
    if kind == "dynamic":
        factor, dim = scaling["factor"], 2 * len(shape)
        base = theta * ((factor * lengths / old_len) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / base**shape, 1.0
    if kind == "longrope":
        long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * theta**shape)
        short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * theta**shape)
        factor = scaling.get("factor") or 1.0
        attention = scaling.get("attention_factor") or (
            math.sqrt(1 + math.log(factor) / math.log(old_len)) if factor > 1 else 1.0)
        return torch.where(lengths > old_len, long, short), attention
    # gpu_workers/families.py's SCALINGS lists the types above: it refuses others at start.
    raise ValueError(f"rope scaling type {kind!r} is not supported")


def _yarn(inv_freq: torch.Tensor, theta: float, shape: torch.Tensor, scaling: dict
          ) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between (by
    how many turns each makes in the original context), and a factor on cos and sin."""
    factor, old_len, dim = scaling["factor"], scaling["original_max_position_embeddings"], \
        2 * len(shape)

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(m) / mscale(m_all) if m and m_all else mscale(1.0)

    def turns_dim(turns: float) -> float:  # the dimension that turns this often in old_len
        return dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turns_dim(scaling.get("beta_fast") or 32), turns_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high += 0.001 if low == high else 0  # as the reference: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    pos_freqs = theta**shape
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return inv, float(attention)


def rotary_angles(positions: torch.Tensor, cache: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, 1, D] for each token's position (see rotary_cache): looked up once a step,
    used by every layer."""
    cos, sin = cache[positions].unsqueeze(1).chunk(2, dim=-1)
    return cos, sin


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [T, heads, D] in place (queries and keys side by side, in one call) by each
    token's angles (see rotary_angles): (x1 c - x2 s, x2 c + x1 s), x1 and x2 its halves."""
    xf = x.float()
    out = xf * cos
    out += xf.roll(x.shape[-1] // 2, -1) * sin
    x.copy_(out)
