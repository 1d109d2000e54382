"""Linear layers that know their tensor-parallel shard.

Each parameter carries `weight_loader(param, loaded, shard_id=None)`, which takes the full
checkpoint tensor and copies this rank's slice into place; fused layers (qkv, gate_up) take a
shard_id naming which checkpoint tensor is arriving. Weights are [out, in] as in HF checkpoints.

Column-parallel layers split the output dim across ranks (no communication); row-parallel layers
split the input dim and all-reduce the partial sums.

A linear's weight is owned by one `quant_method` (tokenforge.model.quant: dense by default,
or int8, int4, fp8, a checkpoint format, ...): the method registers the parameters, processes
them after loading and multiplies. The layer keeps the shard arithmetic, the bias, the all-reduce
and two optional prologues, `forward_normed` (residual add + RMSNorm, then this column-parallel
projection) and `forward_silu_mul` (SwiGLU, then this row-parallel projection), which the method
fuses into one kernel where it has one (at decode sizes on CUDA) and otherwise runs unfused, so
results agree up to bf16 rounding. Loaders slice any parameter by the dims it declares
(`output_dim`, `input_dim`, and a pack factor for each: packed int4 words, one scale per group),
so pre-quantized checkpoints shard like dense ones.

Each linear also has a `lora` slot (model/layers/lora.py): a hook whose delta is added to the
output, before the row-parallel all-reduce. With a hook the layer first offers the method the
hook's slot tensors (`apply_lora`: its own kernels for the product, its prologue and the delta,
the batch-1 GEMV on CUDA); where the method has none, the prologue runs unfused and the hook adds the
delta of the projection's input.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenforge.model.layers.kernel_dispatch import triton_ops
from tokenforge.model.layers.parallel import all_reduce, divide, new_parameter


def _check_shape(param_slice: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if param_slice.shape != loaded.shape:
        raise ValueError(f"{what}: expected a checkpoint slice of shape {tuple(param_slice.shape)}, "
                         f"got {tuple(loaded.shape)}")


def _packed(size: int, pack: int, what: str) -> int:
    if size % pack:
        raise ValueError(f"{what}: {size} rows/columns per rank do not split into whole packs (groups) of {pack}")
    return size // pack


def _narrow(t: torch.Tensor, dim: int, start: int, length: int, what: str) -> torch.Tensor:
    if t.dim() <= dim or start + length > t.shape[dim]:
        raise ValueError(f"{what}: a checkpoint tensor of shape {tuple(t.shape)} has no slice [{start}:{start + length}] "
                         f"along dim {dim}")
    return t.narrow(dim, start, length)


def load_slice(param: nn.Parameter, loaded: torch.Tensor, what: str,
               out: tuple[int, int, int] | None = None, inp: tuple[int, int] | None = None,
               shard_index: int = 0) -> None:
    """Copy this rank's part of a checkpoint tensor into param.

    out = (target offset, size, source start) along the output dim, inp = (source start, size)
    along the input dim, both in unpacked units; each applies only where the parameter declares
    that dim (default: output 0, input 1 for a matrix). Per-tensor scales of fused layers
    (`param.per_shard`) take one slot per checkpoint tensor instead.
    """
    if getattr(param, "per_shard", False):
        _check_shape(param.data[shard_index].reshape(-1), loaded.reshape(-1), what)
        param.data[shard_index].copy_(loaded.reshape(()))
        return
    target, part = param.data, loaded
    out_dim = getattr(param, "output_dim", 0)
    in_dim = getattr(param, "input_dim", 1 if param.dim() == 2 else None)
    if out is not None and out_dim is not None:
        pack = getattr(param, "output_pack", 1)
        offset, size, start = out
        n = _packed(size, pack, what)
        target = target.narrow(out_dim, offset // pack, n)
        part = _narrow(part, out_dim, start // pack, n, what)
    if inp is not None and in_dim is not None:
        pack = getattr(param, "input_pack", 1)
        start, size = inp
        part = _narrow(part, in_dim, start // pack, _packed(size, pack, what), what)
    _check_shape(target, part, what)
    target.copy_(part)


def dense_method():
    """The method every linear is built with. Imported here, not at the top: the quant package
    uses the layers' helpers (parallel.py, kernel_dispatch.py), so importing it while this package
    loads would be circular."""
    from tokenforge.model.quant.dense import DENSE  # noqa: PLC0415

    return DENSE


class LinearBase(nn.Module):
    """What the column- and row-parallel linears share: this rank's weight shape, the model dtype,
    the quant method that owns the weight, and the LoRA slot."""

    input_is_parallel = False     # row-parallel: the input arrives split across ranks

    def __init__(self, in_features: int, out_features: int, params_dtype: torch.dtype | None,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features       # this rank's
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.lora = None              # a hook from model/layers/lora.py, or None
        self.quant_method = dense_method()
        self.quant_method.create_weights(self)

    def shard_sizes(self) -> list[int]:
        """Output rows per checkpoint tensor fused into this layer (this rank's share)."""
        return [self.out_features]

    def _project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.lora is None:
            return self.quant_method.apply(self, x, bias)
        fused = self._apply_lora(x, bias)
        if fused is not None:
            return fused[0]
        started = self.lora.begin(x)          # what the hook runs beside the product (LoRASlots: the shrink)
        return self.lora.finish(started, x, self.quant_method.apply(self, x, bias))

    def _apply_lora(self, x: torch.Tensor, bias: torch.Tensor | None, norm: nn.Module | None = None,
                    residual: torch.Tensor | None = None, silu_mul: bool = False, defer: bool = False):
        """The method's own kernels for the (prologue +) product + the hook's delta: (y, new
        residual, delta left for the consumer or None), or None."""
        lora = self.lora.fused_operand()
        return None if lora is None else self.quant_method.apply_lora(self, x, bias, lora, norm, residual, silu_mul,
                                                                      defer)

    def forward_deferred(self, x: torch.Tensor):
        """(self(x), None), or (y, delta) where the method's kernels left y's LoRA delta for the kernel
        that reads y next to add (kernels/lora_delta.py: RMSNorm and SiluAndMul take it as `pending`;
        anything else must first call `add_pending`). Never deferred across a row-parallel all-reduce."""
        if self.lora is not None and not (self.input_is_parallel and self.tp_size > 1):
            # a row-parallel bias is added once, by rank 0; a column-parallel one is each rank's shard
            bias = self.bias if not self.input_is_parallel or self.tp_rank == 0 else None
            fused = self._apply_lora(x, bias, defer=True)
            if fused is not None:
                return fused[0], fused[2]
        return self(x), None


def add_pending(y: torch.Tensor, pending) -> torch.Tensor:
    """y with a deferred LoRA delta added (its expand launch), for a consumer that cannot fuse it."""
    if pending is None:
        return y
    return triton_ops(y.device).add_lora_delta(y, pending)


class ColumnParallelLinear(LinearBase):
    """y = x W^T + b, W split by output rows across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_rank = divide(output_size, tp_size)
        super().__init__(input_size, self.output_size_per_rank, params_dtype, tp_rank, tp_size)
        self.bias = (new_parameter(self.output_size_per_rank, dtype=params_dtype, weight_loader=self.weight_loader)
                     if bias else None)

    def output_slice(self, shard_id=None) -> tuple[int, int, int]:
        """(offset in this rank's output rows, size, start in the checkpoint tensor) of a shard."""
        size = self.output_size_per_rank
        return 0, size, self.tp_rank * size

    def shard_index(self, shard_id=None) -> int:
        return 0

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        what = type(self).__name__ + ("" if shard_id is None else f" shard {shard_id}")
        load_slice(param, loaded, what, out=self.output_slice(shard_id), shard_index=self.shard_index(shard_id))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._project(x, self.bias)      # [T, out_per_rank]

    def forward_normed(self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """self(norm(x, residual)) -> (y [T, out_per_rank], new residual [T, in]); `norm` is an
        RMSNorm. With residual None, x is the residual. One fused kernel where the method has one."""
        fused = (self.quant_method.apply_normed(self, x, residual, norm, self.bias) if self.lora is None
                 else self._apply_lora(x, self.bias, norm, residual))
        if fused is not None:
            return fused[:2]
        if residual is None:
            return self(norm(x)), x
        h, residual = norm(x, residual)
        return self(h), residual

    def forward_normed_deferred(self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, pending
                                ) -> tuple[torch.Tensor, torch.Tensor, object | None]:
        """forward_normed where x may still owe a LoRA delta (`pending`, from its producer's
        forward_deferred: the norm adds it) and y's own delta may be left to its consumer: (y, new
        residual, delta or None)."""
        if pending is None and self.lora is None:
            return (*self.forward_normed(norm, x, residual), None)
        if pending is None:
            fused = self._apply_lora(x, self.bias, norm, residual, defer=True)
            if fused is not None:
                return fused[0], (fused[1] if fused[1] is not None else x), fused[2]
        if residual is None:                   # x is the residual stream: it takes the delta itself
            x = add_pending(x, pending)
            h, residual = norm(x), x
        else:
            h, residual = norm(x, residual, pending=pending)
        y, delta = self.forward_deferred(h)
        return y, residual, delta


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate_up_proj).

    shard_id is the index into `output_sizes` of the checkpoint tensor being loaded.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 params_dtype: torch.dtype | None = None, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, params_dtype, tp_rank, tp_size)

    def output_slice(self, shard_id=None) -> tuple[int, int, int]:
        assert isinstance(shard_id, int), "MergedColumnParallelLinear needs an int shard_id"
        offset = divide(sum(self.output_sizes[:shard_id]), self.tp_size)
        size = divide(self.output_sizes[shard_id], self.tp_size)
        return offset, size, self.tp_rank * size

    def shard_index(self, shard_id=None) -> int:
        return shard_id

    def shard_sizes(self) -> list[int]:
        return [divide(s, self.tp_size) for s in self.output_sizes]


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; output rows are [q | k | v] for this rank's heads.

    When there are fewer kv heads than ranks, kv heads are replicated so every rank has one.
    shard_id is "q", "k" or "v".
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp_size)
        replicated = num_kv_heads < tp_size
        self.num_kv_heads = 1 if replicated else divide(num_kv_heads, tp_size)
        self.kv_replicas = divide(tp_size, num_kv_heads) if replicated else 1
        output = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output, bias, params_dtype, tp_rank, tp_size)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim       # per rank

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim    # per rank

    def output_slice(self, shard_id=None) -> tuple[int, int, int]:
        offsets = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                   "v": (self.q_size + self.kv_size, self.kv_size)}
        assert shard_id in offsets, f"QKVParallelLinear shard_id must be q, k or v, got {shard_id!r}"
        offset, size = offsets[shard_id]
        source_rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        return offset, size, source_rank * size

    def shard_index(self, shard_id=None) -> int:
        return "qkv".index(shard_id)

    def shard_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]


