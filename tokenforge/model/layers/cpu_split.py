"""One-row CPU matmuls on two cores: the output rows split between this thread and a helper.

Why: a single-sequence decode step multiplies ONE activation row by every weight matrix. MKL runs
a one-row product (sgemv) on one thread whatever torch's thread count, so on a 2-core machine the
second core idles through the step while the first streams all the weights from memory. Here the
weight's output rows are cut in two (row slices of a row-major [out, in] matrix are contiguous
views: no copy), the helper thread computes one half while the caller computes the other, and the
halves are concatenated. Each output element is the same sgemv dot product as before, so the
result is bit-identical to the one-call product (tests/model/test_cpu_split.py checks it).

Only for: one row, float32 CPU tensors, no autograd (serving), torch allowed two or more threads,
and a matrix large enough that the hand-off (tens of microseconds) is worth it. Anything else,
and a call while the helper is busy with another caller, runs the plain product.
"""

from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F

MIN_SPLIT_ELEMENTS = 512 * 1024      # smaller matrices (o_proj 576x576): the hand-off costs what the half saves


class _Helper:
    """A daemon thread that runs one product at a time for the caller."""

    def __init__(self) -> None:
        self.busy = threading.Lock()          # held by the caller for one submit .. wait
        self._ready = threading.Lock()
        self._done = threading.Lock()
        self._ready.acquire()
        self._done.acquire()
        self._job: tuple | None = None
        self._result: torch.Tensor | BaseException | None = None
        threading.Thread(target=self._loop, name="tokenforge-cpu-gemv", daemon=True).start()

    def _loop(self) -> None:
        while True:
            self._ready.acquire()
            x, weight, bias, inference = self._job
            try:
                # grad mode and inference mode are per thread: run as the caller does
                with torch.inference_mode(inference), torch.no_grad():
                    self._result = F.linear(x, weight, bias)
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller, raised there
                self._result = exc
            self._job = None
            self._done.release()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        half = weight.shape[0] // 2
        b_lo, b_hi = (None, None) if bias is None else (bias[:half], bias[half:])
        self._job = (x, weight[half:], b_hi, torch.is_inference_mode_enabled())
        self._ready.release()
        try:
            low = F.linear(x, weight[:half], b_lo)
        finally:
            self._done.acquire()              # always wait: the helper reads x and weight
        high, self._result = self._result, None
        if isinstance(high, BaseException):
            raise high
        return torch.cat((low, high), dim=-1)


_helper: _Helper | None = None
_helper_lock = threading.Lock()


def _forget_helper() -> None:
    """A forked child has no helper thread (only the forking thread survives a fork): start afresh."""
    global _helper, _helper_lock
    _helper, _helper_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helper)


def _get_helper() -> _Helper:
    global _helper
    if _helper is None:
        with _helper_lock:
            if _helper is None:
                _helper = _Helper()
    return _helper


def splits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x [1, in] @ weight^T runs on two cores."""
    return (x.dim() == 2 and x.shape[0] == 1 and x.device.type == "cpu" and weight.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.numel() >= MIN_SPLIT_ELEMENTS and weight.is_contiguous()
            and not torch.is_grad_enabled() and torch.get_num_threads() >= 2)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), its output rows split over two cores when `splits` says so."""
    if not splits(x, weight):
        return F.linear(x, weight, bias)
    helper = _get_helper()
    if not helper.busy.acquire(blocking=False):      # another thread is using the helper
        return F.linear(x, weight, bias)
    try:
        return helper.linear(x, weight, bias)
    finally:
        helper.busy.release()
