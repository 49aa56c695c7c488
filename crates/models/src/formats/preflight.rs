//! What a model needs from a checkpoint, found by building it once
//! against a recording `VarBuilder` (within a [`Budget`] of the file's
//! weights: a config's sizes checked against the file by the constructor
//! that reads them), and the comparison with what the file holds: every
//! missing, unexpected, mis-shaped, non-float and non-finite tensor at
//! once, before any weight is loaded. Each format
//! fills the report from its own file: a safetensors file in
//! `safetensors/load.rs` ([`Preflight::check`]), a GGUF file by its
//! tensors' GGUF names in `gguf/load.rs`.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use candle::{DType, Device, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};
use serde::Serialize;

/// A tensor a model asks for: its name and shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Wanted {
    /// The checkpoint name.
    pub name: String,
    /// The shape the model expects.
    pub shape: Vec<usize>,
}

/// How many times the weights a file holds a model may ask for and still
/// be compared with it tensor by tensor. A config one layer or one width
/// off gets the full list of what is missing; one that asks for more
/// cannot describe the file, and recording its model would cost time and
/// memory in proportion to the config rather than the file.
pub(crate) const CAPACITY_SLACK: usize = 2;

/// How many more tensors than the file holds a model may ask for before
/// a recording gives up: a config a few layers off still gets its full
/// list of missing tensors.
const EXTRA_WANTED: usize = 256;

/// The most a model's recording ([`wanted_within`]) may ask of a file:
/// twice the weights it holds, and twice its tensors plus 256. The
/// model's constructor is the description of its tensors, so a config
/// whose sizes the file cannot hold is refused as it is recorded, at the
/// first tensor past the budget, before anything of the config's size is
/// built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budget {
    /// The config that describes the model (`LlamaConfig`), in errors.
    owner: String,
    /// The file, as its errors name it.
    file: String,
    /// The weights the file holds.
    held: usize,
    /// The tensors the file holds.
    held_tensors: usize,
}

impl Budget {
    /// The budget of the model the config `owner` describes against
    /// `file`, which holds `weights` weights in `tensors` tensors.
    pub fn new(owner: impl Into<String>, file: impl Into<String>, weights: usize, tensors: usize) -> Self {
        Self {
            owner: owner.into(),
            file: file.into(),
            held: weights,
            held_tensors: tensors,
        }
    }

    /// The most weights the model may ask for.
    pub fn weights(&self) -> usize {
        self.held.saturating_mul(CAPACITY_SLACK)
    }

    /// The most tensors the model may ask for (requests, a name asked
    /// twice counted twice).
    pub fn tensors(&self) -> usize {
        tensor_limit(self.held_tensors)
    }
}

/// The most requests a recording against a file of `held` tensors answers.
fn tensor_limit(held: usize) -> usize {
    held.saturating_mul(2).saturating_add(EXTRA_WANTED)
}

/// What a recording has been asked so far.
#[derive(Default)]
struct Asked {
    /// Every request, in order (a name asked twice is here twice).
    wanted: Vec<Wanted>,
    /// The names asked.
    seen: HashSet<String>,
    /// The weights of the names asked, each counted once.
    weights: usize,
}

/// Answers every `vb.get` with zeros (one element broadcast, so a large
/// model costs no memory) and writes down what was asked.
struct Recorder {
    present: HashSet<String>,
    asked: Arc<Mutex<Asked>>,
    /// The file's budget; without one, only the requests are bounded
    /// ([`tensor_limit`] of `present`), so that a config whose sizes the
    /// file cannot hold (`depth: 300000`) stops there instead of
    /// recording millions.
    budget: Option<Budget>,
}

