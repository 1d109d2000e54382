"""The kernel table the quant sweep derives from its rows (bench/kernels/quant_sweep.py): the
fastest backend per M, int4's split-K configs on one layout tile per shape, wrong results left
out, and the table loads into a kernel plan."""

import json

from tokenforge import envs
from tokenforge.bench.kernels.quant_sweep import MS, table_from
from tokenforge.model.quant import kernel_plan


def _row(kind, m, backend, us, cfg=None, err=0.0):
    return {"model": "8b", "shape": "o", "M": m, "kind": kind, "backend": backend, "us": us, "frac_of_read_bw": 0.5,
            "config": cfg, "a8": False, "err": err}


def test_table_picks_per_m_with_one_int4_tile(tmp_path, monkeypatch):
    a, b = [64, 512, 4, True, 4, 1], [64, 1024, 2, True, 4, 3]
    rows = []
    for m in MS:
        rows += [_row("int4", m, "tinygemm", 10.0 if m == 1 else 30.0), _row("int4", m, "dense", 20.0),
                 _row("int4", m, "splitk", 12.0, a), _row("int4", m, "splitk", 11.0 if m == 1 else 13.0, b),
                 _row("int8", m, "splitk", 1.0, [64, 256, 1, True, 4, 1], err=0.5),     # wrong: never chosen
                 _row("int8", m, "dense", 25.0)]
    entries = table_from(rows)
    int4 = entries["int4:4096x4096:g128"]
    assert int4["tile"] == 512                    # 10 + 3 * 12 beats 10 + 3 * 13
    assert int4["rows"] == {"1": ["tinygemm"], "4": ["splitk", a, False], "8": ["splitk", a, False],
                            "16": ["splitk", a, False]}
    assert entries["int8:4096x4096"]["rows"]["1"] == ["dense"]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"entries": entries}))
    monkeypatch.setenv(envs.QUANT_TABLE, str(path))
    monkeypatch.delenv(envs.QUANT_KERNEL, raising=False)
    kernel_plan._table.cache_clear()
    try:
        plan = kernel_plan.plan_for("int4", 4096, 4096, 128)
        assert plan.tile == 512 and plan.choice(1).backend == "tinygemm" and plan.choice(3).config.block_k == 512
    finally:
        kernel_plan._table.cache_clear()
