"""tfm: train, evaluate and serve a from-scratch transformer sentiment classifier."""

import os

__version__ = "0.1.0"

# libgomp's threads spin 300,000 rounds for their next piece of work before they sleep. When another
# process shares the cores (a second run, a test suite), each spins through the other's time slices and
# both slow down many times over (libgomp spins less only when its own process has more threads than
# CPUs); after 1,000 rounds they yield. Set here, before torch loads libgomp; a user's OMP_WAIT_POLICY or
# GOMP_SPINCOUNT wins. Measured by scripts/bench/bench_threads.py.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")
