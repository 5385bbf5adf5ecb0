#!/usr/bin/env bash
# The GPU checks, in about 10 minutes of one H100 or H200: the CUDA tests, `bench gpu` on a shape model (a 4K
# image and a generated video; every case warmed on its own input, then timed GPU_CHECK_REPEATS times), and
# `bench gpu` on an hour of video. Prints its plan (steps, estimated seconds) first.
#
#   OUT=/tmp/out scripts/gpu_check.sh [all|tests|bench|hour]
#   GPU_CHECK_SMALL=1 OUT=/tmp/out scripts/gpu_check.sh bench     # dry run anywhere (CPU too): tiny models
#
# Env: OUT (default gpu_check_out), PYTHON (default python3), GPU_CHECK_SMALL, GPU_CHECK_FAMILIES (shape names
# without "shape-", or "all"; default qwen2.5-vl-7b), GPU_CHECK_METHODS (default full,blockwise-keydiff,salicache;
# the generate rows and full always run), GPU_CHECK_REPEATS (default 3), GPU_CHECK_VIDEO_SECONDS (default 64),
# GPU_CHECK_VIDEO_KINDS (mix,moving), GPU_CHECK_DECODE (auto|eager|static|graph), GPU_CHECK_FORCED=1 (forced
# block-wise rows), GPU_CHECK_AHEAD=N (vision-ahead rows), GPU_CHECK_DECODE_ROWS=model,grouped, GPU_CHECK_KERNELS=1
# (also scripts/decode_attention.py and block_attention.py per shape), STEP_TIMEOUT and HOUR_STEP_TIMEOUT
# (seconds; default 540 each).
#
# Writes under $OUT: provenance.json (commit, dirty tree, diff hash), env.txt, pytest_cuda.log and .xml,
# bench_gpu_<model>.log, gpu_<model>.json and .md, hour/gpu_<model>.json and .md; then packs them into
# gpu_check_<step>.tgz beside summary.md. Carried `.whl/*.whl` (scripts/gpu_wheels.sh) are installed first.
# Exit status: 0 when every step passed.
set -u
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
STEPS=${1:-all}
STEP_TIMEOUT=${STEP_TIMEOUT:-540}
HOUR_STEP_TIMEOUT=${HOUR_STEP_TIMEOUT:-540}
REPEATS=${GPU_CHECK_REPEATS:-3}
METHODS=${GPU_CHECK_METHODS:-full,blockwise-keydiff,salicache}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$(dirname "$0")/.."
case "$STEPS" in all | tests | bench | hour) ;; *) echo "unknown step $STEPS (all, tests, bench, hour)"; exit 2 ;; esac
runs() { [ "$STEPS" = all ] || [ "$STEPS" = "$1" ]; }

case "${GPU_CHECK_FAMILIES:-}" in
  "") shapes="qwen2.5-vl-7b" ;;
  all) shapes="qwen2.5-vl-7b qwen3-vl-8b llava-onevision-7b internvl3.5-8b qwen2.5-vl-3b smolvlm2-2.2b" ;;
  *) shapes="$GPU_CHECK_FAMILIES" ;;
esac
if [ -n "${GPU_CHECK_SMALL:-}" ]; then
  VIDEO_SECONDS=${GPU_CHECK_VIDEO_SECONDS:-4}
else
  VIDEO_SECONDS=${GPU_CHECK_VIDEO_SECONDS:-64}
fi

# -- the plan: estimated seconds per step (H100/H200 at full scale: the tests as last measured; a bench run
# of 3 s on the 4K image and 2 s + 12 s per 512 s of video, from the H200 table; 40 s per input for transformers'
# compile of the static decode; the hour from block-wise KeyDiff's TTFT scaled to 3,600 frames)
methods_n=$(( $(echo "$METHODS" | tr ',' '\n' | grep -cv '^full$') + 3 ))  # + generate, generate-static, full
runs_per_case=$(( REPEATS + 1 ))
if [ -n "${GPU_CHECK_SMALL:-}" ]; then
  est_tests=30 est_bench=$(( methods_n * runs_per_case * 3 + 30 )) est_hour=150
else
  est_tests=240
  est_bench=$(( methods_n * runs_per_case * (3 + 2 + VIDEO_SECONDS * 12 / 512) + 80 + 15 ))
  est_hour=190
