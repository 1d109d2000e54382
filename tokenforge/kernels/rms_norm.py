"""RMSNorm and fused residual-add + RMSNorm.

In: x [T, H] (rows contiguous in the last dim), weight [H], optionally residual [T, H].
Out: `rms_norm` -> y [T, H]; `fused_add_rms_norm` -> (y, residual) where residual is updated in
place to x + residual (one read of each input, one write of each output: the decode path's
norms are pure bandwidth). Numerics follow HF Llama: the sum is rounded to the input dtype
before the norm, the variance is in fp32, and the normed value is rounded before the weight.
"""

import torch

from ._triton import next_power_of_2, require_triton, tl, triton, use_pdl
from .lora_delta import LoRADelta, add_delta, delta_b


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(new_residual, weight, eps), new_residual


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sh_ptr, lb_ptr, ls_ptr, li_ptr, stride_lb,
    stride_x, stride_r, stride_o, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
    HAS_DELTA: tl.constexpr, RANK: tl.constexpr, SLICE1: tl.constexpr, SLICE2: tl.constexpr,
):
    cols = tl.arange(0, BLOCK)
    if HAS_DELTA:    # B never depends on the kernels before: in flight while they drain
        b = delta_b(cols, lb_ptr, li_ptr, stride_lb, hidden, RANK)
    if USE_PDL:  # programmatic dependent launch: wait for the producer, let the consumer launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    mask = cols < hidden
    # every load is issued up front: at one token the kernel is a chain of memory latencies
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        x = tl.where(mask, add_delta(x, b, cols, sh_ptr, ls_ptr, li_ptr, RANK, SLICE1, SLICE2), x)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps, out, delta: LoRADelta | None = None):
    require_triton(x, weight)
    hidden = x.shape[-1]
    assert delta is None or (x.numel() == hidden and sum(delta.slices) == hidden), "a LoRA delta is one row's"
    x2 = x.view(-1, hidden)
    assert x2.stride(-1) == 1 and weight.is_contiguous()
    if out is None:
        out = torch.empty_like(x)
    out2 = out.view(-1, hidden)
    res2 = residual.view(-1, hidden) if residual is not None else x2
    block = next_power_of_2(hidden)
    # Wide rows: one warp per 256 elements keeps 16-byte loads and enough loads in flight.
    num_warps = max(1, min(16, block // 256))
    args, slices = (delta.kernel_args(), delta.bounds()) if delta is not None else ((x2, x2, x2, x2, 0), (0, 0))
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out2, *args, x2.stride(0), res2.stride(0), out2.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, USE_PDL=use_pdl(x),
            HAS_DELTA=delta is not None, RANK=delta.lora_b.shape[2] if delta is not None else 16,
            SLICE1=slices[0], SLICE2=slices[1], num_warps=num_warps, launch_pdl=use_pdl(x),
        )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
             delta: LoRADelta | None = None) -> torch.Tensor:
    """y = weight * rmsnorm(x); x [..., H]. `out` may be x itself (in place)."""
    return _launch(x, None, weight, eps, out, delta)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       out: torch.Tensor | None = None, delta: LoRADelta | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual (in place); returns (weight * rmsnorm(residual), residual).

    `out` may be x itself, so a layer can run with no new allocation.
    """
    assert residual.shape == x.shape and residual.stride(-1) == 1
    return _launch(x, residual, weight, eps, out, delta), residual
