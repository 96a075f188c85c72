"""`python -m benchmarks.run`: the benchmark entry point (`nox -s bench`); it runs `benchmarks/transport.py`.

Same options as `python -m benchmarks.transport` (`--quick`, `--out`, `--dir`, `--reps`); see docs/benchmarks.md.
"""

from __future__ import annotations

import sys

from benchmarks.transport import main

if __name__ == "__main__":
    sys.exit(main())
