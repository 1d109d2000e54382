"""Triton GEMVs (plain, add+RMSNorm prologue, SiLU-and-mul prologue) against their torch references."""

import pytest
import torch

from tokenforge.kernels.gemv import (
    GemvConfig,
    add_rms_norm_gemv,
    add_rms_norm_gemv_ref,
    gemv,
    gemv_config,
    gemv_ref,
    silu_mul_gemv,
    silu_mul_gemv_ref,
)

# (M, N, K): batch 1-5 (5 takes two row blocks), N and K off the block multiples, Llama-like widths
SHAPES = [(1, 256, 512), (2, 300, 1000), (3, 37, 4096), (4, 1030, 96), (5, 129, 576)]
DTYPES = [torch.bfloat16, torch.float32]


def _weights(n: int, k: int, dtype, device, bias: bool):
    w = (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    return w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv(device, rel_err, tol, dtype, m, n, k, bias):
    x = torch.randn(m, k, device=device).to(dtype)
    w, b = _weights(n, k, dtype, device, bias)
    assert rel_err(gemv(x, w, b), gemv_ref(x, w, b)) <= tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_gemv(device, rel_err, tol, dtype, m, n, k, with_residual):
    x = torch.randn(m, k, device=device).to(dtype)
    residual = torch.randn(m, k, device=device).to(dtype) if with_residual else None
    norm_w = (1 + 0.2 * torch.randn(k, device=device)).to(dtype)
    w, b = _weights(n, k, dtype, device, bias=m == 2)
    old = residual.clone() if residual is not None else None
    y, new_res = add_rms_norm_gemv(x, residual, norm_w, 1e-5, w, b)
    y_ref, res_ref = add_rms_norm_gemv_ref(x, old, norm_w, 1e-5, w, b)
    # Triton's interpreter truncates fp32 -> bf16 (the GPU rounds to nearest), and this prologue
    # rounds three times like the unfused path: a ~1% downward bias on the CPU only.
    assert rel_err(y, y_ref) <= tol(dtype) * (2 if device.type == "cpu" else 1)
    if residual is None:
        assert new_res is x
    else:
        assert torch.equal(residual, old)                       # the input residual is not touched
        assert rel_err(new_res, res_ref) <= tol(dtype)
        if device.type == "cuda":                               # same fp32 add, same rounding
            assert torch.equal(new_res, res_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_silu_mul_gemv(device, rel_err, tol, dtype, m, n, k):
    gate_up = torch.randn(m, 2 * k, device=device).to(dtype)
    w, b = _weights(n, k, dtype, device, bias=m == 3)
    assert rel_err(silu_mul_gemv(gate_up, w, b), silu_mul_gemv_ref(gate_up, w, b)) <= tol(dtype)


@pytest.mark.parametrize("cfg", [GemvConfig(1, 8, 256), GemvConfig(2, 16, 128, 8), GemvConfig(4, 2, 512, 4, 3)])
def test_configs_and_strided_input(device, rel_err, tol, cfg):
    """Explicit configs (the bench sweeps them) and a row-strided x (a view into a wider tensor)."""
    wide = torch.randn(3, 1200, device=device).to(torch.bfloat16)
    x = wide[:, 100:1100]                                       # [3, 1000], row stride 1200
    w, _ = _weights(333, 1000, torch.bfloat16, device, bias=False)
    assert rel_err(gemv(x, w, config=cfg), gemv_ref(x, w)) <= tol(torch.bfloat16)


def test_empty_batch(device):
    w, _ = _weights(64, 128, torch.bfloat16, device, bias=False)
    assert gemv(torch.empty(0, 128, dtype=torch.bfloat16, device=device), w).shape == (0, 64)


def test_config_table_covers_llama_shapes():
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]:
        for m in (1, 2, 3, 4, 16):
            cfg = gemv_config(m, n, k)
            assert cfg.block_m <= 4 and cfg.block_n * cfg.block_k * cfg.block_m <= 8192
            assert -(-n // cfg.block_n) >= 4 * 132 or n <= 1024
