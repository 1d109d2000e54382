"""The worker's LoRA adapters: host copies (LRU, `--max-cpu-loras`) and the device slots.

In: `LoRARequest`s to register (`add`: read from disk, checked against the model, kept in host
memory; returns the adapter's fingerprint, which the scheduler keys slots and the prefix cache
by), names to forget (`remove`), and each step's slot writes (`apply`, from
`SchedulerOutput.lora_loads`, queued on the device before the step's forward). An adapter evicted
from host memory but still wanted by a request is read again from its path; if its files changed
since it was registered, the write fails rather than serve other weights under the old key.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from tokenforge.config import LoRAConfig
from tokenforge.messages import LoRARequest
from tokenforge.model.loader.peft import PeftAdapter, read_peft_adapter
from tokenforge.model.lora import ModelLoRASlots

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: torch.nn.Module, config: LoRAConfig, device: torch.device) -> None:
        self.config, self.device = config, device
        self.slots = ModelLoRASlots(model, config.max_loras, config.max_lora_rank)
        self.host: OrderedDict[str, PeftAdapter] = OrderedDict()     # fingerprint -> adapter, LRU first
        logger.info("LoRA: %d device slots of rank %d on %d linears; %d adapters in host memory",
                    config.max_loras, config.max_lora_rank, len(self.slots.linears), config.host_capacity)

    def add(self, lora: LoRARequest) -> str:
        """Read and check the adapter (ValueError naming it if it does not fit); its fingerprint."""
        adapter = read_peft_adapter(lora.lora_path, lora.lora_name, self.config.max_lora_rank)
        self.slots.check(adapter)
        self._keep(self._to_host_format(adapter))
        return adapter.fingerprint

    def _to_host_format(self, adapter: PeftAdapter) -> PeftAdapter:
        """In the model's dtype (the adapter stays in it on quantized bases too), pinned on CUDA so
        slot writes are asynchronous copies."""
        dtype = next(iter(self.slots.linears.values())).params_dtype
        pin = self.device.type == "cuda"
        adapter.modules = {k: (a.to(dtype).pin_memory() if pin else a.to(dtype), b.to(dtype).pin_memory() if pin
                               else b.to(dtype)) for k, (a, b) in adapter.modules.items()}
        return adapter

    def remove(self, name: str) -> int:
        """Drop the host copies registered under `name`; how many were dropped."""
        keys = [k for k, a in self.host.items() if a.name == name]
        for key in keys:
            del self.host[key]
        return len(keys)

    def apply(self, loads) -> None:
        for load in loads:
            adapter = self.host.get(load.key)
            if adapter is None:
                adapter = self._reread(load.lora, load.key)
            self.host.move_to_end(load.key)
            self.slots.write(load.slot, adapter)

    def _keep(self, adapter: PeftAdapter) -> None:
        self.host[adapter.fingerprint] = adapter
        self.host.move_to_end(adapter.fingerprint)
        while len(self.host) > self.config.host_capacity:
            evicted, _ = self.host.popitem(last=False)
            logger.debug("LoRA: adapter %s evicted from host memory", evicted[:12])

    def _reread(self, lora: LoRARequest, key: str) -> PeftAdapter:
        adapter = read_peft_adapter(lora.lora_path, lora.lora_name, self.config.max_lora_rank)
        if adapter.fingerprint != key:
            raise RuntimeError(f"LoRA adapter {lora.lora_name!r}: the files under {lora.lora_path} changed since it "
                               "was loaded; load it again under a new name")
        self._keep(self._to_host_format(adapter))
        return adapter
