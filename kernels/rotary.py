"""Rotary position embedding, Hugging Face (rotate-half) layout (reference)."""

import math

import torch

# Rope scaling types (rope_type) rotary_cache implements.
SCALINGS = ("default", "linear", "llama3")


def rotary_cache(
    head_dim: int, max_positions: int, theta: float, scaling: dict | None = None
) -> torch.Tensor:
    """[max_positions, 2 * head_dim] float32: per position (c, c, -s, s), the factors of (x1, x2)
    and of (x2, x1) in a rotation (see apply_rotary_)."""
    # float32 throughout, as the Hugging Face reference computes it, so angles match bit for bit.
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling:
        inv_freq = _scale(inv_freq, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat([cos, cos, -sin, sin], dim=-1)


def _scale(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"rope scaling type {kind!r} is not supported ({', '.join(SCALINGS)})")


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
