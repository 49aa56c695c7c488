//! Rotary embeddings against HF transformers' own functions, in the three
//! forms real checkpoints use (fixture: `tests/fixtures/decoders/rotary.safetensors`,
//! written by `scripts/make_decoder_fixtures.py`): Llama's half-split
//! `apply_rotary_pos_emb` (theta 500000), GPT-NeoX's partial half-split
//! (`rotary_pct` 0.5) and GPT-J's interleaved `rotate_every_two`
//! (`rotary_dim` 8).

use anyhow::Result;
use candle::{DType, Device};
use multihead_attention::{Rotary, RotaryConfig, RotaryStyle};
use multihead_test_support::{
    compare::assert_close,
    fixtures::{fixture_dir, Fixture},
};

#[test]
fn rotary_equals_hf_in_every_form() -> Result<()> {
    let dev = Device::Cpu;
    let f = Fixture::load(&fixture_dir("decoders").join("rotary.safetensors"), &dev)?;
    let (q, k) = (f.get("q")?, f.get("k")?);
    // (T,) positions 5..10 as one batch row: (1, T).
    let positions = f.get("positions")?.to_dtype(DType::U32)?.unsqueeze(0)?;
    let forms = [
        ("half", RotaryConfig::new(500_000.)),
        ("partial", RotaryConfig::new(10_000.).with_dims(8)),
        (
            "interleaved",
            RotaryConfig::new(10_000.)
                .with_dims(8)
                .with_style(RotaryStyle::Interleaved),
        ),
    ];
    for (form, cfg) in forms {
        // The fixture says which theta and rotary_dim HF used.
        let case = &f.case[form];
        assert_eq!(case["theta"].as_f64(), Some(cfg.theta), "{form}: theta");
        assert_eq!(
            case["rotary_dim"].as_u64(),
            Some(cfg.dims.unwrap_or(16) as u64),
            "{form}: dims"
        );
        let rotary = Rotary::new(&cfg, 16)?;
        // f32 sin/cos of positions < 10: within a few ulps of HF's.
        assert_close(
            form,
            &rotary.apply(q, &positions)?,
            f.get(&format!("q_{form}"))?,
            1e-6,
        )?;
        assert_close(
            form,
            &rotary.apply(k, &positions)?,
            f.get(&format!("k_{form}"))?,
            1e-6,
        )?;
    }
    Ok(())
}
