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


@pytest.mark.parametrize("slots,rank,fused", [
    (16, 16, {"qkv": True, "o": True, "gate_up": True, "down": True}),      # W2 over 64 adapters' slots
    (16, 64, {"qkv": False, "o": False, "gate_up": True, "down": False}),   # 64-rank slots: +50% on qkv
    (1, 64, {"qkv": True, "o": True, "gate_up": True, "down": True}),
])
def test_the_shrink_goes_into_the_product_where_its_columns_are_few(slots, rank, fused):
    """model/lora.py's default on CUDA: the slots' A under the weight while they add at most an
    eighth to the linear's output columns (8B shapes; the input width does not matter)."""
    from tokenforge.model.lora import shrink_in_gemm_pays

    shapes = {"qkv": (4096, 1024, 1024), "o": (4096,), "gate_up": (14336, 14336), "down": (4096,)}
    got = {name: shrink_in_gemm_pays(LoRASlots(slots, 8, sum(s), rank, torch.bfloat16, s)) for name, s in shapes.items()}
    assert got == fused


def test_the_shrink_in_the_product_keeps_prefill_chunks_on_the_kernel():
    """A linear with its slots' A under the weight (`put_a_under`): steps of 2..max_rows rows run one
    product and the expand, a longer prefill chunk the base product and the shrink kernel; both give
    the reference delta, and slot writes land in the product's weight."""
    from tokenforge.kernels.lora import lora_reference

    torch.manual_seed(0)
    layer = QKVParallelLinear(32, 8, 4, 2, bias=True)
    torch.nn.init.normal_(layer.weight, std=0.2)
    torch.nn.init.normal_(layer.bias, std=0.2)
    layer.lora = LoRASlots(3, 32, layer.out_features, 8, torch.float32, tuple(layer.shard_sizes()))
    assert layer.lora.put_a_under(layer)
    cat = layer.lora.in_gemm
    for s in range(3):
        layer.lora.set_slot(s, torch.randn(8, 32), torch.randn(layer.out_features, 8), 0.5 + s)
    assert torch.equal(cat.weight[cat.rows:].view_as(layer.lora.lora_A), layer.lora.lora_A)
    assert cat.weight[cat.rows:].abs().sum() > 0
    for tokens in (5, cat.max_rows + 3):
        x = torch.randn(tokens, 32)
        idx = torch.randint(-1, 3, (tokens,))
        with set_forward_context(None, idx):
            got = layer(x)
        base = F.linear(x, layer.weight, layer.bias)
        want = lora_reference(x, base, layer.lora.lora_A, layer.lora.lora_B, layer.lora.scale, idx, layer.lora.slices)
        assert torch.allclose(got, want, atol=1e-4), tokens
        assert got.stride(0) == (cat.weight.shape[0] if tokens <= cat.max_rows else layer.out_features)
