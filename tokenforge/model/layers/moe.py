"""Mixture-of-experts layer: a router, top-k routing, and the experts' stacked weights.

In: the post-attention normed hidden [T, H]. Out: [T, H], the routing-weighted sum of the k
selected experts' MLPs (all-reduced across tensor-parallel ranks, like the dense MLP's down).

Weights live stacked, one tensor per projection for all of this rank's experts:
`w13_weight` [E_local, 2I_local, H] (gate rows, then up rows) and `w2_weight` [E_local, H, I_local],
or for MXFP4 checkpoints (gpt-oss) their 4-bit codes and scales (`w13_blocks` [E, 2I, H/32, 16]
and `w13_scales` [E, 2I, H/32] uint8, the same for w2), kept 4-bit in memory; gpt-oss adds
`w13_bias` and `w2_bias`. `--quantization fp8` turns the float stacks into e4m3 codes with one
fp32 scale per expert and row once they are loaded (`install_fp8`: `w13_fp8` [E, 2I, H] with
`w13_fp8_scale` [E, 2I], the same for w2; kernels/moe_fp8.py). Their weight loaders take HF's tensors as checkpoints store them, named
by a shard id: `(expert, "gate" | "up" | "down")` for one expert's [I, H] / [H, I] matrix (Mixtral's
w1/w3/w2, Qwen3-MoE's gate/up/down_proj), or a layout name for a tensor of every expert
(`"transposed"`: gpt-oss's [E, H, 2I] / [E, I, H]; `"rows"`: already [E, out, ...]). Interleaved
gate/up rows (gpt-oss) are split into the gate and up halves as they load.

Sharding: under tensor parallelism each rank holds its slice of every expert's intermediate
size; with `expert_parallel` (`--enable-expert-parallel`) it holds whole experts instead (a
contiguous range), and ids routed elsewhere become the sentinel E_local, which the kernels skip.
Either way the ranks' outputs are partial sums that one all-reduce completes; the down bias is
added by one rank only.

Compute is chosen once, when the layer is built: the fused Triton kernel (kernels/moe.py) on
CUDA, which also takes the biases, gpt-oss's clamped SwiGLU and MXFP4 or fp8 experts (decoded
inside the GEMMs); the torch reference on the CPU (it dequantizes one selected MXFP4 or fp8 expert
at a time).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tokenforge.kernels._triton import HAS_TRITON
from tokenforge.kernels.moe import fused_moe, moe_reference, route, silu_mul
from tokenforge.kernels.moe_fp8 import Fp8Stack, quantize_fp8_stack
from tokenforge.kernels.moe_routing import fused_moe_from_logits
from tokenforge.kernels.mxfp4 import GROUP, Mxfp4Stack
from tokenforge.model.arch_config import MoeConfig
from tokenforge.model.layers.kernel_dispatch import gemv_ops
from tokenforge.model.layers.parallel import _without_cycle, all_reduce, default_weight_loader, new_parameter

# MXFP4 scale bytes of dummy weights: 2 ** (120 - 127), so random codes have a std near 0.02
MXFP4_DUMMY_SCALES = (120, 121)


def expert_range(num_experts: int, rank: int, size: int) -> tuple[int, int]:
    """(first, count) of the experts rank holds under expert parallelism; earlier ranks take one
    more on a remainder."""
    if size > num_experts:
        raise ValueError(f"--enable-expert-parallel with {size} ranks needs at least as many experts; "
                         f"the model has {num_experts}")
    base, extra = divmod(num_experts, size)
    return rank * base + min(rank, extra), base + (rank < extra)


def _code_parameter(*shape: int, weight_loader) -> nn.Parameter:
    """An uninitialised uint8 parameter (MXFP4 codes or scales): no gradient, as integers take none."""
    param = nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)
    param.weight_loader = _without_cycle(weight_loader)
    return param


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's SwiGLU: gate clamped above and up on both sides at `limit`, then
    gate * sigmoid(alpha * gate) * (up + 1)."""
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


