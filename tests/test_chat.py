"""bmc-chat and ChatSession: each reply equals generate() on the whole rendered conversation while the KV of
earlier turns is reused (only the new message is prefilled); /reset, a full context, an interrupted reply; the
CLI driven through a pseudo-terminal."""
from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time

import pytest

import bmc
from bmc.chat import ChatSession, ContextFullError
from bmc.errors import InvalidRequestError

from .conftest import make_llama


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """The tiny GQA Llama with a long context and SmolLM2's kind of template (ChatML: the assistant's header in
    the generation prompt is the one the history renders)."""
    path = make_llama(tmp_path_factory.mktemp("llama-chat"), "gqa", max_pos=1024)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=CHATML)))
    return path


@pytest.fixture(scope="module")
def model(chat_dir):
    return bmc.load(str(chat_dir))


def assert_conversation_kept(chat: ChatSession, one_node: bool = True) -> None:
    """Between turns the conversation's KV is in the prefix cache only (the batch is empty), holding every token
    whose KV was computed: the prompt and the reply but its last token; as one node (one segment to read) where the
    template renders the history as it was said."""
    engine = chat.engine
    engine.cache.check_integrity()
    engine.prefix_cache.check_integrity()
    assert engine.cache.batch_size == 0 and not engine.has_work()
    said = chat.prompt_ids + chat._reply_ids
    kept = chat.context_used - 1 if chat.last.finish_reason == "length" else chat.context_used
    pc = engine.prefix_cache
    assert max(pc.peek(said + [0], salt) for salt in pc.roots) == kept  # longrope: under its long rotation's key
    if one_node:
        assert len(pc.nodes()) == 1


def reference(model, messages, max_new_tokens: int) -> str:
    """generate() on a conversation rendered and tokenized whole (a first turn: the same tokens as the session's)."""
    tok = model.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    return bmc.generate(model, [ids], max_new_tokens=max_new_tokens)[0].text


@pytest.mark.parametrize("kv", ["bmc", "upfront"])
def test_each_reply_equals_generate_on_the_whole_conversation(model, kv):
    chat = ChatSession(model, max_new_tokens=12, system="be brief", kv=kv)
    for i, user in enumerate(["hello there", "the quick brown fox", "and the lazy dog?", "again"]):
        before = (list(chat.prompt_ids), list(chat._reply_ids), chat._anchor)
        reply = "".join(chat.turn(user))
        assert chat.messages[-1] == {"role": "assistant", "content": reply}
        tok = model.tokenizer
        rendered = tok.apply_chat_template(chat.messages[:-1], add_generation_prompt=True)
        if i == 0:
            assert chat.prompt_ids == tok.encode(rendered)
        else:  # the history exactly as it was generated, then the template's new part
            prompt, said, anchor = before
            assert rendered.startswith(anchor)
            assert chat.prompt_ids == prompt + said + tok.encode(rendered[len(anchor):], add_special_tokens=False)
        assert reply == bmc.generate(model, [chat.prompt_ids], max_new_tokens=12)[0].text, i
        st = chat.last
        assert st.generated_tokens >= 1 and st.finish_reason in ("stop", "length")
        if i:  # the earlier turns' KV was reused: only the new message (and the reply's end) was prefilled
            assert st.prefilled_tokens < st.prompt_tokens // 2, st
        assert_conversation_kept(chat)


def test_a_template_that_renders_history_differently_is_tokenized_again(tmp_path):
    """The tiny default template writes the generation header as 'assistant:' but history as '<s>assistant: ...':
    the conversation is tokenized whole, the cache cut back to the common prefix, and replies stay exact."""
    model = bmc.load(str(make_llama(tmp_path, "gqa", max_pos=1024)))
    chat = ChatSession(model, max_new_tokens=8)
    for user in ["hello there", "the quick brown fox"]:
        reply = "".join(chat.turn(user))
        tok = model.tokenizer
        assert chat.prompt_ids == tok.encode(tok.apply_chat_template(chat.messages[:-1], add_generation_prompt=True))
        assert reply == bmc.generate(model, [chat.prompt_ids], max_new_tokens=8)[0].text
        chat.engine.prefix_cache.check_integrity()
    assert chat.last.prefilled_tokens < chat.last.prompt_tokens  # the common prefix was still reused


