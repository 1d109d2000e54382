"""The router's own Prometheus metrics (`tokenforge_router:*`), separate from the replicas'."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("tokenforge_router:requests", "Requests sent to a replica, by why it was chosen.",
                                ["replica", "reason"], registry=r)
        self.retries = Counter("tokenforge_router:retries", "Attempts given up before the first byte, by cause.",
                               ["cause"], registry=r)
        self.failed = Counter("tokenforge_router:failed_requests", "Requests the router could not complete.",
                              ["kind"], registry=r)
        self.events = Counter("tokenforge_router:replica_events", "Replica state changes (ejected, admitted, ...).",
                              ["replica", "event"], registry=r)
        self.up = Gauge("tokenforge_router:replica_admitted", "1 if the replica takes requests.", ["replica"],
                        registry=r)
        self.waiting = Gauge("tokenforge_router:replica_waiting", "The replica's last reported queue depth.",
                             ["replica"], registry=r)
        self.in_flight = Gauge("tokenforge_router:replica_in_flight", "Requests the router is proxying there.",
                               ["replica"], registry=r)

    def on_change(self, replica, event: str) -> None:
        self.events.labels(replica.url, event).inc()

    def render(self, pool) -> bytes:
        for replica in pool.replicas.values():
            self.up.labels(replica.url).set(1 if replica.admitted else 0)
            self.waiting.labels(replica.url).set(replica.waiting)
            self.in_flight.labels(replica.url).set(replica.in_flight)
        return generate_latest(self.registry)
