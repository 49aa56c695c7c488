//! Whether a config's sizes can fit in a file at all, decided from the
//! config's arithmetic before any model is built: a `depth: 300000` or a
//! `max_positions` near `usize::MAX` beside a 500 KB file is refused in
//! microseconds, naming the size, instead of building (or overflowing)
//! first.

use candle::{bail, Result};

use super::file::Checkpoint;

/// How many times the weights a file holds a config may ask for and still
/// be compared tensor by tensor. A config one layer or one width off gets
/// the full list of what is missing; one that asks for more cannot
/// describe the file, and recording its model would cost time and memory
/// in proportion to the config rather than the file.
pub(crate) const CAPACITY_SLACK: usize = 2;

/// The fewest weights any checkpoint of a config stores, part by part,
/// computed with checked arithmetic (an overflow is an error naming the
/// part).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MinWeights {
    owner: String,
    parts: Vec<(String, usize)>,
    total: usize,
}

impl MinWeights {
    /// An empty count for the config named `owner` (`"VitConfig"`, ...).
    pub fn new(owner: impl Into<String>) -> Self {
        Self {
            owner: owner.into(),
            parts: Vec::new(),
            total: 0,
        }
    }

    /// Adds the product of `factors` weights for the part `what`.
    pub fn add(&mut self, what: impl Into<String>, factors: &[usize]) -> Result<&mut Self> {
        let what = what.into();
        let Some(n) = checked_product(factors) else {
            bail!(
                "{}: {what} overflows ({} weights)",
                self.owner,
                factors
                    .iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join(" x ")
            )
        };
        let Some(total) = self.total.checked_add(n) else {
            bail!("{}: the total number of weights overflows at {what}", self.owner)
        };
        self.total = total;
        self.parts.push((what, n));
        Ok(self)
    }

    /// The total.
    pub fn total(&self) -> usize {
        self.total
    }

    /// The largest part and its weights.
    pub fn largest(&self) -> Option<(&str, usize)> {
        self.parts
            .iter()
            .max_by_key(|(_, n)| *n)
            .map(|(w, n)| (w.as_str(), *n))
    }
}

/// `factors` multiplied out, or `None` on overflow.
pub fn checked_product(factors: &[usize]) -> Option<usize> {
    factors.iter().try_fold(1usize, |n, &f| n.checked_mul(f))
}

impl Checkpoint {
    /// Refuses a config whose model needs more than twice the weights this
    /// file holds; call it before building (or pre-flighting) the model.
    pub fn ensure_holds(&self, min: &MinWeights) -> Result<()> {
        let have = self.total_params();
        if min.total() <= have.saturating_mul(CAPACITY_SLACK) {
            return Ok(());
        }
        let (what, n) = min.largest().unwrap_or(("", 0));
        bail!(
            "{} describes a model of at least {} weights ({what}: {n}), but '{}' holds {have}: \
             a size in the config is larger than this file can hold",
            min.owner,
            min.total(),
            self.label()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_and_excess_are_named() -> Result<()> {
        let mut m = MinWeights::new("Cfg");
        m.add("a", &[3, 4])?.add("b", &[5])?;
        assert_eq!(m.total(), 17);
        assert_eq!(m.largest(), Some(("a", 12)));
        let err = m.add("huge", &[usize::MAX, 2]).unwrap_err().to_string();
        assert!(err.contains("Cfg: huge overflows"), "{err}");
        let mut m = MinWeights::new("Cfg");
        m.add("big", &[usize::MAX])?;
        let err = m.add("more", &[1]).unwrap_err().to_string();
        assert!(err.contains("overflows at more"), "{err}");
        Ok(())
    }
}
