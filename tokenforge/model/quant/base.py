"""The quantization-method interface: how one linear's weight is stored, loaded and multiplied.

Every linear (model/layers/linear.py, and the LM head) holds exactly one `quant_method`, which
owns its weight representation through the steps vLLM's linear methods use:
- `create_weights(layer)`: register the parameters the checkpoint fills, each carrying the
  layer's `weight_loader` and the dims it is sharded by (`output_dim`, `input_dim`, and a pack
  factor for each), so pre-quantized tensors shard like dense ones. The default is the float
  weight [out, in]; a layer built dense keeps the one it has (a tied LM head stays tied).
- `process_weights_after_loading(layer)`: turn what was loaded into the kernels' format. The
  on-the-fly modes quantize the float weight here; a checkpoint format converts its tensors and
  hands the layer to the method that computes with them (`install`), so a format is a loader and
  the kernels stay in one place per representation.
- `apply(layer, x, bias)`: y = x W^T + b, x [..., in] -> [..., out].
- `apply_normed` / `apply_silu_mul`, optional: the same product with the RMSNorm (plus residual
  add) or the SwiGLU before it fused into one kernel. They return None wherever the method has no
  such kernel for this call; the layer then runs the prologue module and `apply`.
- `apply_lora`, optional: `apply` (with either prologue) plus the delta of a linear's LoRA slots
  (kernels/gemv_lora.GemvLoRA) in the method's own kernels (the prologue stays fused), or None;
  the layer then adds it through its hook. `fuse_lora_a`, optional: the slots' A stored under the
  weight, so the product computes the LoRA shrink of every slot in its extra columns.

What a method may read from its layer: `in_features`, `out_features` (this rank's: the weight is
[out, in]), `params_dtype` (the model dtype), `weight_loader`, `shard_sizes()` (the output rows of
each checkpoint tensor fused into the layer) and, on linears, `input_is_parallel` (row-parallel:
the input is split across ranks). The layer holds the tensors; a method holds only its options,
so one instance serves every layer.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenforge.model.layers.parallel import _without_cycle, new_parameter


class QuantMethod:
    """The interface, and the defaults a method inherits (a float weight; no fused prologue)."""

    name = "none"

    def check(self, layer: nn.Module, name: str) -> None:
        """Refuse, naming the layer, a shape this method cannot take (runs before anything changes)."""

    def create_weights(self, layer: nn.Module) -> None:
        if not has_float_weight(layer):
            layer.weight = new_parameter(layer.out_features, layer.in_features, dtype=layer.params_dtype,
                                         weight_loader=layer.weight_loader, device=drop_weights(layer))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def apply_normed(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module,
                     bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(self.apply(norm(x [+ residual])), the new residual) in one kernel, or None.
        With residual None the new residual is x itself."""
        return None

    def apply_silu_mul(self, layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None
                       ) -> torch.Tensor | None:
        """self.apply(silu(gate) * up) for gate_up [T, 2 * in] = [gate | up] in one kernel, or None."""
        return None

    def apply_lora(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, lora,
                   norm: nn.Module | None = None, residual: torch.Tensor | None = None, silu_mul: bool = False,
                   defer: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, object | None] | None:
        """(y, new residual, delta) from the method's own kernels, or None: y = apply(prologue(x)) + the
        LoRA delta of prologue(x), where the prologue is norm (as apply_normed: the new residual is
        returned, else None), SiLU-and-mul (silu_mul) or nothing; `lora` a GemvLoRA. With `defer`
        the method may leave the delta out of y and return it (a kernels/lora_delta.LoRADelta) for
        the kernel after to add; else delta is None."""
        return None

    def fuse_lora_a(self, layer: nn.Module, rows: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Room for `rows` more output rows under the weight, so one product computes x W^T and,
        in its extra columns, x A^T of every LoRA slot (model/layers/lora.py `ShrinkInGemm`): the
        [out + rows, in] weight and bias (the bias's extra entries zero; None without a bias), the
        layer's `weight` / `bias` becoming views of their first rows. None where the method keeps no
        such float weight (the default: the slots' shrink then runs as its own kernel)."""
        return None


def linear_layers(model: nn.Module, include_lm_head: bool = False) -> list[tuple[str, nn.Module]]:
    """(name, layer) for every module run by a quant method: the parallel linears, and the
    model's `lm_head` when asked (kept in the model dtype by default: its logits decide every
    token)."""
    lm_head = getattr(model, "lm_head", None)
    return [(n, m) for n, m in model.named_modules()
            if hasattr(m, "quant_method") and (include_lm_head or m is not lm_head)]


def has_float_weight(layer: nn.Module) -> bool:
    w = layer._parameters.get("weight")
    return w is not None and w.dtype == layer.params_dtype and tuple(w.shape) == (layer.out_features,
                                                                                  layer.in_features)


def drop_weights(layer: nn.Module) -> torch.device | None:
    """Remove the layer's parameters other than the bias; returns the device they were on."""
    device = None
    for name in [n for n, _ in layer.named_parameters(recurse=False) if n != "bias"]:
        device = getattr(layer, name).device
        delattr(layer, name)
    layer.__dict__.pop("weight", None)       # a `weight = None` left by an earlier install
    return device


def add_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device | None, **dims) -> None:
    """A checkpoint tensor's parameter, with the dims (`output_dim`, `input_dim`, `output_pack`,
    `input_pack`, `per_shard`) the layer's weight loader slices it by."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    for key, value in dims.items():
        setattr(p, key, value)
    p.weight_loader = _without_cycle(layer.weight_loader)
    layer.register_parameter(name, p)


def install(layer: nn.Module, method: QuantMethod, **tensors: torch.Tensor | None) -> None:
    """Replace the layer's loaded parameters with `method`'s tensors (non-persistent buffers) and
    hand the layer to it."""
    drop_weights(layer)
    layer.weight = None
    for name, value in tensors.items():
        layer.register_buffer(name, value, persistent=False)
    layer.quant_method = method


__all__ = ["QuantMethod", "add_param", "drop_weights", "has_float_weight", "install", "linear_layers"]
