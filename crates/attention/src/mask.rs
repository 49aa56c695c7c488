//! Attention masks whose meaning is in their type.
//!
//! PyTorch has two opposite boolean conventions: `nn.MultiheadAttention`
//! treats `True` as "masked out", `F.scaled_dot_product_attention` treats
//! `True` as "may attend". Here a boolean mask is always wrapped in a variant
//! that names its polarity ([`AttnMask::IgnoreWhereTrue`],
//! [`AttnMask::AttendWhereTrue`], [`KeyPaddingMask::PadWhereTrue`]), so the
//! two cannot be confused. candle has no `bool` dtype: boolean masks are
//! integer tensors (`u8`, `u32` or `i64`) where non-zero means `true`.
//!
//! A [`Mask`] combines a causal rule, a key padding mask and an attention
//! mask; every part is optional and they add up (a key masked by any part is
//! masked).

use candle::{bail, DType, Device, Result, Tensor};
use multihead_kernels::attention::window_isize;

pub use crate::alibi::Alibi;

mod parts;

/// Where the causal diagonal sits when `q_len != kv_len`.
///
/// Query `i` may attend to key `j` iff `j <= i + offset`, where `offset` is
/// given by the variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Causal {
    /// `offset = 0`: query `i` sees keys `0..=i`. PyTorch's `is_causal=True`
    /// in `F.scaled_dot_product_attention` and
    /// `nn.Transformer.generate_square_subsequent_mask`.
    TopLeft,
    /// `offset = kv_len - q_len`: the last query sees every key. PyTorch's
    /// `torch.nn.attention.bias.causal_lower_right`; the rule for decoding
    /// new queries against a cache that holds the earlier keys.
    BottomRight,
    /// An explicit offset: the first query sits at key position `offset`
    /// (the number of tokens already in a cache).
    Offset(usize),
}

impl Causal {
    /// The diagonal offset for the given lengths; may be negative for
    /// [`Causal::BottomRight`] when `q_len > kv_len` (the first queries then
    /// see no key and return zeros).
    pub fn offset(&self, q_len: usize, kv_len: usize) -> isize {
        match *self {
            Causal::TopLeft => 0,
            Causal::BottomRight => kv_len as isize - q_len as isize,
            Causal::Offset(o) => o as isize,
        }
    }

    /// Whether query `i` may attend to key `j`.
    pub fn allows(&self, i: usize, j: usize, q_len: usize, kv_len: usize) -> bool {
        (j as isize) <= i as isize + self.offset(q_len, kv_len)
    }
}

/// A mask over keys, one row per batch element: shape `(batch, kv_len)`.
#[derive(Debug, Clone)]
pub enum KeyPaddingMask {
    /// Integer tensor, non-zero marks a padding key that no query attends
    /// to. This is PyTorch's boolean `key_padding_mask` (`True` = padding).
    PadWhereTrue(Tensor),
    /// Float tensor added to the scores of each key (PyTorch's float
    /// `key_padding_mask`; `-inf` removes a key).
    Additive(Tensor),
}

impl KeyPaddingMask {
    /// Padding mask for sequences of the given lengths, right-padded to
    /// `kv_len`: key `j` of batch element `b` is padding iff
    /// `j >= lengths[b]`.
    pub fn from_lengths(lengths: &[usize], kv_len: usize, device: &Device) -> Result<Self> {
        if let Some(&l) = lengths.iter().find(|&&l| l > kv_len) {
            bail!("KeyPaddingMask::from_lengths: length {l} exceeds kv_len {kv_len}")
        }
        let data: Vec<u8> = lengths
            .iter()
            .flat_map(|&l| (0..kv_len).map(move |j| u8::from(j >= l)))
            .collect();
        let t = Tensor::from_vec(data, (lengths.len(), kv_len), device)?;
        Ok(Self::PadWhereTrue(t))
    }

