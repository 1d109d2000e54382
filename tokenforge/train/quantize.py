"""`tokenforge quantize MODEL --out DIR`: an int4 checkpoint in compressed-tensors' W4A16 layout.

In: a model source (the bundled GGUF, a .gguf file or an HF directory), its tokenizer, the group
size and, for GPTQ rounding, the encoded calibration text. Out: DIR with config.json (the HF
config plus `quantization_config`: compressed-tensors, pack-quantized, int4 asymmetric groups),
model.safetensors and the tokenizer, which `--model DIR` then loads as a pre-quantized checkpoint
(model/quant/compressed_tensors.py).

The codes are the ones `--quantization int4 [--quantization-calibration ...]` computes at load
(the same load in float32, the same calibrate_int4 / quantize_int4_groups), so the checkpoint
loads to the same weights and logits as that mode. Per HF linear: `weight_packed` int32
[N, K/8] (code k at bits 4(k mod 8); a code is the signed value + 8), `weight_scale` [N, K/G],
`weight_zero_point` int32 [N/8, K/G] (packed along the output dim, the same + 8) and
`weight_shape` [2]. Our fused qkv and gate_up rows are split back into HF's projections
(export.to_hf_tensors); the lm_head and the embedding are written in `dtype`, unquantized.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenforge.model.arch_config import ArchConfig
from tokenforge.model.loader import load_model, read_arch_config
from tokenforge.model.quant import linear_layers
from tokenforge.model.quant.calibrate import calibrate_int4
from tokenforge.model.quant.int4 import check_group_size, quantize_int4_groups
from tokenforge.train.export import hf_config, save_tokenizer, to_hf_tensors


def check_int4_shapes(cfg: ArchConfig, group: int) -> None:
    """The group size divides every linear's input (before any weight loads)."""
    for name, k in (("the attention and MLP inputs (hidden_size)", cfg.hidden_size),
                    ("o_proj (heads x head_dim)", cfg.num_attention_heads * cfg.head_dim),
                    ("down_proj (intermediate_size)", cfg.intermediate_size)):
        check_group_size(k, group, name)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] (int4.py's layout: low nibble = even k) -> codes uint8 [N, K]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def pack_int32(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [R, 8C] in [0, 15] -> int32 [R, C]: element 8c + i at bits 4i of word c."""
    v = codes.to(torch.int64).reshape(codes.shape[0], -1, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = (v << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def quantization_config(group: int) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": group,
               "dynamic": False, "actorder": None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def w4a16_tensors(codes: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], cfg: ArchConfig,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """{our linear name: (packed, scale, zero)} -> the HF-named compressed-tensors tensors."""
    ours: dict[str, torch.Tensor] = {}
    for name, (packed, scale, zero) in codes.items():
        ours[f"{name}.weight"] = unpack_int4(packed)
        ours[f"{name}.weight_scale"] = scale
        ours[f"{name}.weight_zero_point"] = zero
    split = to_hf_tensors(ours, cfg)
    out: dict[str, torch.Tensor] = {}
    for key, q in split.items():
        if not key.endswith(".weight"):
            continue
        base = key.removesuffix(".weight")
        zero = split[f"{base}.weight_zero_point"].round().to(torch.uint8)
        out[f"{base}.weight_packed"] = pack_int32(q)
        out[f"{base}.weight_scale"] = split[f"{base}.weight_scale"].to(dtype).contiguous()
        out[f"{base}.weight_zero_point"] = pack_int32(zero.t().contiguous()).t().contiguous()
        out[f"{base}.weight_shape"] = torch.tensor(list(q.shape), dtype=torch.int64)
    return out


def quantize_checkpoint(model: str | None, tokenizer, out_dir: Path, group: int,
                        calibration_ids: list[int] | None = None, dtype: torch.dtype = torch.float32) -> dict:
    """Write the checkpoint into out_dir (replacing it, through a temporary directory); returns a summary."""
    cfg = read_arch_config(model)
    check_int4_shapes(cfg, group)
    loaded = load_model(model, "auto", torch.float32, "cpu")
    net, cfg = loaded.model, loaded.arch_config
    layers = linear_layers(net)
    if calibration_ids:
        calibrate_int4(net, layers, calibration_ids, group)
        codes = {name: layer.__dict__.pop("calibrated_int4") for name, layer in layers}
    else:
        codes = {name: quantize_int4_groups(layer.weight.detach(), group, torch.float32) for name, layer in layers}
    quantized = {f"{name}.weight" for name in codes}
    rest = {k: v.to(dtype) for k, v in net.state_dict().items()
            if k not in quantized and k.endswith(".weight") and not k.endswith("_weight")}
    tensors = {**to_hf_tensors(rest, cfg), **w4a16_tensors(codes, cfg, dtype)}
    config = {**hf_config(cfg, dtype), "quantization_config": quantization_config(group)}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        save_tokenizer(tokenizer, tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": str(out_dir), "linears": len(codes), "group_size": group,
            "rounding": "gptq" if calibration_ids else "round-to-nearest",
            "bytes": (out_dir / "model.safetensors").stat().st_size}


__all__ = ["check_int4_shapes", "pack_int32", "quantization_config", "quantize_checkpoint", "w4a16_tensors"]
