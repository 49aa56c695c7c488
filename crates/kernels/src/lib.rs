//! CPU kernels for candle models: the building blocks under
//! `multihead-attention` and `multihead-models`.
//!
//! - [`PackedLinear`]: `torch.nn.Linear` with its weight packed once into
//!   the micro-kernels' panels, fused bias, GELU, ReLU or residual;
//! - [`LayerNorm`] (fused with a residual add) and [`RmsNorm`], [`relu`],
//!   [`silu_and_mul`] and [`silu_mul`] as PyTorch computes them, each one
//!   op with a backward of its own where it trains;
//! - [`attention::sdpa`]: a memory-efficient (FlashAttention-style)
//!   attention kernel over strided inputs, masks read in their own shapes,
//!   and its fused backward ([`attention::sdpa_backward`]);
//! - [`optim`]: candle-nn's `SGD` and `AdamW` updating each f32 CPU
//!   variable in place, one pass a step;
//! - [`isa`]: the one place that detects the instruction set;
//! - [`threads`]: the kernels run their calls' work on candle's own CPU
//!   pool (the threads its element-wise ops use), so that a model mixing
//!   candle's ops and these has one set of workers; [`with_threads`] cuts
//!   a thread's calls for fewer or more.
//!
//! # Layout
//! By operation first, the instruction sets underneath (as ggml-cpu), and
//! in each operation BLIS's split: packing, a driver that walks blocks
//! sized for L1 and L2, and register-blocked micro-kernels, one file per
//! instruction set (`avx2.rs`, `avx512.rs`, `avx512bf16.rs`, `vnni.rs`,
//! `portable.rs`). ISA files are leaves: they import element types,
//! layouts and lane types, never a driver; the one driver of each
//! operation picks among them at run time.
//! - `linear/`: [`PackedLinear`] and how a loader asks it to pack
//!   ([`PackOptions`]: the format, the instruction set, the blocks a GGUF
//!   file lends, [`LentBlocks`]); its weight packed into panels
//!   (`weight.rs`, `pack.rs`), the driver over row groups and panel blocks
//!   (`tiles.rs`, `units.rs`) or a single row (`one_row.rs`), a weight
//!   that trains, its forward and backward a candle op over that driver
//!   (`trained.rs`), and the linear micro-kernels (`avx2.rs`,
//!   `avx512.rs`; `avx512bf16.rs`, the AVX-512 kernels with `vdpbf16ps`
//!   for their step);
//! - `attention/`: [`attention::sdpa`] and its dispatch (`mod.rs`), the
//!   mask as it reads it (`mask.rs`), a call as its work units see it
//!   (`problem.rs`), the packed tiles' driver (`tiles.rs`), decode-sized
//!   products read in place (`decode.rs`), the attention micro-kernels
//!   (`avx2.rs`, `avx512.rs`), and the backward (`backward.rs`);
//! - `panel/`: the panel layout both share, and the AVX2 micro-kernel of
//!   rows by panels that both run;
//! - `quant/`: linear weights in quantized block formats, a folder per
//!   kernel family (`q8_0/`, `blocks/`; see its module doc);
//! - `rows/`: row operations (LayerNorm, activations, the online softmax,
//!   masks) written once over a vector type per instruction set
//!   (`lanes.rs`) or as plain Rust compiled for each (`simd.rs`);
//! - `runtime/`: the instruction set's detection ([`isa`]), work spread
//!   over the threads (`pool.rs`) and page-backed buffers (`pages.rs`);
//! - `elem.rs`: the element types of panels and caches (f32, bf16, f16),
//!   which the micro-kernels widen to f32 lanes as they load them;
//! - `optim.rs`: the optimizers' in-place steps.
//!
//! The instruction set is an argument, never ambient state: every kernel
//! that dispatches takes the [`isa::Isa`] it runs with, the public entry
//! points from their options ([`PackOptions`], [`attention::TileOptions`])
//! or [`isa::current`] (detected, capped by
//! `MULTIHEAD_CPU_ISA=avx512bf16|avx512|avx2|portable` for a whole
//! process). So every variant can be forced, two at once, and the tests
//! compare each one the processor runs ([`isa::supported`]) with the
//! reference path, in parallel.

#![warn(missing_docs)]

/// `$step!(i)` for `i` in `0..$n`: a step for each offset of the list
/// (`[0, 1]`, `[0, 1, 2, 3]`) an iteration of the loop, then the rest one
/// at a time: the micro-kernels' reduction loops, whose counter and
/// pointers then come once per iteration.
#[cfg(target_arch = "x86_64")]
macro_rules! unrolled {
    ($n:expr, [$($k:literal),+], $step:ident) => {{
        let (n, by) = ($n, [$($k),+].len());
        let mut i = 0;
        while i + by <= n {
            $($step!(i + $k);)+
            i += by;
        }
        while i < n {
            $step!(i);
            i += 1;
        }
    }};
}

/// `$f::<r, ..>(args)` for a group of `$rows` rows: the micro-kernel's
/// instance for each row count of the list, the full group's (`$mr`) for
/// any other.
#[cfg(target_arch = "x86_64")]
macro_rules! by_rows {
    ($rows:expr, [$($r:literal)+] else $mr:expr, $f:ident::<_ $(, $p:tt)*>($($arg:expr),*)) => {
        by_rows!(@match $rows, [$($r)+], $mr, $f, [$($p),*], ($($arg),*))
    };
    ($rows:expr, [$($r:literal)+] else $mr:expr, $f:ident($($arg:expr),*)) => {
        by_rows!(@match $rows, [$($r)+], $mr, $f, [], ($($arg),*))
    };
    (@match $rows:expr, [$($r:literal)+], $mr:expr, $f:ident, $p:tt, $args:tt) => {
        match $rows {
            $($r => by_rows!(@call $f, $r, $p, $args),)+
            _ => by_rows!(@call $f, { $mr }, $p, $args),
        }
    };
    (@call $f:ident, $r:tt, [$($p:tt),*], ($($arg:expr),*)) => {
        $f::<$r $(, $p)*>($($arg),*)
    };
}

pub mod attention;
mod elem;
mod linear;
pub mod optim;
#[cfg(target_arch = "x86_64")]
mod panel;
mod quant;
mod rows;
mod runtime;
#[cfg(test)]
mod testing;

pub use linear::{is_broadcast, LentBlocks, PackFormat, PackOptions, PackedLinear};
pub use quant::{dequantize_row, BlockFormat};
pub use rows::{gelu_tanh_and_mul, gelu_tanh_mul, relu, silu_and_mul, silu_mul, LayerNorm, RmsNorm};
pub use runtime::isa;
pub use runtime::pool::{threads, with_threads};

/// The instruction set the CPU kernels run with now: `"avx512bf16"`
/// (AVX-512F with AVX512-BF16: bf16 weights multiply inputs rounded to
/// bf16), `"avx512"` (AVX-512F), `"avx2"` (AVX2 and FMA) or `"portable"`;
/// the best the processor has, unless `MULTIHEAD_CPU_ISA` (one of those
/// names, read once) asks for less ([`isa::current`]); a layer or call
/// given another in its options runs with that one. Benchmarks print it
/// beside their figures.
pub fn cpu_isa() -> &'static str {
    isa::current().name()
}

/// The crate README's Rust snippets, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
