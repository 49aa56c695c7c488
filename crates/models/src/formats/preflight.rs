//! What a model needs from a checkpoint, found by building it once
//! against a recording `VarBuilder`, and the comparison with what the
//! file holds: every missing, unexpected, mis-shaped, non-float and
//! non-finite tensor at once, before any weight is loaded. Each format
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

/// Answers every `vb.get` with zeros (one element broadcast, so a large
/// model costs no memory) and writes down what was asked.
struct Recorder {
    present: HashSet<String>,
    wanted: Arc<Mutex<Vec<Wanted>>>,
    /// Most requests answered: a config whose sizes the file cannot hold
    /// (`depth: 300000`) stops here instead of recording millions.
    limit: usize,
}

impl SimpleBackend for Recorder {
    fn get(&self, s: Shape, name: &str, _h: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        if s.dims()
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .is_none()
        {
            candle::bail!(
                "the model asks for '{name}' of shape {:?}, whose size overflows: a size in its config is absurd",
                s.dims()
            )
        }
        let mut w = self
            .wanted
            .lock()
            .map_err(|_| candle::Error::Msg("preflight: recorder poisoned".into()))?;
        if w.len() >= self.limit {
            candle::bail!(
                "the model asks for more than {} tensors but the file holds {}: a size in its config \
                 (depth, layers, ...) is larger than this file can hold",
                self.limit,
                self.present.len()
            )
        }
        w.push(Wanted {
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

/// How many more tensors than the file holds a model may ask for before
/// [`wanted_tensors`] gives up: a config a few layers off still gets its
/// full list of missing tensors.
pub(crate) const EXTRA_WANTED: usize = 256;

/// The tensors `build` asks for when it constructs its model, in order,
/// each once. `present` answers `vb.contains_tensor`.
///
/// Stops with an error when the model asks for more than twice as many
/// tensors as `present` holds, plus 256, or for a shape whose
/// size overflows: such a model cannot be in the file, and recording it
/// would cost time and memory in proportion to the config, not the file.
pub fn wanted_tensors<T>(
    present: &[&str],
    build: impl FnOnce(VarBuilder) -> Result<T>,
) -> Result<Vec<Wanted>> {
    let wanted = Arc::new(Mutex::new(Vec::new()));
    let recorder = Recorder {
        present: present.iter().map(|s| s.to_string()).collect(),
        wanted: wanted.clone(),
        limit: present.len().saturating_mul(2).saturating_add(EXTRA_WANTED),
    };
    build(VarBuilder::from_backend(
        Box::new(recorder),
        DType::F32,
        Device::Cpu,
    ))?;
    let wanted: Vec<Wanted> = wanted
        .lock()
        .map_err(|_| candle::Error::Msg("preflight: recorder poisoned".into()))?
        .clone();
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

/// A checkpoint compared with what a model needs.
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
