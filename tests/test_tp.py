"""Tensor parallelism on CPU ranks (gloo, 2 worker processes): seed 004's head sharding policy; tp=2 against one
process for MHA, GQA, MQA (fewer KV heads than ranks: replicated) and biased, tied Llama models, OPT, Qwen2 (q/k/v
biases), Gemma 2 (soft-caps, window on some layers), Gemma 3 and Phi-3 with longrope (rows switching while they
decode: each rank recomputes its heads) — logits of a prompt within float rounding, greedy tokens on every cache
strategy, under speculation and with shared prefixes;
a rank that dies or hangs stops the group with an error naming it, and a refused request leaves the group up."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import bmc
from bmc.kv import KV_STRATEGIES
from bmc.parallel import RankHeads, shard_heads
from bmc.parallel.tp import TensorParallelError, TensorParallelModel, prompt_logits

PROMPTS = [[5, 17, 33, 80, 101, 7, 9, 250, 12], [40, 41, 42], [300, 3, 99, 98, 97, 96, 14]]
SETTINGS = [*(dict(kv=kv) for kv in KV_STRATEGIES), dict(kv="bmc", r=3),
            dict(kv="bmc", speculative="ngram"), dict(num_samples=2)]  # the default tree: auto (chain:4 on ranks)


def R(q, kv) -> RankHeads:
    return RankHeads(tuple(q), tuple(kv))


@pytest.mark.parametrize("heads,kv_heads,world,want", [
    (6, 6, 2, [R([0, 1, 2], [0, 1, 2]), R([3, 4, 5], [3, 4, 5])]),
    (6, 6, 4, [R([0, 1], [0, 1]), R([2, 3], [2, 3]), R([4], [4]), R([5], [5])]),
    (6, 2, 2, [R([0, 1, 2], [0]), R([3, 4, 5], [1])]),  # level 1: a KV head and its whole group per rank
    (6, 2, 4, [R([0, 1], [0]), R([2], [0]), R([3, 4], [1]), R([5], [1])]),  # level 2: KV replicated, Q divided
    (6, 1, 2, [R([0, 1, 2], [0]), R([3, 4, 5], [0])]),  # MQA: the one KV head on every rank
    (6, 1, 4, [R([0, 1], [0]), R([2, 3], [0]), R([4], [0]), R([5], [0])]),
    (8, 8, 2, [R([0, 1, 2, 3], [0, 1, 2, 3]), R([4, 5, 6, 7], [4, 5, 6, 7])]),
    (8, 8, 4, [R([0, 1], [0, 1]), R([2, 3], [2, 3]), R([4, 5], [4, 5]), R([6, 7], [6, 7])]),
])
def test_sharding_policy_follows_seed_004(heads, kv_heads, world, want):
    got = shard_heads(heads, kv_heads, world)
    assert got == want
    G = heads // kv_heads
    assert sorted(q for r in got for q in r.q_heads) == list(range(heads))  # every query head exactly once
    for r in got:  # a rank holds exactly the KV heads its query heads read
        assert r.kv_heads == tuple(sorted({q // G for q in r.q_heads}))
    replicated = any(len({kv for r in got for kv in r.kv_heads}) < sum(len(r.kv_heads) for r in got) for _ in [0])
    assert replicated == (kv_heads < world)


def test_sharding_policy_refuses_what_cannot_split():
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        shard_heads(6, 2, 3)  # 2 KV heads over 3 ranks
    with pytest.raises(ValueError, match="without a query head"):
        shard_heads(2, 1, 4)  # 2 query heads over 4 ranks


# one family per sharding case (CI time): GQA, MQA (replicated KV heads), biases with a wide head and tied
# embeddings, OPT's layout, Gemma's norms and window layers, longrope; MHA, Qwen2 and Gemma 2 shard as these do
@pytest.fixture(scope="module", params=["llama-gqa", "llama-mqa", "llama-bias_headdim_tied", "opt-pre_norm", "gemma3",
                                        "phi3-longrope"])
def pair(request, tiny_dirs, tmp_path_factory):
    from .test_gemma import make_gemma
    from .test_phi3 import LONGROPE, make_phi3
    from .test_qwen import make_qwen2

    name = request.param
    where = tmp_path_factory.mktemp(name)
    path = str(tiny_dirs[name] if name in tiny_dirs else make_qwen2(where) if name == "qwen2"
               else make_gemma(where, name) if name.startswith("gemma")
               else make_phi3(where, rope_scaling=LONGROPE, original_max_position_embeddings=12))
    tp = bmc.load(path, tp=2)
    yield bmc.load(path, quant="none"), tp
    tp.close()


def test_tp2_equals_one_process(pair):
    one, tp = pair
    ids = PROMPTS[0] + [11, 12, 13, 14, 15]
    torch.testing.assert_close(tp.logits(ids), prompt_logits(one, ids), atol=1e-4, rtol=1e-4)
    for kw in SETTINGS:
        want = bmc.generate(one, PROMPTS, max_new_tokens=12, ignore_eos=True, **kw)
        got = bmc.generate(tp, PROMPTS, max_new_tokens=12, ignore_eos=True, **kw)
        assert [c.token_ids for c in got] == [c.token_ids for c in want], kw
        if kw.get("num_samples"):  # each prompt's KV read by its samples from one segment, on every rank, except
            cfg = one.config       # where the model keeps KV per row (soft-caps, a window in reach, longrope)
            shares = cfg.attn_softcap is None and cfg.sliding_window is None and cfg.rope_scaling is None
            assert (got.stats.prefix_kv_bytes > 0) == shares == (want.stats.prefix_kv_bytes > 0), kw
    sampled = bmc.generate(tp, PROMPTS, max_new_tokens=8, temperature=0.8, seed=3)
    assert [c.token_ids for c in sampled] == [c.token_ids for c in bmc.generate(
        one, PROMPTS, max_new_tokens=8, temperature=0.8, seed=3)]


def _gpus(world: int) -> list[pytest.MarkDecorator]:
    return [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < world, reason=f"needs {world} GPUs")]


# tp=4 over 4 query heads: MHA one KV head a rank; GQA's 2 and MQA's 1 KV heads replicated over 2 and 4 ranks
@pytest.fixture(scope="module", params=[pytest.param((world, v), marks=_gpus(world), id=f"tp{world}-{v}")
                                        for world in (2, 4) for v in ("llama-mha", "llama-gqa", "llama-mqa")])
def gpu_pair(request, tiny_dirs):
    world, variant = request.param
    path = str(tiny_dirs[variant])
    tp = bmc.load(path, tp=world, device="cuda")
    yield bmc.load(path, quant="none", device="cuda"), tp
    tp.close()


def test_tp_on_gpus_equals_one_gpu(gpu_pair):
    """NCCL ranks on 2 or 4 GPUs, float32: one GPU's greedy tokens with every decode step eager, and with each
    bucket's step captured before the run as one CUDA graph with its all-reduces and the LM head's all-gather
    inside (replayed on every rank: asserted), on bmc and upfront caches, under speculation and with samples."""
    one, tp = gpu_pair
    for cuda_graphs in (True, False):
        for kw in (dict(kv="bmc"), dict(kv="upfront"), dict(kv="bmc", speculative="ngram", tree="chain:3"),
                   dict(num_samples=2)):
            want = bmc.generate(one, PROMPTS, max_new_tokens=12, ignore_eos=True, cuda_graphs=cuda_graphs, **kw)
            got = bmc.generate(tp, PROMPTS, max_new_tokens=12, ignore_eos=True, cuda_graphs=cuda_graphs, **kw)
            assert [c.token_ids for c in got] == [c.token_ids for c in want], (cuda_graphs, kw)
    for prompts in (PROMPTS[:1], PROMPTS):  # batch 1 and 3; buckets of 16 columns, the first ones run eagerly
        kw = dict(max_new_tokens=70, ignore_eos=True, kv="bmc", r=16, graph_warmup=True)  # (48 of 69 steps replayed
        want, got = bmc.generate(one, prompts, **kw), bmc.generate(tp, prompts, **kw)  # at batch 1 on two H100s)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        assert got.stats.decode_kernel == want.stats.decode_kernel == "cuda-graphs"
        assert got.stats.cuda_graph_replays >= 40 and want.stats.cuda_graph_replays >= 40
    eager = bmc.generate(tp, PROMPTS, max_new_tokens=12, ignore_eos=True, cuda_graphs=False)
    assert eager.stats.decode_kernel == "torch" and eager.stats.cuda_graph_replays == 0
    # the decode steps above took the fused all-reduce + norm (bmc/parallel/allreduce_norm.py) on every rank at
    # tp=2 (the only world it is built for), NCCL's at tp=4
    assert all(info["fused_allreduce"] == (tp.tp == 2) for info in tp.rank_info(reps=1))


def _fused_allreduce_rank(rank: int, world: int, port: int, out: str) -> None:
    """One rank of test_fused_allreduce_norm_is_nccl_then_add_rms_norm."""
    import torch.distributed as dist

    from bmc.models.fused_triton import add_rms_norm
    from bmc.parallel.allreduce_norm import MAX_ROWS, AllReduceNorm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    same = []
    for dtype in (torch.float32, torch.bfloat16):
        for D in (576, 4096):
            fused = AllReduceNorm(D, dtype, dev)
            for B in (1, 3, MAX_ROWS):
                shared = torch.Generator(device=dev).manual_seed(B)  # the residual and weight: every rank's
                x = torch.randn(B, 1, D, device=dev, generator=shared).to(dtype)
                w = (1 + 0.1 * torch.randn(D, device=dev, generator=shared)).to(dtype)
                own = torch.Generator(device=dev).manual_seed(100 * B + rank)
                for _ in range(3):  # slots 0, 1, 0
                    part = torch.randn(B, 1, D, device=dev, generator=own).to(dtype)
                    s, y = fused.add_norm(x, part, w, 1e-5)
                    total = part.clone()
                    dist.all_reduce(total)
                    s_ref, y_ref = add_rms_norm(x, total, w, 1e-5)
                    same.append((str(dtype), D, B, torch.equal(s, s_ref) and torch.equal(y, y_ref)))
    torch.save(same, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fused_allreduce_norm_is_nccl_then_add_rms_norm(tmp_path):
    """The fused kernel on two GPUs gives NCCL's all-reduce followed by add_rms_norm bit for bit (float32 and
    bfloat16, widths 576 and 4096, 1 to MAX_ROWS rows, both slots in turn), on both ranks."""
    import torch.multiprocessing as mp

    from bmc.platform.ports import free_port

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_fused_allreduce_rank, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive and all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert len(got) == 2 * 2 * 3 * 3 and all(ok for *_, ok in got), [c for c in got if not c[-1]]


def test_a_rank_builds_only_its_part_of_a_70b_shape(tmp_path):
    """bench/gpu_tp.py's random ranks: a Llama-2-70B shape built from its config alone, its matrices meta tensors
    (no memory) until shard_model cuts rank 0's part of 4; that part has Megatron's shapes under seed 004's policy
    (2 of the 8 KV heads with their 16 query heads, a quarter of the MLP and of the vocabulary)."""
    import json

    from bmc.parallel.shard import MatrixShapes, shard_model
    from bmc.parallel.tp import shape_model

    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=8192,
                  intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = shape_model(str(tmp_path), "bfloat16", torch.device("cpu"), MatrixShapes)
    shard_model(model, 0, 4)
    L = model.net.layers[79]
    assert L.qkv.wt.is_meta and L.ln1.device.type == "cpu"  # matrices shapes only; norms real
    assert tuple(L.qkv.wt.shape) == (8192, (16 + 2 + 2) * 128) and tuple(L.o.wt.shape) == (16 * 128, 8192)
    assert tuple(L.gate_up.wt.shape) == (8192, 2 * 7168) and tuple(L.down.wt.shape) == (7168, 8192)
    assert tuple(model.net.lm_head.wt.shape) == (8192, 8000)
    assert (model.config.num_heads, model.config.num_kv_heads, model.config.intermediate_size) == (16, 2, 7168)


def test_random_rank_part_is_the_loaded_part(gqa_dir, tmp_path):
    """A rank's random part (MatrixShapes, then fill_random) has every tensor of the loaded model's part: the same
    shapes and dtypes, all allocated (no meta tensor left), the same bytes a step reads."""
    import shutil

    from bmc.models import load_model
    from bmc.parallel.shard import MatrixShapes, fill_random, shard_model
    from bmc.parallel.tp import shape_model

    shutil.copy(gqa_dir / "config.json", tmp_path / "config.json")
    for rank in (0, 1):
        whole = load_model(str(gqa_dir), quant="none")
        shard_model(whole, rank, 2)
        part = shape_model(str(tmp_path), "float32", torch.device("cpu"), MatrixShapes)
        shard_model(part, rank, 2)
        fill_random(part)
        for a, b in zip([whole.net, *whole.net.layers], [part.net, *part.net.layers]):
            for name, v in vars(a).items():
                w = vars(b)[name]
                if isinstance(v, torch.Tensor) or hasattr(v, "wt"):
                    for x, y in ((v.wt, w.wt), (v.b, w.b)) if hasattr(v, "wt") else ((v, w),):
                        assert (x is None) == (y is None), name
                        if x is not None:
                            assert (x.shape, x.dtype) == (y.shape, y.dtype) and not y.is_meta, name
        assert part.weight_bytes == whole.weight_bytes


def test_refused_request_leaves_the_group_up(gqa_dir):
    tp = bmc.load(str(gqa_dir), tp=2)
    try:
        with pytest.raises(bmc.InvalidRequestError, match="beyond the model's context"):
            bmc.generate(tp, PROMPTS, max_new_tokens=10_000)
        assert len(bmc.generate(tp, PROMPTS[:1], max_new_tokens=3, ignore_eos=True)[0].token_ids) == 3
        with pytest.raises(bmc.InvalidRequestError, match="quant"):
            bmc.load(str(gqa_dir), tp=2, quant="q8_0")
        from bmc.chat import ChatSession

        for not_built in (lambda: bmc.perplexity(tp, "some text"), lambda: ChatSession(tp),
                          lambda: bmc.stream(tp, PROMPTS, max_new_tokens=2)):
            with pytest.raises(bmc.InvalidRequestError, match="tp > 1"):
                not_built()
    finally:
        tp.close()


def test_a_killed_rank_stops_the_group(gqa_dir):
    tp = bmc.load(str(gqa_dir), tp=2)
    os.kill(tp.procs[1].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 exited"):
        bmc.generate(tp, PROMPTS, max_new_tokens=4)
    assert time.monotonic() - t0 < 30
    assert not tp.procs  # every rank stopped
    with pytest.raises(TensorParallelError, match="stopped"):
        bmc.generate(tp, PROMPTS, max_new_tokens=4)


def test_a_hung_rank_stops_the_group_within_the_timeout(gqa_dir):
    """Rank 1 stopped (SIGSTOP: alive, silent): rank 0's next collective times out after gloo's timeout, and the
    call raises instead of waiting forever."""
    tp = TensorParallelModel(str(gqa_dir), 2, timeout_s=5)
    os.kill(tp.procs[1].pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with pytest.raises(TensorParallelError, match="rank 0 failed"):
            bmc.generate(tp, PROMPTS, max_new_tokens=4)
        assert time.monotonic() - t0 < 60
    finally:
        for p in tp.procs:
            os.kill(p.pid, signal.SIGKILL)
        tp.close()


def test_bmc_generate_tp_flag(gqa_dir):
    """The CLI with --tp 2 prints what one process prints."""
    import subprocess
    import sys

    def run(*extra: str) -> str:
        cmd = [sys.executable, "-m", "bmc.cli.generate", "--model", str(gqa_dir), "--max-new-tokens", "8",
               "--ignore-eos", "--no-weights-cache", *extra, "the quick brown fox"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert run("--tp", "2") == run()


def _follower_pids(pid: int) -> list[int]:
    """The spawned rank processes among a process's children (not multiprocessing's resource tracker)."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as c:
                    if b"spawn_main" in c.read():
                        out.append(int(child))
    return out