    /// Padding mask for sequences of the given lengths, left-padded to
    /// `kv_len` (as batched prompts are for decoder-only generation): key
    /// `j` of batch element `b` is padding iff `j < kv_len - lengths[b]`.
    pub fn from_lengths_left(lengths: &[usize], kv_len: usize, device: &Device) -> Result<Self> {
        if let Some(&l) = lengths.iter().find(|&&l| l > kv_len) {
            bail!("KeyPaddingMask::from_lengths_left: length {l} exceeds kv_len {kv_len}")
        }
        let data: Vec<u8> = lengths
            .iter()
            .flat_map(|&l| (0..kv_len).map(move |j| u8::from(j < kv_len - l)))
            .collect();
        let t = Tensor::from_vec(data, (lengths.len(), kv_len), device)?;
        Ok(Self::PadWhereTrue(t))
    }

    /// The mask's tensor, as given.
    pub(crate) fn tensor(&self) -> &Tensor {
        match self {
            Self::PadWhereTrue(t) | Self::Additive(t) => t,
        }
    }

    /// The additive `f32` bias, shape `(batch, kv_len)`.
    fn bias(&self) -> Result<Tensor> {
        match self {
            Self::PadWhereTrue(t) => bool_to_bias(t, "key_padding_mask (PadWhereTrue)", true),
            Self::Additive(t) => float_to_bias(t, "key_padding_mask (Additive)"),
        }
    }
}

/// A mask over (query, key) pairs.
///
/// Accepted shapes (with `L = q_len`, `S = kv_len`; a dim of 1 broadcasts
/// as in PyTorch):
/// - 2-D `(L, S)`: the same for every batch element and head (`(L, 1)`
///   and `(1, S)` broadcast);
/// - 3-D `(batch * num_heads, L, S)`: PyTorch `nn.MultiheadAttention`'s
///   per-head layout (`(num_heads, L, S)` for unbatched input);
/// - 3-D `(num_heads, L, S)` (or `(1, L, S)`) shared by the batch, as
///   `F.scaled_dot_product_attention` broadcasts it;
/// - 4-D, broadcastable to `(batch, num_heads, L, S)`.
#[derive(Debug, Clone)]
pub enum AttnMask {
    /// Integer tensor, non-zero = this pair is masked out:
    /// `nn.MultiheadAttention`'s boolean `attn_mask` convention.
    IgnoreWhereTrue(Tensor),
    /// Integer tensor, non-zero = this pair may attend:
    /// `F.scaled_dot_product_attention`'s boolean `attn_mask` convention.
    AttendWhereTrue(Tensor),
    /// Float tensor added to the scores (both PyTorch functions' float
    /// `attn_mask`; `-inf` removes a pair).
    Additive(Tensor),
}

impl AttnMask {
    /// The mask's tensor, as given.
    pub(crate) fn tensor(&self) -> &Tensor {
        match self {
            Self::IgnoreWhereTrue(t) | Self::AttendWhereTrue(t) | Self::Additive(t) => t,
        }
    }

    /// The additive `f32` bias, in the mask's own shape.
    fn bias(&self) -> Result<Tensor> {
        match self {
            Self::IgnoreWhereTrue(t) => bool_to_bias(t, "attn_mask (IgnoreWhereTrue)", true),
            Self::AttendWhereTrue(t) => bool_to_bias(t, "attn_mask (AttendWhereTrue)", false),
            Self::Additive(t) => float_to_bias(t, "attn_mask (Additive)"),
        }
    }
}

