"""--chat-template: built-in templates (chatml, llama3, gemma) or a file, on a model that ships none; without one,
chat fails at start-up naming the flag."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

import bmc
from bmc.chat_templates import chat_template
from bmc.errors import BmcError, InvalidRequestError

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]


def render(name: str) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment().from_string(chat_template(name)).render(
        messages=MESSAGES, add_generation_prompt=True, bos_token="<bos>")


def test_the_built_in_templates_render_their_formats():
    assert render("chatml") == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
                                "<|im_start|>assistant\n")
    assert render("llama3") == ("<bos><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                                "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                                "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
                                "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
                                "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert render("gemma") == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
                               "Hello!<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(InvalidRequestError, match="neither a file nor a built-in.*chatml, llama3, gemma"):
        chat_template("no-such-template")


@pytest.fixture
def bare_dir(gqa_dir, tmp_path):
    """The tiny model without a chat template."""
    d = tmp_path / "bare"
    shutil.copytree(gqa_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_a_model_without_a_template_runs_chat_with_the_flag(bare_dir, tmp_path):
    from bmc.chat import ChatSession

    model = bmc.load(str(bare_dir))
    with pytest.raises(BmcError, match="--chat-template"):
        ChatSession(model, max_new_tokens=4)
    with pytest.raises(BmcError, match="--chat-template"):
        bmc.generate(model, ["hi"], chat=True, max_new_tokens=4)
    template = tmp_path / "t.jinja"
    template.write_text(chat_template("chatml"))
    r = subprocess.run([sys.executable, "-m", "bmc.cli.generate", "-m", str(bare_dir), "--chat", "--json", "-n", "4",
                        "--ignore-eos", "--chat-template", str(template), "hi"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    model.tokenizer.chat_template = chat_template("chatml")
    want = bmc.generate(model, ["hi"], chat=True, max_new_tokens=4, ignore_eos=True)[0].token_ids
    assert json.loads(r.stdout)["token_ids"] == want
    r = subprocess.run([sys.executable, "-m", "bmc.cli.chat", "-m", str(bare_dir)], input="hi\n", capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "--chat-template" in r.stderr
    r = subprocess.run([sys.executable, "-m", "bmc.cli.chat", "--chat-template", "nope"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "neither a file nor a built-in" in r.stderr
