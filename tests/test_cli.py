"""bmc-generate as a user runs it: output formats, prompt sources, and exit code 2 with one line on bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import bmc


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "bmc.cli.generate", *args], input=stdin, capture_output=True,
                          text=True, timeout=300, env=env)


def test_json_lines_match_the_api(gqa_dir):
    r = run_cli("--model", str(gqa_dir), "--max-new-tokens", "5", "--ignore-eos", "--json", "--num-samples", "2",
                "the quick brown fox", "hello world")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["prompt_index"], x["sample_index"]) for x in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    api = bmc.generate(bmc.load(str(gqa_dir)), ["the quick brown fox", "hello world"], max_new_tokens=5,
                       ignore_eos=True, num_samples=2)
    assert [x["token_ids"] for x in rows] == [c.token_ids for c in api]
    assert [x["text"] for x in rows] == [c.text for c in api]
    assert {x["finish_reason"] for x in rows} == {"length"}


def test_prompt_file_stdin_and_stream(gqa_dir, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("the quick brown fox\n\nhello world\n")
    a = run_cli("--model", str(gqa_dir), "--max-new-tokens", "4", "--ignore-eos", "--json", "--prompt-file", str(f))
    b = run_cli("--model", str(gqa_dir), "--max-new-tokens", "4", "--ignore-eos", "--json", "--prompt-file", "-",
                stdin=f.read_text())
    assert a.returncode == b.returncode == 0 and len(a.stdout.splitlines()) == 2 and a.stdout == b.stdout
    s = run_cli("--model", str(gqa_dir), "--max-new-tokens", "4", "--ignore-eos", "--stream", "hello world")
    first = json.loads(a.stdout.splitlines()[1])
    assert s.returncode == 0 and s.stdout.strip() == first["text"].strip()


def test_benchmark_compares_strategies_in_one_run(gqa_dir):
    r = run_cli("--model", str(gqa_dir), "--benchmark", "--kv", "all", "--batch-size", "2", "--prompt-len", "8",
                "--max-new-tokens", "6", "--ignore-eos", "--T", "2", "--repeats", "2")
    assert r.returncode == 0, r.stderr
    for kv in ("bmc", "iterative", "upfront"):
        assert kv in r.stderr
    assert r.stderr.count("(median of 2, decode ") == 3, r.stderr  # every strategy twice, interleaved
    assert "decode=" in r.stderr and "GB/s" in r.stderr
    assert "tokens identical across strategies: True" in r.stderr


@pytest.mark.parametrize("args,match", [
    (["--model", "/no/such/model", "hi"], "does not exist"),
    (["--kv", "paged", "hi"], "unknown --kv"),
    (["--max-new-tokens", "0", "hi"], "max_new_tokens"),
    (["--temperature", "-1", "hi"], "temperature"),
    (["--top-p", "2", "--temperature", "1", "hi"], "top_p"),
    (["--top-k", "0", "--temperature", "1", "hi"], "top_k"),
    (["--r", "0", "hi"], "r must"),
    (["--benchmark", "--repeats", "0"], "--repeats must be"),
    (["--T", "0", "hi"], "T must"),
    ([""], "empty"),
    ([], "no prompt"),
    (["--max-new-tokens", "100000", "hi"], "context"),
    (["--prompt-file", "/no/such/file"], "prompt-file"),
    (["--speculative", "layers:x", "hi"], "N must be"),
    (["--speculative", "int8-self", "--tree", "static:0", "hi"], "SIZE"),
])
def test_bad_input_exits_2_with_one_line(gqa_dir, args, match, capsys):
    from bmc.cli.generate import main

    model = [] if "--model" in args else ["--model", str(gqa_dir)]
    with pytest.raises(SystemExit) as exit_info:  # main() catches bmc's errors: any other exception fails here
        main([*model, *args, "--threads", "2"])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2
    assert match in err and len(err.strip().splitlines()) == 1 and out == ""


def test_bad_input_from_a_real_process_has_no_traceback(gqa_dir):
    r = run_cli("--model", str(gqa_dir), "--temperature", "-1", "hi")
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.startswith("error: temperature")


def test_speculative_sampling_from_the_command_line(gqa_dir, capsys):
    """Seeded sampling with a draft model from the command line (in this process: the CLI's own main)."""
    import torch

    from bmc.cli.generate import main

    args = ["--model", str(gqa_dir), "--max-new-tokens", "6", "--ignore-eos", "--json", "--temperature", "0.8",
            "--seed", "4", "--no-weights-cache", "-t", str(torch.get_num_threads()), "the quick brown fox"]
    outs = []
    for extra in ([], ["--speculative", "layers:1", "--tree", "static:6"], ["--speculative", "layers:1", "--tree",
                                                                           "static:6"]):
        main([*args, *extra])
        outs.append(capsys.readouterr().out)
    plain, spec, again = (json.loads(o) for o in outs)
    assert spec == again  # seeded: reproducible
    assert len(spec["token_ids"]) == len(plain["token_ids"]) == 6


def test_bad_files_and_ranges_exit_2_before_loading(tmp_path, capsys):
    """Files that are not UTF-8 text, directories, absurd thread counts, NaN sampling values: one line, exit 2."""
    from bmc.cli.generate import main

    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00 not text")
    cases = [(["--prompt-file", str(binary)], "not UTF-8"), (["--prompt-file", str(tmp_path)], "directory"),
             (["--threads", "0", "hi"], "--threads"), (["--threads", "100000", "hi"], "--threads"),
             (["--temperature", "nan", "hi"], "finite"), (["--benchmark", "--batch-size", "0"], "--batch-size")]
    for args, match in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(["--model", "/no/such/model/needed", *args])
        out, err = capsys.readouterr()
        assert exit_info.value.code == 2, args
        assert match in err and len(err.strip().splitlines()) == 1 and out == "", (args, err)


def test_help_and_bad_arguments_answer_before_torch_loads():
    """Every tool parses and checks its arguments before importing torch (seconds on a small machine): --help and a
    bad range exit at once, and `import bmc` alone loads nothing heavy."""
    code = """
import sys
import bmc
from bmc.cli import calibrate, chat, generate, perplexity, serve
for tool, argv, want in [(generate, ['--help'], 0), (chat, ['--help'], 0), (serve, ['--help'], 0),
                         (perplexity, ['--help'], 0), (calibrate, ['--help'], 0),
                         (generate, ['--threads', '0', 'hi'], 2), (chat, ['--threads', '0'], 2),
                         (serve, ['--port', '99999'], 2), (generate, ['--kv', 'nope', 'hi'], 2)]:
    try:
        tool.main(argv)
        raise AssertionError(f'{tool.__name__} {argv} did not exit')
    except SystemExit as e:
        assert e.code == want, (tool.__name__, argv, e.code)
assert 'torch' not in sys.modules, 'torch was imported'
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_offered_choices_are_the_implemented_ones():
    from bmc.choices import KV_DTYPE_NAMES, KV_STRATEGY_NAMES, QUANT_MODES
    from bmc.kv import KV_DTYPES, KV_STRATEGIES
    from bmc.models import quant

    assert set(KV_STRATEGY_NAMES) == set(KV_STRATEGIES) and set(KV_DTYPE_NAMES) == set(KV_DTYPES)
    assert QUANT_MODES is quant.QUANT_MODES


def test_short_flags_are_the_long_ones(gqa_dir, capsys):
    """llama.cpp's short flags: -m model, -p prompt, -n tokens, -t threads (and -f prompt file); -p prompts come
    before the positional ones."""
    import torch

    from bmc.cli.generate import main
    from bmc.cli.serve import router_argv

    main(["-m", str(gqa_dir), "-n", "5", "--ignore-eos", "--json", "-t", str(torch.get_num_threads()),
          "-p", "the quick brown fox", "hello world"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    api = bmc.generate(bmc.load(str(gqa_dir)), ["the quick brown fox", "hello world"], max_new_tokens=5,
                       ignore_eos=True)
    assert [x["token_ids"] for x in rows] == [c.token_ids for c in api]
    assert router_argv(["-m", "x", "-t", "4", "--port", "1", "--kv", "bmc"]) == ["-m", "x", "--kv", "bmc"]


def test_ctx_size_bounds_prompt_and_generation(gqa_dir, capsys):
    """bmc-generate -c N: the longest prompt and its generated tokens fill at most N positions (generation stops
    there, as llama.cpp's does when its context is full; the others stop with it), and so the KV cache; a prompt
    that fills N, an N past the model's context, below 2 or with --tp is refused in one line (exit 2)."""
    import torch

    from bmc.cli.generate import main

    model = bmc.load(str(gqa_dir))
    prompts = ["the quick brown fox jumps", "hello"]
    longest = max(len(model.tokenizer.encode(p)) for p in prompts)
    main(["-m", str(gqa_dir), "-n", "50", "-c", str(longest + 7), "--ignore-eos", "--json", "--no-weights-cache",
          "-t", str(torch.get_num_threads()), *prompts])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [len(x["token_ids"]) for x in rows] == [7, 7]
    api = bmc.generate(model, prompts, max_new_tokens=7, ignore_eos=True)
    assert [x["token_ids"] for x in rows] == [c.token_ids for c in api]
    for flags, message in ((["-c", str(longest)], f"a prompt has {longest} tokens, --ctx-size is {longest}"),
                           (["-c", "1"], "--ctx-size must be >= 2"),
                           (["-c", str(model.max_context + 1)], f"--ctx-size must be in [2, {model.max_context}]"),
                           (["-c", "64", "--tp", "2"], "--ctx-size is not supported with --tp")):
        with pytest.raises(SystemExit) as e:
            main(["-m", str(gqa_dir), "--no-weights-cache", *flags, *prompts])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and message in err and len(err.splitlines()) == 1, err
