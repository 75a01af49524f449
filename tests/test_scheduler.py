"""The continuous-batching scheduler against generate() alone: requests that join at different steps, leave,
are cancelled at every point of their life and of a chunk, prompts prefilled in chunks between decode steps;
the batch cache's integrity after every step, and its rows and KV back to nothing when idle."""
from __future__ import annotations

import pytest
import torch

import bmc
from bmc.engine import GenerationConfig
from bmc.errors import InvalidRequestError
from bmc.sampling import SamplingParams
from bmc.scheduler import QueueFullError, Request, Scheduler, TokenOutput

from .conftest import skip_unless_isa, transformers  # noqa: F401

PROMPTS = [[5, 17, 33, 80, 101, 7, 9, 250, 12], [40, 41, 42], [300, 3, 99, 98, 97, 96, 14, 15, 16, 17, 18, 19, 20],
           [7], [60, 61, 62, 63, 64]]


class Collector:
    """A request's emitted tokens per sample, its error, and the step each token came at."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.text: dict[int, str] = {}
        self.finish: dict[int, str] = {}
        self.error: BaseException | None = None
        self.steps: list[int] = []
        self.step = 0

    def __call__(self, out: TokenOutput | BaseException) -> None:
        if isinstance(out, BaseException):
            self.error = out
            return
        assert out.sample_index not in self.finish, "a token after the sample's finish"
        self.tokens.setdefault(out.sample_index, []).append(out.token_id)
        self.text[out.sample_index] = self.text.get(out.sample_index, "") + out.text
        self.steps.append(self.step)
        if out.finish_reason:
            self.finish[out.sample_index] = out.finish_reason


def request(prompt, n_new: int, *, n: int = 1, temperature: float = 0.0, seed: int | None = None,
            ignore_eos: bool = True, stop=()) -> tuple[Request, Collector]:
    col = Collector()
    gen = GenerationConfig(max_new_tokens=n_new, num_samples=n, ignore_eos=ignore_eos, stop=tuple(stop),
                           sampling=SamplingParams(temperature=temperature, seed=seed))
    return Request(list(prompt), gen, col), col


def drive(sched: Scheduler, arrivals: dict[int, list[Request]], cancels: dict[int, list[Request]] | None = None,
          collectors=(), max_steps: int = 400) -> int:
    """Run steps, adding and cancelling requests at the given step numbers; check the cache after every step."""
    cancels = cancels or {}
    last = max([*arrivals, *cancels, 0])
    for step in range(max_steps):
        for col in collectors:
            col.step = step
        for req in arrivals.get(step, []):
            sched.add(req)
        for req in cancels.get(step, []):
            sched.abort(req)
        sched.step()
        sched.cache.check_integrity()
        if sched.prefix_cache is not None:
            sched.prefix_cache.check_integrity()
        assert len(sched.rows) == sched.cache.batch_size
        if step >= last and not sched.has_work():
            return step
    raise AssertionError("the scheduler did not go idle")


def alone(model, prompt, n_new: int, **kw) -> list[int]:
    return bmc.generate(model, [list(prompt)], max_new_tokens=n_new, ignore_eos=True, **kw)[0].token_ids


def assert_idle(sched: Scheduler) -> None:
    assert sched.cache.batch_size == 0 and sched.cache.nbytes == 0 and sched.kv_bytes == 0
    assert sched.num_running == 0 and sched.num_waiting == 0


@pytest.mark.parametrize("budget", [64, 6], ids=["whole-prompts", "chunked-prefill"])
@pytest.mark.parametrize("kv", ["bmc", "upfront", "iterative"])
@pytest.mark.parametrize("run_ahead", [False, True], ids=["", "run-ahead"])
def test_staggered_requests_equal_generate_alone(gqa_dir, kv, budget, run_ahead):
    """run_ahead: the decode steps launched before the last one's tokens are read (bmc/run_ahead.py, on by
    default over CUDA graphs), forced on here."""
    model = bmc.load(str(gqa_dir))
    sched = Scheduler(model, max_num_seqs=3, max_num_batched_tokens=budget, kv=kv, r=4 if kv == "bmc" else None,
                      run_ahead=run_ahead)
    lengths = [14, 6, 9, 11, 3]
    reqs = [request(p, n) for p, n in zip(PROMPTS, lengths)]
    arrivals = {0: [reqs[0][0]], 2: [reqs[1][0], reqs[2][0]], 5: [reqs[3][0]], 9: [reqs[4][0]]}
    drive(sched, arrivals, collectors=[c for _, c in reqs])
    for (req, col), p, n in zip(reqs, PROMPTS, lengths):
        assert col.error is None
        assert col.tokens == {0: alone(model, p, n)}, (kv, p)
        assert col.finish == {0: "length"}
    assert_idle(sched)
    assert sched.counters.finished["length"] == len(reqs)
    assert sched.counters.joins_in_place >= 1  # a request took a finished one's slot without moving the batch
    if model.net.native_decoder() is not None:  # decode rows and prompt chunks ran in one native forward
        assert sched.counters.fused_steps >= 1
    assert (sched.counters.ahead_steps > 0) == run_ahead  # steps between the arrivals and chunks ran ahead


@pytest.mark.parametrize("kv", ["bmc", "upfront"])
def test_prompts_that_arrive_together_prefill_as_one_batch_on_the_pytorch_path(gqa_dir, monkeypatch, kv):
    """Where each part is a forward of its own (CUDA, or BMC_NATIVE=0), whole prompts that start in one step are
    prefilled together, left-padded, and copied into their own caches: each request equals generate() alone,
    greedy and seeded samples, also a prompt chunked beside them."""
    monkeypatch.setenv("BMC_NATIVE", "0")
    model = bmc.load(str(gqa_dir))
    sched = Scheduler(model, max_num_seqs=6, max_num_batched_tokens=40, kv=kv, r=4 if kv == "bmc" else None)
    reqs = [request(p, 7) for p in PROMPTS[:4]] + [request(PROMPTS[4], 6, n=2, temperature=0.9, seed=4),
                                                   request(list(range(20, 60)), 5)]
    forwards = []
    net_call = type(model.net).__call__
    monkeypatch.setattr(type(model.net), "__call__",
                        lambda self, tokens, *a, **k: (forwards.append(tuple(tokens.shape)), net_call(self, tokens, *a, **k))[1])
    drive(sched, {0: [r for r, _ in reqs]}, collectors=[c for _, c in reqs])
    for (req, col), p in zip(reqs[:4], PROMPTS):
        assert col.tokens == {0: alone(model, p, 7)}, p
    sampled = bmc.generate(model, [PROMPTS[4]], max_new_tokens=6, ignore_eos=True, num_samples=2, temperature=0.9,
                           seed=4)
    assert reqs[4][1].tokens == {0: sampled[0].token_ids, 1: sampled[1].token_ids}
    assert reqs[5][1].tokens == {0: alone(model, list(range(20, 60)), 5)}
    assert (5, max(map(len, PROMPTS))) in forwards  # the five short prompts in one forward
    assert_idle(sched)


def test_chunked_prefill_does_not_stop_running_rows(gqa_dir):
    """A 40-token prompt arriving under a 6-token budget takes several steps to prefill; the running request
    gets a token at every one of them."""
    model = bmc.load(str(gqa_dir))
    sched = Scheduler(model, max_num_seqs=2, max_num_batched_tokens=6)
    long_prompt = list(range(20, 60))
    (a, ca), (b, cb) = request(PROMPTS[0], 20), request(long_prompt, 4)
    drive(sched, {0: [a], 3: [b]}, collectors=[ca, cb])
    assert cb.tokens == {0: alone(model, long_prompt, 4)} and ca.tokens == {0: alone(model, PROMPTS[0], 20)}
    first_b = cb.steps[0]
    assert first_b >= 3 + 40 // 5 - 1  # the prompt took several chunks ...
    assert set(range(3, first_b + 1)) <= set(ca.steps)  # ... and `a` decoded at every step meanwhile


@pytest.mark.parametrize("at", range(0, 12))
def test_cancel_at_every_point(gqa_dir, at):
    """Cancel the middle request at each step of its life (waiting, prefilling in chunks, joining, decoding,
    across a chunk boundary of r = 4): it emits nothing after, the others are untouched, everything is freed."""
    model = bmc.load(str(gqa_dir))
    sched = Scheduler(model, max_num_seqs=2, max_num_batched_tokens=4, r=4)
    reqs = [request(PROMPTS[0], 10), request(PROMPTS[2], 12), request(PROMPTS[4], 6)]
    arrivals = {0: [reqs[0][0]], 1: [reqs[1][0], reqs[2][0]]}
    victim, vcol = reqs[1]
    drive(sched, arrivals, cancels={at: [victim]}, collectors=[c for _, c in reqs])
    assert all(s <= at for s in vcol.steps)
    assert vcol.error is None
    for (req, col), p, n in [(reqs[0], PROMPTS[0], 10), (reqs[2], PROMPTS[4], 6)]:
        assert col.tokens == {0: alone(model, p, n)}
    assert_idle(sched)
    assert sched.counters.finished["abort"] + sched.counters.finished["length"] == 3


def test_compaction_drops_the_columns_of_rows_that_left(gqa_dir):
    model = bmc.load(str(gqa_dir))
    sched = Scheduler(model, max_num_seqs=2, max_num_batched_tokens=64, r=4)
    (a, ca), (b, cb) = request(list(range(10, 50)), 6), request([3, 4], 30)
    sched.add(a)
    sched.add(b)
    widths = []
    for _ in range(40):
        sched.step()
        sched.cache.check_integrity()
        widths.append((sched.cache.batch_size, sched.cache.length))
        if not sched.has_work():
            break
    assert ca.tokens == {0: alone(model, list(range(10, 50)), 6)} and cb.tokens == {0: alone(model, [3, 4], 30)}
    # while both run the short row is padded to the long one's 40+ columns; once `a` left, b's cache holds its own
    # 2 + generated columns only
    assert any(B == 2 and length > 40 for B, length in widths)
    alone_b = [length for B, length in widths if B == 1]
    assert alone_b and alone_b[0] < 12


def test_samples_with_a_seed_equal_generate_alone(gqa_dir):
    model = bmc.load(str(gqa_dir))
    sched = Scheduler(model, max_num_seqs=5, max_num_batched_tokens=32)
    (a, ca), (b, cb) = request(PROMPTS[0], 10, n=3, temperature=0.9, seed=7), request(PROMPTS[1], 12)
    drive(sched, {0: [b], 2: [a]}, collectors=[ca, cb])
    want = bmc.generate(model, [PROMPTS[0]], max_new_tokens=10, ignore_eos=True, num_samples=3, temperature=0.9,
                        seed=7, share_prefix="off")
    assert ca.tokens == {c.sample_index: c.token_ids for c in want}
    assert len({tuple(t) for t in ca.tokens.values()}) > 1  # the samples differ
    assert cb.tokens == {0: alone(model, PROMPTS[1], 12)}


def test_stop_strings_eos_and_text_equal_generate(gqa_dir):
    model = bmc.load(str(gqa_dir))
    text = "the quick brown fox"
    ref = bmc.generate(model, [text], max_new_tokens=16, ignore_eos=True)[0]
    stop = ref.text[4:7] if len(ref.text) > 8 else ref.text[-2:]
    want = bmc.generate(model, [text], max_new_tokens=16, stop=stop)[0]
    sched = Scheduler(model, max_num_seqs=2, max_num_batched_tokens=16)
    (a, ca) = request(model.tokenizer.encode(text), 16, ignore_eos=False, stop=[stop])
    (b, cb) = request(PROMPTS[2], 5)
    drive(sched, {0: [b], 1: [a]}, collectors=[ca, cb])
    assert ca.tokens[0] == want.token_ids and ca.text[0] == want.text and ca.finish[0] == want.finish_reason


def test_sliding_window_model_under_the_scheduler(tmp_path):
    from .test_sliding_window import make_mistral

    model = bmc.load(str(make_mistral(tmp_path / "m", 5)))
    sched = Scheduler(model, max_num_seqs=3, max_num_batched_tokens=8, r=4)
    reqs = [request(p, 12) for p in PROMPTS[:3]]
    drive(sched, {0: [reqs[0][0]], 3: [reqs[1][0]], 4: [reqs[2][0]]}, collectors=[c for _, c in reqs])
    for (_, col), p in zip(reqs, PROMPTS):
        assert col.tokens == {0: alone(model, p, 12)}
    assert_idle(sched)


def test_admission_errors_and_queue_limit(gqa_dir):
    model = bmc.load(str(gqa_dir))
    sched = Scheduler(model, max_num_seqs=2, max_num_batched_tokens=8, max_queue=1)
    with pytest.raises(InvalidRequestError, match="context"):
        sched.add(request([5] * 100, model.max_context)[0])
    with pytest.raises(InvalidRequestError, match="max_num_seqs"):
        sched.add(request([5], 3, n=3)[0])
    for _ in range(3):  # two take the free rows, one waits
        sched.add(request([5], 3)[0])
    with pytest.raises(QueueFullError):
        sched.add(request([6], 3)[0])
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens"):
        Scheduler(model, max_num_seqs=8, max_num_batched_tokens=8)


def test_a_failing_request_fails_alone(gqa_dir, monkeypatch):
    """An exception inside one request's prefill ends that request with the error; the others finish."""
    model = bmc.load(str(gqa_dir))
    sched = Scheduler(model, max_num_seqs=3, max_num_batched_tokens=32)
    (a, ca), (bad, cbad), (c, cc) = request(PROMPTS[0], 8), request(PROMPTS[1], 8), request(PROMPTS[2], 8)
    real = sched._chunk_part

    def chunk(p, t):
        if p.request is bad:
            raise RuntimeError("boom")
        return real(p, t)

    monkeypatch.setattr(sched, "_chunk_part", chunk)
    drive(sched, {0: [a], 1: [bad, c]}, collectors=[ca, cbad, cc])
    assert isinstance(cbad.error, RuntimeError) and not cbad.tokens
    assert ca.tokens == {0: alone(model, PROMPTS[0], 8)} and cc.tokens == {0: alone(model, PROMPTS[2], 8)}
    assert sched.counters.finished["error"] == 1
    assert_idle(sched)


