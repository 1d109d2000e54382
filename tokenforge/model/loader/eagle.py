"""EAGLE heads in the layout their authors publish (and vLLM / SGLang load): a directory with a
config.json (a Llama config of one layer; EAGLE-3's names LlamaForCausalLMEagle3 and has
draft_vocab_size) and the weights as *.safetensors or pytorch_model.bin. `save_eagle_head`
writes the same layout (what `tokenforge train --draft-head eagle` exports).

`read_eagle_spec` tells the two apart (the architecture name, else the fc's input width) and
`check_eagle_head` refuses a head that cannot run on the target (hidden size, vocabulary, the
EAGLE-3 feature layers) from the config and tensor shapes alone, before any model loads.
EAGLE-3's feature layers: `eagle_aux_hidden_state_layer_ids` (top level or in `eagle_config`),
in vLLM's numbering (id j: the residual stream entering target layer j), else vLLM's default.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from tokenforge.model.arch_config import ArchConfig, config_int, rope_scaling_dict
from tokenforge.model.loader.safetensors_mmap import MappedSafetensors
from tokenforge.model.models.eagle import EagleHead, EagleSpec, default_aux_layers
from tokenforge.source import read_json_object

BIN_FILE = "pytorch_model.bin"


def _files(path: Path) -> list[Path]:
    found = sorted(p for p in path.glob("*.safetensors"))
    if not found and (path / BIN_FILE).is_file():
        found = [path / BIN_FILE]
    if not found:
        raise ValueError(f"EAGLE head {str(path)!r} has a config.json but no *.safetensors or {BIN_FILE}")
    return found


def _load_bin(file: Path, device: str) -> dict[str, torch.Tensor]:
    """A pytorch_model.bin's tensors; a file torch cannot read (cut short, not a checkpoint) is one
    ValueError naming it."""
    try:
        state = torch.load(file, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, UnpicklingError, EOFError, ...
        raise ValueError(f"{file} is not a readable PyTorch checkpoint ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{file} does not hold a dict of tensors")
    return state


def eagle_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in _files(Path(path)):
        if file.suffix == ".bin":
            yield from _load_bin(file, "cpu").items()
            continue
        mapped = MappedSafetensors(file)
        try:
            for name in mapped.keys():
                yield name, mapped.tensor(name)
        finally:
            mapped.close()


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for file in _files(path):
        if file.suffix == ".bin":
            shapes.update((k, tuple(v.shape)) for k, v in _load_bin(file, "meta").items())
        else:
            mapped = MappedSafetensors(file)
            try:
                shapes.update((k, tuple(mapped.tensor(k).shape)) for k in mapped.keys())
            finally:
                mapped.close()
    return {k[len("model."):] if k.startswith("model.") else k: v for k, v in shapes.items()}


def read_eagle_spec(path: str | Path, num_target_layers: int | None = None) -> EagleSpec:
    """The head's spec from its config.json and tensor names (no weights read)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"speculative_model {str(path)!r} is not an EAGLE head directory (no config.json)")
    cfg = read_json_object(config_file)
    archs = [a for a in cfg.get("architectures") or [] if isinstance(a, str)]
    shapes = _shapes(path)
    hidden = config_int(cfg, "hidden_size")
    fc = shapes.get("fc.weight")
    if fc is None:
        raise ValueError(f"speculative_model {str(path)!r} has no fc.weight: not an EAGLE or EAGLE-3 head")
    v3 = any("eagle3" in a.lower() for a in archs) or "draft_vocab_size" in cfg or fc[1] != 2 * hidden
    arch = ArchConfig.from_hf_config({**cfg, "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False})
    target_hidden = config_int(cfg, "target_hidden_size", hidden)
    aux: tuple[int, ...] = ()
    if v3:
        eagle_cfg = cfg.get("eagle_config") or {}
        ids = cfg.get("eagle_aux_hidden_state_layer_ids") or eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
        if ids:
            aux = tuple(int(i) for i in ids)
        elif num_target_layers is not None:
            aux = default_aux_layers(num_target_layers)
        else:
            aux = (0,) * (fc[1] // target_hidden)
        if arch.num_hidden_layers != 1:
            raise ValueError(f"EAGLE-3 head {str(path)!r} has {arch.num_hidden_layers} layers; one is supported")
    return EagleSpec(version=3 if v3 else 1, arch=arch, target_hidden_size=target_hidden,
                     draft_vocab_size=config_int(cfg, "draft_vocab_size", arch.vocab_size), aux_layer_ids=aux,
                     fc_bias="fc.bias" in shapes or bool(cfg.get("eagle_fc_bias", False)),
                     norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                     own_embedding=v3 and "embed_tokens.weight" in shapes)


def check_eagle_head(path: str | Path, target: ArchConfig) -> EagleSpec:
    """One clear error for a head the target cannot run; returns its spec."""
    try:
        spec = read_eagle_spec(path, target.num_hidden_layers)
    except (OSError, KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"speculative_model {str(path)!r} cannot be read as an EAGLE head: {e}") from None
    name = "EAGLE-3" if spec.version == 3 else "EAGLE"
    if spec.target_hidden_size != target.hidden_size or (spec.version == 1 and spec.arch.hidden_size != target.hidden_size):
        raise ValueError(f"the {name} head {str(path)!r} has hidden size {spec.target_hidden_size}, the target "
                         f"{target.hidden_size}: it was trained for another model")
    if spec.arch.vocab_size != target.vocab_size:
        raise ValueError(f"the {name} head {str(path)!r} has a vocabulary of {spec.arch.vocab_size} tokens, the target "
                         f"{target.vocab_size}: it was trained for another model")
    if spec.draft_vocab_size > target.vocab_size:
        raise ValueError(f"the {name} head {str(path)!r} has a draft vocabulary of {spec.draft_vocab_size} tokens, "
                         f"more than the target's {target.vocab_size}")
    fc_in = _shapes(Path(path))["fc.weight"][1]
    expected = 2 * spec.arch.hidden_size if spec.version == 1 else len(spec.aux_layer_ids) * target.hidden_size
    if fc_in != expected:
        raise ValueError(f"the {name} head {str(path)!r} has an fc of input width {fc_in}, expected {expected}")
    bad = [i for i in spec.aux_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        raise ValueError(f"the EAGLE-3 head {str(path)!r} reads target layers {list(spec.aux_layer_ids)}, the target has "
                         f"{target.num_hidden_layers}")
    return spec


def load_eagle_head(path: str | Path, target_model, dtype: torch.dtype, device: torch.device | str) -> EagleHead:
    spec = check_eagle_head(path, target_model.config)
    with torch.device(device):
        head = EagleHead(spec, dtype)
    head.load_weights(eagle_tensors(path))
    head.share(target_model)
    return head.eval()


def save_eagle_head(head: EagleHead, out: str | Path, dtype: torch.dtype = torch.float32, extra: dict | None = None) -> Path:
    """config.json + model.safetensors with the authors' tensor names (unfused q/k/v, gate/up)."""
    from safetensors.torch import save_file  # noqa: PLC0415

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec, arch = head.spec, head.spec.arch
    tensors: dict[str, torch.Tensor] = {}
    for name, t in head.state_dict().items():
        if name.startswith(("_target", "embed_tokens")) and not spec.own_embedding:
            continue
        layer = head.layers[0].self_attn if "qkv_proj" in name else None
        if layer is not None:
            q, kv = layer.qkv_proj.q_size, layer.qkv_proj.kv_size
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv], dim=0)):
                tensors[name.replace("qkv_proj", part)] = piece
        elif "gate_up_proj" in name:
            for part, piece in zip(("gate_proj", "up_proj"), t.chunk(2, dim=0)):
                tensors[name.replace("gate_up_proj", part)] = piece
        else:
            tensors[name] = t
    if spec.version == 3:
        tensors = {k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}
    tensors = {k: (v if k == "d2t" else v.to(dtype)).detach().cpu().contiguous() for k, v in tensors.items()}
    if spec.version == 3:      # the authors' target-vocabulary mask beside d2t (loaders that want it)
        t2d = torch.zeros(arch.vocab_size, dtype=torch.bool)
        t2d[torch.arange(spec.draft_vocab_size) + tensors["d2t"]] = True
        tensors["t2d"] = t2d
    save_file(tensors, str(out / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3" if spec.version == 3 else "LlamaForCausalLM"],
              "model_type": "llama", "hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
              "num_hidden_layers": arch.num_hidden_layers, "num_attention_heads": arch.num_attention_heads,
              "num_key_value_heads": arch.num_key_value_heads, "head_dim": arch.head_dim,
              "vocab_size": arch.vocab_size, "rms_norm_eps": arch.rms_norm_eps, "rope_theta": arch.rope_theta,
              "max_position_embeddings": arch.max_position_embeddings, "hidden_act": "silu",
              "torch_dtype": str(dtype).removeprefix("torch."), "bias": spec.fc_bias,
              "attention_bias": arch.attention_bias, "mlp_bias": arch.mlp_bias, **(extra or {})}
    if arch.rope_scaling is not None:      # the rotary the head was trained with (Llama 3.1's, YaRN's)
        config["rope_scaling"] = rope_scaling_dict(arch.rope_scaling)
    if spec.version == 3:
        config.update(draft_vocab_size=spec.draft_vocab_size, target_hidden_size=spec.target_hidden_size,
                      eagle_config={"eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids)})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
