"""Which replica gets a request.

prefix (default): rendezvous hashing (highest random weight), a consistent hash: every replica
scores sha256(key + url) and the best score wins, so adding or removing one replica moves only
the keys that were its own. The key is the prompt's prefix hash (engine/prefix_hasher.py), so
requests that share their first blocks meet on the replica that holds them in its prefix cache.
Load decides when there is no key (a prompt shorter than a block) and overrides an overloaded
choice: the request goes to the next replica in the key's order that is not overloaded, or to
the least loaded of all when every one is. round-robin and least-loaded exist for comparison.
A request that names a LoRA adapter (its `model` is an adapter some replicas list in /v1/models)
goes to those replicas first, in the policy's order among them (its key mixed with the adapter,
so one prompt's requests for different adapters spread out); the others, which would answer 404,
only when none serves it.
"""

from __future__ import annotations

import hashlib
import itertools

from tokenforge.router.replicas import Replica


class Policy:
    def __init__(self, name: str, overload_waiting: int) -> None:
        self.name = name
        self.overload_waiting = overload_waiting
        self._turn = itertools.count()

    def order(self, replicas: list[Replica], key: bytes | None, adapter: str | None = None
              ) -> tuple[list[Replica], str]:
        """Every admitted replica in the order to try them, and why the first was chosen.
        `adapter`: the LoRA adapter the request names; replicas serving it come first."""
        if adapter is None or not any(adapter in r.adapters for r in replicas):
            return self._order(replicas, key)       # the base model (or an adapter no replica serves)
        if key is not None:
            key = hashlib.sha256(key + b"lora:" + adapter.encode()).digest()
        order, reason = self._order(replicas, key)
        resident = [r for r in order if adapter in r.adapters]
        if len(resident) == len(order):
            return order, reason
        return resident + [r for r in order if r not in resident], \
            reason if order[0] is resident[0] else "lora_resident"

    def _order(self, replicas: list[Replica], key: bytes | None) -> tuple[list[Replica], str]:
        if not replicas:
            return [], "none"
        by_load = sorted(replicas, key=lambda r: (*r.load(), r.url))
        if self.name == "round-robin":
            start = next(self._turn) % len(replicas)
            ring = sorted(replicas, key=lambda r: r.url)
            return ring[start:] + ring[:start], "round_robin"
        if self.name == "least-loaded" or key is None:
            return by_load, "least_loaded"
        ranked = sorted(replicas, key=lambda r: hashlib.sha256(key + r.url.encode()).digest(), reverse=True)
        fits = [r for r in ranked if r.waiting < self.overload_waiting]
        if not fits:
            return by_load, "all_overloaded"
        rest = [r for r in ranked if r not in fits]
        return fits + rest, "prefix" if fits[0] is ranked[0] else "overload_override"
