"""The per-layer decode-kernel plan (model/quant/kernel_plan.py): the pre-table default, a table's
buckets, and forced kernels, refused with one clear line (before any weight loads) where they
cannot run the shape."""

import json

import pytest
import torch

from tokenforge import envs
from tokenforge.kernels.quant_splitk import SplitKConfig
from tokenforge.model.quant import QuantOptions, before_loading
from tokenforge.model.quant import kernel_plan
from tokenforge.model.quant.kernel_plan import plan_for, table_key


@pytest.fixture
def table(tmp_path, monkeypatch):
    def write(entries: dict):
        path = tmp_path / "table.json"
        path.write_text(json.dumps({"entries": entries}))
        monkeypatch.setenv(envs.QUANT_TABLE, str(path))
        kernel_plan._table.cache_clear()
    monkeypatch.delenv(envs.QUANT_KERNEL, raising=False)
    yield write
    kernel_plan._table.cache_clear()


def test_default_without_a_table_entry_is_the_gemv_then_the_many_row_path(table):
    table({})
    plan = plan_for("int8", 4096, 4096)
    assert [plan.choice(m).backend for m in (1, 4)] == ["qgemv", "qgemv"]
    assert plan.choice(5) is None and plan.choice(17) is None


def test_table_buckets_pick_the_smallest_bound_at_or_above_m(table):
    table({table_key("int4", 4096, 4096, 128): {"tile": 512, "rows": {
        "1": ["tinygemm"], "8": ["splitk", [32, 512, 4, True, 4, 1]], "16": ["dense"]}}})
    plan = plan_for("int4", 4096, 4096, 128)
    assert plan.choice(1).backend == "tinygemm"
    assert plan.choice(2).config == SplitKConfig(32, 512, 4, True, 4, 1) == plan.choice(8).config
    assert plan.choice(9) is None and plan.tile == 512
    assert plan.summary()[1] == "tinygemm" and plan.summary()[8].startswith("splitk(n32,k512,s4,dot")


def test_a_table_entry_the_kernel_cannot_run_is_refused(table):
    table({table_key("int4", 4096, 4096, 128): {"tile": 256, "rows": {"16": ["splitk", [32, 512, 4, True]]}}})
    with pytest.raises(ValueError, match=r"the kernel table cannot run a linear \(int4, 4096x4096, 1 rows\): "
                                         r"int4 tile 512 differs from the layer's layout tile 256"):
        plan_for("int4", 4096, 4096, 128)


def test_forced_kernels(table, monkeypatch):
    table({})
    monkeypatch.setenv(envs.QUANT_KERNEL, "splitk")
    plan = plan_for("int4", 28672, 4096, 128)
    assert all(plan.choice(m).config.block_k == plan.tile for m in range(1, 17))
    assert plan_for("fp8", 4096, 14336).choice(16).a8
    monkeypatch.setenv(envs.QUANT_KERNEL, "tinygemm")
    assert plan_for("int4", 4096, 4096).choice(16).backend == "tinygemm"
    with pytest.raises(ValueError, match=r"TOKENFORGE_QUANT_KERNEL=tinygemm cannot run model.layers.0.o "
                                         r"\(int8, 4096x4096, 1 rows\): tinygemm runs int4 only"):
        plan_for("int8", 4096, 4096, name="model.layers.0.o")
    monkeypatch.setenv(envs.QUANT_KERNEL, "marlin")
    with pytest.raises(ValueError, match=r"TOKENFORGE_QUANT_KERNEL='marlin': choose from auto, splitk, qgemv, "
                                         r"tinygemm, dense"):
        plan_for("int4", 4096, 4096)


def test_a_forced_kernel_that_cannot_run_a_shape_fails_before_loading(table, monkeypatch):
    from tokenforge.model.layers.linear import RowParallelLinear  # noqa: PLC0415

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = RowParallelLinear(256, 100, params_dtype=torch.bfloat16)   # 100 rows: not % 8

    table({})
    monkeypatch.setenv(envs.QUANT_KERNEL, "tinygemm")
    model = Tiny()
    with pytest.raises(ValueError, match=r"cannot run proj \(int4, 100x256, 1 rows\): tinygemm needs the output "
                                         r"size divisible by 8 \(got 100\)"):
        before_loading(model, None, QuantOptions(quantization="int4", group_size=128))
    assert model.proj.weight.dtype == torch.bfloat16          # nothing was changed
