//! Where the fused paths' dropout masks come from: each call draws a seed
//! from a process-wide stream, which [`set_dropout_seed`] restarts; the
//! kernel derives the call's mask from it
//! ([`multihead_kernels::attention::Dropout`]) in the forward and again in
//! the backward.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use candle::Result;
use multihead_kernels::attention::Dropout;

/// The stream's start where [`set_dropout_seed`] chose it.
static CHOSEN: OnceLock<AtomicU64> = OnceLock::new();
/// Calls drawn so far from the stream.
static DRAWN: AtomicU64 = AtomicU64::new(0);

/// Restarts the stream the attention dropout masks of the CPU path are
/// drawn from: after it, the same calls in the same order drop the same
/// weights. Without it, each process starts from the OS's randomness.
/// (The reference path's dropout is candle's, which its CPU device does
/// not seed.)
pub fn set_dropout_seed(seed: u64) {
    CHOSEN
        .get_or_init(|| AtomicU64::new(seed))
        .store(seed, Ordering::Relaxed);
    DRAWN.store(0, Ordering::Relaxed);
}

/// The dropout of probability `p` of the next call, its seed the next of
/// the stream; `None` where `p` is 0 (or not given).
pub(crate) fn next(p: Option<f32>) -> Result<Option<Dropout>> {
    let Some(p) = p.filter(|&p| p != 0.) else {
        return Ok(None);
    };
    let start = CHOSEN
        .get()
        .map(|s| s.load(Ordering::Relaxed))
        .unwrap_or_else(|| {
            static OS: OnceLock<u64> = OnceLock::new();
            *OS.get_or_init(|| RandomState::new().build_hasher().finish())
        });
    let n = DRAWN.fetch_add(1, Ordering::Relaxed);
    // The call's seed: a hash of the stream's start and the call's number,
    // so that consecutive calls' masks share no pair bits.
    let mut h = std::hash::DefaultHasher::new();
    h.write_u64(start);
    h.write_u64(n);
    Dropout::new(p, h.finish()).map(Some)
}
