//! GGUF files, untrusted. An input starting with `G` is the file itself,
//! any bytes; any other input is a list of edits to the header of the
//! qwen2 Q8_0 fixture, which is then rebuilt: metadata entries and tensor
//! infos duplicated, dropped or moved, offsets shifted, set or copied from
//! another tensor's, a `general.alignment` of any value type added, the
//! data padded to another alignment or cut short, header bytes
//! overwritten. Either file then goes through what loading and `multihead
//! inspect` do: `GgufFile::from_bytes`, the NaN/Inf scan and tensor reads,
//! the metadata's typed reads, the pre-flight against the config the
//! metadata describes and, where that is clean, the tokenizer, the end
//! tokens and the model load. Nothing may panic, and a file that reads
//! must hold what the reader promises: unique tensor names, each tensor
//! inside the file, no two sharing a byte.
#![no_main]

use std::collections::HashSet;
use std::sync::OnceLock;

use candle::Device;
use libfuzzer_sys::fuzz_target;
use multihead_models::checkpoint::{GgufFile, LoadOptions};
use multihead_models::decoder::{DecoderModel, HfGenerationConfig, TextTokenizer};

static FIXTURE: &[u8] = include_bytes!("../../tests/fixtures/gguf/qwen2-q8_0.gguf");

/// Most edits one input applies, so that one run stays short.
const MAX_EDITS: usize = 64;

/// The fixture cut at its entries' boundaries: each metadata entry (key,
/// type, value) and each tensor info (name, dims, type, offset: its last
/// 8 bytes) as bytes, and the data section.
struct Parts {
    kv: Vec<Vec<u8>>,
    tensors: Vec<Vec<u8>>,
    data: Vec<u8>,
}

/// Reads the fixture's header (GGUF v3, a file this crate wrote and
/// checks: a bad one is a bug in the target, so it panics).
fn parts() -> &'static Parts {
    static PARTS: OnceLock<Parts> = OnceLock::new();
    PARTS.get_or_init(|| {
        let b = FIXTURE;
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize;
        assert_eq!((&b[..4], u32_at(4)), (&b"GGUF"[..], 3));
        let (n_tensors, n_kv) = (u64_at(8), u64_at(16));
        fn value(b: &[u8], ty: u32, at: usize) -> usize {
            let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize;
            match ty {
                0 | 1 | 7 => at + 1,
                2 | 3 => at + 2,
                4..=6 => at + 4,
                10..=12 => at + 8,
                8 => at + 8 + u64_at(at),
                9 => {
                    let elem = u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
                    let mut at = at + 12;
                    for _ in 0..u64_at(at - 8) {
                        at = value(b, elem, at);
                    }
                    at
                }
                other => panic!("value type {other} in the fixture"),
            }
        }
        let mut at = 24;
        let mut kv = Vec::new();
        for _ in 0..n_kv {
            let start = at;
            at += 8 + u64_at(at);
            let ty = u32_at(at);
            at = value(b, ty, at + 4);
            kv.push(b[start..at].to_vec());
        }
        let mut tensors = Vec::new();
        for _ in 0..n_tensors {
            let start = at;
            at += 8 + u64_at(at);
            at += 4 + 8 * u32_at(at) as usize + 4 + 8;
            tensors.push(b[start..at].to_vec());
        }
        Parts {
            kv,
            tensors,
            data: b[at.next_multiple_of(32)..].to_vec(),
        }
    })
}

/// The fuzzer's bytes, read as edits.
struct Edits<'a>(&'a [u8]);

impl Edits<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }

    fn u64(&mut self) -> Option<u64> {
        let mut v = [0u8; 8];
        for b in &mut v {
            *b = self.byte()?;
        }
        Some(u64::from_le_bytes(v))
    }

    /// An index into a list of `n` (`None` when it is empty).
    fn index(&mut self, n: usize) -> Option<usize> {
        let b = self.byte()?;
        (n > 0).then(|| usize::from(b) % n)
    }
}

fn offset_of(info: &[u8]) -> u64 {
    let at = info.len() - 8;
    u64::from_le_bytes(info[at..].try_into().unwrap_or_default())
}

fn set_offset(info: &mut [u8], offset: u64) {
    let at = info.len() - 8;
    info[at..].copy_from_slice(&offset.to_le_bytes());
}

/// A `general.alignment` entry of value type `ty` holding `v` (as many of
/// its low bytes as the type takes; a string or an array of u32 for those
/// types).
fn alignment_entry(ty: u32, v: u64) -> Vec<u8> {
    let key = b"general.alignment";
    let mut e = (key.len() as u64).to_le_bytes().to_vec();
    e.extend(key);
    e.extend(ty.to_le_bytes());
    match ty {
        0 | 1 | 7 => e.push(v as u8),
        2 | 3 => e.extend((v as u16).to_le_bytes()),
        4..=6 => e.extend((v as u32).to_le_bytes()),
        8 => {
            let s = v.to_string();
            e.extend((s.len() as u64).to_le_bytes());
            e.extend(s.as_bytes());
        }
        9 => {
            e.extend(4u32.to_le_bytes());
            e.extend(1u64.to_le_bytes());
            e.extend((v as u32).to_le_bytes());
        }
        _ => e.extend(v.to_le_bytes()),
    }
    e
}

