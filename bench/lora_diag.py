"""Where the batch-1 LoRA step's time goes (device diagnostic, not a test): W1-like decode with the
bare model and LoRA variants, each timed and profiled; per kernel name, the time it advances the
step's timeline (its end past every earlier kernel's end), per step."""
import gc, random, sys, tempfile, time
from collections import defaultdict
from pathlib import Path
import torch

from tokenforge import LLM, SamplingParams
from tokenforge.messages import LoRARequest
from tokenforge.bench.lib import workloads
from tokenforge.kernels import gemv_lora, _triton
from tokenforge.model.arch_config import ArchConfig
from tokenforge.model.loader.peft import write_random_adapter

orig_expand = gemv_lora._expand_row_kernel

class NoLaunch:
    def __getitem__(self, grid):
        return lambda *a, **kw: None

def patch(v):
    gemv_lora.EXPAND_PDL = v != "lora-expand-nopdl"
    gemv_lora._expand_row_kernel = NoLaunch() if v in ("lora-noexpand",) else orig_expand
    if v == "lora-nopdl":
        gemv_lora.use_pdl = lambda x: False
    else:
        gemv_lora.use_pdl = _triton.use_pdl

cfg = workloads.load_config_dict("llama-3.1-8b")
root = Path(tempfile.mkdtemp())
path = write_random_adapter(ArchConfig.from_hf_config(cfg), root / "a0", 16, seed=0, std=0.02, dtype=torch.bfloat16)
prompt = workloads.random_prompts(1, 128, cfg["vocab_size"], 0)[0]
tokens = {}
sp = SamplingParams(max_tokens=256, ignore_eos=True, temperature=0)
for v in sys.argv[1:]:
    patch(v)
    lora = v != "bare"
    llm = LLM(model="llama-3.1-8b", load_format="dummy", dtype="bfloat16", max_model_len=4096,
              enable_lora=lora, max_loras=1, max_lora_rank=16, max_cpu_loras=1)
    req = LoRARequest("a0", 1, str(path)) if lora else None
    inp = [{"prompt_token_ids": prompt}]
    llm.generate(inp, sp, use_tqdm=False, lora_request=req)
    torch.cuda.synchronize(); t0 = time.perf_counter()
    ids = list(llm.generate(inp, sp, use_tqdm=False, lora_request=req)[0].outputs[0].token_ids)
    torch.cuda.synchronize(); dt = time.perf_counter() - t0
    if lora:    # the LoRA variants' greedy tokens against the first one's (rounding may part them late)
        first = tokens.setdefault("first", (v, ids))
        same = next((i for i, (a, b) in enumerate(zip(first[1], ids)) if a != b), len(ids))
        print(f"== {v}: greedy tokens equal to {first[0]}'s for the first {same} of {len(ids)}")
    sp2 = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate(inp, sp2, use_tqdm=False, lora_request=req)
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA)
    steps = sum(1 for k in ks if "argmax" in k[2] or k[2].startswith("void at::native::reduce_kernel"))
    adv, cnt, far = defaultdict(float), defaultdict(int), 0.0
    for s, e, n in ks:
        if far and e > far:
            adv[n[:40]] += e - max(s, far) if s > far else e - far
            if s > far:
                adv["(idle gap)"] += s - far
        far = max(far, e); cnt[n[:40]] += 1
    span = ks[-1][1] - ks[0][0]
    print(f"== {v}: {dt / 256 * 1e3:.3f} ms/token (256 tokens, after 128-token prefill); profiled span {span / 1e3:.1f} ms, ~{steps} steps")
    for n, us in sorted(adv.items(), key=lambda t: -t[1])[:12]:
        print(f"   {n:42s} {us / max(steps, 1):8.1f} us/step advanced   {cnt[n] / max(steps, 1):6.1f} launches/step")
    llm.shutdown(); del llm; gc.collect(); torch.cuda.empty_cache()