impl SimpleBackend for Recorder {
    fn get(&self, s: Shape, name: &str, _h: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        let Some(n) = s.dims().iter().try_fold(1usize, |n, &d| n.checked_mul(d)) else {
            match &self.budget {
                Some(b) => candle::bail!(
                    "{} asks for '{name}' of shape {:?}, whose size overflows, but '{}' holds {}: a size in the \
                     config is larger than this file can hold",
                    b.owner,
                    s.dims(),
                    b.file,
                    b.held
                ),
                None => candle::bail!(
                    "the model asks for '{name}' of shape {:?}, whose size overflows: a size in its config is absurd",
                    s.dims()
                ),
            }
        };
        let mut asked = self
            .asked
            .lock()
            .map_err(|_| candle::Error::Msg("preflight: recorder poisoned".into()))?;
        match &self.budget {
            Some(b) if asked.wanted.len() >= b.tensors() => candle::bail!(
                "{} describes a model of more than {} tensors ('{name}' is one too many), but '{}' holds {}: \
                 a size in the config (layers, ...) is larger than this file can hold",
                b.owner,
                b.tensors(),
                b.file,
                b.held_tensors
            ),
            None if asked.wanted.len() >= tensor_limit(self.present.len()) => candle::bail!(
                "the model asks for more than {} tensors but the file holds {}: a size in its config \
                 (depth, layers, ...) is larger than this file can hold",
                tensor_limit(self.present.len()),
                self.present.len()
            ),
            _ => {}
        }
        if asked.seen.insert(name.to_string()) {
            let total = asked.weights.saturating_add(n);
            if let Some(b) = self.budget.as_ref().filter(|b| total > b.weights()) {
                candle::bail!(
                    "{} describes a model of at least {total} weights ('{name}' {:?}: {n}), but '{}' holds {}: \
                     a size in the config is larger than this file can hold",
                    b.owner,
                    s.dims(),
                    b.file,
                    b.held
                )
            }
            asked.weights = total;
        }
        asked.wanted.push(Wanted {
            name: name.to_string(),
            shape: s.dims().to_vec(),
        });
        Tensor::zeros(1, dtype, dev)?.broadcast_as(s)
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> Result<Tensor> {
        candle::bail!("preflight: the model asks for '{name}' without a shape, which cannot be checked")
    }

    fn contains_tensor(&self, name: &str) -> bool {
        // Optional parts follow the file, as they will when loading.
        self.present.contains(name)
    }
}

/// The tensors `build` asks for when it constructs its model, in order,
/// each once. `present` answers `vb.contains_tensor`.
///
/// Stops with an error when the model asks for more than twice as many
/// tensors as `present` holds, plus 256, or for a shape whose
/// size overflows: such a model cannot be in the file, and recording it
/// would cost time and memory in proportion to the config, not the file.
/// [`wanted_within`] also bounds the weights.
pub fn wanted_tensors<T>(
    present: &[&str],
    build: impl FnOnce(VarBuilder) -> Result<T>,
) -> Result<Vec<Wanted>> {
    record(present, None, build)
}

/// [`wanted_tensors`] within `budget`: the first tensor that takes the
/// model past the weights (or the requests) the file's budget allows is
/// an error naming the config, that tensor and the file, before the
/// constructor builds anything with it. The constructors ask for a
/// tensor before they allocate anything its sizes decide, so the
/// recording costs time and memory in proportion to the file.
pub fn wanted_within<T>(
    present: &[&str],
    budget: &Budget,
    build: impl FnOnce(VarBuilder) -> Result<T>,
) -> Result<Vec<Wanted>> {
    record(present, Some(budget.clone()), build)
}

fn record<T>(
    present: &[&str],
    budget: Option<Budget>,
    build: impl FnOnce(VarBuilder) -> Result<T>,
) -> Result<Vec<Wanted>> {
    let asked = Arc::new(Mutex::new(Asked::default()));
    let recorder = Recorder {
        present: present.iter().map(|s| s.to_string()).collect(),
        asked: asked.clone(),
        budget,
    };
    build(VarBuilder::from_backend(
        Box::new(recorder),
        DType::F32,
        Device::Cpu,
    ))?;
    let wanted = std::mem::take(
        &mut asked
            .lock()
            .map_err(|_| candle::Error::Msg("preflight: recorder poisoned".into()))?
            .wanted,
    );
    let mut seen = HashSet::new();
    Ok(wanted
        .into_iter()
        .filter(|w| seen.insert(w.name.clone()))
        .collect())
}

/// A tensor whose stored shape is not the one the model needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Misshaped {
    /// The checkpoint name.
    pub name: String,
    /// What the model needs.
    pub expected: Vec<usize>,
    /// What the file holds.
    pub found: Vec<usize>,
}

/// A tensor stored in a dtype that is not a float.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NotFloat {
    /// The checkpoint name.
    pub name: String,
    /// The stored dtype, e.g. `I64`.
    pub dtype: String,
}

/// A float tensor holding NaN or infinity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NonFinite {
    /// The checkpoint name.
    pub name: String,
    /// How many elements are NaN.
    pub nan: usize,
    /// How many elements are ±infinity.
    pub inf: usize,
}

/// How many entries of each kind [`Preflight::summary`] names.
pub(crate) const SUMMARY_ITEMS: usize = 20;

