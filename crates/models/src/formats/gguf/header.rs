//! A GGUF header walked before candle's reader parses it, to refuse what
//! that reader would turn into a large allocation, a crash or a silent
//! misreading: metadata that would take more memory than
//! [`MAX_METADATA_MEMORY`] once read (a byte on disk can become a 32-byte
//! `Value`), a metadata key or a tensor name given twice (candle keeps the
//! last; llama.cpp's `gguf_init_from_file` and gguf-py's reader refuse
//! both), a `general.alignment` that is not a positive power of two
//! (candle divides by it), more than 4 dimensions, and a tensor of a ggml
//! type candle does not know (named here, which candle's message does not).
//! It also finds what candle gets wrong: the alignment stored as a 64-bit
//! integer, which candle ignores, and so where the tensor data starts.
//!
//! Layout (ggml's `docs/gguf.md`): magic `GGUF`, version (1: u32 lengths
//! and counts, 2 and 3: u64), tensor count, metadata count; each metadata
//! entry a string key, a u32 value type and the value (arrays: element
//! type, length, elements); each tensor a string name, u32 dim count, the
//! dims, a u32 ggml type and a u64 offset; then the tensor data, from the
//! header's end padded to the alignment. Everything little-endian.
//!
//! Keys and names are untrusted text: every message shows them through
//! `str::escape_debug`, so a control character in one cannot drive the
//! terminal that prints the error.

use std::collections::HashMap;

use candle::{bail, Result};

/// Most memory the metadata may take once candle has read it, estimated
/// from its sizes (a `Value` per element, plus string bytes): 512 MiB. A
/// real file's metadata (tokenizer tables included) takes tens of MB.
pub const MAX_METADATA_MEMORY: u64 = 512 << 20;

/// What a `Value` costs in memory, beside any string bytes it holds.
const VALUE_BYTES: u64 = std::mem::size_of::<candle::quantized::gguf_file::Value>() as u64;

/// Deepest nesting of arrays candle reads.
const MAX_DEPTH: usize = 64;

/// Most dimensions a tensor has (ggml's `GGML_MAX_DIMS`; candle refuses
/// more too, naming the tensor unescaped).
const MAX_DIMS: u32 = 4;

/// GGUF's alignment where `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;

/// What the walk learnt that candle's reader does not give right.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    /// `general.alignment` (any integer type), else 32: every tensor's
    /// offset is a multiple of it.
    pub alignment: u64,
    /// Where the tensor data starts in the file: the header's end padded
    /// to `alignment`. Tensor offsets count from here.
    pub data_start: u64,
}

/// A string of the header as candle's reader makes it (trailing NULs
/// dropped, invalid UTF-8 replaced): the key its maps hold, so two entries
/// that differ only in those bytes are the same key to it.
fn as_candle_reads(bytes: &[u8]) -> String {
    let end = bytes.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// llama.cpp's name for a GGUF value type (`gguf_type_name`).
fn value_type_name(ty: u32) -> &'static str {
    match ty {
        0 => "u8",
        1 => "i8",
        2 => "u16",
        3 => "i16",
        4 => "u32",
        5 => "i32",
        6 => "f32",
        7 => "bool",
        8 => "str",
        9 => "arr",
        10 => "u64",
        11 => "i64",
        12 => "f64",
        _ => "unknown",
    }
}

/// The ggml type numbers candle's reader knows.
const CANDLE_TYPES: [u32; 15] = [0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 30];

/// llama.cpp's names for the ggml types candle does not know.
fn other_type_name(t: u32) -> &'static str {
    match t {
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => "an unknown type",
    }
}

struct Walker<'a> {
    bytes: &'a [u8],
    at: usize,
    /// u32 lengths and counts (version 1) instead of u64.
    short: bool,
    memory: u64,
    label: &'a str,
}

