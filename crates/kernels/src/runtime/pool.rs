//! The threads: [`par_for`] and [`par_chunks_mut`], on candle's own CPU
//! pool, and [`Pool`], buffers kept from call to call.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Multiply-adds (or floats packed) from which a call's work is spread
/// over the threads ([`par_for`]).
pub(crate) const PARALLEL_FROM: usize = 1 << 16;

/// The threads the kernels spread a call's work over: the calling thread
/// and the workers of candle's CPU pool (`CANDLE_NUM_THREADS`, else
/// `RAYON_NUM_THREADS`, else the physical cores, as candle counts them),
/// or what [`with_threads`] sets on this thread.
pub fn threads() -> usize {
    match CUT_FOR.get() {
        Some(n) => n,
        None => candle::utils::barrier_pool().n_workers() + 1,
    }
}

thread_local! {
    /// Whether this thread runs a [`par_for`] job's items now.
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
    /// What [`threads`] says on this thread, in [`with_threads`].
    static CUT_FOR: Cell<Option<usize>> = const { Cell::new(None) };
}

/// `f()` with the kernels' calls from this thread cut into work for `n`
/// threads ([`threads`]): with `n = 1` each runs on this thread alone
/// (one model per core, say); with more, the work splits as it would on
/// a processor of `n` cores, and runs on candle's pool as it is.
pub fn with_threads<R>(n: usize, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<usize>);
    impl Drop for Restore {
        fn drop(&mut self) {
            CUT_FOR.set(self.0);
        }
    }
    let _restore = Restore(CUT_FOR.replace(Some(n.max(1))));
    f()
}

/// Runs `f(i)` for every `i` in `0..n`, spread over [`threads`]; `work`
/// is the job's multiply-adds (or floats moved), below [`PARALLEL_FROM`]
/// of which (or with one thread) it runs on the calling thread alone.
///
/// The jobs run on candle's own pool (`candle::utils::barrier_pool`, which
/// candle's element-wise ops use): a model mixing candle's ops and ours
/// then has one set of worker threads. Beside a pool of our own, candle's
/// worker would poll for its next op (25 000 pauses before it parks) while
/// ours ran the following kernel, on the same cores.
///
/// Each thread takes the items of a contiguous share of `0..n` in order
/// (a unit's neighbours share its panels or rows, and a kernel prefetches
/// the next unit's), then the items left in the others' shares, so that
/// one that finishes first takes the later ones of a slow one's.
///
/// A job started from one of its items runs on that thread, item by
/// item. An item that panics does so on the caller, once the job is done;
/// candle's pool never sees the panic (which would poison the lock that
/// its every later job takes).
pub(crate) fn par_for(n: usize, work: usize, f: impl Fn(usize) + Sync) {
    if n <= 1 || work < PARALLEL_FROM || IN_JOB.get() || threads() == 1 {
        (0..n).for_each(f);
        return;
    }
    /// The next item of a share, on a cache line of its own.
    #[repr(align(64))]
    struct Next(AtomicUsize);
    let pool = candle::utils::barrier_pool();
    let t = pool.n_workers() + 1;
    let end = |share: usize| n * (share + 1) / t;
    let next: Vec<Next> = (0..t).map(|s| Next(AtomicUsize::new(n * s / t))).collect();
    let panic = Mutex::new(None);
    // Each thread, its own share first (the caller's is the last).
    pool.execute(|me| {
        let was = IN_JOB.replace(true);
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for share in (0..t).map(|k| (me + k) % t) {
                loop {
                    let i = next[share].0.fetch_add(1, Ordering::Relaxed);
                    if i >= end(share) {
                        break;
                    }
                    f(i);
                }
            }
        }));
        IN_JOB.set(was);
        if let Err(payload) = run {
            if let Ok(mut first) = panic.lock() {
                first.get_or_insert(payload);
            }
        }
    });
    if let Some(payload) = panic.into_inner().ok().flatten() {
        std::panic::resume_unwind(payload);
    }
}

/// Runs `f(i, chunk)` for every `chunk`-long piece `i` of `out` (the last
/// one shorter), as [`par_for`] does.
pub(crate) fn par_chunks_mut<T: Send>(
    out: &mut [T],
    chunk: usize,
    work: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let (len, chunk) = (out.len(), chunk.max(1));
    let at = SyncPtr(out.as_mut_ptr());
    par_for(len.div_ceil(chunk), work, |i| {
        let lo = i * chunk;
        // SAFETY: pieces `lo..lo + chunk` of distinct `i` are disjoint and
        // in bounds, and `out` is borrowed until every item is done.
        f(i, unsafe { at.slice_mut(lo, chunk.min(len - lo)) })
    });
}

/// Runs `f(item)` for every one of `items` (each handed over once, by
/// value: pieces of several outputs, say), as [`par_for`] does.
pub(crate) fn par_each<T: Send>(items: Vec<T>, work: usize, f: impl Fn(T) + Sync) {
    let items: Vec<Mutex<Option<T>>> = items.into_iter().map(|t| Mutex::new(Some(t))).collect();
    par_for(items.len(), work, |i| {
        if let Some(item) = items[i].lock().ok().and_then(|mut t| t.take()) {
            f(item)
        }
    });
}

