#!/usr/bin/env bash
# The packed-kernel A/B of docs/PERF_NOTES.md (wgpu v18), ready to run: the switches live in
# packed-v18.patch (against commit 2080715's kernels), not in the crate.
#
#   bash scripts/experiments/packed-v18.sh bundle   # here: bundle/ with the patched binaries and
#                                                   # bundle/base/wgsl_bench built without the patch
#   bash bundle/experiment.sh                       # on the GPU machine (carry bundle and .gl)
#
# .gl/ holds the Vulkan loader and the GL dispatch libraries as Debian packages, for a GPU machine
# whose driver comes without them: `cd .gl && apt-get download libvulkan1 libegl1 libglvnd0
# libopengl0 libgl1 libglx0 libgles2` (amd64) here; the run unpacks them there.
# `bundle` leaves the patch applied (`git apply -R scripts/experiments/packed-v18.patch` takes it
# out). The switches: ATTNKIT_WGPU_AB bits 1 K words loaded in place, 2 V words in place, 4 P in
# f16, 8 Q^T 16-bit, 16 V in its own buffer with 3 barriers a tile (needs bit 8 or the 16x64 tile
# to fit 48 KiB; never with bit 1); ATTNKIT_WGPU_PACKED_SKIP=1 the 16x64 tile.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=scripts/experiments
if [[ ${1:-} == bundle ]]; then
  git apply --check "$here/packed-v18.patch"
  FEATURES=cuda,wgpu TESTS="wgsl_bench" bash scripts/gpu-bundle.sh # no cli: no release build
  cp bundle/bin/wgsl_bench /tmp/attnkit-base-wgsl_bench
  git apply "$here/packed-v18.patch"
  FEATURES=cuda,wgpu,cli TESTS="wgsl_bench wgsl_backend conformance" bash scripts/gpu-bundle.sh
  mkdir -p bundle/base
  mv /tmp/attnkit-base-wgsl_bench bundle/base/wgsl_bench
  sed -n '/^# ---- run ----$/,$p' "$0" > bundle/experiment.sh
  echo "bundle ready: run bash bundle/experiment.sh there"
  exit 0
fi
echo "usage: $0 bundle"
exit 2
# ---- run ----
# On the GPU machine, from the checkout's root: the Vulkan loader from .gl (made as above), then
# the tests of the patched text, the A/B in order of priority, the full bench, the peer, the suite.
cd "$(dirname "$0")/.."
for f in .gl/*.deb; do dpkg -x "$f" / 2>/dev/null; done
ldconfig
B=bundle/bin
O=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
echo "== wgsl_backend (patched text, switches off)"
ATTNKIT_REQUIRE_COOP=1 ATTNKIT_CASES=8 timeout 120 $B/wgsl_backend > "$O/wgsl_backend.txt" 2>&1; echo "rc=$?"
grep -E "test result|FAILED|panicked" "$O/wgsl_backend.txt" | head -8
lean() { ATTNKIT_BENCH_LEAN=1 ATTNKIT_BENCH_ONLY="$2" timeout 60 "$1" --ignored --nocapture bench 2>&1 | tee -a "$O/ab_raw.txt" | grep -E "^\| b?f16 dense" | cut -c1-150; }
st() { ATTNKIT_STATS_ONLY="packed bf16" timeout 30 $B/wgsl_bench --ignored --nocapture kernel_statistics 2>&1 | grep -E "^packed" | cut -c1-250; }
echo "== A/B"
echo "-- base (HEAD)"; lean bundle/base/wgsl_bench "16 dense B4"
echo "-- patched"; lean $B/wgsl_bench "16 dense B4"
for ab in 3 28; do echo "-- AB=$ab"; ATTNKIT_WGPU_AB=$ab lean $B/wgsl_bench "bf16 dense B4"; done
for ab in 0 16; do echo "-- 16x64 AB=$ab"; ATTNKIT_WGPU_PACKED_SKIP=1 ATTNKIT_WGPU_AB=$ab lean $B/wgsl_bench "bf16 dense B4"; done
echo "== full bench (patched)"
timeout 100 $B/wgsl_bench --ignored --nocapture bench > "$O/bench.txt" 2>&1; echo "rc=$?"
grep -E "^\|" "$O/bench.txt" | cut -c1-200
echo "== peer"
timeout 80 bash bundle/run.sh anchor --quick > "$O/anchor.txt" 2>&1; echo "rc=$?"; tail -22 "$O/anchor.txt"
echo "== conformance wgpu::"
ATTNKIT_CASES=8 timeout 120 $B/conformance wgpu:: > "$O/conf.txt" 2>&1; echo "rc=$?"; grep -E "test result|FAILED|panicked" "$O/conf.txt" | head -8
echo "== registers and more A/B"
st
for ab in 3 28; do echo "-- AB=$ab"; ATTNKIT_WGPU_AB=$ab st; done
for ab in 0 16; do echo "-- 16x64 AB=$ab"; ATTNKIT_WGPU_PACKED_SKIP=1 ATTNKIT_WGPU_AB=$ab st; done
for ab in 30 1 2 4 8; do echo "-- AB=$ab"; ATTNKIT_WGPU_AB=$ab lean $B/wgsl_bench "bf16 dense B4"; done
for ab in 3 28; do echo "-- 16x64 AB=$ab"; ATTNKIT_WGPU_PACKED_SKIP=1 ATTNKIT_WGPU_AB=$ab lean $B/wgsl_bench "bf16 dense B4"; done
echo "-- base again"; lean bundle/base/wgsl_bench "16 dense B4"
echo "== probes: the 4-row loops alone"
ATTNKIT_PROBE_ONLY="wg128 nx16" timeout 45 $B/wgsl_bench --ignored --nocapture inner_loops > "$O/probes.txt" 2>&1; echo "rc=$?"
grep -E "^\|" "$O/probes.txt" | cut -c1-160 | head -20