fi
n_shapes=$(echo "$shapes" | wc -w)
est_bench=$(( est_bench * n_shapes ))
total=0
echo "plan (estimated seconds):"
runs tests && { echo "  tests  $est_tests s  pytest -m cuda"; total=$(( total + est_tests )); }
runs bench && { echo "  bench  $est_bench s  bench gpu on $shapes: image + ${VIDEO_SECONDS}-s video, $methods_n cases x (1 warm-up + $REPEATS repeats)"; total=$(( total + est_bench )); }
runs hour && { echo "  hour   $est_hour s  bench gpu on an hour of video: blockwise-keydiff and composed, 1 run each"; total=$(( total + est_hour )); }
echo "  total  $total s"
[ -z "${GPU_CHECK_SMALL:-}" ] && [ "$total" -gt 600 ] && echo "  (over 10 minutes: fewer GPU_CHECK_FAMILIES, GPU_CHECK_METHODS or GPU_CHECK_REPEATS)"

if compgen -G ".whl/*.whl" >/dev/null; then
  SITE=${SITE:-/tmp/site}
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "installing .whl/*.whl into $SITE failed"; exit 1; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

"$PY" -m visualkv.bench.provenance "$OUT/provenance.json" "scripts/gpu_check.sh $STEPS" \
  || echo "provenance.json not written"
{
  date -u
  "$PY" - <<'EOF'
import importlib
for name in ("torch", "transformers", "tokenizers", "numpy", "PIL", "psutil", "cv2", "pytest", "plotly"):
    try:
        mod = importlib.import_module(name)
        print(f"{name:13s} {getattr(mod, '__version__', '?')}")
    except Exception as exc:  # noqa: BLE001
        print(f"{name:13s} MISSING ({type(exc).__name__}: {exc})")
import torch
print("cuda available:", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
EOF
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

status=0
if runs tests; then
  if [ -n "${GPU_CHECK_SMALL:-}" ]; then
    tests=(tests/test_cuda.py tests/test_device.py -k "test_fake_cuda_catches or test_sampling_is_seeded or runs_on_cuda and full")
  else
    tests=(-m cuda tests/test_cuda.py tests/test_block_attention.py tests/test_quant.py)
  fi
  echo "== pytest ${tests[*]}"
  # SIGINT at the limit: pytest stops like a Ctrl-C and still writes its summary and JUnit XML
  timeout --signal=INT --kill-after=30 "$STEP_TIMEOUT" "$PY" -m pytest -v -rs --durations=15 "${tests[@]}" \
    --junitxml="$OUT/pytest_cuda.xml" >"$OUT/pytest_cuda.log" 2>&1
  rc=$?
  tail -n 25 "$OUT/pytest_cuda.log"
  echo "pytest exit $rc"
  [ $rc -eq 0 ] || status=1
  if [ -z "${GPU_CHECK_SMALL:-}" ]; then
    # the ZeroGPU emulation forks a worker per call: a process of its own, so CUDA starts in the workers only
    # (run after CUDA tests in one process, each of its tests would rerun itself in a fresh interpreter)
    echo "== pytest tests/test_zerogpu.py (CUDA in the forked workers)"
    timeout --signal=INT --kill-after=30 "$STEP_TIMEOUT" "$PY" -m pytest -q -rs tests/test_zerogpu.py \
      >"$OUT/pytest_zerogpu.log" 2>&1
    rc=$?
    tail -n 5 "$OUT/pytest_zerogpu.log"
    [ $rc -eq 0 ] || status=1
  fi
fi

# one layer's attention timed at a shape's dimensions: scripts/<name>.py NAME ARGS..., its JSON and log under $OUT
attention_script() {
  local name=$1 rc
  shift
  timeout 120 "$PY" "scripts/$name.py" "$OUT/${name}_shape-$shape.json" --shape "shape-$shape" "$@" \
    >"$OUT/${name}_shape-$shape.log" 2>&1
  rc=$?
  cat "$OUT/${name}_shape-$shape.log"
  echo "${name//_/ } shape-$shape exit $rc"
  [ $rc -eq 0 ] || status=1
}

tiny_of() {  # the tiny alias of a shape's family
  case "$1" in
    qwen2.5-vl-*) echo tiny-qwen2.5-vl ;;
    qwen3-vl-*) echo tiny-qwen3-vl ;;
    llava-onevision-*) echo tiny-llava-onevision ;;
    internvl3.5-*) echo tiny-internvl3.5 ;;
    smolvlm2-*) echo tiny-smolvlm2 ;;
  esac
}

