"""Session fixtures shared across test packages."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def hf_gguf_model():
    """HF transformers' own load of the bundled GGUF (float32, eval). Dequantizing the GGUF in
    Python takes ~15 s, so the engine and model tests share this one copy; none of them mutates it."""
    import torch
    from transformers import AutoModelForCausalLM

    from tokenforge.model.loader import find_bundled_gguf

    gguf = find_bundled_gguf()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model.eval()
