//! What the kernels run on: the instruction set the processor has
//! ([`isa`], detected once and capped by `MULTIHEAD_CPU_ISA`), the
//! threads a call's work units spread over, and buffers kept between calls
//! (`pool.rs`), and page-backed buffers for packed weights (`pages.rs`).

pub mod isa;
pub(crate) mod pages;
pub(crate) mod pool;
