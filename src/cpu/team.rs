//! A team of threads that spins between the many small parallel loops of one forward pass.
//!
//! A decode step runs about six parallel loops per layer, each tens of microseconds of work on a
//! small model. Through rayon, each loop wakes the pool's sleeping threads: a futex natively,
//! `Atomics.wait` / `Atomics.notify` between Web Workers in a browser, where one wake-up costs
//! about as much as the loop itself. A team instead holds the pool's threads for the whole pass
//! (as llama.cpp's thread pool does): the caller leads, the helpers are recruited once as jobs on
//! the pool and spin on one atomic word; the leader publishes each loop there and helpers claim
//! its chunks. A loop never waits for a helper to arrive (the leader claims chunks too), only for
//! the chunks already claimed to finish; nor does the pass's end wait for helpers to leave (they
//! share the team, not the pass's stack), so a pass costs one wake-up per helper and nothing else.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// Spins between checks before a waiting helper starts yielding its core now and then (natively;
/// a Web Worker has nothing to yield to).
const SPINS_BEFORE_YIELD: u32 = 1 << 16;

/// Most chunks one loop may have (they share the state word with the epoch).
pub const MAX_CHUNKS: usize = 0xffff;

/// The loop a team is running: a function of the chunk index.
type Chunk<'a> = &'a (dyn Fn(usize) + Sync);

/// A helper's whole life, to run as a job on a thread pool (see [`lead`]).
pub type Helper = Box<dyn FnOnce() + Send>;

#[derive(Default)]
pub struct Team {
    /// The current loop: epoch (high 32 bits), chunks (16 bits), next chunk to claim (low 16).
    /// A helper claims a chunk by compare-and-swap on the whole word, so a claim can never land
    /// in a later loop than the one it read.
    state: AtomicU64,
    /// The current loop's function: a `*const Chunk` on the leader's stack, read only after a
    /// successful claim (the loop cannot end, nor its function go away, before that chunk is done).
    job: AtomicPtr<()>,
    /// Chunks of the current loop finished.
    done: AtomicUsize,
    /// Set when the pass is over: helpers go back to the pool (one that arrives later leaves at
    /// once; no loop is open then, so it can claim nothing).
    quit: AtomicBool,
    /// Set when a chunk panicked on a helper (the leader panics too rather than wait forever).
    poisoned: AtomicBool,
}

thread_local! {
    /// The team this thread leads, while it leads one (see [`lead`]).
    static LEADING: Cell<*const Team> = const { Cell::new(std::ptr::null()) };
}

/// Run `f` on this thread as the leader of a team of `helpers` more threads, each recruited by
/// `spawn` (a job on a pool: `ThreadPool::spawn`, `rayon::spawn`): the parallel loops `f` runs
/// through [`run`] are shared with them. Helpers that the pool cannot spare join late or never;
/// the loops still finish (the leader does every chunk then).
pub fn lead<R>(helpers: usize, spawn: impl Fn(Helper), f: impl FnOnce() -> R) -> R {
    let team = Arc::new(Team::default());
    for _ in 0..helpers {
        let team = Arc::clone(&team);
        spawn(Box::new(move || {
            // A panicking chunk has poisoned the team (`Finish`) for the leader to report; the
            // pool's thread goes on.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| team.help()));
        }));
    }
    // Helpers stop and this thread stops leading on every way out, unwinding included.
    struct Dismiss<'a>(&'a Team, *const Team);
    impl Drop for Dismiss<'_> {
        fn drop(&mut self) {
            self.0.quit.store(true, Ordering::Release);
            LEADING.with(|l| l.set(self.1));
        }
    }
    let _dismiss = Dismiss(&team, LEADING.with(|l| l.replace(&*team)));
    f()
}

/// Run `f(c)` for every chunk `c` in `0..chunks` on the team this thread leads and return true
/// when all are done; or return false at once, running nothing, when this thread leads none.
pub fn run(chunks: usize, f: Chunk) -> bool {
    let team = LEADING.with(|l| l.get());
    if team.is_null() {
        return false;
    }
    // SAFETY: a non-null LEADING points at the team `lead` keeps alive until it resets LEADING.
    unsafe { &*team }.run(chunks, f);
    true
}

impl Team {
    fn run(&self, chunks: usize, f: Chunk) {
        assert!(chunks <= MAX_CHUNKS, "{chunks} chunks in one loop");
        // Helpers read the function only after claiming a chunk of this loop, so it may live on
        // this stack frame: the loop ends (and the frame with it) only once every chunk is done.
        self.job.store(&f as *const Chunk as *mut (), Ordering::Relaxed);
        self.done.store(0, Ordering::Relaxed);
        let epoch = (self.state.load(Ordering::Relaxed) >> 32).wrapping_add(1) & 0xffff_ffff;
        // Release: a helper that claims a chunk of this loop sees the function and `done` reset.
        self.state.store(epoch << 32 | (chunks as u64) << 16, Ordering::Release);
        {
            // Waits on every way out, unwinding from `f` included: no chunk may still run when
            // the function goes away.
            let _wait = WaitForClaimed(self, chunks);
            while let Some(c) = self.claim() {
                let _finish = Finish(self);
                f(c);
            }
        }
        assert!(!self.poisoned.load(Ordering::Relaxed), "a chunk of a parallel loop panicked");
    }

