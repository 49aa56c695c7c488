//! [`GgufFile`]'s metadata read as the types a config wants, each wrong
//! type an error that names the key, what it must be and what it holds.

use candle::quantized::gguf_file::Value;
use candle::Result;

use super::GgufFile;

impl GgufFile {
    /// The metadata value under `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// The metadata keys, sorted.
    pub fn keys(&self) -> Vec<&str> {
        let mut keys: Vec<&str> = self.metadata.keys().map(String::as_str).collect();
        keys.sort_unstable();
        keys
    }

    fn wrong(&self, key: &str, want: &str, v: &Value) -> candle::Error {
        candle::Error::Msg(format!(
            "GGUF file '{}': metadata '{}' must be {want}, found {}",
            self.label,
            key.escape_debug(),
            show(v)
        ))
    }

    /// `key` as a count or an id: any integer type, not negative.
    pub fn usize(&self, key: &str) -> Result<Option<usize>> {
        self.get(key)
            .map(|v| {
                value_u64(v)
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| self.wrong(key, "a non-negative integer", v))
            })
            .transpose()
    }

    /// `key` as a number: a float (an f32 read back as the decimal it was
    /// written from: `1e-6`, not `9.99999997e-7`) or an integer.
    pub fn float(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| match v {
                Value::F32(x) => x
                    .to_string()
                    .parse::<f64>()
                    .map_err(|_| self.wrong(key, "a number", v)),
                Value::F64(x) => Ok(*x),
                other => value_u64(other)
                    .map(|n| n as f64)
                    .ok_or_else(|| self.wrong(key, "a number", v)),
            })
            .transpose()
    }

    /// `key` as a string.
    pub fn string(&self, key: &str) -> Result<Option<&str>> {
        self.get(key)
            .map(|v| match v {
                Value::String(s) => Ok(s.as_str()),
                other => Err(self.wrong(key, "a string", other)),
            })
            .transpose()
    }

    /// `key` as a boolean.
    pub fn bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| match v {
                Value::Bool(b) => Ok(*b),
                other => Err(self.wrong(key, "true or false", other)),
            })
            .transpose()
    }

    /// `key` as an array of strings.
    pub fn strings(&self, key: &str) -> Result<Option<Vec<&str>>> {
        self.get(key)
            .map(|v| match v {
                Value::Array(items) => items
                    .iter()
                    .map(|i| match i {
                        Value::String(s) => Ok(s.as_str()),
                        other => Err(self.wrong(key, "an array of strings", other)),
                    })
                    .collect(),
                other => Err(self.wrong(key, "an array of strings", other)),
            })
            .transpose()
    }

    /// `key` as an array of numbers (SentencePiece's scores: f32).
    pub fn floats(&self, key: &str) -> Result<Option<Vec<f32>>> {
        self.get(key)
            .map(|v| match v {
                Value::Array(items) => items
                    .iter()
                    .map(|i| match *i {
                        Value::F32(x) => Ok(x),
                        Value::F64(x) => Ok(x as f32),
                        ref other => value_i64(other)
                            .map(|n| n as f32)
                            .ok_or_else(|| self.wrong(key, "an array of numbers", other)),
                    })
                    .collect(),
                other => Err(self.wrong(key, "an array of numbers", other)),
            })
            .transpose()
    }

    /// `key` as an array of integers.
    pub fn integers(&self, key: &str) -> Result<Option<Vec<i64>>> {
        self.get(key)
            .map(|v| match v {
                Value::Array(items) => items
                    .iter()
                    .map(|i| value_i64(i).ok_or_else(|| self.wrong(key, "an array of integers", i)))
                    .collect(),
                other => Err(self.wrong(key, "an array of integers", other)),
            })
            .transpose()
    }
}

fn value_u64(v: &Value) -> Option<u64> {
    match *v {
        Value::U8(n) => Some(n.into()),
        Value::U16(n) => Some(n.into()),
        Value::U32(n) => Some(n.into()),
        Value::U64(n) => Some(n),
        Value::I8(n) => u64::try_from(n).ok(),
        Value::I16(n) => u64::try_from(n).ok(),
        Value::I32(n) => u64::try_from(n).ok(),
        Value::I64(n) => u64::try_from(n).ok(),
        _ => None,
    }
}

fn value_i64(v: &Value) -> Option<i64> {
    match *v {
        Value::U8(n) => Some(n.into()),
        Value::U16(n) => Some(n.into()),
        Value::U32(n) => Some(n.into()),
        Value::U64(n) => i64::try_from(n).ok(),
        Value::I8(n) => Some(n.into()),
        Value::I16(n) => Some(n.into()),
        Value::I32(n) => Some(n.into()),
        Value::I64(n) => Some(n),
        _ => None,
    }
}

/// A metadata value for an error message: short, whatever its size.
fn show(v: &Value) -> String {
    match v {
        Value::String(s) if s.chars().count() > 40 => {
            format!("{:?}...", s.chars().take(40).collect::<String>())
        }
        Value::String(s) => format!("{s:?}"),
        Value::Array(a) => format!("an array of {} values", a.len()),
        other => format!("{other:?}"),
    }
}