if runs bench; then
  for shape in $shapes; do
    if [ -n "${GPU_CHECK_SMALL:-}" ]; then
      model=$(tiny_of "$shape")
      [ -n "$model" ] || { echo "unknown shape $shape"; status=1; continue; }
      bench=(--image-size 224x224 --video-size 208x208 --new-tokens 4 --budget 48 --block-size 32)
    else
      model=shape-$shape
      bench=(--image-size 3840x2160 --video-size 640x360 --new-tokens 64 --budget 1024)
    fi
    bench=(--model "$model" --methods "$METHODS" --repeats "$REPEATS" --video-seconds "$VIDEO_SECONDS" "${bench[@]}")
    [ -n "${GPU_CHECK_VIDEO_KINDS:-}" ] && bench+=(--video-kinds "$GPU_CHECK_VIDEO_KINDS")
    [ -n "${GPU_CHECK_DECODE:-}" ] && bench+=(--decode "$GPU_CHECK_DECODE")
    [ "${GPU_CHECK_FORCED:-0}" != 0 ] && bench+=(--forced-blockwise)
    [ "${GPU_CHECK_AHEAD:-1}" != 1 ] && bench+=(--vision-ahead "$GPU_CHECK_AHEAD")
    [ -n "${GPU_CHECK_DECODE_ROWS:-}" ] && bench+=(--decode-attention-rows "$GPU_CHECK_DECODE_ROWS")
    echo "== bench gpu ${bench[*]}"
    timeout "$STEP_TIMEOUT" "$PY" -m visualkv bench gpu "${bench[@]}" --out "$OUT" >"$OUT/bench_gpu_$model.log" 2>&1
    rc=$?
    tail -n 30 "$OUT/bench_gpu_$model.log"
    echo "bench $model exit $rc"
    [ $rc -eq 0 ] || status=1
    if [ "${GPU_CHECK_KERNELS:-0}" != 0 ]; then
      if [ -n "${GPU_CHECK_SMALL:-}" ]; then
        attention_script decode_attention --entries 64,500 --repeats 2 --dtype float32
        attention_script block_attention --cases 64x500 --repeats 2 --dtype float32
      else
        attention_script decode_attention --entries 1024,10579,76574,538200
        attention_script block_attention --cases 1024x1024,1024x8192,1024x75520,16x76544,16x538200
      fi
    fi
  done
  rm -f "$OUT"/*.html  # plotly is absent on the GPU box anyway; keep $OUT to the files that come back
fi

if runs hour; then
  # past every frame cap: the generate rows and full are refused rows; the bounded methods run once each
  if [ -n "${GPU_CHECK_SMALL:-}" ]; then
    model=tiny-qwen2.5-vl
    hour=(--video-seconds 540 --video-size 208x208 --new-tokens 4 --budget 48 --block-size 32)
  else
    model=shape-qwen2.5-vl-7b
    hour=(--video-seconds 3600 --video-size 640x360 --new-tokens 64 --budget 1024)
  fi
  hour=(--model "$model" --inputs video --video-kinds mix --fps 1 --repeats 1 --no-warmup "${hour[@]}"
        --methods full,blockwise-keydiff,blockwise-keydiff+salicache)
  echo "== bench gpu ${hour[*]}"
  timeout "$HOUR_STEP_TIMEOUT" "$PY" -m visualkv bench gpu "${hour[@]}" --out "$OUT/hour" \
    >"$OUT/bench_gpu_hour_$model.log" 2>&1
  rc=$?
  tail -n 30 "$OUT/bench_gpu_hour_$model.log"
  echo "hour $model exit $rc"
  [ $rc -eq 0 ] || status=1
  rm -f "$OUT"/hour/*.html
fi

# Pack: summary.md (what a reader needs at a glance) beside one archive of everything.
pack=$(mktemp -d)
{
  echo "# gpu_check.sh $STEPS ($(date -u +%FT%TZ)), exit status $status"
  echo; echo '```'; cat "$OUT/env.txt"; [ -f "$OUT/provenance.json" ] && cat "$OUT/provenance.json"; echo; echo '```'
  if [ -f "$OUT/pytest_cuda.log" ]; then
    echo; echo "## pytest"; echo; echo '```'; tail -n 40 "$OUT/pytest_cuda.log"; echo '```'
  fi
  for table in "$OUT"/*.md "$OUT"/hour/*.md; do
    [ -f "$table" ] || continue
    echo; echo "## ${table#"$OUT"/}"; echo; cat "$table"
  done
} >"$pack/summary.md"
archive="gpu_check_$STEPS.tgz"
if tar czf "$pack/$archive" -C "$OUT" . && find "$OUT" -mindepth 1 -delete; then
  mv "$pack/$archive" "$pack/summary.md" "$OUT/"
else
  echo "packing $OUT failed: its files are left loose"
fi
rm -rf "$pack"
ls -l "$OUT"
exit $status
