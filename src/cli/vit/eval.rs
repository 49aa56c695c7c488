//! `multihead vit --eval DIR`: accuracy and confusion matrix on a
//! class-per-subfolder directory.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};

use super::{image_files, image_io, Classifier};

/// Images per forward pass.
const BATCH: usize = 64;
/// Fewer images than this finish before a bar would be worth drawing.
const PROGRESS_MIN: usize = 100;

/// `(path, class index)` for every image in `dir/<class>/`, where
/// `<class>` is one of the config's labels or a class index.
fn labelled_images(clf: &Classifier, dir: &Path) -> Result<Vec<(PathBuf, usize)>> {
    let mut out = Vec::new();
    let mut subdirs = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading directory '{}'", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            subdirs.push(path);
        }
    }
    subdirs.sort();
    let n = clf.cfg.num_classes;
    for sub in subdirs {
        let name = sub
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let class = (0..n)
            .find(|&i| clf.cfg.label(i) == name)
            .or_else(|| name.parse::<usize>().ok().filter(|&i| i < n));
        let Some(class) = class else {
            bail!(
                "'{}': '{name}' is not a class of the model (0..{n} or its labels)",
                sub.display()
            )
        };
        out.extend(image_files(&sub)?.into_iter().map(|p| (p, class)));
    }
    if out.is_empty() {
        bail!("no images in class subfolders of '{}'", dir.display())
    }
    Ok(out)
}

/// Prints accuracy and the confusion matrix (rows: true class, columns:
/// predicted).
pub fn run(clf: &Classifier, dir: &Path) -> Result<()> {
    let images = labelled_images(clf, dir)?;
    let n = clf.cfg.num_classes;
    let mut confusion = vec![vec![0usize; n]; n];
    let bar = if images.len() >= PROGRESS_MIN {
        // indicatif draws on stderr only when it is a terminal.
        let bar = ProgressBar::new(images.len() as u64);
        bar.set_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} images, {eta} left")
                .context("progress bar template")?,
        );
        bar
    } else {
        ProgressBar::hidden()
    };
    for chunk in images.chunks(BATCH) {
        let inputs = chunk
            .iter()
            .map(|(p, _)| clf.input(&image_io::open_image(p)?))
            .collect::<Result<Vec<_>>>()?;
        let probs = clf.probabilities(&inputs)?.argmax(1)?.to_vec1::<u32>()?;
        for ((_, truth), pred) in chunk.iter().zip(probs) {
            confusion[*truth][pred as usize] += 1;
        }
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    let correct: usize = (0..n).map(|i| confusion[i][i]).sum();
    let total = images.len();
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "accuracy: {:.2}% ({correct}/{total}) on '{}'",
        100. * correct as f64 / total as f64,
        dir.display()
    )?;
    let labels: Vec<String> = (0..n).map(|i| clf.cfg.label(i)).collect();
    let w = labels.iter().map(String::len).max().unwrap_or(1).max(4);
    writeln!(out, "confusion matrix (rows: true class, columns: predicted)")?;
    write!(out, "{:>w$} ", "")?;
    for l in &labels {
        write!(out, " {l:>w$}")?;
    }
    writeln!(out)?;
    for (l, row) in labels.iter().zip(&confusion) {
        write!(out, "{l:>w$} ")?;
        for c in row {
            write!(out, " {c:>w$}")?;
        }
        writeln!(out)?;
    }
    out.flush()?;
    Ok(())
}
