"""`tokenforge cache ls|rm`: what the engine cache holds, and removing it.

The folder is --engine-cache-dir (default ~/.cache/tokenforge/engine, as --use-cache uses). `ls`
lists each rank's converted weights (source, dtype, TP/PP rank, size) and the kernel caches;
`rm KEY...` or `rm --all` removes entries.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def add_cache_parser(sub) -> None:
    p = sub.add_parser("cache", help="list or remove the engine cache (converted weights, kernel caches)")
    p.add_argument("action", choices=["ls", "rm"])
    p.add_argument("keys", nargs="*", help="rm: the entries to remove (as `ls` prints them)")
    p.add_argument("--engine-cache-dir", "--engine_cache_dir", dest="engine_cache_dir", default=None)
    p.add_argument("--all", action="store_true", help="rm: everything in the folder")
    p.set_defaults(func=run_cache)


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_cache(args: argparse.Namespace) -> int:
    from tokenforge.executor.engine_cache import DEFAULT_ENGINE_CACHE_DIR  # noqa: PLC0415
    from tokenforge.model.loader.weight_cache import list_entries  # noqa: PLC0415

    root = Path(args.engine_cache_dir or DEFAULT_ENGINE_CACHE_DIR).expanduser()
    entries = list_entries(root)
    if args.action == "ls":
        print(f"engine cache {root}")
        for e in entries:
            tp, pp = e.get("tp", ["?", "?"]), e.get("pp", ["?", "?"])
            print(f"  {e['key']}  {e.get('bytes', 0) / 1e9:7.2f} GB  {e.get('dtype', '?')}  tp {tp[0]}/{tp[1]}  "
                  f"pp {pp[0]}/{pp[1]}  {e.get('source', '?')}")
        for kernels in ("triton", "inductor"):
            if (root / kernels).is_dir():
                print(f"  {kernels} kernel cache  {_folder_bytes(root / kernels) / 1e6:.1f} MB")
        if not entries:
            print("  (no converted weights)")
        return 0
    if not args.all and not args.keys:
        raise ValueError("cache rm: name entries (as `tokenforge cache ls` prints them) or pass --all")
    known = {e["key"]: Path(e["path"]) for e in entries}
    unknown = [k for k in args.keys if k not in known]
    if unknown:
        raise ValueError(f"cache rm: no entry {', '.join(unknown)} in {root}")
    if args.all:
        shutil.rmtree(root, ignore_errors=True)
    for key in args.keys:
        shutil.rmtree(known[key], ignore_errors=True)
    print(f"removed {'everything in ' + str(root) if args.all else ', '.join(args.keys)}")
    return 0
