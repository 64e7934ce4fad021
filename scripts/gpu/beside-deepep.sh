#!/usr/bin/env bash
# Ours beside DeepEP in ONE device call: builds DeepEP's v1 low-latency kernels from a
# source tree (never part of the project; see ../shared/GPU.md), then on one GPU
#   1. DeepEP's own tests/test_low_latency.py, unmodified, on ours and on DeepEP
#      (python/deepep_compat/run.py --impl both), plain and with --use-logfmt;
#   2. python/bench.py --impl both: kernel times (profiler), host enqueue per pair, event time
#      per eager pair, graph replay per pair, for ours and DeepEP on the same inputs;
#   3. the Python GPU test that compares every output's shape, dtype and strides with DeepEP's.
#
#   bash scripts/gpu/beside-deepep.sh BIN_DIR DEEPEP_SRC        (BIN_DIR from pack.sh with a wheel)
#
# BESIDE_STEPS="test bench strides" picks steps; BESIDE_TEST_VARIANTS="plain logfmt" the test's
# runs ("host": the plain test with run.py --host-timing, each Buffer call's host time inside the
# test's processes; a run of its own, since the timing wrapper adds a frame to every call); BESIDE_TEST_ARGS / BESIDE_BENCH_ARGS add arguments. Logs and a summary go to $OUT (at most 8 files come back).
set -u
BIN=$(cd "${1:?usage: beside-deepep.sh BIN_DIR DEEPEP_SRC}" && pwd)
SRC=$(cd "${2:?usage: beside-deepep.sh BIN_DIR DEEPEP_SRC}" && pwd)
OUT=${OUT:-/tmp/ep-beside-out}
mkdir -p "$OUT"
PY=${PY:-/opt/torch/.venv/bin/python3}
SITE=${SITE:-/tmp/site}
STEPS=${BESIDE_STEPS:-test bench strides}
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
SUMMARY="$OUT/beside-summary.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
T0=$EPOCHREALTIME
el() { awk -v a="$T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%d", b - a }'; }

"$PY" -m pip install -q --no-deps --no-index --upgrade --target "$SITE" "$BIN"/ep_dispatch-*.whl \
  > "$OUT/pip.log" 2>&1 || { say "wheel install FAILED (see pip.log)"; exit 1; }
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

if ! ls "$SRC"/deep_ep_cpp*.so > /dev/null 2>&1; then
  say "[$(el) s] building DeepEP in $SRC"
  (cd "$SRC" && MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 CPATH=/usr/local/cuda/include/cccl \
    NVCC_APPEND_FLAGS="-I/usr/local/cuda/include/cccl" \
    timeout 240 "$PY" setup.py build_ext --inplace) > "$OUT/deepep-build.log" 2>&1
  rc=$?
  say "[$(el) s] DeepEP build rc=$rc ($(tail -n 1 "$OUT/deepep-build.log"))"
  [ $rc = 0 ] || exit 1
fi

if [[ " $STEPS " == *" test "* ]]; then
  for variant in ${BESIDE_TEST_VARIANTS:-plain logfmt}; do
    extra=""; [ "$variant" = logfmt ] && extra="--use-logfmt"
    timing=""; [ "$variant" = host ] && timing="--host-timing"
    name=test${extra:+-logfmt}${timing:+-host}
    say "[$(el) s] DeepEP's test_low_latency.py $extra $timing on ours and on DeepEP"
    timeout 240 "$PY" "$BIN/python/deepep_compat/run.py" "$SRC" --impl both $timing \
      --log-dir "$OUT/$name" -- --num-processes 1 --num-experts 256 $extra ${BESIDE_TEST_ARGS:-} \
      > "$OUT/$name.log" 2>&1
    say "  rc=$?"
    sed -n '/^== test_low_latency.py/,$p' "$OUT/$name.log" >> "$SUMMARY"
  done
fi

if [[ " $STEPS " == *" bench "* ]]; then
  say "[$(el) s] python/bench.py --impl both (standard setting, E=256, no masked slots)"
  PYTHONPATH="$SRC:$PYTHONPATH" timeout 200 "$PY" "$BIN/python/bench.py" --impl both \
    --experts 256 --masked 0 ${BESIDE_BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  say "  rc=$?"
  grep -E '^\[rank|^==|impl|Host|Graph|Event' "$OUT/bench.log" | tail -n 30 >> "$SUMMARY"
fi

if [[ " $STEPS " == *" strides "* ]]; then
  say "[$(el) s] the strides test beside DeepEP (N = 1)"
  (cd "$BIN/python" && EP_DEEPEP_PATH="$SRC" timeout 120 "$PY" -m pytest -q -s -p no:cacheprovider \
    tests/test_gpu.py -k deepeps_shapes) > "$OUT/strides.log" 2>&1
  say "  rc=$?"
  grep -E '^ok:|SKIPPED|passed|failed|Error' "$OUT/strides.log" | tail -n 8 >> "$SUMMARY"
fi
say "[$(el) s] done"
cat "$SUMMARY"
