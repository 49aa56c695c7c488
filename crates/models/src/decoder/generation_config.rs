//! `generation_config.json` as HF transformers saves it beside a model:
//! the end tokens and the decoding defaults a folder ships with, read as
//! untrusted input (every wrong value names the file and the field).

use std::path::Path;

use candle::{bail, Result};
use serde_json::Value;

use crate::formats::files::{read_text, MAX_CONFIG_BYTES};
use crate::vit::folder::json::{parse_object, Fields, MAX_SIZE};

/// HF's `GenerationConfig`, the fields this crate's generation uses. A
/// field the file leaves out is `None` (or HF's default where noted).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct HfGenerationConfig {
    /// `eos_token_id`, one id or a list (Llama 3 ends on `<|end_of_text|>`
    /// and `<|eot_id|>`).
    pub eos_token_ids: Vec<u32>,
    /// `pad_token_id`.
    pub pad_token_id: Option<u32>,
    /// `bos_token_id`.
    pub bos_token_id: Option<u32>,
    /// `max_new_tokens`.
    pub max_new_tokens: Option<usize>,
    /// `min_new_tokens`.
    pub min_new_tokens: Option<usize>,
    /// `do_sample` (default false: greedy decoding).
    pub do_sample: bool,
    /// `temperature` (HF's default 1; 0: greedy).
    pub temperature: Option<f32>,
    /// `top_k` (HF's default 50 when sampling; 0: every token).
    pub top_k: Option<usize>,
    /// `top_p` (HF's default 1; 0: the best token only).
    pub top_p: Option<f32>,
    /// `repetition_penalty` (HF's default 1).
    pub repetition_penalty: Option<f32>,
    /// `stop_strings`: one string or a list.
    pub stop_strings: Vec<String>,
}

impl HfGenerationConfig {
    /// Reads `dir/generation_config.json`. A folder without one takes the
    /// special tokens of its `config.json` (`eos_token_id`, `bos_token_id`,
    /// `pad_token_id`) and the defaults otherwise, as HF's
    /// `GenerationConfig.from_model_config` does.
    pub fn from_folder(dir: &Path) -> Result<Self> {
        let path = dir.join("generation_config.json");
        if path.exists() {
            let text = read_text(&path, "generation config", MAX_CONFIG_BYTES)?;
            return Self::from_json(&text, &path.display().to_string());
        }
        let config = dir.join("config.json");
        if !config.exists() {
            return Ok(Self::default());
        }
        let text = read_text(&config, "config", MAX_CONFIG_BYTES)?;
        let label = config.display().to_string();
        let map = parse_object(&text, &label)?;
        let f = Fields::new(&label, &map);
        Ok(Self {
            eos_token_ids: ids(&f, "eos_token_id")?,
            bos_token_id: id(&f, "bos_token_id")?,
            pad_token_id: id(&f, "pad_token_id")?,
            ..Self::default()
        })
    }

    /// Parses the file's text; `label` names it in errors.
    pub fn from_json(text: &str, label: &str) -> Result<Self> {
        let map = parse_object(text, label)?;
        let f = Fields::new(label, &map);
        let cfg = Self {
            eos_token_ids: ids(&f, "eos_token_id")?,
            pad_token_id: id(&f, "pad_token_id")?,
            bos_token_id: id(&f, "bos_token_id")?,
            max_new_tokens: count(&f, "max_new_tokens", 1)?,
            min_new_tokens: count(&f, "min_new_tokens", 0)?,
            do_sample: match f.get("do_sample") {
                None => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => bail!("{label}: field 'do_sample' must be true or false, found {v}"),
            },
            // 0 is what greedy folders write (`do_sample: false`); sampling
            // at 0 is greedy too, as in llama.cpp and OpenAI's API (HF
            // raises there).
            temperature: number(&f, "temperature", 0., f64::MAX)?,
            top_k: top_k(&f)?,
            top_p: number(&f, "top_p", 0., 1.)?,
            repetition_penalty: positive(&f, "repetition_penalty")?,
            // An empty stop string stops nothing (HF's `StopStringCriteria`
            // never matches one): dropped.
            stop_strings: match f.get("stop_strings") {
                None | Some(Value::Null) => Vec::new(),
                Some(Value::String(s)) => vec![s.clone()],
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|v| match v {
                        Value::String(s) => Ok(s.clone()),
                        _ => bail!("{label}: field 'stop_strings' must hold strings, found {v}"),
                    })
                    .collect::<Result<_>>()?,
                Some(v) => {
                    bail!("{label}: field 'stop_strings' must be a string or a list of strings, found {v}")
                }
            }
            .into_iter()
            .filter(|s: &String| !s.is_empty())
            .collect(),
        };
        Ok(cfg)
    }

    /// Refuses a token id that is not in a vocabulary of `vocab_size`
    /// (the model's output width).
    pub fn check_ids(&self, vocab_size: usize, label: &str) -> Result<()> {
        let named = self
            .eos_token_ids
            .iter()
            .map(|&id| ("eos_token_id", id))
            .chain(self.pad_token_id.map(|id| ("pad_token_id", id)))
            .chain(self.bos_token_id.map(|id| ("bos_token_id", id)));
        for (name, id) in named {
            if id as usize >= vocab_size {
                bail!("{label}: field '{name}' is {id}, outside the model's vocabulary of {vocab_size}")
            }
        }
        Ok(())
    }
}

