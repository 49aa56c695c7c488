//! A tokenizer not rebuilt asks for its tokenizer.json; bad GGUF files are
//! refused by name: truncated ones, unknown
//! architectures and metadata, unsupported types and wrong tensors,
//! hostile headers, tensors holding NaN or infinity (the fixtures of
//! `decoders_gguf.rs`, edited).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle::quantized::gguf_file::Value as GgufValue;
use candle::quantized::{GgmlDType, QTensor};
use candle::{DType, Device, Tensor};
use multihead_models::checkpoint::{GgufFile, LoadOptions};
use multihead_models::decoder::{DecoderModel, TextGenerator};
use multihead_test_support::{
    errors::{assert_err, assert_mentions},
    fixtures::fixture_dir,
    gguf::{expected, gguf, load_error, model_case, rewrite, set, Meta, MetaEdit, Tensors, FILES},
    tokens::ids,
};

/// A file whose tokenizer model is not rebuilt (WordPiece, `bert`) asks
/// for the tokenizer.json, naming the model; with it, the same model
/// generates. The tokenizer given replaces the file's.
#[test]
fn an_unrebuilt_tokenizer_needs_tokenizer_json() -> Result<()> {
    let path = rewrite("llama", "wpm", |meta, _| {
        set(meta, "tokenizer.ggml.model", GgufValue::String("bert".into()));
        Ok(())
    })?;
    let err = TextGenerator::from_gguf(&path, None, &Device::Cpu, &LoadOptions::default());
    assert_err(
        err,
        &[
            "tokenizer.ggml.model 'bert'",
            "--tokenizer",
            "tokenizer.json",
            &path.display().to_string(),
        ],
    );
    let json = fixture_dir("text").join("llama3").join("tokenizer.json");
    let g = TextGenerator::from_gguf(&path, Some(&json), &Device::Cpu, &LoadOptions::default())?;
    let f = expected()?;
    let p = &model_case(&f, "llama")?["prompts"][0];
    assert_eq!(
        g.tokenizer().encode(p["text"].as_str().context("text")?)?,
        ids(&p["ids"])
    );
    std::fs::remove_file(&path)?;
    Ok(())
}

/// Loading `path` is refused naming `needles` and the file, which is
/// removed.
fn assert_refused(path: &Path, needles: &[&str]) -> Result<()> {
    let msg = load_error(path);
    std::fs::remove_file(path)?;
    assert_mentions(&msg, needles);
    assert_mentions(&msg, &[&path.display().to_string()]);
    Ok(())
}

/// Truncated files, at the tensors or in the header, are refused naming
/// the file (and the first tensor that does not fit).
#[test]
fn truncated_files_are_refused() -> Result<()> {
    let bytes = std::fs::read(gguf("llama", "q8_0"))?;
    let dir = std::env::temp_dir();
    for (cut, needles) in [
        (bytes.len() - 100, vec!["past the end of the file", "tensor '"]),
        (bytes.len() / 2, vec!["past the end of the file"]),
        (100, vec!["truncated"]),
        (3, vec!["not a GGUF file"]),
    ] {
        let path = dir.join(format!("multihead-gguf-{}-cut{cut}.gguf", std::process::id()));
        std::fs::write(&path, &bytes[..cut])?;
        assert_refused(&path, &needles)?;
    }
    Ok(())
}

/// Another architecture is refused with the list this loader runs; so are
/// metadata it cannot honour.
#[test]
fn unknown_architectures_and_metadata_are_refused() -> Result<()> {
    let cases: [(&str, MetaEdit, Vec<&str>); 4] = [
        (
            "gemma",
            Box::new(|m| set(m, "general.architecture", GgufValue::String("gemma".into()))),
            vec![
                "'gemma' is not supported",
                "llama, qwen2, qwen3, smollm3, olmo2, phi3, gemma2, gemma3",
            ],
        ),
        (
            "yarn",
            Box::new(|m| set(m, "llama.rope.scaling.type", GgufValue::String("yarn".into()))),
            vec!["llama.rope.scaling.type", "'yarn'"],
        ),
        (
            "unknown-key",
            Box::new(|m| set(m, "llama.attention.clamp_kqv", GgufValue::F32(8.))),
            vec!["llama.attention.clamp_kqv"],
        ),
        (
            "moe",
            Box::new(|m| set(m, "llama.expert_count", GgufValue::U32(8))),
            vec!["llama.expert_count", "mixture-of-experts"],
        ),
    ];
    for (tag, edit, needles) in cases {
        let path = rewrite("llama", tag, |m, _| {
            edit(m);
            Ok(())
        })?;
        assert_refused(&path, &needles)?;
    }
    Ok(())
}