def test_a_fused_step_that_fails_reruns_part_by_part(gqa_dir, monkeypatch):
    """When the fused forward raises, the step runs each part alone: an error inside one prompt's forward fails
    that request only, and the decode rows and the other prompts go on to generate()'s tokens."""
    model = bmc.load(str(gqa_dir))
    sched = Scheduler(model, max_num_seqs=3, max_num_batched_tokens=32)
    (a, ca), (bad, cbad), (c, cc) = request(PROMPTS[0], 8), request(PROMPTS[1], 8), request(PROMPTS[2], 8)
    fused_calls = []

    def fused(parts):
        fused_calls.append(len(parts))
        raise RuntimeError("fused step failed")

    real_call = type(model.net).__call__

    def forward(net, tokens, positions, cache, attention, bias, all_logits=False, prompt_len=None):
        if tokens.shape[0] == 1 and tokens[0, 0].item() == PROMPTS[1][0]:
            raise RuntimeError("boom in the forward")
        return real_call(net, tokens, positions, cache, attention, bias, all_logits, prompt_len)

    monkeypatch.setattr(model.net, "forward_parts", fused)
    monkeypatch.setattr(type(model.net), "__call__", forward)
    drive(sched, {0: [a], 1: [bad, c]}, collectors=[ca, cbad, cc])
    monkeypatch.undo()
    assert fused_calls and sched.counters.fused_steps == 0
    assert isinstance(cbad.error, RuntimeError) and "boom" in str(cbad.error) and not cbad.tokens
    assert ca.tokens == {0: alone(model, PROMPTS[0], 8)} and cc.tokens == {0: alone(model, PROMPTS[2], 8)}
    assert sched.counters.finished["error"] == 1
    assert_idle(sched)


