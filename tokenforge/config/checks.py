"""Checks and parsers behind the config's `validate()` methods (sizes, the Redis URL, the KV tier
flags, speculative decoding): plain functions over a sub-config's attributes, so this module
imports nothing from the package."""

from __future__ import annotations

import os

import re

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: str | int | float | None) -> int | None:
    """Parse '8GiB', '8GB', '512MiB' or a plain byte count into bytes."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot parse size {value!r}: use a byte count or a unit such as 8GiB, 512MiB, 8GB")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def check(cond: bool, message: str) -> None:
    if not cond: raise ValueError(message)  # noqa: E701


def parse_kv_remote(url: str) -> tuple[str, list[tuple[str, int]], int]:
    """'redis://h:p/db', 'rediss://h:p' or 'redis+cluster://h1:p1,h2:p2' -> (scheme, nodes, db)."""
    m = re.fullmatch(r"(redis|rediss|redis\+cluster)://(?:[^@/]*@)?([^/?#]+)(?:/(\d*))?", url or "")
    if not m:
        raise ValueError(f"kv_remote {url!r} is not a Redis URL: use redis://host:port[/db], rediss://host:port "
                         "or redis+cluster://host1:port1,host2:port2")
    nodes = []
    for node in m.group(2).split(","):
        host, sep, port = node.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"kv_remote {url!r}: {node!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    if m.group(1) != "redis+cluster" and len(nodes) != 1:
        raise ValueError(f"kv_remote {url!r}: several nodes need the redis+cluster:// scheme")
    return m.group(1), nodes, int(m.group(3) or 0)


def validate_quantization(m, modes) -> None:
    """ModelConfig `m`'s quantization fields (`modes`: the accepted modes), each a ValueError naming the field."""
    check(m.quantization in modes,
          f"quantization must be one of {', '.join(q for q in modes if q)} (aliases 8bit, 4bit) "
          f"or unset, got {m.quantization!r}")
    if m.quantization_backend == "bitsandbytes":
        equivalent = {"int4": "int4 (bitsandbytes 4-bit)", "int8": "int8 (bitsandbytes LLM.int8)"}
        raise ValueError("quantization_backend 'bitsandbytes' is not supported: tokenforge quantizes with its own "
                         "kernels (quantization_backend='tokenforge'); use quantization="
                         + equivalent.get(m.quantization or "", "int8 (for 8-bit) or int4 (for 4-bit)"))
    check(m.quantization_backend == "tokenforge",
          f"quantization_backend must be tokenforge, got {m.quantization_backend!r}")
    g = m.quantization_group_size
    check(g >= 8 and g % 8 == 0, f"quantization_group_size must be a positive multiple of 8, got {g}")
    check(not m.quantize_lm_head or m.quantization in ("int8", "int4", "fp8", "fp8-sim"),
          "quantize_lm_head needs a quantization mode")
    check(not m.quantization_calibration or m.quantization == "int4",
          f"quantization_calibration applies to quantization='int4' only (GPTQ rounding of int4 groups), got "
          f"quantization={m.quantization!r}")
    check(m.prune_rate is None or 0.0 <= m.prune_rate < 1.0, f"prune_rate must be in [0, 1), got {m.prune_rate}")
    check(m.sparsity in (None, "2:4"),
          f"sparsity {m.sparsity!r} is not supported: only 2:4 semi-structured sparsity (what sparse "
          "tensor cores run)")
    check(not (m.sparsity and m.quantization),
          f"sparsity 2:4 cannot be combined with quantization={m.quantization!r}: pick one")


def validate_kv_tiers(c) -> None:
    for name in ("kv_offload_cpu_gb", "kv_offload_disk_gb"):
        check(getattr(c, name) >= 0, f"{name} must be >= 0, got {getattr(c, name)}")
    check(c.kv_remote_ttl >= 1, f"kv_remote_ttl must be >= 1 second, got {c.kv_remote_ttl}")
    if c.kv_remote is not None:
        parse_kv_remote(c.kv_remote)
    check(c.kv_remote_write_through is None or c.kv_remote is not None,
           f"kv_remote_write_through={c.kv_remote_write_through} needs a remote tier (kv_remote=redis://...)")
    check(not c.kv_tiers_enabled or c.enable_prefix_caching,
           "the KV offload tiers are keyed by prefix-cache hashes: they need prefix caching on")
    if c.kv_offload_disk_dir is None:
        check(not c.kv_offload_disk_gb, "kv_offload_disk_gb needs kv_offload_disk_dir")
        return
    check(c.kv_offload_disk_gb > 0, "kv_offload_disk_dir needs a size: kv_offload_disk_gb > 0")
    d = c.kv_offload_disk_dir
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        raise ValueError(f"kv_offload_disk_dir {d!r} cannot be created: {e.strerror}") from None
    check(os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK), f"kv_offload_disk_dir {d!r} is not a writable directory")


SPECULATIVE_METHODS = ("ngram", "draft", "eagle")
SPECULATIVE_METHODS_BUILT = ("ngram", "draft", "eagle")


def validate_speculative(c) -> None:
    m = c.speculative_method
    if m is None:
        check(c.num_speculative_tokens is None and c.speculative_model is None and not c.speculative_tree,
               "num_speculative_tokens, speculative_model and speculative_tree need speculative_method")
        return
    check(m in SPECULATIVE_METHODS,
           f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, got {m!r}")
    check(m in SPECULATIVE_METHODS_BUILT,
           f"speculative_method={m!r} is not implemented yet; available: {', '.join(SPECULATIVE_METHODS_BUILT)}")
    k = c.num_draft_tokens
    check(isinstance(k, int) and 1 <= k <= 16, f"num_speculative_tokens must be between 1 and 16, got {k!r}")
    if m == "ngram":
        check(c.speculative_model is None,
               "speculative_model is for the draft and eagle methods: ngram looks drafts up in the request itself")
        check(1 <= c.ngram_min <= c.ngram_max,
               f"need 1 <= ngram_min <= ngram_max, got {c.ngram_min} and {c.ngram_max}")
    else:
        check(c.speculative_model is not None,
              f"speculative_method={m!r} needs speculative_model (the path of the "
              f"{'EAGLE head' if m == 'eagle' else 'draft model'})")
    check(c.pipeline_steps == 1, "speculative decoding does not combine with pipeline_steps > 1 yet")
    if c.speculative_tree:
        check(m == "eagle", f"speculative_tree drafts a tree with an EAGLE head: it needs speculative_method='eagle', "
                            f"got {m!r}")
        check(c.max_num_seqs in (None, 1), f"speculative_tree verifies one sequence per step (batch 1): it needs "
                                           f"max_num_seqs=1, got {c.max_num_seqs}")
