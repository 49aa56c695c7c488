//! Linear layers over weights in ggml's block formats (Q4_0 … Q6_K) as a
//! GGUF file stores them: each output feature's row of blocks kept as its
//! bytes, never widened, and multiplied by inputs quantized per block
//! (`inputs.rs`) in the integer form of `format.rs`, as ggml's
//! `ggml_vec_dot_*` do.
//!
//! A call quantizes its input rows once, then cuts the output features
//! into tasks over the pool; a task takes its panels of 8 features
//! (`repack.rs`) one at a time and each panel block once for up to 8
//! input rows, so that a prefill's rows share the unpacking and a decode
//! step reads every weight byte once.
//!
//! Unlike Q8_0's kernels (`quant/q8_0/`), the vector and portable code
//! add the same integer sums in other orders of f32 operations: they agree
//! within float rounding, not bit for bit.
//!
//! # Kernels
//! One body for several formats, by family: the formats of 32 in panels
//! (Q4_0, Q4_1, Q5_0, Q5_1) share one (`avx2.rs`), Q4_K and Q5_K one and
//! Q6_K its own (`avx2_k.rs`), Q2_K and Q3_K one (`avx2_k23.rs`), each
//! written over its step and compiled for AVX2 (`vpmaddubsw`) and for
//! AVX512-VNNI on 256-bit vectors (`vpdpbusd`, `vnni.rs` runs those
//! instances, 8 rows at a time where AVX2 takes 4, 2 for the k-quants);
//! `portable.rs` computes every format (and alone Q8_0, kept in rows: its
//! layers take the Q8_0 kernels). `vnni.rs` imports the AVX2 files' VNNI
//! instances, `lanes.rs` their byte loads, scales and fifth bits, and the kernels
//! with rows in lanes `lanes.rs`' layouts, the only imports between ISA
//! files here; none imports a driver.
//!
//! A prefill of 16 rows or more through the panels takes other kernels
//! (`lanes.rs`): a task unpacks its panels once for all the rows, and the
//! inputs, laid out several rows to a vector (16 with AVX512-VNNI,
//! `vnni_lanes.rs`; 8 with AVX2, `avx2_lanes.rs`), meet each feature's
//! broadcast codes, with the same sums, so the same bits, as the panels'
//! kernels of the same instruction set.

/// `$kernel!` (a kernel body written over a step and a widening)
/// instantiated twice: `$avx2` with AVX2's step (`vpmaddubsw` into `i16`
/// sums, widened by `vpmaddwd`) and `$vnni` with AVX512-VNNI's
/// (`vpdpbusd` straight into `i32` sums) on 256-bit vectors.
#[cfg(target_arch = "x86_64")]
macro_rules! avx2_and_vnni {
    ($kernel:ident, $avx2:ident, $vnni:ident) => {
        $kernel!(
            $avx2,
            "avx2,fma,f16c",
            |s, u, x| _mm256_add_epi16(s, _mm256_maddubs_epi16(u, x)),
            |s| _mm256_madd_epi16(s, _mm256_set1_epi16(1)),
            true
        );
        $kernel!(
            $vnni,
            "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
            |s, u, x| _mm256_dpbusd_epi32(s, u, x),
            |s| s,
            false
        );
    };
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_k;
#[cfg(target_arch = "x86_64")]
mod avx2_k23;
#[cfg(target_arch = "x86_64")]
mod avx2_lanes;
mod format;
mod inputs;
#[cfg(target_arch = "x86_64")]
mod lanes;
mod portable;
mod quantize;
mod repack;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod vnni;
#[cfg(target_arch = "x86_64")]
mod vnni_lanes;

use candle::{bail, Result};
use rayon::prelude::*;

pub use format::{dequantize_row, BlockFormat};
use inputs::{quantize_inputs, InputRow};
use repack::{Layout, PANEL};

use crate::runtime::isa::{has_vnni_vl, runnable, Isa};
use crate::runtime::pool::{par_chunks_mut, par_for, threads, SyncPtr};

/// Output features a task takes (of a call of more than [`FEW_ROWS`]).
const TASK_FEATURES: usize = 16;
/// Input rows up to which a call gives each thread one run of features.
const FEW_ROWS: usize = 4;
/// Input rows from which the panels take the kernels with rows in lanes
/// (`lanes.rs`).
#[cfg(target_arch = "x86_64")]
const LANES_FROM: usize = 16;

/// The code a weight's products run with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX2's code, the panels with AVX512-VNNI's `vpdpbusd`.
    #[cfg(target_arch = "x86_64")]
    Vnni,
}

