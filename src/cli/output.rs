//! Files the binary writes: whole or not at all, with every error
//! reported. A write that runs out of space, a full device or a failed
//! flush is an error naming the file, never a truncated file and exit 0.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use image::{ImageFormat, RgbImage};

/// Writes `bytes` to `path`. A regular file (or a new one) is written to a
/// temporary name in the same folder, flushed to disk and renamed over
/// `path`, so a failure leaves any earlier file as it was; anything else
/// that exists there (`/dev/stdout`, a FIFO) is written in place, every
/// error checked.
pub fn write_file(path: &Path, bytes: &[u8], what: &str) -> Result<()> {
    let ctx = || format!("writing {what} '{}'", path.display());
    let in_place = std::fs::metadata(path).is_ok_and(|m| !m.is_file());
    if in_place {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .with_context(ctx)?;
        f.write_all(bytes).with_context(ctx)?;
        return f.flush().with_context(ctx);
    }
    let name = path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let written = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        // Best effort: the error that matters is the write's.
        let _ = std::fs::remove_file(&tmp);
    }
    written.with_context(ctx)
}

/// Encodes `img` as PNG and writes it with [`write_file`].
pub fn write_png(path: &Path, img: &RgbImage, what: &str) -> Result<()> {
    let mut bytes = std::io::Cursor::new(Vec::new());
    img.write_to(&mut bytes, ImageFormat::Png)
        .with_context(|| format!("encoding {what} '{}'", path.display()))?;
    write_file(path, bytes.get_ref(), what)
}
