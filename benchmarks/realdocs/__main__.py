"""`python -m benchmarks.realdocs [--list] [--check]`: see `benchmarks.realdocs.main`."""

import sys

from benchmarks.realdocs import main

sys.exit(main())