def test_logprobs_are_the_models(gqa_dir):
    model = bmc.load(str(gqa_dir))
    sched = Scheduler(model, max_num_seqs=2, max_num_batched_tokens=32)
    got: list[TokenOutput] = []
    gen = GenerationConfig(max_new_tokens=3, ignore_eos=True)
    sched.add(Request(list(PROMPTS[0]), gen, got.append, logprobs=2))
    drive(sched, {})
    with torch.inference_mode():
        ids = PROMPTS[0] + [o.token_id for o in got[:-1]]
        logits = transformers.AutoModelForCausalLM.from_pretrained(gqa_dir, dtype=torch.float32)(
            torch.tensor([ids])).logits[0, len(PROMPTS[0]) - 1:]
    lp = torch.log_softmax(logits, -1)
    for i, o in enumerate(got):
        assert o.logprob == pytest.approx(float(lp[i, o.token_id]), abs=1e-4)
        assert [t for t, _ in o.top_logprobs] == lp[i].topk(2).indices.tolist()


def test_engine_options_are_checked_in_one_place(gqa_dir):
    """The engine's settings are one EngineOptions, checked when made; a scheduler takes it and changes by name."""
    from bmc.engine_options import EngineOptions

    model = bmc.load(str(gqa_dir))
    with pytest.raises(InvalidRequestError, match="unknown engine option maxseqs"):
        Scheduler(model, maxseqs=3)
    with pytest.raises(InvalidRequestError, match="must exceed max_num_seqs"):
        EngineOptions(max_num_seqs=8, max_num_batched_tokens=8)
    with pytest.raises(InvalidRequestError, match="unknown speculative"):
        EngineOptions(speculative="bogus")
    with pytest.raises(InvalidRequestError, match="spec_max_tokens"):
        EngineOptions(spec_max_tokens=1)
    sched = Scheduler(model, EngineOptions(max_num_seqs=2, kv="upfront"), max_num_seqs=3)
    assert (sched.options.max_num_seqs, sched.options.kv, sched.max_num_seqs) == (3, "upfront", 3)