impl Kernel {
    /// The kernel for `isa`, never past what the processor has.
    fn for_isa(isa: Isa) -> Kernel {
        match runnable(isa) {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 | Isa::Avx512Bf16 if has_vnni_vl(isa) => Kernel::Vnni,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 | Isa::Avx512Bf16 => Kernel::Avx2,
            _ => Kernel::Portable,
        }
    }
}

/// A weight `(n, k)` in one block format: `n` rows of `k / block`
/// blocks, the bytes a GGUF file holds for it (the formats of 32
/// reordered into panels of 8 features, `repack.rs`), and its bias in f32.
#[derive(Clone)]
pub(crate) struct BlockWeight {
    format: BlockFormat,
    /// The blocks in parts of whole rows or panels, each with its first
    /// feature, in order: a joined weight keeps its parts' buffers, so
    /// that joining copies no weight and leaves no freed buffer behind.
    parts: Vec<(usize, Vec<u8>)>,
    /// Where the blocks are in panels, their layout.
    panels: Option<Layout>,
    bias: Option<Vec<f32>>,
    n: usize,
    k: usize,
    kernel: Kernel,
    /// The instruction set its calls' row passes (epilogues) run with.
    isa: Isa,
}

impl std::fmt::Debug for BlockWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockWeight")
            .field("format", &self.format)
            .field("out", &self.n)
            .field("in", &self.k)
            .field("bias", &self.bias.is_some())
            .field("kernel", &self.kernel)
            .finish()
    }
}

/// `ys` into `dst`, plus the bias's `b` and then the residual's `res`
/// where given (each at least as long): a whole panel's 8 outputs in
/// registers, as a copy of 8 floats (a copy of a length known only at
/// run time is a call to `memmove`, which a prompt's rows in lanes would
/// make once per row and panel).
fn put(dst: &mut [f32], ys: &[f32], b: Option<&[f32]>, res: Option<&[f32]>) {
    fn add(v: &mut [f32], more: Option<&[f32]>) {
        if let Some(more) = more {
            for (v, m) in v.iter_mut().zip(more) {
                *v += m;
            }
        }
    }
    match (
        <&mut [f32; PANEL]>::try_from(&mut *dst),
        <&[f32; PANEL]>::try_from(ys),
    ) {
        (Ok(dst), Ok(ys)) => {
            let mut v = *ys;
            add(&mut v, b);
            add(&mut v, res);
            *dst = v;
        }
        _ => {
            dst.copy_from_slice(ys);
            add(dst, b);
            add(dst, res);
        }
    }
}

impl BlockWeight {
    /// `data`, `n` rows of `k` weights in `format`'s blocks, with `bias`
    /// (`n` floats), for the kernel of `isa` (capped at what the processor has).
    pub(crate) fn new(
        format: BlockFormat,
        data: Vec<u8>,
        n: usize,
        k: usize,
        bias: Option<Vec<f32>>,
        isa: Isa,
    ) -> Result<Self> {
        let name = format.name();
        if n == 0 || k == 0 || !k.is_multiple_of(format.block_elems()) {
            bail!(
                "{name} weight ({n}, {k}): the input size must be a positive multiple of {}",
                format.block_elems()
            )
        }
        if data.len() != n * format.row_bytes(k) {
            bail!(
                "{name} weight ({n}, {k}): {} bytes, expected {}",
                data.len(),
                n * format.row_bytes(k)
            )
        }
        if let Some(b) = bias.as_ref().filter(|b| b.len() != n) {
            bail!("{name} weight ({n}, {k}): bias of {}", b.len())
        }
        let panels = Layout::of(format);
        let data = match panels {
            Some(l) => repack::repack(l, data, n, k / format.block_elems()),
            None => data,
        };
        Ok(BlockWeight {
            format,
            parts: vec![(0, data)],
            panels,
            bias,
            n,
            k,
            kernel: Kernel::for_isa(isa),
            isa: runnable(isa),
        })
    }