impl<'a> Walker<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        let left = self.bytes.len() - self.at;
        match usize::try_from(n) {
            Ok(n) if n <= left => {
                let bytes: &'a [u8] = self.bytes;
                let s = &bytes[self.at..self.at + n];
                self.at += n;
                Ok(s)
            }
            _ => bail!(
                "GGUF file '{}': the header runs past the end of the file at {what} ({} bytes): truncated or corrupt",
                self.label,
                self.bytes.len()
            ),
        }
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        let b = self.take(8, what)?;
        Ok(u64::from_le_bytes([
            b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7],
        ]))
    }

    fn len(&mut self, what: &str) -> Result<u64> {
        if self.short {
            self.u32(what).map(u64::from)
        } else {
            self.u64(what)
        }
    }

    fn string(&mut self, what: &str) -> Result<&'a [u8]> {
        let n = self.len(what)?;
        self.take(n, what)
    }

    fn spend(&mut self, bytes: u64) -> Result<()> {
        self.memory = self.memory.saturating_add(bytes);
        if self.memory > MAX_METADATA_MEMORY {
            bail!(
                "GGUF file '{}': its metadata would take over {} MiB of memory once read, past the limit: a hostile or corrupt file",
                self.label,
                MAX_METADATA_MEMORY >> 20
            )
        }
        Ok(())
    }

    /// Skips one value of type `ty` (the number the file gives), counting
    /// what candle will allocate for it; returns it when it is an integer.
    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Option<i128>> {
        if depth > MAX_DEPTH {
            bail!(
                "GGUF file '{}': metadata '{key}' nests arrays deeper than {MAX_DEPTH}",
                self.label
            )
        }
        let fixed = |ty: u32| match ty {
            0 | 1 | 7 => Some(1u64),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        };
        if let Some(size) = fixed(ty) {
            let b = self.take(size, key)?;
            let mut v = [0u8; 8];
            v[..b.len()].copy_from_slice(b);
            let unsigned = i128::from(u64::from_le_bytes(v));
            // Sign-extended from the value's own width.
            let signed = |bits: u32| (unsigned << (128 - bits)) >> (128 - bits);
            return Ok(match ty {
                0 | 2 | 4 | 10 => Some(unsigned),
                1 => Some(signed(8)),
                3 => Some(signed(16)),
                5 => Some(signed(32)),
                11 => Some(signed(64)),
                _ => None,
            });
        }
        match ty {
            8 => {
                let n = self.string(key)?.len() as u64;
                self.spend(n)?;
            }
            9 => {
                let elem = self.u32(key)?;
                let n = self.len(key)?;
                self.spend(n.saturating_mul(VALUE_BYTES))?;
                match fixed(elem) {
                    Some(size) => {
                        self.take(n.saturating_mul(size), key)?;
                    }
                    None => {
                        for _ in 0..n {
                            self.value(elem, key, depth + 1)?;
                        }
                    }
                }
            }
            other => bail!(
                "GGUF file '{}': metadata '{key}' has value type {other}, which GGUF does not define",
                self.label
            ),
        }
        Ok(None)
    }
}

