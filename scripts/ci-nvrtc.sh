#!/usr/bin/env bash
# Make NVRTC loadable on a machine without the CUDA toolkit (CI), so the kernel compile test
# (tests/cuda_nvrtc.rs) compiles every CUDA kernel variant instead of skipping.
#
#   source scripts/ci-nvrtc.sh      # installs NVRTC from the Python registry, exports
#                                   # LD_LIBRARY_PATH and ATTNKIT_REQUIRE_NVRTC=1
#   cargo test --features cuda --test cuda_nvrtc
#
# NVRTC_VERSION picks the wheel (default: the CUDA 13.0 series cudarc is built against).
# Safe to source: it never exits the calling shell.
_attnkit_nvrtc() {
  local ver=${NVRTC_VERSION:-13.0.*}
  local dir=${NVRTC_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/attnkit-nvrtc}
  local py
  py=$(command -v python3 || command -v python) || { echo "ci-nvrtc: python3 not found" >&2; return 1; }
  if ! ls "$dir"/nvidia/cu13/lib/libnvrtc.so.* >/dev/null 2>&1; then
    "$py" -m pip install --quiet --no-deps --target "$dir" "nvidia-cuda-nvrtc==$ver" >&2 ||
      { echo "ci-nvrtc: pip could not install nvidia-cuda-nvrtc==$ver" >&2; return 1; }
  fi
  local lib
  lib=$(dirname "$(ls "$dir"/nvidia/cu*/lib/libnvrtc.so.* | head -n1)")
  # cudarc opens libnvrtc.so.13 (or libnvrtc.so); the wheel ships the versioned name.
  export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export ATTNKIT_REQUIRE_NVRTC=1
  echo "ci-nvrtc: NVRTC from $lib (LD_LIBRARY_PATH exported, ATTNKIT_REQUIRE_NVRTC=1)"
}
_attnkit_nvrtc
