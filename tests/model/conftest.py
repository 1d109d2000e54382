"""Fixtures for model tests: a tiny paged-KV driver (what the model runner does, minus scheduling)
and the float32 quality baseline shared by the int8 and fp8-KV checks (the HF reference model is
tests/conftest.py's `hf_gguf_model`)."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tokenforge.model.attention import AttentionBatch, TorchAttentionBackend
from tokenforge.model.forward_context import set_forward_context


class PagedDriver:
    """Feeds chunks of sequences through a model with a paged KV cache and a block table per sequence.

    Blocks are handed out in shuffled order so block tables are not the identity.
    """

    def __init__(self, model: torch.nn.Module, block_size: int = 4, num_blocks: int = 256, seed: int = 0,
                 backend=None) -> None:
        self.model, self.block_size = model, block_size
        self.backend = backend or TorchAttentionBackend()
        cfg = model.config
        dtype, self.device = next(model.parameters()).dtype, next(model.parameters()).device
        for layer in model.attention_layers():
            shape = self.backend.kv_cache_shape(num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
            layer.kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)
            layer.backend = self.backend
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    @torch.inference_mode()
    def step(self, chunks: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """chunks: (seq_id, new token ids). Returns per chunk its logits [len, V] (fp32)."""
        ids, positions, batch = self.prepare(chunks)
        metadata = self.backend.build_metadata(batch)
        with set_forward_context(metadata):
            hidden = self.model(ids, positions)
        logits = self.model.compute_logits(hidden).float()
        return list(logits.split(batch.query_lens))

    def prepare(self, chunks: list[tuple[str, list[int]]]) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """The step's (input_ids [T], positions [T], AttentionBatch), blocks allocated as needed."""
        ids, positions, q_lens, ctx_lens, tables = [], [], [], [], []
        for seq_id, tokens in chunks:
            ctx = self.lens.get(seq_id, 0)
            table = self.tables.setdefault(seq_id, [])
            while len(table) * self.block_size < ctx + len(tokens):
                table.append(self.free.pop())
            ids += tokens
            positions += range(ctx, ctx + len(tokens))
            q_lens.append(len(tokens))
            ctx_lens.append(ctx)
            tables.append(list(table))
            self.lens[seq_id] = ctx + len(tokens)
        batch = AttentionBatch(q_lens, ctx_lens, tables, self.block_size, self.device)
        return torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device), batch


@pytest.fixture
def paged_driver():
    return PagedDriver


@pytest.fixture(scope="session")
def bundled_gguf():
    from tokenforge.model.loader import find_bundled_gguf

    return find_bundled_gguf()


QUALITY_TEXT = Path(__file__).resolve().parents[1] / "data" / "quality_text.txt"
QUALITY_WINDOW, QUALITY_STRIDE = 256, 128


def quality_float32_llm():
    """The float32 engine of the quality checks."""
    from tokenforge import LLM

    return LLM(dtype="float32", num_kv_blocks=128, max_model_len=512)


def _quality_float32() -> dict:
    from tokenforge.eval.perplexity import perplexity

    llm = quality_float32_llm()
    ids = llm.tokenizer.encode(QUALITY_TEXT.read_text(encoding="utf-8"))[:1500]
    result = {"ids": ids, "perplexity": perplexity(llm, ids, QUALITY_WINDOW, QUALITY_STRIDE).perplexity}
    llm.shutdown()
    return result


@pytest.fixture(scope="session")
def quality_float32(once_per_run):
    """The float32 baseline of the int8 and fp8-KV quality checks: the first 1,500 tokens of the
    quality text and their sliding-window perplexity (windows of 256, stride 128) by
    `quality_float32_llm()`. ~10 s of a core: computed once per run, whichever worker asks first."""
    return SimpleNamespace(**once_per_run("quality-float32", _quality_float32))
