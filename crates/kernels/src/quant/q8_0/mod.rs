//! Linear layers with 8-bit weights in llama.cpp's Q8_0 format, computed
//! as llama.cpp's `ggml_vec_dot_q8_0_q8_0` computes them.
//!
//! # Numerics
//! Each output feature's row of `k` weights is cut into blocks of 32
//! (`k` a multiple of 32), and each block quantized as llama.cpp's
//! `quantize_row_q8_0_ref` does: `d = max|w| / 127`, kept as f16 (round to
//! nearest), and `q = round(w · (1 / d))` in `i8` (ties away from zero,
//! C's `roundf`; `1 / d` in f32 from the unrounded `d`, and 0 where `d`
//! is). The inputs' rows are quantized the same way at every call. Then
//!
//! `y[r][j] = bias[j] + Σ_b (d_w · d_x) · isum_b`, `isum_b = Σ_{i ∈ b}
//! q_w[i] · q_x[i]`,
//!
//! the integer dot exact in i32, each block's product and the running sum
//! rounded to f32 in block order (llama.cpp's `sumf += sumi * (d_x *
//! d_w)`), the bias added after the sum and a residual after that, as the
//! separate adds of a ggml graph. Every kernel below follows that order
//! (no fused multiply-add), so all of them give the same bits. A block
//! holding NaN gets a NaN scale, so the outputs it reaches are NaN; an
//! infinite weight or input zeroes its block's values, and its infinite
//! scale makes those outputs NaN (as in llama.cpp).
//!
//! # Layout
//! Panels of [`NR`] = 16 features. Panel `p`'s block `b` is 512 bytes at
//! `(p·nb + b)·512` (`nb = k / 32`): 8 groups of 4 inputs, 64 bytes each,
//! feature `c`'s 4 consecutive values at `4·c` of its group, so that one
//! `zmm` holds a group for the panel's 16 features, each lane the 4 bytes
//! `vpdpbusd` multiplies by 4 inputs broadcast to every lane (two `ymm`
//! halves for AVX2). The block's 16 scales are f16 at `(p·nb + b)·16` of
//! a second array. Features past `n` hold zeros. 34 bytes per 32 weights,
//! as Q8_0's blocks.
//!
//! # Kernels
//! Picked when the weight is quantized, for the instruction set it is built for (as for
//! the packed weights), each in its own file:
//! - `vnni.rs`: AVX-512 with AVX512-VNNI and AVX512BW; the weights are
//!   stored as `q + 128` for `vpdpbusd`'s unsigned operand, corrected by
//!   each input block's `-128 · Σ q_x`;
//! - `avx2.rs`: AVX2 (and AVX-512 without VNNI), `vpmaddubsw` on `|x|`
//!   and sign-applied weights;
//! - `portable.rs`: plain Rust.
//!
//! Each kernel's file also quantizes, one block in registers, to the
//! values `quantize_block` (`quantize.rs`, llama.cpp's reference rule)
//! gives bit for bit: the weights once, as they
//! are packed (in parallel over panels, each feature's row read in its
//! own dtype and its blocks written straight into the panel), and the
//! inputs once per call, in parallel over rows. A tile holds one
//! block's i32 sums in registers, then adds them to its f32 sums: one row
//! (a decoder's step) goes through a thread's run of panels one panel
//! after another in one call on VNNI, so that its weights come from memory
//! as one stream, each byte once; more rows take tiles of 4 rows by 2
//! panels on VNNI (2 by 1 on AVX2), so that each group of weights loaded
//! feeds every row of the tile.
//!
//! A call (`run.rs`) cuts the work into units of [`UNIT_PANELS`] panels
//! by [`UNIT_ROWS`] rows (one row: a run of panels per thread), spread
//! over the pool from [`PARALLEL_FROM`](crate::runtime::pool::PARALLEL_FROM)
//! multiply-adds on. A unit of several row groups cuts
//! the reduction into slices of [`SLICE_BLOCKS`] blocks: a tile's panel
//! slice stays in L1 while the unit's row groups pass it, and the unit's
//! running sums stay in a buffer of its own between slices (the blocks
//! still add in order). The bias and the residual are added as the unit
//! writes its outputs.

