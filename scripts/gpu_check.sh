#!/usr/bin/env bash
# The GPU checks, for a machine that has a GPU: the CUDA tests, `bench gpu` on the shapes, and `bench gpu` on
# an hour of video.
#
#   OUT=/tmp/out scripts/gpu_check.sh tests      # only `pytest -m cuda`
#   OUT=/tmp/out scripts/gpu_check.sh bench      # only `bench gpu` (shapes, 4K image + 512-s mix video)
#   OUT=/tmp/out scripts/gpu_check.sh hour       # only `bench gpu` on shape-qwen2.5-vl-7b, one hour of video
#   OUT=/tmp/out scripts/gpu_check.sh            # all three, one after the other (does not fit one call: below)
#   GPU_CHECK_SMALL=1 OUT=/tmp/out scripts/gpu_check.sh [step]   # dry run anywhere (CPU too): tiny models, small inputs
#
# Time on one H200 (a fresh machine's start and the transfers take about 30 s per call; pip installing the
# wheels a few seconds):
#   tests  about 2 min for 92 of tests/test_cuda.py's tests (the slowest 10 s); the whole file perhaps 3-4 min, plus
#          a few seconds for tests/test_block_attention.py's and tests/test_quant.py's CUDA tests.
#   bench  191 s for shape-qwen2.5-vl-7b without the warm-up and the forced rows (GPU_CHECK_FORCED=0: 4K image and
#          the 512-s mix video x transformers generate, 6 methods and the 2 vision-ahead rows); with the warm-up
#          (every case once on a small image and an 8-frame video: 16 s) about 215 s. The forced rows add 4 cases,
#          ~25 s by the rows' TTFT. The 7B shape builds in 1.2 s and the 512-s video is written in 0.8 s.
#   hour   estimated 3-5 min (not measured): an hour at 1 fps is 3,600 frames, ~540k visual tokens (538,200 on
#          Qwen2.5-VL at 640x360), 7x the 512-s video's 76,544, on which block-wise KeyDiff took 14.6 s TTFT
#          (H200, warmed up), so ~105 s for block-wise KeyDiff (linear: its cache is bounded) and at most as much
#          for blockwise-keydiff+salicache on the mix video (Sali-Cache alone took 0.63x block-wise's TTFT on the
#          512-s video), plus the start, the warm-up and writing the hour-long video (3.6 s on a 2-core CPU).
#          The reference (transformers generate) and `full` are refused rows past 512 frames (no time).
# 15 minutes of GPU time (the machine's start included) fit the three steps for one shape, each its own call or
# two in one (one call may run 10 min at most): e.g. call 1 `tests` then `bench` with
# GPU_CHECK_FAMILIES=qwen2.5-vl-7b (each into its own $OUT/<step>, ~8 min with the decode-attention rows), call 2 at
# once (the machine stays warm 30 s after a call) `hour` with HOUR_STEP_TIMEOUT set to what `status` says is left,
# less a minute. Order: `tests`, `bench` on the 7B shape (its decode tok/s and decode_attention_<shape>.json decide
# GROUPED_MIN_ENTRIES; block_attention_<shape>.json times the lower-right flash attention of every block after the
# cache against transformers' masked path), `hour`, then the other shapes. `bench gpu` rewrites its JSON after
# every case, so a step stopped by its timeout keeps the cases it finished; the tests step stopped by its timeout
# still ends with pytest's summary and JUnit XML of the tests that ran (SIGINT, as a Ctrl-C).
#
# `bench gpu` runs once per shape model (each its own process: one model in GPU memory at a time). Which:
#   GPU_CHECK_FAMILIES unset      shape-qwen2.5-vl-7b and shape-qwen3-vl-8b (the default)
#   GPU_CHECK_FAMILIES=all        also shape-llava-onevision-7b and shape-internvl3.5-8b (and the 3B / SmolVLM2
#                                 shapes); about twice the time: mind 15 minutes of GPU time
#   GPU_CHECK_FAMILIES="qwen3-vl-8b internvl3.5-8b"   any list of shape names without the "shape-" prefix
#   GPU_CHECK_VIDEO_KINDS=mix,moving   the bench's video inputs (default mix; moving: nothing can be skipped)
#   GPU_CHECK_DECODE=eager        how the methods decode (default auto: one CUDA graph per answer)
#   GPU_CHECK_FORCED=0            without the forced block-wise rows (default: each block-wise method also runs
#                                 with every block of b tokens, ~25 s more per shape on the H200's 7B shape)
#   GPU_CHECK_AHEAD=1             without the vision-ahead rows (default 4: each block-wise method also runs with
#                                 4 blocks' media per vision-tower call, `--vision-ahead 4`; ~30 s more on the 7B shape)
#   GPU_CHECK_DECODE_ROWS=        without the decode-attention rows (default model: each method also decodes with the
#                                 model's own masked SDPA beside auto's choice, `--decode-attention-rows model`; an
#                                 estimated ~85 s more on the 7B shape by the rows' TTFT and decode times, not measured)
# Each method row of the bench JSON also holds the memory guard's estimate (`guard_estimate_bytes`) beside its
# CUDA peak (`peak_over_weights_bytes`): the guard checked at real scale.
# Each bench table is followed by the GPU targets judged on its rows (visualkv/bench/gpu_targets.py:
# met / not met / not measured), in the .md, the JSON (`targets`) and summary.md.
# With GPU_CHECK_SMALL each shape is replaced by the tiny alias of its family. The `hour` step always runs
# shape-qwen2.5-vl-7b (tiny-qwen2.5-vl with GPU_CHECK_SMALL: 540 s of 384x216 video, past the 512-frame cap).
#
# Writes under $OUT: env.txt (versions, GPU), pytest_cuda.log (+ junit XML), bench_gpu_<model>.log,
# gpu_<model>.json and .md (the README table) per model, decode_attention_<shape>.json and .log per shape
# (scripts/decode_attention.py: one decode step's attention three ways over 1k to 538k entries),
# block_attention_<shape>.json and .log per shape (scripts/block_attention.py: a block after cached entries, two
# ways); the hour step
# writes bench_gpu_hour_<model>.log and hour/gpu_<model>.json and .md. At the end they are packed into
# $OUT/gpu_check_<step>.tgz beside $OUT/summary.md (versions, the test summary, every table): the device tool brings back at most 8 files, and
# two shapes' logs, JSON and tables alone are more (a step cut short by the call's own limit leaves them loose).
# Unpack with `tar xzf gpu_check_<step>.tgz`; the JSON files go to docs/results/gpu/ (`bench report` renders them).
#
# Wheels: `scripts/gpu_wheels.sh` (on the development machine) fetches into .whl/ the transformers version this
# project pins and num2words; carry .whl and this script installs them into /tmp/site and puts it first on
# PYTHONPATH (the GPU machine's own transformers is older). Each step has its own time limit (STEP_TIMEOUT,
# seconds; the hour step HOUR_STEP_TIMEOUT), so one slow step cannot eat the other's log (in the bench step each
# shape has its own STEP_TIMEOUT). Exit status: 0 when every step passed.
set -u
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
STEPS=${1:-all}
STEP_TIMEOUT=${STEP_TIMEOUT:-540}
HOUR_STEP_TIMEOUT=${HOUR_STEP_TIMEOUT:-540}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$(dirname "$0")/.."