class LogprobCollector(Collector):
    """Collector that also keeps each token's log-probability, the float the engine computed."""

    def __init__(self) -> None:
        super().__init__()
        self.logprobs: list[float] = []

    def __call__(self, out: TokenOutput | BaseException) -> None:
        super().__call__(out)
        if not isinstance(out, BaseException):
            self.logprobs.append(out.logprob)


@pytest.mark.parametrize("quant", ["none", "q4_0"])
def test_a_prompt_chunked_or_whole_gives_the_same_logprobs_bit_for_bit(tmp_path, quant):
    """A row's arithmetic does not depend on how its prompt is chunked: the GEMMs sum a row alike at any row
    count, a prompt row's attention takes spans of a fixed size folded in order and its scores as a matrix product
    at any row count, and a row's softmax sums and last key block do not depend on where its chunk ends. So a
    request whose prompt is prefilled in chunks of a 40-token budget gets, bit for bit, the log-probabilities of
    the same request prefilled whole, at another thread count: not only the same tokens. Prompts of 283 and 121
    tokens cross the 256-key spans and end in chunks of fewer than 8 rows a KV head."""
    model = _tiny_long(tmp_path, quant)
    g = torch.Generator().manual_seed(11)
    for n in (283, 121):  # last chunks of 3 and 1 tokens: 6 and 2 rows a KV head
        assert_chunked_equals_whole(model, torch.randint(3, 320, (n,), generator=g).tolist(), 12)


