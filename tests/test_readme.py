"""The README's bmc-generate examples, run as written (by bash, on the default model) so the README cannot drift
from the code: each exits 0 and prints something. Examples that name a placeholder path (path/to/...) are not
collected (at most two of them); the prompt files the others read are written first. The set-up commands are
CI's own run."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from .conftest import require_real_model

README = os.path.join(os.path.dirname(__file__), "..", "README.md")
PROMPT_FILES = {
    "prompts.txt": "The capital of France is\nOnce upon a time\n",
    "document_and_question.txt": "Paris is the capital of France. Berlin is the capital of Germany. "
                                 "Question: what is the capital of Germany? Answer:",
    "long_document.txt": "The history of the city begins long ago. " * 40 + "Summarise the history above:",
}


def readme_commands(program: str) -> list[str]:
    """Every command line of `program` in the README's bash blocks (continuation lines joined, comments cut)."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for cmd in block.replace("\\\n", " ").splitlines():
            cmd = re.sub(r"\s+#(?![^']*'\s*$).*$", "", cmd).strip()  # a trailing comment, not a '#' inside $'...'
            if cmd.startswith(program + " ") or cmd == program:
                commands.append(cmd)
    return commands


def runnable(commands: list[str]) -> list[str]:
    """The commands that name no placeholder path (path/to/...: a model or draft the reader brings)."""
    return [c for c in commands if "path/to/" not in c]


def test_the_readme_has_generate_examples():
    commands = readme_commands("bmc-generate")
    assert len(runnable(commands)) >= 8 and any("--benchmark" in c for c in runnable(commands))
    assert len(commands) - len(runnable(commands)) <= 2  # placeholders stay the exception


@pytest.mark.slow
@pytest.mark.parametrize("command", runnable(readme_commands("bmc-generate")))
def test_readme_generate_example_runs(command, tmp_path):
    require_real_model()
    for name, content in PROMPT_FILES.items():
        (tmp_path / name).write_text(content, encoding="utf-8")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    # what is under test is the command line as written; how long the completion is, is not (CI time)
    short = command if "--max-new-tokens" in command or "--benchmark" in command else command + " --max-new-tokens 24"
    short = re.sub(r"--max-new-tokens \d+", "--max-new-tokens 40", short)  # a benchmark's 3 x 8 rows: 40 still grow
    r = subprocess.run(["bash", "-c", short], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (command, r.stderr[-2000:])
    if "--benchmark" in command:  # the report goes to stderr; the strategies must agree
        assert "tokens identical across strategies: True" in r.stderr, r.stderr[-2000:]
    else:
        assert r.stdout.strip(), command
