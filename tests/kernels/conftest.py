"""Fixtures for kernel tests.

GPU tests take the `device` fixture: CUDA when present; on a CPU machine with Triton installed
and TRITON_INTERPRET=1 they run through Triton's interpreter (slow, small shapes; bf16 dots are
not emulated there, so bf16 attention cases skip); otherwise they skip.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenforge.kernels._triton import HAS_TRITON

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1" and HAS_TRITON and not torch.cuda.is_available()


@pytest.fixture
def device() -> torch.device:
    if torch.cuda.is_available() and HAS_TRITON:
        return torch.device("cuda")
    if INTERPRET:
        return torch.device("cpu")
    pytest.skip("needs CUDA and Triton (or TRITON_INTERPRET=1 with Triton installed)")


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere fails."""
    out64, ref64 = out.double(), ref.double()
    assert not torch.isnan(out64).any(), "NaN in output (unwritten or bad math)"
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def _tol(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}[dtype]


def random_paged_problem(ctx_lens: list[int], query_lens: list[int], num_q_heads: int, num_kv_heads: int,
                         head_dim: int, block_size: int, dtype: torch.dtype, device: torch.device,
                         extra_blocks: int = 3):
    """q [T, Hq, D], kv_cache filled with random K/V for every position, block tables over a
    shuffled pool (so neighbouring positions live in unrelated blocks), query_start_loc, seq_lens."""
    seq_lens = [c + q for c, q in zip(ctx_lens, query_lens)]
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + extra_blocks
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    perm = torch.randperm(num_blocks).tolist()
    width = max(max(need), 1) + 1
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    lists, used = [], 0
    for i, n in enumerate(need):
        lists.append(perm[used: used + n])
        tables[i, :n] = torch.tensor(lists[-1], dtype=torch.int32)
        used += n
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    q = torch.randn(int(qsl[-1]), num_q_heads, head_dim, dtype=dtype, device=device)
    return (q, kv_cache, tables.to(device), qsl.to(device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device), lists)


@pytest.fixture
def rel_err():
    return _rel_err


@pytest.fixture
def tol():
    return _tol


@pytest.fixture
def paged_problem():
    return random_paged_problem


def run_interpreted(module: str, timeout: float) -> subprocess.CompletedProcess:
    """`python -m module` from the repository root under Triton's interpreter (TRITON_INTERPRET=1 must
    be set before Triton is imported, so in a fresh process); its output captured as text."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.run([sys.executable, "-m", module], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)
