"""`tokenforge bench cpu`: W6, the bundled SmolLM2-135M on the CPU against HF transformers and
llama.cpp.

In: 32 prompts of random token ids (lengths 8-200, fixed seed), 64 greedy output tokens, forced.
Out, all from one run: tokenforge fp32 output tok/s; HF's best of sequential batch-1 `generate`
and one left-padded batch; the float32 ratio (`ratio_float32`); how many tokenforge outputs equal HF's sequential ones
token for token; then the bf16 path of both (HF padded), its ratio, and the perplexity change of
bf16 against fp32 on a fixed text (from tokenforge's prompt logprobs). For a GGUF model, the
`gguf` section: tokenforge computing the blocks as stored (`--dtype auto`) and llama.cpp
(llama-cpp-python, the `bench` extra) on the same file, prompts and threads, one prompt after
another (batch 1) and all prompts as parallel sequences, with the ratios.

The headline `ratio` is W6 as the issue defines it: the CPU default path for the model (the
blocks as stored for a GGUF file, `gguf.parallel`: all 32 prompts at once; float32 otherwise)
against HF's best configuration measured in the run (the fastest of fp32 sequential, fp32
padded, int8 padded and bf16 padded), named in `hf_best`.
"""

from __future__ import annotations

import argparse
import math

import torch

from tokenforge.bench.lib import ceilings, harness, hf_baseline, llama_cpp_peer, report, workloads

# The modules tokenforge's dynamic int8 quantizes (model/quant/cpu_int8.py), by HF's names.
INT8_MODULES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")

# A fixed English passage for the perplexity check (written for this bench).
PERPLEXITY_TEXT = (
    "The harbour town woke slowly on winter mornings. Fishing boats left before dawn, and by the "
    "time the bakery opened its shutters the quay was already wet with melted frost and spilled "
    "seawater. Children walked to school along the sea wall, counting the gulls that stood in a row "
    "on the railings, while their parents argued about the price of fuel and the weather forecast. "
    "In the afternoon the wind turned, the tide came in, and the small library near the church "
    "filled with students who had come to read about history, chemistry and the stars. When the "
    "lamps were lit in the evening, the boats returned one by one, and the town listened to the "
    "engines and the waves until everyone fell asleep."
)


ENGINE_FLAGS = True     # cli/bench.py adds the engine flags


def add_args(p: argparse.ArgumentParser) -> None:
    harness.add_common_args(p, model=None, dtype="float32", num_prompts=32, input_len=0,
                            output_len=64, repeats=2)
    p.add_argument("--min-input", type=int, default=8)
    p.add_argument("--max-input", type=int, default=200)
    p.add_argument("--no-bf16", action="store_true", help="skip the bf16 path")
    p.add_argument("--no-int8", action="store_true", help="skip the dynamic int8 path")
    p.add_argument("--no-sequential", action="store_true", help="skip HF's sequential batch-1 run")
    p.add_argument("--no-gguf", action="store_true",
                   help="skip the GGUF section (tokenforge native blocks and llama.cpp, batch 1 and parallel)")
    p.add_argument("--gguf-only", action="store_true",
                   help="only the GGUF section (tokenforge native vs llama.cpp): no float32, HF, int8 or bf16 runs")
    p.add_argument("--gguf-shapes", default="batch1,parallel",
                   help="the GGUF section's shapes, comma-separated: batch1 (one prompt after another), parallel")
    p.add_argument("--llama-cpp-extra-bufts", action="store_true",
                   help="let llama.cpp use its repacked / AMX weight buffers (off: its AMX matmul crashes on "
                        "some VMs that report AMX)")


def perplexity_ids(llm, vocab: int, seed: int) -> list[int]:
    tok = getattr(llm, "tokenizer", None)
    try:
        ids = list(tok.encode(PERPLEXITY_TEXT, add_special_tokens=False))
    except (AttributeError, TypeError, ValueError):
        ids = []
    if len(ids) < 2 or max(ids) >= vocab:   # a dummy model's tokenizer may not fit its vocabulary:
        ids = workloads.random_prompts(1, 160, vocab, seed + 7)[0]   # random ids still compare dtypes
    return ids


def tokenforge_perplexity(llm, ids: list[int]) -> float | None:
    from tokenforge import SamplingParams  # noqa: PLC0415

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    if not out.prompt_logprobs:
        return None
    lps = [d[t].logprob for t, d in zip(ids[1:], out.prompt_logprobs[1:])]
    return math.exp(-sum(lps) / len(lps))


