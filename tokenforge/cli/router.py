"""`tokenforge router`: its flags (RouterSettings' fields) and its run.

The router package never imports this module (DESIGN.md): it takes RouterSettings.
"""

from __future__ import annotations

import argparse

from tokenforge.router.settings import API_KEY_ENV, POLICIES, RouterSettings


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
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="the replicas' --tokenizer, when they run one: prefix keys are its token ids")
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
    p.set_defaults(func=run_router)
    return p


def run_router(args: argparse.Namespace) -> int:
    from tokenforge.router.app import run_router as run  # noqa: PLC0415 - keep `tokenforge --help` fast

    return run(RouterSettings.from_args(args))