/// Everything that restricts which keys a query sees. Parts combine: a
/// (query, key) pair is masked if any part masks it, and additive parts add.
///
/// ```
/// use multihead_attention::{AttnMask, Causal, KeyPaddingMask, Mask};
/// # fn main() -> candle::Result<()> {
/// let dev = candle::Device::Cpu;
/// let mask = Mask::new()
///     .with_causal(Causal::TopLeft)
///     .with_key_padding(KeyPaddingMask::from_lengths(&[3, 5], 5, &dev)?);
/// assert!(!mask.is_empty());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Default)]
pub struct Mask {
    /// A causal rule, applied without materialising a tensor where a kernel
    /// can skip the masked blocks.
    pub causal: Option<Causal>,
    /// Per-key mask, `(batch, kv_len)`.
    pub key_padding: Option<KeyPaddingMask>,
    /// Per-pair mask; see [`AttnMask`] for the accepted shapes.
    pub attn: Option<AttnMask>,
    /// Sliding window: with the causal rule, query `i` sees only the
    /// `window` keys ending at its diagonal, `j > i + offset - window`.
    /// Tiles wholly outside the window are skipped. For
    /// [`crate::scaled_dot_product_attention`]; a [`crate::MultiheadAttention`]
    /// takes its window from [`crate::MhaConfig::sliding_window`] and
    /// refuses one here.
    pub window: Option<usize>,
    /// ALiBi: a per-head linear bias on the distance between query and key,
    /// computed where the scores are, never as a matrix. For
    /// [`crate::scaled_dot_product_attention`]; a [`crate::MultiheadAttention`]
    /// takes ALiBi from its config ([`crate::PositionEncoding::Alibi`]) and
    /// refuses it here.
    pub alibi: Option<Alibi>,
    /// Logit soft-capping (Gemma 2's `attn_logit_softcapping`,
    /// FlashAttention's `softcap`): every scaled score `s` becomes `cap ·
    /// tanh(s / cap)` before the other parts mask or bias it, computed
    /// where the scores are. For [`crate::scaled_dot_product_attention`];
    /// a [`crate::MultiheadAttention`] takes it from
    /// [`crate::MhaConfig::softcap`] and refuses it here. Not part of
    /// [`Mask::to_bias`], which is additive.
    pub softcap: Option<f32>,
}

impl Mask {
    /// No masking.
    pub fn new() -> Self {
        Self::default()
    }

    /// Only a causal rule.
    pub fn causal(causal: Causal) -> Self {
        Self::new().with_causal(causal)
    }

    /// Adds (or replaces) the causal rule.
    pub fn with_causal(mut self, causal: Causal) -> Self {
        self.causal = Some(causal);
        self
    }

    /// Adds (or replaces) the key padding mask.
    pub fn with_key_padding(mut self, key_padding: KeyPaddingMask) -> Self {
        self.key_padding = Some(key_padding);
        self
    }

    /// Adds (or replaces) the attention mask.
    pub fn with_attn(mut self, attn: AttnMask) -> Self {
        self.attn = Some(attn);
        self
    }

    /// Adds (or replaces) a sliding window of `window` keys (needs a causal
    /// rule).
    pub fn with_window(mut self, window: usize) -> Self {
        self.window = Some(window);
        self
    }

    /// Adds (or replaces) an ALiBi bias.
    pub fn with_alibi(mut self, alibi: Alibi) -> Self {
        self.alibi = Some(alibi);
        self
    }

    /// Adds (or replaces) logit soft-capping at `cap` (see
    /// [`Mask::softcap`]).
    pub fn with_softcap(mut self, cap: f32) -> Self {
        self.softcap = Some(cap);
        self
    }

    /// Whether no part is set.
    pub fn is_empty(&self) -> bool {
        self.causal.is_none()
            && self.key_padding.is_none()
            && self.attn.is_none()
            && self.window.is_none()
            && self.alibi.is_none()
            && self.softcap.is_none()
    }

    /// Whether the pair `(i, j)` passes the causal rule and the window.
    pub(crate) fn rule_allows(&self, i: usize, j: usize, q_len: usize, kv_len: usize) -> bool {
        let Some(c) = self.causal else { return true };
        let diag = i as isize + c.offset(q_len, kv_len);
        let j = j as isize;
        j <= diag
            && self
                .window
                .is_none_or(|w| j > diag.saturating_sub(window_isize(w)))
    }

