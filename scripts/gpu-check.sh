#!/usr/bin/env bash
# The CUDA checks, in two halves: build here, run on the GPU machine.
#
#   scripts/gpu-check.sh build [--flash-attn]   # here: CUDA 13.0 nvcc from PyPI
#   scripts/gpu-check.sh run                    # there, from the repo root
#
# The GPU machine has CUDA 13.0's nvcc but no Rust toolchain and no
# network, so `build` compiles with `--features cuda` on this machine, with
# nvcc and its headers from NVIDIA's PyPI wheels in .venv-cuda, and puts the
# device test binary and the GPU benchmark in target/gpu-bundle (about 20
# MB, compressed). Carry that folder to the GPU machine and call `run` there: it runs
# crates/attention/tests/devices.rs (the PyTorch fixtures, every dtype of the default path, and
# a bf16 Llama-shaped attention's prefill and cached steps with a bf16 cache, on the GPU against
# the CPU reference) and examples/bench_gpu.rs (bf16: our
# dispatch, candle-flash-attn directly, the reference path), and prints the
# table last. With the device tool:
#
#   run(command="scripts/gpu-check.sh run", carry=["target/gpu-bundle"])
#
# `--flash-attn` also builds candle-flash-attn's kernels: CUTLASS headers
# come from the nvidia-cutlass 3.5 wheel (the pinned commit is CUTLASS 3.5)
# and are seeded where candle-flash-attn's build looks; its 53 kernels take
# an hour or more on two cores (cached in target/cuda afterwards). The CUDA
# build has its own target dir, target/cuda, so target/release (the CPU
# build, `multihead` included) is never touched.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bundle="$root/target/gpu-bundle"
cuda_target="$root/target/cuda"

