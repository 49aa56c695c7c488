//! Whether a config's sizes can fit in a file at all: a `depth: 300000`
//! or a `max_positions` near `usize::MAX` beside a 500 KB file is refused
//! in microseconds, naming the size, instead of building (or overflowing)
//! first. A decoder's constructor is checked as it is recorded, within
//! the file's [`Checkpoint::budget`]; the models whose constructors build
//! tables from their config before they ask for a tensor (a ViT's or a
//! seq2seq model's positions) are checked from their config's arithmetic
//! first ([`MinWeights`], [`Checkpoint::ensure_holds`]).

use candle::{bail, Result};
use candle_nn::VarBuilder;

use super::file::Checkpoint;
use crate::formats::preflight::{wanted_tensors, Budget, CAPACITY_SLACK};

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

    /// The weights the model of `layers` layers that `build(n, vb)` builds
    /// with `n` layers asks for, every tensor counted: its constructor
    /// recorded with one layer and with two (every layer asks for the
    /// same tensors), the rest multiplied out with checked arithmetic.
    pub(crate) fn recorded<T>(
        owner: &str,
        layers: usize,
        build: impl Fn(usize, VarBuilder) -> Result<T>,
    ) -> Result<Self> {
        let weights = |n: usize| -> Result<usize> {
            let wanted = wanted_tensors(&[], |vb| build(n, vb))?;
            wanted
                .iter()
                .try_fold(0usize, |sum, w| {
                    checked_product(&w.shape).and_then(|n| sum.checked_add(n))
                })
                .ok_or_else(|| candle::Error::Msg(format!("{owner}: the number of weights overflows")))
        };
        let (one, two) = (weights(1)?, weights(2)?);
        let per_layer = two.saturating_sub(one);
        let mut m = Self::new(owner);
        m.add("outside the layers", &[one.saturating_sub(per_layer)])?;
        m.add(
            format!("layers ({layers} x {per_layer} each)"),
            &[layers, per_layer],
        )?;
        Ok(m)
    }
}

/// `factors` multiplied out, or `None` on overflow.
pub fn checked_product(factors: &[usize]) -> Option<usize> {
    factors.iter().try_fold(1usize, |n, &f| n.checked_mul(f))
}

impl Checkpoint {
    /// What a recording of the model the config `owner` describes may ask
    /// of this file ([`Budget`]): twice its weights.
    pub fn budget(&self, owner: &str) -> Budget {
        Budget::new(owner, self.label(), self.total_params(), self.tensors().len())
    }

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
