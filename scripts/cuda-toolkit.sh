#!/usr/bin/env bash
# What the `candle-cuda` feature needs at build time, on a machine without the CUDA toolkit (CI,
# or a build machine without a GPU), from the Python registry:
#
#   source scripts/cuda-toolkit.sh     # then: cargo build --features candle-cuda ...
#
# - nvcc with its headers (nvcc, crt, cudart, cccl, nvvm wheels): candle-kernels' build script
#   compiles candle's own CUDA kernels with it (CUDA_COMPUTE_CAP picks the target, default 90);
# - link stubs (in $CUDA_ROOT/lib/stubs, never on the loader path): candle-core links cudarc to
#   libcuda, libnvrtc, libcublas, libcublasLt and libcurand (cudarc's `dynamic-linking`). The
#   linker only needs their names and symbols, so small stub libraries with the real sonames are
#   generated from cudarc's own bindings; at run time the loader finds the real libraries (the
#   driver's libcuda.so.1, the CUDA or PyTorch wheels' libs).
#
# Exports PATH (nvcc), CUDA_ROOT (headers and stubs), CUDA_COMPUTE_CAP. attnkit's plain `cuda`
# feature needs none of this: it loads the driver and NVRTC at run time.
# CUDA_TOOLKIT_VERSION picks the wheels (default 13.0.*, the CUDA cudarc is built against).
# Safe to source: it never exits the calling shell.
_attnkit_cuda_toolkit() {
  local ver=${CUDA_TOOLKIT_VERSION:-13.0.*}
  local dir=${CUDA_TOOLKIT_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/attnkit-cuda-toolkit}
  local py
  py=$(command -v python3 || command -v python) || { echo "cuda-toolkit: python3 not found" >&2; return 1; }
  local root="$dir/nvidia/cu13"
  if [[ ! -x $root/bin/nvcc || ! -x $root/nvvm/bin/cicc || ! -e $root/include/nv/target ]]; then
    rm -rf "$dir"
    # One pip call: separate --target installs into one folder would not merge nvidia/cu13.
    "$py" -m pip install --quiet --no-deps --target "$dir" "nvidia-cuda-nvcc==$ver" "nvidia-cuda-runtime==$ver" \
      "nvidia-cuda-crt==$ver" "nvidia-cuda-cccl==$ver" "nvidia-nvvm==$ver" >&2 ||
      { echo "cuda-toolkit: pip could not install the CUDA $ver compiler wheels" >&2; return 1; }
  fi
  # cudarc's bindings: where the stub symbols come from.
  local cudarc
  cudarc=$(cargo metadata --format-version 1 --all-features 2>/dev/null | "$py" -c '
import json, os, sys
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == "cudarc":
        print(os.path.dirname(p["manifest_path"])); break')
  if [[ -z $cudarc ]]; then
    echo "cuda-toolkit: cudarc's source not found (run from the attnkit checkout)" >&2
    return 1
  fi
  local cc=${CC:-cc}
  mkdir -p "$root/lib/stubs"
  local lib soname sys
  for spec in cuda:libcuda.so.1:driver nvrtc:libnvrtc.so.13:nvrtc cublas:libcublas.so.13:cublas \
    cublasLt:libcublasLt.so.13:cublaslt curand:libcurand.so.10:curand; do
    IFS=: read -r lib soname sys <<<"$spec"
    local out="$root/lib/stubs/lib$lib.so"
    [[ -f $out && $out -nt $cudarc/src/$sys/sys/mod.rs ]] && continue
    grep -oE '^pub unsafe fn [A-Za-z0-9_]+' "$cudarc/src/$sys/sys/mod.rs" | awk '{print $4}' | sort -u | awk '{print "void " $1 "(void) {}"}' \
      >"$root/lib/stubs/stub_$lib.c"
    "$cc" -shared -fPIC -Wl,-soname,"$soname" -o "$out" "$root/lib/stubs/stub_$lib.c" ||
      { echo "cuda-toolkit: could not build the $lib link stub" >&2; return 1; }
  done
  # candle-kernels also links a static library of its own to the CUDA runtime: the real one, by
  # its unversioned name.
  ln -sf "$root/lib/libcudart.so.13" "$root/lib/stubs/libcudart.so"
  export PATH="$root/bin:$PATH"
  export CUDA_ROOT="$root"
  export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
  echo "cuda-toolkit: $(nvcc --version | tail -n 2 | head -n 1); CUDA_ROOT=$root (link stubs), CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP"
}
_attnkit_cuda_toolkit
