"""PEFT adapters on the served model (model/loader/peft.py, model/lora.py): logits equal HF PEFT's
on a tiny random Llama for every target subset and scaling rule, each token row takes its own slot,
tensor-parallel shards of an adapter add up to the unsharded delta, and every bad adapter is one
clear error naming it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from tokenforge.model.arch_config import ArchConfig
from tokenforge.model.forward_context import set_forward_context
from tokenforge.model.loader import load_model
from tokenforge.model.loader.peft import read_peft_adapter
from tokenforge.model.lora import ModelLoRASlots
from tokenforge.model.models import get_model_class

peft = pytest.importorskip("peft")

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_CFG = dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=331, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1,
            tie_word_embeddings=False)


def make_peft_adapter(hf_base, out_dir, targets, rank=8, alpha=16, seed=0, safe=True, **extra):
    """A random PEFT LoRA (B random too, so the delta shows) saved as PEFT saves it (safe=False: as
    older PEFT did, adapter_model.bin)."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                             lora_dropout=0.0, **extra)
    model = peft.get_peft_model(hf_base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.2)
    model.save_pretrained(out_dir, safe_serialization=safe)
    return model.eval()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("base")
    LlamaForCausalLM(LlamaConfig(**_CFG)).save_pretrained(path)
    return path


def _hf_base(base_dir):
    return LlamaForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32).eval()


def _our_logits(model, tokens, slot_of_row):
    ids = torch.tensor(tokens)
    with torch.no_grad(), set_forward_context(None, lora_indices=torch.tensor(slot_of_row)):
        hidden = model(ids, torch.arange(len(tokens)))
    return model.compute_logits(hidden).float()


@pytest.mark.parametrize("targets,extra", [
    (ALL_TARGETS, {}),
    (["q_proj", "v_proj"], {}),
    (["k_proj", "gate_proj", "down_proj"], {"use_rslora": True}),
    (["q_proj", "o_proj", "up_proj"], {"rank_pattern": {"o_proj": 4}, "alpha_pattern": {"up_proj": 5}}),
], ids=["all-seven", "q-v", "rslora", "patterns"])
def test_logits_match_hf_peft(base_dir, tmp_path, targets, extra):
    tokens = torch.randint(0, 331, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    hf = make_peft_adapter(_hf_base(base_dir), tmp_path / "a", targets, **extra)
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0].float()
        with hf.disable_adapter():
            bare = hf(torch.tensor([tokens])).logits[0].float()
    model = load_model(str(base_dir), "auto", torch.float32, "cpu").model
    slots = ModelLoRASlots(model, num_slots=3, max_rank=16)
    adapter = read_peft_adapter(tmp_path / "a", "a", max_rank=16)
    slots.write(1, adapter)
    torch.testing.assert_close(_our_logits(model, tokens, [1] * len(tokens)), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_our_logits(model, tokens, [-1] * len(tokens)), bare, atol=1e-4, rtol=1e-4)
    assert (expected - bare).abs().max() > 1e-2          # the adapter visibly changes the logits



