"""tokenforge: LLM inference, serving and training on PyTorch and Triton.

The top-level names are imported lazily, so `tokenforge.core` stays importable without torch.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob", "LoRARequest",
           "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from tokenforge.engine.llm import LLM
        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from tokenforge import sampling_params
        return getattr(sampling_params, name)
    if name in ("RequestOutput", "CompletionOutput", "Logprob", "LoRARequest"):
        from tokenforge import messages
        return getattr(messages, name)
    raise AttributeError(f"module 'tokenforge' has no attribute {name!r}")
