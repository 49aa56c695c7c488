//! Dropout on the attention weights from a counter-based generator: whether
//! pair (batch, head, query, key) keeps its weight is a pure function of
//! the call's seed and the pair's index, so the forward draws the mask a
//! tile at a time and the backward draws the same one again, and no
//! `(q_len, kv_len)` mask is ever held.
//!
//! Query row `r` (`(batch · heads + head) · q_len + query`) takes a 32-bit
//! key, the high half of SplitMix64's output at that position of the
//! stream the seed starts (Steele, Lea and Flood, "Fast splittable
//! pseudorandom number generators", 2014): `mix64(seed + (r + 1) · γ)`.
//! Key `j` of the row then takes the bits `mix32(key ⊕ j · γ₃₂)` (Chris
//! Wellons' `lowbias32` as `mix32`), 32-bit operations that vectorise on
//! every instruction set. A pair keeps its weight, scaled by `1 / (1 −
//! p)`, where its bits are at least `p · 2³²`, as PyTorch's dropout keeps
//! an element with probability `1 − p` and scales it so.

use candle::{bail, Device, Result, Tensor};

use crate::runtime::isa::Isa;

/// SplitMix64's increment, the golden ratio's fraction in 64 bits.
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;
/// The same in 32 bits.
const GAMMA32: u32 = 0x9e37_79b9;

/// Dropout of probability `p` on the attention weights of one call, its
/// mask drawn from `seed` (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropout {
    p: f32,
    seed: u64,
    /// A pair keeps its weight where its 32 bits are at least this.
    threshold: u32,
    /// `1 / (1 − p)`.
    scale: f32,
}

impl Dropout {
    /// Dropout of probability `p`, in `[0, 1)`, with the mask that `seed`
    /// draws.
    pub fn new(p: f32, seed: u64) -> Result<Self> {
        if !(0.0..1.0).contains(&p) {
            bail!("attention dropout: the probability must be in [0, 1), found {p}")
        }
        Ok(Self {
            p,
            seed,
            threshold: (p as f64 * 4_294_967_296.) as u32,
            scale: 1. / (1. - p),
        })
    }

    /// The probability that a weight is dropped.
    pub fn p(&self) -> f32 {
        self.p
    }

    /// The seed the mask is drawn from.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Whether key `j` of query row `row` (`(batch · heads + head) · q_len
    /// + query`) keeps its weight.
    pub fn keeps(&self, row: u64, j: usize) -> bool {
        bits(self.row_key(row), j as u32) >= self.threshold
    }

    /// The factors the weights are multiplied by, `(batch, heads, q_len,
    /// kv_len)` f32: `1 / (1 − p)` where a pair keeps its weight, else 0.
    /// What a path that holds the weights applies to get the kernel's
    /// result, and what tests compare with.
    pub fn factors(&self, (b, h, l, s): (usize, usize, usize, usize), device: &Device) -> Result<Tensor> {
        let mut f = vec![1f32; b * h * l * s];
        for (row, xs) in f.chunks_exact_mut(s.max(1)).enumerate() {
            self.apply(Isa::Portable, row as u64, 0, xs);
        }
        Tensor::from_vec(f, (b, h, l, s), device)
    }

    /// Drops the weights of keys `j0..j0 + xs.len()` of query row `row`
    /// from `xs` and scales the others, on `isa` (at most what the
    /// processor runs): a dropped weight becomes 0 (set, whatever it was).
    #[inline]
    pub(crate) fn apply(&self, isa: Isa, row: u64, j0: usize, xs: &mut [f32]) {
        let args = (self.row_key(row), j0 as u32, self.threshold, self.scale);
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f")]
            unsafe fn avx512(xs: &mut [f32], args: (u32, u32, u32, f32)) {
                drop_impl(xs, args)
            }
            #[target_feature(enable = "avx2")]
            unsafe fn avx2(xs: &mut [f32], args: (u32, u32, u32, f32)) {
                drop_impl(xs, args)
            }
            match isa {
                // SAFETY: `isa` never exceeds what the processor runs.
                Isa::Avx512 | Isa::Avx512Bf16 => return unsafe { avx512(xs, args) },
                // SAFETY: as above.
                Isa::Avx2 => return unsafe { avx2(xs, args) },
                Isa::Portable => {}
            }
        }
        let _ = isa;
        drop_impl(xs, args)
    }

    /// Query row `row`'s key (see the module doc).
    fn row_key(&self, row: u64) -> u32 {
        let mut z = self.seed.wrapping_add(row.wrapping_add(1).wrapping_mul(GAMMA));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 32) as u32
    }
}

