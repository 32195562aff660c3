"""Linear layers on oneDNN-packed weights, for bf16 on the CPU.

Reordering a weight once into oneDNN's blocked layout pays off by CPU (bench.packed_weights):
with AVX-512 BF16 alone (AMD EPYC) steps run about 1.2x faster and the results are
bit-identical to the plain product's; with AMX (Intel Xeon) steps take the same time (1.03x),
and tile products sum in another order, so the last bf16 bit differs and greedy tokens may part
from the plain path's after some steps. Either way the packed model is as close to the float32
one as the plain bf16 model is (tests/test_packed.py), so packing stays on by default. fp32 is
left alone: there the packed path rounds differently.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_workers.llama import LlamaModel


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN reorders bf16 weights only on CPUs with its bf16 path (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT): an AVX2-only CPU serves bf16 from the plain weights."""
    return (device.type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packed_copy(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a weight: an opaque tensor, not a Parameter."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.packed = packed_copy(weight)  # nothing else reads it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]: the model's tokens are flat, and a reshape on either side
        costs more than one might think (about 4% of a one-token step, 121 calls)."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def pack_model(model: LlamaModel) -> None:
    """Every bias-free nn.Linear becomes a PackedLinear; a head tied to the embedding gets a
    packed copy of its own (the embedding lookup still reads the plain table)."""
    model.replace_linears(lambda m: isinstance(m, nn.Linear) and m.bias is None,
                          lambda m: PackedLinear(m.weight))


# --deterministic's products take x in slices of this many rows (see FixedRowsLinear).
FIXED_ROWS = 16


class FixedRowsLinear(nn.Module):
    """A linear layer whose every product has FIXED_ROWS rows (the last slice padded with
    zeros): oneDNN and MKL may pick their kernel, and so the order of a row's sums, by the
    shape. Without it, on a 2-core AMD EPYC, a bf16 request alone and the same request among 16
    gave different text (test_deterministic_bf16_recovery_and_batching_give_the_same_text),
    though the shapes tried one by one gave equal bits. Costs up to 16 rows' work for one."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        padded = F.pad(x, (0, 0, 0, -t % FIXED_ROWS))
        return torch.cat([self.inner(rows) for rows in padded.split(FIXED_ROWS)])[:t]


def fix_row_counts(model: LlamaModel, linear_types: tuple[type, ...]) -> None:
    """Every linear layer of these types (and a head tied to the embedding) becomes a
    FixedRowsLinear: --deterministic's batch-invariant products."""
    model.replace_linears(lambda m: isinstance(m, linear_types), FixedRowsLinear)
