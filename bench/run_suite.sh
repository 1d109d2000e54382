#!/usr/bin/env bash
# One named device session of bench/suites.toml:  bash bench/run_suite.sh NAME OUTDIR  (--list: all)
set -uo pipefail
cd "$(dirname "$0")/.."
exec python3 bench/run_suite.py "$@"