/// The fixture with `edits` applied and its header rebuilt; `None` where
/// the edits run out mid-way (the fuzzer learns to finish them).
fn mutate(edits: &[u8]) -> Option<Vec<u8>> {
    let p = parts();
    let (mut kv, mut tensors, mut data) = (p.kv.clone(), p.tensors.clone(), p.data.clone());
    let mut align = 32usize;
    let mut pokes = Vec::new();
    let mut e = Edits(edits);
    for _ in 0..MAX_EDITS {
        let Some(op) = e.byte() else { break };
        match op % 11 {
            0 => {
                let (i, j) = (e.index(kv.len())?, e.index(kv.len() + 1)?);
                kv.insert(j, kv[i].clone());
            }
            1 => {
                let (i, j) = (e.index(tensors.len())?, e.index(tensors.len() + 1)?);
                tensors.insert(j, tensors[i].clone());
            }
            2 => {
                let i = e.index(kv.len())?;
                kv.remove(i);
            }
            3 => {
                let i = e.index(tensors.len())?;
                tensors.remove(i);
            }
            4 => {
                let i = e.index(tensors.len())?;
                let delta = i64::from(i16::from_le_bytes([e.byte()?, e.byte()?]));
                let o = offset_of(&tensors[i]).wrapping_add_signed(delta);
                set_offset(&mut tensors[i], o);
            }
            5 => {
                let i = e.index(tensors.len())?;
                let o = e.u64()?;
                set_offset(&mut tensors[i], o);
            }
            6 => {
                let (i, j) = (e.index(tensors.len())?, e.index(tensors.len())?);
                let o = offset_of(&tensors[i]);
                set_offset(&mut tensors[j], o);
            }
            7 => {
                let ty = u32::from(e.byte()? % 14);
                let v = e.u64()?;
                let j = e.index(kv.len() + 1)?;
                kv.insert(j, alignment_entry(ty, v));
            }
            8 => align = 1 << (e.byte()? % 13),
            9 => {
                let cut = usize::from(u16::from_le_bytes([e.byte()?, e.byte()?]));
                data.truncate(data.len().saturating_sub(cut));
            }
            _ => pokes.push((u16::from_le_bytes([e.byte()?, e.byte()?]), e.byte()?)),
        }
    }
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((kv.len() as u64).to_le_bytes());
    kv.iter().for_each(|k| b.extend(k));
    tensors.iter().for_each(|t| b.extend(t));
    b.resize(b.len().next_multiple_of(align), 0);
    b.extend(data);
    let len = b.len();
    for (at, v) in pokes {
        b[usize::from(at) % len] = v;
    }
    Some(b)
}

/// What loading and `multihead inspect` do with a GGUF file's bytes.
fn exercise(bytes: Vec<u8>) {
    let len = bytes.len();
    let Ok(file) = GgufFile::from_bytes(bytes, "fuzz.gguf") else {
        return;
    };
    let mut names = HashSet::new();
    let mut ranges = Vec::new();
    for t in file.tensors() {
        assert!(names.insert(t.name.as_str()), "tensor {:?} twice", t.name);
        assert!(
            t.range.start <= t.range.end && t.range.end <= len,
            "{:?}: {:?}",
            t.name,
            t.range
        );
        if !t.range.is_empty() {
            ranges.push(t.range.clone());
        }
    }
    // Sorted by start, any overlap is one between neighbours.
    ranges.sort_by_key(|r| r.start);
    for w in ranges.windows(2) {
        assert!(w[0].end <= w[1].start, "{:?} and {:?} overlap", w[0], w[1]);
    }
    let _ = file.non_finite(file.tensors().iter().map(|t| t.name.as_str()));
    let _ = file.weight_dtype();
    for k in file.keys() {
        let _ = (file.usize(k), file.float(k), file.string(k), file.bool(k));
        let _ = (file.strings(k), file.integers(k));
    }
    for t in file.tensors().iter().take(8) {
        let _ = file.tensor(&t.name, &Device::Cpu);
    }
    let Ok((_, report)) = DecoderModel::gguf_preflight(&file) else {
        return;
    };
    let _ = report.summary();
    if report.is_clean() {
        let _ = TextTokenizer::from_gguf(&file);
        let _ = HfGenerationConfig::from_gguf(&file);
        let _ = DecoderModel::from_gguf_file(&file, &Device::Cpu, &LoadOptions::default());
    }
}

fuzz_target!(|data: &[u8]| {
    match data.first() {
        Some(b'G') => exercise(data.to_vec()),
        _ => {
            if let Some(bytes) = mutate(data) {
                exercise(bytes);
            }
        }
    }
});
