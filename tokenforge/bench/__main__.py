"""`python -m tokenforge.bench NAME ...` runs `tokenforge bench NAME ...` (an entry point, like cli's)."""

import sys

from tokenforge.cli.main import bench_main

sys.exit(bench_main(sys.argv[1:]))
