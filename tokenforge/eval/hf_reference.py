"""HF transformers' sliding-window perplexity on the same token ids (`eval perplexity --compare-hf`).

In: the engine's model argument (None = the bundled GGUF, a .gguf file or an HF directory), the
token ids and the windows of perplexity.sliding_windows. Out: the perplexity HF transformers gives
in float32, scoring exactly the tokens tokenforge scores, so the two figures differ only by the
models' arithmetic.
"""

from __future__ import annotations

import math
from pathlib import Path

from tokenforge.eval.perplexity import Window


def load_hf_model(model: str | None):
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from tokenforge.model.loader import find_bundled_gguf  # noqa: PLC0415

    path = Path(model) if model else find_bundled_gguf()
    if path.suffix == ".gguf":
        net = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    elif path.is_dir():
        net = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    else:
        raise ValueError(f"--compare-hf needs the bundled model, a .gguf file or an HF directory, got {model!r}")
    return net.eval()


def hf_perplexity(net, token_ids: list[int], windows: list[Window]) -> float:
    import torch  # noqa: PLC0415

    total, count = 0.0, 0
    with torch.inference_mode():
        for w in windows:
            ids = torch.tensor([token_ids[w.begin:w.end]])
            logprobs = torch.log_softmax(net(ids).logits[0].float(), dim=-1)    # [L, V]; row j predicts j+1
            targets = ids[0, 1:]
            nll = -logprobs[:-1].gather(1, targets[:, None])[:, 0]              # nll[j-1] scores token j
            scored = nll[w.first - w.begin - 1:]
            total += scored.double().sum().item()
            count += scored.numel()
    return math.exp(total / count)
