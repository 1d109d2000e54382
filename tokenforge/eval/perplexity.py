"""Sliding-window perplexity of a text through the engine (`tokenforge eval perplexity`).

In: a text, an `LLM` built with the engine flags under test, a window and a stride. Out:
`PerplexityResult` (perplexity, NLL, how many tokens were scored).

The recipe is the standard one (HF transformers, "Perplexity of fixed-length models"): windows
of `window` tokens start every `stride` tokens; each window scores only the tokens that no
earlier window scored, so every token after the first is scored exactly once, with between
window - stride and window - 1 tokens of context. The first token of the text has no context
and is never scored. Perplexity = exp(sum of NLL / tokens scored). (HF's page weights each
window's mean loss by its label count minus one; here every scored token counts once, exactly.)

The windows are ordinary requests: prompt = the window, `prompt_logprobs=0` (the log-probability
of each prompt token given the ones before it, computed in float32 from the logits), one output
token. So quantization, the KV cache dtype and chunked prefill all act as they do in serving.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

from tokenforge.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Window:
    begin: int      # first token of the window (absolute)
    end: int        # one past its last token
    first: int      # first token it scores (absolute); tokens first .. end-1 are scored


@dataclass(slots=True)
class PerplexityResult:
    perplexity: float
    nll: float              # mean negative log-likelihood per scored token (nats)
    tokens: int             # tokens in the text
    scored_tokens: int
    windows: int
    window: int
    stride: int
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def check_window(window: int, stride: int) -> None:
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if stride < 1:
        raise ValueError(f"stride must be at least 1 token, got {stride}")
    if stride >= window:
        raise ValueError(f"stride ({stride}) must be smaller than the window ({window}): otherwise the windows do "
                         "not overlap and the first tokens of each window are scored without context")


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """The recipe's windows over a text of num_tokens tokens."""
    check_window(window, stride)
    if num_tokens < 2:
        raise ValueError(f"the text must have at least 2 tokens to score one, got {num_tokens}")
    out, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        out.append(Window(begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == num_tokens:
            break
    return out


def window_nll(llm, token_ids: list[int], windows: list[Window]) -> tuple[float, int]:
    """(sum of NLL over the scored tokens, how many) with every window submitted at once."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": token_ids[w.begin:w.end]} for w in windows], params, use_tqdm=False)
    total, count = 0.0, 0
    for w, out in zip(windows, outs, strict=True):
        logprobs = out.prompt_logprobs      # [window length]; entry j: log p(token j | tokens < j)
        for j in range(w.first - w.begin, w.end - w.begin):
            total -= logprobs[j][token_ids[w.begin + j]].logprob
            count += 1
    return total, count


def perplexity(llm, token_ids: list[int], window: int = 512, stride: int = 256) -> PerplexityResult:
    windows = sliding_windows(len(token_ids), window, stride)
    limit = llm.runtime.max_model_len
    if window > limit - 1 and len(token_ids) > limit - 1:
        raise ValueError(f"window {window} does not fit the engine's max_model_len {limit} (a window and one "
                         "generated token): lower --window or raise --max-model-len")
    start = time.perf_counter()
    total, count = window_nll(llm, token_ids, windows)
    nll = total / count
    return PerplexityResult(math.exp(nll), nll, len(token_ids), count, len(windows), window, stride,
                            time.perf_counter() - start)


def text_token_ids(llm, text: str) -> list[int]:
    """The text as the engine's tokenizer encodes a prompt (no chat template)."""
    return list(llm.tokenizer.encode(text))
