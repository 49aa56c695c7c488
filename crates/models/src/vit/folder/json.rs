//! Typed reads of a stranger's JSON object: every wrong value is an error
//! naming the file, the field (dotted from the top), what was expected and
//! what was found.

use candle::{bail, Result};
use serde_json::{Map, Value};

/// Largest size (pixels, widths, layer counts) a config may state: larger
/// ones are refused by name before any arithmetic is done with them.
pub const MAX_SIZE: usize = 1 << 20;

/// A JSON object from `file`, read field by field.
#[derive(Debug, Clone)]
pub struct Fields<'a> {
    file: &'a str,
    /// The dotted path of this object in the file, `""` at the top.
    path: String,
    map: &'a Map<String, Value>,
}

/// Parses `text` as a JSON object; `file` names it in errors.
pub fn parse_object(text: &str, file: &str) -> Result<Map<String, Value>> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => bail!("{file}: expected a JSON object, found {}", short(&other)),
        Err(e) => bail!("{file}: not valid JSON: {e}"),
    }
}

/// A value as a short piece of JSON for a message.
pub fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 40 {
        format!("{}…", s.chars().take(40).collect::<String>())
    } else {
        s
    }
}

impl<'a> Fields<'a> {
    /// The top-level object of `file`.
    pub fn new(file: &'a str, map: &'a Map<String, Value>) -> Self {
        Self {
            file,
            path: String::new(),
            map,
        }
    }

    /// The file's name.
    pub fn file(&self) -> &'a str {
        self.file
    }

    /// The dotted name of `key` in this object.
    pub fn name(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    /// An error about `key`.
    pub fn error(&self, key: &str, what: impl std::fmt::Display) -> candle::Error {
        candle::Error::Msg(format!("{}: field '{}': {what}", self.file, self.name(key)))
    }

    fn wrong(&self, key: &str, expected: &str, found: &Value) -> candle::Error {
        self.error(key, format!("expected {expected}, found {}", short(found)))
    }

    /// The value of `key`; JSON `null` counts as absent.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    /// Whether `key` is present (and not `null`).
    pub fn has(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// The keys present (sorted: serde_json's default map).
    pub fn keys(&self) -> impl Iterator<Item = &'a String> {
        self.map.keys()
    }

    /// A whole number in `1..=MAX_SIZE` (or `0..` when `zero_ok`).
    pub fn size(&self, key: &str, zero_ok: bool) -> Result<Option<usize>> {
        let Some(v) = self.get(key) else { return Ok(None) };
        let lo = usize::from(!zero_ok);
        match v.as_u64() {
            Some(n) if n >= lo as u64 && n <= MAX_SIZE as u64 => Ok(Some(n as usize)),
            Some(n) if n > MAX_SIZE as u64 => {
                Err(self.error(key, format!("{n} is over the limit of {MAX_SIZE}")))
            }
            _ => Err(self.wrong(key, &format!("a whole number >= {lo}"), v)),
        }
    }

    /// [`Self::size`], required.
    pub fn size_req(&self, key: &str, zero_ok: bool) -> Result<usize> {
        self.size(key, zero_ok)?.ok_or_else(|| self.error(key, "missing"))
    }

    /// A side given as a number or as `[h, w]` with `h == w`.
    pub fn square(&self, key: &str) -> Result<Option<usize>> {
        let Some(v) = self.get(key) else { return Ok(None) };
        if let Some(list) = v.as_array() {
            let sides: Vec<Option<u64>> = list.iter().map(Value::as_u64).collect();
            return match sides.as_slice() {
                [Some(h), Some(w)] if h == w && *h >= 1 && *h <= MAX_SIZE as u64 => Ok(Some(*h as usize)),
                [Some(h), Some(w)] if h != w => {
                    Err(self.error(key, format!("{h}x{w} is not square, which multihead's ViT needs")))
                }
                _ => Err(self.wrong(key, &format!("a side in 1..={MAX_SIZE} or [side, side]"), v)),
            };
        }
        self.size(key, false)
    }

    /// A finite number.
    pub fn number(&self, key: &str) -> Result<Option<f64>> {
        let Some(v) = self.get(key) else { return Ok(None) };
        match v.as_f64() {
            Some(x) if x.is_finite() => Ok(Some(x)),
            _ => Err(self.wrong(key, "a finite number", v)),
        }
    }

    /// `true` or `false`.
    pub fn boolean(&self, key: &str) -> Result<Option<bool>> {
        let Some(v) = self.get(key) else { return Ok(None) };
        v.as_bool()
            .map(Some)
            .ok_or_else(|| self.wrong(key, "true or false", v))
    }

    /// A string.
    pub fn string(&self, key: &str) -> Result<Option<&'a str>> {
        let Some(v) = self.get(key) else { return Ok(None) };
        v.as_str().map(Some).ok_or_else(|| self.wrong(key, "a string", v))
    }

    /// A nested object.
    pub fn object(&self, key: &str) -> Result<Option<Fields<'a>>> {
        let Some(v) = self.get(key) else { return Ok(None) };
        let Some(map) = v.as_object() else {
            return Err(self.wrong(key, "an object", v));
        };
        Ok(Some(Fields {
            file: self.file,
            path: self.name(key),
            map,
        }))
    }

    /// Per-channel values: a list of `channels` finite numbers, or one
    /// number for every channel.
    pub fn channels(&self, key: &str, channels: usize) -> Result<Option<Vec<f32>>> {
        let Some(v) = self.get(key) else { return Ok(None) };
        let values: Vec<Option<f64>> = match v {
            Value::Array(list) => list.iter().map(Value::as_f64).collect(),
            Value::Number(n) => vec![n.as_f64(); channels],
            _ => return Err(self.wrong(key, &format!("{channels} numbers"), v)),
        };
        if values.len() != channels {
            return Err(self.error(
                key,
                format!("has {} values, the model has {channels} channels", values.len()),
            ));
        }
        values
            .into_iter()
            .map(|x| match x {
                Some(x) if x.is_finite() && x.abs() < 1e6 => Ok(x as f32),
                _ => Err(self.wrong(key, "finite numbers", v)),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// Class names: a list of strings, or an object `{"0": name, ...}`
    /// whose keys are `0..n` each once.
    pub fn labels(&self, key: &str) -> Result<Option<Vec<String>>> {
        let Some(v) = self.get(key) else { return Ok(None) };
        match v {
            Value::Array(list) => list
                .iter()
                .map(|s| {
                    s.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| self.wrong(key, "a list of strings", s))
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Value::Object(map) => {
                let mut out = vec![None; map.len()];
                for (k, name) in map {
                    let Some(i) = k.parse::<usize>().ok().filter(|&i| i < map.len()) else {
                        return Err(
                            self.error(key, format!("key '{k}' is not a class index in 0..{}", map.len()))
                        );
                    };
                    let Some(name) = name.as_str() else {
                        return Err(self.wrong(key, &format!("a string for class {k}"), name));
                    };
                    // Two keys that parse to the same index ("1" and "01").
                    if out[i].replace(name.to_string()).is_some() {
                        return Err(self.error(key, format!("class {i} is named twice")));
                    }
                }
                // n distinct indices in 0..n: every slot is filled.
                Ok(Some(out.into_iter().flatten().collect()))
            }
            _ => Err(self.wrong(key, "a list of names or an object {\"0\": name, ...}", v)),
        }
    }
}
