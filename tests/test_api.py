"""The Python API: completions, streaming, sampling, stops, and a typed error for every bad input."""
from __future__ import annotations

import json
import re

import pytest
import torch

import bmc
from bmc.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError
from bmc.sampling import Sampler, SamplingParams
from bmc.textstream import TextStream


@pytest.fixture(scope="module")
def model(gqa_dir):
    return bmc.load(str(gqa_dir))


def test_string_prompts_completions_and_stream_agree(model):
    prompts = ["the quick brown fox", "hello world"]
    out = bmc.generate(model, prompts, max_new_tokens=8, ignore_eos=True)
    assert [(c.prompt_index, c.sample_index) for c in out] == [(0, 0), (1, 0)]
    for c in out:
        assert len(c.token_ids) == 8 and c.finish_reason == "length"
        assert c.text == model.tokenizer.decode(c.token_ids)
    events = list(bmc.stream(model, prompts, max_new_tokens=8, ignore_eos=True))
    assert len(events) == 16
    for c in out:
        mine = [e for e in events if e.prompt_index == c.prompt_index]
        assert [e.token_id for e in mine] == c.token_ids
        assert "".join(e.text for e in mine) == c.text
        assert [e.finish_reason for e in mine] == [None] * 7 + ["length"]


def test_eos_stops_a_row_and_others_continue(model):
    free = bmc.generate(model, [[5, 6, 7], [40, 41]], max_new_tokens=10, ignore_eos=True)
    eos = free[0].token_ids[3]  # make row 0's 4th token an EOS: row 0 must stop there, row 1 run on unchanged
    model.tokenizer.eos_token_ids.append(eos)
    try:
        out = bmc.generate(model, [[5, 6, 7], [40, 41]], max_new_tokens=10)
    finally:
        model.tokenizer.eos_token_ids.remove(eos)
    assert out[0].token_ids == free[0].token_ids[:4] and out[0].finish_reason == "stop"
    cut = free[1].token_ids.index(eos) + 1 if eos in free[1].token_ids else 10
    assert out[1].token_ids == free[1].token_ids[:cut]


def test_num_samples_forks_prompt_and_greedy_samples_agree(model):
    out = bmc.generate(model, [[5, 6, 7]], max_new_tokens=6, num_samples=3, ignore_eos=True)
    assert [(c.prompt_index, c.sample_index) for c in out] == [(0, 0), (0, 1), (0, 2)]
    assert out[0].token_ids == out[1].token_ids == out[2].token_ids
    assert out.stats.batch_size == 3


def test_seeded_sampling_is_reproducible_and_varies(model):
    kw = dict(max_new_tokens=12, temperature=1.0, num_samples=4, ignore_eos=True)
    a = bmc.generate(model, [[5, 6, 7]], seed=1, **kw)
    b = bmc.generate(model, [[5, 6, 7]], seed=1, **kw)
    c = bmc.generate(model, [[5, 6, 7]], seed=2, **kw)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    assert len({tuple(x.token_ids) for x in a}) > 1  # samples of one prompt differ


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=0), torch.device("cpu")).probs(logits)
    assert (p[0, 2:] == 0).all() and p[0, :2].sum().item() == pytest.approx(1.0)
    probs = logits.softmax(-1)[0]  # [0.636, 0.234, 0.086, ...]
    p = Sampler(SamplingParams(temperature=1.0, top_p=0.8, seed=0), torch.device("cpu")).probs(logits)
    assert (p[0, :2] > 0).all() and (p[0, 2:] == 0).all() and probs[0] < 0.8 < probs[:2].sum()
    p = Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=0), torch.device("cpu")).probs(logits)
    assert p[0, 0] == 1.0  # the top token alone reaches 0.5


def test_stop_strings_cut_text_and_are_never_streamed(model):
    free = bmc.generate(model, ["hello world"], max_new_tokens=12, ignore_eos=True)[0]
    text = free.text
    assert len(text) > 4
    stop = text[2:4]
    out = bmc.generate(model, ["hello world"], max_new_tokens=12, ignore_eos=True, stop=[stop])[0]
    assert out.finish_reason == "stop" and out.text == text[: text.find(stop)]
    streamed = "".join(e.text for e in bmc.stream(model, ["hello world"], max_new_tokens=12, ignore_eos=True,
                                                  stop=stop))
    assert streamed == out.text and stop not in streamed


