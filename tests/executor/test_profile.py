"""torch.profiler hooks: LLM.start_profile/stop_profile write a trace, and the device-busy
summary (the fraction of the profiled span the GPU was executing) is computed exactly."""

from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from tokenforge import LLM, SamplingParams
from tokenforge.executor.executor import device_busy


def _event(start_us: float, end_us: float, device=DeviceType.CUDA):
    return SimpleNamespace(device_type=device, time_range=SimpleNamespace(start=start_us, end=end_us))


def test_device_busy_is_the_union_of_device_intervals():
    events = [_event(0, 10), _event(5, 12), _event(20, 30), _event(29, 31), _event(40, 50),
              _event(0, 100, DeviceType.CPU)]                  # host events do not count
    s = device_busy(events)
    assert s["busy_ms"] == pytest.approx((12 + 11 + 10) / 1e3)
    assert s["span_ms"] == pytest.approx(50 / 1e3) and s["num_kernels"] == 5
    assert s["busy_frac"] == pytest.approx(33 / 50)
    assert device_busy([_event(0, 5, DeviceType.CPU)]) is None


def test_profile_writes_a_trace_and_a_summary(tmp_path):
    llm = LLM("tiny-llama", load_format="dummy", device="cpu", max_model_len=256, profile_dir=str(tmp_path))
    llm.start_profile()
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    table = llm.stop_profile()
    assert "aten::" in table
    assert (tmp_path / "summary.txt").read_text() == table
    assert any(p.name.endswith(".pt.trace.json") for p in tmp_path.iterdir())
    assert llm.stop_profile() == ""                             # stopping twice is harmless


def test_profiling_without_a_directory_is_a_clear_error():
    llm = LLM("tiny-llama", load_format="dummy", device="cpu", max_model_len=256)
    with pytest.raises(ValueError, match="profile directory"):
        llm.start_profile()