def test_an_adapter_model_bin_reads_as_its_safetensors_twin(base_dir, tmp_path):
    """Older PEFT saved adapter_model.bin (torch.save): read it without unpickling code, same logits."""
    tokens = [5, 17, 99, 3, 42, 8, 250]
    hf = make_peft_adapter(_hf_base(base_dir), tmp_path / "bin", ["q_proj", "down_proj"], safe=False)
    names = {p.name for p in (tmp_path / "bin").iterdir()}
    assert "adapter_model.bin" in names and "adapter_model.safetensors" not in names
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0].float()
    model = load_model(str(base_dir), "auto", torch.float32, "cpu").model
    slots = ModelLoRASlots(model, num_slots=2, max_rank=16)
    slots.write(1, read_peft_adapter(tmp_path / "bin", "bin", max_rank=16))
    torch.testing.assert_close(_our_logits(model, tokens, [1] * len(tokens)), expected, atol=1e-4, rtol=1e-4)
    # a broken .bin is one error naming it; a pickle that would run code is refused, not run
    for name, payload, words in (("garbage", b"\x80\x02garbage", "is not a readable PyTorch weights file"),
                                 ("code", None, "is not a readable PyTorch weights file"),
                                 ("list", [torch.zeros(2)], "does not hold a dict of named tensors")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text((tmp_path / "bin" / "adapter_config.json").read_text())
        target = tmp_path / name / "adapter_model.bin"
        if isinstance(payload, bytes):
            target.write_bytes(payload)
        else:
            torch.save(payload if payload is not None else {"x": _Evil()}, target)
        with pytest.raises(ValueError, match=f"LoRA adapter '{name}': .*adapter_model.bin {words}"):
            read_peft_adapter(tmp_path / name, name, max_rank=16)


class _Evil:
    def __reduce__(self):
        return (print, ("unpickled code ran",))

def test_rows_take_their_own_slot(base_dir, tmp_path):
    """One forward over two sequences' tokens, rows in slots 0 and 2: each matches its adapter alone
    (the model sees one causal sequence, so compare the first sequence's rows only)."""
    model = load_model(str(base_dir), "auto", torch.float32, "cpu").model
    slots = ModelLoRASlots(model, num_slots=3, max_rank=8)
    for slot, seed in ((0, 1), (2, 2)):
        make_peft_adapter(_hf_base(base_dir), tmp_path / str(slot), ALL_TARGETS, seed=seed)
        slots.write(slot, read_peft_adapter(tmp_path / str(slot), str(slot), 8))
    tokens = list(range(5, 14))
    alone = {s: _our_logits(model, tokens, [s] * len(tokens)) for s in (0, 2, -1)}
    for s in (0, 2, -1):
        other = {0: 2, 2: 0, -1: 0}[s]
        mixed = _our_logits(model, tokens + tokens, [s] * len(tokens) + [other] * len(tokens))
        torch.testing.assert_close(mixed[:len(tokens)], alone[s], atol=1e-5, rtol=1e-5)
    slots.clear(0)
    torch.testing.assert_close(_our_logits(model, tokens, [0] * len(tokens)), alone[-1], atol=1e-6, rtol=1e-6)


def test_each_forward_makes_its_own_lora_plan(base_dir):
    """The rows-by-slot plan the linears share (kernels/lora.py) lives in the forward context for
    one forward only: a CUDA graph captured after warm-up runs in the same context must record its
    own plan, not replay one the warm-up allocated (an illegal address on the GPU)."""
    model = load_model(str(base_dir), "auto", torch.float32, "cpu").model
    ModelLoRASlots(model, num_slots=2, max_rank=8)
    with torch.no_grad(), set_forward_context(None, lora_indices=torch.tensor([0, 1, -1])) as ctx:
        ctx.lora_plan = "a plan from an earlier forward"
        model(torch.tensor([5, 6, 7]), torch.arange(3))
        assert ctx.lora_plan is None          # the CPU's reference path makes none


@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
def test_tensor_parallel_shards_add_up(tmp_path, num_kv_heads):
    """Each rank's slot holds its shard (column-parallel: B's rows; row-parallel: A's columns); the
    ranks' deltas, concatenated or summed as the base outputs are, equal the unsharded delta."""
    torch.manual_seed(0)
    hf_cfg = LlamaConfig(**{**_CFG, "num_key_value_heads": num_kv_heads})
    hf = LlamaForCausalLM(hf_cfg)
    make_peft_adapter(hf, tmp_path / "a", ALL_TARGETS)
    adapter = read_peft_adapter(tmp_path / "a", "a", 8)
    arch = ArchConfig.from_hf_config(hf_cfg.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    cls = get_model_class(arch.architecture)
    models = [cls(arch, torch.float32, rank, size) for rank, size in ((0, 1), (0, 2), (1, 2))]
    for m in models:
        ModelLoRASlots(m, 2, 8).write(1, adapter)
    x = {"qkv_proj": torch.randn(3, 64), "gate_up_proj": torch.randn(3, 64), "o_proj": torch.randn(3, 64),
         "down_proj": torch.randn(3, 112)}
    layer = "model.layers.1"

    def delta(model, name, inp):
        linear = model.get_submodule(f"{layer}.{'mlp' if 'gate' in name or 'down' in name else 'self_attn'}.{name}")
        with set_forward_context(None, lora_indices=torch.ones(3, dtype=torch.long)):
            return linear.lora(inp, torch.zeros(3, linear.out_features)), linear.lora.slices

    for name in ("qkv_proj", "gate_up_proj"):
        full, full_slices = delta(models[0], name, x[name])
        (d0, s0), (d1, _) = delta(models[1], name, x[name]), delta(models[2], name, x[name])
        for whole, p0, p1 in zip(full.split(full_slices, -1), d0.split(s0, -1), d1.split(s0, -1)):
            joined = torch.cat([p0, p1], -1)
            if num_kv_heads == 1 and whole.shape[-1] < joined.shape[-1]:    # a replicated kv head
                torch.testing.assert_close(p0, whole)
                torch.testing.assert_close(p1, whole)
            else:
                torch.testing.assert_close(joined, whole)
    for name in ("o_proj", "down_proj"):
        full, _ = delta(models[0], name, x[name])
        half = x[name].shape[1] // 2
        d0, _ = delta(models[1], name, x[name][:, :half])
        d1, _ = delta(models[2], name, x[name][:, half:])
        torch.testing.assert_close(d0 + d1, full, atol=1e-5, rtol=1e-5)


# ---- bad adapters ------------------------------------------------------------------------------------

def _write(path, config: dict | str, tensors: dict | bytes):
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if isinstance(tensors, bytes):
        (path / "adapter_model.safetensors").write_bytes(tensors)
    else:
        save_file(tensors, str(path / "adapter_model.safetensors"))


_PREFIX = "base_model.model.model.layers.0.self_attn."


def _good(rank=4, out=64, inp=64, module="q_proj"):
    return {f"{_PREFIX}{module}.lora_A.weight": torch.zeros(rank, inp),
            f"{_PREFIX}{module}.lora_B.weight": torch.zeros(out, rank)}


def test_bad_adapters_are_one_clear_error(base_dir, tmp_path):
    model = load_model(str(base_dir), "auto", torch.float32, "cpu").model
    slots = ModelLoRASlots(model, 2, 8)
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    cases = {
        "missing": (None, r"LoRA adapter 'missing': .*missing is not a directory"),
        "no-weights": ("config-only", r"LoRA adapter 'no-weights': .*adapter_model.safetensors is missing"),
        "bad-json": (("{not json", _good()), r"LoRA adapter 'bad-json': .*adapter_config.json is not valid JSON"),
        "corrupt": ((cfg, b"\x10\x00\x00\x00garbage"), r"LoRA adapter 'corrupt': .*is not a valid safetensors file"),
        "too-big": (({**cfg, "r": 16}, _good(16)), r"LoRA adapter 'too-big' has rank 16, more than --max-lora-rank 8"),
        "dora": (({**cfg, "use_dora": True}, _good()), r"LoRA adapter 'dora': DoRA is not supported"),
        "half": ((cfg, {f"{_PREFIX}q_proj.lora_A.weight": torch.zeros(4, 64)}),
                 r"LoRA adapter 'half': model.layers.0.self_attn.q_proj has no lora_B weight"),
        # a corrupt config's values: each a ValueError naming the field, not a TypeError from the scale
        "alpha-text": (({**cfg, "lora_alpha": "16"}, _good()), r"LoRA adapter 'alpha-text': lora_alpha must be a "
                                                                r"number, got '16'"),
        "alpha-null": (({**cfg, "lora_alpha": None}, _good()), r"lora_alpha must be a number, got None"),
        "rank-pattern-list": (({**cfg, "rank_pattern": [4]}, _good()), r"rank_pattern must be an object"),
        "rank-pattern-text": (({**cfg, "rank_pattern": {"q_proj": "4"}}, _good()),
                              r"rank_pattern\['q_proj'\] must be a positive integer, got '4'"),
        "alpha-pattern-text": (({**cfg, "alpha_pattern": {"q_proj": "x"}}, _good()),
                               r"alpha_pattern\['q_proj'\] must be a number, got 'x'"),
        "saved-text": (({**cfg, "modules_to_save": "lm_head"}, _good()), r"modules_to_save \(lm_head\) is not supported"),
        "rank-0": ((cfg, _good(0)), r"q_proj has lora_A \(0, 64\) and lora_B \(64, 0\), not \[r, in\] and \[out, r\]"),
        # the tensors' rank against the config's (PEFT would not load it either)
        "rank-mismatch": (({**cfg, "r": 8}, _good(4)), r"LoRA adapter 'rank-mismatch': model.layers.0.self_attn.q_proj "
                                                      r"has rank 4 in adapter_model.safetensors, but adapter_config.json "
                                                      r"gives it r = 8"),
        "nan": ((cfg, {**_good(), f"{_PREFIX}q_proj.lora_A.weight": torch.full((4, 64), float("nan"))}),
                r"LoRA adapter 'nan': model.layers.0.self_attn.q_proj has values that are not finite"),
        "overflow": (({**cfg, "lora_alpha": 1e300}, {**_good(), f"{_PREFIX}q_proj.lora_B.weight": torch.ones(64, 4)}),
                     r"LoRA adapter 'overflow': .* times the scale \(lora_alpha / r\)"),
        "pattern-mismatch": (({**cfg, "rank_pattern": {r"layers\.0\..*q_proj": 2}}, _good()),
                             r"has rank 4 in adapter_model.safetensors, but adapter_config.json gives it r = 2"),
    }
    for name, (content, message) in cases.items():
        if content == "config-only":
            (tmp_path / name).mkdir()
            (tmp_path / name / "adapter_config.json").write_text(json.dumps(cfg))
        elif content is not None:
            _write(tmp_path / name, *content)
        with pytest.raises(ValueError, match=message):
            read_peft_adapter(tmp_path / name, name, max_rank=8)
    fitting = {  # readable adapters that do not fit the model: nothing is written
        "shape": (_good(out=48), r"LoRA adapter 'shape': model.layers.0.self_attn.q_proj has lora_A \(4, 64\) and "
                                 r"lora_B \(48, 4\), but the base model's q_proj is \[64, 64\]"),
        "module": ({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
                    "base_model.model.lm_head.lora_B.weight": torch.zeros(331, 4)},
                   r"LoRA adapter 'module' targets modules the base model has no LoRA slot for: lm_head \(supported: "
                   r"q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj of each layer\)"),
    }
    for name, (tensors, message) in fitting.items():
        _write(tmp_path / name, cfg, tensors)
        adapter = read_peft_adapter(tmp_path / name, name, max_rank=8)
        with pytest.raises(ValueError, match=message):
            slots.check(adapter)
