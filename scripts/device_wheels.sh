#!/usr/bin/env bash
# The py3.12 wheels a device call carries in .whl/ (the GPU machine has torch, triton,
# transformers, uvloop, httpx and anyio; scripts/gpu_check.sh installs these beside them):
#   bash scripts/device_wheels.sh [PYTHON]   # PYTHON: the pip to download with (default python3)
# Then pass carry [".whl"] to the call. Dependencies are listed, not resolved, so that
# nothing the machine already has is downloaded again.
set -euo pipefail
cd "$(dirname "$0")/.."
"${1:-python3}" -m pip download -q -d .whl --python-version 3.12 --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --no-deps \
  msgspec websockets textual rich markdown-it-py mdurl linkify-it-py uc-micro-py platformdirs \
  pygments gguf starlette uvicorn httptools pytest-asyncio pytest-timeout hypothesis \
  sortedcontainers xgrammar prometheus-client psutil tqdm h11 click annotated-types pydantic \
  pydantic-core typing-inspection ninja sentencepiece tiktoken \
  jsonschema jsonschema-specifications referencing rpds-py attrs
du -sh .whl
