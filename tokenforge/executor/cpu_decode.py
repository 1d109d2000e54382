"""The CPU's captured decode step: a GGUF-native model's decode steps as one native call each.

What CUDA graphs are to the GPU runner (cuda_graph.py: `can_run` / `run` / `release`, chosen once
at start-up): decode-only steps of up to `MAX_ROWS` sequences skip the per-op forward, whose ~300
small torch ops and ctypes calls a token cost more than its matmuls at batch 1, and run
model/native_decode.py's step instead. Prefill and mixed steps, and larger decode batches, keep
the model's forward; so does every step
under `--enforce-eager`, which keeps the per-op path as on the GPU it keeps eager steps.

Speculative verify steps (a sequence's last token and its drafts) run there too, as decode rows:
the native step stores every row's KV before any row of the layer attends, so a draft's row sees
the rows before it as a causal prefill would.

In: a decode-only InputBatch, or a verify batch whose rows are decodes. Out: the final-normed hidden states [B, H], as the forward gives.
"""

from __future__ import annotations

import logging

import torch

from tokenforge.executor.cuda_graph import decode_rows
from tokenforge.model.native_decode import MAX_ROWS, NativeDecoder

logger = logging.getLogger(__name__)


class CpuDecodeRunner:
    def __init__(self, decoder: NativeDecoder) -> None:
        self.decoder = decoder

    @classmethod
    def for_runner(cls, runner) -> CpuDecodeRunner | None:
        """The native decode step when the runner's model qualifies (after its KV cache exists)."""
        if (runner.device.type != "cpu" or runner.config.device.enforce_eager or runner.loras is not None
                or runner.offloader is not None or runner.rank.tp_size > 1 or runner.rank.pp_size > 1
                or runner.drafter.reads_layer_states):     # EAGLE-3 reads inner layers' states
            return None
        decoder, why = NativeDecoder.of(runner.model)
        if decoder is None:
            if any(hasattr(m, "gguf_weight") for m in runner.model.modules()):
                logger.info("GGUF decode steps run per op (%s)", why)
            return None
        logger.info("GGUF decode steps of up to %d sequences run as one native call", MAX_ROWS)
        return cls(decoder)

    def can_run(self, inputs) -> bool:
        """A decode step, or a speculative verify step as decode rows (each row a decode whose
        context is the rows before it, as cuda_graph.decode_rows lays it out), of up to MAX_ROWS rows."""
        return inputs.rows_are_decodes and inputs.num_tokens <= MAX_ROWS

    def capture_next(self) -> bool:
        """Nothing to capture later (the CUDA graph runner's deferred buckets): the native step is
        ready once built."""
        return False

    def counts(self) -> tuple[int, int]:
        return 0, 0

    def run(self, inputs) -> torch.Tensor:
        batch = inputs.attn_batch if inputs.is_decode_only else decode_rows(inputs.attn_batch)
        return self.decoder.forward(inputs.input_ids, batch)

    def release(self) -> None:
        self.decoder = None
