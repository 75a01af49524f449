"""bmc vs HF transformers on the same weights: `python bench/compare.py --help` (same as `bmc-bench`)."""
import sys

from bmc.bench.harness import main

if __name__ == "__main__":
    sys.exit(main())