TWO_GPUS = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.mark.parametrize("device, flags", [("cpu", []), pytest.param("cuda", [], marks=TWO_GPUS),
                                           pytest.param("cuda", ["--no-cuda-graphs"], marks=TWO_GPUS)])
def test_bmc_serve_tp2_equals_generate_alone(gqa_dir, device, flags):
    """bmc-serve --tp 2 (gloo CPU ranks, or NCCL over two GPUs, graphs on and off): concurrent greedy and seeded
    requests (n=2), prefix-cache hits and a cancelled stream give what generate() gives each alone in one process;
    killing a follower rank stops the engine: the request in flight gets an error and the server exits non-zero,
    naming the rank."""
    import concurrent.futures

    import httpx

    from .serving import ServerProcess

    shared = list(range(60, 100))  # 40 tokens: two prefix-cache blocks
    prompts = [shared + [5, 17, 33], shared + [40, 41], PROMPTS[0], shared + [5, 17, 33]]
    one = bmc.load(str(gqa_dir), quant="none", device=device)
    srv = ServerProcess(["--model", str(gqa_dir), "--tp", "2", "--device", device, "--no-weights-cache",
                         "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--prefix-cache-bytes",
                         str(1 << 22), *flags])
    try:
        def complete(ids: list[int], **kw) -> list[str]:
            body = {"prompt": ids, "max_tokens": 10, "ignore_eos": True, "temperature": 0, **kw}
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

        def tokens(ids: list[int], **kw) -> list[str]:
            return [c.text for c in bmc.generate(one, [ids], max_new_tokens=10, ignore_eos=True, **kw)]

        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                          json={"prompt": shared, "max_tokens": 80, "stream": True,
                                "ignore_eos": True}) as cancelled:
            next(cancelled.iter_lines())  # running: its rows leave at a step boundary on both ranks
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            greedy = [pool.submit(complete, p) for p in prompts[:3]]
            sampled = pool.submit(complete, prompts[0], temperature=0.8, seed=5, n=2)
            assert [f.result(timeout=180) for f in greedy] == [tokens(p) for p in prompts[:3]]
            assert sampled.result(timeout=180) == tokens(prompts[0], temperature=0.8, seed=5, num_samples=2)
        assert complete(prompts[3]) == tokens(prompts[3])  # the whole shared prefix read from the cache
        assert srv.metric("bmc:prefix_cache_hits_total") >= len(shared)

        followers = _follower_pids(srv.proc.pid)
        assert len(followers) == 1
        os.kill(followers[0], signal.SIGKILL)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 4}, timeout=120)
        assert r.status_code >= 500
        assert srv.proc.wait(60) != 0
        assert "rank 1" in srv.output()
    finally:
        srv.stop()


def test_served_prefix_cache_needs_even_kv_heads():
    """A rank's cached bytes decide its evictions: the prefix cache is served where every rank holds as many KV heads
    (divided evenly, or replicated), and off where they differ (3 KV heads over 2 ranks)."""
    from types import SimpleNamespace

    from bmc.engine_options import EngineOptions
    from bmc.parallel.serve import even_prefix_cache

    on = EngineOptions(prefix_cache_bytes=1 << 20)
    for heads, kv_heads, world, kept in ((8, 4, 2, True), (8, 1, 2, True), (6, 3, 2, False), (8, 2, 4, True)):
        got = even_prefix_cache(SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads), world, on)
        assert (got.prefix_cache_bytes == on.prefix_cache_bytes) == kept, (heads, kv_heads, world)