def _fused(experts: FusedExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    w13, w2 = experts.stacks()
    moe = experts.moe
    return fused_moe(x, w13, w2, weights, ids, experts.w13_bias, experts.w2_bias, moe.activation,
                     moe.swiglu_alpha, moe.swiglu_limit, all_local=not moe.expert_parallel)


def _fused_from_logits(experts: FusedExperts, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor | None:
    """The fused path from the router's logits: routing and alignment in one launch
    (kernels/moe_routing.py), then the GEMMs; None when the batch is too large for that launch."""
    moe = experts.moe
    w13, w2 = experts.stacks()
    return fused_moe_from_logits(x, logits, w13, w2, moe.top_k, moe.routing, moe.renormalize, experts.first,
                                 experts.num_local, w13_bias=experts.w13_bias, w2_bias=experts.w2_bias,
                                 activation=moe.activation, alpha=moe.swiglu_alpha, limit=moe.swiglu_limit,
                                 all_local=not moe.expert_parallel)


def _reference(experts: FusedExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    w13, w2 = experts.stacks()
    return moe_reference(x, w13, w2, weights, ids, experts.w13_bias, experts.w2_bias, experts.activation)


def _all_local_ids(experts: FusedExperts, ids: torch.Tensor) -> torch.Tensor:
    return ids


def _rank_local_ids(experts: FusedExperts, ids: torch.Tensor) -> torch.Tensor:
    """Global expert ids -> this rank's (expert parallelism); other ranks' experts -> E_local."""
    local = ids - experts.first
    return torch.where((local >= 0) & (local < experts.num_local), local, experts.num_local)


class Router(nn.Module):
    """The gate: logits [T, E] = x W^T (+ b), replicated on every rank."""

    def __init__(self, hidden_size: int, num_experts: int, bias: bool, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = new_parameter(num_experts, hidden_size, dtype=dtype, weight_loader=default_weight_loader)
        self.bias = new_parameter(num_experts, dtype=dtype, weight_loader=default_weight_loader) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a decode row through the Triton GEMV: one launch (cuBLAS runs this [E, H] product as a
        # split-K GEMM and its reduction, two), its weights streamed before the previous kernel ends
        ops = gemv_ops(x, self.weight)
        if ops is not None:
            return ops.gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class FusedExperts(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeConfig, dtype: torch.dtype | None, tp_rank: int, tp_size: int,
                 per_expert_shards: bool = True) -> None:
        super().__init__()
        self.moe, self.hidden_size = moe, hidden_size
        inter = moe.intermediate_size
        if moe.expert_parallel:
            self.first, self.num_local = expert_range(moe.num_experts, tp_rank, tp_size)
            self.inter, self.inter_start = inter, 0
        else:
            if inter % tp_size:
                raise ValueError(f"tensor_parallel_size {tp_size} does not divide the experts' intermediate size "
                                 f"{inter}; use a divisor of it or --enable-expert-parallel")
            self.first, self.num_local = 0, moe.num_experts
            self.inter = inter // tp_size
            self.inter_start = tp_rank * self.inter
        self.adds_down_bias = moe.expert_parallel or tp_rank == 0
        self.activation = (silu_mul if moe.activation == "silu" else
                           functools.partial(swiglu_oai, alpha=moe.swiglu_alpha, limit=moe.swiglu_limit))
        self._create_weights(dtype, per_expert_shards)
        self.local_ids = _rank_local_ids if moe.expert_parallel else _all_local_ids
        on_cuda = torch.empty(0).device.type == "cuda"
        self.compute = _fused if on_cuda and HAS_TRITON else _reference      # a function, not a method: no cycle

    def _create_weights(self, dtype: torch.dtype | None, per_expert_shards: bool) -> None:
        e, i, h = self.num_local, self.inter, self.hidden_size
        load = self.weight_loader
        if self.moe.expert_format == "mxfp4":
            if i % GROUP or h % GROUP:
                raise ValueError(f"MXFP4 experts: the hidden size {h} and this rank's intermediate size {i} must be "
                                 f"multiples of {GROUP} (choose a tensor_parallel_size that keeps them so)")
            self.w13_blocks = _code_parameter(e, 2 * i, h // GROUP, GROUP // 2, weight_loader=load)
            self.w13_scales = _code_parameter(e, 2 * i, h // GROUP, weight_loader=load)
            self.w2_blocks = _code_parameter(e, h, i // GROUP, GROUP // 2, weight_loader=load)
            self.w2_scales = _code_parameter(e, h, i // GROUP, weight_loader=load)
            self.w13_scales.dummy_range = self.w2_scales.dummy_range = MXFP4_DUMMY_SCALES
            self.w13_blocks.values_per_element = self.w2_blocks.values_per_element = 2     # for parameter counts
            self.w13_scales.values_per_element = self.w2_scales.values_per_element = 0
            self.w13_weight = self.w2_weight = None
            self.weight_format = "mxfp4"
        else:
            self.w13_weight = new_parameter(e, 2 * i, h, dtype=dtype, weight_loader=load)
            self.w2_weight = new_parameter(e, h, i, dtype=dtype, weight_loader=load)
            if per_expert_shards:        # one checkpoint tensor per expert and projection
                self.w13_weight.num_shards = 2 * self.moe.num_experts
                self.w2_weight.num_shards = self.moe.num_experts
            self.weight_format = "dense"
        self.w13_bias = new_parameter(e, 2 * i, dtype=dtype, weight_loader=load) if self.moe.bias else None
        self.w2_bias = new_parameter(e, h, dtype=dtype, weight_loader=load) if self.moe.bias else None

    def stacks(self):
        """(w13, w2) as the reference indexes them: float stacks, or MXFP4 / fp8 ones dequantized
        per expert."""
        if self.weight_format == "dense":
            return self.w13_weight, self.w2_weight
        if self.weight_format == "fp8":
            return Fp8Stack(self.w13_fp8, self.w13_fp8_scale), Fp8Stack(self.w2_fp8, self.w2_fp8_scale)
        return Mxfp4Stack(self.w13_blocks, self.w13_scales), Mxfp4Stack(self.w2_blocks, self.w2_scales)

    @torch.no_grad()
    def install_fp8(self) -> None:
        """The loaded float stacks -> e4m3 codes and per-(expert, row) fp32 scales, as buffers (not
        trained, and the engine cache keeps the weights from before quantization); the float
        stacks are freed. The biases stay in the model dtype."""
        assert self.weight_format == "dense", self.weight_format
        for name in ("w13", "w2"):
            codes, scales = quantize_fp8_stack(getattr(self, f"{name}_weight").detach())
            delattr(self, f"{name}_weight")
            setattr(self, f"{name}_weight", None)
            self.register_buffer(f"{name}_fp8", codes, persistent=False)
            self.register_buffer(f"{name}_fp8_scale", scales, persistent=False)
        self.weight_format = "fp8"

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing weights/ids [T, k] (global expert ids) -> this rank's partial sum [T, H]."""
        return self.compute(self, x, weights, self.local_ids(self, ids))

    # ---- loading -------------------------------------------------------------------------------

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if isinstance(shard_id, tuple):
            self._load_one_expert(param, loaded, *shard_id)
            return
        if shard_id == "transposed":               # gpt-oss's float [E, in, out] -> [E, out, in]
            loaded = loaded.transpose(1, 2)
        if param is self.w2_bias:
            part = self._experts(loaded)
            self._copy(param, part if self.adds_down_bias else torch.zeros_like(part))   # added by one rank
        elif param is self.w13_bias:
            self._copy(param, self._gate_up_rows(loaded.unsqueeze(-1)).squeeze(-1))
        elif param is self.w13_weight or param is getattr(self, "w13_blocks", None) or \
                param is getattr(self, "w13_scales", None):
            self._copy(param, self._gate_up_rows(loaded))
        else:                                      # w2 weight, blocks or scales: [E, H, I (/32), ...]
            pack = 1 if param is self.w2_weight else GROUP
            start, size = self.inter_start // pack, self.inter // pack
            fits = loaded.dim() >= 3 and loaded.shape[2] >= start + size
            self._copy(param, self._experts(loaded).narrow(2, start, size) if fits else loaded)

    def _experts(self, t: torch.Tensor) -> torch.Tensor:
        return t.narrow(0, self.first, self.num_local) if t.shape[0] >= self.first + self.num_local else t

    def _gate_up_rows(self, t: torch.Tensor) -> torch.Tensor:
        """[E, 2I, ...] as the checkpoint orders the rows -> this rank's [E_local, gate rows | up rows, ...]."""
        t = self._experts(t)
        full = self.moe.intermediate_size
        if t.shape[1] != 2 * full:
            return t                               # shape error reported by _copy
        gate, up = (t[:, 0::2], t[:, 1::2]) if self.moe.interleaved_gate_up else (t[:, :full], t[:, full:])
        s, n = self.inter_start, self.inter
        return torch.cat((gate[:, s:s + n], up[:, s:s + n]), dim=1)

    @staticmethod
    def _copy(param: nn.Parameter, part: torch.Tensor) -> None:
        if param.shape != part.shape:
            raise ValueError(f"experts: expected a checkpoint slice of shape {tuple(param.shape)}, "
                             f"got {tuple(part.shape)}")
        param.data.copy_(part)

    def _load_one_expert(self, param: nn.Parameter, loaded: torch.Tensor, expert: int, part: str) -> None:
        """One expert's gate or up [I, H], or down [H, I]; experts of other ranks are skipped."""
        local = expert - self.first
        if not 0 <= local < self.num_local:
            return
        s, n = self.inter_start, self.inter
        if part == "down":
            target, piece = param.data[local], loaded[:, s:s + n] if loaded.dim() == 2 else loaded
        else:
            offset = 0 if part == "gate" else n
            target, piece = param.data[local, offset:offset + n], loaded[s:s + n]
        if target.shape != piece.shape:
            raise ValueError(f"expert {expert} {part}: expected a checkpoint slice of shape {tuple(target.shape)}, "
                             f"got {tuple(piece.shape)}")
        target.copy_(piece)

    def extra_repr(self) -> str:
        return (f"experts={self.first}..{self.first + self.num_local - 1} of {self.moe.num_experts}, "
                f"top_k={self.moe.top_k}, intermediate={self.inter}, format={self.weight_format}, "
                f"compute={self.compute.__name__.strip('_')}")


class SparseMoeBlock(nn.Module):
    """Router (`gate`) + experts; forward(x [T, H]) -> [T, H]."""

    def __init__(self, hidden_size: int, moe: MoeConfig, dtype: torch.dtype | None, tp_rank: int, tp_size: int,
                 per_expert_shards: bool = True) -> None:
        super().__init__()
        self.moe, self.tp_size = moe, tp_size
        self.gate = Router(hidden_size, moe.num_experts, moe.bias, dtype)
        self.experts = FusedExperts(hidden_size, moe, dtype, tp_rank, tp_size, per_expert_shards)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights, expert ids), [T, k] each."""
        return route(self.gate(x), self.moe.top_k, self.moe.routing, self.moe.renormalize)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the selected experts [T, H]. On the fused path a decode-sized
        batch routes and aligns in one launch, a larger one in three; past those limits (and on
        the CPU) `route` then the experts."""
        logits = self.gate(x)
        if self.experts.compute is _fused:
            out = _fused_from_logits(self.experts, x, logits)
            if out is not None:
                return out
        weights, ids = route(logits, self.moe.top_k, self.moe.routing, self.moe.renormalize)
        return self.experts(x, weights, ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed(x)
        return all_reduce(out) if self.tp_size > 1 else out
