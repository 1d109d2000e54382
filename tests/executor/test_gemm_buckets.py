"""The decode-graph bucket plan (executor/gemm_buckets.py) from fake per-size linear times: a
bucket slower than the next kept larger one is dropped (its batches pad up), never the largest,
the small ones or a verify shape; cuBLASLt is chosen only where it is clearly faster; the graph
runner captures exactly the planned sizes under the planned library."""

from __future__ import annotations

from tokenforge.executor.gemm_buckets import MEASURE_FROM, plan_buckets

# H100-like layer times (us) at the sizes cuda_graph.capture_sizes gives up to 512, by M
MEASURED = {16: 167, 32: 169, 48: 170, 64: 172, 80: 175, 96: 178, 112: 179, 128: 181, 144: 184, 160: 187, 176: 190,
            192: 194, 208: 200, 224: 206, 240: 205, 256: 204, 288: 260, 320: 245, 352: 262, 384: 273, 416: 330,
            448: 443, 480: 300, 512: 301}
SIZES = [1, 2, 4, 8, *MEASURED]


def test_slow_buckets_pad_to_a_faster_larger_one():
    plan = plan_buckets(SIZES, lambda s, lib: MEASURED[s] * (1.0 if lib == "cublas" else 1.001))
    # 448 (443 us) and 416 (330) lose to 480 (300); 288 (260) to 320 (245); 224 (206) to 240 (205) is
    # within the margin and stays
    assert plan.dropped == [288, 416, 448]
    assert plan.sizes == [s for s in SIZES if s not in (288, 416, 448)]
    assert plan.library == {}                    # cuBLASLt never clearly faster here
    assert 512 in plan.sizes and all(s in plan.sizes for s in SIZES if s < MEASURE_FROM)


def test_dropping_chains_to_the_bucket_batches_would_pad_to():
    """300 loses to 320 and is dropped, so 290's batches would pad to 320 as well: 290 is dropped
    against 320's time; 280 is within the margin of 320's and stays."""
    cost = {280: 206.0, 290: 250.0, 300: 500.0, 320: 200.0}
    plan = plan_buckets([280, 290, 300, 320], lambda s, lib: cost[s])
    assert plan.sizes == [280, 320] and plan.dropped == [290, 300]


def test_cublaslt_where_clearly_faster_and_verify_shapes_kept():
    times = {(s, "cublas"): 100.0 + s for s in (16, 32, 64)} | {(s, "cublaslt"): 100.0 + s for s in (16, 32, 64)}
    times[(32, "cublaslt")] = 80.0           # clearly faster
    times[(64, "cublaslt")] = 163.0          # within the margin: the default stays
    times[(40, "cublas")] = times[(40, "cublaslt")] = 900.0
    plan = plan_buckets([16, 32, 40, 64], lambda s, lib: times[(s, lib)], keep={40})
    assert plan.library == {32: "cublaslt"}
    assert 40 in plan.sizes                   # a verify bucket is never dropped nor measured
