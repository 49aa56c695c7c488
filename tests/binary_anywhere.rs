//! The built binary, copied out of the source tree and run from another
//! empty folder with an empty environment (as after `cargo install` or a
//! copy to another machine), runs both demos: the shipped models are built
//! into it, not found through the path it was built at.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{Context, Result};
use multihead_test_support::cli::success;

/// A fresh folder outside the source tree (and outside `target/`).
fn outside(name: &str) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("multihead-anywhere-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// Removes the folder when the test ends, passed or failed.
struct Cleanup(Vec<PathBuf>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for dir in &self.0 {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// The binary copied to `bin/` and run with the working directory `cwd`,
/// no environment at all.
fn run(bin: &Path, cwd: &Path, args: &[&str]) -> Result<Output> {
    // A binary just copied can be briefly "busy" (ETXTBSY): a child forked
    // by another test thread while the copy's file was open for writing
    // holds that descriptor until it execs. Wait it out.
    const ETXTBSY: i32 = 26;
    let mut tries = 0;
    loop {
        match Command::new(bin).current_dir(cwd).env_clear().args(args).output() {
            Err(e) if e.raw_os_error() == Some(ETXTBSY) && tries < 50 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            res => return Ok(res?),
        }
    }
}

#[test]
fn copied_binary_runs_both_demos_from_anywhere() -> Result<()> {
    let (bin_dir, cwd) = (outside("bin")?, outside("cwd")?);
    let _cleanup = Cleanup(vec![bin_dir.clone(), cwd.clone()]);
    let bin = bin_dir.join("multihead");
    std::fs::copy(env!("CARGO_BIN_EXE_multihead"), &bin)?;

    // `multihead vit`: the 12 built-in samples, each read as the digit its
    // name says (digit7_0413.png is a 7).
    let stdout = success(&run(&bin, &cwd, &["vit", "--top-k", "1"])?)?;
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2 * 12, "{stdout}");
    for pair in lines.chunks(2) {
        let name = pair[0].rsplit('/').next().context("name")?;
        let digit = name
            .strip_prefix("digit")
            .and_then(|n| n.get(..1))
            .context("digit")?;
        assert_eq!(pair[1].split_whitespace().next(), Some(digit), "{stdout}");
    }

    // `multihead seq2seq`: the built-in date normaliser.
    let out = success(&run(&bin, &cwd, &["seq2seq", "March 3, 2021", "3 mars 2021"])?)?;
    assert_eq!(out, "2021-03-03\n2021-03-03\n");

    // Neither help text nor the binary names the folder it was built in.
    let help = success(&run(&bin, &cwd, &["seq2seq", "--help"])?)?;
    assert!(!help.contains(env!("CARGO_MANIFEST_DIR")), "{help}");
    let bytes = std::fs::read(&bin)?;
    let built_at = concat!(env!("CARGO_MANIFEST_DIR"), "/weights");
    assert!(
        !bytes.windows(built_at.len()).any(|w| w == built_at.as_bytes()),
        "the binary holds the path {built_at}"
    );
    Ok(())
}

/// `--weights` takes a file or a folder, for both commands: the copied
/// binary reads a copy of each shipped model, as a folder and as its
/// weights file (renamed, with the config beside it), the same as the
/// built-in one.
#[test]
fn weights_take_a_file_or_a_folder() -> Result<()> {
    let (models, cwd) = (outside("models")?, outside("cwd2")?);
    let _cleanup = Cleanup(vec![models.clone(), cwd.clone()]);
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("weights");
    let bin = Path::new(env!("CARGO_BIN_EXE_multihead"));
    for (model, files) in [
        ("dates", &["config.json", "vocab.json"][..]),
        ("vit-digits", &["config.json"][..]),
    ] {
        std::fs::create_dir_all(models.join(model))?;
        for f in files {
            std::fs::copy(repo.join(model).join(f), models.join(model).join(f))?;
        }
        std::fs::copy(
            repo.join(model).join("model.safetensors"),
            models.join(model).join("renamed.safetensors"),
        )?;
    }
    let s = |p: PathBuf| p.display().to_string();

    let date = ["seq2seq", "Wednesday, 3 March 2021"];
    let built_in = success(&run(bin, &cwd, &date)?)?;
    assert_eq!(built_in, "2021-03-03\n");
    let file = s(models.join("dates/renamed.safetensors"));
    assert_eq!(
        success(&run(bin, &cwd, &[&date[..], &["--weights", &file]].concat())?)?,
        built_in
    );
    // A folder's one safetensors file is its weights, whatever its name,
    // as every model kind finds them (`Weights::find`).
    let dir = s(models.join("dates"));
    assert_eq!(
        success(&run(bin, &cwd, &[&date[..], &["--weights", &dir]].concat())?)?,
        built_in
    );
    std::fs::rename(
        models.join("dates/renamed.safetensors"),
        models.join("dates/model.safetensors"),
    )?;
    assert_eq!(
        success(&run(bin, &cwd, &[&date[..], &["--weights", &dir]].concat())?)?,
        built_in
    );

    // vit: the built-in model, its file copy and its folder give the same
    // output.
    let sample = s(repo.join("vit-digits/samples/digit3_0705.png"));
    let built_in = success(&run(bin, &cwd, &["vit", &sample])?)?;
    let file = s(models.join("vit-digits/renamed.safetensors"));
    assert_eq!(
        success(&run(bin, &cwd, &["vit", &sample, "--weights", &file])?)?,
        built_in
    );
    std::fs::rename(
        models.join("vit-digits/renamed.safetensors"),
        models.join("vit-digits/model.safetensors"),
    )?;
    let dir = s(models.join("vit-digits"));
    assert_eq!(
        success(&run(bin, &cwd, &["vit", &sample, "--weights", &dir])?)?,
        built_in
    );
    Ok(())
}

/// `inspect` takes the folder too, and finds the config in it.
#[test]
fn inspect_takes_a_folder() -> Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("weights/vit-digits");
    let out = success(
        &Command::new(env!("CARGO_BIN_EXE_multihead"))
            .arg("inspect")
            .arg(&dir)
            .output()?,
    )?;
    assert!(out.contains("layout: timm VisionTransformer"), "{out}");
    assert!(out.contains("config: VitConfig"), "{out}");
    Ok(())
}

/// `vit --weights FILE --config CONFIG` needs no config beside the file.
#[test]
fn vit_config_elsewhere() -> Result<()> {
    let dir = outside("config_elsewhere")?;
    let _cleanup = Cleanup(vec![dir.clone()]);
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("weights/vit-digits");
    std::fs::create_dir_all(dir.join("w"))?;
    std::fs::copy(repo.join("model.safetensors"), dir.join("w/digits.safetensors"))?;
    std::fs::copy(repo.join("config.json"), dir.join("digits.json"))?;
    let bin = Path::new(env!("CARGO_BIN_EXE_multihead"));
    let sample = repo.join("samples/digit3_0705.png");
    let out = success(&run(
        bin,
        &dir,
        &[
            "vit",
            "--weights",
            "w/digits.safetensors",
            "--config",
            "digits.json",
            "--top-k",
            "1",
            &sample.display().to_string(),
        ],
    )?)?;
    assert_eq!(
        out.lines().nth(1).and_then(|l| l.split_whitespace().next()),
        Some("3"),
        "{out}"
    );
    Ok(())
}
