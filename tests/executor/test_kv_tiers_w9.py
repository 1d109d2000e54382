"""W9 in miniature on the CPU (`tokenforge bench tiers` scaled down): prefix groups x rounds, all
submitted at once, each round in a new random group order, a device pool that holds about a
quarter of the prefixes and a CPU tier that holds them all. Every prefix is computed once: the
other requests restore it (or hit it on the device), and the greedy outputs equal the device
prefix cache's alone."""

from __future__ import annotations

from tokenforge import LLM, SamplingParams
from tokenforge.bench.lib import workloads

GROUPS, ROUNDS, PREFIX, SUFFIX, OUT, BS = 12, 3, 64, 16, 2, 16


def run(llm: LLM, prompts, tiers_on: bool, salt: str):
    llm.engine.set_kv_tiers_enabled(tiers_on)
    before = llm.get_stats()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=OUT, ignore_eos=True, temperature=0.0, cache_salt=salt),
                        use_tqdm=False)
    after = llm.get_stats()
    restored = after.kv_tiers.restored_tokens - before.kv_tiers.restored_tokens
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    puts = after.kv_tiers.puts.get("cpu", 0) - before.kv_tiers.puts.get("cpu", 0)
    return [list(o.outputs[0].token_ids) for o in outs], restored, hits, puts, after


def test_w9_miniature_restores_every_repeated_prefix():
    prompts = workloads.shuffled_group_prompts(GROUPS, ROUNDS, PREFIX, SUFFIX, 512, 0)
    num_blocks = GROUPS // 4 * (PREFIX + SUFFIX + OUT) // BS + 4    # ~4 of the 16 requests at once
    llm = LLM("tiny-llama", load_format="dummy", device="cpu", max_model_len=PREFIX + SUFFIX + OUT,
              num_kv_blocks=num_blocks, block_size=BS, max_num_batched_tokens=2 * PREFIX,
              kv_offload_cpu_gb=0.05, async_scheduling=True)
    dev_ids, dev_restored, dev_hits, dev_puts, _ = run(llm, prompts, False, "device")
    tier_ids, restored, hits, puts, stats = run(llm, prompts, True, "tier")
    ideal = GROUPS * (ROUNDS - 1) * PREFIX          # every request after its group's first
    assert dev_restored == 0 and dev_puts == 0
    assert dev_hits < 0.25 * ideal                  # the device alone recomputes most prefixes
    assert restored + hits >= 0.95 * ideal, (restored, hits, ideal)
    assert restored >= 0.75 * ideal
    # Each prefix block is put once (plus each request's own blocks), never once per request.
    assert puts <= GROUPS * PREFIX // BS + len(prompts) * (SUFFIX + OUT) // BS + num_blocks
    assert tier_ids == dev_ids
    assert stats.num_free_blocks == num_blocks and not stats.kv_tiers.dropped_puts
    llm.shutdown()
