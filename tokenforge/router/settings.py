"""RouterSettings and the flags of `tokenforge router` (validated once, frozen).

The one environment variable the router reads, TOKENFORGE_ROUTER_API_KEY, is read here.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

API_KEY_ENV = "TOKENFORGE_ROUTER_API_KEY"
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
        if not keys and os.environ.get(API_KEY_ENV):
            keys = [os.environ[API_KEY_ENV]]
        fields = {name: getattr(args, name) for name in RouterSettings.__dataclass_fields__
                  if name not in ("replicas", "api_keys") and getattr(args, name, None) is not None}
        return RouterSettings(replicas=tuple(args.replica or ()), api_keys=tuple(keys), **fields).validate()


def add_router_parser(subparsers) -> argparse.ArgumentParser:
    d = RouterSettings()
    p = subparsers.add_parser("router", help="prefix-aware router in front of tokenforge serve replicas")
    p.add_argument("--replica", nargs="+", action="extend", metavar="URL", help="replica base URLs")
    p.add_argument("--k8s-service", default=None, metavar="NAME",
                   help="discover replicas from this Service's Endpoints (official kubernetes client)")
    p.add_argument("--k8s-namespace", default=d.k8s_namespace)
    p.add_argument("--k8s-port-name", default=None, help="the Endpoints port to use (default: the first)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' (all but /health); also ${API_KEY_ENV}")
    p.add_argument("--replica-api-key", default=None,
                   help="key sent to the replicas (default: forward the client's Authorization header)")
    p.add_argument("--policy", choices=POLICIES, default=d.policy,
                   help="prefix: consistent hashing on the prompt's first blocks, load overrides overload "
                        "(default); round-robin and least-loaded for comparison")
    p.add_argument("--model", default=None, help="tokenizer for prefix keys: the replicas' model (default bundled)")
    p.add_argument("--load-format", default=d.load_format)
    p.add_argument("--block-size", type=int, default=d.block_size, help="the replicas' KV block size")
    p.add_argument("--prefix-blocks", type=int, default=d.prefix_blocks,
                   help="leading blocks hashed into the routing key (default %(default)s)")
    p.add_argument("--overload-waiting", type=int, default=d.overload_waiting,
                   help="waiting requests at which a replica counts as overloaded (default %(default)s)")
    p.add_argument("--health-interval", type=float, default=d.health_interval)
    p.add_argument("--eject-after", type=int, default=d.eject_after)
    p.add_argument("--retries", type=int, default=d.retries)
    p.add_argument("--upstream-keepalive", type=float, default=d.upstream_keepalive, metavar="SECONDS",
                   help="how long an idle connection to a replica is kept for reuse (default %(default)s)")
    p.add_argument("--allow-mixed-versions", action="store_true",
                   help="admit replicas of one model that report different --model-version values")
    p.add_argument("--model-version", default=None, help="admit only replicas reporting this version")
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
    p.add_argument("--no-ui", dest="ui", action="store_false",
                   help="serve no web UI (/ui, /ui/dashboard, /ui/api/stats answer 404)")
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace, engine_kwargs=None) -> int:
    from tokenforge.router.app import run_router  # noqa: PLC0415 - keep `tokenforge --help` fast

    return run_router(RouterSettings.from_args(args))
