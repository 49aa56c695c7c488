//! Weights made in a test: builders over plain tensors, and safetensors
//! files of a chosen shape.

use std::collections::HashMap;
use std::path::Path;

use anyhow::Result;
use candle::{DType, Device, Tensor};

/// A builder over plain copies of `varmap`'s variables, so that a module
/// built on it takes the packed and tiled paths (variables would force the
/// differentiable ones).
pub fn plain_copy(varmap: &candle_nn::VarMap) -> Result<candle_nn::VarBuilder<'static>> {
    let plain: HashMap<String, Tensor> = varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned VarMap lock"))?
        .iter()
        .map(|(name, var)| (name.clone(), var.as_tensor().detach()))
        .collect();
    Ok(candle_nn::VarBuilder::from_tensors(
        plain,
        DType::F32,
        &Device::Cpu,
    ))
}

/// Writes a safetensors file of `n` one-element F32 tensors named `t.0`,
/// `t.1`, ... (zeros): a header as long as a test needs, in a file a few
/// bytes a tensor long.
pub fn many_tensors(path: &Path, n: usize) -> Result<()> {
    let mut header = String::from("{");
    for i in 0..n {
        if i > 0 {
            header.push(',');
        }
        header.push_str(&format!(
            r#""t.{i}":{{"dtype":"F32","shape":[1],"data_offsets":[{},{}]}}"#,
            4 * i,
            4 * i + 4
        ));
    }
    header.push('}');
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.resize(bytes.len() + 4 * n, 0);
    std::fs::write(path, bytes)?;
    Ok(())
}
