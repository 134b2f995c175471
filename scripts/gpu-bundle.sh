#!/usr/bin/env bash
# Build attnkit's test and bench binaries here (no CUDA toolkit needed: cudarc loads the driver and
# NVRTC at run time) and pack them into bundle/, a self-contained folder that runs on any Linux
# x86-64 machine with an NVIDIA driver and/or Vulkan:
#
#   FEATURES=cuda,wgpu,cli scripts/gpu-bundle.sh      # build and pack
#   bash bundle/run.sh tests [filter]                 # there: the conformance suite and every test binary
#   bash bundle/run.sh bench [attnkit bench args]     # there: attnkit bench
#   bash bundle/run.sh anchor [torch_anchor args]     # there: the PyTorch SDPA peer (needs torch)
#   bash bundle/run.sh sanitize [filter]              # there: compute-sanitizer memcheck + racecheck over the suite
#   FEATURES=cuda,cli,candle-cuda scripts/gpu-bundle.sh   # also candle on CUDA (nvcc and link stubs
#                                                     # from scripts/cuda-toolkit.sh), with the Llama example:
#   bash bundle/run.sh example 10_llama_paged cuda    # there
#
# TESTS="candle conformance" picks test binaries (default: all). With candle-cuda every binary
# carries candle's CUDA kernels (about 36 MB each): the binaries then travel as one xz archive
# (COMPRESS=1, the default with candle-cuda), which run.sh unpacks on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
FEATURES=${FEATURES:-cuda,wgpu,cli}
if [[ ",$FEATURES," == *",candle-cuda,"* ]]; then
  # shellcheck source=/dev/null
  source scripts/cuda-toolkit.sh
fi
rm -rf bundle
mkdir -p bundle/bin bundle/examples
# Test binaries (one per tests/*.rs and the lib's unit tests), paths read from cargo's JSON messages.
test_args=()
for t in ${TESTS:-}; do test_args+=(--test "$t"); done
cargo test --no-run --features "$FEATURES" "${test_args[@]}" --message-format=json 2>/dev/null |
  python3 scripts/test-binaries.py bundle/bin
if [[ ",$FEATURES," == *",cli,"* ]]; then
  # The command uses no candle: build it without candle's CUDA build (nvcc) in release.
  bin_features=$(echo ",$FEATURES," | sed 's/,candle-cuda,/,/g; s/^,//; s/,$//')
  cargo build --release --features "$bin_features" --bin attnkit
  cp target/release/attnkit bundle/bin/attnkit
  echo "bundled attnkit (release)"
fi
if [[ ",$FEATURES," == *",candle-cuda,"* ]]; then
  cargo build --release --features "$FEATURES" --example 10_llama_paged
  cp target/release/examples/10_llama_paged bundle/examples/
  echo "bundled example 10_llama_paged (release)"
fi
# The peer benchmark, if the shared folder is beside the checkout.
for p in ../shared/gpu/torch_anchor.py shared/gpu/torch_anchor.py; do
  [[ -f $p ]] && cp "$p" bundle/torch_anchor.py && break
done
cp scripts/bundle-run.sh bundle/run.sh
# Debug info makes the binaries ten times larger than the code; the bundle has to travel.
strip --strip-debug bundle/bin/* bundle/examples/* 2>/dev/null || true
git rev-parse --short HEAD > bundle/COMMIT 2>/dev/null || true
default_compress=0
[[ ",$FEATURES," == *",candle-cuda,"* ]] && default_compress=1
if [[ ${COMPRESS:-$default_compress} == 1 ]]; then
  tar -C bundle -cJf bundle/bins.tar.xz bin examples && rm -rf bundle/bin bundle/examples
  echo "binaries packed into bundle/bins.tar.xz"
fi
du -sh bundle
