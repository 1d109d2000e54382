"""If-nodes in torch-captured CUDA graphs (executor/cond_graph.py): on the GPU, with each builder
this machine has (torch's own, cuda-python's), a replay runs a node's body only while its flag is
set, the body may allocate (its memory comes from the capture's pool), and a body that clears the
flag skips the nodes after it; on the CPU, the builder choice and the refusals."""

from __future__ import annotations

import pytest
import torch

from tokenforge.executor import cond_graph

BUILDERS = [b for b in (cond_graph.TORCH, cond_graph.CUDA_PYTHON)
            if torch.cuda.is_available() and
            (hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node") if b == cond_graph.TORCH
             else cond_graph._cuda_python() is not None)]


def test_no_builder_without_cuda_and_a_clear_refusal(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cond_graph.builder() is None
    flag = torch.ones((), dtype=torch.bool)
    with pytest.raises(RuntimeError, match="one bool/uint8/int32 element on CUDA"):
        with cond_graph.if_node(None, flag, None):
            pass
    with pytest.raises(RuntimeError, match="one bool/uint8/int32 element on CUDA"):
        with cond_graph.if_node(None, torch.ones(2, dtype=torch.bool), None, use=cond_graph.TORCH):
            pass


def test_the_builder_follows_what_torch_and_cuda_python_offer(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node", lambda *a: None, raising=False)
    assert cond_graph.builder() == cond_graph.TORCH
    monkeypatch.delattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")
    monkeypatch.setattr(cond_graph, "_cuda_python", lambda: None)
    assert cond_graph.builder() is None
    monkeypatch.setattr(cond_graph, "_cuda_python", lambda: ("driver", "nvrtc", "runtime"))
    monkeypatch.setattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", lambda *a: None, raising=False)
    assert cond_graph.builder() == cond_graph.CUDA_PYTHON


@pytest.mark.skipif(not BUILDERS, reason="needs CUDA and an if-node builder (torch >= 2.12 or cuda-python)")
@pytest.mark.parametrize("use", BUILDERS)
@pytest.mark.parametrize("dtype", [torch.bool, torch.int32])
def test_bodies_run_while_the_flag_holds(use, dtype):
    x = torch.zeros(4, device="cuda")
    out = torch.zeros(4, device="cuda")
    flag = torch.ones((), dtype=dtype, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        for _ in range(40):                           # more nodes than torch's pool has streams (32)
            with cond_graph.if_node(graph, flag, pool, use=use):
                x.add_(1)
                doubled = x * 2                       # allocated inside the body: the capture's pool
                out.copy_(doubled)
                flag.copy_((x[0] < 3).to(dtype))      # the third iteration clears it
    for start in (1, 0):                              # set: three bodies run; clear: none
        x.zero_()
        out.zero_()
        flag.fill_(start)
        graph.replay()
        torch.cuda.synchronize()
        runs = 3 if start else 0
        assert x.tolist() == [float(runs)] * 4 and out.tolist() == [2.0 * runs] * 4, (use, start)
