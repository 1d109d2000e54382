"""Where a MoE model's W1 prefill goes (lead probe, wave 3 round 20).

W1's output tok/s counts the first token's latency: on an H200 gpt-oss-120b decodes at 343 tok/s
but reports 302 with a 104 ms TTFT for its 128-token prompt; qwen3-30b-a3b 58-125 ms, gpt-oss-20b
42 ms, against 13-15 ms for the dense 8B. This times prefills of W1's prompt alone (a fresh prompt
each, so no prefix-cache hit), then profiles a few: the wall time of one, how much of it the
device was busy, the kernels' time by name, and the host's op count, to tell a host-bound prefill
(eager launches) from slow kernels.

Run: python bench/moe_prefill_profile.py --models qwen3-30b-a3b gpt-oss-20b --out OUT (GPU or CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import tempfile
import time
from collections import Counter
from pathlib import Path


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, min(vocab, 30000)) for _ in range(length)] for _ in range(count)]


def _kernel_table(prof, top: int) -> tuple[list[dict], int, int]:
    from torch.autograd import DeviceType  # noqa: PLC0415

    by_name: Counter = Counter()
    calls: Counter = Counter()
    host_ops = 0
    kernels = 0
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            kernels += 1
            by_name[e.name[:80]] += e.time_range.end - e.time_range.start
            calls[e.name[:80]] += 1
        elif e.name.startswith("aten::") and e.cpu_parent is None:
            host_ops += 1
    rows = [{"kernel": n, "us": round(t, 1), "calls": calls[n]} for n, t in by_name.most_common(top)]
    return rows, kernels, host_ops


def profile_model(model: str, args: argparse.Namespace, out: Path) -> dict:
    import torch  # noqa: PLC0415

    from tokenforge import LLM, SamplingParams  # noqa: PLC0415
    from tokenforge.executor.executor import device_busy  # noqa: PLC0415

    prof_dir = Path(tempfile.mkdtemp(prefix=f"prefill-{model}-"))     # the traces stay off $OUT (size)
    kwargs = {"load_format": "dummy", "dtype": args.dtype, "max_model_len": 4096, "profile_dir": str(prof_dir)}
    if args.device:
        kwargs["device"] = args.device
    t0 = time.perf_counter()
    llm = LLM(model=model, **kwargs)
    load_s = time.perf_counter() - t0
    vocab = getattr(llm.tokenizer, "vocab_size", 512) or 512
    prompts = iter(_prompts(64, args.input_len, vocab, 0))
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    decode = SamplingParams(temperature=0.0, max_tokens=args.decode_len, ignore_eos=True)

    def run(params) -> float:
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": next(prompts)}], params, use_tqdm=False)
        sync()
        return (time.perf_counter() - start) * 1e3

    for _ in range(3):
        run(decode)                                   # warm-up: prefill and decode shapes
    prefill_ms = sorted(run(one) for _ in range(args.repeats))
    decode_ms = sorted(run(decode) for _ in range(2))
    llm.start_profile()
    prof = llm.engine.executor._profiler            # noqa: SLF001 - the probe reads the raw events
    wall = [run(one) for _ in range(3)]
    prof.stop()
    llm.engine.executor._profiler = None            # noqa: SLF001
    busy = device_busy(prof.events()) or {}
    rows, kernels, host_ops = _kernel_table(prof, args.top)
    result = {
        "model": model, "load_s": round(load_s, 1), "input_len": args.input_len,
        "prefill_ms": [round(x, 2) for x in prefill_ms], "prefill_ms_median": round(prefill_ms[len(prefill_ms) // 2], 2),
        "decode_len": args.decode_len, "generate_ms_with_decode": [round(x, 1) for x in decode_ms],
        "profiled_prefills_ms": [round(x, 2) for x in wall], "device_busy": busy,
        "kernels_per_prefill": kernels / 3, "host_aten_ops_per_prefill": host_ops / 3,
        "kernel_us_per_prefill": [{**r, "us": round(r["us"] / 3, 1), "calls": r["calls"] / 3} for r in rows],
    }
    llm.shutdown()
    del llm, prof
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-20b", "gpt-oss-120b"])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--decode-len", type=int, default=33)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for model in args.models:
        try:
            r = profile_model(model, args, out)
        except Exception as err:  # noqa: BLE001 - a probe: report and go on to the next model
            r = {"model": model, "error": f"{type(err).__name__}: {err}"}
        results.append(r)
        (out / "moe_prefill_profile.json").write_text(json.dumps(results, indent=1))
        if "error" in r:
            print(f"{model}: {r['error']}", flush=True)
            continue
        b = r["device_busy"]
        print(f"{model}: prefill of {r['input_len']} tokens {r['prefill_ms_median']} ms (runs {r['prefill_ms']}), "
              f"with {r['decode_len']} tokens {r['generate_ms_with_decode']} ms; profiled {r['profiled_prefills_ms']} ms, "
              f"device busy {b.get('busy_ms', 0) / 3:.2f} ms a prefill of a {b.get('span_ms', 0) / 3:.2f} ms span "
              f"({100 * b.get('busy_frac', 0):.1f}%), {r['kernels_per_prefill']:.0f} kernels and "
              f"{r['host_aten_ops_per_prefill']:.0f} top-level aten ops a prefill", flush=True)
        for row in r["kernel_us_per_prefill"]:
            print(f"   {row['us']:10.1f} us  {row['calls']:6.1f}x  {row['kernel']}", flush=True)


if __name__ == "__main__":
    main()
