#!/usr/bin/env bash
# Pre-flight for a GPU run, on the development machine (CPU): gpu_check.sh's dry run and the test suite
# under the GPU image's package versions, so that a difference in an API shows here and not in the GPU's
# 15 minutes. The versions are those KINDS.md of the device tool lists for the H200 image: Python 3.12, torch
# 2.11, torchvision 0.26, numpy 2.5.2, with the transformers this project pins (gpu_check.sh carries it there).
#
#   scripts/device_env_check.sh              # dry run without gradio/plotly/decord/kaleido (as there), then the
#                                            # suite but the browser tests, with them installed
#   scripts/device_env_check.sh tests/test_quant.py -x     # the dry run, then these pytest arguments instead
#   scripts/device_env_check.sh --which-python             # print the Python 3.12 it would use, and stop
#
# Needs PyPI and a Python 3.12 (PY312=/path/to/python3.12, else the first of python3.12 on PATH and pyenv's that
# runs as 3.12). The venv stays at $VENV (default /tmp/visualkv-device-env) for the next run. What it catches:
# e.g. SmolVLM's image processor differs below torchvision 0.27 (transformers loads its PIL backend there), so
# a built tiny model and the same model saved and reloaded would disagree (models/synthetic/smolvlm.py).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/visualkv-device-env}
if [ -z "${PY312:-}" ]; then
  # the first candidate that runs as 3.12: a pyenv shim named python3.12 is on PATH even when pyenv's selected
  # version is another one, and then it only fails (the venv step dies on it)
  for candidate in "$(command -v python3.12 || true)" /root/.pyenv/versions/3.12*/bin/python; do
    if [ -x "$candidate" ] && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      PY312=$candidate
      break
    fi
  done
fi
[ -n "${PY312:-}" ] || { echo "no Python 3.12 found: set PY312=/path/to/python3.12"; exit 2; }
if [ "${1:-}" = --which-python ]; then echo "$PY312"; exit 0; fi  # the interpreter it would use (a test asks)
transformers=$(grep -E '^transformers==' requirements.txt | cut -d' ' -f1)

if [ ! -x "$VENV/bin/python" ]; then
  "$PY312" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" torch==2.11.0 torchvision==0.26.0 numpy==2.5.2 "$transformers" opencv-python-headless psutil \
  safetensors tokenizers pillow num2words pytest accelerate
# as on the GPU machine: the GPU code paths must import without the UI packages
"$VENV/bin/python" -m pip uninstall -q -y gradio plotly kaleido decord >/dev/null 2>&1 || true

out=$(mktemp -d)
echo "== gpu_check.sh dry run (GPU_CHECK_SMALL=1), $("$VENV/bin/python" -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__)')"
GPU_CHECK_SMALL=1 PYTHON="$VENV/bin/python" OUT="$out" scripts/gpu_check.sh >"$out.log" 2>&1 \
  || { tail -n 40 "$out.log"; echo "dry run failed: $out.log"; exit 1; }
grep -E "^(pytest|bench|hour) .*exit" "$out.log"

echo "== pytest ${*:---ignore=tests/test_app_browser.py}"
"${pip[@]}" -r requirements.txt -r requirements-dev.txt  # the suite's UI tests need them; torch stays at 2.11
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "${@:---ignore=tests/test_app_browser.py}"
