"""The HF transformers peer, run in the same process as tokenforge's figures.

In: token-id prompts, a forced output length and a batch size. Out: the generated ids and the
seconds of `generate` on padded batches (left padding, attention mask), eager and, on the GPU,
with `cache_implementation="static"`; the best variant is the baseline. The model is built from
the same config.json with random weights, or loaded from the bundled GGUF for real weights.
Lengths are forced: EOS is disabled and `min_new_tokens == max_new_tokens`.
"""

from __future__ import annotations

import time

import torch

from tokenforge.bench.lib import harness
from tokenforge.source import find_bundled_gguf

def bundled_gguf() -> tuple[str, str]:
    """(directory, file name) of the bundled SmolLM2 GGUF (tokenforge/source.py finds it)."""
    path = find_bundled_gguf()
    return str(path.parent), path.name


def load_bundled(dtype: torch.dtype = torch.float32):
    """HF's own reading of the bundled GGUF (the reference tokenforge must match)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    folder, name = bundled_gguf()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).to(dtype)
    print(f"hf: loaded {name} in {time.perf_counter() - t0:.1f} s", flush=True)
    return _forced_length(model.eval())


def build_from_config(cfg: dict, dtype: torch.dtype, device: str, seed: int = 0):
    """A model of the config's architecture with random weights, built directly on `device`."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: PLC0415

    values = {k: v for k, v in cfg.items() if k not in ("model_type", "torch_dtype", "dtype")}
    config = CONFIG_MAPPING[cfg["model_type"]](**values)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    print(f"hf: built {cfg['model_type']} with random weights in {time.perf_counter() - t0:.1f} s", flush=True)
    return _forced_length(model.eval())


def _forced_length(model):
    gc_ = model.generation_config
    gc_.eos_token_id = None      # with min_new_tokens == max_new_tokens, every row runs to the end
    gc_.do_sample = False
    gc_.temperature = gc_.top_p = gc_.top_k = None
    return model


@torch.inference_mode()
def quantize_dynamic_int8(model, module_suffixes: tuple[str, ...]):
    """A copy of an HF model with the named nn.Linear modules dynamically quantized to int8."""
    import copy  # noqa: PLC0415

    names = {name for name, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in module_suffixes}
    spec = {name: torch.ao.quantization.default_dynamic_qconfig for name in names}
    return torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), qconfig_spec=spec, dtype=torch.qint8)


def perplexity(model, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:] given what precedes each."""
    x = torch.tensor([ids], device=model.device)                              # [1, n]
    logits = model(input_ids=x).logits[0, :-1].float()                         # [n - 1, vocab]
    nll = torch.nn.functional.cross_entropy(logits, x[0, 1:])
    return float(torch.exp(nll))


def _left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)   # [batch, width]
    mask = torch.zeros((len(prompts), width), dtype=torch.long)         # [batch, width]
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], output_len: int, cache: str | None,
                   pad_id: int = 0) -> list[list[int]]:
    ids, mask = _left_pad(prompts, pad_id, model.device)
    extra = {"cache_implementation": cache} if cache else {}
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                         min_new_tokens=output_len, pad_token_id=pad_id, do_sample=False, **extra)
    new = out[:, ids.shape[1]:]                                           # [batch, output_len]
    if new.shape[1] != output_len:
        raise AssertionError(f"hf generated {new.shape[1]} tokens, forced {output_len}")
    return new.tolist()


def generate_all(model, prompts: list[list[int]], output_len: int, batch_size: int,
                 cache: str | None = None) -> tuple[list[list[int]], float]:
    """Padded batches of `batch_size` in order; returns the new ids and the total seconds."""
    outs: list[list[int]] = []
    harness.sync()
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        outs += generate_batch(model, prompts[i:i + batch_size], output_len, cache)
    harness.sync()
    return outs, time.perf_counter() - t0


def run_baseline(model, prompts: list[list[int]], output_len: int, batch_size: int,
                 variants: list[str | None] | None = None) -> dict:
    """Time each variant (eager = None, "static") after a short warm-up; the best is the baseline."""
    if variants is None:
        variants = [None, "static"] if torch.cuda.is_available() else [None]
    results = {}
    for cache in variants:
        name = f"hf-{cache or 'eager'}-bs{batch_size}"
        # Warm-up. A static cache compiles for its exact shapes, so it warms up on the first real
        # batch; eager needs only the allocator and kernels warm, which a short batch does.
        if cache == "static":
            generate_batch(model, prompts[:batch_size], output_len, cache)
        else:
            generate_batch(model, [p[:16] for p in prompts[:2]], 2, cache)
        ids, seconds = generate_all(model, prompts, output_len, batch_size, cache)
        n_out = len(prompts) * output_len
        n_in = sum(len(p) for p in prompts)
        results[name] = {"output_tok_s": n_out / seconds, "total_tok_s": (n_out + n_in) / seconds,
                         "seconds": seconds, "num_prompts": len(prompts), "batch_size": batch_size}
        print(f"{name}: {seconds:.2f} s, {n_out / seconds:,.1f} output tok/s", flush=True)
        results[name]["_ids"] = ids
    best = max(results, key=lambda k: results[k]["output_tok_s"])
    return {"name": best, **{k: v for k, v in results[best].items() if k != "_ids"},
            "variants": {k: {m: x for m, x in v.items() if m != "_ids"} for k, v in results.items()},
            "_ids": results[best]["_ids"]}


def baseline_from_config(cfg: dict, dtype: str, prompts: list[list[int]], output_len: int,
                         batch_size: int, seed: int = 0, variants: list[str | None] | None = None) -> dict:
    """Build, time and free the HF model of a dummy-weights bench (run before tokenforge's engine
    takes the GPU memory)."""
    model = build_from_config(cfg, getattr(torch, dtype), harness.device(), seed)
    try:
        result = run_baseline(model, prompts, output_len, batch_size, variants)
    except torch.OutOfMemoryError as e:   # a peer that does not fit is a finding, not a crash
        print(f"hf: out of memory at batch size {batch_size}: {e}", flush=True)
        result = {"name": f"hf-bs{batch_size}", "output_tok_s": None, "error": "out of memory"}
    finally:
        del model
        harness.release_memory()
    result.pop("_ids", None)
    return result