def measure_tokenforge(args: argparse.Namespace, dtype: str, prompts: list[list[int]] | None,
                       quantization: str | None = None, **overrides) -> dict:
    """Build the engine in `dtype`, make the prompts if needed, check, time, and measure perplexity."""
    llm = harness.build_llm(args, dtype=dtype, quantization=quantization, **overrides)
    vocab = harness.vocab_size(llm, args.model)
    if prompts is None:
        prompts = workloads.random_prompts(args.num_prompts, (args.min_input, args.max_input), vocab, args.seed)
    timing, outs = harness.run_checked(llm, prompts, args.output_len, args.repeats,
                                       f"tokenforge-{quantization or dtype}")
    ppl_ids = perplexity_ids(llm, vocab, args.seed)
    ppl = tokenforge_perplexity(llm, ppl_ids)
    harness.shutdown(llm)
    n_in = sum(len(p) for p in prompts) / len(prompts)
    figures = {**harness.rates(len(prompts), n_in, args.output_len, timing.median), **timing.summary(),
               "perplexity": ppl}
    return {"figures": figures, "ids": harness.token_ids(outs), "prompts": prompts, "ppl_ids": ppl_ids}


def load_hf(args: argparse.Namespace):
    cfg = workloads.load_config_dict(args.model)
    if args.model is None:
        return hf_baseline.load_bundled(torch.float32), True
    if cfg is None:
        raise SystemExit(f"no HF baseline for {args.model!r}: give a config or use --no-baseline")
    return hf_baseline.build_from_config(cfg, torch.float32, "cpu", args.seed), False


def hf_best(model, prompts: list[list[int]], args: argparse.Namespace, sequential: bool) -> dict:
    """HF's best of a left-padded batch of all prompts and (optionally) one prompt at a time."""
    runs = {}
    if sequential:
        runs["seq"] = hf_baseline.run_baseline(model, prompts, args.output_len, 1, [None])
    runs["padded"] = hf_baseline.run_baseline(model, prompts, args.output_len, len(prompts), [None])
    best = max(runs.values(), key=lambda r: r["output_tok_s"])
    out = {k: v for k, v in best.items() if k not in ("_ids", "variants")}
    out["variants"] = {r["name"]: {m: r[m] for m in ("output_tok_s", "seconds")} for r in runs.values()}
    out["_seq_ids"] = runs["seq"]["_ids"] if sequential else None
    return out


def main(args: argparse.Namespace) -> dict:
    if args.dtype == "auto":
        args.dtype = "float32"
    result = report.new_result("W6", args.model, args.dtype)
    result["ceilings"] = ceilings.measure_ceilings("cpu", args.quick_ceilings)
    result["threads"] = torch.get_num_threads()
    if args.gguf_only:
        return gguf_only(args, result)
    tf32 = measure_tokenforge(args, "float32", None)
    result["threads"] = torch.get_num_threads()      # as the engine set it (--num-threads)
    harness.release_memory()
    prompts = tf32["prompts"]
    result["workload_args"] = {"num_prompts": len(prompts), "input_len": [args.min_input, args.max_input],
                               "mean_input_len": sum(map(len, prompts)) / len(prompts), "output_len": args.output_len}
    result["tokenforge"] = tf32["figures"]
    model, real_weights = (None, False) if args.no_baseline else load_hf(args)
    if model is not None:
        base = hf_best(model, prompts, args, sequential=not args.no_sequential)
        seq_ids = base.pop("_seq_ids")
        result["baseline"] = base
        result["ratio_float32"] = result["tokenforge"]["output_tok_s"] / base["output_tok_s"]
        if real_weights and seq_ids is not None:
            result["parity"] = {"exact_match": sum(a == b for a, b in zip(tf32["ids"], seq_ids)), "of": len(prompts),
                                "reference": "HF transformers fp32, sequential batch-1 greedy"}
    if not args.no_int8:
        result["int8"] = run_int8(args, prompts, model, tf32)
    if not args.no_bf16:
        result["bf16"] = run_bf16(args, prompts, model, tf32)
    del model
    if not args.no_gguf and (args.model is None or str(args.model).endswith(".gguf")):
        result["gguf"] = run_gguf(args, prompts, tf32)
    harness.release_memory()
    set_headline(result)
    report.save(result, args)
    print_summary(result)
    return result


