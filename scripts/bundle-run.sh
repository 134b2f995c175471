#!/usr/bin/env bash
# Runs a bundle made by scripts/gpu-bundle.sh on a GPU machine. No Rust toolchain needed.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cmd=${1:-tests}
shift || true
echo "attnkit bundle $(cat "$here/COMMIT" 2>/dev/null) on $(hostname): $cmd $*"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
export RUST_BACKTRACE=1
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
  anchor)
    PYTHONUNBUFFERED=1 exec python3 "$here/torch_anchor.py" "$@" ;;
  sanitize)
    rc=0
    for tool in memcheck racecheck; do
      for t in "$here"/bin/*; do
        [[ $(basename "$t") == attnkit ]] && continue
        echo "=== compute-sanitizer --tool $tool $(basename "$t")"
        ATTNKIT_CASES=${ATTNKIT_CASES:-8} compute-sanitizer --tool "$tool" --error-exitcode 99 "$t" "$@" || rc=1
      done
    done
    exit $rc ;;
  *) echo "usage: run.sh tests|test NAME|bench|cli|anchor|sanitize [args]"; exit 2 ;;
esac
