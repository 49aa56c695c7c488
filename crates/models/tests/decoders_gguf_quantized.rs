//! GGUF files in ggml's 2- to 6-bit block formats as `llama-quantize`
//! writes them (Q4_0, Q4_K_M, Q5_K_M, Q6_K, Q3_K_M, Q2_K of one tiny
//! Llama, `scripts/make_gguf_fixtures.py`) against HF transformers over the
//! weights as the file stores them (gguf-py's own dequantization, in f32):
//! loaded as f32 the logits are HF's to float rounding; kept in their
//! blocks (`ggml`, what `multihead generate` does) they are HF's within the
//! inputs' 8-bit quantization, as llama.cpp computes them, with the same
//! top token nearly everywhere.

use anyhow::{Context, Result};
use candle::{DType, Device, Tensor};
use multihead_attention::BlockFormat;
use multihead_models::checkpoint::{block_format, GgufFile, WeightDtype};
use multihead_models::decoder::{CausalLm, DecoderModel, TextGenerator};
use multihead_test_support::{
    compare::{assert_close, max_abs_diff},
    fixtures::{fixture_dir, Fixture},
    gguf::{logits, opts},
};

/// The quantized files of model `llama256`.
const TYPES: [&str; 6] = ["q4_0", "q4_k_m", "q5_k_m", "q6_k", "q3_k_m", "q2_k"];

fn file(ty: &str) -> std::path::PathBuf {
    fixture_dir("gguf").join(format!("llama256-{ty}.gguf"))
}

fn expected() -> Result<Fixture> {
    Fixture::load(
        &fixture_dir("gguf").join("expected-quantized.safetensors"),
        &Device::Cpu,
    )
}

fn top1(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.argmax(2)?.flatten_all()?.to_vec1()?)
}

/// Every file dequantized to f32 at load gives HF's logits within 1e-5
/// of the largest: our reading of every block format (and of the rows of
/// q and k the converter permuted) is gguf-py's.
#[test]
fn dequantized_logits_equal_hf_s() -> Result<()> {
    let f = expected()?;
    let input = f.get("llama256.input_ids")?.to_dtype(DType::U32)?;
    for ty in TYPES {
        let want = f.get(&format!("llama256.{ty}.logits"))?;
        let model = DecoderModel::from_gguf(&file(ty), &Device::Cpu, &opts(WeightDtype::F32))
            .with_context(|| format!("loading {ty}"))?;
        let got = logits(&model, &input)?;
        assert_close(&format!("{ty} as f32"), &got, want, 1e-5)?;
    }
    Ok(())
}

/// Kept in its blocks, each file's logits are HF's within 4 % of the
/// largest (the inputs rounded to 8 bits per block, as llama.cpp rounds
/// them) and the top token is HF's at 90 % of the positions or more;
/// prefill plus cached steps give the full pass's logits.
#[test]
fn block_logits_equal_hf_s_within_the_inputs_quantization() -> Result<()> {
    let f = expected()?;
    let input = f.get("llama256.input_ids")?.to_dtype(DType::U32)?;
    for ty in TYPES {
        let path = file(ty);
        let gguf = GgufFile::read(&path)?;
        assert_eq!(gguf.weight_dtype(), Some(WeightDtype::Ggml), "{ty}");
        let want = f.get(&format!("llama256.{ty}.logits"))?;
        let model = DecoderModel::from_gguf_file(&gguf, &Device::Cpu, &opts(WeightDtype::Ggml))?;
        let got = logits(&model, &input)?;
        let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
        let err = max_abs_diff(&got, want)? / scale;
        let (a, b) = (top1(&got)?, top1(want)?);
        let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
        eprintln!(
            "{ty}: max |ours - HF| {:.2e} of the largest logit, top-1 as HF's at {same} of {}",
            err,
            a.len()
        );
        assert!(err <= 4e-2, "{ty}: {err:.3e} of the largest logit");
        assert!(same * 10 >= a.len() * 9, "{ty}: top-1 at {same} of {}", a.len());

        // Prefill of all but the last 4, then one token at a time.
        let n = input.dim(1)?;
        let mut cache = model.new_cache(vec![]);
        let mut parts = vec![model.forward(&input.narrow(1, 0, n - 4)?, &mut cache)?];
        for t in n - 4..n {
            parts.push(model.forward(&input.narrow(1, t, 1)?, &mut cache)?);
        }
        let stepped = Tensor::cat(&parts, 1)?;
        assert_close(&format!("{ty}: cached steps"), &stepped, &got, 1e-5)?;
    }
    Ok(())
}

