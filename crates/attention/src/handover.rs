//! A forward computed before its custom op is applied: candle hands a
//! custom op's `cpu_fwd` storages, where the kernels read tensors (views,
//! dtypes, several outputs), so the op is built around the output it will
//! give, and `cpu_fwd` hands that over ([`Handover::take`]).

use std::sync::Mutex;

use candle::{bail, CpuStorage, Result, Shape, Storage, Tensor};

/// An op's output, computed already, until candle asks for it.
pub(crate) struct Handover(Mutex<Option<Tensor>>);

impl Handover {
    /// Holds `out`, an f32 CPU tensor.
    pub(crate) fn new(out: Tensor) -> Self {
        Self(Mutex::new(Some(out)))
    }

    /// The output as the op's result, contiguous; `op` names the op in
    /// errors. candle calls `cpu_fwd` once: a second call is an error.
    pub(crate) fn take(&self, op: &str) -> Result<(CpuStorage, Shape)> {
        let Some(out) = self.0.lock().ok().and_then(|mut o| o.take()) else {
            bail!("{op}: the forward's output was already taken")
        };
        let out = out.contiguous()?;
        let (storage, layout) = out.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else {
            bail!("{op}: the output is not on the CPU")
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("{op}: the output is not contiguous")
        };
        let data = cpu.as_slice::<f32>()?[start..end].to_vec();
        Ok((CpuStorage::F32(data), out.shape().clone()))
    }
}
