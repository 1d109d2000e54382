"""Give a runner's memory back at shutdown, without relying on the garbage collector.

An engine's tensors are reachable from many objects (layers hold their KV cache, CUDA graphs hold
their memory pool and outputs, the sampler and the input batch hold persistent buffers), and some
of those objects sit in reference cycles. Dropping the runner alone then frees nothing until
`gc.collect()` runs, so the next engine in the same process finds the device full. Instead the
runner's tensors are dropped where they are held: each module's parameters and buffers, the
tensors in the attributes of the runner and of the tokenforge objects it owns, and the graphs.
Afterwards the device allocator's cache is emptied, so `torch.cuda.memory_allocated()` and the
driver both see the memory back.
"""

from __future__ import annotations

import torch
from torch import nn


def release_runner(runner) -> None:
    """Drop every tensor `runner` owns (the runner is unusable afterwards)."""
    graphs = getattr(runner, "graphs", None)
    if graphs is not None:
        graphs.release()
        runner.graphs = None
    burst = getattr(runner, "burst", None)
    if burst is not None:
        burst.release()
    drafter = getattr(runner, "drafter", None)
    if drafter is not None:
        drafter.release()
    model = getattr(runner, "model", None)
    if isinstance(model, nn.Module):
        for module in model.modules():
            module._parameters.clear()
            module._buffers.clear()
            _drop_tensors(module, depth=0)
    _drop_tensors(runner, depth=2)
    runner.model = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _drop_tensors(obj, depth: int) -> None:
    """Set every tensor-valued attribute of `obj` to None (tensors in lists, tuples and dicts
    too), and recurse `depth` levels into the tokenforge objects it holds."""
    attrs = getattr(obj, "__dict__", None)
    if attrs is None:
        return
    for name, value in list(attrs.items()):
        if _holds_tensor(value):
            attrs[name] = None
        elif depth > 0 and type(value).__module__.startswith("tokenforge.") and not isinstance(value, nn.Module):
            _drop_tensors(value, depth - 1)


def _holds_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, torch.Tensor) for v in value)
    if isinstance(value, dict):
        return any(isinstance(v, torch.Tensor) for v in value.values())
    return False
