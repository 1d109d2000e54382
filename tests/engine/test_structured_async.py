"""Grammar-constrained requests keep async scheduling on (issue 14), on the CPU.

The same mixed batch (constrained and free requests, greedy and seeded) runs with async scheduling
off and on: the token ids must be identical, every constrained output must parse and validate, the
async run must really have deferred the sampling of steps scheduled ahead (not fallen back to
synchronous steps), and no KV block may leak. A tight variant forces preemption and chunked
prefill. (tests/server/test_openai_compat.py covers more schema shapes through the server.)
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tokenforge import LLM, SamplingParams, StructuredOutputsParams

pytest.importorskip("llguidance")

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "colors": {"type": "object", "properties": {"colors": {"type": "array", "minItems": 1, "maxItems": 2,
                                                           "items": {"enum": ["red", "green", "blue"]}}},
               "required": ["colors"], "additionalProperties": False},
    "sentiment": {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                                   "sure": {"type": "boolean"}},
                  "required": ["sentiment"], "additionalProperties": False},
}
FREE_PROMPTS = ["The capital of France is", "1, 2, 3, 4, 5,"]


def _chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def _batch():
    """Constrained (greedy, seeded, a choice that completes early) and free requests, mixed."""
    prompts, params, constrained = [], [], {}
    for name, schema in SCHEMAS.items():
        constrained[len(prompts)] = schema
        prompts.append(_chat(f"Give an example {name} as JSON."))
        params.append(SamplingParams(temperature=0, max_tokens=40,
                                     structured_outputs=StructuredOutputsParams(json=schema)))
    # Seeded random sampling under a grammar: a row's draws depend only on its own generator.
    constrained[len(prompts)] = SCHEMAS["person"]
    prompts.append(_chat("Describe someone as JSON."))
    params.append(SamplingParams(temperature=0.8, seed=5, max_tokens=40,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMAS["person"])))
    # A grammar that completes early while ignore_eos keeps the row sampling (EOS-only masks).
    prompts.append(_chat("Is water wet?"))
    params.append(SamplingParams(temperature=0, max_tokens=CHOICE_TOKENS, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))
    for i, text in enumerate(FREE_PROMPTS):
        prompts.append(text)
        params.append(SamplingParams(temperature=0, max_tokens=6 + 7 * i))
    return prompts, params, constrained


CHOICE_TOKENS = 8
CHOICE_ROW = len(SCHEMAS) + 1


def _generate(llm: LLM, async_scheduling: bool, sampled_late: list[bool]):
    llm.engine.async_scheduling = async_scheduling
    prompts, params, constrained = _batch()
    real_sample = llm.engine.executor.sample

    def spy(handle, sched):
        sampled_late.append(bool(sched.grammar_rows))
        real_sample(handle, sched)

    llm.engine.executor.sample = spy
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del llm.engine.executor.sample
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_kv_blocks, "KV blocks leaked"
    assert stats.num_running == stats.num_waiting == 0 and not llm.engine.has_unfinished_requests()
    assert len(llm.engine.grammars) == 0, "a grammar matcher outlived its request"
    for i, schema in constrained.items():
        out = outs[i].outputs[0]
        assert out.finish_reason == "stop", (i, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert outs[CHOICE_ROW].outputs[0].text in ("yes", "no")
    assert len(outs[CHOICE_ROW].outputs[0].token_ids) == CHOICE_TOKENS
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kwargs", [
    dict(),                                                                   # plenty of room
    dict(num_kv_blocks=16, block_size=8, max_num_batched_tokens=24),          # preemption, chunked prefill
], ids=["roomy", "tight"])
def test_constrained_batch_is_identical_with_async_scheduling_on_and_off(kwargs):
    llm = LLM(max_model_len=512, max_num_seqs=16, enable_prefix_caching=False, async_scheduling=True, **kwargs)
    sync_late: list[bool] = []
    sync_ids = _generate(llm, False, sync_late)
    assert not sync_late, "the synchronous engine has the tokens before it launches: nothing waits"
    async_late: list[bool] = []
    async_ids = _generate(llm, True, async_late)
    assert async_ids == sync_ids
    # Grammar requests no longer turn scheduling ahead off: their masks were filled after launch.
    assert sum(async_late) >= 15 and all(async_late)
    if "num_kv_blocks" in kwargs:
        assert llm.get_stats().num_preemptions > 0


def test_a_deferred_step_must_be_sampled_before_the_next_launch_or_collect():
    """The runner's contract for `launch(defer_sampling=True)`: the next step's placeholders read
    this step's sampled ids, so neither a launch nor a collect may overtake its `sample`."""
    from tokenforge.core.outputs import ScheduledSequence, SchedulerOutput
    from tokenforge.messages import WireSamplingParams

    llm = LLM("tiny-llama", load_format="dummy", device="cpu", max_model_len=256, num_kv_blocks=8)
    runner = llm.engine.executor.runner
    seq = ScheduledSequence("r", [1, 2, 3], 0, [0], True, WireSamplingParams(max_tokens=4, temperature=0.0),
                            [1, 2, 3], [])
    step = runner.launch(SchedulerOutput([seq]), defer_sampling=True)
    assert step.sample_pending and step.sampler_output is None
    with pytest.raises(RuntimeError, match="before the previous one was sampled"):
        runner.launch(SchedulerOutput([seq]))
    with pytest.raises(RuntimeError, match="collected before"):
        runner.collect(step)
    vocab = runner.vocab_size
    width = (vocab + 31) // 32
    first = llm.engine.executor.grammar_bitmask_buffer(1, width)
    second = llm.engine.executor.grammar_bitmask_buffer(1, width)
    assert first.ctypes.data != second.ctypes.data, "two slots, alternating"
    second[:] = 0
    second[0, 7 // 32] = 1 << 7                          # only token 7 is allowed
    runner.sample(step, SchedulerOutput([seq], grammar_rows=[0], grammar_bitmask=second))
    assert runner.collect(step).sampled_token_ids == {"r": [7]}
