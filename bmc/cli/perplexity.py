"""bmc-perplexity: a model's perplexity on a text file, scored as llama.cpp's llama-perplexity scores it (chunks of
--ctx-size tokens, the second half of each scored), so quantized and float weights, and bmc and llama.cpp, can be
compared on the same file. Default model: the embedded SmolLM2-135M-Instruct."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from .common import MAX_THREADS, Parser, add_kv_dtype_argument, add_load_arguments, fail, physical_cores


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="bmc-perplexity", description=__doc__)
    p.add_argument("file", help="a UTF-8 text file ('-' reads stdin)")
    p.add_argument("-m", "--model",
                   help="HF model directory, .gguf file, or a hub name ORG/NAME or ORG/NAME:FILE.gguf (read from the "
                   "Hugging Face cache, downloaded if missing; bmc-models lists them) (default: the embedded "
                   "SmolLM2-135M-Instruct)")
    p.add_argument("-c", "--ctx-size", type=int, default=512, help="tokens per chunk (default 512, as llama.cpp)")
    p.add_argument("-b", "--batch-size", type=int, default=4,
                   help="chunks scored per step (default 4); memory does not grow with it: a chunk is prefilled 256 MiB "
                        "of logits at a time")
    p.add_argument("--chunks", type=int, default=None, help="score at most this many chunks (default: all)")
    add_load_arguments(p)
    add_kv_dtype_argument(p)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def read_text(path: str) -> str:
    try:
        if path == "-":
            return sys.stdin.buffer.read().decode("utf-8")
        with open(path, "rb") as f:
            return f.read().decode("utf-8")
    except UnicodeDecodeError as e:
        fail(f"{path} is not UTF-8 text (byte {e.start}: {e.reason})")
    except IsADirectoryError:
        fail(f"{path} is a directory, not a text file")
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.threads is not None and not 1 <= args.threads <= MAX_THREADS:
        fail(f"--threads must be in [1, {MAX_THREADS}], got {args.threads}")
    if args.chunks is not None and args.chunks < 1:
        fail(f"--chunks must be >= 1, got {args.chunks}")
    import torch

    torch.set_num_threads(args.threads or physical_cores())
    text = read_text(args.file)
    from .. import load
    from ..errors import BmcError
    from ..ppl import perplexity

    def progress(done: int, total: int, ppl: float) -> None:  # llama-perplexity's running estimate
        print(f"[{done}]{ppl:.4f},", end="\n" if done == total else "", file=sys.stderr, flush=True)

    try:
        model = load(args.model, dtype=args.dtype, device=args.device, share_weights=args.device == "cpu" and not args.no_weights_cache,
                     quant=args.quant, activations=args.activations)
        print(f"bmc-perplexity: {model.path} (quant {model.quant}, {model.activations} activations, kv "
              f"{args.kv_dtype}), chunks of {args.ctx_size} tokens, "
              f"{args.batch_size} per forward", file=sys.stderr, flush=True)
        res = perplexity(model, text, context=args.ctx_size, batch=args.batch_size, max_chunks=args.chunks,
                         progress=progress, kv_dtype=args.kv_dtype)
    except (BmcError, OSError) as e:
        fail(str(e))
    if args.json:
        print(json.dumps({"ppl": res.ppl, "ppl_stderr": res.ppl_stderr, "nll": res.nll, "chunks": res.chunks,
                          "context": res.context, "scored_tokens": res.scored_tokens, "seconds": res.seconds,
                          "quant": model.quant, "activations": model.activations, "model": model.path}))
    else:
        print(f"Final estimate: PPL = {res.ppl:.4f} +/- {res.ppl_stderr:.5f}  ({res.chunks} chunks of {res.context}, "
              f"{res.scored_tokens} tokens scored, {res.tokens_per_s:.0f} tok/s)")


if __name__ == "__main__":
    main()