def test_reset_and_a_full_context(model):
    chat = ChatSession(model, max_new_tokens=4)
    "".join(chat.turn("hello"))
    assert chat.context_used > 0
    chat.reset()
    assert chat.messages == [] and chat.context_used == 0 and chat.engine.prefix_cache.nbytes == 0
    with pytest.raises(ContextFullError, match="/reset"):
        "".join(chat.turn("word " * 2000))
    assert chat.messages == []  # the refused message did not join the conversation
    assert "".join(chat.turn("hello")) == reference(model, [{"role": "user", "content": "hello"}], 4)
    with pytest.raises(InvalidRequestError, match="empty"):
        "".join(chat.turn("   "))


def test_ctx_size_bounds_the_conversation_and_its_cache(model):
    """ctx_size (bmc-chat -c): replies stop at it, a turn beyond it is refused naming the flag, the engine's cache
    is bounded by it; out of range it is refused."""
    chat = ChatSession(model, max_new_tokens=200, ctx_size=96)
    assert chat.engine.max_length == 96
    reply = "".join(chat.turn("hello"))
    assert chat.context_used <= 96 and reply == reference(model, [{"role": "user", "content": "hello"}],
                                                          96 - len(chat.prompt_ids))
    with pytest.raises(ContextFullError, match="--ctx-size is 96"):
        "".join(chat.turn("word " * 60))
    for bad in (1, model.max_context + 1):
        with pytest.raises(InvalidRequestError, match="--ctx-size"):
            ChatSession(model, ctx_size=bad)


def test_a_reply_stopped_early_is_kept_and_the_next_turn_is_exact(model):
    chat = ChatSession(model, max_new_tokens=20)
    stream = chat.turn("tell me a story")
    next(stream)
    stream.close()  # the reader stopped it (Ctrl-C): what came so far is the reply
    assert chat.messages[-1]["role"] == "assistant" and chat.last.generated_tokens >= 1
    reply = "".join(chat.turn("go on"))
    assert reply == bmc.generate(model, [chat.prompt_ids], max_new_tokens=20)[0].text


def read_until(fd: int, marker: bytes, buf: bytearray, timeout: float = 60.0) -> bytes:
    """Read the pseudo-terminal until `marker` appears after what was consumed; return the text before it."""
    deadline = time.monotonic() + timeout
    while marker not in buf:
        left = deadline - time.monotonic()
        assert left > 0, f"no {marker!r} in {bytes(buf)!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            buf.extend(chunk)
    i = buf.index(marker)
    out = bytes(buf[:i])
    del buf[: i + len(marker)]
    return out


def prefilled_of(output: str) -> tuple[int, int]:
    """(prefilled, prompt tokens) from --verbose's line after a reply."""
    a, b = output.split("[prefilled ")[1].split(" tokens")[0].split(" of ")
    return int(a), int(b)


def test_the_cli_in_a_terminal(chat_dir, model):
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "bmc.cli.chat", "--model", str(chat_dir), "--max-new-tokens", "8",
                             "--verbose", "--no-weights-cache"], stdin=slave, stdout=slave, stderr=slave,
                            env=dict(os.environ, TERM="dumb"), close_fds=True)
    os.close(slave)
    buf = bytearray()
    try:
        banner = read_until(master, b"> ", buf)
        assert b"/reset" in banner and b"/exit" in banner
        first_message = "the quick brown fox jumps over the lazy dog " * 6
        os.write(master, first_message.encode() + b"\n")
        first = read_until(master, b"> ", buf).decode().replace("\r\n", "\n")
        want = reference(model, [{"role": "user", "content": first_message}], 8)
        assert want in first and prefilled_of(first)[0] == prefilled_of(first)[1]
        os.write(master, b"and more\n")
        prefilled, total = prefilled_of(read_until(master, b"> ", buf).decode())
        assert prefilled < total // 2  # the first turn's KV was kept
        os.write(master, b"/nonsense\n")
        assert "unknown command" in read_until(master, b"> ", buf).decode()
        os.write(master, b"/reset\n")
        assert "conversation cleared" in read_until(master, b"> ", buf).decode()
        os.write(master, first_message.encode() + b"\n")
        again = read_until(master, b"> ", buf).decode().replace("\r\n", "\n")
        assert want in again and prefilled_of(again) == prefilled_of(first)  # all of it again, the same reply
        os.write(master, b"/exit\n")
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(master)