/// `TextGenerator::from_gguf` (the file's own tokenizer, kept in its
/// blocks by `weight_dtype`) continues each prompt greedily with HF's ids
/// over the same weights up to the first step whose two best logits HF
/// puts within 0.2 of each other (the inputs' 8-bit rounding moves these
/// logits by up to 2.5 % of the largest), and at least 3 steps over the 18
/// prompts and files (15 as made).
#[test]
fn greedy_ids_are_hf_s_up_to_a_close_call() -> Result<()> {
    let f = expected()?;
    let case = &f.case["models"]["llama256"];
    let mut compared = 0;
    for ty in TYPES {
        let gguf = GgufFile::read(&file(ty))?;
        let opts = opts(gguf.weight_dtype().context("dtype")?);
        let g = TextGenerator::from_gguf_file(&gguf, None, &Device::Cpu, &opts)?;
        let mut settings = g.settings();
        settings.max_new_tokens = 8;
        settings.sampling = None;
        for p in case["prompts"].as_array().context("prompts")? {
            let want = &p["greedy_by_type"][ty];
            let ids: Vec<u32> = want["ids"]
                .as_array()
                .context("ids")?
                .iter()
                .filter_map(|v| v.as_u64())
                .map(|v| v as u32)
                .collect();
            let margins: Vec<f64> = want["margins"]
                .as_array()
                .context("margins")?
                .iter()
                .filter_map(|v| v.as_f64())
                .collect();
            let sure = margins.iter().take_while(|&&m| m >= 0.2).count();
            let out = g.generate(p["text"].as_str().context("text")?, &settings, &mut |_| Ok(()))?;
            assert_eq!(
                out.ids[..sure.min(out.ids.len())],
                ids[..sure.min(ids.len())],
                "{ty}: {}",
                p["text"]
            );
            compared += sure;
        }
    }
    assert!(compared >= 3, "only {compared} steps were far from a tie");
    Ok(())
}

/// The files hold the block formats `llama-quantize` writes for each
/// name (Q4_K_M: Q4_K with Q6_K for v, down and the output), all read.
#[test]
fn the_files_hold_the_formats_their_names_say() -> Result<()> {
    for (ty, formats) in [
        ("q4_0", &[BlockFormat::Q4_0, BlockFormat::Q6_K][..]),
        ("q4_k_m", &[BlockFormat::Q4_K, BlockFormat::Q6_K]),
        ("q5_k_m", &[BlockFormat::Q5_K, BlockFormat::Q6_K]),
        ("q6_k", &[BlockFormat::Q6_K]),
        ("q3_k_m", &[BlockFormat::Q3_K]),
        ("q2_k", &[BlockFormat::Q2_K]),
    ] {
        let gguf = GgufFile::read(&file(ty))?;
        let held: Vec<BlockFormat> = gguf
            .tensors()
            .iter()
            .filter_map(|t| block_format(t.ggml_type))
            .collect();
        for f in formats {
            assert!(held.contains(f), "{ty}: no {} tensor in {held:?}", f.name());
        }
    }
    Ok(())
}

/// Loading a folder with `ggml` is refused by name: it keeps a GGUF
/// file's blocks, which a folder does not have.
#[test]
fn ggml_is_refused_for_a_folder() {
    let dir = fixture_dir("decoders").join("llama");
    let err = DecoderModel::from_folder_with(&dir, &Device::Cpu, &opts(WeightDtype::Ggml))
        .unwrap_err()
        .to_string();
    assert!(err.contains("ggml") && err.contains("GGUF"), "{err}");
}

/// A file mostly in Q8_0 with other matrices in another block format (as
/// `llama-quantize`'s Q6_K writes a model whose widths are not multiples
/// of 256) keeps each matrix in its own blocks by default, none quantized
/// a second time: its logits equal those of the same file read in its
/// blocks explicitly.
#[test]
fn a_mostly_q8_0_file_keeps_its_other_blocks() -> Result<()> {
    use candle::quantized::{gguf_file, GgmlDType, QTensor};

    let src = file("q6_k");
    let mut reader = std::fs::File::open(&src)?;
    let content = gguf_file::Content::read(&mut reader)?;
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut tensors = Vec::new();
    for name in names {
        let t = content.tensor(&mut reader, name, &Device::Cpu)?;
        // Every matrix but the first layer's ffn_down in Q8_0.
        let t = if t.shape().rank() == 2 && name != "blk.0.ffn_down.weight" {
            QTensor::quantize(&t.dequantize(&Device::Cpu)?, GgmlDType::Q8_0)?
        } else {
            t
        };
        tensors.push((name.clone(), t));
    }
    let path = std::env::temp_dir().join(format!("multihead-gguf-{}-mostly-q8_0.gguf", std::process::id()));
    let meta: Vec<(&str, &gguf_file::Value)> =
        content.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut std::fs::File::create(&path)?, &meta, &t)?;

    let gguf = GgufFile::read(&path)?;
    let kept = gguf.info("blk.0.ffn_down.weight").context("ffn_down")?;
    assert_eq!(block_format(kept.ggml_type), Some(BlockFormat::Q6_K));
    assert_eq!(gguf.weight_dtype(), Some(WeightDtype::Ggml));
    let input = expected()?.get("llama256.input_ids")?.to_dtype(DType::U32)?;
    let by_default =
        DecoderModel::from_gguf_file(&gguf, &Device::Cpu, &opts(gguf.weight_dtype().context("dtype")?))?;
    let in_blocks = DecoderModel::from_gguf_file(&gguf, &Device::Cpu, &opts(WeightDtype::Ggml))?;
    let as_q8_0 = DecoderModel::from_gguf_file(&gguf, &Device::Cpu, &opts(WeightDtype::Q8_0))?;
    let got = logits(&by_default, &input)?;
    assert_close("by default", &got, &logits(&in_blocks, &input)?, 1e-6)?;
    // Requantized, the Q6_K matrix's logits move: the comparison can fail.
    assert!(max_abs_diff(&got, &logits(&as_q8_0, &input)?)? > 0.);
    std::fs::remove_file(&path)?;
    Ok(())
}