    /// `w`, `n` rows of `k` values (f32, bf16 or f16, widened exactly),
    /// quantized to `format` (Q4_0, Q5_0 or Q4_K) by ggml's reference
    /// rule (`quantize.rs`), in parallel over rows, with `bias`, for the
    /// kernel of `isa`. `k` must be a positive multiple of the format's
    /// block.
    pub(crate) fn quantize<S: crate::elem::PanelElem>(
        format: BlockFormat,
        w: &[S],
        n: usize,
        k: usize,
        bias: Option<&[f32]>,
        isa: Isa,
    ) -> Result<Self> {
        let quantize_row: fn(&[S], &mut [u8]) = match format {
            BlockFormat::Q4_0 => quantize::quantize_row_q4_0,
            BlockFormat::Q5_0 => quantize::quantize_row_q5_0,
            BlockFormat::Q4_K => quantize::quantize_row_q4_k,
            other => bail!(
                "{} weights are read from GGUF files, not quantized here",
                other.name()
            ),
        };
        let block = format.block_elems();
        if k == 0 || !k.is_multiple_of(block) || w.len() != n * k {
            bail!(
                "{} weight ({n}, {k}): {} values, the input size a positive multiple of {block}",
                format.name(),
                w.len()
            )
        }
        let rb = format.row_bytes(k);
        let mut data = vec![0u8; n * rb];
        data.par_chunks_mut(rb)
            .zip(w.par_chunks(k))
            .for_each(|(out, row)| quantize_row(row, out));
        Self::new(format, data, n, k, bias.map(<[f32]>::to_vec), isa)
    }

    /// `(out_features, in_features)`.
    pub(crate) fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// The instruction set it runs with.
    pub(crate) fn isa(&self) -> Isa {
        self.isa
    }

    /// Its block format.
    pub(crate) fn format(&self) -> BlockFormat {
        self.format
    }

    /// Blocks a row.
    fn nb(&self) -> usize {
        self.k / self.format.block_elems()
    }

    /// The part holding feature `j`, and `j` within it.
    fn part_of(&self, j: usize) -> (&[u8], usize) {
        let (first, data) = self
            .parts
            .iter()
            .rev()
            .find(|(first, _)| *first <= j)
            .expect("the first part starts at feature 0");
        (data, j - first)
    }

    /// Feature `j`'s blocks, where they are kept in rows.
    fn row(&self, j: usize) -> &[u8] {
        let rb = self.format.row_bytes(self.k);
        let (data, j) = self.part_of(j);
        &data[j * rb..][..rb]
    }

    /// Panel `p`'s blocks, where they are kept in panels (a part holds
    /// whole panels).
    fn panel(&self, l: Layout, p: usize) -> &[u8] {
        let pb = self.nb() * l.bytes();
        let (data, j) = self.part_of(p * PANEL);
        &data[j / PANEL * pb..][..pb]
    }

    /// Whether [`BlockWeight::join`] takes `other`: the same format, input
    /// size and kernel, and its features fill whole panels.
    pub(crate) fn joins(&self, other: &Self) -> bool {
        let whole_panels = self.panels.is_none() || self.n.is_multiple_of(PANEL);
        self.format == other.format && self.k == other.k && self.kernel == other.kernel && whole_panels
    }

    /// Its output features, then `other`'s (`other`'s parts taken as they
    /// are, a missing bias as zeros). Panics unless it
    /// [`joins`](BlockWeight::joins) `other`.
    pub(crate) fn join(mut self, other: Self) -> Self {
        assert!(self.joins(&other), "BlockWeight::join: {self:?} and {other:?}");
        let n = self.n;
        self.parts
            .extend(other.parts.into_iter().map(|(first, data)| (n + first, data)));
        self.bias = match (self.bias.take(), &other.bias) {
            (None, None) => None,
            (a, b) => {
                let mut bias = a.unwrap_or_else(|| vec![0.; self.n]);
                bias.extend_from_slice(b.as_deref().unwrap_or(&vec![0.; other.n]));
                Some(bias)
            }
        };
        self.n += other.n;
        self
    }

