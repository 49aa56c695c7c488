//! A weights file's bytes, safetensors or GGUF: read into memory, or the
//! file mapped read-only and its pages handed back as a loader is done
//! with them.

use std::ops::Deref;
use std::path::Path;

use candle::Result;

/// A weights file's bytes (safetensors or GGUF): read into memory, or a
/// file mapped read-only.
#[derive(Debug)]
pub(crate) enum Bytes {
    Owned(Vec<u8>),
    Mapped(memmap2::Mmap),
}

impl Bytes {
    /// Hands the whole pages inside `range` back to the system where the
    /// bytes are a mapped file (they stay in the page cache, and a later
    /// read faults them in again): a loader that releases each tensor once
    /// read holds the model and one tensor's pages, not the model and the
    /// file. Pages the range shares with its neighbours are kept.
    pub(crate) fn release(&self, range: std::ops::Range<usize>) {
        if let Bytes::Mapped(map) = self {
            const PAGE: usize = 4096;
            let start = range.start.next_multiple_of(PAGE);
            let end = range.end / PAGE * PAGE;
            if end > start {
                // SAFETY: the mapping is read-only; MADV_DONTNEED on it drops
                // this process's copies of the pages, and a later read
                // faults them in again from the file.
                let _ = unsafe {
                    map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
                };
            }
        }
    }

    /// `path` mapped read-only (an empty file, which cannot be mapped, as
    /// no bytes); `what` names the file's kind in errors.
    pub(crate) fn map(path: &Path, what: &str) -> Result<Self> {
        let label = path.display();
        if crate::formats::files::regular_file_len(path, what)? == 0 {
            return Ok(Self::Owned(Vec::new()));
        }
        let file = std::fs::File::open(path)
            .map_err(|e| candle::Error::Msg(format!("reading {what} '{label}': {e}")))?;
        // SAFETY: the mapping is read-only and private to this process; as
        // with any mapped file (candle maps safetensors the same way), the
        // file must not be truncated or rewritten while it is loaded.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .map_err(|e| candle::Error::Msg(format!("mapping {what} '{label}': {e}")))?;
        Ok(Self::Mapped(map))
    }
}

impl Deref for Bytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Self::Owned(v) => v,
            Self::Mapped(m) => m,
        }
    }
}