/// What llama.cpp's `smollm3` and `olmo2` read beyond these loaders is
/// refused naming the key: OLMo 3's sliding windows (its files are arch
/// `olmo2`, with `sliding_window` and the pattern of layers that use it)
/// and an attention scale. An OLMo 2 file whose norms carry Llama's names
/// is refused naming them.
#[test]
fn smollm3_and_olmo2_metadata_they_do_not_run_is_refused() -> Result<()> {
    let cases: [(&str, &str, MetaEdit, Vec<&str>); 3] = [
        (
            "olmo2",
            "window",
            Box::new(|m| set(m, "olmo2.attention.sliding_window", GgufValue::U32(4096))),
            vec!["olmo2.attention.sliding_window", "sliding windows"],
        ),
        (
            "olmo2",
            "pattern",
            Box::new(|m| {
                let pattern = GgufValue::Array(vec![GgufValue::Bool(true), GgufValue::Bool(false)]);
                set(m, "olmo2.attention.sliding_window_pattern", pattern)
            }),
            vec![
                "olmo2.attention.sliding_window_pattern",
                "not one this loader can honour",
            ],
        ),
        (
            "smollm3",
            "scale",
            Box::new(|m| set(m, "smollm3.attention.scale", GgufValue::F32(0.5))),
            vec!["smollm3.attention.scale", "not one this loader can honour"],
        ),
    ];
    for (name, tag, edit, needles) in cases {
        let path = rewrite(name, tag, |m, _| {
            edit(m);
            Ok(())
        })?;
        assert_refused(&path, &needles)?;
    }
    let renamed = rewrite("olmo2", "llama-names", |_, tensors| {
        for (name, _) in tensors.iter_mut() {
            if name == "blk.0.post_attention_norm.weight" {
                *name = "blk.0.ffn_norm.weight".into();
            }
        }
        Ok(())
    })?;
    assert_refused(
        &renamed,
        &[
            "1 missing: blk.0.post_attention_norm.weight [32]",
            "1 unexpected: blk.0.ffn_norm.weight",
        ],
    )
}