/// Walks the header of `bytes` (which start with `GGUF`): refuses metadata
/// too large once read, a key or tensor name given twice, a
/// `general.alignment` that is not a positive power of two, more than 4
/// dimensions and tensors of a ggml type candle's reader does not know;
/// returns the alignment and where the tensor data starts.
pub(crate) fn check_header(bytes: &[u8], label: &str) -> Result<Header> {
    let mut w = Walker {
        bytes,
        at: 4,
        short: false,
        memory: 0,
        label,
    };
    let version = w.u32("the version")?;
    if !(1..=3).contains(&version) {
        bail!("GGUF file '{label}': version {version} is not one this reader knows (1 to 3)")
    }
    w.short = version == 1;
    let tensors = w.len("the tensor count")?;
    let entries = w.len("the metadata count")?;
    let mut alignment = DEFAULT_ALIGNMENT;
    // Each key's entry number; the counts are bounded by the file's size
    // (each entry takes bytes), so these maps are too.
    let mut keys: HashMap<String, u64> = HashMap::new();
    for i in 0..entries {
        let raw = w.string("a metadata key")?;
        w.spend(raw.len() as u64 + VALUE_BYTES)?;
        let key = as_candle_reads(raw);
        let shown = key.escape_debug().to_string();
        if let Some(first) = keys.insert(key.clone(), i) {
            bail!(
                "GGUF file '{label}': metadata key '{shown}' appears twice (entries {first} and {i}): a corrupt or hostile file"
            )
        }
        let ty = w.u32(&shown)?;
        let v = w.value(ty, &shown, 0)?;
        if key == "general.alignment" {
            alignment = match v.and_then(|a| u64::try_from(a).ok()) {
                Some(a) if a.is_power_of_two() => a,
                _ => {
                    let found = match v {
                        Some(a) => format!("{} {a}", value_type_name(ty)),
                        None => format!("a value of type {}", value_type_name(ty)),
                    };
                    bail!("GGUF file '{label}': metadata 'general.alignment' must be a positive power of two, found {found}")
                }
            };
        }
    }
    // Each name's tensor number and offset.
    let mut names: HashMap<String, (u64, u64)> = HashMap::new();
    for i in 0..tensors {
        let name = as_candle_reads(w.string("a tensor name")?);
        let shown = name.escape_debug().to_string();
        let dims = w.u32(&shown)?;
        if dims > MAX_DIMS {
            bail!("GGUF file '{label}': tensor '{shown}' has {dims} dimensions, more than GGUF's {MAX_DIMS}")
        }
        for _ in 0..dims {
            w.len(&shown)?;
        }
        let ty = w.u32(&shown)?;
        if !CANDLE_TYPES.contains(&ty) {
            bail!(
                "GGUF file '{label}': tensor '{shown}' is ggml type {ty} ({}), which this loader does not read (it reads F32, F16, BF16, Q8_0)",
                other_type_name(ty)
            )
        }
        let offset = w.u64(&shown)?;
        if let Some((first, at)) = names.insert(name, (i, offset)) {
            bail!(
                "GGUF file '{label}': tensor '{shown}' appears twice (tensor infos {first} and {i}, at data offsets {at} and {offset}): a corrupt or hostile file"
            )
        }
    }
    let Some(data_start) = (w.at as u64).checked_next_multiple_of(alignment) else {
        bail!("GGUF file '{label}': general.alignment {alignment} puts the tensor data past any file")
    };
    Ok(Header {
        alignment,
        data_start,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(kv: &[u8], entries: u64, tensors: &[u8], count: u64) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(count.to_le_bytes());
        b.extend(entries.to_le_bytes());
        b.extend(kv);
        b.extend(tensors);
        b
    }

    fn string(s: &str) -> Vec<u8> {
        let mut b = (s.len() as u64).to_le_bytes().to_vec();
        b.extend(s.as_bytes());
        b
    }

    #[test]
    fn refuses_metadata_that_would_blow_up_in_memory() {
        // 32 M one-byte elements: 32 MB on disk, a GB of `Value`s.
        let n: u64 = 32 << 20;
        let mut kv = string("big");
        kv.extend(9u32.to_le_bytes());
        kv.extend(0u32.to_le_bytes());
        kv.extend(n.to_le_bytes());
        kv.resize(kv.len() + n as usize, 0);
        let err = check_header(&header(&kv, 1, &[], 0), "big.gguf")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("'big.gguf'") && err.contains("MiB of memory"),
            "{err}"
        );
    }

    #[test]
    fn names_a_tensor_of_an_unknown_type() {
        let mut t = string("blk.0.attn_q.weight");
        t.extend(1u32.to_le_bytes());
        t.extend(32u64.to_le_bytes());
        t.extend(16u32.to_le_bytes());
        t.extend(0u64.to_le_bytes());
        let err = check_header(&header(&[], 0, &t, 1), "iq.gguf")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("'blk.0.attn_q.weight'") && err.contains("IQ2_XXS"),
            "{err}"
        );
    }

    /// The data starts at the header's end padded to `general.alignment`,
    /// a u64 here (which candle ignores, padding to 32).
    #[test]
    fn the_data_starts_at_the_alignment_the_file_gives() -> Result<()> {
        let mut kv = string("general.alignment");
        kv.extend(10u32.to_le_bytes());
        kv.extend(256u64.to_le_bytes());
        let b = header(&kv, 1, &[], 0);
        assert_eq!(b.len(), 61);
        let h = check_header(&b, "a.gguf")?;
        assert_eq!((h.alignment, h.data_start), (256, 256));
        let h = check_header(&header(&[], 0, &[], 0), "b.gguf")?;
        assert_eq!((h.alignment, h.data_start), (32, 32));
        Ok(())
    }

    #[test]
    fn refuses_a_zero_alignment() {
        let mut kv = string("general.alignment");
        kv.extend(4u32.to_le_bytes());
        kv.extend(0u32.to_le_bytes());
        let err = check_header(&header(&kv, 1, &[], 0), "a.gguf")
            .unwrap_err()
            .to_string();
        assert!(err.contains("general.alignment"), "{err}");
    }
}
