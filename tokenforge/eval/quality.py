"""The quality table (`tokenforge eval quality`): perplexity of every quantization and pruning mode.

In: a text, the base engine flags, window and stride. Out: one row per variant (perplexity and
the change against float32 on the same text and windows, with the issue's target), printed as a
table and returned as dicts for the JSON.

Each variant is one set of engine keyword arguments laid over the base flags. A variant the
engine refuses (an unknown argument, or a ValueError such as a mode this build or device does
not have) is reported as "not available" with the engine's reason, never a crash, so the table
runs on any build and fills in as modes land. FP8 rows on the CPU are marked "simulated": there
the values are quantized to e4m3 and dequantized, and the arithmetic runs in float32.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field

from tokenforge.eval.perplexity import perplexity, text_token_ids

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    kwargs: dict = field(default_factory=dict)
    target_pct: float | None = None       # the ceiling on the perplexity change, in %
    fp8: bool = False                     # simulated on the CPU
    cpu_kwargs: dict = field(default_factory=dict)   # laid over kwargs on the CPU

    def kwargs_for(self, device: str) -> dict:
        return {**self.kwargs, **self.cpu_kwargs} if device == "cpu" else dict(self.kwargs)


BASELINE = Variant("float32", {"dtype": "float32"})
VARIANTS: tuple[Variant, ...] = (
    BASELINE,
    Variant("int8", {"dtype": "float32", "quantization": "int8"}, 1.5),
    Variant("int4 g128", {"dtype": "float32", "quantization": "int4", "quantization_group_size": 128}, 8.0),
    # g128 does not divide a hidden size of 576 (the bundled SmolLM2), which int4 refuses; g64 does
    Variant("int4 g64", {"dtype": "float32", "quantization": "int4", "quantization_group_size": 64}),
    Variant("int4 g64 GPTQ", {"dtype": "float32", "quantization": "int4", "quantization_group_size": 64,
                              "quantization_calibration": "builtin"}, 8.0),
    Variant("int8 + lm_head", {"dtype": "float32", "quantization": "int8", "quantize_lm_head": True}),   # vs int8: <= +1%
    Variant("fp8 W8A8", {"dtype": "float32", "quantization": "fp8"}, 3.0, fp8=True,
            cpu_kwargs={"quantization": "fp8-sim"}),
    Variant("fp8 KV", {"dtype": "float32", "kv_cache_dtype": "fp8"}, 1.0, fp8=True),
    Variant("2:4 sparsity", {"dtype": "float32", "sparsity": "2:4"}),
    Variant("prune 0.2", {"dtype": "float32", "prune_rate": 0.2}),
)


def _llm(kwargs: dict):
    from tokenforge.engine.llm import LLM  # noqa: PLC0415 - heavy; only when a table runs

    return LLM(**kwargs)


def measure(variant: Variant, base: dict, text: str, window: int, stride: int) -> dict:
    """One row: the variant's perplexity, or why the engine would not build it."""
    from tokenforge.config import DeviceConfig  # noqa: PLC0415

    device = DeviceConfig(device=base.get("device") or "auto").resolved_device()
    kwargs = {**base, **variant.kwargs_for(device)}
    row: dict = {"variant": variant.name, "engine_kwargs": variant.kwargs_for(device),
                 "target_pct": variant.target_pct}
    try:
        llm = _llm(kwargs)
    except (TypeError, ValueError, NotImplementedError) as exc:
        row.update(available=False, reason=f"{type(exc).__name__}: {exc}")
        logger.info("variant %s not available: %s", variant.name, exc)
        return row
    try:
        device = llm.engine.executor.runner.device.type
        result = perplexity(llm, text_token_ids(llm, text), window, stride)
    finally:
        del llm
        gc.collect()
    row.update(available=True, simulated=variant.fp8 and device == "cpu", device=device, **result.as_dict())
    return row


def quality_table(text: str, base: dict, window: int = 512, stride: int = 256,
                  variants: tuple[Variant, ...] = VARIANTS) -> list[dict]:
    """Every variant's row, with delta_pct against the float32 baseline (measured first)."""
    if variants[0] is not BASELINE:
        variants = (BASELINE, *[v for v in variants if v is not BASELINE])
    rows = [measure(v, base, text, window, stride) for v in variants]
    ref = rows[0].get("perplexity")
    if ref is None:
        raise ValueError(f"the float32 baseline did not run: {rows[0].get('reason')}")
    for row in rows:
        if row.get("available"):
            row["delta_pct"] = 100.0 * (row["perplexity"] / ref - 1.0)
            if row["target_pct"] is not None:
                row["meets_target"] = row["delta_pct"] <= row["target_pct"]
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'variant':<14} {'perplexity':>10} {'delta %':>8} {'target':>7}  note",
             f"{'-' * 14} {'-' * 10} {'-' * 8} {'-' * 7}  {'-' * 30}"]
    for r in rows:
        target = f"<=+{r['target_pct']:g}" if r["target_pct"] is not None else "-"
        if not r.get("available"):
            lines.append(f"{r['variant']:<14} {'-':>10} {'-':>8} {target:>7}  not available ({r['reason'][:90]})")
            continue
        notes = []
        if r.get("simulated"):
            notes.append("simulated (quantize-dequantize on the CPU)")
        if "meets_target" in r:
            notes.append("meets target" if r["meets_target"] else "MISSES target")
        lines.append(f"{r['variant']:<14} {r['perplexity']:>10.4f} {r['delta_pct']:>+8.2f} {target:>7}  "
                     f"{'; '.join(notes)}")
    return "\n".join(lines)
