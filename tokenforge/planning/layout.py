"""Choosing tensor x pipeline parallelism for a model and some GPUs (`doctor --gpus`, `--parallel auto`).

In: the model's shape, the number of GPUs, their memory each, and how many share a host. Out: a
`LayoutPlan` (TP, PP, replicas, CPU offload) and the reasons, in words. The rule, as vLLM's
guidance has it: use as few GPUs per replica as leave the KV cache real room (at least one
full-length sequence and a quarter of what the weights leave free); within a replica prefer
tensor parallelism inside one host (fast links), and pipeline stages across hosts. GPUs beyond
one replica serve more replicas. When even all GPUs cannot hold the weights, the overflow per
GPU is what `--cpu-offload-gb` would have to keep in host memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ACTIVATION_RESERVE = 0.1     # share of each GPU kept for activations and the allocator
KV_ROOM = 0.25               # share of each GPU the KV cache should get, at least


@dataclass(slots=True)
class LayoutPlan:
    tp: int
    pp: int
    replicas: int
    offload_gb: float = 0.0
    reasons: list[str] = field(default_factory=list)

    @property
    def gpus_per_replica(self) -> int:
        return self.tp * self.pp


def valid_tp_sizes(arch, limit: int) -> list[int]:
    """TP sizes the model's heads and MLP width allow, up to `limit`."""
    heads, kv = arch.num_attention_heads, arch.num_key_value_heads
    return [t for t in range(1, limit + 1)
            if heads % t == 0 and (kv % t == 0 or t % kv == 0) and arch.intermediate_size % t == 0]


def plan_layout(arch, num_gpus: int, gpu_memory: int, dtype: str = "bfloat16", max_model_len: int | None = None,
                gpus_per_node: int = 8) -> LayoutPlan:
    weights = arch.weight_bytes(dtype)
    length = max_model_len or arch.max_position_embeddings
    need_kv = max(arch.kv_bytes_per_token(dtype) * length, KV_ROOM * gpu_memory)
    usable = gpu_memory * (1 - ACTIVATION_RESERVE)
    tps = valid_tp_sizes(arch, min(num_gpus, gpus_per_node))
    for world in range(1, num_gpus + 1):
        if num_gpus % world:
            continue
        layout = _split(world, tps, arch.num_hidden_layers)
        if layout is None:
            continue
        tp, pp = layout
        per_gpu = weights / world
        if per_gpu + need_kv / world <= usable or world == num_gpus:
            plan = LayoutPlan(tp, pp, num_gpus // world)
            _explain(plan, weights, per_gpu, usable, need_kv, world, length, gpus_per_node)
            return plan
    raise ValueError(f"no tensor x pipeline layout of {num_gpus} GPUs fits the model's {arch.num_attention_heads} "
                     f"heads and {arch.num_hidden_layers} layers")


def _split(world: int, tps: list[int], layers: int) -> tuple[int, int] | None:
    """The largest allowed TP that divides `world`; pipeline stages for the rest."""
    for tp in sorted(tps, reverse=True):
        if world % tp == 0 and world // tp <= layers:
            return tp, world // tp
    return None


def _explain(plan: LayoutPlan, weights: float, per_gpu: float, usable: float, need_kv: float, world: int,
             length: int, gpus_per_node: int) -> None:
    gib = 2**30
    r = plan.reasons
    fits = per_gpu + need_kv / world <= usable
    if world == 1 and fits:
        r.append(f"the weights ({weights / gib:.1f} GiB) fit one GPU with room for the KV cache")
    elif not fits:
        r.append(f"the weights ({weights / gib:.1f} GiB) and the KV cache do not fit even all {world} GPUs "
                 f"({per_gpu / gib:.1f} GiB of weights per GPU)")
    else:
        r.append(f"the weights ({weights / gib:.1f} GiB) need {world} GPUs to leave the KV cache room "
                 f"({per_gpu / gib:.1f} GiB of weights per GPU)")
    if plan.pp > 1:
        r.append(f"tensor parallelism stays within one host ({gpus_per_node} GPUs) or the model's heads; "
                 f"{plan.pp} pipeline stages cover the rest")
    elif plan.tp > 1:
        r.append(f"TP={plan.tp}: every layer split across {plan.tp} GPUs of one host (NVLink all-reduce)")
    if plan.replicas > 1:
        r.append(f"{plan.replicas} replicas of {world} GPU(s) each: run one server per replica behind a load "
                 f"balancer; for lower batch-1 latency, raise TP instead")
    if not fits:
        plan.offload_gb = round((per_gpu + need_kv / world - usable) / 1e9, 1)
        r.append(f"about {plan.offload_gb} GB of weights per GPU would have to stay in host memory "
                 f"(--cpu-offload-gb), or quantize, or lower --max-model-len below {length:,}")
