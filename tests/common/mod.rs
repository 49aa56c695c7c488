//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
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

/// `tests/fixtures/<sub>` of the repository (the one place every crate's
/// tests read fixtures from); `MULTIHEAD_FIXTURES` names another fixtures
/// folder (test binaries carried to a machine where the checkout lives
/// elsewhere).
pub fn fixture_dir(sub: &str) -> PathBuf {
    std::env::var_os("MULTIHEAD_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            // The package's own folder, or a member crate's under crates/.
            let package = Path::new(env!("CARGO_MANIFEST_DIR"));
            package
                .ancestors()
                .map(|dir| dir.join("tests/fixtures"))
                .find(|dir| dir.is_dir())
                .unwrap_or_else(|| package.join("tests/fixtures"))
        })
        .join(sub)
}

/// Every `*.safetensors` file in `dir`, sorted.
pub fn fixture_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    files.retain(|p| p.extension().is_some_and(|e| e == "safetensors"));
    files.sort();
    Ok(files)
}

/// A fixture: its tensors and the JSON in its metadata under "case".
pub struct Fixture {
    pub name: String,
    pub tensors: HashMap<String, Tensor>,
    pub case: serde_json::Value,
}

impl Fixture {
    pub fn load(path: &Path, device: &Device) -> Result<Self> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)?;
        let case = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get("case"))
            .context("fixture has no 'case' metadata")?;
        let case = serde_json::from_str(case)?;
        let file = safetensors::SafeTensors::deserialize(&bytes)?;
        let tensors = file
            .tensors()
            .into_iter()
            .map(|(name, view)| {
                let t = match view.dtype() {
                    // Boolean masks load as u8 (candle has no bool dtype).
                    safetensors::Dtype::BOOL => Tensor::from_vec(view.data().to_vec(), view.shape(), device)?,
                    _ => candle::safetensors::Load::load(&view, device)?,
                };
                Ok((name, t))
            })
            .collect::<Result<HashMap<_, _>>>()?;
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(Self { name, tensors, case })
    }

    pub fn get(&self, name: &str) -> Result<&Tensor> {
        self.tensors
            .get(name)
            .with_context(|| format!("{}: no tensor '{name}'", self.name))
    }

    /// The tensors whose names start with `prefix.`, with the prefix removed.
    pub fn with_prefix(&self, prefix: &str) -> HashMap<String, Tensor> {
        let p = format!("{prefix}.");
        self.tensors
            .iter()
            .filter_map(|(k, v)| k.strip_prefix(&p).map(|k| (k.to_string(), v.clone())))
            .collect()
    }

    pub fn str(&self, key: &str) -> Option<&str> {
        self.case.get(key).and_then(|v| v.as_str())
    }
}

/// The tolerance, relative to the largest logit, of a model with half-
/// precision weights against the oracle's f32 compute over the same
/// rounded weights: 1e-5, but 2e-2 (the bf16 target against f32) for `bf16`
/// weights where the CPU kernels run `avx512bf16`, whose `vdpbf16ps`
/// layers round their inputs to bf16 as PyTorch's CPU autocast does
/// (`crates/kernels`' tests hold those layers to 1e-5 of the sums over the
/// rounded inputs).
pub fn half_weights_tolerance(bf16: bool) -> f64 {
    match (bf16, multihead_attention::cpu_isa()) {
        (true, "avx512bf16") => 2e-2,
        _ => 1e-5,
    }
}

/// Asserts that `a` equals `b` within relative error `rtol`, measured
/// against the expected tensor's scale: `|a_i - b_i| <= rtol * max_j |b_j|`
/// for every element (elementwise relative error is meaningless for the
/// near-zero entries that cancellation produces). Names the worst element.
pub fn assert_close(what: &str, a: &Tensor, b: &Tensor, rtol: f64) -> Result<()> {
    if a.dims() != b.dims() {
        bail!(
            "{what}: shape {:?} differs from expected {:?}",
            a.dims(),
            b.dims()
        )
    }
    let a: Vec<f32> = a.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let b: Vec<f32> = b.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let scale = b.iter().fold(0f64, |m, &y| m.max((y as f64).abs()));
    let tol = rtol * scale.max(f64::MIN_POSITIVE);
    let mut worst: Option<(usize, f64)> = None;
    for (i, (&x, &y)) in a.iter().zip(&b).enumerate() {
        let err = (x as f64 - y as f64).abs();
        // NaN compares false with everything, so it is checked first.
        let bad = err.is_nan() || err > tol;
        if bad && worst.is_none_or(|(_, w)| err.is_nan() || err > w) {
            worst = Some((i, err));
        }
    }
    if let Some((i, err)) = worst {
        bail!(
            "{what}: element {i} is {} but expected {}: error {err:.3e} > {rtol:e} x max|expected| {scale:.3e}",
            a[i],
            b[i]
        )
    }
    Ok(())
}

/// The largest absolute difference between two tensors of the same shape.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar()?)
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

/// Asserts `res` is an error whose message mentions every one of
/// `needles`. Only the first line is read: candle appends a backtrace when
/// `RUST_BACKTRACE` is set.
#[track_caller]
pub fn assert_err<T>(res: candle::Result<T>, needles: &[&str]) {
    let msg = match res {
        Ok(_) => panic!("expected an error mentioning {needles:?}"),
        Err(e) => e.to_string().lines().next().unwrap_or_default().to_string(),
    };
    for n in needles {
        assert!(msg.contains(n), "error {msg:?} does not mention {n:?}");
    }
}

/// Asserts a command failed with exactly one `error: ...` line on stderr
/// (no panic, no backtrace) that mentions every one of `what`.
#[track_caller]
pub fn assert_one_line_error(out: &std::process::Output, what: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(!stderr.contains("panicked"), "panicked: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "not one line: {stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    for w in what {
        assert!(lines[0].contains(w), "{stderr} does not mention {w:?}");
    }
}
