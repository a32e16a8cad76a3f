//! Which way a model's decode steps walk the weight rows: adjacent tiles or long streams
//! (`kernels::decode_walk`). Natively the host settles it (`kernels::decode_in_streams`); where it
//! cannot (the wasm build does not know the CPU it runs on), the first decode steps time both
//! walks, alternating, and the faster one stays.
//!
//! Adjacent and spread tiles (the walks of the wasm build, and natively of Q4_0, Q5_0, Q5_1)
//! compute every row the same way (a tile sums each of its rows on its own, and the same rows are
//! left over for the one-row kernel), so there the choice changes speed, never a result: the
//! steps that time it give the logits any other step would. Natively, row by row (Q8_0 and the
//! K-quants in streams) sums in another order than a tile: rounding differs, within the fast
//! path's tolerance (`tests/cpu_kernels.rs`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::timing::Clock;

/// Decode steps timed with each walk before choosing: the median of 3 survives one outlier.
const STEPS_PER_WALK: usize = 3;
/// Decode steps run before timing starts: the first after a prompt finds the weights where the
/// prompt's pass left them in the caches, which favours whichever walk runs it.
const WARMUP_STEPS: usize = 1;

pub struct WalkChoice {
    /// Whether the decode step running now reads in streams.
    streams: AtomicBool,
    /// The timing still under way; `None` once settled (or settled from the start).
    trial: Mutex<Option<Trial>>,
}

#[derive(Default)]
struct Trial {
    /// Decode steps begun so far.
    steps: usize,
    /// Milliseconds of the timed steps: adjacent tiles, streams.
    ms: [Vec<f64>; 2],
}

impl WalkChoice {
    /// Settled from the start: `Some(streams)`; `None` times the first decode steps.
    pub fn new(known: Option<bool>) -> WalkChoice {
        WalkChoice {
            streams: AtomicBool::new(known.unwrap_or(false)),
            trial: Mutex::new(known.is_none().then(Trial::default)),
        }
    }

    /// Whether decode reads in streams now (during the trial: the step running).
    pub fn streams(&self) -> bool {
        self.streams.load(Ordering::Relaxed)
    }

    /// The walk chosen, or `None` while the trial runs.
    pub fn settled(&self) -> Option<bool> {
        match *self.lock() {
            Some(_) => None,
            None => Some(self.streams()),
        }
    }

    /// Run one decode step `f`, timed by `clock` while the trial needs it.
    pub fn step<R>(&self, clock: Clock, f: impl FnOnce() -> R) -> R {
        let walk = self.lock().as_mut().map(|t| t.next());
        let Some(walk) = walk else { return f() };
        if let Some(streams) = walk {
            self.streams.store(streams, Ordering::Relaxed);
        }
        let start = clock();
        let out = f();
        let ms = clock() - start;
        if let Some(streams) = walk {
            let mut trial = self.lock();
            if let Some(chosen) = trial.as_mut().and_then(|t| t.record(streams, ms)) {
                self.streams.store(chosen, Ordering::Relaxed);
                *trial = None;
            }
        }
        out
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Trial>> {
        self.trial.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Trial {
    /// The walk the next step is timed with (`None`: a warm-up step, not timed): adjacent
    /// tiles and streams in turn.
    fn next(&mut self) -> Option<bool> {
        self.steps += 1;
        (self.steps > WARMUP_STEPS).then_some((self.steps - WARMUP_STEPS).is_multiple_of(2))
    }

    /// Count a timed step; the choice once both walks have their steps: the lower median, ties
    /// (a clock that reads 0 or too coarsely) to adjacent tiles.
    fn record(&mut self, streams: bool, ms: f64) -> Option<bool> {
        self.ms[streams as usize].push(ms);
        if self.ms.iter().any(|m| m.len() < STEPS_PER_WALK) {
            return None;
        }
        let [tiles, streams] = self.ms.each_mut().map(|m| median(m));
        Some(streams < tiles)
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    thread_local! {
        static NOW: Cell<f64> = const { Cell::new(0.0) };
    }
    fn fake_clock() -> f64 {
        NOW.with(|n| n.get())
    }

    /// Steps that take `tiles_ms` with adjacent tiles and `streams_ms` in streams: the walks the
    /// steps ran with, and the choice.
    fn trial(tiles_ms: f64, streams_ms: f64, steps: usize) -> (Vec<bool>, Option<bool>) {
        let choice = WalkChoice::new(None);
        let walks = (0..steps)
            .map(|_| {
                choice.step(fake_clock, || {
                    let ms = if choice.streams() { streams_ms } else { tiles_ms };
                    NOW.with(|n| n.set(n.get() + ms));
                    choice.streams()
                })
            })
            .collect();
        (walks, choice.settled())
    }

    #[test]
    fn the_faster_walk_stays() {
        let (walks, chosen) = trial(10.0, 7.0, 12);
        // Warm-up on tiles, then 3 steps each in turn, then streams for good.
        let expected = [false, false, true, false, true, false, true, true, true, true, true, true];
        assert_eq!(walks, expected);
        assert_eq!(chosen, Some(true));
        let (walks, chosen) = trial(7.0, 10.0, 12);
        assert_eq!(&walks[7..], &[false; 5]);
        assert_eq!(chosen, Some(false));
    }

    #[test]
    fn no_choice_before_both_walks_are_timed() {
        assert_eq!(trial(10.0, 7.0, 6).1, None);
        assert_eq!(trial(10.0, 7.0, 7).1, Some(true));
    }

    #[test]
    fn a_clock_that_reads_zero_keeps_adjacent_tiles() {
        assert_eq!(trial(0.0, 0.0, 20).1, Some(false));
    }

    #[test]
    fn one_slow_step_does_not_decide() {
        let choice = WalkChoice::new(None);
        // Streams faster, but its first timed step is hit by something else (50 ms).
        let mut streams_steps = 0;
        for _ in 0..7 {
            choice.step(fake_clock, || {
                let ms = if choice.streams() {
                    streams_steps += 1;
                    if streams_steps == 1 {
                        50.0
                    } else {
                        7.0
                    }
                } else {
                    10.0
                };
                NOW.with(|n| n.set(n.get() + ms));
            });
        }
        assert_eq!(choice.settled(), Some(true));
    }

    #[test]
    fn a_known_walk_is_never_timed() {
        for known in [false, true] {
            let choice = WalkChoice::new(Some(known));
            assert_eq!(choice.settled(), Some(known));
            choice.step(|| panic!("timed a settled walk"), || ());
            assert_eq!(choice.streams(), known);
        }
    }
}