#[cfg(target_arch = "x86_64")]
mod avx2;
mod portable;
mod quantize;
mod run;
#[cfg(target_arch = "x86_64")]
mod vnni;

use candle::{bail, Result};
use half::f16;
use rayon::prelude::*;

use crate::elem::PanelElem;
use crate::runtime::isa::{has_vnni, runnable, Isa};
use crate::runtime::pool::par_chunks_mut;
use quantize::{quantize_block, QK};

/// Output features per panel.
const NR: usize = 16;
/// Bytes of one panel's block: 16 features by 32 inputs.
const BLOCK_BYTES: usize = NR * QK;
/// Panels per work unit of a call of several rows (64 features).
const UNIT_PANELS: usize = 4;
/// Rows per work unit, at most.
const UNIT_ROWS: usize = 32;
/// Blocks per slice of the reduction where a unit has several row
/// groups: a tile's two panels' slice (16 KiB) stays in L1 while the
/// unit's row groups pass it.
const SLICE_BLOCKS: usize = 16;
/// Inputs a task of the inputs' quantization takes, about (whole rows,
/// at least one): some microseconds of work.
const QUANTIZE_TASK: usize = 1 << 14;

/// The micro-kernel a weight is laid out for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Vnni,
}

impl Kernel {
    /// The kernel for `isa`, never past what the processor has.
    fn for_isa(isa: Isa) -> Kernel {
        match runnable(isa) {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 | Isa::Avx512Bf16 if has_vnni(isa) => Kernel::Vnni,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Bf16 | Isa::Avx512 | Isa::Avx2 => Kernel::Avx2,
            _ => Kernel::Portable,
        }
    }

    /// `(rows, panels)` of a tile (one row on VNNI goes through
    /// `vnni::one_row` instead).
    fn tile_shape(self) -> (usize, usize) {
        match self {
            Kernel::Portable => (portable::MR, portable::NP),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => (avx2::MR, avx2::NP),
            #[cfg(target_arch = "x86_64")]
            Kernel::Vnni => (vnni::MR, vnni::NP),
        }
    }

    /// The byte a value `q` is stored as: `q + 128` for `vpdpbusd`'s
    /// unsigned operand, else `q`'s bits.
    fn encode(self, q: i8) -> u8 {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Vnni => (q as u8) ^ 0x80,
            _ => q as u8,
        }
    }

    /// The value a stored byte holds.
    fn decode(self, byte: u8) -> i8 {
        self.encode(byte as i8) as i8
    }
}

/// A linear layer's weight `(n, k)` in Q8_0 blocks, laid out for one
/// kernel (see the module docs), and its bias in f32.
pub(crate) struct Q8Weight {
    /// The panels' values, from `start` on (64-byte aligned).
    qs: Vec<u8>,
    start: usize,
    /// The panels' block scales.
    d: Vec<f16>,
    bias: Option<Vec<f32>>,
    n: usize,
    k: usize,
    kernel: Kernel,
    /// The instruction set its calls' row passes (epilogues) run with.
    isa: Isa,
}

impl std::fmt::Debug for Q8Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Q8Weight")
            .field("out", &self.n)
            .field("in", &self.k)
            .field("bias", &self.bias.is_some())
            .field("kernel", &self.kernel)
            .finish()
    }
}

