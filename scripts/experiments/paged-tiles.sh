#!/usr/bin/env bash
# A/B of the prefill kernels' whole-tile path for paged caches (docs/PERF_NOTES.md, wgpu v19):
# the shaders of BASE (default e723acf, paged tiles read a row a word) against the working tree's,
# each with this tree's tests and bench, on one GPU machine in one call.
#
#   bash scripts/experiments/paged-tiles.sh bundle     # here: base wgsl_bench, then the bundle
#   bash bundle/experiment.sh                         # there (carry bundle and .gl, the Vulkan
#                                                     # loader packages: see README, wgpu on a GPU)
set -euo pipefail
cd "$(dirname "$0")/../.."
BASE=${BASE:-e723acf}
if [[ ${1:-} == bundle ]]; then
  keep=$(mktemp -d)
  cp -r shaders "$keep/"
  # BASE's shaders written from its tree (the index untouched, so a commit made meanwhile
  # cannot pick them up), the tree's own put back after the build.
  rm -rf shaders && git archive "$BASE" shaders | tar -x
  trap 'rm -rf shaders && cp -r "$keep/shaders" .' EXIT
  FEATURES=cuda,wgpu TESTS="wgsl_bench" bash scripts/gpu-bundle.sh # no cli: no release build
  cp bundle/bin/wgsl_bench "$keep/base-wgsl_bench"
  rm -rf shaders && cp -r "$keep/shaders" .
  trap - EXIT
  FEATURES=cuda,wgpu,cli TESTS="wgsl_bench wgsl_backend conformance" bash scripts/gpu-bundle.sh
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
# On the GPU machine, from the checkout's root: the Vulkan loader from .gl, then the tests, the
# A/B (base, new), the full bench, the peer, the suite, the A/B again.
cd "$(dirname "$0")/.."
for f in .gl/*.deb; do dpkg -x "$f" / 2>/dev/null; done
ldconfig
B=bundle/bin
O=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
echo "== wgsl_backend"
ATTNKIT_REQUIRE_COOP=1 ATTNKIT_CASES=8 timeout 150 $B/wgsl_backend > "$O/wgsl_backend.txt" 2>&1; echo "rc=$?"
grep -E "test result|FAILED|panicked|^test " "$O/wgsl_backend.txt" | head -24
lean() { ATTNKIT_BENCH_LEAN=1 ATTNKIT_BENCH_ONLY="$2" timeout 90 "$1" --ignored --nocapture bench 2>&1 | tee -a "$O/ab_raw.txt" | grep -E "^\| b?f16 (dense|paged16) B4" | cut -c1-150; }
echo "== A/B: dense and paged16 prefill, default kernel alone"
echo "-- base"; lean bundle/base/wgsl_bench " B4 "
echo "-- new"; lean $B/wgsl_bench " B4 "
echo "== full bench (new)"
timeout 150 $B/wgsl_bench --ignored --nocapture bench > "$O/bench.txt" 2>&1; echo "rc=$?"
grep -E "^\|" "$O/bench.txt" | cut -c1-200
echo "== peer"
timeout 80 bash bundle/run.sh anchor --quick > "$O/anchor.txt" 2>&1; echo "rc=$?"; tail -16 "$O/anchor.txt"
echo "== conformance wgpu::"
ATTNKIT_CASES=8 timeout 120 $B/conformance wgpu:: > "$O/conf.txt" 2>&1; echo "rc=$?"; grep -E "test result|FAILED|panicked" "$O/conf.txt" | head -8
echo "== A/B again"
echo "-- base"; lean bundle/base/wgsl_bench " B4 "
echo "-- new"; lean $B/wgsl_bench " B4 "
