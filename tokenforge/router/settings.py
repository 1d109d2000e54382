"""RouterSettings (validated once, frozen), built from the flags of `tokenforge router` (cli/router.py).

The one environment variable the router reads, TOKENFORGE_ROUTER_API_KEY, comes through envs.py.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from tokenforge import envs

API_KEY_ENV = envs.ROUTER_API_KEY
POLICIES = ("prefix", "round-robin", "least-loaded")


@dataclass(frozen=True, slots=True)
class RouterSettings:
    replicas: tuple[str, ...] = ()
    k8s_service: str | None = None
    k8s_namespace: str = "default"
    k8s_port_name: str | None = None        # None: the Endpoints' first port
    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: tuple[str, ...] = ()          # clients must send one of these (none: open)
    replica_api_key: str | None = None      # sent upstream; None forwards the client's Authorization
    policy: str = "prefix"
    model: str | None = None                # tokenizer source for prefix keys (None = the bundled model)
    load_format: str = "auto"
    tokenizer: str | None = None            # the replicas' --tokenizer, when they run one (prefix keys from it)
    block_size: int = 16                    # must match the replicas' --block-size
    prefix_blocks: int = 4                  # how many leading blocks make the routing key
    overload_waiting: int = 16              # a replica with this many waiting requests is overloaded
    health_interval: float = 2.0            # seconds between health/metrics polls
    eject_after: int = 2                    # consecutive failed polls (or proxy connect errors) to eject
    retries: int = 2                        # other replicas tried on a connect error or 503 (before any byte)
    connect_timeout: float = 5.0
    upstream_keepalive: float = 5.0         # seconds an idle upstream connection stays open
    allow_mixed_versions: bool = False
    model_version: str | None = None        # pin: admit only replicas reporting this version
    log_level: str = "info"
    ui: bool = True                         # /ui pages and /ui/api/stats (--no-ui: off)

    def validate(self) -> RouterSettings:
        def check(cond: bool, message: str) -> None:
            if not cond:
                raise ValueError(message)

        check(bool(self.replicas) != bool(self.k8s_service),
              "give the replicas either as --replica URL... or as --k8s-service NAME (exactly one of them)")
        check(all(u.startswith(("http://", "https://")) for u in self.replicas),
              f"a replica must be an http(s) URL, got {[u for u in self.replicas if '://' not in u]}")
        check(self.policy in POLICIES, f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        check(0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}")
        check(self.block_size >= 1 and self.prefix_blocks >= 1, "block_size and prefix_blocks must be >= 1")
        check(self.overload_waiting >= 1, f"overload_waiting must be >= 1, got {self.overload_waiting}")
        check(self.health_interval > 0, f"health_interval must be positive, got {self.health_interval}")
        check(self.eject_after >= 1, f"eject_after must be >= 1, got {self.eject_after}")
        check(self.retries >= 0, f"retries must be >= 0, got {self.retries}")
        check(self.upstream_keepalive >= 0, f"upstream_keepalive must be >= 0, got {self.upstream_keepalive}")
        check(all(self.api_keys), "an API key must not be empty")
        return self

    @staticmethod
    def from_args(args: argparse.Namespace) -> RouterSettings:
        keys = list(args.api_key or [])
        if not keys and envs.router_api_key():
            keys = [envs.router_api_key()]
        fields = {name: getattr(args, name) for name in RouterSettings.__dataclass_fields__
                  if name not in ("replicas", "api_keys") and getattr(args, name, None) is not None}
        return RouterSettings(replicas=tuple(args.replica or ()), api_keys=tuple(keys), **fields).validate()

