#!/usr/bin/env bash
# A/B of the packed kernel's loop iterations (docs/PERF_NOTES.md, wgpu v20): main's shaders (BASE,
# default HEAD) against the working tree's, whose packed kernel takes `ATTNKIT_WGPU_PACKED_UNROLL=
# qk,pv` (steps of 4 d a q.k iteration, keys a p.v iteration); with the inner-loop probes, the
# tests, the full bench and the peer, on one GPU machine in one call.
#
#   bash scripts/experiments/unroll.sh bundle     # here: base wgsl_bench, then the bundle
#   bash bundle/experiment.sh                    # there (carry bundle and .gl, the Vulkan loader
#                                                # packages: see README, wgpu on a GPU)
#
# The first call (v20) ran SETTINGS="1,1 1,2 1,4 1,8 2,1 4,1 2,4 4,8 8,64" with PROBES=1 FULL=1.
set -euo pipefail
cd "$(dirname "$0")/../.."
BASE=${BASE:-HEAD}
if [[ ${1:-} == bundle ]]; then
  keep=$(mktemp -d)
  cp -r shaders "$keep/"
  git checkout "$BASE" -- shaders/
  trap 'rm -rf shaders && cp -r "$keep/shaders" . && git reset -q -- shaders' EXIT
  FEATURES=cuda,wgpu TESTS="wgsl_bench" bash scripts/gpu-bundle.sh # no cli: no release build
  cp bundle/bin/wgsl_bench "$keep/base-wgsl_bench"
  rm -rf shaders && cp -r "$keep/shaders" . && git reset -q -- shaders
  trap - EXIT
  # The trial: unroll.patch on the working tree, taken off again after the build.
  P=scripts/experiments/unroll.patch
  applied=0
  if ! git apply --reverse --check "$P" 2>/dev/null; then git apply "$P" && applied=1; fi
  FEATURES=cuda,wgpu,cli TESTS="wgsl_bench wgsl_backend conformance" bash scripts/gpu-bundle.sh
  if [[ $applied == 1 ]]; then git apply --reverse "$P"; fi
  mkdir -p bundle/base
  mv "$keep/base-wgsl_bench" bundle/base/wgsl_bench
  rm -rf "$keep"
  sed -n '/^# ---- run ----$/,$p' "$0" > bundle/experiment.sh
  echo "bundle ready: run bash bundle/experiment.sh there"
  exit 0
fi
echo "usage: $0 bundle"
exit 2
# ---- run ----
# On the GPU machine, from the checkout's root: the Vulkan loader from .gl, then the A/B (f16 with
# cooperative matrices off, and bf16: the packed kernel both), the packed kernel's tests at the
# setting BEST, the suite at BEST, the peer, the A/B's ends again. SETTINGS: the A/B's settings
# (qk,pv,red); PROBES=1 adds the inner-loop probes, FULL=1 the full bench (default kernels).
cd "$(dirname "$0")/.."
for f in .gl/*.deb; do dpkg -x "$f" / 2>/dev/null; done
ldconfig
B=bundle/bin
O=${OUT:-/tmp}
SETTINGS=${SETTINGS:-"4,1,1 4,1,16 8,1,1 8,1,16 32,1,16 4,2,16 2,1,16"}
BEST=${BEST:-4,1,16}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
lean() { ATTNKIT_WGPU_COOP=off ATTNKIT_BENCH_LEAN=1 ATTNKIT_BENCH_ONLY="16 dense B4" timeout 60 "$1" --ignored --nocapture bench 2>&1 | tee -a "$O/ab_raw.txt" | grep -E "^\| b?f16 dense B4" | cut -c1-90; }
regs() { ATTNKIT_STATS_ONLY="packed bf16 32x64" timeout 30 $B/wgsl_bench --ignored --nocapture kernel_statistics 2>&1 | grep -iE "regist|spill|local" | head -3 | cut -c1-110; }
ab() {
  echo "-- base"; lean bundle/base/wgsl_bench
  for u in "$@"; do
    echo "-- unroll $u"; export ATTNKIT_WGPU_PACKED_UNROLL=$u; lean $B/wgsl_bench; regs; unset ATTNKIT_WGPU_PACKED_UNROLL
  done
}
echo "== A/B: packed kernel, f16 and bf16 dense B4 H16 S4096 D128, ms"
# shellcheck disable=SC2086
ab $SETTINGS
if [[ ${PROBES:-0} == 1 ]]; then
  echo "== probes"
  timeout 150 $B/wgsl_bench --ignored --nocapture inner_loops > "$O/probes.txt" 2>&1; echo "rc=$?"
  grep -E "^\|" "$O/probes.txt"
fi
echo "== wgsl_backend at $BEST"
ATTNKIT_WGPU_PACKED_UNROLL=$BEST ATTNKIT_REQUIRE_COOP=1 ATTNKIT_CASES=8 timeout 150 $B/wgsl_backend > "$O/wgsl_backend.txt" 2>&1; echo "rc=$?"
grep -E "test result|FAILED|panicked" "$O/wgsl_backend.txt" | head -12
if [[ ${FULL:-0} == 1 ]]; then
  echo "== full bench"
  timeout 150 $B/wgsl_bench --ignored --nocapture bench > "$O/bench.txt" 2>&1; echo "rc=$?"
  grep -E "^\|" "$O/bench.txt" | cut -c1-200
fi
echo "== peer"
timeout 80 bash bundle/run.sh anchor --quick > "$O/anchor.txt" 2>&1; echo "rc=$?"; tail -16 "$O/anchor.txt"
echo "== conformance wgpu:: at $BEST"
ATTNKIT_WGPU_PACKED_UNROLL=$BEST ATTNKIT_CASES=8 timeout 120 $B/conformance wgpu:: > "$O/conf.txt" 2>&1; echo "rc=$?"; grep -E "test result|FAILED|panicked" "$O/conf.txt" | head -8
echo "== A/B again"
ab "$BEST"
