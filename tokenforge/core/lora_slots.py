"""Which LoRA adapter sits in which device slot: policy on plain data, no torch.

In: requests as the scheduler admits, preempts and finishes them (`Request.lora_key`, the
adapter's content fingerprint; None for the base model). Out: each running request's
`lora_slot` (-1 for the base), and per step the slot writes the executor performs before that
step's forward (`LoRASlotLoad`). A slot is held while any running request uses its adapter, so
the adapters of one step are at most the slot count (`--max-loras`); a request whose adapter
finds no slot waits (`can_admit`) while others run, but not forever: once one has been overtaken
in `patience` schedules (refused while a request that arrived after its first refusal joined a
held slot), one slot drains to it (the one whose adapter has the fewest requests still waiting,
then the fewest running: its adapter admits no new request until the slot is free and taken),
while the other slots keep admitting their adapters' requests, and no new adapter takes a free
slot before it (base requests still run). Only later arrivals count: requests already queued when
it was refused are finite, so the held slots free on their own and in queue order; draining one
for them would cut an adapter's queued requests off from their slot (a batch over many adapters
split into an extra, nearly empty wave: W2 over 64 adapters and 16 slots took 1,305 steps instead
of 1,050). A released slot keeps its adapter: the next request of it reuses the slot without a
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
        self._refusals: dict[str, int] = {}        # request id -> schedules in which it was overtaken
        self._since: dict[str, int] = {}           # request id -> arrivals before its first refusal
        self._refused: list = []                   # this schedule's refused requests, in queue order
        self._overtaken: set[str] = set()          # those of them counted in this schedule
        self._waiting = ()                         # the waiting queue of this schedule
        self._arrivals = 0
        self._starving = None                      # the request a slot drains to, once one waited too long
        self._draining = -1                        # that slot

    def begin_schedule(self, waiting=(), arrivals: int = 0) -> None:
        """A pass over the waiting queue starts (the scheduler calls it before `can_admit`):
        `waiting`, its requests; `arrivals`, how many requests have arrived so far (a request's
        `arrival_seq` is the count before it)."""
        self._refused.clear()
        self._overtaken.clear()
        self._waiting = waiting
        self._arrivals = arrivals

    def can_admit(self, req) -> bool:
        if req.lora_key is None:
            return True
        slot = self.slot_of.get(req.lora_key)
        if self._starving is not None and self._starving is not req:
            ok = slot is not None and slot != self._draining and self.refs[slot] > 0   # free slots wait for it
        else:
            ok = slot is not None or bool(self._idle)
        if not ok:
            self._refused.append(req)
            self._since.setdefault(req.request_id, self._arrivals)
        return ok

    def acquire(self, req) -> None:
        """Give an admitted request its adapter's slot (writing the adapter there if needed)."""
        key = req.lora_key
        if key is None:
            return
        self._forget(req)
        self._count_overtaken(req)
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

    def _count_overtaken(self, req) -> None:
        """`req`, being admitted, overtakes the requests refused before it in this schedule that
        were first refused before it arrived; the first overtaken `patience` times starves."""
        for waiting in self._refused:
            rid = waiting.request_id
            since = self._since.get(rid)            # None: admitted or gone since its refusal
            if since is None or rid in self._overtaken or req.arrival_seq < since:
                continue
            self._overtaken.add(rid)
            count = self._refusals[rid] = self._refusals.get(rid, 0) + 1
            if self._starving is None and count >= self.patience:
                self._starving = waiting
                self._draining = self._slot_to_drain()

    def _slot_to_drain(self) -> int:
        """Draining a slot whose adapter still has requests waiting would cut them off from it
        (they wait a whole round more): the slot with the fewest of those, then of running ones."""
        queued = [0] * len(self.refs)
        for req in self._waiting:
            slot = self.slot_of.get(req.lora_key) if req.lora_key is not None else None
            if slot is not None:
                queued[slot] += 1
        return min(range(len(self.refs)), key=lambda s: (queued[s], self.refs[s]))

    def _forget(self, req) -> None:
        self._refusals.pop(req.request_id, None)
        self._since.pop(req.request_id, None)
        if self._starving is req:
            self._starving, self._draining = None, -1

    def take_loads(self) -> list[LoRASlotLoad]:
        loads, self._loads = self._loads, []
        return loads
