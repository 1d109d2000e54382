"""Mixture-of-experts models under tensor parallelism on the CPU (gloo): each rank holding a slice
of every expert (TP=2), or whole experts (--enable-expert-parallel), gives TP=1's greedy tokens and
logprobs on tiny random Mixtral, Qwen2-MoE (shared experts), Qwen3-MoE and gpt-oss checkpoints
(float and MXFP4 experts). Bad expert layouts fail in one line before any process starts."""

from __future__ import annotations

import json
import multiprocessing

import pytest

from tests.distributed.conftest import ENGINE
from tests.model import moe_checkpoints
from tokenforge import LLM, SamplingParams

BUILDERS = {"mixtral": moe_checkpoints.mixtral, "qwen2_moe": moe_checkpoints.qwen2_moe, "qwen3_moe": moe_checkpoints.qwen3_moe,
            "gpt_oss": moe_checkpoints.gpt_oss, "gpt_oss_mxfp4": moe_checkpoints.gpt_oss_mxfp4}
PROMPTS = [list(range(7, 27)), [5, 90, 17, 200, 3, 41, 41, 8, 120]]
SETTINGS = {**ENGINE, "block_size": 4, "max_model_len": 128}


def _run(path, **layout) -> dict:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    with LLM(str(path), **SETTINGS, **layout) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_kv_blocks
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [[{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs] for o in outs]}


@pytest.fixture(scope="module", params=list(BUILDERS))
def model_and_tp1(request, tmp_path_factory):
    _, path = BUILDERS[request.param](tmp_path_factory.mktemp(request.param))
    return path, _run(path)


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2},
                                    {"tensor_parallel_size": 2, "enable_expert_parallel": True}], ids=["tp2", "ep2"])
def test_sharded_experts_match_tp1(model_and_tp1, layout):
    path, tp1 = model_and_tp1
    got = _run(path, **layout)
    assert got["tokens"] == tp1["tokens"]
    for seq_a, seq_b in zip(got["logprobs"], tp1["logprobs"]):
        for a, b in zip(seq_a, seq_b):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a), (a, b)
    assert not multiprocessing.active_children()


def _config(tmp_path, builder_config, **changes):
    cfg = {**builder_config.to_dict(), **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _qwen3_moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=64, intermediate_size=112, moe_intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                          num_experts_per_tok=2, vocab_size=331)


@pytest.mark.parametrize("changes,layout,message", [
    ({"moe_intermediate_size": 51}, {"tensor_parallel_size": 2},
     "tensor_parallel_size 2 does not divide the experts' intermediate size 51 (it must be one of 1, 3, 17, 51); "
     "or add --enable-expert-parallel"),
    ({"num_local_experts": 2, "num_experts_per_tok": 1}, {"tensor_parallel_size": 4, "enable_expert_parallel": True},
     "--enable-expert-parallel with 4 ranks needs at least as many experts; the model has 2"),
    ({"num_experts_per_tok": 9}, {},
     "num_experts_per_tok 9 must be between 1 and the number of experts (8)"),
], ids=["tp-split", "ep-ranks", "top-k"])
def test_bad_expert_layouts_fail_before_any_process_starts(tmp_path, changes, layout, message):
    path = _config(tmp_path, _qwen3_moe_config(), **changes)
    with pytest.raises(ValueError) as info:
        LLM(path, load_format="dummy", **ENGINE, **layout)
    assert str(info.value) == message
    assert not multiprocessing.active_children()


def test_mxfp4_slices_must_hold_whole_groups(tmp_path):
    cfg = moe_checkpoints.gpt_oss_config()
    path = _config(tmp_path, cfg, quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(ValueError) as info:
        LLM(path, load_format="dummy", **ENGINE, tensor_parallel_size=4)
    assert str(info.value) == ("tensor_parallel_size 4 splits the MXFP4 experts' intermediate size 64 into slices "
                               "of 16, not whole groups of 32; use a smaller tensor_parallel_size or "
                               "--enable-expert-parallel")


def test_expert_parallel_needs_experts():
    with pytest.raises(ValueError, match="enable_expert_parallel applies to mixture-of-experts models; "
                                         "LlamaForCausalLM has no experts"):
        LLM(**ENGINE, tensor_parallel_size=1, enable_expert_parallel=True)