def assert_chunked_equals_whole(model, prompt: list[int], tokens: int) -> None:
    """The prompt prefilled whole at 1 thread, then in chunks of a 40-token budget at 2: the same tokens and
    log-probabilities, compared exactly as floats."""
    runs = []
    for budget, threads in ((512, 1), (40, 2)):
        col = LogprobCollector()
        req = Request(list(prompt), GenerationConfig(max_new_tokens=tokens, ignore_eos=True), col, logprobs=1)
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(threads)
            drive(Scheduler(model, max_num_seqs=1, max_num_batched_tokens=budget), {0: [req]}, collectors=[col])
        finally:
            torch.set_num_threads(before)
        assert col.error is None and len(col.logprobs) == tokens
        runs.append(col)
    whole, chunked = runs
    assert chunked.tokens == whole.tokens
    assert chunked.logprobs == whole.logprobs  # floats compared exactly


@pytest.mark.parametrize("quant,activations,kv_dtype", [
    ("none", "float", "auto"), ("q4_0", "float", "auto"), ("q8_0", "float", "auto"), ("q4_0", "int8", "auto"),
    ("none", "bfloat16", "auto"), ("q4_0", "float", "int8"), ("none", "float", "bfloat16")])
def test_served_logprobs_are_the_alone_runs_bit_for_bit(tmp_path, quant, activations, kv_dtype):
    """Requests served together (joining at different steps, their prompts prefilled in chunks of a 40-token
    budget beside the others' decode rows, rows of other lengths left-padded in the batch cache, with bmc-serve's
    prefix cache: a 600-token prompt read in place from its cached blocks, and a later request's 400-token hit of
    it read in place) get each run alone's log-probabilities bit for bit, not only its tokens: every GEMM
    sums a row alike at any row count, and attention counts each row's span and chunk grid from its own first key,
    reading cached blocks as the row's first keys, so a row's keys meet the same grid at any column of any
    capacity. Alone runs at 1 thread with prompts prefilled whole; served at 2. In float32
    arithmetic, with int8 activations (VNNI) and with bfloat16 prompts (each row's rounding its own); over float32,
    int8 and bfloat16 KV."""
    from bmc.kernels.native import native_module

    if activations == "int8":
        skip_unless_isa(native_module().has_int8_dot(), ("avx512_vnni", "avx512vbmi"),
                        "int8 activations need AVX512-VNNI and AVX512-VBMI")
    model = _tiny_long(tmp_path, quant, activations)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (600, 23, 150, 77)]
    prompts.append(prompts[0][:400] + torch.randint(3, 320, (50,), generator=g).tolist())  # a hit of 400 tokens

    # with bmc-serve's prefix cache on: a 600-token prompt is past the length from which the CPU once read a
    # single request's own prompt in place (as a segment, which sums in its own order)
    sched = Scheduler(model, max_num_seqs=4, max_num_batched_tokens=40, kv_dtype=kv_dtype, prefix_cache_bytes=1 << 26)
    in_place, step = [], sched.step
    sched.step = lambda: (step(), in_place.append(sched.shared_prefix_rows))[0]  # type: ignore[method-assign]
    # 4 takes 0's slot when it leaves
    assert_served_equals_alone(model, prompts, sched, {0: [0], 2: [1], 5: [2, 3], 10: [4]}, 16, kv_dtype=kv_dtype)
    assert sched.counters.cached_prompt_tokens >= 400  # the last request's hit, read in place
    assert max(in_place) == 1  # a row read cached blocks in place (600-token prompt, then the hit), no other
    # with them (cached blocks that several rows read are Hydragen's: read once for all, summed in their order)
    if kv_dtype != "auto":
        assert sched.cache.format.name == kv_dtype