impl Q8Weight {
    /// Quantizes `w`, `n` rows of `k` values (f32, bf16 or f16, widened
    /// exactly), for the kernel of `isa` (capped at what the processor has) and by
    /// its instruction set (the same blocks whichever it is), with `bias`
    /// (`n` floats). `k` must be a positive multiple of 32, `n` positive.
    pub(crate) fn quantize<S: PanelElem>(
        w: &[S],
        n: usize,
        k: usize,
        bias: Option<&[f32]>,
        isa: Isa,
    ) -> Result<Self> {
        if k == 0 || !k.is_multiple_of(QK) {
            bail!("Q8Weight: in_features {k} is not a positive multiple of the block size {QK}")
        }
        if n == 0 {
            bail!("Q8Weight: out_features is 0")
        }
        if w.len() != n * k {
            bail!("Q8Weight: {} weights for ({n}, {k})", w.len())
        }
        if let Some(b) = bias.filter(|b| b.len() != n) {
            bail!("Q8Weight: bias of {} for {n} features", b.len())
        }
        let (isa, kernel) = (runnable(isa), Kernel::for_isa(isa));
        let (nb, panels) = (k / QK, n.div_ceil(NR));
        let mut qs = crate::runtime::pages::filled(panels * nb * BLOCK_BYTES + 63, kernel.encode(0));
        let start = qs.as_ptr().align_offset(64).min(63);
        let mut d = vec![f16::ZERO; panels * nb * NR];
        qs[start..start + panels * nb * BLOCK_BYTES]
            .par_chunks_mut(nb * BLOCK_BYTES)
            .zip(d.par_chunks_mut(nb * NR))
            .enumerate()
            .for_each(|(p, (qs, d))| {
                for c in 0..NR.min(n - p * NR) {
                    quantize_weight_row(kernel, &w[(p * NR + c) * k..][..k], c, qs, d);
                }
            });
        Ok(Q8Weight {
            qs,
            start,
            d,
            bias: bias.map(<[f32]>::to_vec),
            n,
            k,
            kernel,
            isa,
        })
    }

    /// The weight from ggml's `block_q8_0` bytes as a GGUF file stores a
    /// Q8_0 tensor (`n` rows of `k / 32` blocks: an f16 scale, then 32
    /// `i8`), laid out for the kernel of `isa` with `bias`: the blocks as
    /// they are, no float copy of the weight (the inverse of
    /// [`Q8Weight::blocks`]).
    pub(crate) fn from_blocks(
        data: &[u8],
        n: usize,
        k: usize,
        bias: Option<&[f32]>,
        isa: Isa,
    ) -> Result<Self> {
        const GGML_BLOCK: usize = 2 + QK;
        if k == 0 || !k.is_multiple_of(QK) || n == 0 || data.len() != n * k / QK * GGML_BLOCK {
            bail!(
                "Q8Weight: {} bytes do not hold ({n}, {k}) in Q8_0 blocks",
                data.len()
            )
        }
        if let Some(b) = bias.filter(|b| b.len() != n) {
            bail!("Q8Weight: bias of {} for {n} features", b.len())
        }
        let (isa, kernel) = (runnable(isa), Kernel::for_isa(isa));
        let (nb, panels) = (k / QK, n.div_ceil(NR));
        let mut qs = crate::runtime::pages::filled(panels * nb * BLOCK_BYTES + 63, kernel.encode(0));
        let start = qs.as_ptr().align_offset(64).min(63);
        let mut d = vec![f16::ZERO; panels * nb * NR];
        qs[start..start + panels * nb * BLOCK_BYTES]
            .par_chunks_mut(nb * BLOCK_BYTES)
            .zip(d.par_chunks_mut(nb * NR))
            .enumerate()
            .for_each(|(p, (qs, d))| {
                for c in 0..NR.min(n - p * NR) {
                    let row = &data[(p * NR + c) * nb * GGML_BLOCK..][..nb * GGML_BLOCK];
                    for (b, block) in row.chunks_exact(GGML_BLOCK).enumerate() {
                        d[b * NR + c] = f16::from_le_bytes([block[0], block[1]]);
                        let panel = &mut qs[b * BLOCK_BYTES..][..BLOCK_BYTES];
                        for (i, &q) in block[2..].iter().enumerate() {
                            panel[(i / 4) * 64 + c * 4 + i % 4] = kernel.encode(q as i8);
                        }
                    }
                }
            });
        Ok(Q8Weight {
            qs,
            start,
            d,
            bias: bias.map(<[f32]>::to_vec),
            n,
            k,
            kernel,
            isa,
        })
    }

