//! Files named by a user, read as untrusted input: only regular files,
//! and never more bytes than the caller's limit, so that `/dev/zero`, a
//! FIFO or an oversized config is refused by name, not read until memory
//! runs out or waited on forever.

use std::io::Read;
use std::path::Path;

use candle::{bail, Result};

/// Largest JSON file (`config.json`, `preprocessor_config.json`, a shard
/// index) read, in bytes: real ones are a few KB, ImageNet-21k's
/// `id2label` about 1 MB.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// The size of `path`, which must be a regular file (symbolic links are
/// followed); `what` names it in errors (`config`, `weights`, ...).
pub fn regular_file_len(path: &Path, what: &str) -> Result<u64> {
    let meta = std::fs::metadata(path)
        .map_err(|e| candle::Error::Msg(format!("reading {what} '{}': {e}", path.display())))?;
    if !meta.is_file() {
        let kind = if meta.is_dir() {
            "a folder"
        } else {
            "a device, FIFO or socket"
        };
        bail!("reading {what} '{}': not a regular file ({kind})", path.display())
    }
    Ok(meta.len())
}

/// The bytes of the regular file `path`, refusing one over `max` bytes
/// (checked before reading, and again while reading in case it grows).
pub fn read_bytes(path: &Path, what: &str, max: u64) -> Result<Vec<u8>> {
    let len = regular_file_len(path, what)?;
    let too_big = |len: u64| {
        candle::Error::Msg(format!(
            "{what} '{}' is {len} bytes, over the limit of {max}",
            path.display()
        ))
    };
    if len > max {
        return Err(too_big(len));
    }
    let err = |e: std::io::Error| candle::Error::Msg(format!("reading {what} '{}': {e}", path.display()));
    let file = std::fs::File::open(path).map_err(err)?;
    let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    file.take(max.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(err)?;
    if bytes.len() as u64 > max {
        return Err(too_big(bytes.len() as u64));
    }
    Ok(bytes)
}

/// The UTF-8 text of the regular file `path`, at most `max` bytes.
pub fn read_text(path: &Path, what: &str, max: u64) -> Result<String> {
    String::from_utf8(read_bytes(path, what, max)?).map_err(|e| {
        candle::Error::Msg(format!(
            "reading {what} '{}': not UTF-8 text (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_and_folders_are_refused_without_reading() {
        for (path, kind) in [("/dev/zero", "device"), ("/", "folder")] {
            let err = read_bytes(Path::new(path), "config", 1 << 20)
                .unwrap_err()
                .to_string();
            assert!(err.contains("not a regular file") && err.contains(kind), "{err}");
        }
    }

    #[test]
    fn a_file_over_the_limit_is_refused_by_size() -> Result<()> {
        let path = std::env::temp_dir().join(format!("multihead-files-{}.json", std::process::id()));
        std::fs::write(&path, b"{\"a\": 1}")?;
        assert_eq!(read_text(&path, "config", 8)?, "{\"a\": 1}");
        let err = read_text(&path, "config", 7).unwrap_err().to_string();
        std::fs::remove_file(&path)?;
        assert!(err.contains("is 8 bytes, over the limit of 7"), "{err}");
        Ok(())
    }
}
