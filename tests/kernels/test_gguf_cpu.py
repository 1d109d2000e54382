"""The CPU GGUF kernel (kernels/gguf_cpu.cpp) and its repack (kernels/gguf_repack.py): the repacked
blocks dequantize exactly as the gguf library does, and the native kernel matches the torch
reference on fresh random inputs, for every native type."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.model.gguf_builder import K_QUANTS, random_k_blocks
from tokenforge.kernels import gguf_cpu
from tokenforge.kernels.gguf_cpu import gguf_matmul, gguf_matmul_ref, quantize_activations_ref
from tokenforge.kernels.gguf_repack import I8, I8_32, U4, cat_rows, dequantize_packed, pack, repack, to_panels

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def _raw(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind in K_QUANTS:
        return random_k_blocks(rng, kind, (n, k))
    values = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    return gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind", TYPES)
def test_repack_dequantizes_as_the_gguf_library(kind):
    raw = _raw(kind, 48, 512, seed=1)
    qtype = gguf.GGMLQuantizationType[kind]
    packed = pack(torch.from_numpy(raw.copy()), int(qtype), 512)
    expected = gguf.quants.dequantize(raw, qtype)
    np.testing.assert_allclose(dequantize_packed(packed).numpy(), expected, rtol=1e-6, atol=1e-7 * np.abs(expected).max())


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 13])       # the 8-, 4- and 1-row tiles of a panel
@pytest.mark.parametrize("n", [80, 72])            # whole panels, and a last panel half full
def test_native_kernel_matches_reference(kind, rows, n):
    assert gguf_cpu.native_library() is not None, "g++ is on this machine: the native kernel must build"
    raw = _raw(kind, n, 512, seed=2)
    packed = pack(torch.from_numpy(raw), int(gguf.GGMLQuantizationType[kind]), 512)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0.0                                     # an all-zero activation block (scale 0)
    got, expected = gguf_matmul(x, packed), gguf_matmul_ref(x, packed)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_activation_quantization_is_per_block_of_32():
    x = torch.zeros(1, 64)
    x[0, 3], x[0, 40] = -2.54, 0.127
    xq, dx, xsum = quantize_activations_ref(x)
    assert xq[0, 3] == -127 and xq[0, 40] == 127 and dx[0].tolist() == pytest.approx([0.02, 0.001])
    assert xsum.tolist() == [[-127, 0, 127, 0]]


def test_fused_rows_and_the_fallback_without_a_compiler(monkeypatch):
    a, b = (repack(torch.from_numpy(_raw("Q4_1", n, 256, seed=n)), 3, 256) for n in (40, 16))
    x = torch.randn(2, 256)
    both = gguf_matmul(x, gguf_cpu.panels(cat_rows([a, b])))
    torch.testing.assert_close(both, torch.cat([gguf_matmul(x, to_panels(a)), gguf_matmul(x, to_panels(b))], dim=1))
    monkeypatch.setattr(gguf_cpu, "native_library", lambda: None)
    torch.testing.assert_close(gguf_matmul(x, gguf_cpu.panels(cat_rows([a, b]))), both, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_rms_norm_quantize_matches_the_reference(with_residual):
    """The add + RMSNorm computed and quantized in one native call, then multiplied, equals the
    torch prologue followed by the reference product (and returns the same new residual)."""
    lib = gguf_cpu.native_library()
    raw = _raw("Q4_1", 64, 256, seed=3)
    packed = pack(torch.from_numpy(raw), 3, 256)
    gen = torch.Generator().manual_seed(4)
    x, residual, weight = (torch.randn(3, 256, generator=gen), torch.randn(3, 256, generator=gen),
                           1 + 0.1 * torch.randn(256, generator=gen))
    acts, new_residual = gguf_cpu.rms_norm_quantize(lib, x, residual if with_residual else None, weight, 1e-5)
    normed, expected_residual = gguf_cpu.rms_norm_ref(x, residual if with_residual else None, weight, 1e-5)
    torch.testing.assert_close(new_residual, expected_residual)
    got, expected = gguf_cpu.matmul_quantized(lib, acts, packed), gguf_matmul_ref(normed, packed)
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3 * expected.abs().max().item())


def test_fused_silu_mul_quantize_matches_the_reference():
    lib = gguf_cpu.native_library()
    packed = pack(torch.from_numpy(_raw("Q6_K", 48, 512, seed=5)), 14, 512)
    gate_up = torch.randn(5, 1024, generator=torch.Generator().manual_seed(6))
    got = gguf_cpu.matmul_quantized(lib, gguf_cpu.silu_mul_quantize(lib, gate_up), packed)
    expected = gguf_matmul_ref(gguf_cpu.silu_mul_ref(gate_up), packed)
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3 * expected.abs().max().item())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_an_odd_block_count_takes_the_tail_path(kind):
    """K = 288: nine blocks (no pairs of blocks assumed anywhere), 24 rows (a panel and a half)."""
    packed = pack(torch.from_numpy(_raw(kind, 24, 288, seed=7)), int(gguf.GGMLQuantizationType[kind]), 288)
    x = torch.randn(5, 288, generator=torch.Generator().manual_seed(8))
    got, expected = gguf_matmul(x, packed), gguf_matmul_ref(x, packed)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_native_repack_is_the_torch_repack_bit_for_bit(kind):
    """The start-up's one-pass repack (C++) against gguf_repack.repack, with the block scales'
    float16 bits drawn at random (zeros, subnormals and negatives among them; no inf/NaN)."""
    assert gguf_cpu.native_library() is not None
    qtype = gguf.GGMLQuantizationType[kind]
    raw = _raw(kind, 40, 256, seed=3).copy()
    block = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    halves = np.random.default_rng(4).integers(0, 0x7C00, (raw.size // block, 2), dtype=np.uint16)
    halves[:, :] |= np.random.default_rng(5).integers(0, 2, halves.shape, dtype=np.uint16) << 15   # signs
    halves[:8] = [[0, 0], [1, 0x8001], [0x3FF, 0x83FF], [0x400, 0x7BFF], [0x8000, 3], [2, 0x200], [5, 9], [7, 0x3C00]]
    blocks = raw.reshape(-1, block)
    blocks[:, :2] = halves[:, :1].view(np.uint8)
    if kind == "Q4_1":
        blocks[:, 2:4] = halves[:, 1:].view(np.uint8)
    tensor = torch.from_numpy(raw)
    got, expected = gguf_cpu.repack_fast(tensor, int(qtype), 256), repack(tensor, int(qtype), 256)
    assert (got.kind, got.has_min, got.in_features) == (expected.kind, expected.has_min, expected.in_features)
    for a, b in ((got.q, expected.q), (got.scale, expected.scale), (got.minv, expected.minv)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.int8 else a.view(torch.int32) if a.is_floating_point()
                           else a, b.view(torch.uint8) if b.dtype == torch.int8 else b.view(torch.int32)
                           if b.is_floating_point() else b)


@pytest.mark.parametrize("kind", TYPES)
def test_native_dequantize_is_the_reference_bit_for_bit(kind):
    """A long prefill chunk's weight, dequantized in one native pass (no FMA contraction), is
    dequantize_packed's, so that chunk's GEMM is exactly the float32 path's."""
    raw = _raw(kind, 24, 512, seed=6)
    packed = pack(torch.from_numpy(raw), int(gguf.GGMLQuantizationType[kind]), 512)
    got = gguf_cpu.dequantize_into(packed, torch.full((24, 512), float("nan")))
    assert torch.equal(got, dequantize_packed(packed))


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("built", [True, False])
def test_dequantize_into_bf16_rounds_as_torch(kind, built, monkeypatch):
    """The bf16 prefill GEMM's weight (native, and the torch fallback without a compiler) is the
    float32 dequantization rounded to nearest even, bit for bit what `.to(torch.bfloat16)` gives."""
    raw = _raw(kind, 24, 512, seed=7)
    packed = pack(torch.from_numpy(raw), int(gguf.GGMLQuantizationType[kind]), 512)
    if not built:
        monkeypatch.setattr(gguf_cpu, "native_library", lambda: None)
    got = gguf_cpu.dequantize_into(packed, torch.full((24, 512), float("nan"), dtype=torch.bfloat16))
    assert torch.equal(got.view(torch.int16), dequantize_packed(packed).to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("kind", TYPES)
def test_native_panels_are_the_torch_panels_bit_for_bit(kind):
    """The loader's one-pass panel layout (C++) is gguf_repack.to_panels', padding rows included,
    and it keeps the codes once: no row-by-row copy beside the panels."""
    rows = repack(torch.from_numpy(_raw(kind, 40, 256, seed=11)), int(gguf.GGMLQuantizationType[kind]), 256)
    got, expected = gguf_cpu.panels(rows), to_panels(rows)
    assert (got.kind, got.out_features, got.in_features) == (expected.kind, 40, 256)
    assert got.q.shape == (3, 8, 256 if rows.kind == 0 else 512)       # 40 rows: 3 panels of 16
    # one scale per 32 wherever the type has one (all but Q6_K's i8): one float epilogue a block
    assert got.kind == (U4 if rows.kind == U4 else I8 if kind == "Q6_K" else I8_32)
    assert got.scale.numel() == 3 * 8 * 16 * (2 if kind == "Q6_K" else 1)
    assert (got.minv is None) == (expected.minv is None) == (not rows.has_min)
    pairs = [(got.q, expected.q), (got.scale, expected.scale)] + ([(got.minv, expected.minv)] if rows.has_min else [])
    for a, b in pairs:
        assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx2",)])
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q6_K", "Q5_K"])
def test_avx2_and_plain_panel_kernels_match_reference(flags, kind):
    """The panel kernels other CPUs build (AVX2 half panels; plain loops), built here with the
    AVX-512 (or AVX2) instructions turned off, against the float64 reference."""
    lib = gguf_cpu.build_library(flags)
    assert lib is not None
    packed = pack(torch.from_numpy(_raw(kind, 40, 256, seed=12)), int(gguf.GGMLQuantizationType[kind]), 256)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(13))
    got = gguf_cpu.matmul_quantized(lib, gguf_cpu.quantize_activations(lib, x), packed)
    expected = gguf_matmul_ref(x, packed)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q6_K"])