    /// `(out_features, in_features)`.
    pub(crate) fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// The instruction set it runs with.
    pub(crate) fn isa(&self) -> Isa {
        self.isa
    }

    /// Its output features, then `other`'s, `other`'s panels and scales
    /// copied after its own as they are (the buffers grown in place where
    /// the allocator can; a missing bias as zeros); given back unchanged
    /// unless both are laid out for the same kernel over the same inputs
    /// and its features fill whole panels.
    pub(crate) fn join(mut self, other: &Self) -> std::result::Result<Self, Self> {
        let k = self.k;
        if self.kernel != other.kernel || other.k != k || !self.n.is_multiple_of(NR) {
            return Err(self);
        }
        let nb = k / QK;
        let (pa, pb) = (self.n / NR, other.n.div_ceil(NR));
        let (la, lb) = (pa * nb * BLOCK_BYTES, pb * nb * BLOCK_BYTES);
        let old = self.start;
        self.qs.truncate(old + la);
        // Exactly the joined size (a growing `Vec` would double a first
        // part larger than the second, q's before k's).
        self.qs
            .reserve_exact((63 + la + lb).saturating_sub(self.qs.len()));
        self.qs.resize(63 + la + lb, 0);
        let start = self.qs.as_ptr().align_offset(64).min(63);
        self.qs.copy_within(old..old + la, start);
        self.qs[start + la..][..lb].copy_from_slice(&other.panels()[..lb]);
        self.d.truncate(pa * nb * NR);
        self.d.reserve_exact(pb * nb * NR);
        self.d.extend_from_slice(&other.d[..pb * nb * NR]);
        let bias = match (self.bias, &other.bias) {
            (None, None) => None,
            (a, b) => {
                let mut bias = a.unwrap_or_else(|| vec![0.; self.n]);
                bias.extend_from_slice(b.as_deref().unwrap_or(&vec![0.; other.n]));
                Some(bias)
            }
        };
        Ok(Q8Weight {
            qs: self.qs,
            start,
            d: self.d,
            bias,
            n: self.n + other.n,
            k,
            kernel: self.kernel,
            isa: self.isa,
        })
    }

    /// Bytes held on the heap: the values, their scales and the bias.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.qs.capacity()
            + self.d.capacity() * size_of::<f16>()
            + self.bias.as_ref().map_or(0, |b| b.capacity() * 4)
    }

    fn panels(&self) -> &[u8] {
        &self.qs[self.start..]
    }

    /// Rows `ids` of the weight (each `< n`), one after another, each value
    /// `d · q` in f32: the lookup of an embedding table tied to this layer.
    pub(crate) fn rows(&self, ids: &[u32]) -> Vec<f32> {
        let (k, nb) = (self.k, self.k / QK);
        let mut out = vec![0f32; ids.len() * k];
        par_chunks_mut(&mut out, k, ids.len() * k, |i, row| {
            let (p, c) = (ids[i] as usize / NR, ids[i] as usize % NR);
            for (b, row) in row.chunks_exact_mut(QK).enumerate() {
                let block = &self.panels()[(p * nb + b) * BLOCK_BYTES..][..BLOCK_BYTES];
                let d = self.d[(p * nb + b) * NR + c].to_f32();
                for (i, y) in row.iter_mut().enumerate() {
                    *y = d * f32::from(self.kernel.decode(block[(i / 4) * 64 + c * 4 + i % 4]));
                }
            }
        });
        out
    }

    /// The weight in ggml's `block_q8_0` bytes, as a GGUF file stores a
    /// Q8_0 tensor: row by row, `k / 32` blocks a row, each 34 bytes, the
    /// scale `d` (f16, little-endian) then the 32 values `q` (`i8`).
    pub(crate) fn blocks(&self) -> Vec<u8> {
        const GGML_BLOCK: usize = 2 + QK;
        let nb = self.k / QK;
        let mut out = vec![0u8; self.n * nb * GGML_BLOCK];
        out.par_chunks_mut(nb * GGML_BLOCK)
            .enumerate()
            .for_each(|(j, row)| {
                let (p, c) = (j / NR, j % NR);
                for (b, block) in row.chunks_exact_mut(GGML_BLOCK).enumerate() {
                    let at = p * nb + b;
                    block[..2].copy_from_slice(&self.d[at * NR + c].to_le_bytes());
                    let src = &self.panels()[at * BLOCK_BYTES..][..BLOCK_BYTES];
                    for (i, q) in block[2..].iter_mut().enumerate() {
                        *q = self.kernel.decode(src[(i / 4) * 64 + c * 4 + i % 4]) as u8;
                    }
                }
            });
        out
    }

    /// The weight dequantized (`n` rows of `k` floats, `d · q`) and the
    /// bias.
    pub(crate) fn unpack(&self) -> (Vec<f32>, Option<Vec<f32>>) {
        let ids: Vec<u32> = (0..self.n as u32).collect();
        (self.rows(&ids), self.bias.clone())
    }
}