/// [`par_chunks_mut`] where each piece also gives a value: the values in
/// the pieces' order.
pub(crate) fn par_chunks_mut_map<T: Send, R: Send>(
    out: &mut [T],
    chunk: usize,
    work: usize,
    f: impl Fn(usize, &mut [T]) -> R + Sync,
) -> Vec<R> {
    let results: Vec<Mutex<Option<R>>> = (0..out.len().div_ceil(chunk.max(1)))
        .map(|_| Mutex::new(None))
        .collect();
    par_chunks_mut(out, chunk, work, |i, piece| {
        let r = f(i, piece);
        if let Ok(mut slot) = results[i].lock() {
            *slot = Some(r);
        }
    });
    results
        .into_iter()
        .map(|r| r.into_inner().ok().flatten().expect("every piece ran"))
        .collect()
}

/// Piece `i` of `xs` cut into `chunk`-long pieces (the last one shorter):
/// the input that goes with [`par_chunks_mut`]'s piece `i`.
pub(crate) fn piece<T>(xs: &[T], chunk: usize, i: usize) -> &[T] {
    let lo = (i * chunk).min(xs.len());
    &xs[lo..(lo + chunk).min(xs.len())]
}

/// Buffers kept for the next call: fresh pages cost a page fault each
/// (about a tenth of a 1024-token attention call's time), so per-call
/// pack buffers come from a pool that keeps up to `slots` of them, each of
/// at most `max` floats; larger ones go back to the allocator.
pub(crate) struct Pool {
    kept: Mutex<Vec<Vec<f32>>>,
    slots: usize,
    max: usize,
}

/// The attention's packed keys and values (two per call, up to 16 MiB
/// each).
pub(crate) static KV_PACKS: Pool = Pool::new(2, 4 << 20);

impl Pool {
    const fn new(slots: usize, max: usize) -> Pool {
        Pool {
            kept: Mutex::new(Vec::new()),
            slots,
            max,
        }
    }

    /// A buffer of `len` floats, reusing a kept one where it can: its
    /// contents are stale, the caller writes them all. Of the kept buffers
    /// large enough, one already `len` long or more goes first (one
    /// shorter is zeroed up to `len`, on this thread), then the smallest.
    pub(crate) fn take(&self, len: usize) -> Vec<f32> {
        let kept = self.kept.lock().ok().and_then(|mut kept| {
            let (i, _) = kept
                .iter()
                .enumerate()
                .filter(|(_, b)| b.capacity() >= len)
                .min_by_key(|(_, b)| (b.len() < len, b.capacity()))?;
            Some(kept.swap_remove(i))
        });
        let mut buf = kept.unwrap_or_default();
        buf.resize(len, 0.);
        buf
    }

    /// Hands `buf` back for a later [`Pool::take`].
    pub(crate) fn keep(&self, buf: Vec<f32>) {
        if buf.capacity() == 0 || buf.capacity() > self.max {
            return;
        }
        if let Ok(mut kept) = self.kept.lock() {
            if kept.len() < self.slots {
                kept.push(buf);
            } else if let Some(small) = kept.iter_mut().min_by_key(|b| b.capacity()) {
                if small.capacity() < buf.capacity() {
                    *small = buf;
                }
            }
        }
    }
}

/// A raw output pointer shared by the work units, which write disjoint rows.
pub(crate) struct SyncPtr<T = f32>(pub(crate) *mut T);
// SAFETY: the units that share one write disjoint parts; the pointer outlives
// the parallel loop, which joins before the buffer is used.
unsafe impl<T: Send> Send for SyncPtr<T> {}
unsafe impl<T: Send> Sync for SyncPtr<T> {}

impl<T> Clone for SyncPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SyncPtr<T> {}

impl<T> SyncPtr<T> {
    /// The pointer; a method, so that closures capture the `SyncPtr`
    /// (`Send + Sync`), not its raw field.
    pub(crate) fn get(self) -> *mut T {
        self.0
    }

