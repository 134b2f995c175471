#!/usr/bin/env bash
# A/B of the wgpu shaders of BASE (a commit) against the working tree's, with this tree's tests,
# full bench and the peer, on one GPU machine in one call (docs/PERF_NOTES.md, wgpu):
#
#   BASE=<commit> bash scripts/gpu-ab.sh bundle   # here: base wgsl_bench, then the bundle
#   bash bundle/experiment.sh                     # there (carry bundle and .gl, the Vulkan loader
#                                                 # packages: see README, wgpu on a GPU)
#
# There: ONLY (default " B4 ") picks the A/B's shapes; the default kernel of each, alone, f16 with
# cooperative matrices where the adapter has them, and again with them off (PACKED=1, default).
# TRIAL_ENV="NAME=value ...[;NAME=value ...]" adds the trial binary under each set of variables
# (a trial switch; sets apart by ';') to the A/B, with its packed kernel's registers and its tests.
# The trial binary is the new one, or the trial patch's: TRIAL_PATCH=<file> (here) builds
# wgsl_bench and wgsl_backend from the tree with that patch applied, beside the bundle's own (the
# tree's text), so one call runs both. BASE_SUITE=1 (here) also carries BASE's conformance suite,
# so that either text can land with its GPU run. The base's and the trial's binaries travel
# xz-compressed. Every suite runs before any timing. COOP_AB=0 leaves the A/B's and the trials'
# runs with cooperative matrices out (the full bench still times that kernel). SHORT=1 (there)
# runs only the packed kernel's tests of wgsl_backend (conformance stays whole), for a short call.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${BASE:?BASE=<commit> whose shaders are the A/B base}
if [[ ${1:-} == bundle ]]; then
  keep=$(mktemp -d)
  cp -r shaders "$keep/"
  # BASE's shaders written from its tree (the index untouched, so a commit made meanwhile
  # cannot pick them up), the tree's own put back after the build.
  rm -rf shaders && git archive "$BASE" shaders | tar -x
  trap 'rm -rf shaders && cp -r "$keep/shaders" .' EXIT
  BASE_TESTS="wgsl_bench"
  if [[ ${BASE_SUITE:-0} == 1 ]]; then BASE_TESTS="wgsl_bench conformance"; fi
  FEATURES=cuda,wgpu TESTS="$BASE_TESTS" bash scripts/gpu-bundle.sh # no cli: no release build
  mkdir -p "$keep/base"
  for t in $BASE_TESTS; do cp "bundle/bin/$t" "$keep/base/"; done
  rm -rf shaders && cp -r "$keep/shaders" .
  trap - EXIT
  FEATURES=cuda,wgpu,cli TESTS="wgsl_bench wgsl_backend conformance" bash scripts/gpu-bundle.sh
  mv "$keep/base" bundle/base
  echo "$BASE" > bundle/base/COMMIT
  rm -rf "$keep"
  if [[ -n ${TRIAL_PATCH:-} ]]; then
    git apply "$TRIAL_PATCH"
    trap 'git apply -R "$TRIAL_PATCH"' EXIT
    mkdir -p bundle/trial
    cargo test --no-run --features cuda,wgpu --test wgsl_bench --test wgsl_backend \
      --message-format=json 2>/dev/null | python3 scripts/test-binaries.py bundle/trial
    git apply -R "$TRIAL_PATCH"
    trap - EXIT
    strip --strip-debug bundle/trial/*
    echo "$(cat bundle/COMMIT) + $(basename "$TRIAL_PATCH")" > bundle/trial/COMMIT
  fi
  for f in bundle/base/* bundle/trial/*; do
    if [[ -x $f ]]; then xz -T2 "$f"; fi
  done
  sed -n '/^# ---- run ----$/,$p' "$0" > bundle/experiment.sh
  echo "bundle ready: run bash bundle/experiment.sh there"
  exit 0
fi
echo "usage: BASE=<commit> $0 bundle"
exit 2
# ---- run ----
cd "$(dirname "$0")/.."
for f in .gl/*.deb; do dpkg -x "$f" / 2>/dev/null; done
ldconfig
B=bundle/bin
O=${OUT:-/tmp}
ONLY=${ONLY:-" B4 "}
for f in bundle/base/*.xz bundle/trial/*.xz; do
  if [[ -e $f ]]; then xz -d -f "$f"; fi
done
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
echo "base $(cat bundle/base/COMMIT), new $(cat bundle/COMMIT)"
# The trials' binaries: the trial patch's where the bundle has them, else the new text's.
T=$B
if [[ -d bundle/trial ]]; then
  T=bundle/trial
  echo "trials run $(cat bundle/trial/COMMIT)"
fi
TRIALS=()
if [[ -n ${TRIAL_ENV:-} ]]; then IFS=';' read -r -a TRIALS <<< "$TRIAL_ENV"; fi
lean() { ATTNKIT_BENCH_LEAN=1 ATTNKIT_BENCH_ONLY="$ONLY" timeout 90 "$@" --ignored --nocapture bench 2>&1 | tee -a "$O/ab_raw.txt" | grep -E "^\| " | grep -v "^| shape" | cut -c1-90; }
ab() {
  if [[ ${COOP_AB:-1} == 1 ]]; then
    echo "-- base"; lean bundle/base/wgsl_bench
    echo "-- new"; lean $B/wgsl_bench
  fi
  if [[ ${PACKED:-1} == 1 ]]; then
    echo "-- base, cooperative matrices off"; ATTNKIT_WGPU_COOP=off lean bundle/base/wgsl_bench
    echo "-- new, cooperative matrices off"; ATTNKIT_WGPU_COOP=off lean $B/wgsl_bench
  fi
  for t in "${TRIALS[@]}"; do
    if [[ ${COOP_AB:-1} == 1 ]]; then
      # shellcheck disable=SC2086
      echo "-- trial, $t"; (export $t; lean $T/wgsl_bench)
    fi
    # shellcheck disable=SC2086
    echo "-- trial, $t, cooperative matrices off"; (export $t; ATTNKIT_WGPU_COOP=off lean $T/wgsl_bench)
  done
}
# Correct before fast: every suite (the new text's, the base's, each trial's) before any timing;
# then the peer, the A/B and the full bench.
# suite TITLE LOG [NAME=value ...] COMMAND...: a test binary, 8 cases a property, its output
# in $O/LOG, its exit status and summary lines here.
suite() {
  local title=$1 log=$2
  shift 2
  echo "== $title"
  env ATTNKIT_CASES=8 "$@" > "$O/$log" 2>&1; echo "rc=$?"
  grep -E "test result|FAILED|panicked" "$O/$log" | head -12
}
suite "conformance wgpu::" conf.txt timeout 120 $B/conformance wgpu::
if [[ -x bundle/base/conformance ]]; then
  suite "conformance wgpu::, base" conf_base.txt timeout 120 bundle/base/conformance wgpu::
fi
if [[ ${SHORT:-0} == 1 ]]; then
  # A short call (little device time left): the packed kernel's own tests of the backend suite.
  suite "wgsl_backend packed paged_whole" wgsl_backend.txt timeout 60 $B/wgsl_backend packed paged_whole
else
  suite wgsl_backend wgsl_backend.txt ATTNKIT_REQUIRE_COOP=1 timeout 150 $B/wgsl_backend
fi
n=0
for t in "${TRIALS[@]}"; do
  n=$((n + 1))
  # shellcheck disable=SC2086
  suite "wgsl_backend, $t" "wgsl_backend_trial$n.txt" $t ATTNKIT_REQUIRE_COOP=1 timeout 150 $T/wgsl_backend
  echo "== registers, $t"
  # shellcheck disable=SC2086
  env $t ATTNKIT_STATS_ONLY=packed timeout 60 $T/wgsl_bench --ignored --nocapture kernel_statistics 2>&1 | grep -E "Register" | cut -c1-120
done
echo "== peer"
timeout 80 bash bundle/run.sh anchor --quick > "$O/anchor.txt" 2>&1; echo "rc=$?"; tail -16 "$O/anchor.txt"
echo "== A/B, default kernel alone, ms"
ab
echo "== full bench (new)"
timeout 150 $B/wgsl_bench --ignored --nocapture bench > "$O/bench.txt" 2>&1; echo "rc=$?"
grep -E "^\|" "$O/bench.txt" | cut -c1-200
