"""Names the command-line tools offer as choices, importable without torch (so --help and argument errors answer
at once). The modules that implement them check that they agree (tests/test_cli.py)."""
from __future__ import annotations

KV_STRATEGY_NAMES = ("bmc", "iterative", "upfront")  # bmc/kv/strategies.py, kv.KV_STRATEGIES
KV_DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16", "int8")  # bmc/kv/formats.py, KV_DTYPES
QUANT_MODES = ("auto", "none", "stored", "gguf", "q8_0", "q4_0")  # bmc/models/quant.py
