#!/usr/bin/env bash
# Builds the GPU verification binaries here (no GPU needed) and copies them, stripped, into a
# folder that travels to the GPU machine:
#
#   bash scripts/gpu/pack.sh [DEST]      (DEST default .gpu, git-ignored; a relative DEST is taken
#                                         from the checkout's root, an absolute one as it is)
#
# DEST gets the test binaries gpu, gpu_fuzz, gpu_soak, gpu_process (custom runners; paths from
# `cargo test --no-run --message-format=json`), ep-bench (also process mode's program: the
# fault runs start its ranks), ep-scale (set-up time and memory against R), moe_layer, and BUILD-INFO (the commit
# and whether the tree had changes). Then, on the GPU machine: bash scripts/gpu/run-all.sh DEST.

set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
DEST=${1:-.gpu}
mkdir -p "$DEST"
# Absolute from here on (a relative DEST is relative to the checkout): the wheel is built from
# python/, where a relative "../$DEST" would name the wrong folder for an absolute DEST.
DEST=$(cd "$DEST" && pwd)
command -v jq > /dev/null || { echo "pack.sh: jq is needed to read cargo's JSON" >&2; exit 2; }

cargo build --release -p ep-benches --bin ep-bench --bin ep-scale
cargo build --release -p ep-group --example moe_layer
# gpu, gpu_fuzz, gpu_soak: ep-kernels; gpu_process: ep-group.
json=$(cargo test --release -p ep-kernels -p ep-group --no-run --message-format=json)
for t in gpu gpu_fuzz gpu_soak gpu_process; do
  exe=$(echo "$json" | jq -r --arg t "$t" \
    'select(.reason == "compiler-artifact" and .target.name == $t and (.target.kind | index("test")) and .executable != null) | .executable' \
    | tail -n 1)
  if [ -z "$exe" ] || [ ! -x "$exe" ]; then
    echo "pack.sh: no test binary for $t in cargo's output" >&2
    exit 1
  fi
  strip -o "$DEST/$t" "$exe"
done
# Cargo's target folder: $CARGO_TARGET_DIR where set (relative: to the checkout's root, where
# cargo ran), else target/.
tgt=${CARGO_TARGET_DIR:-target}
strip -o "$DEST/ep-bench" "$tgt/release/ep-bench"
strip -o "$DEST/ep-scale" "$tgt/release/ep-scale"
strip -o "$DEST/moe_layer" "$tgt/release/examples/moe_layer"
# The Python Buffer, where maturin is at hand (PACK_WHEEL=1): the abi3 wheel plus what
# python/gpu.sh runs beside it (its tests and bench.py).
if [ "${PACK_WHEEL:-0}" = 1 ]; then
  rm -rf "$DEST/python" "$DEST"/ep_dispatch-*.whl
  (cd python && maturin build --release --strip --out "$DEST")
  mkdir -p "$DEST/python"
  cp -r python/gpu.sh python/bench.py python/faults.py python/tests python/deepep_compat "$DEST/python/"
fi
dirty=$(git status --porcelain --untracked-files=no | wc -l)
echo "commit $(git rev-parse --short HEAD)$([ "$dirty" -gt 0 ] && echo " + $dirty changed tracked files"), built $(date -u +%FT%TZ) on $(hostname)" > "$DEST/BUILD-INFO"
ls -l "$DEST"
size=$(du -sm "$DEST" | cut -f1)
echo "pack.sh: $DEST holds ${size} MiB: $(cat "$DEST/BUILD-INFO")"
if [ "$size" -gt 40 ]; then
  echo "pack.sh: more than 40 MiB: the device tool carries at most 64 MiB with the tree" >&2
  exit 1
fi
