"""Small pre-quantized checkpoints for the loader tests, built the way their producers build them:
compressed-tensors with the `compressed-tensors` library itself (scales from min-max, then the
library's compressor and config writer), AWQ with its documented GEMM packing. Each builder also
returns the dequantized reference: an HF model whose weights are what the format dequantizes to."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-5,
              initializer_range=0.08, tie_word_embeddings=False)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()


def _linears(model) -> list[tuple[str, torch.nn.Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n]


def fp8_activation_hooks(model, static_scale: float | None) -> None:
    """Simulate fp8 activations on every quantized linear: per token (dynamic) or per tensor."""
    def hook(_module, args):
        x = args[0].float()
        s = torch.tensor(static_scale) if static_scale else (x.abs().amax(-1, keepdim=True) / 448).clamp_min(1e-12)
        return ((x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).to(args[0].dtype),
    for _, m in _linears(model):
        m.register_forward_pre_hook(hook)


def compressed_tensors_checkpoint(path: Path, preset: str, static_scale: float = 0.05):
    """(checkpoint dir, dequantized HF reference) for a compressed-tensors preset."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    model = tiny_llama()
    reference = copy.deepcopy(model)
    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, ignore=["lm_head"])
    apply_quantization_config(model, qc)
    ref_linears = dict(_linears(reference))
    for name, m in _linears(model):
        args, w = m.quantization_scheme.weights, m.weight.detach()
        if args.strategy == "group":
            wv = w.reshape(w.shape[0], -1, args.group_size)
            lo, hi = wv.amin(-1), wv.amax(-1)
        elif args.strategy == "channel":
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        else:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        scale, zero = calculate_qparams(lo, hi, args)
        m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
        m.weight_zero_point.data.copy_(zero.reshape(m.weight_zero_point.shape))
        if hasattr(m, "input_scale"):
            m.input_scale.data.fill_(static_scale)
        ref_linears[name].weight.data = fake_quantize(w, m.weight_scale, m.weight_zero_point, args)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(str(path))
    if preset.startswith("FP8"):
        fp8_activation_hooks(reference, static_scale if preset == "FP8" else None)
    return path, reference


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] in [0, 15] -> int32 [R, C/8]: nibble i of word c holds column 8c + AWQ_ORDER[i]."""
    v = values.to(torch.int64).reshape(values.shape[0], -1, 8)
    packed = torch.zeros(v.shape[:2], dtype=torch.int64)
    for i, col in enumerate(AWQ_ORDER):
        packed |= v[..., col] << (4 * i)
    return (packed - (packed >= 2**31).long() * 2**32).to(torch.int32)      # the same bits, as int32


def awq_checkpoint(path: Path, group: int = 64):
    """(checkpoint dir, dequantized HF reference) in AutoAWQ's GEMM layout."""
    model = tiny_llama(seed=1)
    reference = copy.deepcopy(model)
    ref_linears = dict(_linears(reference))
    tensors = {n: t.contiguous() for n, t in model.state_dict().items()}
    for name, m in _linears(model):
        w = m.weight.detach()                                       # [N, K]
        wg = w.reshape(w.shape[0], -1, group)
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-6).half()             # [N, K/G]
        zero = (-lo / scale.float()).round().clamp(0, 15)
        q = (wg / scale.float()[..., None]).round().add(zero[..., None]).clamp(0, 15).reshape(w.shape)
        del tensors[name + ".weight"]
        tensors[name + ".qweight"] = _pack_awq(q.t().contiguous())          # [K, N/8]
        tensors[name + ".qzeros"] = _pack_awq(zero.t().contiguous())        # [K/G, N/8]
        tensors[name + ".scales"] = scale.t().contiguous()                  # [K/G, N] fp16
        deq = (q.reshape(wg.shape) - zero[..., None]) * scale.float()[..., None]
        ref_linears[name].weight.data = deq.reshape(w.shape)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    config = {**model.config.to_dict(), "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}}
    (path / "config.json").write_text(json.dumps(config))
    return path, reference