def test_textstream_holds_back_partial_stop_and_multibyte(model):
    tok = model.tokenizer
    ids = tok.encode("hello world é!", add_special_tokens=False)
    ts = TextStream(tok, stop=("xyz",))
    pieces = [ts.push(i)[0] for i in ids]
    assert "".join(pieces) + ts.flush() == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_textstream_never_emits_text_past_a_stop_split_across_tokens(model):
    tok = model.tokenizer
    ids = tok.encode("hello world é!", add_special_tokens=False)
    text, stop = tok.decode(ids), "ld é"
    assert not any(stop in tok.decode([i]) for i in ids)  # the stop string spans several tokens
    ts, pieces, stopped = TextStream(tok, stop=(stop,)), [], False
    for i in ids:
        piece, stopped = ts.push(i)
        pieces.append(piece)
        if stopped:
            break
    # emitted text cannot be taken back: the stop's first characters must have been held until it completed
    assert stopped and "".join(pieces) == text[: text.index(stop)]
    ts = TextStream(tok, stop=("ld x",))  # a near miss: everything held back is released
    assert "".join(ts.push(i)[0] for i in ids) + ts.flush() == text


def test_chat_formatting(model):
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<s>user: hi\nassistant:"
    out = bmc.generate(model, ["hi"], max_new_tokens=3, chat=True, ignore_eos=True)
    assert len(out[0].token_ids) == 3


def test_chat_without_a_chat_template(tmp_path, gqa_dir):
    d = _copy_with_config(tmp_path, gqa_dir)
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    del tok_cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    m = bmc.load(str(d))
    assert m.tokenizer is not None and m.tokenizer.chat_template is None
    with pytest.raises(ModelLoadError, match="has no chat template"):
        bmc.generate(m, ["hi"], max_new_tokens=2, chat=True)
    assert len(bmc.generate(m, ["hi"], max_new_tokens=2, ignore_eos=True)[0].token_ids) == 2  # plain prompts still run


def test_token_id_model_without_tokenizer(tmp_path, gqa_dir):
    import shutil

    d = tmp_path / "notok"
    shutil.copytree(gqa_dir, d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).unlink()
    m = bmc.load(str(d))
    assert m.tokenizer is None
    out = bmc.generate(m, [[5, 6, 7]], max_new_tokens=4, ignore_eos=True)
    assert out[0].text is None and len(out[0].token_ids) == 4
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        bmc.generate(m, ["text"], max_new_tokens=4)
    with pytest.raises(InvalidRequestError, match="stop strings need a tokenizer"):
        bmc.generate(m, [[5, 6, 7]], max_new_tokens=4, stop=["."])


BAD_REQUESTS = [
    (dict(prompts=[]), "non-empty"),
    (dict(prompts=[""]), "empty"),
    (dict(prompts=[[]]), "empty"),
    (dict(prompts=[[5, 99999]]), "outside"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0, temperature=1.0), "top_p"),
    (dict(top_p=1.5, temperature=1.0), "top_p"),
    (dict(top_k=0, temperature=1.0), "top_k"),
    (dict(r=0), "r must"),
    (dict(T=0), "T must"),
    (dict(r=4, T=4), "not both"),
    (dict(kv="paged"), "unknown kv"),
    (dict(num_samples=0), "num_samples"),
    (dict(max_new_tokens=500), "context"),
    (dict(stop=[""]), "stop strings must be non-empty"),
    (dict(attention="window", window_k=0), "window_k must be >= 1"),
    (dict(attention="sparq", sparq_k=0), "sparq k must be >= 1"),
]


@pytest.mark.parametrize("kw,match", BAD_REQUESTS, ids=[m for _, m in BAD_REQUESTS])
def test_bad_requests_raise_typed_errors(model, kw, match):
    kw = dict(kw)
    prompts = kw.pop("prompts", [[5, 6, 7]])
    kw.setdefault("max_new_tokens", 4)
    with pytest.raises(InvalidRequestError, match=match):
        list(bmc.generate(model, prompts, **kw))


