//! Token ids as fixtures write them and as models take them.

use anyhow::{Context, Result};
use candle::{Device, Tensor};
use serde_json::Value;

/// The ids of a JSON array (HF's and llama.cpp's ids, as the fixture
/// scripts record them); anything else gives none.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect())
        .unwrap_or_default()
}

/// Token rows right-padded with 0 to the longest: `(rows, max_len)` u32.
pub fn padded(rows: &[Vec<u32>], dev: &Device) -> Result<Tensor> {
    let n = rows.iter().map(Vec::len).max().context("no rows")?;
    let data: Vec<u32> = rows
        .iter()
        .flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(0, n - r.len())))
        .collect();
    Ok(Tensor::from_vec(data, (rows.len(), n), dev)?)
}
