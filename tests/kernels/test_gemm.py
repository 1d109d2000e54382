"""The mid-batch GEMM (kernels/gemm.py) against its torch reference on fresh random inputs: plain and
swapped tiles, partial row, column and K tiles, grouped row tiles, split-K that does and does not
divide the K tiles (bitwise reproducible), and the config checks. CUDA, or Triton's interpreter on
the CPU (TRITON_INTERPRET=1, small shapes)."""

import pytest
import torch

from tokenforge.kernels.gemm import (GemmConfig, check_config, default_config, gemm, gemm_ref, row_use,
                                     shared_memory_bytes)

# (M, N, K, config)
CASES = [
    (5, 48, 128, GemmConfig(16, 64, 64)),                                  # one partial tile each way
    (37, 96, 192, GemmConfig(16, 32, 64, group_m=2)),                      # 3 row tiles in groups of 2
    (20, 64, 160, GemmConfig(16, 32, 64, swap_ab=True)),                   # K = 2.5 tiles
    (70, 80, 256, GemmConfig(32, 32, 64, group_m=3, split_k=3)),           # 4 K tiles in 3 splits
    (9, 64, 512, GemmConfig(16, 64, 128, split_k=4, swap_ab=True)),
]


@pytest.mark.parametrize("m,n,k,cfg", CASES, ids=[c[3].label() for c in CASES])
def test_gemm_matches_reference(device, rel_err, tol, m, n, k, cfg):
    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    w = (torch.randn(n, k, device=device) * k ** -0.5).to(torch.bfloat16)
    y = gemm(x, w, cfg)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert rel_err(y, gemm_ref(x, w)) <= tol(torch.bfloat16)
    if cfg.split_k > 1:           # partials added in a fixed order: the same bits every run
        assert torch.equal(gemm(x, w, cfg), y)


def test_gemm_default_config_and_empty_batch(device, rel_err, tol):
    x = torch.randn(3, 128, device=device).to(torch.bfloat16)
    w = torch.randn(64, 128, device=device).to(torch.bfloat16)
    assert rel_err(gemm(x, w), gemm_ref(x, w)) <= tol(torch.bfloat16)
    assert gemm(x[:0], w).shape == (0, 64)


def test_config_checks():
    assert check_config(GemmConfig(64, 128, 64), 4096) is None
    assert "power of two" in check_config(GemmConfig(48, 128, 64), 4096)
    assert "split_k" in check_config(GemmConfig(64, 128, 64, split_k=3), 128)
    big = GemmConfig(128, 256, 128, num_stages=3)
    assert shared_memory_bytes(big) == 3 * 384 * 128 * 2 and "bytes" in check_config(big, 4096)
    assert row_use(GemmConfig(128, 128, 64), 160) == 160 / 256 and row_use(GemmConfig(16, 64, 64), 32) == 1.0
    for m in (1, 16, 48, 64, 200, 512):
        for n, k in ((6144, 4096), (4096, 14336)):
            assert check_config(default_config(m, n, k), k) is None