/// A token id `v` of field `key`.
fn id_value(f: &Fields, key: &str, v: &Value) -> Result<u32> {
    match v.as_u64().and_then(|n| u32::try_from(n).ok()) {
        Some(id) => Ok(id),
        None => bail!(
            "{}: field '{key}' must hold token ids (whole numbers), found {v}",
            f.file()
        ),
    }
}

/// One id or a list of them (none when absent).
fn ids(f: &Fields, key: &str) -> Result<Vec<u32>> {
    match f.get(key) {
        None => Ok(Vec::new()),
        Some(Value::Array(list)) => list.iter().map(|v| id_value(f, key, v)).collect(),
        Some(v) => Ok(vec![id_value(f, key, v)?]),
    }
}

fn id(f: &Fields, key: &str) -> Result<Option<u32>> {
    f.get(key).map(|v| id_value(f, key, v)).transpose()
}

/// A whole number in `min..=MAX_SIZE` (the cap every config size has).
fn count(f: &Fields, key: &str, min: usize) -> Result<Option<usize>> {
    let Some(v) = f.get(key) else {
        return Ok(None);
    };
    match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
        Some(n) if (min..=MAX_SIZE).contains(&n) => Ok(Some(n)),
        _ => bail!(
            "{}: field '{key}' must be a whole number in {min}..={MAX_SIZE}, found {v}",
            f.file()
        ),
    }
}

/// A number in `min..=max`.
fn number(f: &Fields, key: &str, min: f64, max: f64) -> Result<Option<f32>> {
    let Some(v) = f.get(key) else {
        return Ok(None);
    };
    match v.as_f64() {
        Some(x) if x.is_finite() && (min..=max).contains(&x) => Ok(Some(x as f32)),
        _ if max == f64::MAX => bail!(
            "{}: field '{key}' must be a finite number >= {min}, found {v}",
            f.file()
        ),
        _ => bail!(
            "{}: field '{key}' must be a number in [{min}, {max}], found {v}",
            f.file()
        ),
    }
}

/// `top_k`: 0 or less keeps every token (HF skips its top-k warper at 0;
/// below 0 it raises when sampling, where this keeps every token too).
fn top_k(f: &Fields) -> Result<Option<usize>> {
    let Some(v) = f.get("top_k") else {
        return Ok(None);
    };
    match v.as_i64() {
        Some(k) if k <= 0 => Ok(Some(0)),
        Some(k) if k as u64 <= MAX_SIZE as u64 => Ok(Some(k as usize)),
        _ => bail!(
            "{}: field 'top_k' must be a whole number up to {MAX_SIZE}, found {v}",
            f.file()
        ),
    }
}

fn positive(f: &Fields, key: &str) -> Result<Option<f32>> {
    let Some(v) = f.get(key) else {
        return Ok(None);
    };
    match v.as_f64().map(|x| x as f32) {
        Some(x) if x.is_finite() && x > 0. => Ok(Some(x)),
        _ => bail!(
            "{}: field '{key}' must be a finite number > 0, found {v}",
            f.file()
        ),
    }
}