def test_bad_model_paths(tmp_path, gqa_dir):
    with pytest.raises(ModelLoadError, match="does not exist"):
        bmc.load(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="config.json"):
        bmc.load(str(tmp_path))
    (tmp_path / "weights.txt").write_text("x")
    with pytest.raises(ModelLoadError, match="gguf"):
        bmc.load(str(tmp_path / "weights.txt"))


def _copy_with_config(tmp_path, src, drop=(), **changes):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    for key in drop:
        del cfg[key]
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_unsupported_architecture(tmp_path, gqa_dir):
    d = _copy_with_config(tmp_path, gqa_dir, model_type="gpt_neox")
    with pytest.raises(UnsupportedModelError, match="gpt_neox"):
        bmc.load(str(d))


# transformers >= 5 saves rope settings as `rope_parameters`, which bmc reads before `rope_scaling`: the legacy
# row clears it so that its rope_scaling is the one parsed.
BAD_CONFIGS = [
    pytest.param("llama-gqa", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}), (),
                 UnsupportedModelError, "unsupported rope scaling 'yarn'", id="rope_parameters_yarn"),
    pytest.param("llama-gqa", dict(rope_parameters=None, rope_scaling={"type": "dynamic", "factor": 2.0}), (),
                 UnsupportedModelError, "unsupported rope scaling 'dynamic'", id="rope_scaling_dynamic"),
    pytest.param("llama-gqa", dict(hidden_act="gelu"), (), UnsupportedModelError, "unsupported hidden_act 'gelu'",
                 id="hidden_act_gelu"),
    pytest.param("llama-gqa", dict(num_attention_heads=4, num_key_value_heads=3), (), ModelLoadError,
                 "num_attention_heads=4 is not a multiple of num_key_value_heads=3", id="heads_not_multiple_of_kv"),
    pytest.param("llama-gqa", {}, ("num_hidden_layers",), ModelLoadError,
                 "config.json lacks required field 'num_hidden_layers'", id="missing_num_hidden_layers"),
    pytest.param("opt-pre_norm", dict(activation_function="gelu_new"), (), UnsupportedModelError,
                 "unsupported OPT activation_function 'gelu_new'", id="opt_activation_gelu_new"),
    pytest.param("opt-pre_norm", dict(layer_norm_elementwise_affine=False), (), UnsupportedModelError,
                 "OPT with layer_norm_elementwise_affine=False is not supported", id="opt_no_elementwise_affine"),
]


@pytest.mark.parametrize("src,changes,drop,cls,match", BAD_CONFIGS)
def test_unsupported_or_invalid_config(tmp_path, tiny_dirs, src, changes, drop, cls, match):
    d = _copy_with_config(tmp_path, tiny_dirs[src], drop=drop, **changes)
    with pytest.raises(cls, match=re.escape(match)) as err:
        bmc.load(str(d))
    assert type(err.value) is cls  # an invalid config is not reported as an unsupported one, nor the reverse


