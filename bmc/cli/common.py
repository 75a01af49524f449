"""Pieces the CLIs share: thread count, error exits."""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from ..choices import KV_DTYPE_NAMES, QUANT_MODES
from ..platform.topology import physical_cores  # noqa: F401 (the CLIs' default thread count)


MAX_THREADS = 1024  # more is a typo, not a machine


def fail(message: str) -> NoReturn:
    """One clear line on stderr and exit code 2, as argparse does for bad arguments."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    """argparse with a bad argument reported in one line (no usage block), exit 2, as every other bad input."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (--help lists the options)", file=sys.stderr)
        sys.exit(2)


def add_kv_dtype_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPE_NAMES,
                   help="how the KV cache stores keys and values: auto (the model's --dtype: exact), bfloat16, "
                   "float16, or int8 (a scale per token and KV head; 3.8x fewer bytes than float32 for long-context "
                   "decode to read) (default auto)")


def add_chat_template_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template",
                   help="the chat template: a built-in name (chatml, llama3, gemma) or a Jinja file; replaces the "
                   "model's own (default: the model's, from its tokenizer config or GGUF)")


def chat_template_of(args: argparse.Namespace) -> str | None:
    """--chat-template's text (None when not given); a bad one exits 2 before anything loads."""
    if args.chat_template is None:
        return None
    from ..chat_templates import chat_template
    from ..errors import BmcError

    try:
        return chat_template(args.chat_template)
    except BmcError as e:
        fail(str(e))


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    """How a CLI loads its model: threads, dtype, device, quantization, the weights cache."""
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the model's weights and arithmetic (default float32: exact)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--quant", default="auto", choices=QUANT_MODES,
                   help="weights: auto (stored on a CPU in float32, else none), stored (a GGUF file's F16/BF16/Q8_0/"
                   "Q4_0/Q4_1/Q4_K/Q5_K/Q6_K matrices, an HF checkpoint's bfloat16/float16 ones, kept as stored), none "
                   "(dequantized to --dtype), gguf (stored, for a GGUF file), or q8_0 / q4_0 (quantized at load, "
                   "as llama.cpp does). Quantized matrices compute with exactly the float weights they dequantize to "
                   "(on CUDA in bfloat16, Q4 runs torch's int4 GEMM within a stated bound)")
    p.add_argument("--activations", default="auto", choices=["auto", "float", "int8", "bfloat16"],
                   help="auto (default): bfloat16 for a bfloat16 checkpoint kept in 16 bits on a CPU with AMX or "
                   "AVX512-BF16 (its own precision), else float; float (exact); int8: quantized matrices against "
                   "activations quantized to int8 blocks of 32, by VNNI dot products, as llama.cpp computes them; "
                   "~2x the Q4 GEMMs at batch 8, within a stated bound (needs AVX512-VNNI/VBMI); bfloat16: prompts prefilled in bfloat16 arithmetic (AMX or "
                   "AVX512-BF16; emulated, no faster, elsewhere), generated tokens in float32, within a stated bound")
    p.add_argument("--no-weights-cache", action="store_true",
                   help="read the weights from the model file, instead of mapping the weights derived from it from "
                   "~/.cache/bmc/weights (written on the first run, rebuilt when the file changes; a fast start)")
