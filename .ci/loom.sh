#!/usr/bin/env bash
# The loom suite on the shipped protocol code, then the mutants that must make it fail.
# Each build has its own target dir (RUSTFLAGS differ), so the normal build is not disturbed.
set -euo pipefail
cd "$(dirname "$0")/.."
export LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-4}"

echo "-- loom models (LOOM_MAX_PREEMPTIONS=$LOOM_MAX_PREEMPTIONS)"
RUSTFLAGS="--cfg ep_loom" CARGO_TARGET_DIR=target/loom \
  cargo test --release -p ep-verify --test loom_protocol

# mutant cfg value : the model that must catch it
mutants=(
  "signal_relaxed:payload_then_signal"
  "finish_relaxed:staging_workers_then_sender"
  "credit_relaxed:consecutive_dispatches"
)
log=$(mktemp)
for m in "${mutants[@]}"; do
  name=${m%%:*}
  model=${m#*:}
  echo "-- mutant $name (one ordering weakened to Relaxed): loom must find the violation in $model"
  if RUSTFLAGS="--cfg ep_loom --cfg ep_mutant=\"$name\"" CARGO_TARGET_DIR=target/loom-mutant \
    cargo test --release -p ep-verify --test loom_protocol -- "$model" >"$log" 2>&1; then
    echo "FAIL: mutant $name survived: loom found nothing"
    tail -n 30 "$log"
    exit 1
  fi
  if ! grep -q "Causality violation" "$log"; then
    echo "FAIL: mutant $name failed, but not with a loom causality violation:"
    tail -n 30 "$log"
    exit 1
  fi
  echo "ok: mutant $name killed: $(grep -m1 'Causality violation' "$log")"
done
rm -f "$log"
