"""Train -> serve: the output directory of `tokenforge train --lora-rank N --lora-export adapter` is a
PEFT adapter over the base weights beside it. The engine loads the directory as its base model
(the adapter file is not mistaken for weights) and as a LoRA adapter, without conversion, and the
adapter's logits equal HF PEFT's loading of the same directory."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from tests.train.test_train_cpu import _cfg
from tokenforge.train.trainer import train

pytestmark = pytest.mark.slow
peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def trained_dir(module_run_root, data_dir, tokenizer, bundled_model):
    result = train(_cfg(data_dir, module_run_root / "lora", max_steps=2, lora_rank=4, lora_export="adapter", lr=5e-2),
                   tokenizer, model=copy.deepcopy(bundled_model))
    return result.final_dir


def test_trained_adapter_matches_hf_peft(trained_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from tokenforge.model.forward_context import set_forward_context
    from tokenforge.model.loader import load_model
    from tokenforge.model.loader.peft import read_peft_adapter
    from tokenforge.model.lora import ModelLoRASlots

    tokens = [1, 504, 3458, 314, 4649, 28, 253, 9370, 30, 216]
    for name in ("config.json", "model.safetensors"):      # the base alone: HF would load the adapter beside it
        shutil.copy(trained_dir / name, tmp_path / name)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        bare = hf(torch.tensor([tokens])).logits[0]
        tuned = peft.PeftModel.from_pretrained(hf, trained_dir).eval()
        expected = tuned(torch.tensor([tokens])).logits[0]
    model = load_model(str(trained_dir), "auto", torch.float32, "cpu").model
    ModelLoRASlots(model, 1, 8).write(0, read_peft_adapter(trained_dir, "trained", 8))
    with torch.no_grad(), set_forward_context(None, lora_indices=torch.zeros(len(tokens), dtype=torch.long)):
        ours = model.compute_logits(model(torch.tensor(tokens), torch.arange(len(tokens))))
    assert (expected - bare).abs().max() > 1e-3              # training moved the adapter off B = 0
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=1e-4)


def test_engine_serves_the_train_output_as_base_and_adapter(trained_dir):
    from tokenforge import LLM, LoRARequest, SamplingParams

    llm = LLM(str(trained_dir), enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    base = llm.generate(["The cat sat on"], params, use_tqdm=False)[0]
    tuned = llm.generate(["The cat sat on"], params, use_tqdm=False,
                         lora_request=LoRARequest("trained", 1, str(trained_dir)))[0]
    assert len(base.outputs[0].token_ids) == len(tuned.outputs[0].token_ids) == 6
    stats = llm.get_stats()
    assert stats.lora_swaps == 1 and stats.num_free_blocks == stats.num_kv_blocks
    llm.shutdown()
