//! The key proof for the shipped model: `multihead vit` and PyTorch give
//! the same prediction on every held-out image, read from the same PNG
//! files (`weights/vit-digits/pytorch_predictions.json`, written by
//! `scripts/train_vit_digits.py`).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};
use multihead_test_support::shipped;

/// Probabilities agree to float rounding; the predictions must be equal.
const PROB_ATOL: f64 = 1e-4;

/// The shipped model's folder and PyTorch's predictions there.
fn reference() -> Result<(PathBuf, serde_json::Value)> {
    let dir = shipped::folder("vit-digits");
    let text = std::fs::read_to_string(dir.join("pytorch_predictions.json"))?;
    Ok((dir, serde_json::from_str(&text)?))
}

#[test]
fn binary_agrees_with_pytorch_on_every_heldout_image() -> Result<()> {
    let (dir, reference) = reference()?;
    let preds = reference["predictions"].as_object().context("predictions")?;
    let rel: Vec<&String> = preds.keys().collect();
    let out = Command::new(env!("CARGO_BIN_EXE_multihead"))
        .current_dir(&dir)
        .args(["vit", "--format", "json", "--top-k", "10"])
        .args(&rel)
        .output()?;
    if !out.status.success() {
        bail!("multihead vit failed: {}", String::from_utf8_lossy(&out.stderr))
    }
    let ours: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let ours = ours.as_array().context("array")?;
    assert_eq!(ours.len(), rel.len());
    let (mut heldout, mut correct, mut disagreements) = (0, 0, Vec::new());
    for (path, got) in rel.iter().zip(ours) {
        let want = &preds[path.as_str()];
        let want_pred = want["pred"].as_u64().context("pred")?;
        let top = got["top_k"].as_array().context("top_k")?;
        let got_pred = top[0]["class"].as_u64().context("class")?;
        if got_pred != want_pred {
            disagreements.push(format!("{path}: ours {got_pred}, PyTorch {want_pred}"));
        }
        let want_probs = want["probs"].as_array().context("probs")?;
        for entry in top {
            let c = entry["class"].as_u64().context("class")? as usize;
            let (p, q) = (
                entry["prob"].as_f64().context("prob")?,
                want_probs[c].as_f64().context("prob")?,
            );
            assert!(
                (p - q).abs() <= PROB_ATOL,
                "{path}: class {c}: ours {p}, PyTorch {q}"
            );
        }
        // heldout/<class>/<n>.png: the folder is the true class.
        if let Some(truth) = path.strip_prefix("heldout/").and_then(|p| p.split('/').next()) {
            heldout += 1;
            correct += usize::from(truth.parse::<u64>()? == got_pred);
        }
    }
    assert!(disagreements.is_empty(), "{}", disagreements.join("\n"));
    let acc = correct as f64 / heldout as f64;
    let want_acc = reference["accuracy"].as_f64().context("accuracy")?;
    assert_eq!(
        heldout,
        reference["num_images"].as_u64().context("num_images")? as usize
    );
    assert!(
        (acc - want_acc).abs() < 1e-6,
        "accuracy: ours {acc}, PyTorch {want_acc}"
    );
    assert!(acc >= 0.95, "held-out accuracy {acc} below 95%");
    Ok(())
}

/// With its weight matrices in bf16 or f16 (`--dtype`, packed as such on
/// the CPU, activations in f32), the shipped model keeps PyTorch's f32
/// prediction on every image, the held-out ones included, and its
/// probabilities move, but by less than 1e-2: the weights were rounded.
#[test]
fn half_precision_weights_keep_every_prediction() -> Result<()> {
    let (dir, reference) = reference()?;
    let preds = reference["predictions"].as_object().context("predictions")?;
    let rel: Vec<&String> = preds.keys().collect();
    for dtype in ["bf16", "f16"] {
        let out = Command::new(env!("CARGO_BIN_EXE_multihead"))
            .current_dir(&dir)
            .args(["vit", "--format", "json", "--top-k", "1", "--dtype", dtype])
            .args(&rel)
            .output()?;
        if !out.status.success() {
            bail!(
                "multihead vit --dtype {dtype} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )
        }
        let ours: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        let ours = ours.as_array().context("array")?;
        assert_eq!(ours.len(), rel.len());
        let mut moved = 0f64;
        for (path, got) in rel.iter().zip(ours) {
            let want = &preds[path.as_str()];
            let top = &got["top_k"][0];
            let class = top["class"].as_u64().context("class")?;
            assert_eq!(class, want["pred"].as_u64().context("pred")?, "{dtype} {path}");
            let p = top["prob"].as_f64().context("prob")?;
            let q = want["probs"][class as usize].as_f64().context("prob")?;
            moved = moved.max((p - q).abs());
        }
        assert!(moved < 1e-2, "{dtype}: a probability moved by {moved}");
        assert!(
            moved > 1e-6,
            "{dtype}: no probability moved: were the weights rounded?"
        );
    }
    Ok(())
}