def set_headline(result: dict) -> None:
    """`ratio`: the default path's output tok/s over HF's fastest configuration in this run."""
    hf = [(v["name"], v["output_tok_s"]) for v in (result.get("baseline"), (result.get("int8") or {}).get("baseline"),
                                                   (result.get("bf16") or {}).get("baseline")) if v]
    parallel = (result.get("gguf") or {}).get("parallel")
    if parallel:
        path, rate = "gguf-native (dtype auto), all prompts at once", parallel["tokenforge"]["output_tok_s"]
    else:
        path, rate = "float32", result["tokenforge"]["output_tok_s"]
    result["default_path"] = {"name": path, "output_tok_s": rate}
    if hf:
        name, best = max(hf, key=lambda v: v[1])
        result["hf_best"] = {"name": name, "output_tok_s": best}
        result["ratio"] = rate / best


def run_int8(args: argparse.Namespace, prompts: list[list[int]], model, tf32: dict) -> dict:
    """Dynamic int8 (q/k/v and gate/up quantized, o/down and lm_head float32) against HF with the
    same modules quantized by torch.ao's dynamic quantization."""
    tf8 = measure_tokenforge(args, "float32", prompts, quantization="int8")
    harness.release_memory()
    out = {"tokenforge": tf8["figures"], "greedy_match_vs_fp32": sum(a == b for a, b in zip(tf8["ids"], tf32["ids"]))}
    ppl32, ppl8 = tf32["figures"]["perplexity"], tf8["figures"]["perplexity"]
    if ppl32 and ppl8:
        out["perplexity"] = {"fp32": ppl32, "int8": ppl8, "change_pct": (ppl8 / ppl32 - 1) * 100,
                             "text_tokens": len(tf32["ppl_ids"])}
    if model is not None:
        hf8 = hf_baseline.quantize_dynamic_int8(model, INT8_MODULES)
        padded = hf_baseline.run_baseline(hf8, prompts, args.output_len, len(prompts), [None])
        padded.pop("_ids")
        out["baseline"] = {**padded, "name": padded["name"] + "-int8"}
        out["ratio"] = tf8["figures"]["output_tok_s"] / padded["output_tok_s"]
        del hf8
        harness.release_memory()
    return out


def gguf_only(args: argparse.Namespace, result: dict) -> dict:
    """`--gguf-only`: the GGUF section alone, on prompts made for the file's vocabulary."""
    from tokenforge.model.loader import read_arch_config  # noqa: PLC0415

    vocab = read_arch_config(args.model, "auto").vocab_size
    prompts = workloads.random_prompts(args.num_prompts, (args.min_input, args.max_input), vocab, args.seed)
    result["workload_args"] = {"num_prompts": len(prompts), "input_len": [args.min_input, args.max_input],
                               "mean_input_len": sum(map(len, prompts)) / len(prompts), "output_len": args.output_len}
    result["gguf"] = run_gguf(args, prompts, None)
    result["threads"] = result["gguf"]["threads"]
    report.save(result, args)
    print_gguf(result)
    return result


_GGUF_SHAPES = {"batch1": ({"max_num_seqs": 1}, False), "parallel": ({}, True)}


def run_gguf(args: argparse.Namespace, prompts: list[list[int]], tf32: dict | None) -> dict:
    """tokenforge on the stored blocks (dtype auto) and llama.cpp on the same file, batch 1 and parallel."""
    from tokenforge.source import resolve_model_source  # noqa: PLC0415

    shapes = [s.strip() for s in args.gguf_shapes.split(",") if s.strip()]
    if not shapes or set(shapes) - set(_GGUF_SHAPES):
        raise SystemExit(f"--gguf-shapes: expected a comma-separated subset of {', '.join(_GGUF_SHAPES)}, "
                         f"got {args.gguf_shapes!r}")
    path = str(resolve_model_source(args.model, "auto").path)
    out: dict = {"file": path}
    for shape in shapes:
        run = measure_tokenforge(args, "auto", prompts, **_GGUF_SHAPES[shape][0])
        harness.release_memory()
        out[shape] = {"tokenforge": run["figures"]}
        if tf32 is not None:
            out[shape]["greedy_match_vs_fp32"] = sum(a == b for a, b in zip(run["ids"], tf32["ids"]))
    threads = out["threads"] = torch.get_num_threads()          # as the engine set it (--num-threads)
    try:
        for shape in shapes:
            peer = llama_cpp_peer.run(path, prompts, args.output_len, threads, _GGUF_SHAPES[shape][1],
                                      args.llama_cpp_extra_bufts)
            peer_ids = peer.pop("_ids")
            tf = out[shape]["tokenforge"]
            out[shape].update(llama_cpp=peer, ratio=tf["output_tok_s"] / peer["output_tok_s"])
            if tf32 is not None:
                out[shape]["greedy_match_vs_fp32_llama_cpp"] = sum(a == b for a, b in zip(peer_ids, tf32["ids"]))
    except (ImportError, RuntimeError) as exc:
        out["llama_cpp_error"] = str(exc)
        print(exc)
    return out