    /// The `len` elements from `lo` on.
    ///
    /// # Safety
    /// They are in bounds of the buffer, which outlives `'a`, and no other
    /// reference reaches them meanwhile (each work item its own part).
    pub(crate) unsafe fn slice_mut<'a>(self, lo: usize, len: usize) -> &'a mut [T] {
        // SAFETY: the caller's.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(lo), len) }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::{par_chunks_mut, par_for, piece, Pool, PARALLEL_FROM};

    /// A pool of two hands each length the kept buffer already that long
    /// (no zeroing, the wide one never cut down to a narrow call's
    /// length), the smallest such first; a buffer over `max` is not kept.
    #[test]
    fn pool_hands_out_the_buffer_already_long_enough() {
        let pool = Pool::new(2, 1000);
        let (narrow, wide) = (vec![1f32; 100], vec![2f32; 400]);
        let (narrow_ptr, wide_ptr) = (narrow.as_ptr(), wide.as_ptr());
        pool.keep(wide);
        pool.keep(narrow);
        for _ in 0..3 {
            let a = pool.take(80);
            assert_eq!((a.as_ptr(), a.len()), (narrow_ptr, 80));
            let b = pool.take(400);
            assert_eq!((b.as_ptr(), b.len()), (wide_ptr, 400));
            // Stale contents, never zeroed: each buffer kept its own.
            assert!(a.iter().all(|&x| x == 1.) && b.iter().all(|&x| x == 2.));
            pool.keep(a);
            pool.keep(b);
        }
        // Past both: a fresh buffer; one over `max` is dropped.
        assert_eq!(pool.take(500).len(), 500);
        pool.keep(vec![0f32; 2000]);
        let kept: Vec<usize> = pool.kept.lock().unwrap().iter().map(Vec::capacity).collect();
        assert!(kept.iter().all(|&c| c <= 1000), "{kept:?}");
    }

    /// Runs `par_for(n, work, ..)` and returns how often each item ran.
    fn counts(n: usize, work: usize) -> Vec<usize> {
        let runs: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
        par_for(n, work, |i| {
            runs[i].fetch_add(1, Ordering::Relaxed);
        });
        runs.into_iter().map(AtomicUsize::into_inner).collect()
    }

    #[test]
    fn par_for_runs_every_item_once() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        for n in [0, 1, 2, 7, 60, 1000] {
            // Spread over the threads, and on the caller alone.
            for work in [n * PARALLEL_FROM, PARALLEL_FROM - 1] {
                // From the model's thread and from another pool's worker.
                assert_eq!(counts(n, work), vec![1; n], "n {n}, work {work}");
                let inside = pool.install(|| counts(n, work));
                assert_eq!(inside, vec![1; n], "n {n}, work {work}, inside a pool");
            }
        }
    }

    /// A job started from an item of another, on whichever thread runs
    /// it, runs every item of its own once (and does not wait on the
    /// pool that its caller holds).
    #[test]
    fn a_job_inside_a_job_runs_every_item_once() {
        let (n, inner) = (16, 9);
        let runs: Vec<AtomicUsize> = (0..n * inner).map(|_| AtomicUsize::new(0)).collect();
        par_for(n, n * PARALLEL_FROM, |i| {
            par_for(inner, inner * PARALLEL_FROM, |j| {
                runs[i * inner + j].fetch_add(1, Ordering::Relaxed);
            })
        });
        assert!(runs.iter().all(|r| r.load(Ordering::Relaxed) == 1));
    }

    /// Each piece once, with its index, the last one shorter; `piece`
    /// cuts an input as the output is cut.
    #[test]
    fn par_chunks_mut_hands_each_piece_with_its_index() {
        for (len, chunk) in [(0, 4), (1, 4), (16, 4), (17, 4), (1000, 7)] {
            let input: Vec<usize> = (0..len).collect();
            let mut out = vec![usize::MAX; len];
            par_chunks_mut(&mut out, chunk, len * PARALLEL_FROM, |i, o| {
                let x = piece(&input, chunk, i);
                assert_eq!(x.len(), o.len());
                for (o, &x) in o.iter_mut().zip(x) {
                    *o = x + i * len;
                }
            });
            let want: Vec<usize> = (0..len).map(|e| e + (e / chunk) * len).collect();
            assert_eq!(out, want, "len {len}, chunk {chunk}");
        }
    }

    /// Callers on several threads at once each run every item of their
    /// own once.
    #[test]
    fn concurrent_callers_each_run_every_item_once() {
        std::thread::scope(|s| {
            for t in 0..4 {
                s.spawn(move || {
                    for round in 0..50 {
                        let n = 2 + (t * 7 + round) % 40;
                        assert_eq!(
                            counts(n, n * PARALLEL_FROM),
                            vec![1; n],
                            "thread {t}, round {round}"
                        );
                    }
                });
            }
        });
    }

    #[test]
    fn par_for_reports_a_panicking_item() {
        for (n, work) in [(60, 60 * PARALLEL_FROM), (1000, 1000 * PARALLEL_FROM)] {
            for bad in [0, n / 2, n - 1] {
                let run = std::panic::catch_unwind(|| {
                    par_for(n, work, |i| {
                        if i == bad {
                            panic!("item {i}");
                        }
                    })
                });
                assert!(run.is_err(), "n {n}: item {bad}'s panic was lost");
            }
        }
        // candle's pool still serves its own ops and ours.
        let x = candle::Tensor::ones(4 * PARALLEL_FROM, candle::DType::F32, &candle::Device::Cpu).unwrap();
        let sum = (&x + &x).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(sum, 8. * PARALLEL_FROM as f32);
        assert_eq!(counts(60, 60 * PARALLEL_FROM), vec![1; 60]);
    }
}
