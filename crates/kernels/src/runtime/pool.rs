//! The threads: [`par_for`], on the caller and the [`Helpers`] or on
//! rayon's pool, and [`Pool`], buffers kept from call to call.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Multiply-adds (or floats packed) from which a call's work is spread
/// over the threads ([`par_for`]).
pub(crate) const PARALLEL_FROM: usize = 1 << 16;

/// Multiply-adds per item from which the caller works beside the helpers
/// even while they sleep: a helper that comes late still finds items to
/// take. Smaller items go to the helpers only while one is polling (a
/// decoder step's attention between its linears, whose wake-ups through
/// rayon's pool cost more than the attention); with the helpers asleep (a
/// B8 transformer's decoder step, 64 heads of up to 64 keys, whose
/// linears run on rayon's pool) rayon's awake workers take them sooner
/// than a sleeping helper, and the caller alone is slower still.
const MIN_ITEM: usize = 1 << 16;

/// How long a helper keeps polling for the next job after its last before
/// it sleeps: longer than the gap between two parallel jobs of a decode
/// step (a norm, the rotary embedding), so that a decoder's jobs find the
/// helpers awake.
const SPIN: Duration = Duration::from_micros(300);

/// Runs `f(i)` for every `i` in `0..n`, on as many threads as rayon's
/// pool has; `work` is the job's multiply-adds.
///
/// Called from outside the pool (the model's thread), with items of at
/// least [`MIN_ITEM`] or while a helper polls, the job is not handed over: the calling thread
/// takes items from a counter, and the [`Helpers`] (one thread fewer than
/// the pool) take from the same counter. The caller never sleeps; it waits
/// only for items a helper has already taken, and a helper that comes
/// after the last item was taken does nothing. A decode step's hundred-odd
/// jobs, each a few hundred microseconds, then neither wake a sleeping
/// worker nor sleep until one is done (on rayon's pool, which does both,
/// the handing-over is a large share of a Q8_0 decode step). Smaller
/// items while the helpers sleep, and calls from inside the pool, take
/// rayon's own splitting.
pub(crate) fn par_for(n: usize, work: usize, f: impl Fn(usize) + Sync) {
    let threads = rayon::current_num_threads().min(n);
    if threads <= 1 {
        (0..n).for_each(f);
        return;
    }
    let helpers = Helpers::get();
    if rayon::current_thread_index().is_some() || (work / n < MIN_ITEM && !helpers.polling()) {
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
    helpers.submit(&items);
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

/// Threads that take the items of [`par_for`]'s jobs beside their caller:
/// each polls for the next job for [`SPIN`] after its last, then sleeps
/// until one comes. One job is offered at a time; a caller whose job was
/// replaced by another caller's before a helper took it runs its items
/// itself.
struct Helpers {
    /// The job on offer.
    job: Mutex<Option<Arc<Items>>>,
    /// Bumped for every job offered.
    offered: AtomicUsize,
    wake: Condvar,
    /// Helpers awake: polling for a job or running one.
    awake: AtomicUsize,
}

impl Helpers {
    /// The helpers: one thread fewer than rayon's pool has at the first
    /// call, started then.
    fn get() -> &'static Helpers {
        static HELPERS: OnceLock<&'static Helpers> = OnceLock::new();
        HELPERS.get_or_init(|| {
            let helpers: &'static Helpers = Box::leak(Box::new(Helpers {
                job: Mutex::new(None),
                offered: AtomicUsize::new(0),
                wake: Condvar::new(),
                awake: AtomicUsize::new(0),
            }));
            for i in 1..rayon::current_num_threads() {
                // One that cannot start leaves its share to the callers.
                let _ = std::thread::Builder::new()
                    .name(format!("multihead-helper-{i}"))
                    .spawn(move || helpers.run());
            }
            helpers
        })
    }

    /// Whether a helper is awake, and so takes a job's items without being
    /// woken.
    fn polling(&self) -> bool {
        self.awake.load(Ordering::Relaxed) > 0
    }

    /// Offers `items` to the helpers.
    fn submit(&self, items: &Arc<Items>) {
        if let Ok(mut job) = self.job.lock() {
            *job = Some(Arc::clone(items));
            self.offered.fetch_add(1, Ordering::Release);
            self.wake.notify_all();
        }
    }

    /// A helper's loop: wait for a job newer than the last one seen
    /// (polling, then asleep), take its items.
    fn run(&self) {
        let mut seen = self.offered.load(Ordering::Acquire);
        self.awake.fetch_add(1, Ordering::Relaxed);
        loop {
            let since = Instant::now();
            while self.offered.load(Ordering::Acquire) == seen {
                if since.elapsed() < SPIN {
                    std::hint::spin_loop();
                    continue;
                }
                self.awake.fetch_sub(1, Ordering::Relaxed);
                let Ok(mut job) = self.job.lock() else { return };
                while self.offered.load(Ordering::Acquire) == seen {
                    job = match self.wake.wait(job) {
                        Ok(job) => job,
                        Err(_) => return,
                    };
                }
                self.awake.fetch_add(1, Ordering::Relaxed);
            }
            let Ok(job) = self.job.lock() else {
                self.awake.fetch_sub(1, Ordering::Relaxed);
                return;
            };
            seen = self.offered.load(Ordering::Acquire);
            let items = job.clone();
            drop(job);
            if let Some(items) = items {
                items.work();
            }
        }
    }
}

/// The items of a [`par_for`] job, shared with the helpers.
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

    use super::{par_for, Pool, MIN_ITEM};

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
            // Items the caller and the helpers take, and smaller ones
            // (rayon's splitting).
            for work in [n * MIN_ITEM, n * MIN_ITEM / 2] {
                // From outside the pool and from one of its workers.
                assert_eq!(counts(n, work), vec![1; n], "n {n}, work {work}");
                let inside = pool.install(|| counts(n, work));
                assert_eq!(inside, vec![1; n], "n {n}, work {work}, inside a pool");
            }
        }
    }

    /// Callers on several threads at once, whose jobs replace each other
    /// on offer to the helpers: each still runs every item of its own once.
    #[test]
    fn concurrent_callers_each_run_every_item_once() {
        std::thread::scope(|s| {
            for t in 0..4 {
                s.spawn(move || {
                    for round in 0..50 {
                        let n = 2 + (t * 7 + round) % 40;
                        assert_eq!(counts(n, n * MIN_ITEM), vec![1; n], "thread {t}, round {round}");
                    }
                });
            }
        });
    }

    #[test]
    fn par_for_reports_a_panicking_item() {
        for (n, work) in [(60, 60 * MIN_ITEM), (1000, 1000 * MIN_ITEM / 2)] {
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