def test_invalid_config_json_and_no_weight_files(tmp_path, gqa_dir):
    d = _copy_with_config(tmp_path, gqa_dir)
    (d / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    with pytest.raises(ModelLoadError, match=re.escape("config.json is not valid JSON")):
        bmc.load(str(d))
    d2 = tmp_path / "no_weights"
    d2.mkdir()
    (d2 / "config.json").write_text((gqa_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=re.escape("no model.safetensors, sharded index or pytorch_model.bin")):
        bmc.load(str(d2))


def test_sharded_index_naming_a_missing_shard(tmp_path, gqa_dir):
    from safetensors.torch import load_file, save_file

    d = _copy_with_config(tmp_path, gqa_dir)
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    names = sorted(tensors)
    in_first = set(names[: len(names) // 2])
    save_file({k: tensors[k] for k in in_first}, str(d / first))  # the second shard is never written
    weight_map = {k: first if k in in_first else second for k in names}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match=re.escape(f"names shard {second!r}, which does not exist")):
        bmc.load(str(d))


def test_wrong_shape_and_missing_tensors(tmp_path, gqa_dir):
    d = _copy_with_config(tmp_path, gqa_dir, intermediate_size=100)
    with pytest.raises(ModelLoadError, match="shape"):
        bmc.load(str(d))
    from safetensors.torch import load_file, save_file

    d2 = tmp_path / "m2"
    d2.mkdir()
    (d2 / "config.json").write_text((gqa_dir / "config.json").read_text())
    tensors = load_file(str(gqa_dir / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(d2 / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing tensor 'model.layers.1.mlp.down_proj.weight'"):
        bmc.load(str(d2))


def test_unknown_dtype_and_device():
    with pytest.raises(ModelLoadError, match="dtype"):
        bmc.load(dtype="float8")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA"):
            bmc.load(device="cuda")


def test_options_are_checked_in_one_place(model):
    """generate() and stream() take the same options (GenerateOptions), refused by name when unknown or missing."""
    for call in (bmc.generate, bmc.stream):
        with pytest.raises(InvalidRequestError, match="unknown option temprature"):
            call(model, [[5, 6]], max_new_tokens=2, temprature=0.5)
        with pytest.raises(InvalidRequestError, match="max_new_tokens is required"):
            call(model, [[5, 6]], temperature=0.5)
    gen = bmc.generation_config(max_new_tokens=3, temperature=0.7, seed=1, stop="\n", sparq_k=64, window_k=9)
    assert (gen.sampling.temperature, gen.sampling.seed, gen.stop) == (0.7, 1, ("\n",))
    assert (gen.attention_options.sparq.k, gen.attention_options.window_k) == (64, 9)
    assert set(bmc.GenerateOptions.__annotations__) >= {"max_new_tokens", "kv_dtype", "speculative", "share_prefix"}


def test_tokens_that_hold_part_of_a_character_show_their_own_bytes(gqa_dir):
    """logprobs' `token` for a token whose bytes are not whole UTF-8: `bytes:\\xNN`, as OpenAI writes it, never the
    replacement character, so two such tokens stay two entries of `top_logprobs`."""
    tok = bmc.load(str(gqa_dir)).tokenizer
    partial = [i for i in range(tok.backend.get_vocab_size()) if tok.logprob_text(i).startswith("bytes:")]
    assert len(partial) >= 2 and len({tok.logprob_text(i) for i in partial}) == len(partial)
    for i in partial:
        shown = tok.logprob_text(i).removeprefix("bytes:")
        assert bytes(int(h, 16) for h in shown.split("\\x")[1:]) == tok.token_bytes(i)
    whole = tok.encode("the", add_special_tokens=False)[0]
    assert tok.logprob_text(whole) == tok.decode([whole], skip_special_tokens=False)


def test_a_conversation_is_a_chat_prompt_and_other_prompt_kinds_are_refused(model):
    """With chat=True a prompt may be a list of messages (rendered by the chat template, as a string prompt is);
    token ids may be ints, numpy or tensor integers; anything else is refused by name, not a TypeError."""
    import numpy as np

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    want = bmc.generate(model, [model.tokenizer.encode(text)], max_new_tokens=4, ignore_eos=True)[0].token_ids
    assert bmc.generate(model, [messages], max_new_tokens=4, ignore_eos=True, chat=True)[0].token_ids == want
    ids = [5, 17, 33]
    plain = bmc.generate(model, [ids], max_new_tokens=3, ignore_eos=True)[0].token_ids
    for same in (np.array(ids), torch.tensor(ids)):
        assert bmc.generate(model, [same], max_new_tokens=3, ignore_eos=True)[0].token_ids == plain
    for bad, reason in (([messages], "needs chat=True"), ([[1.5, 2.0]], "list of float"), ([None], "NoneType"),
                        ([[True, 5]], "token ids"), ([[{"role": 1, "content": "x"}]], "string role")):
        with pytest.raises(InvalidRequestError, match=reason):
            bmc.generate(model, bad, max_new_tokens=2, chat=bad == [[{"role": 1, "content": "x"}]])
