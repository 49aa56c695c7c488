//! The random numbers sampling draws: SplitMix64 (Steele, Lea and Flood,
//! "Fast splittable pseudorandom number generators", OOPSLA 2014), written
//! out so that a seed gives the same output on every platform and version,
//! which no external crate promises.

/// A SplitMix64 stream.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    /// The stream of `seed`, row `row`: each row gets its own stream, so a
    /// row's samples do not depend on which other rows share its batch.
    pub(crate) fn for_row(seed: u64, row: u64) -> Self {
        let mut s = Self(seed);
        let base = s.next_u64();
        Self(base ^ row.wrapping_mul(0xD1B5_4A32_D192_ED03))
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`, 53 random bits.
    pub(crate) fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_sequence() {
        // The first outputs of SplitMix64 seeded with 0, from the reference
        // C code (Vigna, prng.di.unimi.it/splitmix64.c):
        // 0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4, 0x06c45d188009454f.
        let mut s = SplitMix64(0);
        assert_eq!(s.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(s.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(s.next_u64(), 0x06c4_5d18_8009_454f);
    }

    #[test]
    fn uniform_is_in_range_and_rows_differ() {
        let (mut a, mut b) = (SplitMix64::for_row(7, 0), SplitMix64::for_row(7, 1));
        let xs: Vec<f64> = (0..1000).map(|_| a.next_f64()).collect();
        assert!(xs.iter().all(|&x| (0.0..1.0).contains(&x)));
        let mean = xs.iter().sum::<f64>() / 1000.;
        assert!((mean - 0.5).abs() < 0.05, "mean {mean}");
        assert_ne!(a.next_u64(), b.next_u64());
    }
}
