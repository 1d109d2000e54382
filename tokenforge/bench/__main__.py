"""`python -m tokenforge.bench NAME ...` runs `tokenforge bench NAME ...`."""

import sys

from tokenforge.bench import main

sys.exit(main())