/// The bits of key `j` of the row whose key is `key`.
#[inline(always)]
fn bits(key: u32, j: u32) -> u32 {
    let mut x = key ^ j.wrapping_mul(GAMMA32);
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// [`Dropout::apply`]'s loop, `(key, j0, threshold, scale)`: a select per
/// element, so that it vectorises.
#[inline(always)]
fn drop_impl(xs: &mut [f32], (key, j0, threshold, scale): (u32, u32, u32, f32)) {
    for (c, x) in xs.iter_mut().enumerate() {
        let kept = bits(key, j0.wrapping_add(c as u32)) >= threshold;
        *x = if kept { *x * scale } else { 0. };
    }
}

#[cfg(test)]
mod tests {
    use super::Dropout;
    use crate::runtime::isa::supported;

    /// The pairs of 400 rows of 500 keys: `(row, key)`.
    fn pairs() -> impl Iterator<Item = (u64, usize)> {
        (0..400u64).flat_map(|r| (0..500).map(move |j| (r, j)))
    }

    /// The share of pairs kept is `1 − p` within a few standard
    /// deviations; two seeds, two neighbouring rows, two neighbouring keys
    /// agree as independent draws do; one seed always draws the same
    /// mask.
    #[test]
    fn keeps_one_minus_p_and_is_a_function_of_seed_and_pair() {
        let n = pairs().count() as f64;
        let share = |f: &dyn Fn(u64, usize) -> bool| pairs().filter(|&(r, j)| f(r, j)).count() as f64 / n;
        for p in [0.1f32, 0.5, 0.9] {
            let a = Dropout::new(p, 7).unwrap();
            let kept = share(&|r, j| a.keeps(r, j));
            let sd = (p as f64 * (1. - p as f64) / n).sqrt();
            assert!((kept - (1. - p as f64)).abs() < 5. * sd, "p {p}: kept {kept}");
            // Two independent draws agree with probability p² + (1 − p)².
            let agree = (p * p + (1. - p) * (1. - p)) as f64;
            let b = Dropout::new(p, 8).unwrap();
            for (what, same) in [
                ("seeds 7 and 8", share(&|r, j| a.keeps(r, j) == b.keeps(r, j))),
                (
                    "rows r and r + 1",
                    share(&|r, j| a.keeps(r, j) == a.keeps(r + 1, j)),
                ),
                (
                    "keys j and j + 1",
                    share(&|r, j| a.keeps(r, j) == a.keeps(r, j + 1)),
                ),
            ] {
                assert!((same - agree).abs() < 0.01, "p {p}: {what} agree on {same}");
            }
            let again = Dropout::new(p, 7).unwrap();
            assert!(pairs().all(|(r, j)| a.keeps(r, j) == again.keeps(r, j)));
        }
        let none = Dropout::new(0., 3).unwrap();
        assert!(pairs().all(|(r, j)| none.keeps(r, j)));
        assert!(Dropout::new(1., 0).is_err() && Dropout::new(-0.1, 0).is_err());
    }

    /// `apply` scales kept weights by `1 / (1 − p)` and zeroes the others,
    /// a NaN one too, on every instruction set, as `keeps` says.
    #[test]
    fn apply_scales_kept_and_zeroes_dropped() {
        let d = Dropout::new(0.5, 11).unwrap();
        for isa in supported() {
            let mut row = vec![f32::NAN; 67];
            row[..32].fill(0.25);
            d.apply(isa, 9, 100, &mut row);
            for (c, x) in row.iter().enumerate() {
                match (d.keeps(9, 100 + c), c < 32) {
                    (false, _) => assert_eq!(*x, 0., "{isa:?} key {c}"),
                    (true, true) => assert_eq!(*x, 0.5, "{isa:?} key {c}"),
                    (true, false) => assert!(x.is_nan(), "{isa:?} key {c}"),
                }
            }
            assert!(row.contains(&0.) && row.contains(&0.5));
        }
    }
}