def test_the_cli_refuses_bad_flags_in_one_line():
    from .conftest import run_side_by_side

    cases = ((["--threads", "0"], "--threads"), (["--temperature", "nan"], "finite"), (["--kv", "nope"], "unknown --kv"),
             (["--model", "/nonexistent/x.gguf"], ""), (["-c", "1"], "--ctx-size"))
    procs = run_side_by_side([[sys.executable, "-m", "bmc.cli.chat", *flags] for flags, _ in cases])
    for (flags, message), proc in zip(cases, procs):
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_longrope_conversation_switches_as_generate(tmp_path):
    """Phi-3 longrope with a pretraining context of 24: the first prompt (20 tokens) is inside it and its reply
    passes it while decoding (the session computes the conversation again with the long factors, as generate()
    recomputes the row), later turns start past it; every reply's tokens equal generate()'s on the whole
    conversation."""
    from .test_phi3 import LONGROPE, make_phi3

    model = bmc.load(str(make_phi3(tmp_path / "long", rope_scaling=dict(LONGROPE, original_max_position_embeddings=24),
                                   original_max_position_embeddings=24)))
    chat = ChatSession(model, max_new_tokens=10)
    for user in ["hi", "the quick brown fox", "ok"]:
        "".join(chat.turn(user))
        assert chat._reply_ids == bmc.generate(model, [chat.prompt_ids], max_new_tokens=10)[0].token_ids
        assert_conversation_kept(chat, one_node=False)  # the tiny template rewrites history; two rotations
        assert len(chat.prompt_ids) > 24 or len(chat.prompt_ids) + chat.last.generated_tokens > 24
    assert chat.engine.counters.relongs == 1  # the first reply passed the switch
    assert chat.last.prefilled_tokens < chat.last.prompt_tokens  # later turns read the long-rotated history


def test_ctrl_c_inside_a_step_stops_the_reply_and_keeps_the_conversation(model):
    """Ctrl-C (SIGINT) arriving while the engine steps waits for the step's end: the reply stops there, the
    conversation's KV stays (the next turn prefills only its new part) and the next reply is exact."""
    import signal

    chat = ChatSession(model, max_new_tokens=20)
    "".join(chat.turn("hello"))
    engine = chat.engine
    real_step, calls = engine.step, []

    def interrupted_step() -> None:
        calls.append(1)
        if len(calls) == 3:  # inside a decode step of the second turn
            signal.raise_signal(signal.SIGINT)
        real_step()

    engine.step = interrupted_step
    # Python's own Ctrl-C handler, as at a terminal: a test run started in the background inherits SIGINT ignored,
    # and then neither bmc nor Python takes the signal (this test failed so once)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in chat.turn("tell me a story"):
                pass
    finally:
        signal.signal(signal.SIGINT, previous)
    assert chat.engine is engine, "the conversation's KV was kept"
    assert len(calls) >= 3 and chat.messages[-1]["role"] == "assistant"
    engine.step = real_step
    reply = "".join(chat.turn("go on"))
    assert chat.last.prefilled_tokens < chat.last.prompt_tokens // 2, "only the new part prefilled"
    assert reply == bmc.generate(model, [chat.prompt_ids], max_new_tokens=20)[0].text


def test_save_load_and_a_message_of_several_lines(chat_dir, tmp_path, model):
    """/save writes the conversation as JSON, /load continues it (the next reply is generate() on the conversation
    as the template renders it), and a message between two triple-quote marks keeps its lines."""
    import json
    import subprocess
    import sys

    saved, again = tmp_path / "c.json", tmp_path / "d.json"
    script = f'hi\n/save {saved}\n/reset\n/load {saved}\n"""\nline one\nline two\n"""\n/save {again}\n/exit\n'
    r = subprocess.run([sys.executable, "-m", "bmc.cli.chat", "-m", str(chat_dir), "-n", "6"], input=script,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    first = json.loads(saved.read_text())
    assert [m["role"] for m in first] == ["user", "assistant"] and first[0]["content"] == "hi"
    second = json.loads(again.read_text())
    assert second[:2] == first and second[2] == {"role": "user", "content": "line one\nline two"}
    session = ChatSession(model, max_new_tokens=6)
    session.load_messages(first)
    reply = "".join(session.turn("line one\nline two"))
    assert reply == second[3]["content"]
    with pytest.raises(bmc.InvalidRequestError, match="JSON list"):
        session.load_messages([{"role": "wizard", "content": "x"}])
