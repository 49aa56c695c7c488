//! What a project outside this checkout gets: the README's and docs/'s
//! Rust snippets (which the doctests compile and run from the package
//! root) copied into one read nothing of the checkout but the shipped
//! models, and only through a path they document; and `examples/outside`
//! builds from its own lock file (`cargo run --locked`).

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};

/// The ```rust blocks of a Markdown text, each with the line it starts on.
fn rust_blocks(text: &str) -> Vec<(usize, String)> {
    let mut blocks = Vec::new();
    let mut open: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        match (&mut open, line.trim_start()) {
            (None, l) if l.starts_with("```rust") => open = Some((i + 1, String::new())),
            (Some(_), l) if l.starts_with("```") => blocks.extend(open.take()),
            (Some((_, body)), _) => {
                body.push_str(line);
                body.push('\n');
            }
            (None, _) => {}
        }
    }
    blocks
}

/// Every snippet of README.md and docs/*.md: as shown, with no rustdoc
/// hidden lines (`# ...`, shown in Markdown), and reading the checkout's
/// files (`weights/`, `tests/fixtures/`) only as the default of a path
/// its first argument gives, so that a copy runs from anywhere.
#[test]
fn doc_snippets_run_from_another_project() -> Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md")];
    for entry in std::fs::read_dir(root.join("docs"))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "md") {
            files.push(path);
        }
    }
    let mut snippets = 0;
    for file in files {
        let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
        for (start, body) in rust_blocks(&text) {
            snippets += 1;
            let at = format!("{}:{start}", file.display());
            for line in body.lines() {
                let code = line.trim_start();
                assert!(
                    !(code == "#" || code.starts_with("# ")),
                    "{at}: a rustdoc hidden line, shown as is in Markdown: {line:?}"
                );
                if ["\"weights/", "\"tests/", "\"examples/"]
                    .iter()
                    .any(|p| code.contains(p))
                {
                    assert!(
                        code.contains("std::env::args().nth(1)"),
                        "{at}: a path into the checkout, which a copy of the snippet elsewhere does not have: {line:?}"
                    );
                }
            }
        }
    }
    assert!(snippets >= 9, "found only {snippets} snippets");
    Ok(())
}

/// `cargo run --locked --manifest-path examples/outside/Cargo.toml`, as
/// the README gives it, needs a lock file that matches the crates'
/// manifests: a dependency added to a crate must be added to it too.
/// Only that is checked here (offline, from cargo's cache); a machine
/// whose cache cannot resolve it at all is not this test's concern.
#[test]
fn the_outside_example_s_lock_file_is_current() -> Result<()> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/outside/Cargo.toml");
    let out = Command::new(env!("CARGO"))
        .args([
            "tree",
            "--locked",
            "--offline",
            "--edges",
            "normal",
            "--manifest-path",
        ])
        .arg(&manifest)
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("cannot update the lock file"),
        "examples/outside/Cargo.lock is stale: run `cargo tree --offline --manifest-path \
         examples/outside/Cargo.toml` (or build it) and commit the lock file\n{stderr}"
    );
    Ok(())
}
