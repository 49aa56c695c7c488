//! ALiBi, attention with linear biases: a per-head penalty on the
//! distance between query and key, applied where the scores are.

use candle::{Device, Result, Tensor};

/// ALiBi's per-head slopes (Press et al., 2022, "Train short, test long").
///
/// Adds `slope_h · (j - (i + offset))` to the score of query `i` and key
/// `j` in head `h`, where `offset` is the causal rule's (bottom-right,
/// `kv_len - q_len`, without one): zero on the diagonal, more negative
/// the further back a key lies. This differs from BLOOM's `slope_h · j` by
/// a constant per query row, which the softmax cancels.
#[derive(Debug, Clone, PartialEq)]
pub struct Alibi {
    slopes: Vec<f32>,
}

impl Alibi {
    /// The paper's slopes for `num_heads` heads: `2^(-8k/n)` for
    /// `k = 1..=n` when `n` is a power of two; otherwise those of the
    /// largest power of two below, then every other slope of the next
    /// (as BLOOM's `build_alibi_tensor` and the reference code do).
    pub fn new(num_heads: usize) -> Self {
        let pow2 = |n: usize| -> Vec<f64> {
            let start = 2f64.powf(-8. / n as f64);
            (1..=n).map(|k| start.powi(k as i32)).collect()
        };
        let closest = if num_heads == 0 {
            0
        } else {
            1usize << (usize::BITS - 1 - num_heads.leading_zeros())
        };
        let mut slopes = pow2(closest);
        if closest < num_heads {
            slopes.extend(pow2(2 * closest).into_iter().step_by(2).take(num_heads - closest));
        }
        Self {
            slopes: slopes.into_iter().map(|s| s as f32).collect(),
        }
    }

    /// Explicit slopes, one per head.
    pub fn from_slopes(slopes: Vec<f32>) -> Self {
        Self { slopes }
    }

    /// The slopes, one per head.
    pub fn slopes(&self) -> &[f32] {
        &self.slopes
    }

    /// `(1, heads, q_len, kv_len)` f32: the bias as the reference path adds it.
    pub(crate) fn bias(&self, offset: isize, q_len: usize, kv_len: usize, device: &Device) -> Result<Tensor> {
        let data: Vec<f32> = self
            .slopes
            .iter()
            .flat_map(|&m| {
                (0..q_len).flat_map(move |i| {
                    (0..kv_len).map(move |j| m * (j as isize - i as isize - offset) as f32)
                })
            })
            .collect();
        Tensor::from_vec(data, (1, self.slopes.len(), q_len, kv_len), device)
    }
}
