#!/usr/bin/env bash
# Fetch, on the development machine, the wheels the GPU machine lacks into .whl/ (git-ignored), for
# `scripts/gpu_check.sh` to install there (it installs .whl/*.whl into /tmp/site when the folder is present).
#
#   scripts/gpu_wheels.sh        # then: run(command="OUT=$OUT scripts/gpu_check.sh STEP", carry=[".whl"])
#
# The GPU machine (KINDS.md of the device tool) has Python 3.12, torch, transformers 5.17, tokenizers,
# huggingface_hub, safetensors, opencv, psutil and pytest; it lacks the transformers version this project pins
# (requirements.txt) and num2words (SmolVLM's processor needs it for video prompts). Neither needs anything
# else there: transformers' own requirements (huggingface-hub >= 1.31, tokenizers 0.23.x, safetensors >= 0.8)
# are met by that machine's versions, and num2words imports docopt only for its command line. plotly, gradio,
# decord and kaleido stay behind: the GPU code paths import without them (tests/test_bench_gpu.py).
set -euo pipefail
cd "$(dirname "$0")/.."
transformers=$(grep -E '^transformers==' requirements.txt | cut -d' ' -f1)
num2words=$(grep -E '^num2words' requirements.txt | cut -d' ' -f1)
rm -rf .whl
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "$transformers" "$num2words"
ls -l .whl
