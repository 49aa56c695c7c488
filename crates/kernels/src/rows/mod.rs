//! Row operations: LayerNorm (`norm.rs`, its backward `norm_grad.rs`), the activations and gated MLP
//! halves (`activation.rs`, their backward `activation_grad.rs`), the online softmax, its `exp` and the `tanh`
//! of logit soft-capping (`softmax.rs`), and the masks' and epilogues' row
//! passes (`simd.rs`). They are written once, over a vector type per
//! instruction set (`lanes.rs`: `ymm`, `zmm`, and `f32` for one lane) or as
//! plain Rust that each instruction set's `#[target_feature]` instance
//! vectorises (`simd.rs`, which picks the instance at run time).

mod activation;
pub(crate) mod activation_grad;
pub(crate) mod lanes;
mod norm;
mod norm_grad;
pub(crate) mod simd;
pub(crate) mod softmax;

pub use activation::{gelu_tanh_and_mul, gelu_tanh_mul, relu, silu_and_mul, silu_mul};
pub use norm::{LayerNorm, RmsNorm};
