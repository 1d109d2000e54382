"""Which decode-graph buckets to capture, and under which BLAS library, from the linears' measured times.

In: the candidate bucket sizes (cuda_graph.capture_sizes) and the time of one decoder layer's
linears at each size under each library (`measure_layer`, on the device, before capture). Out: a
`BucketPlan`: the sizes kept (a bucket whose linears run slower than a larger bucket's is dropped,
so its batches pad to the larger one) and, per size, the library its graph is captured with (a
graph keeps the kernels it recorded; eager steps keep torch's default).

Why: cuBLAS picks its kernel per shape by heuristics, and at serving batch sizes some picks are far
off (H100, Llama-3.1-8B, `tokenforge bench kernels --part mid_gemm`, BENCHMARKS.md wave 3 round 11):
gate_up at 448 rows took 292 us where 512 rows took 160, qkv at 320 rows 38.5 us where 384 took
29.6; cuBLASLt ran down_proj (4096 x 14336) 14-28% faster at 128-384 rows and the other shapes
within 1%. Measuring at start-up (~0.3 s on an 8B model) finds them on whatever GPU and model this
is. Only the policy is here free of torch (`plan_buckets`, the CPU tests drive it with fake times).
Tensor-parallel ranks would measure different times and must capture the same buckets: the plan
is made only on one GPU.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

LIBRARIES = ("cublas", "cublaslt")
MEASURE_FROM = 16      # smaller buckets are latency-bound GEMVs: every size is kept, default library
MARGIN = 0.03          # a larger bucket (another library) must be this much faster to be chosen


@dataclass
class BucketPlan:
    sizes: list[int]
    library: dict[int, str] = field(default_factory=dict)     # size -> library; absent: torch's default
    dropped: list[int] = field(default_factory=list)

    def describe(self) -> str:
        lt = sorted(s for s, lib in self.library.items() if lib == "cublaslt")
        return (f"{len(self.sizes)} buckets; dropped {self.dropped or 'none'} (slower than a larger one); "
                f"cuBLASLt at {lt or 'none'}")


def plan_buckets(sizes: list[int], cost: Callable[[int, str], float], keep: set[int] = frozenset()) -> BucketPlan:
    """`cost(size, library)`: seconds of the measured linears at `size` rows. Sizes below
    MEASURE_FROM and those in `keep` (a speculative verify shape) stay as they are."""
    sizes = sorted(set(sizes))
    best: dict[int, tuple[float, str]] = {}
    for s in sizes:
        if s < MEASURE_FROM or s in keep:
            continue
        times = {lib: cost(s, lib) for lib in LIBRARIES}
        lib = "cublaslt" if times["cublaslt"] < times["cublas"] * (1 - MARGIN) else "cublas"
        best[s] = (times[lib], lib)
    kept, dropped, above = [], [], None       # above: the cost of the smallest bucket kept so far
    for s in reversed(sizes):
        if s in best and above is not None and above < best[s][0] * (1 - MARGIN):
            dropped.append(s)                     # its batches pad to that bucket, which is faster
            continue
        kept.append(s)
        above = best[s][0] if s in best else None
    library = {s: best[s][1] for s in kept if s in best and best[s][1] != "cublas"}
    return BucketPlan(sorted(kept), library, sorted(dropped))


def measure_layer(linears, device, dtype, repeats: int = 5) -> Callable[[int, str], float]:
    """The cost function of `plan_buckets`: `linears` (one decoder layer's, each called as
    layer.quant_method.apply on a random [size, in] input) timed with CUDA events, the median of a
    few runs after a warm-up, under each library."""
    import statistics  # noqa: PLC0415

    import torch  # noqa: PLC0415

    inputs: dict[int, list] = {}

    def cost(size: int, library: str) -> float:
        if size not in inputs:
            inputs[size] = [torch.randn(size, m.in_features, device=device, dtype=dtype) for m in linears]
        with blas_library(library):
            def run():
                for m, x in zip(linears, inputs[size]):
                    m.quant_method.apply(m, x, None)
            run()
            times = []
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(repeats):
                    run()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3 / repeats)
            return statistics.median(times)
    return cost


def first_layer_linears(model) -> list:
    """The linears (model/layers/linear.py) of the model's first decoder layer, in module order."""
    from tokenforge.model.layers.linear import LinearBase  # noqa: PLC0415

    found: dict[int, list] = {}
    for name, module in model.named_modules():
        match = re.search(r"\.layers\.(\d+)\.", name)
        if match and isinstance(module, LinearBase):
            found.setdefault(int(match.group(1)), []).append(module)
    return found[min(found)] if found else []


@contextlib.contextmanager
def blas_library(library: str | None) -> Iterator[None]:
    """torch's BLAS library set to `library` within (None: unchanged), restored after."""
    if library is None:
        yield
        return
    import torch  # noqa: PLC0415

    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


__all__ = ["BucketPlan", "blas_library", "first_layer_linears", "measure_layer", "plan_buckets"]
