//! A [`Mask`]'s tensors as the kernel's [`MaskPart`]s, the whole mask as
//! the kernel's [`Masking`], and as the `(hidden, added)` pair of a
//! reference path.

use candle::{Device, Result, Tensor};
use multihead_kernels::attention::{Dropout, MaskPart, Masking};

use super::{as_u8, attn_mask_as_4d, float_to_bias, AttnMask, KeyPaddingMask, Mask};

/// `(hidden, added)` of a mask part: `u8`, 1 where the part hides a
/// pair, and the `f32` values it adds to the visible pairs (`None` for
/// boolean parts).
fn hidden_and_added(part: &MaskPart) -> Result<(Tensor, Option<Tensor>)> {
    Ok(match part {
        MaskPart::HideWhereNonZero(t) => (t.ne(0f64)?, None),
        MaskPart::HideWhereZero(t) => (t.eq(0f64)?, None),
        MaskPart::Additive(a) => {
            let hidden = a.eq(f64::NEG_INFINITY)?;
            let added = hidden.where_cond(&a.zeros_like()?, a)?;
            (hidden, Some(added))
        }
    })
}

impl Mask {
    /// The key padding and attention masks as the kernel's [`MaskPart`]s
    /// over `(batch, heads, q_len, kv_len)`, validated; the causal rule is
    /// not among them. The kernel names what a byte does, these types what
    /// PyTorch's `True` means: `PadWhereTrue` and `IgnoreWhereTrue` hide
    /// where non-zero, `AttendWhereTrue` where zero; additive masks stay
    /// additive, `-inf` hiding.
    pub(crate) fn tensor_parts(
        &self,
        (batch, heads, q_len, kv_len): (usize, usize, usize, usize),
    ) -> Result<Vec<MaskPart>> {
        self.validate(batch, heads, q_len, kv_len)?;
        let mut parts = Vec::new();
        if let Some(kp) = &self.key_padding {
            let kp4 = |t: Tensor| t.reshape((batch, 1, 1, kv_len))?.contiguous();
            parts.push(match kp {
                KeyPaddingMask::PadWhereTrue(t) => {
                    MaskPart::HideWhereNonZero(kp4(as_u8(t, "key_padding_mask (PadWhereTrue)")?)?)
                }
                KeyPaddingMask::Additive(t) => {
                    MaskPart::Additive(kp4(float_to_bias(t, "key_padding_mask (Additive)")?)?)
                }
            });
        }
        if let Some(am) = &self.attn {
            let am4 = |t: Tensor| attn_mask_as_4d(&t, batch, heads, q_len, kv_len)?.contiguous();
            parts.push(match am {
                AttnMask::IgnoreWhereTrue(t) => {
                    MaskPart::HideWhereNonZero(am4(as_u8(t, "attn_mask (IgnoreWhereTrue)")?)?)
                }
                AttnMask::AttendWhereTrue(t) => {
                    MaskPart::HideWhereZero(am4(as_u8(t, "attn_mask (AttendWhereTrue)")?)?)
                }
                AttnMask::Additive(t) => MaskPart::Additive(am4(float_to_bias(t, "attn_mask (Additive)")?)?),
            });
        }
        Ok(parts)
    }

    /// The mask as the tiled kernel reads it for queries `q` `(batch,
    /// heads, q_len, ·)` over keys `k`, whose last `appended` lie outside
    /// it, validated: key padding and attention masks in their own shapes
    /// (bytes stay bytes), the causal rule, the window and ALiBi as rules,
    /// so that tiles they hide whole are skipped instead of computed and
    /// masked; with `dropout` on the weights where given.
    pub(crate) fn masking(
        &self,
        q: &Tensor,
        k: &Tensor,
        appended: usize,
        dropout: Option<Dropout>,
    ) -> Result<Masking<'_>> {
        let (batch, heads, q_len, _) = q.dims4()?;
        let kv_len = k.dim(2)?.saturating_sub(appended);
        Ok(Masking {
            parts: self.tensor_parts((batch, heads, q_len, kv_len))?,
            causal: self.causal.map(|c| c.offset(q_len, kv_len)),
            window: self.window,
            alibi: self
                .alibi
                .as_ref()
                .map(|a| (a.slopes(), self.alibi_offset(q_len, kv_len))),
            softcap: self.softcap,
            dropout,
        })
    }

    /// The mask as the reference path applies it, over `(batch, heads,
    /// q_len, kv_len + appended)`: `hidden` (`u8`, 1 where any part or the
    /// causal rule hides a pair) and `added` (`f32`, the sum of the
    /// additive parts over the pairs no part hides), each broadcastable to
    /// that shape, `None` where no part contributes. The last `appended`
    /// keys (`add_bias_kv`, `add_zero_attn`) are visible to every query.
    pub(crate) fn hidden_and_added(
        &self,
        (batch, heads, q_len, kv_len): (usize, usize, usize, usize),
        appended: usize,
        device: &Device,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let mut hidden: Option<Tensor> = None;
        let mut added: Option<Tensor> = None;
        let merge =
            |acc: &mut Option<Tensor>, t: Tensor, f: fn(&Tensor, &Tensor) -> Result<Tensor>| -> Result<()> {
                *acc = Some(match acc.take() {
                    None => t,
                    Some(a) => f(&a, &t)?,
                });
                Ok(())
            };
        if self.causal.is_some() {
            let t = self
                .rule_hidden(q_len, kv_len, device)?
                .reshape((1, 1, q_len, kv_len))?;
            merge(&mut hidden, t, Tensor::broadcast_maximum)?;
        }
        if let Some(a) = &self.alibi {
            let t = a.bias(self.alibi_offset(q_len, kv_len), q_len, kv_len, device)?;
            merge(&mut added, t, Tensor::broadcast_add)?;
        }
        for part in self.tensor_parts((batch, heads, q_len, kv_len))? {
            let (h, a) = hidden_and_added(&part)?;
            merge(&mut hidden, h, Tensor::broadcast_maximum)?;
            if let Some(a) = a {
                merge(&mut added, a, Tensor::broadcast_add)?;
            }
        }
        let pad = |t: Option<Tensor>| -> Result<Option<Tensor>> {
            match t {
                Some(t) if appended > 0 => {
                    let (d0, d1, d2, _) = t.dims4()?;
                    Ok(Some(
                        t.broadcast_as((d0, d1, d2, kv_len))?
                            .pad_with_zeros(3, 0, appended)?,
                    ))
                }
                t => Ok(t),
            }
        };
        Ok((pad(hidden)?, pad(added)?))
    }
}
