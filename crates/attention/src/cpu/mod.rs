//! The memory-efficient CPU attention kernel.
//!
//! FlashAttention's algorithm (Dao et al., 2022) on the CPU: queries are cut
//! into blocks of rows, keys into blocks of columns; each query block keeps a
//! running row max, row sum and output accumulator, so the `(q_len, kv_len)`
//! score matrix never exists, only one `(BLOCK_Q, BLOCK_K)` tile per thread.
//! The two products per tile go, on x86-64 with AVX2 but no AVX-512, through
//! register-blocked micro-kernels over packed keys and values (`avx2.rs`);
//! elsewhere through the `gemm` crate (the one candle's CPU matmul uses, here
//! with its AVX-512 kernels enabled). The softmax goes through a vectorised
//! `exp` compiled for the best instruction set the processor has. Work is
//! spread over rayon's pool by (batch, head, query block).
//!
//! Inputs are read in place through their strides (only the last dim must be
//! contiguous), so `(batch, seq, heads, head_dim)` views from a projection
//! need no transposing copy; the output is written as
//! `(batch, q_len, heads, v_head_dim)`, the layout the output projection
//! wants.
//!
//! The files, one concept each:
//! - `attention.rs`: the tiled attention (work units, masks by parts,
//!   the `gemm`-tile path and the dispatch to the AVX2 tiles);
//! - `linear.rs`: linear layers packed once ([`crate::PackedLinear`]);
//! - `simd.rs`: softmax, `exp`, mask rows, GELU, compiled per ISA;
//! - `avx2.rs`: the AVX2+FMA micro-kernels (attention tiles and linears),
//!   and the packed unit both tile kinds share;
//! - `avx512.rs`: the AVX-512F attention tile micro-kernels;
//! - `isa.rs`: the one place that picks the instruction set
//!   (`MULTIHEAD_CPU_ISA=avx512|avx2|portable` caps it).

mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub(crate) mod isa;
pub(crate) mod linear;
mod simd;

pub(crate) use attention::{sdpa_cpu, supports};

/// Helpers of the crate's unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use candle::{Device, Result, Tensor};

    pub(crate) fn randn(shape: &[usize]) -> Result<Tensor> {
        Tensor::randn(0f32, 1., shape, &Device::Cpu)
    }

    /// Largest difference over the expected tensor's largest magnitude.
    pub(crate) fn rel_err(a: &Tensor, b: &Tensor) -> Result<f32> {
        let diff = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        let scale = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?.max(1e-30);
        Ok(diff / scale)
    }
}
