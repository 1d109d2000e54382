"""Which LoRA adapter sits in which device slot: policy on plain data, no torch.

In: requests as the scheduler admits, preempts and finishes them (`Request.lora_key`, the
adapter's content fingerprint; None for the base model). Out: each running request's
`lora_slot` (-1 for the base), and per step the slot writes the executor performs before that
step's forward (`LoRASlotLoad`). A slot is held while any running request uses its adapter, so
the adapters of one step are at most the slot count (`--max-loras`); a request whose adapter
finds no slot waits (`can_admit`) while others run, but not forever: once one has been refused
`patience` times, one slot drains to it (the one fewest running requests hold: its adapter
admits no new request until the slot is free and taken), while the other slots keep admitting
their adapters' requests, and no new adapter takes a free slot before it (base requests still
run). A released slot keeps its adapter: the next request of it reuses the slot without a
write; a new adapter takes the least recently released.
The device runs its steps in order, so a write queued for step N+1 lands after step N's forward
read the slot's old adapter.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tokenforge.messages import LoRARequest


@dataclass(slots=True)
class LoRASlotLoad:
    slot: int
    lora: LoRARequest
    key: str                        # the adapter's fingerprint (the executor's host-cache key)


class LoRASlotTable:
    def __init__(self, num_slots: int, patience: int = 32) -> None:
        self.keys: list[str | None] = [None] * num_slots
        self.refs = [0] * num_slots
        self.slot_of: dict[str, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))  # refs 0, LRU first
        self._loads: list[LoRASlotLoad] = []
        self.num_swaps = 0
        self.patience = patience
        self._refusals: dict[str, int] = {}        # request id -> schedules that found no slot for it
        self._starving = None                      # the request a slot drains to, once one waited too long
        self._draining = -1                        # that slot

    def can_admit(self, req) -> bool:
        if req.lora_key is None:
            return True
        slot = self.slot_of.get(req.lora_key)
        if self._starving is not None and self._starving is not req:
            return slot is not None and slot != self._draining and self.refs[slot] > 0   # free slots wait for it
        if slot is not None or self._idle:
            return True
        refused = self._refusals[req.request_id] = self._refusals.get(req.request_id, 0) + 1
        if refused >= self.patience:
            self._starving = req
            self._draining = min(range(len(self.refs)), key=lambda s: self.refs[s])
        return False

    def acquire(self, req) -> None:
        """Give an admitted request its adapter's slot (writing the adapter there if needed)."""
        key = req.lora_key
        if key is None:
            return
        self._forget(req)
        slot = self.slot_of.get(key)
        if slot is None:
            slot, _ = self._idle.popitem(last=False)
            old = self.keys[slot]
            if old is not None:
                del self.slot_of[old]
            self.keys[slot], self.slot_of[key] = key, slot
            self._loads.append(LoRASlotLoad(slot, req.lora, key))
            self.num_swaps += 1
        elif self.refs[slot] == 0:
            del self._idle[slot]
        self.refs[slot] += 1
        req.lora_slot = slot

    def release(self, req) -> None:
        """The request stops running (finished, aborted, preempted), or leaves the queue (aborted)."""
        self._forget(req)
        slot = req.lora_slot
        if slot < 0:
            return
        req.lora_slot = -1
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            self._idle[slot] = None

    def _forget(self, req) -> None:
        self._refusals.pop(req.request_id, None)
        if self._starving is req:
            self._starving, self._draining = None, -1

    def take_loads(self) -> list[LoRASlotLoad]:
        loads, self._loads = self._loads, []
        return loads