/// What a Gemma file says that llama.cpp would not run as its author's
/// model is refused naming the key: a soft-cap on Gemma 3's scores (which
/// llama.cpp's `gemma3` ignores), an attention scale (neither Gemma reads
/// one), a Gemma 2 window of 0 (every key hidden from its sliding layers)
/// or logit cap of 0 (llama.cpp divides by it), a per-layer pattern of
/// the wrong length, a layer count far past any model's (refused before
/// any per-layer table is built; SmolLM3's too). A `gemma2` file holding `output.weight` (llama.cpp's
/// Gemma 2 always projects with the embeddings) or lacking the norm
/// before the MLP is refused naming the tensor.
#[test]
fn gemma_metadata_they_do_not_run_is_refused() -> Result<()> {
    let cases: [(&str, &str, MetaEdit, Vec<&str>); 7] = [
        (
            "gemma3",
            "layers",
            Box::new(|m| set(m, "gemma3.block_count", GgufValue::U64(1 << 40))),
            vec!["gemma3.block_count", "must be in 1..="],
        ),
        (
            "smollm3",
            "layers",
            Box::new(|m| set(m, "smollm3.block_count", GgufValue::U64(1 << 40))),
            vec!["smollm3.block_count", "must be in 1..="],
        ),
        (
            "gemma3",
            "attn-cap",
            Box::new(|m| set(m, "gemma3.attn_logit_softcapping", GgufValue::F32(50.))),
            vec!["gemma3.attn_logit_softcapping", "not one this loader can honour"],
        ),
        (
            "gemma2",
            "scale",
            Box::new(|m| set(m, "gemma2.attention.scale", GgufValue::F32(0.25))),
            vec!["gemma2.attention.scale", "not one this loader can honour"],
        ),
        (
            "gemma2",
            "window-0",
            Box::new(|m| set(m, "gemma2.attention.sliding_window", GgufValue::U32(0))),
            vec!["gemma2.attention.sliding_window", "is 0"],
        ),
        (
            "gemma2",
            "cap-0",
            Box::new(|m| set(m, "gemma2.final_logit_softcapping", GgufValue::F32(0.))),
            vec!["gemma2.final_logit_softcapping", "must be finite and > 0"],
        ),
        (
            "gemma3",
            "pattern-length",
            Box::new(|m| {
                let pattern = GgufValue::Array(vec![GgufValue::Bool(true); 3]);
                set(m, "gemma3.attention.sliding_window_pattern", pattern)
            }),
            vec![
                "gemma3.attention.sliding_window_pattern",
                "3 entries for 6 layers",
            ],
        ),
    ];
    for (name, tag, edit, needles) in cases {
        let path = rewrite(name, tag, |m, _| {
            edit(m);
            Ok(())
        })?;
        assert_refused(&path, &needles)?;
    }
    let untied = rewrite("gemma2", "output", |_, tensors| {
        let embd = tensors
            .iter()
            .find(|(n, _)| n == "token_embd.weight")
            .map(|(_, t)| t.dequantize(&Device::Cpu))
            .context("token_embd")??;
        tensors.push(("output.weight".into(), QTensor::quantize(&embd, GgmlDType::F32)?));
        Ok(())
    })?;
    assert_refused(&untied, &["1 unexpected: output.weight"])?;
    let no_pre_norm = rewrite("gemma3", "no-ffn-norm", |_, tensors| {
        tensors.retain(|(n, _)| n != "blk.2.ffn_norm.weight");
        Ok(())
    })?;
    assert_refused(&no_pre_norm, &["1 missing: blk.2.ffn_norm.weight [32]"])
}

/// A tensor stored in a ggml type this loader does not read (Q8_1 here,
/// the inputs' format of ggml's Q4_1 and Q5_1 products, never a weight's)
/// is refused by name and type; a tensor the model lacks, or one it does
/// not know, is named too.
#[test]
fn unsupported_types_and_wrong_tensors_are_named() -> Result<()> {
    let q4 = rewrite("llama", "q4", |_, tensors| {
        for (name, t) in tensors.iter_mut() {
            if name == "blk.1.ffn_up.weight" {
                *t = QTensor::quantize(&t.dequantize(&Device::Cpu)?, GgmlDType::Q8_1)?;
            }
        }
        Ok(())
    })?;
    let msg = load_error(&q4);
    std::fs::remove_file(&q4)?;
    assert_mentions(
        &msg,
        &["blk.1.ffn_up.weight", "Q8_1", "F32, F16, BF16, Q8_0, Q4_0"],
    );

    let odd = rewrite("llama", "odd", |_, tensors| {
        tensors.retain(|(n, _)| n != "blk.0.ffn_down.weight");
        let extra = QTensor::quantize(&Tensor::zeros(32, DType::F32, &Device::Cpu)?, GgmlDType::F32)?;
        tensors.push(("blk.0.ffn_mystery.weight".into(), extra));
        Ok(())
    })?;
    let msg = load_error(&odd);
    std::fs::remove_file(&odd)?;
    assert_mentions(
        &msg,
        &[
            "1 missing: blk.0.ffn_down.weight [32, 64]",
            "1 unexpected: blk.0.ffn_mystery.weight",
        ],
    );
    Ok(())
}