    /// The next unclaimed chunk of the current loop, if any is left.
    fn claim(&self) -> Option<usize> {
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            let (chunks, next) = ((s >> 16) & 0xffff, s & 0xffff);
            if next >= chunks {
                return None;
            }
            match self.state.compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(next as usize),
                Err(now) => s = now,
            }
        }
    }

    /// A helper's life: claim and run chunks as loops are published, until the pass is over.
    fn help(&self) {
        let mut idle = 0u32;
        loop {
            if let Some(c) = self.claim() {
                let _finish = Finish(self);
                // SAFETY: the claim succeeded, so the loop (and the function `job` points at,
                // stored before the loop was published) lasts until this chunk is counted done.
                let f = unsafe { *(self.job.load(Ordering::Relaxed) as *const Chunk) };
                f(c);
                idle = 0;
                continue;
            }
            if self.quit.load(Ordering::Acquire) {
                return;
            }
            idle = idle.saturating_add(1);
            if idle >= SPINS_BEFORE_YIELD && idle.is_multiple_of(64) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

/// Counts a chunk done when it ends, even by panicking (the leader would wait for it forever).
struct Finish<'a>(&'a Team);

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.poisoned.store(true, Ordering::Relaxed);
        }
        self.0.done.fetch_add(1, Ordering::Release);
    }
}

/// Closes the current loop to new claims and waits until the chunks already claimed are done.
struct WaitForClaimed<'a>(&'a Team, usize);

impl Drop for WaitForClaimed<'_> {
    fn drop(&mut self) {
        let state = &self.0.state;
        let mut s = state.load(Ordering::Acquire);
        let claimed = loop {
            let next = s & 0xffff;
            let closed = s - next + (self.1 as u64);
            match state.compare_exchange_weak(s, closed, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break next as usize,
                Err(now) => s = now,
            }
        };
        while self.0.done.load(Ordering::Acquire) < claimed {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap()
    }

    #[test]
    fn a_team_of_one_runs_every_chunk_on_its_leader() {
        let me = std::thread::current().id();
        let ran = AtomicUsize::new(0);
        let led = lead(
            0,
            |_| unreachable!("no helper"),
            || {
                run(17, &|_| {
                    assert_eq!(std::thread::current().id(), me);
                    ran.fetch_add(1, Ordering::Relaxed);
                })
            },
        );
        assert!(led, "no team was led");
        assert_eq!(ran.load(Ordering::Relaxed), 17);
    }

    #[test]
    fn every_chunk_of_every_loop_runs_once() {
        let pool = pool(3);
        let seen = lead(
            3,
            |h| pool.spawn(h),
            || {
                let mut seen = std::collections::HashSet::new();
                for i in 0..5000 {
                    let chunks = i % 41;
                    let runs: Vec<AtomicUsize> = (0..chunks).map(|_| AtomicUsize::new(0)).collect();
                    let threads = std::sync::Mutex::new(std::collections::HashSet::new());
                    let on_team = run(chunks, &|c| {
                        runs[c].fetch_add(1, Ordering::Relaxed);
                        threads.lock().unwrap().insert(std::thread::current().id());
                    });
                    assert!(on_team, "the leader runs loops on its team");
                    let runs: Vec<usize> = runs.iter().map(|r| r.load(Ordering::Relaxed)).collect();
                    assert_eq!(runs, vec![1; chunks], "loop {i}");
                    seen.extend(threads.into_inner().unwrap());
                }
                seen.len()
            },
        );
        assert!(seen > 1, "helpers took part ({seen} threads ran chunks)");
    }

    #[test]
    fn loops_finish_when_no_helper_comes() {
        // Helpers recruited but run only after the pass (a pool with no thread to spare): the
        // leader does every chunk, and the late helpers leave at once.
        let late = std::sync::Mutex::new(Vec::new());
        let sum = lead(
            3,
            |h| late.lock().unwrap().push(h),
            || {
                let total = AtomicUsize::new(0);
                let on_team = run(10, &|c| {
                    total.fetch_add(c, Ordering::Relaxed);
                });
                assert!(on_team, "the leader runs loops on its team");
                total.into_inner()
            },
        );
        assert_eq!(sum, 45);
        for helper in late.into_inner().unwrap() {
            helper();
        }
    }

    #[test]
    fn a_thread_that_leads_no_team_runs_nothing() {
        let ran = AtomicUsize::new(0);
        let f = |_| {
            ran.fetch_add(1, Ordering::Relaxed);
        };
        assert!(!run(4, &f));
        // Nor after leading one.
        let pool = pool(1);
        lead(1, |h| pool.spawn(h), || ());
        assert!(!run(4, &f));
        assert_eq!(ran.into_inner(), 0);
    }

    #[test]
    fn a_panicking_chunk_panics_the_pass_instead_of_hanging_it() {
        for bad in [0, 7] {
            let pool = pool(1);
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                lead(
                    1,
                    |h| pool.spawn(h),
                    || {
                        run(8, &|c| {
                            std::thread::sleep(std::time::Duration::from_millis(1));
                            assert!(c != bad, "chunk {c}");
                        })
                    },
                )
            }));
            assert!(r.is_err(), "chunk {bad} panicked");
        }
    }
}