@pytest.mark.parametrize("quant,kv_dtype", [("none", "auto"), ("q4_0", "int8"), ("none", "bfloat16")])
def test_rows_sharing_a_cached_prefix_get_their_alone_logprobs_bit_for_bit(tmp_path, quant, kv_dtype):
    """Several decode rows reading the same cached blocks in one step (Hydragen: each chunk of the shared prefix
    read once for all of them) still get each request's alone log-probabilities bit for bit: the rows' shared
    keys go through the same spans, chunks and arithmetic as the same keys in a row's own cache. A 700-token prompt
    is cached and three requests hit 640 of its tokens (past two whole spans of 256 keys and into a third) while
    it still decodes, each with a suffix of its own."""
    model = _tiny_long(tmp_path, quant)
    g = torch.Generator().manual_seed(5)
    first = torch.randint(3, 320, (700,), generator=g).tolist()
    prompts = [first] + [first[:640] + torch.randint(3, 320, (n,), generator=g).tolist() for n in (30, 47, 12)]
    sched = Scheduler(model, max_num_seqs=4, max_num_batched_tokens=64, kv_dtype=kv_dtype, prefix_cache_bytes=1 << 26)
    sharing, step = [], sched.step
    sched.step = lambda: (step(), sharing.append(sched.shared_prefix_rows))[0]  # type: ignore[method-assign]
    assert_served_equals_alone(model, prompts, sched, {0: [0], 14: [1, 2, 3]}, 24, kv_dtype=kv_dtype)
    assert sched.counters.cached_prompt_tokens >= 3 * 640
    assert max(sharing) >= 3  # rows read the cached blocks together in one step


def assert_served_equals_alone(model, prompts: list[list[int]], sched: Scheduler, arrivals: dict[int, list[int]],
                               tokens: int, **alone: object) -> None:
    """Each prompt run alone (its own scheduler with `alone`'s options, prefilled whole, 1 thread), then all served
    by `sched` as `arrivals` ({step: prompt indices}) says: each request the same tokens and log-probabilities,
    compared exactly as floats."""
    def run(sched: Scheduler, arrivals: dict[int, list[int]]) -> list[LogprobCollector]:
        cols = [LogprobCollector() for _ in prompts]
        reqs = [Request(list(p), GenerationConfig(max_new_tokens=tokens, ignore_eos=True), c, logprobs=1)
                for p, c in zip(prompts, cols)]
        drive(sched, {step: [reqs[i] for i in ids] for step, ids in arrivals.items()}, collectors=cols)
        return cols

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone_runs = [run(Scheduler(model, max_num_seqs=1, max_num_batched_tokens=512, **alone), {0: [i]})[i]
                      for i in range(len(prompts))]
    finally:
        torch.set_num_threads(threads)
    for one, many in zip(alone_runs, run(sched, arrivals)):
        assert many.error is None and len(many.logprobs) == tokens
        assert many.tokens == one.tokens
        assert many.logprobs == one.logprobs  # floats compared exactly


def _tiny_long(tmp_path, quant: str, activations: str = "float"):
    """A tiny GQA Llama (head_dim 64, the vectorised attention paths) with positions for prompts past 256 keys."""
    from .conftest import save_tiny

    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    path = save_tiny(tmp_path / "tiny", transformers.LlamaForCausalLM(cfg).eval(), 320)
    return bmc.load(str(path), quant=quant, activations=activations)
