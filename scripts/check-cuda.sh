#!/usr/bin/env bash
# Type-checks the CUDA-gated code (`--features cuda,flash-attn`) on a machine
# without CUDA or network, in about a minute once dependencies are built.
#
#   scripts/check-cuda.sh
#
# candle-kernels' and candle-flash-attn's build scripts run nvcc even for
# `cargo check`, and candle-flash-attn's also clones CUTLASS. Here a stand-in
# nvcc (scripts/ci/nvcc-stub) answers as CUDA 13.0 and writes empty outputs,
# and an empty CUTLASS checkout at the pinned commit is seeded where the
# build's fetcher (cudaforge) looks, so no network is needed. Nothing built
# this way can run on a GPU: for that, see scripts/gpu-check.sh.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${CUDA_CHECK_DIR:-$root/target/cuda-check}
mkdir -p "$work/bin"
ln -sf "$root/scripts/ci/nvcc-stub" "$work/bin/nvcc"

# cudaforge reuses a checkout whose `include/` exists and whose HEAD is the
# pinned commit; candle-flash-attn 0.11.1 pins this one.
cutlass_commit=7d49e6c7e2f8896c47f586706e67e1fb215529dc
checkout="$work/cudaforge/git/checkouts/cutlass-${cutlass_commit:0:16}"
if [ ! -d "$checkout/include" ]; then
  mkdir -p "$checkout/include"
  git init -q "$checkout"
  echo "$cutlass_commit" > "$checkout/.git/HEAD"
fi

export PATH="$work/bin:$PATH" CUDA_COMPUTE_CAP=90 CUDAFORGE_HOME="$work/cudaforge"
export CARGO_TARGET_DIR="$work/target"
# The stand-in's empty outputs must not be mistaken for real kernels later.
rm -rf "$CARGO_TARGET_DIR"/debug/build/candle-kernels-* "$CARGO_TARGET_DIR"/debug/build/candle-flash-attn-*
cd "$root"
cargo check --workspace --all-targets --features cuda,flash-attn
echo "cuda and flash-attn code type-checks"