if compgen -G ".whl/*.whl" >/dev/null; then
  SITE=${SITE:-/tmp/site}
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "installing .whl/*.whl into $SITE failed"; exit 1; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

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
if [ "$STEPS" = all ] || [ "$STEPS" = tests ]; then
  if [ -n "${GPU_CHECK_SMALL:-}" ]; then
    tests=(tests/test_cuda.py tests/test_device.py -k "test_fake_cuda_catches or test_sampling_is_seeded or runs_on_cuda and full")
  else
    # every test marked cuda, in the modules that import without gradio / plotly (absent there)
    tests=(-m cuda tests/test_cuda.py tests/test_block_attention.py tests/test_quant.py)
  fi
  echo "== pytest ${tests[*]}"
  # SIGINT at the limit, not SIGTERM: pytest then stops like a Ctrl-C and still prints its summary and writes
  # the JUnit XML of the tests that ran (SIGKILL 30 s later if a kernel holds it); -v names each test's outcome
  # in the log as it ends, so a step cut short still says which passed.
  timeout --signal=INT --kill-after=30 "$STEP_TIMEOUT" "$PY" -m pytest -v -rs --durations=15 "${tests[@]}" \
    --junitxml="$OUT/pytest_cuda.xml" >"$OUT/pytest_cuda.log" 2>&1
  rc=$?
  tail -n 25 "$OUT/pytest_cuda.log"
  echo "pytest exit $rc"
  [ $rc -eq 0 ] || status=1
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

