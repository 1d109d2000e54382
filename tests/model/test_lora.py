"""The LoRA hook on the linears (model/layers/lora.py): the delta lands on the output of every
entry point (plain, with the norm prologue, with the SwiGLU prologue, on a quantized weight), and
slot adapters pick theirs per token row from the forward context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenforge.model.forward_context import set_forward_context
from tokenforge.model.layers import RMSNorm, SiluAndMul
from tokenforge.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenforge.model.layers.lora import LoRA, LoRASlots
from tokenforge.model.quant.int8 import Int8Method


def _adapter(in_features: int, out_features: int, rank: int = 4, seed: int = 0) -> LoRA:
    torch.manual_seed(seed)
    lora = LoRA(in_features, out_features, rank, alpha=8.0)
    torch.nn.init.normal_(lora.lora_B, std=0.1)          # B starts at zero: give it a delta
    return lora


def _init(layer) -> None:
    torch.nn.init.normal_(layer.weight, std=0.05)
    if layer.bias is not None:
        torch.nn.init.normal_(layer.bias, std=0.05)


def _expected(x, weight, bias, lora) -> torch.Tensor:
    return F.linear(x, weight, bias) + 2.0 * F.linear(F.linear(x, lora.lora_A), lora.lora_B)   # alpha / r = 2


@torch.no_grad()
def test_hook_adds_the_delta_on_plain_and_row_parallel_outputs():
    qkv = QKVParallelLinear(64, 16, 4, 2, bias=True, params_dtype=torch.float32)
    row = RowParallelLinear(64, 48, bias=True, params_dtype=torch.float32)
    x = torch.randn(5, 64)
    for layer in (qkv, row):
        _init(layer)
        base = layer(x)
        layer.lora = _adapter(64, layer.out_features)
        out = layer(x)
        torch.testing.assert_close(out, _expected(x, layer.weight, layer.bias, layer.lora))
        assert (out - base).abs().max() > 1e-3          # the hook changed the output
        layer.lora = None
        torch.testing.assert_close(layer(x), base)


@torch.no_grad()
def test_hook_sees_the_prologues_input():
    """With a hook the fused prologues give way to norm-then-project, so the delta is of the
    normed input (and of silu(gate) * up)."""
    norm = RMSNorm(64, 1e-6, torch.float32)
    torch.nn.init.normal_(norm.weight, mean=1.0, std=0.1)
    gate_up = MergedColumnParallelLinear(64, [96, 96], params_dtype=torch.float32)
    down = RowParallelLinear(96, 64, params_dtype=torch.float32)
    _init(gate_up), _init(down)
    gate_up.lora, down.lora = _adapter(64, 192, seed=1), _adapter(96, 64, seed=2)
    x, residual = torch.randn(3, 64), torch.randn(3, 64)
    y, new_residual = gate_up.forward_normed(norm, x, residual)
    h, expected_residual = norm(x, residual)
    torch.testing.assert_close(new_residual, expected_residual)
    torch.testing.assert_close(y, _expected(h, gate_up.weight, None, gate_up.lora))
    act = SiluAndMul()
    torch.testing.assert_close(down.forward_silu_mul(act, y), _expected(act(y), down.weight, None, down.lora))


@torch.no_grad()
def test_hook_composes_with_a_quantized_weight():
    layer = QKVParallelLinear(64, 16, 4, 2, params_dtype=torch.float32)
    _init(layer)
    layer.quant_method = Int8Method()
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(4, 64)
    quantized = layer(x)
    layer.lora = _adapter(64, layer.out_features)
    torch.testing.assert_close(layer(x), quantized + layer.lora.delta_of(x))


@torch.no_grad()
def test_slots_pick_each_rows_adapter_from_the_forward_context():
    layer = RowParallelLinear(32, 24, bias=True, params_dtype=torch.float32)
    _init(layer)
    adapters = [_adapter(32, 24, rank=r, seed=10 + r) for r in (2, 4, 3)]
    slots = LoRASlots(3, 32, 24, max_rank=4)
    for i, a in enumerate(adapters):
        slots.set_slot(i, a.lora_A, a.lora_B, float(a.scale))
    layer.lora = slots
    x = torch.randn(6, 32)
    base = F.linear(x, layer.weight, layer.bias)
    indices = torch.tensor([0, 2, -1, 1, 0, -1])
    with set_forward_context(None, lora_indices=indices):
        out = layer(x)
    for row, slot in enumerate(indices.tolist()):
        expect = base[row] if slot < 0 else base[row] + adapters[slot].delta_of(x[row])
        torch.testing.assert_close(out[row], expect)
    torch.testing.assert_close(layer(x), base)                     # outside a forward context: no adapter
    with set_forward_context(None):
        torch.testing.assert_close(layer(x), base)                 # no indices: no adapter


def test_slot_rank_is_checked():
    slots = LoRASlots(2, 32, 24, max_rank=4)
    with pytest.raises(ValueError, match="rank 8 .* does not fit slots of rank 4"):
        slots.set_slot(0, torch.zeros(8, 32), torch.zeros(24, 8), 1.0)