/// A checkpoint compared with what a model needs. The names it holds
/// print as they are: each name a file supplied is escaped
/// (`str::escape_debug`) as it is written down, so that no byte of a
/// stranger's file reaches a terminal through a report or its
/// [`Preflight::summary`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Preflight {
    /// Needed but absent.
    pub missing: Vec<Wanted>,
    /// In the file but not needed (PyTorch's `strict=True` refuses these).
    pub unexpected: Vec<String>,
    /// Present with another shape.
    pub misshaped: Vec<Misshaped>,
    /// Present but stored as integers or booleans.
    pub not_float: Vec<NotFloat>,
    /// Present, float, but with NaN or infinity.
    pub non_finite: Vec<NonFinite>,
}

impl Preflight {
    /// Whether nothing is wrong.
    pub fn is_clean(&self) -> bool {
        self.missing.is_empty()
            && self.unexpected.is_empty()
            && self.misshaped.is_empty()
            && self.not_float.is_empty()
            && self.non_finite.is_empty()
    }

    /// One line naming every problem (the first 20 of each kind, and how
    /// many more), or `None` when clean.
    pub fn summary(&self) -> Option<String> {
        fn list<T>(out: &mut Vec<String>, what: &str, items: &[T], show: impl Fn(&T) -> String) {
            if !items.is_empty() {
                let mut shown: Vec<String> = items.iter().take(SUMMARY_ITEMS).map(show).collect();
                if items.len() > SUMMARY_ITEMS {
                    shown.push(format!("and {} more", items.len() - SUMMARY_ITEMS));
                }
                out.push(format!("{} {what}: {}", items.len(), shown.join(", ")));
            }
        }
        let mut parts = Vec::new();
        list(&mut parts, "missing", &self.missing, |w| {
            format!("{} {:?}", w.name, w.shape)
        });
        list(&mut parts, "unexpected", &self.unexpected, |n| n.clone());
        list(&mut parts, "mis-shaped", &self.misshaped, |m| {
            format!("{} expected {:?} found {:?}", m.name, m.expected, m.found)
        });
        list(
            &mut parts,
            "not float (integer or bool where a float weight belongs)",
            &self.not_float,
            |n| format!("{} is {}", n.name, n.dtype),
        );
        list(&mut parts, "with NaN/Inf", &self.non_finite, |n| {
            format!("{} ({} NaN, {} Inf)", n.name, n.nan, n.inf)
        });
        (!parts.is_empty()).then(|| parts.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model asking for `n` tensors `t0`, `t1`, ... of `shape` each,
    /// and `t0` again.
    fn asks(n: usize, shape: &'static [usize]) -> impl FnOnce(VarBuilder) -> Result<()> {
        move |vb| {
            for i in 0..n {
                vb.get(shape, &format!("t{i}"))?;
            }
            vb.get(shape, "t0")?;
            Ok(())
        }
    }

    /// The first tensor past twice the file's weights stops the recording,
    /// naming the config, that tensor and the file; a name asked twice
    /// counts once.
    #[test]
    fn a_budget_stops_the_recording_at_the_tensor_past_it() -> Result<()> {
        let budget = Budget::new("TestConfig", "w.safetensors", 100, 4);
        assert_eq!((budget.weights(), budget.tensors()), (200, 264));
        let wanted = wanted_within(&[], &budget, asks(3, &[6, 10]))?;
        assert_eq!(wanted.len(), 3);
        let err = wanted_within(&[], &budget, asks(4, &[6, 10]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(
                "TestConfig describes a model of at least 240 weights ('t3' [6, 10]: 60), but 'w.safetensors' \
                 holds 100: a size in the config is larger than this file can hold"
            ),
            "{err}"
        );
        let many = Budget::new("TestConfig", "w.safetensors", 1000, 4);
        let err = wanted_within(&[], &many, asks(300, &[1]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("TestConfig describes a model of more than 264 tensors ('t264' is one too many)")
                && err.contains("larger than this file can hold"),
            "{err}"
        );
        let err = wanted_within(&[], &budget, asks(1, &[usize::MAX, 2]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("TestConfig asks for 't0'") && err.contains("overflows"),
            "{err}"
        );
        // Without a budget only the requests are bounded.
        assert_eq!(wanted_tensors(&[], asks(4, &[1000, 1000]))?.len(), 4);
        let err = wanted_tensors(&[], asks(300, &[1])).unwrap_err().to_string();
        assert!(err.contains("more than 256 tensors"), "{err}");
        Ok(())
    }
}
