#!/usr/bin/env bash
# The wheels a device host lacks for bmc's server and tests (its image has torch, transformers, numpy, jinja2 and
# the like, for Python 3.12, and no network): downloaded here into .whl, which bench/device_*.sh install with
# `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`. Carry [".whl"] to the device tool.
#   bash bench/device_wheels.sh          # then e.g. run: bash bench/device_tp.sh tests, carry [".whl"]
# fastapi >= 0.165 imports opentelemetry-api and annotated-doc: without them bmc-serve exits at start there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip download -q --no-deps --only-binary :all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .whl \
  fastapi starlette uvicorn h11 anyio sniffio pydantic pydantic-core annotated-types typing-inspection \
  annotated-doc opentelemetry-api prometheus-client gguf llguidance openai httpx httpcore distro jiter \
  hypothesis sortedcontainers psutil uvloop httptools
ls .whl
