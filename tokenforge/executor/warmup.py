"""Start-up warm-up: forwards over the batch shapes serving meets, so their kernels compile (or
load from the engine cache) before the engine is Ready, not on a request's path.

What varies a compiled Triton kernel beyond its constexprs: Triton specialises integer arguments
(== 1, divisible by 16) and pointer alignment, so a prefill of 17 tokens and one of 64 are two
kernels, a chunk over a cached prefix (context > 0) takes the prefix loop, a step that mixes
decodes and a prefill chunk runs both attention kernels in one forward, and uncaptured decode
batches run eagerly. `warm_up_batches` lists one batch of each kind that fits the engine's
limits; `warm_up` runs them over the real KV cache's first blocks (free at start-up; whatever
they hold is overwritten when a sequence is given them) and the LM head over their last rows.
The CUDA graphs captured just before cover their decode buckets; the buckets deferred to idle
time (graph_stages.py) run eagerly until then, so one eager decode batch per kernel variant the
attention backend names for them (`decode_variant`: the split-KV decode's split count) runs too:
a batch of 12 before bucket 16 is captured then compiles nothing. Without graphs
(--enforce-eager) every decode batch is eager: one batch per variant over all sizes.
"""

from __future__ import annotations

import logging
import time

import torch

from tokenforge.kernels.lora import warm_up_lora_kernels
from tokenforge.model.attention.backend import AttentionBatch
from tokenforge.model.forward_context import set_forward_context

logger = logging.getLogger(__name__)


def warm_up_batches(block_size: int, max_tokens: int, max_len: int, max_seqs: int,
                    num_blocks: int) -> list[tuple[list[int], list[int]]]:
    """(query_lens, context_lens) per warm-up batch, all within the token budget, the length
    cap, the sequence cap and the cache."""
    chunk = min(max_tokens, max_len - 1)
    candidates = [
        ([17], [0]), ([64], [0]), ([131], [0]), ([chunk], [0]),          # prefills: odd, aligned, long
        ([33], [48]), ([min(chunk, 256)], [min(max_len // 2, 3 * block_size + 5)]),   # over a prefix
        ([20, 37], [0, 0]),                                                # two prompts in one step
        ([1, 1, 1, 40], [16, 35, 70, 0]),                                  # decodes beside a chunk
        ([1, 1, 24], [7, 130, 64]),                                        # decodes beside a prefix chunk
    ]
    out = []
    for q, c in candidates:
        blocks = sum(-(-(a + b) // block_size) for a, b in zip(q, c))
        if (sum(q) <= max_tokens and len(q) <= max_seqs and all(a + b <= max_len for a, b in zip(q, c))
                and blocks <= num_blocks and (q, c) not in out):
            out.append((q, c))
    return out


def eager_decode_sizes(graphs, max_num_seqs: int) -> list[int]:
    """Decode batch sizes that may run eagerly after start-up: the CUDA graphs' deferred buckets,
    none when every bucket is captured, every size up to max_num_seqs without graphs
    (--enforce-eager, offloaded weights), whose decode kernels would otherwise compile on the
    first request of each split count."""
    if graphs is None:
        return list(range(1, max_num_seqs + 1))
    stages = getattr(graphs, "stages", None)
    return list(stages.pending) if stages is not None else []


def deferred_decode_batches(pending: list[int], variant, max_seqs: int, num_blocks: int,
                            context: int) -> list[tuple[list[int], list[int]]]:
    """One decode batch (`context` cached tokens per sequence, one block each) per distinct
    `variant(batch size)` among the deferred buckets `pending`, the smallest size of each."""
    seen, out = set(), []
    for size in sorted(pending):
        size = min(size, max_seqs)
        key = variant(size)
        if key in seen or size > num_blocks:
            continue
        seen.add(key)
        out.append(([1] * size, [context] * size))
    return out


@torch.inference_mode()
def warm_up(runner, num_blocks: int) -> float:
    """Run the warm-up batches; returns the seconds it took."""
    start = time.perf_counter()
    sched = runner.config.scheduler
    batches = warm_up_batches(runner.block_size, sched.max_num_batched_tokens, sched.max_model_len,
                              sched.max_num_seqs, num_blocks)
    sizes = eager_decode_sizes(getattr(runner, "graphs", None), sched.max_num_seqs)
    variant = getattr(runner.backend, "decode_variant", None)
    if sizes and variant is not None:
        num_kv_heads = runner.kv_caches[0].shape[3]
        batches += deferred_decode_batches(sizes, lambda b: variant(b, num_kv_heads, runner.device),
                                           sched.max_num_seqs, num_blocks, runner.block_size - 1)
    for query_lens, context_lens in batches:
        tables, next_block = [], 0
        for q, c in zip(query_lens, context_lens):
            n = -(-(q + c) // runner.block_size)
            tables.append(list(range(next_block, next_block + n)))
            next_block += n
        batch = AttentionBatch(query_lens, context_lens, tables, runner.block_size, runner.device)
        ids = torch.zeros(sum(query_lens), dtype=torch.long, device=runner.device)
        pos = torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, context_lens)]).to(runner.device)
        # slot 0 (as the memory profile does): the LoRA kernels' variants compile here too, not on
        # the first adapted request (W2 over 8 adapters logged 8 _shrink_kernel compiles after Ready)
        lora = torch.zeros_like(ids) if runner.loras is not None else None
        with set_forward_context(runner.backend.build_metadata(batch), lora):
            hidden = runner.stages.forward(runner.model, ids, pos)
        if hidden is not None:
            ends = torch.tensor(query_lens, device=runner.device).cumsum(0) - 1
            runner.model.compute_logits(hidden[ends])
    if runner.loras is not None:
        # every shrink / expand variant the step sizes can take (SPLITS, BLOCK_M follow T): the
        # forwards above meet only theirs (W2 over 8 adapters compiled 4 more during its run)
        warm_up_lora_kernels([linear.lora for linear in runner.loras.slots.linears.values()],
                             sched.max_num_batched_tokens)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    seconds = time.perf_counter() - start
    logger.info("warm-up: %d batch shapes in %.2f s", len(batches), seconds)
    return seconds