    /// The same mask without a window that can hide no key of a
    /// `(q_len, kv_len)` call: a window at least as long as both the
    /// queries and the keys is no window, as in HF transformers.
    pub(crate) fn without_inert_window(&self, q_len: usize, kv_len: usize) -> std::borrow::Cow<'_, Self> {
        match self.window {
            Some(w) if w >= q_len.max(kv_len) && self.causal.is_some() => {
                let mut m = self.clone();
                m.window = None;
                std::borrow::Cow::Owned(m)
            }
            _ => std::borrow::Cow::Borrowed(self),
        }
    }

    /// The diagonal offset ALiBi measures distances from: the causal
    /// rule's, else bottom-right.
    pub(crate) fn alibi_offset(&self, q_len: usize, kv_len: usize) -> isize {
        self.causal.unwrap_or(Causal::BottomRight).offset(q_len, kv_len)
    }

    /// Checks every part's shape against `(batch, heads, q_len, kv_len)`.
    pub fn validate(&self, batch: usize, heads: usize, q_len: usize, kv_len: usize) -> Result<()> {
        match (self.window, self.causal) {
            (Some(0), _) => bail!("Mask: the sliding window must be >= 1 key"),
            (Some(w), None) => bail!("Mask: a sliding window ({w}) needs a causal rule to slide along"),
            _ => {}
        }
        if let Some(cap) = self.softcap {
            if !(cap.is_finite() && cap > 0.) {
                bail!("Mask: the soft-capping cap must be finite and > 0, found {cap}")
            }
        }
        if let Some(a) = &self.alibi {
            if a.slopes().len() != heads {
                bail!(
                    "Mask: ALiBi has {} slopes but the call has {heads} heads",
                    a.slopes().len()
                )
            }
            if let Some(m) = a.slopes().iter().find(|m| !m.is_finite()) {
                bail!("Mask: ALiBi slope {m} is not finite")
            }
        }
        if let Some(kp) = &self.key_padding {
            let dims = kp.tensor().dims();
            if dims != [batch, kv_len] {
                bail!(
                    "key_padding_mask: expected shape (batch, kv_len) = ({batch}, {kv_len}), found {dims:?}"
                )
            }
        }
        if let Some(am) = &self.attn {
            attn_mask_as_4d(am.tensor(), batch, heads, q_len, kv_len)?;
        }
        Ok(())
    }

    /// The whole mask as one additive `f32` bias broadcastable to
    /// `(batch, heads, q_len, kv_len)`: `0` where a pair may attend,
    /// `-inf` where it is masked, other values from additive parts.
    /// `None` when the mask is empty.
    pub fn to_bias(
        &self,
        (batch, heads, q_len, kv_len): (usize, usize, usize, usize),
        device: &Device,
    ) -> Result<Option<Tensor>> {
        self.validate(batch, heads, q_len, kv_len)?;
        let mut bias: Option<Tensor> = None;
        let mut add = |t: Tensor| -> Result<()> {
            bias = Some(match bias.take() {
                None => t,
                Some(b) => b.broadcast_add(&t)?,
            });
            Ok(())
        };
        if self.causal.is_some() {
            add(self
                .rule_bias(q_len, kv_len, device)?
                .reshape((1, 1, q_len, kv_len))?)?;
        }
        if let Some(a) = &self.alibi {
            add(a.bias(self.alibi_offset(q_len, kv_len), q_len, kv_len, device)?)?;
        }
        if let Some(kp) = &self.key_padding {
            add(kp.bias()?.reshape((batch, 1, 1, kv_len))?)?;
        }
        if let Some(am) = &self.attn {
            let b = am.bias()?;
            add(attn_mask_as_4d(&b, batch, heads, q_len, kv_len)?)?;
        }
        Ok(bias)
    }
}

