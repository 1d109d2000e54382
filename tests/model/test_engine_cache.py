"""The engine cache's converted weights: built once, then mapped (lazy on the CPU: never copied),
verified on load (a corrupt entry is rebuilt with one warning), listed and removed by the CLI."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenforge.bench.lib.checkpoint import write_random_checkpoint
from tokenforge.cli import main
from tokenforge.model.loader import CacheOptions, load_model
from tokenforge.model.loader.weight_cache import list_entries

REPO = str(Path(__file__).resolve().parents[2])
# ~120 MB of float32 weights: big enough that copying them shows in the RSS, small to write.
CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512, "intermediate_size": 2048,
       "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 4096,
       "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
       "bos_token_id": 1, "eos_token_id": 2}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_random_checkpoint(CFG, tmp_path_factory.mktemp("ckpt") / "m", dtype=torch.float32, std=0.05)


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_cache_round_trip_and_corrupt_entry_rebuilt(checkpoint, tmp_path, caplog):
    opts = CacheOptions(str(tmp_path / "cache"))
    fresh = load_model(str(checkpoint), "auto", torch.float32, "cpu", cache=opts)
    (entry,) = list_entries(opts.root)
    assert entry["tp"] == [0, 1] and Path(entry["path"], "weights.safetensors").is_file()
    cached = load_model(str(checkpoint), "lazy", torch.float32, "cpu", cache=opts)
    a, b = _state(fresh.model), _state(cached.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # A truncated (partial) file: one warning, then the entry is rebuilt from the checkpoint.
    weights = Path(entry["path"], "weights.safetensors")
    weights.write_bytes(weights.read_bytes()[:1000])
    with caplog.at_level(logging.WARNING):
        again = load_model(str(checkpoint), "auto", torch.float32, "cpu", cache=opts)
    assert sum("unusable" in r.getMessage() for r in caplog.records) == 1
    c = _state(again.model)
    assert all(torch.equal(a[k], c[k]) for k in a)
    assert json.loads(Path(entry["path"], "manifest.json").read_text())["bytes"] == weights.stat().st_size


# Peak RSS (VmHWM) growth over the engine's construction: the peak is reset first (clear_refs 5),
# so the imports' own peak does not hide it.
_RSS = """
import sys, torch
from tokenforge import LLM, SamplingParams
from tokenforge.engine.tokenization import load_engine_tokenizer
load_engine_tokenizer(sys.argv[1])      # transformers' import is not the engine's memory
def kib(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])
open("/proc/self/clear_refs", "w").write("5")
base = kib("VmRSS:")
llm = LLM(sys.argv[1], load_format=sys.argv[2], engine_cache_dir=sys.argv[3], device="cpu", dtype="float32",
          num_kv_blocks=8, num_threads=1)
grown = kib("VmHWM:") - base
out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
print(grown * 1024, out[0].outputs[0].token_ids)
"""


def _peak_growth(checkpoint: Path, load_format: str, cache: Path) -> tuple[int, list]:
    out = subprocess.run([sys.executable, "-c", _RSS, str(checkpoint), load_format, str(cache)], cwd=REPO,
                         env={"PYTHONPATH": REPO, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split(maxsplit=1)
    return int(out[0]), out[1]


def test_lazy_loading_keeps_peak_rss_well_below_the_model(checkpoint, tmp_path):
    """The cache is built here; a fresh process then maps it. Copying the weights would add their
    full size to the peak (the round-trip test above checks the values are the same)."""
    model_bytes = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
    cache = tmp_path / "cache"
    load_model(str(checkpoint), "auto", torch.float32, "cpu", cache=CacheOptions(str(cache)))
    lazy_growth, tokens = _peak_growth(checkpoint, "lazy", cache)
    assert len(json.loads(tokens)) == 4
    assert lazy_growth < 0.25 * model_bytes, (lazy_growth, model_bytes)


def test_cache_ls_and_rm(checkpoint, tmp_path, capsys):
    root = tmp_path / "cache"
    load_model(str(checkpoint), "auto", torch.float32, "cpu", cache=CacheOptions(str(root)))
    assert main(["cache", "ls", "--engine-cache-dir", str(root)]) == 0
    listing = capsys.readouterr().out
    assert str(checkpoint) in listing and "tp 0/1" in listing
    assert main(["cache", "rm", "--engine-cache-dir", str(root), "--all"]) == 0
    assert list_entries(root) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staged_copy_to_the_gpu_is_byte_exact(tmp_path):
    from tokenforge.model.loader.safetensors_mmap import MappedSafetensors, write_safetensors
    from tokenforge.model.loader.weight_cache import staged_copy

    g = torch.Generator().manual_seed(0)
    shapes = {"empty": (0, 8), "tiny": (3,), "exact": (64, 64), "odd": (37, 129), "big": (300, 257)}
    host = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}
    host["ints"] = torch.randint(-128, 127, (1000,), dtype=torch.int8, generator=g)
    write_safetensors(tmp_path / "w.safetensors", host.items())
    mapped = MappedSafetensors(tmp_path / "w.safetensors")
    for threads, chunk in ((1, 1 << 20), (3, 4096), (8, 1000)):    # chunks cut through tensors, more threads than chunks
        params = {n: torch.nn.Parameter(torch.full_like(t, 7, device="cuda"), requires_grad=False) for n, t in host.items()}
        staged_copy(mapped, params, threads=threads, chunk_bytes=chunk)
        for name, t in host.items():
            assert torch.equal(params[name].data.cpu(), t), (threads, chunk, name)
    mapped.close()
