//! Unit tests of `VitConfig`: presets, validation messages, JSON.

use super::*;

#[test]
fn presets_validate() -> Result<()> {
    for cfg in [
        VitConfig::tiny_patch16_224(),
        VitConfig::small_patch16_224(),
        VitConfig::base_patch16_224(),
    ] {
        cfg.validate()?;
        assert_eq!(cfg.grid_size(), 14);
        assert_eq!(cfg.mlp_hidden_dim(), 4 * cfg.embed_dim);
    }
    Ok(())
}

#[test]
fn errors_name_the_value() {
    let mut cfg = VitConfig {
        img_size: 30,
        patch_size: 16,
        embed_dim: 64,
        depth: 2,
        num_heads: 4,
        ..VitConfig::default()
    };
    let err = cfg.validate().unwrap_err().to_string();
    assert!(
        err.contains("img_size (30)") && err.contains("patch_size (16)"),
        "{err}"
    );
    cfg.img_size = 32;
    cfg.num_heads = 5;
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("num_heads (5)"), "{err}");
    cfg.num_heads = 4;
    cfg.naming = Naming::Hf;
    cfg.init_values = Some(1e-5);
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("init_values"), "{err}");
}

#[test]
fn json_defaults_and_unknown_fields() -> Result<()> {
    let cfg = VitConfig::from_json(
        r#"{"img_size": 32, "patch_size": 4, "embed_dim": 64, "depth": 2, "num_heads": 4}"#,
    )?;
    assert_eq!(
        cfg,
        VitConfig {
            img_size: 32,
            patch_size: 4,
            embed_dim: 64,
            depth: 2,
            num_heads: 4,
            ..VitConfig::default()
        }
    );
    let err = VitConfig::from_json(
        r#"{"img_size": 32, "patch_size": 4, "embed_dim": 64, "depth": 2, "num_heads": 4, "dept": 3}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("dept"), "{err}");
    let mut cfg = VitConfig {
        img_size: 32,
        patch_size: 4,
        embed_dim: 64,
        depth: 2,
        num_heads: 4,
        hydra_layers: vec![1, 2],
        ..VitConfig::default()
    };
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("block 2"), "{err}");
    cfg.hydra_layers = vec![1];
    let back = VitConfig::from_json(&serde_json::to_string(&cfg).map_err(candle::Error::wrap)?)?;
    assert_eq!(back.attention_kind(1), AttentionKind::Hydra);
    assert_eq!(back.attention_kind(0), AttentionKind::Softmax);
    Ok(())
}