impl Mask {
    /// `(q_len, kv_len)` `u8`: 1 where the causal rule or the window hides
    /// the pair.
    fn rule_hidden(&self, q_len: usize, kv_len: usize, device: &Device) -> Result<Tensor> {
        let data: Vec<u8> = (0..q_len)
            .flat_map(|i| (0..kv_len).map(move |j| u8::from(!self.rule_allows(i, j, q_len, kv_len))))
            .collect();
        Tensor::from_vec(data, (q_len, kv_len), device)
    }

    /// `(q_len, kv_len)` bias: `0` where the causal rule and the window
    /// allow the pair, `-inf` elsewhere.
    fn rule_bias(&self, q_len: usize, kv_len: usize, device: &Device) -> Result<Tensor> {
        let hidden = self.rule_hidden(q_len, kv_len, device)?;
        bool_to_bias(&hidden, "causal rule", true)
    }
}

/// A boolean (integer) mask as `u8`, non-zero = true: the tensor itself
/// when it is `u8` already.
fn as_u8(t: &Tensor, what: &str) -> Result<Tensor> {
    check_bool(t, what)?;
    if t.dtype() == DType::U8 {
        Ok(t.clone())
    } else {
        t.ne(0f64)
    }
}

/// Reshapes a 2-, 3- or 4-D attention mask to a 4-D tensor broadcastable to
/// `(batch, heads, q_len, kv_len)`, or says why it cannot.
fn attn_mask_as_4d(t: &Tensor, batch: usize, heads: usize, q_len: usize, kv_len: usize) -> Result<Tensor> {
    let dims = t.dims();
    let fits = |n: usize, full: usize| n == 1 || n == full;
    match *dims {
        // PyTorch broadcasting, aligned right, as F.scaled_dot_product_attention
        // reads masks: (L, S), (L, 1), (1, S), ...
        [l, s] if fits(l, q_len) && fits(s, kv_len) => t.reshape((1, 1, l, s)),
        // nn.MultiheadAttention's per-head layout, batch-major.
        [bh, l, s] if bh == batch * heads && fits(l, q_len) && fits(s, kv_len) => {
            t.reshape((batch, heads, l, s))
        }
        // SDPA's (H, L, S) broadcast over the batch.
        [h, l, s] if fits(h, heads) && fits(l, q_len) && fits(s, kv_len) => t.reshape((1, h, l, s)),
        [b, h, l, s] if fits(b, batch) && fits(h, heads) && fits(l, q_len) && fits(s, kv_len) => {
            Ok(t.clone())
        }
        _ => bail!(
            "attn_mask: found shape {dims:?}, expected (q_len, kv_len) = ({q_len}, {kv_len}), \
             (batch*num_heads, q_len, kv_len) = ({}, {q_len}, {kv_len}), \
             or 2- to 4-D broadcastable to ({batch}, {heads}, {q_len}, {kv_len})",
            batch * heads
        ),
    }
}

/// Boolean (integer) mask to an `f32` bias; `masked_when` says which value
/// of the mask removes the pair.
fn bool_to_bias(t: &Tensor, what: &str, masked_when: bool) -> Result<Tensor> {
    check_bool(t, what)?;
    let neg = Tensor::new(f32::NEG_INFINITY, t.device())?.broadcast_as(t.shape())?;
    let zero = Tensor::new(0f32, t.device())?.broadcast_as(t.shape())?;
    if masked_when {
        t.where_cond(&neg, &zero)
    } else {
        t.where_cond(&zero, &neg)
    }
}

fn check_bool(t: &Tensor, what: &str) -> Result<()> {
    if !t.dtype().is_int() {
        bail!(
            "{what}: a boolean mask must be an integer tensor (u8/u32/i64, non-zero = true), \
             found {:?}; use the Additive variant for a float mask",
            t.dtype()
        )
    }
    Ok(())
}

fn float_to_bias(t: &Tensor, what: &str) -> Result<Tensor> {
    if !t.dtype().is_float() {
        bail!(
            "{what}: an additive mask must be a float tensor, found {:?}; \
             use a boolean variant for an integer mask",
            t.dtype()
        )
    }
    t.to_dtype(DType::F32)
}