/// Quantizes `x` (rows of `q.len()` values, `d.len()` blocks a row) into
/// `q`, `d` and `off` ([`Quantized`]) with `kernel`'s instruction set:
/// the same values whichever it is.
fn quantize_rows(kernel: Kernel, x: &[f32], q: &mut [i8], d: &mut [f32], off: &mut [i32]) {
    assert!(x.len() == q.len() && q.len() == d.len() * QK && d.len() == off.len());
    match kernel {
        // SAFETY: the slices hold the extents (asserted above); the kernel
        // was picked for an instruction set the processor has.
        #[cfg(target_arch = "x86_64")]
        Kernel::Vnni => unsafe {
            vnni::quantize_row(
                x.as_ptr(),
                d.len(),
                q.as_mut_ptr(),
                d.as_mut_ptr(),
                off.as_mut_ptr(),
            )
        },
        // SAFETY: as above; the AVX2 kernel reads no offsets.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => unsafe { avx2::quantize_row(x.as_ptr(), d.len(), q.as_mut_ptr(), d.as_mut_ptr()) },
        Kernel::Portable => {
            let blocks = x.as_chunks::<QK>().0.iter().zip(q.as_chunks_mut::<QK>().0);
            for ((xb, qb), (d, off)) in blocks.zip(d.iter_mut().zip(off)) {
                let (scale, sum) = quantize_block(xb, qb);
                *d = f16::from_f32(scale).to_f32();
                *off = -128 * sum;
            }
        }
    }
}

/// Feature `c`'s row `w` of weights (`nb` blocks) quantized into its
/// panel's values `qs` (`nb` blocks of [`BLOCK_BYTES`]) and scales `d`
/// (`nb` blocks of [`NR`]), laid out for `kernel`, by its instruction set:
/// the same blocks whichever it is, each as [`quantize_block`] gives it.
fn quantize_weight_row<S: PanelElem>(kernel: Kernel, w: &[S], c: usize, qs: &mut [u8], d: &mut [f16]) {
    let nb = w.len() / QK;
    assert!(w.len() == nb * QK && qs.len() == nb * BLOCK_BYTES && d.len() == nb * NR && c < NR);
    match kernel {
        // SAFETY: the slices hold the extents (asserted above); the kernel
        // was picked for an instruction set the processor has.
        #[cfg(target_arch = "x86_64")]
        Kernel::Vnni => unsafe {
            vnni::quantize_weight_row(w.as_ptr(), nb, c, qs.as_mut_ptr(), d.as_mut_ptr().cast())
        },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => unsafe {
            avx2::quantize_weight_row(w.as_ptr(), nb, c, qs.as_mut_ptr(), d.as_mut_ptr().cast())
        },
        Kernel::Portable => portable::quantize_weight_row(w, c, qs, d),
    }
}

#[cfg(test)]
mod tests;