def run_bf16(args: argparse.Namespace, prompts: list[list[int]], model, tf32: dict) -> dict:
    tf16 = measure_tokenforge(args, "bfloat16", prompts)
    harness.release_memory()
    out = {"tokenforge": tf16["figures"]}
    ppl32, ppl16 = tf32["figures"]["perplexity"], tf16["figures"]["perplexity"]
    if ppl32 is None and model is not None:   # the engine gave no prompt logprobs: ask HF instead
        ppl32 = hf_baseline.perplexity(model, tf32["ppl_ids"])
    if model is not None:
        model.to(torch.bfloat16)
        if ppl16 is None:
            ppl16 = hf_baseline.perplexity(model, tf32["ppl_ids"])
        padded = hf_baseline.run_baseline(model, prompts, args.output_len, len(prompts), [None])
        padded.pop("_ids")
        out["baseline"] = {**padded, "name": padded["name"] + "-bf16"}
        out["ratio"] = tf16["figures"]["output_tok_s"] / padded["output_tok_s"]
    out["greedy_match_vs_fp32"] = sum(a == b for a, b in zip(tf16["ids"], tf32["ids"]))
    if ppl32 and ppl16:
        out["perplexity"] = {"fp32": ppl32, "bf16": ppl16, "change_pct": (ppl16 / ppl32 - 1) * 100,
                             "text_tokens": len(tf32["ppl_ids"])}
    return out


def print_summary(r: dict) -> None:
    tf, rows = r["tokenforge"], []
    rows.append(["tokenforge fp32", tf["output_tok_s"], tf["median_s"], _ratio(r.get("ratio_float32"))])
    for name, v in r.get("baseline", {}).get("variants", {}).items():
        rows.append([name, v["output_tok_s"], v["seconds"], None])
    for key in ("int8", "bf16"):
        _add_variant_rows(rows, key, r.get(key))
    _add_gguf_rows(rows, r)
    report.print_table(f"W6 cpu  {r['model']}  {r['device']}  threads={r['threads']}",
                       ["variant", "output tok/s", "seconds", "vs HF best"], rows)
    if "ratio" in r:
        d, hf = r["default_path"], r["hf_best"]
        print(f"W6 headline: the default path ({d['name']}) {d['output_tok_s']:.1f} tok/s = {r['ratio']:.2f}x HF's "
              f"best configuration ({hf['name']}, {hf['output_tok_s']:.1f} tok/s); float32 path "
              f"{_ratio(r.get('ratio_float32'))}")
    if "parity" in r:
        par = r["parity"]
        print(f"greedy parity with HF (fp32, sequential): {par['exact_match']}/{par['of']} prompts equal")
    for key in ("int8", "bf16"):
        p = (r.get(key) or {}).get("perplexity")
        if p:
            print(f"perplexity on {p['text_tokens']} tokens: fp32 {p['fp32']:.3f}, {key} {p[key]:.3f} "
                  f"({p['change_pct']:+.2f}%)")


def print_gguf(r: dict) -> None:
    rows: list = []
    _add_gguf_rows(rows, r)
    report.print_table(f"W6 cpu (GGUF only)  {r['gguf']['file']}  threads={r['threads']}",
                       ["variant", "output tok/s", "seconds", "ratio"], rows)


def _add_gguf_rows(rows: list, r: dict) -> None:
    for shape in _GGUF_SHAPES:
        g = (r.get("gguf") or {}).get(shape)
        if g:
            rows.append([f"tokenforge gguf-native {shape}", g["tokenforge"]["output_tok_s"], g["tokenforge"]["median_s"],
                         None if "ratio" not in g else f"{g['ratio']:.2f}x vs llama.cpp"])
            if "llama_cpp" in g:
                rows.append([g["llama_cpp"]["name"], g["llama_cpp"]["output_tok_s"], g["llama_cpp"]["seconds"], None])


def _add_variant_rows(rows: list, key: str, b16: dict | None) -> None:
    if b16:
        rows.append([f"tokenforge {key}", b16["tokenforge"]["output_tok_s"], b16["tokenforge"]["median_s"],
                     _ratio(b16.get("ratio"))])
        if "baseline" in b16:
            rows.append([b16["baseline"]["name"], b16["baseline"]["output_tok_s"], b16["baseline"]["seconds"], None])


def _ratio(x: float | None) -> str | None:
    return None if x is None else f"{x:.2f}x"
