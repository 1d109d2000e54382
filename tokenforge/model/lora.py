"""Adapter slots on a built model: `LoRASlots` hooks on every linear a LoRA may target, and the
writing of a PEFT adapter (model/loader/peft.py) into one slot.

In: a model (after its weights are loaded), the slot count (`--max-loras`) and the largest rank
(`--max-lora-rank`). Out: `ModelLoRASlots`, whose `write(slot, adapter)` maps each HF module of the
adapter onto our linears (q/k/v onto the slices of qkv_proj, gate/up onto gate_up_proj, through the
model's `packed_modules`) and shards it as the base weight is sharded: a column-parallel linear
keeps this rank's rows of B (the rows `output_slice` gives its weight), a row-parallel one this
rank's input columns of A (its delta is partial, summed by the same all-reduce as the output).
`check(adapter)` raises, naming the adapter, when a module or a shape does not fit, before any
slot is touched. Without --enable-lora none of this runs: the linears keep `lora = None`.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenforge import envs
from tokenforge.kernels._triton import HAS_TRITON
from tokenforge.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from tokenforge.model.layers.lora import LoRASlots
from tokenforge.model.loader.peft import PeftAdapter

TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")     # our linears that carry slots


class ModelLoRASlots:
    def __init__(self, model: nn.Module, num_slots: int, max_rank: int) -> None:
        self.model, self.num_slots, self.max_rank = model, num_slots, max_rank
        self.linears: dict[str, nn.Module] = {}
        side = None           # one stream for every linear's shrink, beside its projection (CUDA + Triton)
        use_side = HAS_TRITON and envs.lora_side_stream()
        # the shrink in the base product: one launch a linear fewer; its outputs are then strided
        # views of the product, which a row-parallel all-reduce cannot take, so TP 1 only
        asked = envs.lora_shrink_in_gemm()
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in TARGETS and isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                device = module.weight.device
                module.lora = LoRASlots(num_slots, module.in_features, module.out_features, max_rank,
                                        module.params_dtype, tuple(module.shard_sizes())).to(device)
                if device.type == "cuda" and use_side:
                    side = side or torch.cuda.Stream(device)
                    module.lora.side_stream = side
                elif module.tp_size == 1 and (asked if asked is not None else
                                              device.type == "cuda" and shrink_in_gemm_pays(module.lora)):
                    module.lora.put_a_under(module)
                self.linears[name] = module
        if not self.linears:
            raise ValueError(f"{type(model).__name__} has no linear named {', '.join(TARGETS)} to serve LoRA on")
        # HF module name -> (our linear name, shard id); HF names not packed map to themselves
        self._packed = {part: (fused, shard) for fused, parts in getattr(model, "packed_modules", {}).items()
                        for part, shard in parts.items()}

    @property
    def supported_modules(self) -> list[str]:
        return [p for fused in TARGETS for p in self._parts_of(fused)]

    def check(self, adapter: PeftAdapter) -> None:
        """Raise ValueError when the adapter does not fit the model (nothing is written)."""
        self._placements(adapter)

    @torch.no_grad()
    def write(self, slot: int, adapter: PeftAdapter) -> None:
        placements = self._placements(adapter)
        for linear in self.linears.values():
            linear.lora.clear_slot(slot)
        for linear, j, a, b in placements:
            linear.lora.set_slice(slot, j, a.to(linear.params_dtype), b.to(linear.params_dtype))

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        for linear in self.linears.values():
            linear.lora.clear_slot(slot)

    # ---- mapping and sharding -------------------------------------------------------------------
    def _parts_of(self, fused: str) -> list[str]:
        parts = [p for p, (f, _) in self._packed.items() if f == fused]
        return parts or [fused]

    def _placements(self, adapter: PeftAdapter) -> list[tuple[nn.Module, int, torch.Tensor, torch.Tensor]]:
        out, unknown = [], []
        for module, (a, b) in adapter.modules.items():
            parent, _, leaf = module.rpartition(".")
            fused, shard = self._packed.get(leaf, (leaf, None))
            linear = self.linears.get(f"{parent}.{fused}")
            if linear is None:
                if not self._on_other_stage(parent, fused):
                    unknown.append(module)
                continue
            out += [(linear, *part) for part in self._shard(adapter.name, module, linear, shard, a, b)]
        if unknown:
            shown = ", ".join(sorted(unknown)[:4]) + (" ..." if len(unknown) > 4 else "")
            raise ValueError(f"LoRA adapter {adapter.name!r} targets modules the base model has no LoRA slot for: "
                             f"{shown} (supported: {', '.join(self.supported_modules)} of each layer)")
        return out

    def _on_other_stage(self, parent: str, fused: str) -> bool:
        """A module of a decoder layer that another pipeline stage holds (its layer is a MissingLayer)."""
        parts = parent.split(".")
        if fused not in TARGETS or len(parts) < 3 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            return False
        layers = self.model.model.layers
        return int(parts[2]) < len(layers) and int(parts[2]) not in self.model.model.stage

    @staticmethod
    def _shard(name: str, module: str, linear: nn.Module, shard, a: torch.Tensor, b: torch.Tensor):
        """[(slice index, this rank's A, this rank's B)] of one HF module's adapter."""
        if isinstance(linear, RowParallelLinear):
            _check_shapes(name, module, a, b, linear.input_size, linear.output_size)
            start, size = linear.input_slice()
            return [(0, a[:, start:start + size], b)]
        if shard is None:                    # the whole (possibly fused) linear, as the checkpoint names it
            slices = linear.lora.slices
            if len(slices) > 1 and linear.tp_size > 1:
                raise ValueError(f"LoRA adapter {name!r}: {module} adapts the fused projection as a whole, which "
                                 "is not supported with tensor parallelism (adapt its q/k/v or gate/up parts)")
            _check_shapes(name, module, a, b, linear.input_size, linear.output_size)
            start = linear.tp_rank * linear.out_features
            b, offsets = b[start:start + linear.out_features], [sum(slices[:j]) for j in range(len(slices))]
            return [(j, a, b[o:o + size]) for j, (o, size) in enumerate(zip(offsets, slices))]
        _, size, start = linear.output_slice(shard)
        if isinstance(shard, str):           # q / k / v of a QKVParallelLinear (kv heads may be replicated)
            full_out = size * linear.tp_size // (1 if shard == "q" else linear.kv_replicas)
        else:
            full_out = linear.output_sizes[shard]
        _check_shapes(name, module, a, b, linear.input_size, full_out)
        return [(linear.shard_index(shard), a, b[start:start + size])]


