"""`bench serve --replay-acceptance`: the replay drafter inside a launched server's n-gram method
learns the served greedy path over untimed passes and proposes it back; the same load then runs
without speculation. On the CPU, one prompt at a time (no batch-dependent rounding), acceptance 1
must accept every draft."""

from __future__ import annotations

import json

from tokenforge.cli.main import bench_main as main
from tokenforge.bench.lib.replay import LearningReplay
from tokenforge.bench.serving.serve_spec import without_flags


def test_without_flags_drops_each_speculative_flag_and_its_value():
    words = ["--model", "m", "--speculative-method", "ngram", "--num-speculative-tokens=4", "--ngram-max", "5", "-x"]
    assert without_flags(words, ("--speculative-method", "--num-speculative-tokens", "--ngram-max")) == ["--model", "m", "-x"]


def test_the_learning_replay_proposes_nothing_until_it_has_seen_the_path():
    replay = LearningReplay(1.0, prompt_len=3)
    history = [7, 8, 9]
    for token in (40, 41, 42, 43):            # first pass: the engine emits, the drafter only learns
        history.append(token)
        assert replay(history, 2) == []
    assert replay([7, 8, 9, 40], 3) == [41, 42, 43]          # second pass: the path comes back
    assert replay([5, 8, 9, 40], 3) == []                    # another prompt: nothing known
    assert LearningReplay(0.0, 3)._miss(0) == 1 and LearningReplay(0.0, 3)._miss(9) == 8


def test_served_replay_at_acceptance_one_accepts_every_draft(tmp_path):
    out = tmp_path / "res"
    assert main(["serve", "--launch", "--speculative-method ngram --num-speculative-tokens 3 --max-model-len 512 "
                 "--log-level warning", "--replay-acceptance", "1.0", "--request-rate", "inf", "--num-prompts", "1",
                 "--input-len", "16", "--output-len", "32", "--warm-up-max-burst", "0", "--seed", "3",
                 "--results-dir", str(out)]) == 0
    result = json.loads(next(out.glob("*.json")).read_text())
    stats = result["spec_decode"]
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] == stats["num_draft_tokens"]
    assert result["speculative"]["completed"] == result["no_speculation"]["completed"] == 1
    assert result["speculative"]["output_tokens"] == result["no_speculation"]["output_tokens"] == 32
    assert result["tpot_p50_ratio"] > 0 and result["workload"] == "W4-spec"


def test_replay_acceptance_needs_a_launched_ngram_server(capsys):
    assert main(["serve", "--launch", "--max-model-len 512", "--replay-acceptance", "0.8", "--num-prompts", "1"]) == 2
    assert "give --launch with --speculative-method ngram" in capsys.readouterr().err


def test_stable_dummy_weights_give_the_same_greedy_tokens_in_any_batch(monkeypatch):
    """TOKENFORGE_STABLE_DUMMY (what bench serve --replay-acceptance sets for its servers): greedy
    decoding repeats each prompt's last token, alone or batched with others, in bf16; plain dummy
    weights do not (their tokens are the model's random path)."""
    from tokenforge import LLM, SamplingParams, envs        # noqa: PLC0415

    prompts = [{"prompt_token_ids": [5, 17, 99, 3, 250]}, {"prompt_token_ids": [7, 8, 9]},
               {"prompt_token_ids": list(range(30, 70))}]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def tokens(stable: bool) -> tuple[list, list]:
        monkeypatch.setenv(envs.STABLE_DUMMY, "1" if stable else "0")
        llm = LLM("tiny-llama", load_format="dummy", max_model_len=256, dtype="bfloat16")
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        alone = [llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        llm.shutdown()
        return batched, alone

    batched, alone = tokens(stable=True)
    assert batched == alone == [[p["prompt_token_ids"][-1]] * 12 for p in prompts]
    plain, _ = tokens(stable=False)
    assert plain != batched
