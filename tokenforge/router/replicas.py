"""The replica pool: discovery, health polls, ejection, re-admission and the version rule.

Every `health_interval` the pool re-discovers the replica URLs and polls each one's /health and
/metrics: queue depth (`tokenforge:num_requests_waiting`), running sequences, KV usage, and the
served weights (`tokenforge:model_info{version, checksum}`), and /v1/models for the LoRA adapters
it serves (entries with a `parent`). A replica is ejected after
`eject_after` failed polls in a row, or at once when the proxy cannot connect to it; the first
good poll re-admits it. A replica whose model reports a version other than the pool's for that
model name is refused (never routed to) unless `allow_mixed_versions`: the pool's version is the
router's --model-version, else that of the replicas already admitted, else the most common one.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import Counter
from dataclasses import dataclass

import httpx

from tokenforge.router.settings import RouterSettings

logger = logging.getLogger(__name__)

_INFO = re.compile(r'^tokenforge:model_info\{(?P<labels>[^}]*)\} 1(\.0)?$', re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_GAUGES = {"waiting": "tokenforge:num_requests_waiting", "running": "tokenforge:num_requests_running",
           "kv_usage": "tokenforge:kv_cache_usage_perc"}


@dataclass(slots=True)
class Replica:
    url: str
    state: str = "new"          # new | admitted | ejected | version_mismatch
    failures: int = 0
    reason: str = ""
    healthy: bool = False       # the last poll succeeded
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    in_flight: int = 0          # requests this router is proxying to it now
    model_name: str = ""
    version: str = ""
    checksum: str = ""
    adapters: frozenset[str] = frozenset()     # LoRA adapters it serves (its /v1/models entries with a parent)

    @property
    def admitted(self) -> bool:
        return self.state == "admitted"

    def load(self) -> tuple[float, int]:
        """(queue depth the replica last reported, requests this router has there now): the
        first is the replica's own view, the second breaks ties between polls."""
        return self.waiting, self.in_flight


def parse_metrics(text: str) -> dict:
    values: dict = {}
    for key, name in _GAUGES.items():
        match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
        if match:
            values[key] = float(match.group(1))
    info = _INFO.search(text)
    if info:
        labels = dict(_LABEL.findall(info.group("labels")))
        values.update(model_name=labels.get("model_name", ""), version=labels.get("version", ""),
                      checksum=labels.get("checksum", ""))
    return values


def adapters_of(models: dict) -> frozenset[str]:
    """The adapter names of a /v1/models body: entries that name a parent model."""
    data = models.get("data") if isinstance(models, dict) else None
    return frozenset(m["id"] for m in data or () if isinstance(m, dict) and m.get("parent") and m.get("id"))


class ReplicaPool:
    def __init__(self, settings: RouterSettings, discovery, client: httpx.AsyncClient, on_change=None) -> None:
        self.settings = settings
        self.discovery = discovery
        self.client = client
        self.replicas: dict[str, Replica] = {}
        self.on_change = on_change or (lambda replica, event: None)

    def admitted(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.admitted]

    async def refresh(self) -> None:
        """Re-discover, poll every replica, then apply the version rule."""
        try:
            urls = await self.discovery.discover()
        except Exception as err:   # noqa: BLE001 - keep the last known replicas when discovery fails
            logger.warning("replica discovery failed (keeping %d known): %s", len(self.replicas), err)
            urls = list(self.replicas)
        for url in urls:
            self.replicas.setdefault(url, Replica(url))
        for url in [u for u in self.replicas if u not in urls]:
            self.on_change(self.replicas.pop(url), "removed")
        await asyncio.gather(*(self._poll(r) for r in list(self.replicas.values())))
        self._apply_version_rule()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval)
            await self.refresh()

    async def _poll(self, replica: Replica) -> None:
        try:
            health = await self.client.get(f"{replica.url}/health", timeout=self.settings.connect_timeout)
            health.raise_for_status()
            metrics = await self.client.get(f"{replica.url}/metrics", timeout=self.settings.connect_timeout,
                                            headers=self._auth())
            metrics.raise_for_status()
        except httpx.HTTPError as err:
            self.fail(replica, f"health check failed: {type(err).__name__}: {err}".rstrip(": "))
            return
        for key, value in parse_metrics(metrics.text).items():
            setattr(replica, key, value)
        replica.adapters = await self._adapters(replica)
        replica.failures = 0
        replica.healthy = True

    async def _adapters(self, replica: Replica) -> frozenset[str]:
        """The replica's LoRA adapters from /v1/models; none when it lists none (or cannot say)."""
        try:
            models = await self.client.get(f"{replica.url}/v1/models", timeout=self.settings.connect_timeout,
                                           headers=self._auth())
            return adapters_of(models.json()) if models.status_code == 200 else frozenset()
        except (httpx.HTTPError, ValueError):
            return frozenset()

    def _auth(self) -> dict:
        key = self.settings.replica_api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def fail(self, replica: Replica, reason: str, *, at_once: bool = False) -> None:
        """A failed poll (or, with at_once, a connect error while proxying)."""
        replica.healthy = False
        replica.failures = self.settings.eject_after if at_once else replica.failures + 1
        if replica.failures >= self.settings.eject_after and replica.state in ("admitted", "new"):
            replica.state, replica.reason = "ejected", reason
            logger.warning("ejected replica %s: %s", replica.url, reason)
            self.on_change(replica, "ejected")

    def _apply_version_rule(self) -> None:
        by_model: dict[str, list[Replica]] = {}
        for replica in self.replicas.values():
            if replica.healthy:
                by_model.setdefault(replica.model_name, []).append(replica)
        for model, candidates in by_model.items():
            target = self._version_for(candidates)
            for replica in candidates:
                ok = self.settings.allow_mixed_versions or replica.version == target
                self._set_state(replica, "admitted" if ok else "version_mismatch",
                                "" if ok else f"model {model!r} version {replica.version!r} differs from the "
                                              f"pool's {target!r} (start the router with --allow-mixed-versions "
                                              "to mix them)")

    def _version_for(self, candidates: list[Replica]) -> str:
        if self.settings.model_version is not None:
            return self.settings.model_version
        current = sorted({r.version for r in candidates if r.admitted})
        if current:
            return current[0]
        counts = Counter(r.version for r in sorted(candidates, key=lambda r: r.url))
        return counts.most_common(1)[0][0]

    def _set_state(self, replica: Replica, state: str, reason: str) -> None:
        if replica.state == state:
            return
        replica.state, replica.reason = state, reason
        if state == "admitted":
            logger.info("admitted replica %s (model %s, version %r)", replica.url, replica.model_name,
                        replica.version)
        else:
            logger.error("refused replica %s: %s", replica.url, reason)
        self.on_change(replica, state)
