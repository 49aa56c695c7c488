//! Folders a test writes in, and copies of fixtures edited there.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// A fresh, empty folder `name` of the calling integration test:
/// `CARGO_TARGET_TMPDIR/<test>/<name>` (`target/tmp`, which cargo keeps for
/// tests; `<test>` is the test target's name), emptied if a run before
/// left it. An expression giving `Result<PathBuf>`; a macro because cargo
/// sets `CARGO_TARGET_TMPDIR` only while it compiles the test itself.
#[macro_export]
macro_rules! scratch_dir {
    ($name:expr) => {
        $crate::scratch::fresh_dir(
            ::std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
                .join(env!("CARGO_CRATE_NAME"))
                .join($name),
        )
    };
}

/// `dir`, emptied if it exists, created if not.
pub fn fresh_dir(dir: PathBuf) -> Result<PathBuf> {
    // Absent on the first run; anything else shows up when creating.
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// Copies every file of folder `from` (not its subfolders' files) into
/// folder `to`.
pub fn copy_files(from: &Path, to: &Path) -> Result<()> {
    for entry in std::fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let path = entry?.path();
        if path.is_file() {
            let name = path.file_name().context("a file without a name")?;
            std::fs::copy(&path, to.join(name)).with_context(|| format!("copying {}", path.display()))?;
        }
    }
    Ok(())
}

/// The JSON file `path`, changed by `edit`, written back.
pub fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) -> Result<()> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut v: serde_json::Value = serde_json::from_str(&text)?;
    edit(&mut v);
    std::fs::write(path, v.to_string())?;
    Ok(())
}