if [ "$STEPS" = all ] || [ "$STEPS" = bench ]; then
  case "${GPU_CHECK_FAMILIES:-}" in
    "") shapes="qwen2.5-vl-7b qwen3-vl-8b" ;;
    all) shapes="qwen2.5-vl-7b qwen3-vl-8b llava-onevision-7b internvl3.5-8b qwen2.5-vl-3b smolvlm2-2.2b" ;;
    *) shapes="$GPU_CHECK_FAMILIES" ;;
  esac
  for shape in $shapes; do
    if [ -n "${GPU_CHECK_SMALL:-}" ]; then
      case "$shape" in  # the tiny alias of the shape's family
        qwen2.5-vl-*) model=tiny-qwen2.5-vl ;;
        qwen3-vl-*) model=tiny-qwen3-vl ;;
        llava-onevision-*) model=tiny-llava-onevision ;;
        internvl3.5-*) model=tiny-internvl3.5 ;;
        smolvlm2-*) model=tiny-smolvlm2 ;;
        *) echo "unknown shape $shape"; status=1; continue ;;
      esac
      bench=(--model "$model" --image-size 448x252 --video-seconds 6 --video-size 320x240 --new-tokens 4
             --budget 64 --methods full,blockwise-keydiff)
    else
      model=shape-$shape
      bench=(--model "$model" --image-size 3840x2160 --video-seconds 512 --video-size 640x360
             --new-tokens 64 --budget 1024)
    fi
    # GPU_CHECK_VIDEO_KINDS=mix,moving adds a video where every frame moves (the Sali-Cache target with
    # nothing to skip; about 2 more minutes per shape); GPU_CHECK_DECODE=eager runs the methods without CUDA graphs
    [ -n "${GPU_CHECK_VIDEO_KINDS:-}" ] && bench+=(--video-kinds "$GPU_CHECK_VIDEO_KINDS")
    [ -n "${GPU_CHECK_DECODE:-}" ] && bench+=(--decode "$GPU_CHECK_DECODE")
    # the block-wise TTFT target holds for the hybrid plan and for forced block-wise: both are rows
    [ "${GPU_CHECK_FORCED:-1}" != 0 ] && bench+=(--forced-blockwise)
    # the tower-launch lever beside each block-wise default: N blocks' media per vision-tower call (same embeddings)
    [ "${GPU_CHECK_AHEAD:-4}" != 1 ] && bench+=(--vision-ahead "${GPU_CHECK_AHEAD:-4}")
    # the decode step's attention: each method also with the model's own masked SDPA, beside auto (grouped over
    # long windows): the decode tok/s of the two side by side
    [ -n "${GPU_CHECK_DECODE_ROWS-model}" ] && bench+=(--decode-attention-rows "${GPU_CHECK_DECODE_ROWS-model}")
    echo "== bench gpu ${bench[*]}"
    timeout "$STEP_TIMEOUT" "$PY" -m visualkv bench gpu "${bench[@]}" --out "$OUT" >"$OUT/bench_gpu_$model.log" 2>&1
    rc=$?
    tail -n 30 "$OUT/bench_gpu_$model.log"
    echo "bench $model exit $rc"
    [ $rc -eq 0 ] || status=1
    # the decode step's attention three ways at this shape's dimensions (why long caches decode slowly; an estimated ~20 s)
    if [ -n "${GPU_CHECK_SMALL:-}" ]; then
      attention=(--entries 64,500 --repeats 2 --dtype float32)
    else
      attention=(--entries 1024,10579,76574,538200)
    fi
    attention_script decode_attention "${attention[@]}"
    # a prefill block's / follow-up's attention after cached entries, transformers' (repeat_kv, mask) vs
    # block_attention's (lower-right flash): the kernel behind every block-wise TTFT (an estimated ~10 s)
    if [ -n "${GPU_CHECK_SMALL:-}" ]; then
      blocks=(--cases 64x500 --repeats 2 --dtype float32)
    else
      blocks=(--cases 1024x1024,1024x8192,1024x75520,16x76544,16x538200)
    fi
    attention_script block_attention "${blocks[@]}"
  done
  rm -f "$OUT"/*.html  # plotly is absent on the GPU box anyway; keep $OUT to the files that come back
fi

if [ "$STEPS" = all ] || [ "$STEPS" = hour ]; then
  # the hour's target: peak over weights <= 1 GiB for block-wise and composed on an hour of video; TTFT per hour.
  # The mix video (static shots, pans, cuts, like the example) is generated once and read lazily per case;
  # transformers generate and full are refused rows past 512 frames.
  if [ -n "${GPU_CHECK_SMALL:-}" ]; then
    model=tiny-qwen2.5-vl
    hour=(--video-seconds 540 --video-size 384x216 --new-tokens 4 --budget 64)
  else
    model=shape-qwen2.5-vl-7b
    hour=(--video-seconds 3600 --video-size 640x360 --new-tokens 64 --budget 1024)
  fi
  hour=(--model "$model" --inputs video --video-kinds mix --fps 1 "${hour[@]}"
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
  echo; echo '```'; cat "$OUT/env.txt"; echo '```'
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
