"""`python -m tokenforge ...` (what `torchrun -m tokenforge serve ...` runs on every rank)."""

import sys

from tokenforge.cli import main

if __name__ == "__main__":
    sys.exit(main())
