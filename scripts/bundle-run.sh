#!/usr/bin/env bash
# Runs a bundle made by scripts/gpu-bundle.sh on a GPU machine. No Rust toolchain needed.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# A bundle may carry its binaries as one xz archive (scripts/gpu-bundle.sh, COMPRESS=1).
if [[ -f $here/bins.tar.xz && ! -d $here/bin ]]; then
  tar -C "$here" -xJf "$here/bins.tar.xz" || { echo "could not unpack bins.tar.xz"; exit 2; }
fi
cmd=${1:-tests}
shift || true
echo "attnkit bundle $(cat "$here/COMMIT" 2>/dev/null) on $(hostname): $cmd $*"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
export RUST_BACKTRACE=1
# cudarc opens libnvrtc.so.13 (or libnvrtc.so) by name, and binaries built with `candle-cuda` are
# linked to libcublas, libcublasLt, libcurand and libnvrtc: put the CUDA (or PyTorch wheel) library
# folders on the loader path.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib $(python3 -c 'import nvidia, os, glob; print(" ".join(sorted({os.path.dirname(f) for p in nvidia.__path__ for f in glob.glob(os.path.join(p, "*", "lib", "lib*.so*"))})))' 2>/dev/null); do
  for lib in libnvrtc.so libcublas.so libcublasLt.so libcurand.so; do
    if compgen -G "$d/$lib*" >/dev/null; then
      export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      echo "CUDA libraries from $d"
      break
    fi
  done
done
case "$cmd" in
  tests)
    rc=0
    for t in "$here"/bin/*; do
      [[ $(basename "$t") == attnkit ]] && continue
      echo "=== $(basename "$t")"
      "$t" "$@" || rc=1
    done
    exit $rc ;;
  test)
    name=$1; shift
    exec "$here/bin/$name" "$@" ;;
  bench)
    exec "$here/bin/attnkit" bench "$@" ;;
  cli)
    exec "$here/bin/attnkit" "$@" ;;
  example)
    name=$1; shift
    exec "$here/examples/$name" "$@" ;;
  anchor)
    PYTHONUNBUFFERED=1 exec python3 "$here/torch_anchor.py" "$@" ;;
  sanitize)
    # Only the binaries that launch CUDA kernels: compute-sanitizer fails a program that makes no
    # CUDA call ("terminated before first instrumented API call"). Extra args filter the tests.
    rc=0
    for tool in memcheck racecheck; do
      for name in conformance cuda_graph cuda_backend; do
        t="$here/bin/$name"
        [[ -x $t ]] || continue
        args=("$@")
        [[ $name == conformance && $# -eq 0 ]] && args=("cuda::")
        # The split-KV tests force the tensor-core decode tile (bulk copies on Hopper).
        [[ $name == cuda_backend && $# -eq 0 ]] && args=("split_kv_tensor_core")
        echo "=== compute-sanitizer --tool $tool $name ${args[*]}"
        ATTNKIT_CASES=${ATTNKIT_CASES:-8} compute-sanitizer --tool "$tool" --error-exitcode 99 "$t" "${args[@]}" || rc=1
      done
    done
    exit $rc ;;
  *) echo "usage: run.sh tests|test NAME|bench|cli|example NAME|anchor|sanitize [args]"; exit 2 ;;
esac
