#!/usr/bin/env bash
# Issue 32's checks on a lent GPU machine, in parts sized for one device call each.
#
#   bash benchmarks/gpu.sh PART [PART ...]        (from the repository root, on that machine)
#
# Here, first: `make device-wheels` (the test wheels that machine lacks and this package's own
# wheel, into the git-ignored .device-wheels/), then carry that path: run(command="bash
# benchmarks/gpu.sh gpu-tests demo", carry=[".device-wheels"], kind="nvidia-h100-x1", timeout_s=...).
# What comes back under $OUT is at most 6 files (the tool returns 8): every part's output in
# log.txt, the rewritten benchmarks/RESULTS.md, the demo's two reports and its warm profile. A part
# that runs past its own limit is stopped and the next one runs.
#
# part        seconds  what it checks (issue 32's criterion)
# gpu-tests        20  1: every gpu-marked test
# suite           400  2: the whole suite, 14 processes (a call of its own: over 370 s on 2026-11-27)
# guards           60  3: the guards' overhead on CUDA
# data-bound      150  4: workers against the sweep and Lightning's count, 8,192 images
# demo            150  5: the demo cold, then warm, then warm under cProfile ($DEMO_SAMPLES images)
# batch-size      450  6: AutoBatchSize on ResNet-50 against BatchSizeFinder (a call of its own)
# saves           100  checkpoint saves: on the training thread / background; pinned / pageable
# eval-pass       120  a predict job alone: tuned loaders against the plain one
# channels-last   120  NHWC against NCHW under bf16, four CNNs: whether the preset should time it there
set -uo pipefail

OUT=${OUT:-/tmp/gpu-out}
EXTRA=/tmp/lightning-boost-extra
mkdir -p "$OUT"

setup() {
  # the package's wheel gives the contract test its metadata; the source itself is imported from
  # here, by an absolute path (the DDP example's subprocess runs in a temporary directory)
  if [ ! -d "$EXTRA" ]; then
    python3 -m pip install --quiet --no-index --no-deps --target "$EXTRA" .device-wheels/*.whl || exit 1
  fi
  export PYTHONPATH="$PWD:$EXTRA"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/log.txt"
  git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/log.txt"
}

# `timed LIMIT NAME COMMAND...`: the command's output appended to $OUT/log.txt under its name, its
# last lines here, stopped at LIMIT s.
timed() {
  local limit=$1 name=$2
  shift 2
  local start=$SECONDS
  echo "== $name: $*" >> "$OUT/log.txt"
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/log.txt" | tail -n 40
  echo "== $name: exit ${PIPESTATUS[0]} in $((SECONDS - start)) s" | tee -a "$OUT/log.txt"
  cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
}

demo() {
  local cache
  cache=$(mktemp -d)
  export LIGHTNING_BOOST_CACHE_DIR=$cache
  local args=(--samples "${DEMO_SAMPLES:-16384}" --epochs 2)
  timed 150 demo-cold python3 -m lightning_boost demo "${args[@]}" --root /tmp/demo-cold
  timed 100 demo-warm python3 -m lightning_boost demo "${args[@]}" --root /tmp/demo-warm
  timed 100 demo-profile python3 -m cProfile -o "$OUT/demo-warm.prof" -m lightning_boost demo "${args[@]}" \
    --root /tmp/demo-profile
  python3 -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('cumulative').print_stats(60)" \
    "$OUT/demo-warm.prof" > "$OUT/demo-warm-profile.txt"
  for run in cold warm; do
    find "/tmp/demo-$run" -name 'boost_report.json' -exec cp {} "$OUT/demo-$run-report.json" \; -quit
  done
  unset LIGHTNING_BOOST_CACHE_DIR
}

PARTS=(gpu-tests suite guards data-bound demo batch-size saves eval-pass channels-last)

run_part() {
  case $1 in
    gpu-tests) timed 60 gpu-tests python3 -m pytest -p no:benchmark -p no:cacheprovider -m gpu -rA ;;
    # -v names each result as it comes (a suite stopped at its limit prints no summary; SIGINT
    # would not help: Lightning's fit takes it as a graceful stop and the test goes on), the
    # passed ones and the names of tests starting left out of log.txt; a test past 200 s fails
    # with every thread's stack, inside the limit (the slowest: 170 s with 8 processes on 2 CPUs)
    suite) timed 480 suite bash -c "set -o pipefail; python3 -m pytest -p no:benchmark -p no:cacheprovider \
      -n 14 -v --durations=20 --timeout=200 | grep --line-buffered -v -E ' PASSED |^tests/'" ;;
    guards) timed 120 guards python3 -m benchmarks guard_overhead ;;
    data-bound) timed 240 data-bound python3 -m benchmarks data_bound:samples=8192 ;;
    demo) demo ;;
    batch-size) timed 560 batch-size python3 -m benchmarks gpu_batch_size ;;
    saves) timed 200 saves python3 -m benchmarks checkpoint_saves ;;
    eval-pass) timed 200 eval-pass python3 -m benchmarks eval_pass:repeats=1 ;;
    channels-last) timed 200 channels-last python3 -m benchmarks channels_last ;;
  esac
}

if [ $# -eq 0 ]; then
  sed -n '2,20p' "$0"
  exit 2
fi
for part in "$@"; do  # every name checked before the machine spends time on any
  if [[ ! " ${PARTS[*]} " =~ " $part " ]]; then
    echo "unknown part '$part': expected one of ${PARTS[*]}" >&2
    exit 2
  fi
done
setup
for part in "$@"; do
  run_part "$part"
done
