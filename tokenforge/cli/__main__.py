"""`python -m tokenforge.cli ...` (what the tests and `torchrun -m tokenforge.cli` run)."""

from tokenforge.cli.main import console_main

console_main()
