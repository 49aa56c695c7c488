//! The fused attention backward holds no `(q_len, kv_len)` tensor: the
//! bytes a forward and backward allocate at their peak, counted by this
//! test binary's allocator, stay under a quarter of one such f32 tensor,
//! and under a quarter of the reference path's peak. Its own binary, with
//! one test, so that no other test's allocations are counted.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::Result;
use candle::{Tensor, Var};
use multihead_attention::{scaled_dot_product_attention_via, AttnPath, Causal, Mask};
use multihead_test_support::random::randn;

/// The system allocator, counting the bytes live now and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call goes to `System` as it came; the counters only watch.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The peak bytes allocated, over those live before, while attention over
/// `(1, 1, n, d)` variables runs forward and backward on `path`.
fn peak_bytes(q: &Var, k: &Var, v: &Var, g: &Tensor, path: AttnPath) -> Result<usize> {
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let mask = Mask::causal(Causal::TopLeft);
    let out = scaled_dot_product_attention_via(q, k, v, &mask, None, path)?;
    let grads = (out * g)?.sum_all()?.backward()?;
    anyhow::ensure!(grads.get(q).is_some() && grads.get(k).is_some() && grads.get(v).is_some());
    drop(grads);
    Ok(PEAK.load(Ordering::Relaxed) - before)
}

/// `N = 4096`, `D = 64`, one head, causal. Peaks are compared by how
/// they grow with `N`, so that what does not grow (each thread's tile
/// buffers, `gemm`'s packing, the first call's thread start-up) cancels
/// out, whatever the thread count: from `N = 2048` to 4096 the fused
/// path's peak grows by under a quarter of what one `(N, N)` f32 tensor
/// grows by, and from 512 to 1024 by under a quarter of what the
/// reference path's grows by.
#[test]
fn fused_backward_holds_no_score_matrix() -> Result<()> {
    let d = 64;
    let run = |n: usize, path| -> Result<usize> {
        let var = |_| -> Result<Var> { Ok(Var::from_tensor(&randn(&[1, 1, n, d])?)?) };
        let (q, k, v) = (var(0)?, var(1)?, var(2)?);
        peak_bytes(&q, &k, &v, &randn(&[1, 1, n, d])?, path)
    };
    let scores = |n: usize| n * n * std::mem::size_of::<f32>();
    // Starts the threads and fills their kept buffers.
    run(512, AttnPath::CpuTiled)?;
    let growth = |path, from, to| -> Result<usize> { Ok(run(to, path)?.saturating_sub(run(from, path)?)) };
    let fused = growth(AttnPath::CpuTiled, 2048, 4096)?;
    let bound = (scores(4096) - scores(2048)) / 4;
    assert!(
        fused <= bound,
        "N = 2048 -> 4096: the fused path's peak grows by {fused} bytes, over {bound}"
    );
    let (fused, reference) = (
        growth(AttnPath::CpuTiled, 512, 1024)?,
        growth(AttnPath::Reference, 512, 1024)?,
    );
    assert!(
        4 * fused <= reference,
        "N = 512 -> 1024: the fused path's peak grows by {fused} bytes, the reference path's by {reference}"
    );
    Ok(())
}