build() {
  local features=cuda
  [ "${1:-}" = "--flash-attn" ] && features=cuda,flash-attn
  local venv="$root/.venv-cuda"
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
  fi
  # nvcc, the runtime and C++ library headers, and a matching NVVM (the
  # newest nvvm wheel emits PTX this ptxas refuses).
  "$venv/bin/pip" install -q "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" \
    "nvidia-cuda-crt==13.0.*" "nvidia-cuda-cccl==13.0.*" "nvidia-nvvm==13.0.*"
  local cuda
  cuda=$("$venv/bin/python" -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13"))')
  export PATH="$cuda/bin:$PATH" CUDA_ROOT="$cuda" CUDA_PATH="$cuda" CUDA_COMPUTE_CAP=90
  # A target dir of its own: CUDA builds of the crates in target/ would
  # replace the CPU builds (and the `multihead` binary the example builds)
  # with ones linked to libcuda.so.1 (unusable here). The first build there
  # compiles every dependency once more.
  export CARGO_TARGET_DIR="$cuda_target"
  if [ "$features" = cuda,flash-attn ]; then
    "$venv/bin/pip" install -q "nvidia-cutlass==3.5.*"
    local src commit=7d49e6c7e2f8896c47f586706e67e1fb215529dc
    src=$("$venv/bin/python" -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source"))')
    export CUDAFORGE_HOME="$root/target/cudaforge"
    local checkout="$CUDAFORGE_HOME/git/checkouts/cutlass-${commit:0:16}"
    if [ ! -f "$checkout/include/cutlass/cutlass.h" ]; then
      rm -rf "$checkout" && mkdir -p "$checkout"
      cp -r "$src/include" "$checkout/"
      git init -q "$checkout" && echo "$commit" >"$checkout/.git/HEAD"
    fi
  fi
  cd "$root"
  nvcc --version | tail -1
  # The first build stops at the link (no CUDA libraries here), once every
  # crate the stand-ins are made from is built, with the same features.
  cargo build --release --features "$features" --example bench_gpu 2>/dev/null || true
  link_stubs
  # cc hands LIBRARY_PATH to the linker; RUSTFLAGS would rebuild everything.
  export LIBRARY_PATH="$root/target/cuda-link-stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
  cargo build --release --features "$features" --example bench_gpu
  local tests
  tests=$(cargo test --release -p multihead-attention --features "$features" --test devices --no-run --message-format=json |
    sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
  # The kernels candle embeds make each binary ~50 MB: the device tool
  # carries 64 MiB, so they travel compressed.
  local stage="$root/target/gpu-stage"
  rm -rf "$bundle" "$stage" && mkdir -p "$bundle" "$stage"
  cp "$tests" "$stage/devices"
  cp "$CARGO_TARGET_DIR/release/examples/bench_gpu" "$stage/bench_gpu"
  strip "$stage/devices" "$stage/bench_gpu"
  echo "$features" >"$stage/features"
  tar czf "$bundle/bundle.tar.gz" -C "$stage" devices bench_gpu features
  du -sh "$bundle"
}

# candle links cuBLAS, cuRAND, NVRTC, the runtime and the driver
# (libcuda) by name, and this machine has none of them. Link against
# stand-ins with the real sonames and every CUDA symbol the built crates
# reference, so the binaries load the real libraries on the GPU machine.
link_stubs() {
  local dir="$root/target/cuda-link-stubs"
  rm -rf "$dir" && mkdir -p "$dir"
  local syms
  syms=$(for f in "$cuda_target"/release/deps/lib{cudarc,candle_core,candle_nn,candle_kernels,candle_flash_attn}-*.rlib \
    "$cuda_target"/release/build/candle-{kernels,flash-attn}-*/out/*.a; do
    if [ -f "$f" ]; then nm -u "$f" 2>/dev/null || true; fi
  done | awk '$1 == "U" {print $2}' | { grep -E '^(__cuda|cuda|cu[A-Z]|nvrtc|curand|cublas)' || true; } | sort -u)
  local lib soname pattern
  while read -r lib soname pattern; do
    grep -E "$pattern" <<<"$syms" | sed 's/.*/void &(void) {}/' >"$dir/$lib.c" || true
    cc -shared -fPIC -Wl,-soname,"$soname" -o "$dir/lib$lib.so" "$dir/$lib.c"
  done <<'LIBS'
cuda libcuda.so.1 ^cu[A-Z]
cudart libcudart.so.13 ^(__cuda|cuda)
nvrtc libnvrtc.so.13 ^nvrtc
curand libcurand.so.10 ^curand
cublas libcublas.so.13 ^cublas($|[^L]|L[^t])
cublasLt libcublasLt.so.13 ^cublasLt
LIBS
}

run() {
  [ -f "$bundle/bundle.tar.gz" ] || { echo "no $bundle: run 'scripts/gpu-check.sh build' first and carry it" >&2; exit 2; }
  local bin
  bin=$(mktemp -d)
  tar xzf "$bundle/bundle.tar.gz" -C "$bin"
  nvidia-smi -L || true
  echo "built with features: $(cat "$bin/features")"
  # The binaries need the driver, cuBLAS, cuRAND, NVRTC and the runtime:
  # put the image's copies (CUDA toolkit or PyTorch's wheels) on the
  # loader's path.
  local dirs="" lib
  for lib in libcuda.so.1 'libcublas.so*' 'libcurand.so*' 'libnvrtc.so*' 'libcudart.so*'; do
    dirs+=$(find /usr/local/nvidia /usr/local/cuda*/ /usr/lib/x86_64-linux-gnu /usr/lib64 /opt \
      -name "$lib" -printf '%h:' 2>/dev/null || true)
  done
  export LD_LIBRARY_PATH="${dirs}${LD_LIBRARY_PATH:-}"
  export MULTIHEAD_FIXTURES="$root/tests/fixtures" MULTIHEAD_REQUIRE_CUDA=1
  local status=0
  "$bin/devices" --test-threads 1 || status=$?
  "$bin/bench_gpu" || status=$?
  exit $status
}

case "${1:-}" in
  build) shift; build "$@" ;;
  run) run ;;
  *) sed -n '2,25p' "$0"; exit 2 ;;
esac
