"""Greedy decoding with llama.cpp (llama-cpp-python's low-level API), run in llama-cpp-python's own venv by
bmc-bench: `python llamacpp_run.py request.json result.json`. Imports nothing from bmc.

Every prompt is its own sequence of one multi-sequence batch (one KV cache per sequence); each step decodes one
token for every sequence; exactly gen_len tokens, EOS ignored, argmax of the logits."""
import ctypes
import json
import resource
import sys
import time

import llama_cpp
import numpy as np


def main(req_path: str, out_path: str) -> None:
    req = json.load(open(req_path))
    prompts, G, threads = req["prompts"], req["gen_len"], req["threads"]
    B, P = len(prompts), max(len(p) for p in prompts)
    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(req["model"].encode(), mp)
    if not model:
        raise SystemExit(f"llama.cpp could not load {req['model']}")
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = B * (P + G + 8)
    cp.n_batch = max(B * P, B)
    cp.n_ubatch = min(cp.n_batch, 512)
    cp.n_seq_max = B
    cp.n_threads = cp.n_threads_batch = threads
    if hasattr(cp, "kv_unified"):
        cp.kv_unified = False
    ctx = llama_cpp.llama_init_from_model(model, cp)
    batch = llama_cpp.llama_batch_init(max(B * P, B), 0, B)

    def submit(items):  # items: (token, pos, seq, wants_logits)
        batch.n_tokens = len(items)
        for n, (tok, pos, seq, logits) in enumerate(items):
            batch.token[n], batch.pos[n], batch.n_seq_id[n] = tok, pos, 1
            batch.seq_id[n][0] = seq
            batch.logits[n] = logits
        rc = llama_cpp.llama_decode(ctx, batch)
        if rc != 0:
            raise SystemExit(f"llama_decode returned {rc}")

    def argmax(i: int) -> int:
        ptr = llama_cpp.llama_get_logits_ith(ctx, i)
        return int(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,)).argmax())

    start = time.perf_counter()
    items = [(tok, i, s, i == len(p) - 1) for s, p in enumerate(prompts) for i, tok in enumerate(p)]
    submit(items)  # n_batch holds every prompt token: one prefill call
    last = {seq: n for n, (_, _, seq, wants) in enumerate(items) if wants}
    nxt = [argmax(last[s]) for s in range(B)]
    tokens = [[t] for t in nxt]
    steps = [time.perf_counter()]
    pos = [len(p) for p in prompts]
    for _ in range(G - 1):
        submit([(nxt[s], pos[s], s, True) for s in range(B)])
        nxt = [argmax(s) for s in range(B)]
        for s in range(B):
            tokens[s].append(nxt[s])
            pos[s] += 1
        steps.append(time.perf_counter())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    json.dump({"engine": "llama.cpp", "tokens": tokens, "start": start, "steps": steps, "peak_rss_mb": rss,
               "extra": {"llama_cpp_python": llama_cpp.__version__, "kv_unified": False}}, open(out_path, "w"))
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