class RowParallelLinear(LinearBase):
    """y = x W^T + b, W split by input columns across ranks; partial sums all-reduced."""

    input_is_parallel = True

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_rank = divide(input_size, tp_size)
        super().__init__(self.input_size_per_rank, output_size, params_dtype, tp_rank, tp_size)
        self.bias = new_parameter(output_size, dtype=params_dtype, weight_loader=self.weight_loader) if bias else None

    def input_slice(self) -> tuple[int, int]:
        """(start in the checkpoint tensor, size) of this rank's input columns."""
        return self.tp_rank * self.input_size_per_rank, self.input_size_per_rank

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        # the bias (1-D: no input dim) is not split: rank 0 adds it once
        load_slice(param, loaded, type(self).__name__, inp=self.input_slice())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._project(x, self.bias if self.tp_rank == 0 else None)    # [T, out]
        return all_reduce(y) if self.tp_size > 1 else y

    def forward_silu_mul(self, act_fn: nn.Module, gate_up: torch.Tensor, pending=None) -> torch.Tensor:
        """self(act_fn(gate_up)) for gate_up [T, 2 * in_per_rank] = [gate | up] and act_fn a
        SiluAndMul; one fused kernel where the method has one. `pending`: gate_up's LoRA delta,
        left by its projection (forward_deferred) for the activation to add."""
        if pending is not None:
            return self(act_fn(gate_up, pending=pending))
        bias = self.bias if self.tp_rank == 0 else None
        if self.lora is None:
            y = self.quant_method.apply_silu_mul(self, gate_up, bias)
        else:
            fused = self._apply_lora(gate_up, bias, silu_mul=True)
            y = fused[0] if fused is not None else None
        if y is None:
            return self(act_fn(gate_up))
        return all_reduce(y) if self.tp_size > 1 else y
