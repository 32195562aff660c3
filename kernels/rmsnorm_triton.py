"""RMSNorm, alone and fused with the residual add (Triton; same semantics as kernels.rmsnorm)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, n, x_stride, residual_stride, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid (rows,): one program normalises one whole row (BLOCK >= n columns), writing
    x + residual to sum_ptr first when HAS_RESIDUAL."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        # Rounded to the serving dtype first, as the reference's x + residual is.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * n + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    normed = (xf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * n + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, n] with a unit column stride (copied only where a view lacks one)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(1) == 1 else rows.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out: torch.Tensor, total: torch.Tensor) -> None:
    rows = _rows(x)
    # Without a residual the slot is never read; x fills it.
    res_rows = rows if residual is None else _rows(residual)
    n = rows.shape[1]
    _rms_norm_kernel[(rows.shape[0],)](
        rows, res_rows, weight, out, total, n, rows.stride(0), res_rows.stride(0), eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n))


def _empty_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # weight * x in the reference: the promoted dtype of the two.
    return torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = _empty_out(x, weight)
    _launch(x, None, weight, eps, out, out)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), in one pass."""
    out, total = _empty_out(x, weight), torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, residual, weight, eps, out, total)
    return out, total
