"""SiLU-and-mul for gated MLPs: [T, 2I] (gate | up) -> [T, I] = silu(gate) * up.

In: x [T, 2I] with the last dim contiguous (the fused gate_up projection's output).
Out: a new [T, I] tensor (or `out`). One read, one write, computed in fp32. With `delta` (a
one-row step's LoRA delta of gate_up that its projection left, kernels/lora_delta.py) gate and up
are first the projection's output plus its delta, as the separate expand kernel would have made them.
"""

import torch

from ._triton import require_triton, tl, triton, use_pdl
from .lora_delta import LoRADelta, add_delta, delta_b


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, sh_ptr, lb_ptr, ls_ptr, li_ptr, stride_lb, stride_x, stride_o, inter,
                         BLOCK: tl.constexpr, USE_PDL: tl.constexpr, HAS_DELTA: tl.constexpr, RANK: tl.constexpr):
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if HAS_DELTA:    # B never depends on the kernels before: in flight while they drain
        b_gate = delta_b(cols, lb_ptr, li_ptr, stride_lb, inter, RANK)
        b_up = delta_b(inter + cols, lb_ptr, li_ptr, stride_lb, 2 * inter, RANK)
    if USE_PDL:  # programmatic dependent launch: wait for the producer, let the consumer launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    if HAS_DELTA:    # the packed slices: gate's columns are slice 0, up's slice 1
        gate = add_delta(gate, b_gate, cols, sh_ptr, ls_ptr, li_ptr, RANK, inter, 2 * inter)
        up = add_delta(up, b_up, inter + cols, sh_ptr, ls_ptr, li_ptr, RANK, inter, 2 * inter)
    gate = gate.to(tl.float32)
    up = up.to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None, delta: LoRADelta | None = None) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:] for x [..., 2I]."""
    require_triton(x)
    inter = x.shape[-1] // 2
    assert delta is None or (x.numel() == 2 * inter and delta.slices == (inter, inter)), "a gate_up row's delta"
    x2 = x.view(-1, 2 * inter)
    if out is None:
        out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, inter)
    assert x2.stride(-1) == 1 and out2.stride(-1) == 1
    # with a delta each program also holds two [BLOCK, R] tiles of B: half the columns, twice the warps
    block, warps = (1024, 4) if delta is None else (512, 8)
    args = delta.kernel_args() if delta is not None else (x2, x2, x2, x2, 0)
    if x2.shape[0] > 0:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out2, *args, x2.stride(0), out2.stride(0), inter, BLOCK=block, USE_PDL=use_pdl(x),
            HAS_DELTA=delta is not None, RANK=delta.lora_b.shape[2] if delta is not None else 16,
            num_warps=warps, launch_pdl=use_pdl(x),
        )
    return out
