"""`python -m tokenforge ...` (what `torchrun -m tokenforge serve ...` runs on every rank)."""

from tokenforge.cli import console_main

if __name__ == "__main__":
    console_main()
