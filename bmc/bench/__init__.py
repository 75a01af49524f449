"""The benchmark harness behind `bmc-bench` (bench/compare.py runs the same code from a checkout)."""
