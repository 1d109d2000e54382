"""doctor --gpus: the proposed TP x PP for shipped architectures (shapes only; no weights)."""

from __future__ import annotations

import pytest

from tokenforge.cli import build_parser, engine_kwargs, main
from tokenforge.model.loader import read_arch_config
from tokenforge.planning.layout import plan_layout, valid_tp_sizes

GIB = 2**30


@pytest.mark.parametrize("model,gpus,memory,per_node,expected", [
    ("llama-3.1-8b", 8, 80 * GIB, 8, (1, 1, 8)),       # fits one GPU: 8 replicas
    ("llama-3.1-70b", 2, 141 * GIB, 8, (2, 1, 1)),     # needs both: TP within the host
    ("llama-3.1-70b", 16, 24 * GIB, 8, (8, 1, 2)),     # 8 GPUs per replica, 2 replicas
    ("llama-3.1-70b", 8, 24 * GIB, 2, (2, 4, 1)),      # 2 GPUs per host: TP 2, 4 pipeline stages
])
def test_plan(model, gpus, memory, per_node, expected):
    plan = plan_layout(read_arch_config(model, "dummy"), gpus, memory, "bfloat16", 8192, per_node)
    assert (plan.tp, plan.pp, plan.replicas) == expected
    assert plan.offload_gb == 0 and plan.reasons


def test_plan_that_cannot_fit_names_the_offload():
    plan = plan_layout(read_arch_config("llama-3.1-70b", "dummy"), 2, 24 * GIB, "bfloat16", 8192)
    assert (plan.tp, plan.pp) == (2, 1) and plan.offload_gb > 40
    assert "do not fit even all 2 GPUs" in plan.reasons[0]


def test_tp_sizes_respect_heads():
    arch = read_arch_config(None)        # bundled SmolLM2: 9 heads, 3 KV heads, MLP 1536 (not / 9)
    assert valid_tp_sizes(arch, 9) == [1, 3]


def test_doctor_prints_the_proposal(capsys):
    assert main(["doctor", "--model", "llama-3.1-70b", "--load-format", "dummy", "--memory", "141GB",
                 "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "--tensor-parallel-size 2 --pipeline-parallel-size 1 (1 replica on 2 GPUs)" in out
    assert "because" in out


@pytest.mark.parametrize("argv,tp,pp", [
    (["--num-gpus", "4"], 4, 1),
    (["--num_devices", "4", "--model-sharding-type", "pipe"], 1, 4),
    (["--num_processes", "4", "--sharding_strategy", "pipeline"], 1, 4),
    (["--model_parallelism", "2", "--pipe_parallelism_level", "3"], 2, 3),
    (["--shard-size", "2"], 2, 1),
    (["-tp", "2", "-pp", "2", "--num-gpus", "4"], 2, 2),
])
def test_playbook_aliases(argv, tp, pp):
    kwargs = engine_kwargs(build_parser().parse_args(["generate", "hi", *argv]))
    assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"]) == (tp, pp)


def test_conflicting_num_gpus_is_an_error():
    with pytest.raises(ValueError, match="--num-gpus 3 does not equal"):
        engine_kwargs(build_parser().parse_args(["generate", "hi", "-tp", "2", "--num-gpus", "3"]))


@pytest.mark.parametrize("argv,steps", [
    (["-pp", "2"], 2),                                          # default: one step per stage
    (["-pp", "2", "--pipeline-steps", "3"], 3),
    (["--pipe_parallelism", "4", "--pipeline_steps", "1"], 1),  # one step passes the stages at a time
    ([], 1),
])
def test_pipeline_steps_flag(argv, steps):
    from tokenforge.config import EngineConfig

    kwargs = engine_kwargs(build_parser().parse_args(["generate", "hi", *argv]))
    config = EngineConfig.from_kwargs(device="cpu", pipeline_parallel_size=kwargs["pipeline_parallel_size"],
                                      pipeline_steps=kwargs["pipeline_steps"])
    assert config.scheduler.pipeline_steps == steps


@pytest.mark.parametrize("kwargs,message", [
    ({"pipeline_parallel_size": 2, "pipeline_steps": 0}, "pipeline_steps must be an integer >= 1, got 0"),
    ({"pipeline_steps": 2}, "pipeline_steps 2 keeps several steps in flight .* needs pipeline_parallel_size > 1"),
])
def test_bad_pipeline_steps_are_refused(kwargs, message):
    from tokenforge.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(device="cpu", **kwargs)