def shrink_in_gemm_pays(slots: LoRASlots) -> bool:
    """Whether computing every slot's shrink in the base product's extra columns is the default
    for a linear: while they add at most an eighth to its output columns (on the 8B with 16 slots
    of rank 16: qkv +12.5%, o and down +6.25%, gate_up +1.8%; W2 over 64 adapters 75.3% -> 78.9%
    of bare on an H100, BENCHMARKS wave 3 round 19). The extra columns cost every step of up to
    `ShrinkInGemm.max_rows` rows their bytes, and the shrink kernel they replace a launch's fixed
    latency (~10 us), so wide ranks or many slots keep the kernel."""
    num_slots, packed_rank, _ = slots.lora_A.shape
    return num_slots * packed_rank * 8 <= sum(slots.slices)


def _check_shapes(name: str, module: str, a: torch.Tensor, b: torch.Tensor, in_features: int,
                  out_features: int) -> None:
    if a.shape[1] != in_features or b.shape[0] != out_features:
        raise ValueError(f"LoRA adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                         f"but the base model's {module.rpartition('.')[2]} is [{out_features}, {in_features}] "
                         f"(lora_A must be [r, {in_features}], lora_B [{out_features}, r])")


__all__ = ["TARGETS", "ModelLoRASlots", "shrink_in_gemm_pays"]