    /// Rows `ids` (each `< n`) dequantized, one after another: an
    /// embedding table's lookup.
    pub(crate) fn rows(&self, ids: &[u32]) -> Vec<f32> {
        let mut out = vec![0f32; ids.len() * self.k];
        let (format, nb, be) = (self.format, self.nb(), self.format.block_elems());
        par_chunks_mut(&mut out, self.k, ids.len() * self.k, |i, o| {
            let j = ids[i];
            match self.panels {
                Some(l) => {
                    let mut block = [0u8; 256];
                    let (data, j) = self.part_of(j as usize);
                    for (b, o) in o.chunks_exact_mut(be).enumerate() {
                        repack::block_of(l, data, nb, j, b, &mut block[..l.block]);
                        format::dequantize_block(format, &block[..l.block], o);
                    }
                }
                None => dequantize_row(format, self.row(j as usize), o),
            }
        });
        out
    }

    /// The weight dequantized (`n` rows of `k`) and the bias.
    pub(crate) fn unpack(&self) -> (Vec<f32>, Option<Vec<f32>>) {
        let ids: Vec<u32> = (0..self.n as u32).collect();
        (self.rows(&ids), self.bias.clone())
    }

    /// `x · wᵀ + b` for output features `lo..hi`, plus `residual` where
    /// given: `x` `m` rows of `k`, `residual` `m` rows of `hi - lo`; `m`
    /// rows of `hi - lo` back. Panics where `lo..hi` is not in `0..n` or a
    /// slice is short.
    pub(crate) fn forward(
        &self,
        x: &[f32],
        m: usize,
        (lo, hi): (usize, usize),
        residual: Option<&[f32]>,
    ) -> Vec<f32> {
        let (k, width) = (self.k, hi - lo);
        assert!(
            lo < hi && hi <= self.n,
            "BlockWeight: features {lo}..{hi} of {}",
            self.n
        );
        assert!(x.len() >= m * k && residual.is_none_or(|r| r.len() == m * width));
        let mut out = vec![0f32; m * width];
        if m == 0 {
            return out;
        }
        let xq = quantize_inputs(self.isa, &x[..m * k], m, k, self.format.block_elems());
        let rows = xq.rows();
        let out_ptr = SyncPtr(out.as_mut_ptr());
        // Writes row r's outputs for features j0.. from `ys`, with the
        // bias and the residual.
        let write = |r: usize, j0: usize, ys: &[f32]| {
            let at = r * width + j0 - lo;
            assert!(j0 >= lo && j0 + ys.len() <= hi && r < m);
            // SAFETY: columns j0 - lo.. of row r of the m × width output
            // are this task's alone (tasks take disjoint features).
            let dst = unsafe { out_ptr.slice_mut(at, ys.len()) };
            put(
                dst,
                ys,
                self.bias.as_ref().map(|b| &b[j0..]),
                residual.map(|r| &r[at..]),
            );
        };
        // Units: features, or panels of them. A few rows (a decode step):
        // one run of units a thread, so that each thread streams its part
        // of the weight from memory in order; more: tasks of
        // TASK_FEATURES, taken as threads free up.
        let (u_lo, u_hi, unit) = match self.panels {
            Some(_) => (lo / PANEL, hi.div_ceil(PANEL), PANEL),
            None => (lo, hi, 1),
        };
        let per_task = match m {
            ..=FEW_ROWS => (u_hi - u_lo).div_ceil(threads()).max(1),
            _ => TASK_FEATURES.div_ceil(unit),
        };
        let tasks = (u_hi - u_lo).div_ceil(per_task);
        #[cfg(target_arch = "x86_64")]
        let lanes = match (self.kernel, self.panels) {
            (Kernel::Vnni | Kernel::Avx2, Some(l)) if m >= LANES_FROM && lanes::takes(self.format) => {
                let n = match self.kernel {
                    Kernel::Vnni => vnni_lanes::LANES,
                    _ => avx2_lanes::LANES,
                };
                Some((l, lanes::LaneInputs::new(self.format, &rows, n)))
            }
            _ => None,
        };
        par_for(tasks, m * width * k, |t| {
            let units = u_lo + t * per_task..(u_lo + (t + 1) * per_task).min(u_hi);
            #[cfg(target_arch = "x86_64")]
            if let Some((l, x)) = &lanes {
                return self.panels_in_lanes(*l, units, x, (lo, hi), &write);
            }
            let mut ys = vec![0f32; m * unit];
            for u in units {
                match self.panels {
                    Some(l) => {
                        self.dot_panel(l, u, &rows, &mut ys);
                        // The panel's features inside lo..hi.
                        let (j0, j1) = ((u * PANEL).max(lo), ((u + 1) * PANEL).min(hi));
                        for (r, ys) in ys.chunks_exact(PANEL).enumerate() {
                            write(r, j0, &ys[j0 - u * PANEL..j1 - u * PANEL]);
                        }
                    }
                    None => {
                        self.dot_rows(u, &rows, &mut ys);
                        for (r, &y) in ys.iter().enumerate() {
                            write(r, u, &[y]);
                        }
                    }
                }
            }
        });
        out
    }

