"""bmc-chat: talk to a model in the terminal. The conversation's KV stays in one BMC cache across turns, so each
turn prefills only the new message. /reset starts over, /exit (or Ctrl-D) quits, Ctrl-C stops a reply."""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Sequence

from .common import (MAX_THREADS, Parser, add_chat_template_argument, add_kv_dtype_argument, add_load_arguments,
                     chat_template_of, fail, physical_cores)

HELP = ("/reset clears the conversation, /save FILE and /load FILE keep it as JSON, \"\"\" opens and closes a message "
        "of several lines, /help, /exit (or Ctrl-D) quits, Ctrl-C stops a reply")


def read_message(first: str) -> str:
    """A message of several lines between two \"\"\" marks (Ollama's convention), or the line itself."""
    text = first.strip()
    if not text.startswith('"""'):
        return first
    body = text[3:]
    if len(body) >= 3 and body.endswith('"""'):  # opened and closed on one line
        return body[:-3]
    lines = [body] if body else []
    while True:
        line = input(". ")
        if line.rstrip().endswith('"""'):
            last = line.rstrip()[:-3]
            return "\n".join(lines + ([last] if last else []))
        lines.append(line)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="bmc-chat", description=__doc__)
    p.add_argument("-m", "--model",
                   help="HF model directory, .gguf file, or a hub name ORG/NAME or ORG/NAME:FILE.gguf (read from the "
                   "Hugging Face cache, downloaded if missing; bmc-models lists them) (default: the embedded "
                   "SmolLM2-135M-Instruct)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("-n", "--max-new-tokens", type=int, default=512, help="longest reply in tokens (default 512)")
    p.add_argument("-c", "--ctx-size", type=int, default=None,
                   help="the conversation's bound in tokens, and so the KV cache's (default: the model's context; "
                   "at most that)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--kv", default="bmc", help="KV cache strategy (default bmc)")
    add_load_arguments(p)
    add_chat_template_argument(p)
    add_kv_dtype_argument(p)
    p.add_argument("--verbose", action="store_true",
                   help="after each reply, print to stderr the tokens prefilled (the rest came from the cache), "
                   "generated, and the reply's tok/s")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.threads is not None and not 1 <= args.threads <= MAX_THREADS:
        fail(f"--threads must be in [1, {MAX_THREADS}], got {args.threads}")
    for name in ("temperature", "top_p"):
        v = getattr(args, name)
        if v is not None and not math.isfinite(v):
            fail(f"--{name.replace('_', '-')} must be a finite number, got {v}")
    template = chat_template_of(args)
    import torch

    torch.set_num_threads(args.threads or physical_cores())

    from .. import load
    from ..chat import ChatSession, ContextFullError
    from ..errors import BmcError
    from ..kv import KV_STRATEGIES
    from ..sampling import SamplingParams

    if args.kv not in KV_STRATEGIES:
        fail(f"unknown --kv {args.kv!r}; choose from {', '.join(KV_STRATEGIES)}")
    if args.ctx_size is not None and args.ctx_size < 2:  # before the model loads (its upper bound: after)
        fail(f"--ctx-size must be >= 2 (a prompt token and one to generate), got {args.ctx_size}")
    try:
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        model = load(args.model, dtype=args.dtype, device=args.device,
                     share_weights=args.device == "cpu" and not args.no_weights_cache, quant=args.quant,
                     activations=args.activations)
        if template is not None and model.tokenizer is not None:
            model.tokenizer.chat_template = template
        session = ChatSession(model, max_new_tokens=args.max_new_tokens, sampling=sampling, system=args.system,
                              kv=args.kv, kv_dtype=args.kv_dtype, ctx_size=args.ctx_size)
    except (BmcError, OSError, ValueError) as e:
        fail(str(e))
    print(f"bmc-chat: {model.path} ({model.config.num_layers} layers, context {session.context}); {HELP}",
          file=sys.stderr, flush=True)
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            break
        except KeyboardInterrupt:
            print()
            continue
        command = line.strip()
        if not command:
            continue
        if command in ("/exit", "/quit", "/bye"):
            break
        if command == "/reset":
            session.reset()
            print("(conversation cleared)", flush=True)
            continue
        if command == "/help":
            print(HELP, flush=True)
            continue
        if command.startswith(("/save ", "/load ")):
            path = command[6:].strip()
            try:
                if command.startswith("/save"):
                    with open(path, "w", encoding="utf-8") as f:
                        json.dump(session.messages, f, ensure_ascii=False, indent=1)
                    print(f"(saved {len(session.messages)} messages to {path})", flush=True)
                else:
                    with open(path, encoding="utf-8") as f:
                        session.load_messages(json.load(f))
                    print(f"(loaded {len(session.messages)} messages from {path})", flush=True)
            except (OSError, ValueError, BmcError) as e:
                print(f"bmc-chat: {command[:5]} {path}: {e}", file=sys.stderr, flush=True)
            continue
        if command.startswith("/"):
            print(f"unknown command {command}: {HELP}", flush=True)
            continue
        try:
            line = read_message(line)
        except (EOFError, KeyboardInterrupt):
            print()
            continue
        if not line.strip():
            continue
        t0 = time.perf_counter()
        try:
            for piece in session.turn(line):
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            sys.stdout.write(" [stopped]")
        except ContextFullError as e:
            print(f"bmc-chat: {e}", file=sys.stderr, flush=True)
            continue
        except BmcError as e:
            print(f"bmc-chat: {e}", file=sys.stderr, flush=True)
            continue
        print(flush=True)
        if args.verbose:
            st, dt = session.last, time.perf_counter() - t0
            print(f"[prefilled {st.prefilled_tokens} of {st.prompt_tokens} tokens, generated {st.generated_tokens} "
                  f"({st.finish_reason}), {st.generated_tokens / dt:.1f} tok/s, context {session.context_used}/"
                  f"{model.max_context}]", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
