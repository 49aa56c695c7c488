//! The threads: [`par_for`] over rayon's pool, and [`Pool`], buffers kept
//! from call to call.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Multiply-adds under which a parallel job is short: at most a few
/// hundred microseconds on two cores, of which handing it to the pool and
/// waking the caller afterwards is a large share.
const SHORT_JOB: usize = 1 << 22;
/// Multiply-adds per item from which a short job's caller works beside
/// the helpers: a helper that wakes late still finds items to take. Under
/// it (a B8 transformer's decoder step: 64 heads of up to 64 keys) rayon's
/// splitting measured faster, and the caller alone slower still.
const MIN_ITEM: usize = 1 << 16;

/// Runs `f(i)` for every `i` in `0..n` on rayon's pool, with as many
/// threads as the pool has; `work` is the job's multiply-adds.
///
/// A short job ([`SHORT_JOB`], [`MIN_ITEM`]) called from outside the pool
/// (a decoder step on the main thread) is not handed over: the calling
/// thread takes items from a counter, and helper tasks spawned on the pool
/// take from the same counter when a worker picks them up. The caller
/// never sleeps; it waits only for items a helper has already taken, and a
/// helper that arrives after the last item has been taken does nothing:
/// a decode step's attention and linears, each a few hundred microseconds,
/// do not wait for a sleeping worker to wake. Other jobs, and calls from
/// inside the pool, take rayon's own splitting.
pub(crate) fn par_for(n: usize, work: usize, f: impl Fn(usize) + Sync) {
    let threads = rayon::current_num_threads().min(n);
    if threads <= 1 {
        (0..n).for_each(f);
        return;
    }
    if work >= SHORT_JOB || work / n < MIN_ITEM || rayon::current_thread_index().is_some() {
        use rayon::prelude::*;
        (0..n).into_par_iter().for_each(&f);
        return;
    }
    let f: &(dyn Fn(usize) + Sync) = &f;
    // SAFETY: the lifetime is erased so that helpers may outlive this call;
    // they call `f` only for items taken below `n`, and this call returns
    // only once every taken item is done (`Items::work`, the wait below).
    let f: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(f) };
    let items = Arc::new(Items {
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        panicked: AtomicBool::new(false),
        n,
        // About 8 takes a thread: each take and each count is a cache line
        // passed between cores.
        take: n.div_ceil(8 * threads),
        f,
    });
    for _ in 1..threads {
        let items = Arc::clone(&items);
        rayon::spawn(move || items.work());
    }
    items.work();
    let mut spins = 0u32;
    while items.done.load(Ordering::Acquire) < n {
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
    assert!(
        !items.panicked.load(Ordering::Relaxed),
        "a parallel work item panicked"
    );
}

/// The items of a short [`par_for`] job, shared with its helpers.
struct Items {
    next: AtomicUsize,
    done: AtomicUsize,
    panicked: AtomicBool,
    n: usize,
    /// Items taken at a time.
    take: usize,
    /// Valid while `done < n` (the caller waits for that).
    f: *const (dyn Fn(usize) + Sync),
}

// SAFETY: `f` is `Sync` and only called while it is alive (see `par_for`);
// the rest are atomics.
unsafe impl Send for Items {}
unsafe impl Sync for Items {}

impl Items {
    /// Takes and runs items until none are left.
    fn work(&self) {
        loop {
            let lo = self.next.fetch_add(self.take, Ordering::Relaxed);
            if lo >= self.n {
                return;
            }
            let hi = (lo + self.take).min(self.n);
            // SAFETY: items lo..hi < n are not done, so the caller still
            // waits and `f` is alive.
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                (lo..hi).for_each(|i| unsafe { (*self.f)(i) })
            }));
            if run.is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
            self.done.fetch_add(hi - lo, Ordering::Release);
        }
    }
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
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr(pub(crate) *mut f32);
// SAFETY: the units that share one write disjoint parts; the pointer outlives
// the parallel loop, which joins before the buffer is used.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// The pointer; a method, so that closures capture the `SyncPtr`
    /// (`Send + Sync`), not its raw field.
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::{par_for, Pool, MIN_ITEM, SHORT_JOB};

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
            // A short job (the caller works beside helpers) where n allows
            // one, and a long one (rayon's splitting).
            let short = n * MIN_ITEM;
            assert!(n > 60 || short < SHORT_JOB);
            for work in [short, SHORT_JOB] {
                // From outside the pool and from one of its workers.
                assert_eq!(counts(n, work), vec![1; n], "n {n}, work {work}");
                let inside = pool.install(|| counts(n, work));
                assert_eq!(inside, vec![1; n], "n {n}, work {work}, inside a pool");
            }
        }
    }

    #[test]
    fn par_for_reports_a_panicking_item() {
        for (n, work) in [(60, 60 * MIN_ITEM), (1000, SHORT_JOB)] {
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
    }
}