def test_i8_code_bias_leaves_no_float_cancellation(kind):
    """i8 codes are stored + 128 for the unsigned dot product; the bias must come back out exactly
    (in the integers). Activations with a mean make the biased sum large against the signed one:
    taking the bias out in float erred by ~6e-6 of the largest output here (Q5_0)."""
    packed = pack(torch.from_numpy(_raw(kind, 64, 512, seed=14)), int(gguf.GGMLQuantizationType[kind]), 512)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(15)) + 3.0
    got, expected = gguf_matmul(x, packed), gguf_matmul_ref(x, packed)
    assert (got - expected).abs().max() < 1e-6 * expected.abs().max()


@pytest.mark.parametrize("flags", [(), ("-mno-avx512f",)])
def test_native_activation_quantizer_is_the_reference_bit_for_bit(flags):
    """The vectorised quantizer (AVX-512) and the scalar one give the reference's codes, scales and
    code sums exactly: halves round to even, an all-zero block has scale 0."""
    lib = gguf_cpu.build_library(flags)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(16)) * 3
    x[1, :32] = 0.0
    x[2, :32] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5] + [0.25] * 26)      # scale 1: exact halves
    acts = gguf_cpu.quantize_activations(lib, x)
    xq, dx, xs = quantize_activations_ref(x)
    assert torch.equal(acts.xq, xq) and torch.equal(acts.dx, dx) and torch.equal(acts.xs, xs)
    assert acts.xq[2, :6].tolist() == [127, 2, -4, 0, 0, 2]
