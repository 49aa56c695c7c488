//! Attention rollout: where the class token looks, across all layers.

use candle::{bail, DType, Result, Tensor};

/// Attention rollout (Abnar & Zuidema, "Quantifying Attention Flow in
/// Transformers", 2020) of the class token over the patches.
///
/// Each layer's attention is averaged over heads; the residual connection
/// is accounted for by adding the identity and renormalising rows; the
/// layers are then multiplied, first layer rightmost. The class token's
/// row, restricted to patch tokens, is the map.
///
/// # Shapes
/// - `attentions`: per layer `(batch, heads, tokens, tokens)`, with
///   `tokens = num_prefix_tokens + grid_h * grid_w` and the class token first
/// - returns `(batch, grid_h, grid_w)` in f32, non-negative
pub fn attention_rollout(
    attentions: &[Tensor],
    num_prefix_tokens: usize,
    (grid_h, grid_w): (usize, usize),
) -> Result<Tensor> {
    let Some(first) = attentions.first() else {
        bail!("attention_rollout: no attention weights (a model without blocks)")
    };
    let (b, _, n, _) = first.dims4()?;
    if num_prefix_tokens == 0 {
        bail!("attention_rollout: the model has no class token to follow")
    }
    if n != num_prefix_tokens + grid_h * grid_w {
        bail!("attention_rollout: {n} tokens do not match {num_prefix_tokens} prefix tokens and a {grid_h}x{grid_w} grid")
    }
    let eye = Tensor::eye(n, DType::F32, first.device())?;
    let mut rollout = eye.broadcast_left(b)?;
    for a in attentions {
        // (B, N, N)
        let a = a.to_dtype(DType::F32)?.mean(1)?;
        let a = a.broadcast_add(&eye)?;
        let a = a.broadcast_div(&a.sum_keepdim(2)?)?;
        rollout = a.matmul(&rollout)?;
    }
    // Class token's row over the patches: (B, gh, gw)
    rollout
        .narrow(1, 0, 1)?
        .narrow(2, num_prefix_tokens, grid_h * grid_w)?
        .reshape((b, grid_h, grid_w))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle::Device;

    /// One layer of uniform attention over 1 + 4 tokens: after adding the
    /// identity each row is (0.2 + [i == j]) / 2, so the class token gives
    /// 0.1 to every patch.
    #[test]
    fn uniform_attention() -> Result<()> {
        let a = (Tensor::ones((1, 2, 5, 5), DType::F32, &Device::Cpu)? / 5.)?;
        let r = attention_rollout(&[a], 1, (2, 2))?;
        let r: Vec<f32> = r.flatten_all()?.to_vec1()?;
        assert!(r.iter().all(|v| (v - 0.1).abs() < 1e-6), "{r:?}");
        Ok(())
    }

    #[test]
    fn follows_the_attended_patch() -> Result<()> {
        // The class token attends only to patch 2 (token 3) in every layer.
        let mut w = vec![0f32; 25];
        w[3] = 1.;
        for i in 1..5 {
            w[i * 5 + i] = 1.;
        }
        let a = Tensor::from_vec(w, (1, 1, 5, 5), &Device::Cpu)?;
        let r = attention_rollout(&[a.clone(), a], 1, (2, 2))?;
        let r: Vec<f32> = r.flatten_all()?.to_vec1()?;
        let max = r.iter().cloned().fold(f32::MIN, f32::max);
        assert_eq!(r[2], max, "{r:?}");
        assert!(r[0] == 0. && r[1] == 0. && r[3] == 0.);
        Ok(())
    }
}