/// Headers candle's reader accepts but that must not be trusted: an
/// alignment of 0 (candle divides by it) and dims whose product overflows
/// are errors, not a crash or an allocation of that size.
#[test]
fn hostile_headers_are_errors() -> Result<()> {
    let zero = rewrite("qwen2", "align0", |m, _| {
        set(m, "general.alignment", GgufValue::U32(0));
        Ok(())
    })?;
    let msg = load_error(&zero);
    std::fs::remove_file(&zero)?;
    assert_mentions(&msg, &["alignment"]);

    // A GGUF v3 header by hand: no metadata, one F32 tensor of 2^40 x 2^40.
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend(4u64.to_le_bytes());
    b.extend(b"huge");
    b.extend(2u32.to_le_bytes());
    b.extend((1u64 << 40).to_le_bytes());
    b.extend((1u64 << 40).to_le_bytes());
    b.extend(0u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.resize(96, 0);
    let err = GgufFile::from_bytes(b.clone(), "huge.gguf").map(|_| ());
    assert_err(err, &["huge.gguf", "'huge'", "overflows"]);
    // 2^20 x 2^20 does not overflow but is far larger than the file.
    b[40..48].copy_from_slice(&(1u64 << 20).to_le_bytes());
    b[48..56].copy_from_slice(&(1u64 << 20).to_le_bytes());
    let err = GgufFile::from_bytes(b, "big.gguf").map(|_| ());
    assert_err(err, &["big.gguf", "'huge'", "past the end of the file"]);
    Ok(())
}

/// A copy of fixture `{name}-{ty}.gguf` in a temporary file with bytes of
/// tensor `tensor` overwritten: `(byte offset in the tensor's data, bytes)`.
fn patched(name: &str, ty: &str, tensor: &str, patches: &[(usize, Vec<u8>)]) -> Result<PathBuf> {
    let src = gguf(name, ty);
    let range = GgufFile::read(&src)?
        .info(tensor)
        .with_context(|| format!("{name}-{ty} has no tensor {tensor}"))?
        .range
        .clone();
    let mut bytes = std::fs::read(&src)?;
    for (at, b) in patches {
        bytes[range.start + at..][..b.len()].copy_from_slice(b);
    }
    let path = std::env::temp_dir().join(format!(
        "multihead-gguf-{}-{name}-{ty}-{tensor}.gguf",
        std::process::id()
    ));
    std::fs::write(&path, bytes)?;
    Ok(path)
}

/// One file of `non_finite_tensors_are_refused_by_name`: fixture
/// `{name}-{ty}.gguf` with bytes of `tensor` (of type `ggml`) patched, and
/// the counts `(NaN, Inf)` written out where they are.
struct Patch {
    name: &'static str,
    ty: &'static str,
    tensor: &'static str,
    ggml: GgmlDType,
    patches: Vec<(usize, Vec<u8>)>,
    counts: Option<(usize, usize)>,
}

/// A tensor holding NaN or infinity is refused before the model is built,
/// named with its counts as a safetensors file's pre-flight names it: f32,
/// f16 and bf16 elements patched in a copy of a fixture (the counts
/// written out), and Q8_0 block scales, one NaN and one infinite, whose
/// counts are those of the values the file's tensor reads as
/// (`GgufFile::tensor`, classified here with `is_nan`/`is_infinite`).
#[test]
fn non_finite_tensors_are_refused_by_name() -> Result<()> {
    let f16 = |bits: u16| bits.to_le_bytes().to_vec();
    let f32s = |x: f32| x.to_le_bytes().to_vec();
    let cases = [
        Patch {
            name: "llama",
            ty: "f32",
            tensor: "blk.1.attn_v.weight",
            ggml: GgmlDType::F32,
            patches: vec![(4 * 5, f32s(f32::NAN)), (4 * 9, f32s(f32::NEG_INFINITY))],
            counts: Some((1, 1)),
        },
        // f16: 0x7e00 NaN, 0x7c00 +Inf, 0xfc00 -Inf.
        Patch {
            name: "llama",
            ty: "f16",
            tensor: "blk.0.ffn_up.weight",
            ggml: GgmlDType::F16,
            patches: vec![(2 * 3, f16(0x7e00)), (2 * 4, f16(0x7c00)), (2 * 60, f16(0xfc00))],
            counts: Some((1, 2)),
        },
        // bf16: 0x7fc0 NaN, 0xff80 -Inf.
        Patch {
            name: "qwen3",
            ty: "bf16",
            tensor: "blk.1.ffn_down.weight",
            ggml: GgmlDType::BF16,
            patches: vec![(0, f16(0x7fc0)), (2, f16(0x7fc0)), (2 * 17, f16(0xff80))],
            counts: Some((2, 1)),
        },
        // Block 0's scale NaN, block 2's +Inf (34-byte blocks).
        Patch {
            name: "qwen2",
            ty: "q8_0",
            tensor: "blk.0.attn_k.weight",
            ggml: GgmlDType::Q8_0,
            patches: vec![(0, f16(0x7e00)), (2 * 34, f16(0x7c00))],
            counts: None,
        },
        // Q4_K (144-byte blocks): block 0's scale NaN, block 1's min +Inf
        // (its values -Inf, NaN where a min is 0).
        Patch {
            name: "llama256",
            ty: "q4_k_m",
            tensor: "blk.0.attn_q.weight",
            ggml: GgmlDType::Q4K,
            patches: vec![(0, f16(0x7e00)), (144 + 2, f16(0x7c00))],
            counts: None,
        },
    ];
    for Patch {
        name,
        ty,
        tensor,
        ggml,
        patches,
        counts,
    } in cases
    {
        let path = patched(name, ty, tensor, &patches)?;
        let file = GgufFile::read(&path)?;
        assert_eq!(
            file.info(tensor).map(|t| t.ggml_type),
            Some(ggml),
            "{name}-{ty} {tensor}"
        );
        let values = file
            .tensor(tensor, &Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let read = (
            values.iter().filter(|x| x.is_nan()).count(),
            values.iter().filter(|x| x.is_infinite()).count(),
        );
        if let Some(counts) = counts {
            assert_eq!(read, counts, "{name}-{ty}: the patched values as read");
        }
        assert!(read.0 > 0 && read.1 > 0, "{name}-{ty}: {read:?}");
        assert_eq!(
            file.non_finite(file.tensors().iter().map(|t| t.name.as_str()))?,
            [(tensor.to_string(), read.0, read.1)]
        );
        let msg = load_error(&path);
        std::fs::remove_file(&path)?;
        assert_mentions(
            &msg,
            &[
                &path.display().to_string(),
                &format!("1 with NaN/Inf: {tensor} ({} NaN, {} Inf)", read.0, read.1),
            ],
        );
    }
    // The fixtures themselves are clean.
    for (name, types) in FILES {
        for &ty in types {
            let file = GgufFile::read(&gguf(name, ty))?;
            assert_eq!(
                file.non_finite(file.tensors().iter().map(|t| t.name.as_str()))?,
                [],
                "{name}-{ty}"
            );
        }
    }
    Ok(())
}

/// A GGUF v3 file written by hand: metadata entries `(key, value type,
/// value bytes)`, tensor infos `(name, dims in ggml's order, ggml type,
/// offset)`, then `data` from the header's end padded to `align` (what a
/// reader takes the alignment to be is the test's question).
struct HandGguf {
    kv: Vec<(String, u32, Vec<u8>)>,
    tensors: Vec<(String, Vec<u64>, u32, u64)>,
    align: usize,
    data: Vec<u8>,
}

/// A GGUF string: u64 length, then the bytes.
fn gguf_string(s: &str) -> Vec<u8> {
    let mut b = (s.len() as u64).to_le_bytes().to_vec();
    b.extend(s.as_bytes());
    b
}

impl HandGguf {
    /// One F32 tensor of 8 elements at offset 0, no metadata, data 0..16.
    fn new(name: &str) -> Self {
        Self {
            kv: vec![],
            tensors: vec![(name.to_string(), vec![8], 0, 0)],
            align: 32,
            data: (0..16).flat_map(|i| (i as f32).to_le_bytes()).collect(),
        }
    }

    fn u32_kv(mut self, key: &str, v: u32) -> Self {
        self.kv.push((key.to_string(), 4, v.to_le_bytes().to_vec()));
        self
    }

    /// The header, and where it ends.
    fn header(&self) -> (Vec<u8>, usize) {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend((self.tensors.len() as u64).to_le_bytes());
        b.extend((self.kv.len() as u64).to_le_bytes());
        for (key, ty, value) in &self.kv {
            b.extend(gguf_string(key));
            b.extend(ty.to_le_bytes());
            b.extend(value);
        }
        for (name, dims, ty, offset) in &self.tensors {
            b.extend(gguf_string(name));
            b.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(ty.to_le_bytes());
            b.extend(offset.to_le_bytes());
        }
        let end = b.len();
        (b, end)
    }

    fn bytes(&self) -> Vec<u8> {
        let (mut b, end) = self.header();
        b.resize(end.next_multiple_of(self.align), 0);
        b.extend(&self.data);
        b
    }

    fn read(&self, label: &str) -> candle::Result<GgufFile> {
        GgufFile::from_bytes(self.bytes(), label)
    }
}

/// The hand-written file itself reads, so each refusal below is the one
/// edit's: its tensor holds the data's first 8 floats.
#[test]
fn a_hand_written_gguf_reads() -> Result<()> {
    let file = HandGguf::new("w")
        .u32_kv("general.alignment", 32)
        .read("hand.gguf")?;
    let w = file.tensor("w", &Device::Cpu)?.to_vec1::<f32>()?;
    assert_eq!(w, [0., 1., 2., 3., 4., 5., 6., 7.]);
    Ok(())
}

/// As llama.cpp's `gguf_init_from_file` ("duplicate key", "duplicate
/// tensor name") and gguf-py's reader refuse them: a metadata key or a
/// tensor name given twice (candle's reader keeps the last), named with
/// the file and, for tensors, both data offsets.
#[test]
fn duplicate_keys_and_tensor_names_are_refused() {
    let keys = HandGguf::new("w")
        .u32_kv("general.quantization_version", 2)
        .u32_kv("llama.block_count", 1)
        .u32_kv("general.quantization_version", 3);
    assert_err(
        keys.read("dupkey.gguf").map(|_| ()),
        &[
            "dupkey.gguf",
            "'general.quantization_version'",
            "twice",
            "entries 0 and 2",
        ],
    );

    let mut names = HandGguf::new("w");
    names.tensors.push(("w".into(), vec![8], 0, 32));
    assert_err(
        names.read("dupname.gguf").map(|_| ()),
        &["dupname.gguf", "tensor 'w'", "twice", "data offsets 0 and 32"],
    );

    // candle's reader drops trailing NULs: "w\0" is "w" to it, so "w\0"
    // after "w" is a duplicate too.
    let mut nul = HandGguf::new("w");
    nul.tensors.push(("w\0".into(), vec![8], 0, 32));
    assert_err(
        nul.read("nul.gguf").map(|_| ()),
        &["nul.gguf", "tensor 'w'", "twice"],
    );
}

/// Tensors whose bytes overlap, or whose offset is not a multiple of the
/// file's alignment (GGUF's spec: `align_offset(offset) == offset`), are
/// refused naming the tensors and the offsets; so is a tensor past the
/// end of the data.
#[test]
fn overlapping_and_misaligned_tensors_are_refused() {
    // 16 floats (bytes 0..64) and 8 more at 32: the second half shared.
    let mut overlap = HandGguf::new("a");
    overlap.tensors[0].1 = vec![16];
    overlap.tensors.push(("b".into(), vec![8], 0, 32));
    assert_err(
        overlap.read("overlap.gguf").map(|_| ()),
        &["overlap.gguf", "'a'", "'b'", "overlap", "0..64", "32..64"],
    );
    // The same tensor listed second: the overlap is found whatever the
    // order of the infos.
    overlap.tensors.swap(0, 1);
    assert_err(
        overlap.read("overlap2.gguf").map(|_| ()),
        &["overlap2.gguf", "'a'", "'b'", "overlap"],
    );

    let mut misaligned = HandGguf::new("w");
    misaligned.tensors[0].3 = 16;
    assert_err(
        misaligned.read("misaligned.gguf").map(|_| ()),
        &["misaligned.gguf", "'w'", "offset 16", "alignment 32"],
    );
    // Aligned to 16, the same offset is fine.
    let mut sixteen = HandGguf::new("w").u32_kv("general.alignment", 16);
    sixteen.tensors[0].3 = 16;
    sixteen.align = 16;
    assert!(sixteen.read("sixteen.gguf").is_ok());

    let mut past = HandGguf::new("w");
    past.tensors[0].3 = 64;
    assert_err(
        past.read("past.gguf").map(|_| ()),
        &["past.gguf", "'w'", "past the end of the file"],
    );
}

/// 2^62 f32 elements: a count that fits, a size in bytes that does not
/// (the fuzzer's `gguf_header` found the multiplication overflowing).
#[test]
fn a_size_in_bytes_that_overflows_is_refused() {
    let mut huge = HandGguf::new("w");
    huge.tensors[0].1 = vec![1 << 62];
    assert_err(
        huge.read("huge.gguf").map(|_| ()),
        &["huge.gguf", "'w'", "size in bytes that overflows"],
    );
}

/// `general.alignment` in any integer type moves the data section (candle
/// honours only 8- to 32-bit types and reads a u64's file from the wrong
/// place); zero, negative or not a power of two is refused naming the key.
#[test]
fn general_alignment_of_any_integer_type_is_honoured() -> Result<()> {
    let file = |ty: u32, value: Vec<u8>| {
        let mut f = HandGguf::new("w");
        f.kv.push(("general.alignment".into(), ty, value));
        f.align = 64;
        // Where the data would start at the default 32 is padding (zeros).
        let end = f.header().1;
        assert!(
            end.next_multiple_of(32) < end.next_multiple_of(64),
            "the header must end where 32 and 64 differ: {end}"
        );
        f
    };
    let cases: [(u32, Vec<u8>); 8] = [
        (0, vec![64]),
        (1, vec![64]),
        (2, 64u16.to_le_bytes().to_vec()),
        (3, 64i16.to_le_bytes().to_vec()),
        (4, 64u32.to_le_bytes().to_vec()),
        (5, 64i32.to_le_bytes().to_vec()),
        (10, 64u64.to_le_bytes().to_vec()),
        (11, 64i64.to_le_bytes().to_vec()),
    ];
    for (ty, value) in cases {
        let read = file(ty, value).read("align64.gguf")?;
        let w = read.tensor("w", &Device::Cpu)?.to_vec1::<f32>()?;
        assert_eq!(w, [0., 1., 2., 3., 4., 5., 6., 7.], "value type {ty}");
    }
    for (ty, value, what) in [
        (10, 48u64.to_le_bytes().to_vec(), "48"),
        (10, 0u64.to_le_bytes().to_vec(), "0"),
        (11, (-64i64).to_le_bytes().to_vec(), "-64"),
        (
            10,
            (1u64 << 63).wrapping_add(1).to_le_bytes().to_vec(),
            "9223372036854775809",
        ),
        (6, 64f32.to_le_bytes().to_vec(), "f32"),
    ] {
        assert_err(
            file(ty, value).read("badalign.gguf").map(|_| ()),
            &["badalign.gguf", "'general.alignment'", "power of two", what],
        );
    }
    Ok(())
}

/// Names and strings from a file reach errors escaped: a tensor name, a
/// metadata key and an architecture holding ANSI escapes, a C1 control
/// and a newline are printed as `\u{1b}`, `\u{9b}`, `\n`, and each error
/// stays one line.
#[test]
fn names_from_the_file_are_escaped_in_errors() -> Result<()> {
    // The first line (candle appends a backtrace under RUST_BACKTRACE):
    // a raw newline in the name would end it early.
    let check = |res: candle::Result<()>, escaped: &str| {
        let msg = match res {
            Ok(()) => panic!("expected an error naming {escaped}"),
            Err(e) => e.to_string().lines().next().unwrap_or_default().to_string(),
        };
        assert!(msg.contains(escaped), "{msg:?} does not contain {escaped:?}");
        assert!(!msg.chars().any(char::is_control), "{msg:?}");
    };
    // A tensor of a ggml type this loader does not read (IQ2_XXS).
    let mut iq = HandGguf::new("w\u{1b}[2J\u{9b}31m\nx");
    iq.tensors[0].2 = 16;
    check(iq.read("iq.gguf").map(|_| ()), r"'w\u{1b}[2J\u{9b}31m\nx'");
    // A duplicate key.
    let dup = HandGguf::new("w")
        .u32_kv("k\u{1b}]0;title\u{7}", 1)
        .u32_kv("k\u{1b}]0;title\u{7}", 1);
    check(dup.read("dup.gguf").map(|_| ()), r"'k\u{1b}]0;title\u{7}'");
    // Misaligned, with five dimensions: the name in each message.
    let mut odd = HandGguf::new("\u{1b}[31mred");
    odd.tensors[0].3 = 4;
    check(odd.read("odd.gguf").map(|_| ()), r"'\u{1b}[31mred'");
    odd.tensors[0].1 = vec![8, 1, 1, 1, 1];
    check(odd.read("odd.gguf").map(|_| ()), r"'\u{1b}[31mred'");
    // An architecture the loader does not run, and an unknown key of a
    // known one.
    let mut arch = HandGguf::new("w");
    arch.kv
        .push(("general.architecture".into(), 8, gguf_string("\u{1b}[5mllama")));
    let file = arch.read("arch.gguf")?;
    check(
        DecoderModel::from_gguf_file(&file, &Device::Cpu, &LoadOptions::default()).map(|_| ()),
        r"'\u{1b}[5mllama'",
    );
    let mut key = HandGguf::new("w");
    key.kv
        .push(("general.architecture".into(), 8, gguf_string("llama")));
    key = key.u32_kv("llama.\u{1b}[8m", 1);
    let file = key.read("key.gguf")?;
    check(
        DecoderModel::from_gguf_file(&file, &Device::Cpu, &LoadOptions::default()).map(|_| ()),
        r"'llama.\u{1b}[8m'",
    );
    Ok(())
}

/// An f32 file loaded with its matrices in f16 (`--dtype f16`): a weight
/// past f16's largest (65504) would become infinity, so the load refuses
/// it naming the tensor and the value, as a folder's load does; the file
/// itself loads in f32.
#[test]
fn a_weight_past_f16_s_range_is_refused_when_loading_as_f16() -> Result<()> {
    let path = patched(
        "llama",
        "f32",
        "blk.0.ffn_up.weight",
        &[(8, 1.0e5f32.to_le_bytes().to_vec())],
    )?;
    let f16 = LoadOptions {
        dtype: multihead_models::checkpoint::WeightDtype::F16,
        ..LoadOptions::default()
    };
    let err = DecoderModel::from_gguf(&path, &Device::Cpu, &f16).map(|_| ());
    assert_err(
        err,
        &["tensor 'blk.0.ffn_up.weight' holds 1 value up to 100000, past f16's largest 65504"],
    );
    DecoderModel::from_gguf(&path, &Device::Cpu, &LoadOptions::default())?;
    std::fs::remove_file(&path)?;
    Ok(())
}

/// A Phi-3 file whose LongRoPE is incomplete or misplaced is refused by
/// the tensor or key at fault: one factor tensor without the other,
/// factors of the wrong count for the rotated dims, factors without the
/// original context, factors in another architecture's file.
#[test]
fn bad_longrope_metadata_is_refused_by_name() -> Result<()> {
    let drop = |name: &'static str| {
        move |_: &mut Meta, t: &mut Tensors| -> Result<()> {
            t.retain(|(n, _)| n != name);
            Ok(())
        }
    };
    let path = rewrite("phi3", "no-short", drop("rope_factors_short.weight"))?;
    assert_refused(
        &path,
        &["rope_factors_long.weight", "without 'rope_factors_short.weight'"],
    )?;
    let path = rewrite("phi3", "no-original", |m, _| {
        m.retain(|(k, _)| k != "phi3.rope.scaling.original_context_length");
        Ok(())
    })?;
    assert_refused(&path, &["phi3.rope.scaling.original_context_length"])?;
    let path = rewrite("phi3", "few-factors", |_, t| {
        for (n, q) in t.iter_mut() {
            if n.starts_with("rope_factors_") {
                let short = Tensor::new(&[1f32, 2., 3.], &Device::Cpu)?;
                *q = QTensor::quantize(&short, GgmlDType::F32)?;
            }
        }
        Ok(())
    })?;
    assert_refused(&path, &["'short_factor'", "3 entries", "6"])?;
    let path = rewrite("phi3", "dims", |m, _| {
        set(m, "phi3.rope.dimension_count", GgufValue::U32(7));
        Ok(())
    })?;
    assert_refused(&path, &["7 rotary dims"])?;
    let path = rewrite("phi3", "as-llama", |m, _| {
        let renamed: Meta = m
            .drain(..)
            .map(|(k, v)| (k.replacen("phi3.", "llama.", 1), v))
            .collect();
        *m = renamed;
        set(m, "general.architecture", GgufValue::String("llama".into()));
        Ok(())
    })?;
    assert_refused(&path, &["rope_factors_long.weight", "arch 'phi3' files only"])?;
    Ok(())
}