    /// Panels `units` times every input row through the kernels with rows
    /// in lanes (`lanes.rs`): each panel unpacked once, then each group of
    /// rows through them, its rows' outputs inside `lo..hi` to `write`.
    #[cfg(target_arch = "x86_64")]
    fn panels_in_lanes(
        &self,
        l: Layout,
        units: std::ops::Range<usize>,
        x: &lanes::LaneInputs,
        (lo, hi): (usize, usize),
        write: &(impl Fn(usize, usize, &[f32]) + Sync),
    ) {
        let (nb, rows, n) = (self.nb(), x.rows(), x.lanes);
        let unpacked: Vec<(usize, lanes::UnpackedPanel)> = units
            // SAFETY: the kernels with rows in lanes are chosen only where
            // the processor runs AVX2, FMA and F16C (`Kernel::for_isa`).
            .map(|u| {
                (u, unsafe {
                    lanes::unpack_panel(self.format, self.panel(l, u), nb)
                })
            })
            .collect();
        // The panel's outputs, feature by feature, a group's rows each.
        let mut ys = vec![0f32; PANEL * n];
        for g in 0..x.groups() {
            for (u, panel) in &unpacked {
                if self.kernel == Kernel::Vnni {
                    // SAFETY: `Kernel::Vnni` is chosen only where the processor
                    // runs AVX512-VNNI with AVX512-VL and BW (`isa::has_vnni_vl`).
                    unsafe { vnni_lanes::rows_in_lanes(self.format, panel, x, g, &mut ys) }
                } else {
                    // SAFETY: else `Kernel::Avx2` (the lanes are laid out for
                    // these two alone), chosen only where the processor runs
                    // AVX2, FMA and F16C.
                    unsafe { avx2_lanes::rows_in_lanes(self.format, panel, x, g, &mut ys) }
                }
                let (j0, j1) = ((u * PANEL).max(lo), ((u + 1) * PANEL).min(hi));
                let here = (g * n + n).min(rows) - g * n;
                for r0 in (0..here).step_by(8) {
                    // SAFETY: the kernels with rows in lanes run only where
                    // the processor runs AVX2 (`Kernel::for_isa`), so AVX.
                    let block = unsafe { lanes::rows_of(&ys, n, r0) };
                    for (r, row) in (g * n + r0..).zip(&block[..8.min(here - r0)]) {
                        write(r, j0, &row[j0 - u * PANEL..j1 - u * PANEL]);
                    }
                }
            }
        }
    }

    /// Panel `p`'s products with every input row, into `out` (8 a row).
    fn dot_panel(&self, l: Layout, p: usize, rows: &[InputRow], out: &mut [f32]) {
        let (panel, nb) = (self.panel(l, p), self.nb());
        match self.kernel {
            Kernel::Portable => portable::dot_panel(self.format, panel, nb, rows, out),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Kernel::Avx2` is chosen only where the processor
            // runs AVX2, FMA and F16C (`Kernel::for_isa`, `runtime/isa.rs`).
            Kernel::Avx2 => unsafe { avx2::dot_panel(self.format, panel, nb, rows, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Kernel::Vnni` is chosen only where the processor
            // runs AVX512-VNNI with AVX512-VL and BW (`isa::has_vnni_vl`).
            Kernel::Vnni => unsafe { vnni::dot_panel(self.format, panel, nb, rows, out) },
        }
    }

    /// Feature `j`'s products with every input row, into `out`.
    fn dot_rows(&self, j: usize, rows: &[InputRow], out: &mut [f32]) {
        // The format kept in rows (Q8_0, whose layers take the Q8_0
        // kernels) has no vector code here.
        portable::dot_rows(self.format, self.row(j), rows, out)
    }
}
