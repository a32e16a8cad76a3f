//! Choosing the next token from the model's logits.
//!
//! The model gives a score (logit) per vocabulary entry; softmax turns scores into a probability
//! distribution, and a sampler draws one token from a reshaped version of that distribution.
//! `Sampler::sample` applies, in this order:
//!
//! 1. **repetition penalty** (CTRL / llama.cpp style): each distinct token of the last
//!    `repeat_window` history tokens gets `logit / penalty` if its logit is positive and
//!    `logit * penalty` otherwise, so both cases move towards "less likely";
//! 2. **greedy** if `temperature` is 0 or below [`GREEDY_BELOW`]: the argmax, ties going to the
//!    lowest id;
//! 3. **temperature**: logits are divided by it (<1 sharpens, >1 flattens);
//! 4. **softmax** (max-subtracted, so `exp` never overflows; `-inf` logits get probability 0);
//! 5. **top-k**: keep the `top_k` most probable tokens;
//! 6. **min-p**: drop tokens whose probability is below `min_p` × the largest probability;
//! 7. **top-p** (nucleus): keep the smallest set of most probable tokens whose probability
//!    (relative to what is still kept) reaches `top_p`; always at least one;
//! 8. **renormalise and draw** with the seeded [`Rng`].
//!
//! The probability reported in [`Pick`] is not the reshaped one: it is what the model itself
//! believes, the plain softmax of the logits at temperature 1.

use crate::constraint::AllowedSet;
use crate::error::{Error, Result};
use rand_core::{RngCore, SeedableRng};
use rand_pcg::Pcg32;

/// How to choose tokens. The default samples from the model's own distribution (temperature 1,
/// every filter off); [`SamplerConfig::greedy`] always takes the most probable token.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    /// Divides the logits; 0 (or anything below [`GREEDY_BELOW`]) means greedy.
    pub temperature: f32,
    /// Keep only the k most probable tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest nucleus reaching this probability; 1.0 = off.
    pub top_p: f32,
    /// Drop tokens less probable than `min_p` × the most probable one; 0 = off.
    pub min_p: f32,
    /// Penalty for tokens seen in the last `repeat_window` tokens; 1.0 = off.
    pub repeat_penalty: f32,
    pub repeat_window: usize,
    pub seed: u64,
    /// How many of the most probable tokens each [`Pick`] reports (at most [`MAX_SHOWN`]).
    pub alternatives: usize,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_window: 64,
            seed: 0,
            alternatives: TOP_SHOWN,
        }
    }
}

impl SamplerConfig {
    /// Always the most probable token (after the repetition penalty, which is off here too).
    pub fn greedy() -> Self {
        SamplerConfig { temperature: 0.0, ..Self::default() }
    }

    /// Temperature 0 is the limit where all probability goes to the argmax, and temperatures
    /// below [`GREEDY_BELOW`] are that limit in f32. A NaN temperature (which
    /// [`validate`](SamplerConfig::validate) refuses) is greedy too, rather than NaNs.
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_BELOW || self.temperature.is_nan()
    }

    /// An [`Error::Input`] naming the first option out of range: a temperature that is
    /// negative or not finite, top-p or min-p outside [0, 1], a repetition penalty that is not
    /// a finite number above 0. The generation constructors call it, so every front end does.
    pub fn validate(&self) -> Result<()> {
        self.validate_as(|field| field.to_string())
    }

    /// [`validate`](SamplerConfig::validate), the option named as a front end spells it
    /// (`spell("top_p")` is `--top-p` on the command line).
    pub fn validate_as(&self, spell: impl Fn(&str) -> String) -> Result<()> {
        let bad = |name: &str, value: f32, want: &str| {
            let name = spell(name);
            Err(Error::Input(format!("{name} = {value} is out of range: it must be {want}")))
        };
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return bad("temperature", t, "a finite number >= 0 (0 is greedy)");
        }
        for (name, p) in [("top_p", self.top_p), ("min_p", self.min_p)] {
            if !(0.0..=1.0).contains(&p) {
                return bad(name, p, "between 0 and 1");
            }
        }
        let r = self.repeat_penalty;
        if !(r.is_finite() && r > 0.0) {
            return bad("repeat_penalty", r, "a finite number > 0 (1 is off)");
        }
        Ok(())
    }
}

/// Temperatures below this are greedy. Sampling divides the logits' distances from the best by
/// T: at T < 1e-6 a token 1e-4 below the best gets weight exp(-100) ≈ 4e-44 against the
/// best's 1, which vanishes in the draw's sum, so only near-exact ties could ever be drawn
/// instead of the argmax. Going greedy there also keeps 1/T far from f32 overflow (at
/// T = 1e-39, 1/T is infinite and 0 × inf = NaN made every weight NaN: the least likely token
/// came out every step).
pub const GREEDY_BELOW: f32 = 1e-6;

/// The temperature the page, the `<next-token>` element and the CLI start from: a little
/// sharper than the model's own distribution (1, [`SamplerConfig`]'s default), which small
/// models make rambling.
pub const FRONT_END_TEMPERATURE: f32 = 0.8;

/// The largest seed [`fresh_seed`] draws: 2^53 - 1, so JavaScript numbers hold every seed
/// exactly and a seed a page reports can be typed back in.
pub const MAX_FRESH_SEED: u64 = (1 << 53) - 1;

/// A seed nobody chose, for a front end given none (each run draws anew; a fixed seed
/// reproduces a run): natively from the OS's randomness that seeds std's hash maps and the
/// clock, in the browser from `Math.random`. At most [`MAX_FRESH_SEED`].
pub fn fresh_seed() -> u64 {
    #[cfg(not(target_arch = "wasm32"))]
    let drawn = {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        h.write_u128(now.map_or(0, |d| d.as_nanos()));
        h.finish()
    };
    #[cfg(target_arch = "wasm32")]
    let drawn = (js_sys::Math::random() * MAX_FRESH_SEED as f64) as u64;
    drawn & MAX_FRESH_SEED
}

/// The error for a row of logits holding NaN or +inf (a NaN or infinite weight, or an overflow
/// in the forward pass): nothing can be chosen or scored from it. `position` is the index in
/// the sequence of the token those logits predict.
pub fn bad_logits(position: usize) -> Error {
    Error::Model(format!(
        "the logits predicting position {position} are NaN or infinite (a NaN or infinite \
         weight, or an overflow in the forward pass); stopping instead of picking at random"
    ))
}

/// The random stream behind sampling: PCG32 (XSH-RR), whose output is specified bit for bit, so a
/// seed gives the same tokens natively and in wasm.
#[derive(Clone, Debug)]
pub struct Rng(Pcg32);

impl Rng {
    /// Seeded through `SeedableRng::seed_from_u64`, which expands the u64 into PCG32's 128-bit
    /// state and stream (itself with a PCG step, so seeds 0, 1, 2... give unrelated streams).
    pub fn new(seed: u64) -> Rng {
        Rng(Pcg32::seed_from_u64(seed))
    }

    /// A generator built from an explicit PCG32 (e.g. `Pcg32::new(state, stream)`).
    pub fn from_pcg(pcg: Pcg32) -> Rng {
        Rng(pcg)
    }

    pub fn next_u32(&mut self) -> u32 {
        self.0.next_u32()
    }

    /// Uniform in [0, 1): the top 24 bits (an f32 holds 24 bits of mantissa exactly).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u32() >> 8) as f32 / (1u32 << 24) as f32
    }
}

/// The token chosen at one step and what the model thought of it.
#[derive(Clone, Debug, PartialEq)]
pub struct Pick {
    pub id: u32,
    /// P(id) under the plain softmax of the logits (temperature 1, no filters, no penalty).
    pub prob: f32,
    /// ln of `prob`, computed directly (stays finite where `prob` rounds to 0).
    pub logprob: f32,
    /// The most probable ids under the same plain softmax, most probable first
    /// ([`SamplerConfig::alternatives`] of them).
    pub top: Vec<(u32, f32)>,
}

/// How many alternatives a [`Pick`] shows by default.
pub const TOP_SHOWN: usize = 5;
/// The most alternatives a pick may report (OpenAI's `top_logprobs` allows 20).
pub const MAX_SHOWN: usize = 20;

/// A nucleus that reaches `top_p` up to float rounding counts as reaching it: probabilities of
/// 0.5 and 0.3 should make a 0.8 nucleus even though softmax returns 0.79999995 for their sum.
const NUCLEUS_SLACK: f64 = 1e-6;

pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
    // Scratch buffers, reused so a step allocates nothing proportional to the vocabulary.
    adjusted: Vec<f32>,
    candidates: Vec<(u32, f32)>,
    recent: Vec<u32>,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        let rng = Rng::new(cfg.seed);
        Sampler { cfg, rng, adjusted: Vec::new(), candidates: Vec::new(), recent: Vec::new() }
    }

    /// Alternatives each pick reports.
    fn shown(&self) -> usize {
        self.cfg.alternatives.min(MAX_SHOWN)
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// What the model believes about `id` (its plain-softmax probability and the top
    /// alternatives), as a [`Pick`] of it, without drawing: for a token chosen by the caller.
    pub fn describe(&self, logits: &[f32], id: u32) -> Pick {
        describe(logits, id, self.shown())
    }

    /// Choose the next token given the model's `logits` and the tokens so far (prompt included),
    /// which only the repetition penalty looks at. A row holding NaN or +inf gives a pick whose
    /// `logprob` is NaN (see [`logsumexp`]): callers check that, not every logit.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> Pick {
        let id = self.choose(logits, None, history);
        describe(logits, id, self.shown())
    }

    /// [`sample`](Sampler::sample) among the `allowed` tokens only (structured output): the
    /// others get `-inf` before step 1, so every step of the module docs sees only allowed
    /// tokens. The pick's probability and alternatives are still the model's own (the plain
    /// softmax of all the logits). When every allowed token has a `-inf` logit the pick is the
    /// lowest id, allowed or not: the caller checks.
    pub fn sample_allowed(
        &mut self,
        logits: &[f32],
        allowed: &AllowedSet,
        history: &[u32],
    ) -> Pick {
        let id = self.choose(logits, Some(allowed), history);
        describe(logits, id, self.shown())
    }

    fn choose(&mut self, logits: &[f32], allowed: Option<&AllowedSet>, history: &[u32]) -> u32 {
        let mut adjusted = std::mem::take(&mut self.adjusted);
        adjusted.clear();
        adjusted.extend_from_slice(logits);
        if let Some(allowed) = allowed {
            allowed.mask_in_place(&mut adjusted);
        }
        self.penalise_repeats(&mut adjusted, history);
        let id = if self.cfg.is_greedy() { argmax(&adjusted) } else { self.draw(&adjusted) };
        self.adjusted = adjusted;
        id
    }

    /// Whether the repetition penalty changes anything. A penalty of 0 or less would divide by
    /// zero or flip signs: it counts as off.
    fn penalises(&self) -> bool {
        let penalty = self.cfg.repeat_penalty;
        !(penalty == 1.0 || penalty <= 0.0 || penalty.is_nan() || self.cfg.repeat_window == 0)
    }

    /// How many of the most likely tokens this sampler must see to pick as it would from the
    /// whole row: `Some(k)` (at most `limit`, at least the [`TOP_SHOWN`] alternatives a pick
    /// reports) when it looks at no others (greedy, or top-k sampling with k <= `limit`, and no
    /// repetition penalty), so a GPU can rank on the device and send back only those
    /// ([`Sampler::sample_top`]); `None` when it needs every logit.
    pub fn top_needed(&self, limit: usize) -> Option<usize> {
        if self.penalises() {
            return None;
        }
        let k = match self.cfg.top_k {
            _ if self.cfg.is_greedy() => 1,
            k if (1..=limit).contains(&k) => k,
            _ => return None,
        };
        Some(k.max(self.shown()).min(limit))
    }

    /// [`Sampler::sample`] given only the most likely tokens (at least
    /// [`top_needed`](Sampler::top_needed) of them, best first) and the log-sum-exp of all
    /// logits. Greedy picks are the same; a top-k draw is the same in exact arithmetic (its
    /// weights are normalised over the kept tokens rather than over the vocabulary, which can
    /// only matter when the random point lands on a rounding boundary).
    pub fn sample_top(&mut self, top: &TopK) -> Pick {
        let id = match top.ids.first() {
            None => 0,
            Some(&best) if self.cfg.is_greedy() => best,
            Some(_) => {
                let max = top.logits[0];
                let inv_temperature = 1.0 / self.cfg.temperature;
                let c = &mut self.candidates;
                c.clear();
                let mut sum = 0.0f64;
                for (&id, &logit) in top.ids.iter().zip(&top.logits) {
                    if logit > f32::NEG_INFINITY {
                        let weight = ((logit - max) * inv_temperature).exp();
                        sum += weight as f64;
                        c.push((id, weight));
                    }
                }
                for (_, p) in c.iter_mut() {
                    *p = (*p as f64 / sum) as f32;
                }
                self.filter_and_draw()
            }
        };
        let logprob_of = |logit: f32| logit as f64 - top.logsumexp;
        let logprob = match top.ids.iter().position(|&i| i == id) {
            Some(at) => logprob_of(top.logits[at]),
            // Nothing was ranked: every logit was NaN.
            None if top.ids.is_empty() => f64::NAN,
            None => f64::NEG_INFINITY,
        };
        let shown = top.ids.iter().zip(&top.logits).take(self.shown());
        Pick {
            id,
            prob: logprob.exp() as f32,
            logprob: logprob as f32,
            top: shown.map(|(&i, &l)| (i, logprob_of(l).exp() as f32)).collect(),
        }
    }

    fn penalise_repeats(&mut self, logits: &mut [f32], history: &[u32]) {
        let penalty = self.cfg.repeat_penalty;
        if !self.penalises() {
            return;
        }
        // Each distinct token once, however often it repeated (that is llama.cpp's rule).
        let recent = &history[history.len().saturating_sub(self.cfg.repeat_window)..];
        self.recent.clear();
        self.recent.extend_from_slice(recent);
        self.recent.sort_unstable();
        self.recent.dedup();
        for &id in &self.recent {
            if let Some(logit) = logits.get_mut(id as usize) {
                *logit = if *logit > 0.0 { *logit / penalty } else { *logit * penalty };
            }
        }
    }

    /// Steps 3 to 8 of the module docs.
    fn draw(&mut self, logits: &[f32]) -> u32 {
        let Some(max) = max_finite(logits) else {
            return argmax(logits);
        };
        self.temperature_softmax(logits, max);
        self.filter_and_draw()
    }

    /// Which tokens this sampler draws from given `logits` and the tokens so far, with the
    /// probabilities it draws them with (renormalised over the kept set), most probable first:
    /// steps 1 to 7 of the module docs without the draw, for a view of what the settings do.
    /// Greedy keeps the argmax alone. Draws nothing, so the random stream is untouched.
    pub fn kept(&mut self, logits: &[f32], history: &[u32]) -> Vec<(u32, f32)> {
        self.kept_allowed(logits, None, history)
    }

    /// [`kept`](Sampler::kept) among the `allowed` tokens only, as
    /// [`sample_allowed`](Sampler::sample_allowed) draws: the distribution a step samples from.
    pub fn kept_allowed(
        &mut self,
        logits: &[f32],
        allowed: Option<&AllowedSet>,
        history: &[u32],
    ) -> Vec<(u32, f32)> {
        let mut adjusted = logits.to_vec();
        if let Some(allowed) = allowed {
            allowed.mask_in_place(&mut adjusted);
        }
        self.penalise_repeats(&mut adjusted, history);
        let max = max_finite(&adjusted);
        if self.cfg.is_greedy() || max.is_none() {
            return vec![(argmax(&adjusted), 1.0)];
        }
        self.temperature_softmax(&adjusted, max.unwrap_or_default());
        self.filter();
        let mass: f64 = self.candidates.iter().map(|&(_, p)| p as f64).sum();
        let mut kept: Vec<(u32, f32)> =
            self.candidates.iter().map(|&(id, p)| (id, (p as f64 / mass) as f32)).collect();
        kept.sort_unstable_by(most_probable_first);
        kept
    }

    /// One draw from `dist` (id, probability; as [`kept`](Sampler::kept) gives it) with this
    /// sampler's random stream.
    pub fn draw_from(&mut self, dist: &[(u32, f32)]) -> u32 {
        self.candidates.clear();
        self.candidates.extend_from_slice(dist);
        self.draw_candidates()
    }

    /// Speculative decoding's rejection rule for a guess `draft` drawn from `q` (id,
    /// probability): keep it with probability min(1, p/q), otherwise draw from max(0, p − q)
    /// renormalised, where p is the distribution [`sample_allowed`](Sampler::sample_allowed)
    /// would draw from here. The token that comes out is distributed as p (see
    /// [`speculative`](crate::generate::speculative)).
    pub fn judge_draft(
        &mut self,
        logits: &[f32],
        allowed: Option<&AllowedSet>,
        history: &[u32],
        draft: u32,
        q: &[(u32, f32)],
    ) -> u32 {
        use crate::generate::speculative::{accept_probability, residual};
        let p = self.kept_allowed(logits, allowed, history);
        let prob = |dist: &[(u32, f32)]| {
            dist.iter().find(|&&(id, _)| id == draft).map_or(0.0, |&(_, w)| w as f64)
        };
        if (self.rng.next_f32() as f64) < accept_probability(prob(&p), prob(q)) {
            return draft;
        }
        let rest = residual(&p, q);
        self.draw_from(if rest.is_empty() { &p } else { &rest })
    }

    /// Steps 3 and 4: the candidates (id, probability) at this temperature; impossible tokens
    /// are never candidates.
    fn temperature_softmax(&mut self, logits: &[f32], max: f32) {
        let inv_temperature = 1.0 / self.cfg.temperature;
        // exp((l - max) / T) is exp(l/T) scaled by a constant, and at most 1: it cannot overflow.
        let c = &mut self.candidates;
        c.clear();
        let mut sum = 0.0f64;
        for (id, &logit) in logits.iter().enumerate() {
            if logit > f32::NEG_INFINITY {
                let weight = ((logit - max) * inv_temperature).exp();
                sum += weight as f64;
                c.push((id as u32, weight));
            }
        }
        for (_, p) in c.iter_mut() {
            *p = (*p as f64 / sum) as f32;
        }
    }

    /// Steps 5 to 8 on the candidates (id, probability): top-k, min-p, top-p, then the draw.
    fn filter_and_draw(&mut self) -> u32 {
        self.filter();
        self.draw_candidates()
    }

    /// Step 8 on the candidates: renormalise implicitly, draw a point in [0, kept mass) and
    /// find whose slice holds it.
    fn draw_candidates(&mut self) -> u32 {
        let c = &self.candidates;
        let mass: f64 = c.iter().map(|&(_, p)| p as f64).sum();
        let r = self.rng.next_f32() as f64 * mass;
        let mut cumulative = 0.0f64;
        for &(id, p) in c.iter() {
            cumulative += p as f64;
            if r < cumulative {
                return id;
            }
        }
        c.last().map_or(0, |&(id, _)| id) // r landed past the end by rounding
    }

    /// Steps 5 to 7 on the candidates: top-k, min-p, top-p.
    fn filter(&mut self) {
        let c = &mut self.candidates;
        let top_k = self.cfg.top_k;
        if top_k > 0 {
            // Partition instead of sorting the whole vocabulary; then sort the few kept so the
            // draw below sees them in an order that does not depend on the partition algorithm
            // (nor on whether there were more than k: a constraint can leave fewer, and the
            // GPU's ranked top-k must draw the same token).
            if top_k < c.len() {
                c.select_nth_unstable_by(top_k - 1, most_probable_first);
                c.truncate(top_k);
            }
            c.sort_unstable_by(most_probable_first);
        }

        if self.cfg.min_p > 0.0 {
            let max_prob = c.iter().map(|&(_, p)| p).fold(0.0, f32::max);
            let threshold = self.cfg.min_p.min(1.0) * max_prob; // the best always stays
            c.retain(|&(_, p)| p >= threshold);
        }

        if self.cfg.top_p < 1.0 {
            keep_nucleus(c, self.cfg.top_p);
        }
    }
}

/// Top-p on candidates holding probabilities (not necessarily summing to 1: what earlier filters
/// left). Keeps the most probable tokens until their share of the kept mass reaches `top_p`.
fn keep_nucleus(c: &mut Vec<(u32, f32)>, top_p: f32) {
    let mass: f64 = c.iter().map(|&(_, p)| p as f64).sum();
    let target = (top_p as f64 - NUCLEUS_SLACK) * mass;

    // llama2.c's shortcut: a token below (1 - top_p) / (n - 1) of the mass can never be in the
    // nucleus (all such tokens together hold less than 1 - top_p), so drop them before sorting.
    if c.len() > 1 {
        let cutoff = ((1.0 - top_p as f64) * mass / (c.len() - 1) as f64) as f32;
        if c.iter().any(|&(_, p)| p >= cutoff) {
            c.retain(|&(_, p)| p >= cutoff);
        }
    }

    c.sort_unstable_by(most_probable_first);
    let mut cumulative = 0.0f64;
    let mut keep = c.len();
    for (i, &(_, p)) in c.iter().enumerate() {
        cumulative += p as f64;
        if cumulative >= target {
            keep = i + 1;
            break;
        }
    }
    c.truncate(keep.max(1));
}

/// Higher probability first; equal probabilities by lower id, so results never depend on the
/// order an algorithm happens to leave ties in.
fn most_probable_first(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// What the model believes about `id`: its plain-softmax probability and the top alternatives.
fn describe(logits: &[f32], id: u32, shown: usize) -> Pick {
    let lse = logsumexp(logits);
    let logprob_of = |logit: f32| {
        if lse == f64::NEG_INFINITY {
            f64::NEG_INFINITY
        } else {
            logit as f64 - lse
        }
    };
    let logprob = logits.get(id as usize).map_or(f64::NEG_INFINITY, |&l| logprob_of(l));
    let top = top_n(logits, shown)
        .into_iter()
        .map(|(i, logit)| (i, logprob_of(logit).exp() as f32))
        .collect();
    Pick { id, prob: logprob.exp() as f32, logprob: logprob as f32, top }
}

/// Index of the largest logit; ties (and an all `-inf` or NaN vector) go to the lowest id.
pub fn argmax(logits: &[f32]) -> u32 {
    // Eight running maxima and where each was first seen (so it vectorises: greedy decoding
    // pays it per token over the vocabulary); `>` keeps the first of equals and never takes NaN.
    let mut lanes = [(f32::NEG_INFINITY, u32::MAX); 8];
    let mut rows = logits.chunks_exact(8);
    for (r, row) in (&mut rows).enumerate() {
        for (k, (lane, &l)) in lanes.iter_mut().zip(row).enumerate() {
            if l > lane.0 {
                *lane = (l, (8 * r + k) as u32);
            }
        }
    }
    let done = logits.len() - rows.remainder().len();
    for (k, (lane, &l)) in lanes.iter_mut().zip(rows.remainder()).enumerate() {
        if l > lane.0 {
            *lane = (l, (done + k) as u32);
        }
    }
    let best =
        lanes.into_iter().reduce(|a, b| if b.0 > a.0 || (b.0 == a.0 && b.1 < a.1) { b } else { a });
    match best {
        Some((max, id)) if max > f32::NEG_INFINITY => id,
        // Nothing above -inf: the first logit that is not NaN, as below.
        _ => argmax_slow(logits),
    }
}

/// [`argmax`] one logit at a time, for rows with nothing above `-inf`.
fn argmax_slow(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &logit) in logits.iter().enumerate() {
        // `>` is false for NaN, so a NaN never wins.
        if logit > logits[best] || (logits[best].is_nan() && !logit.is_nan()) {
            best = i;
        }
    }
    best as u32
}

/// The `n` largest logits as (id, logit), largest first, ties to the lowest id; NaN skipped.
/// One pass keeping a short sorted list: for the handful shown per token (or one per beam) this
/// beats sorting, and allocates nothing the size of the vocabulary.
pub fn top_n(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n == 0 {
        return top;
    }
    for (id, &logit) in logits.iter().enumerate() {
        let full = top.len() == n;
        if logit.is_nan() || (full && logit <= top[n - 1].1) {
            continue;
        }
        // After any equal logits, so among ties the lower id (seen first) stays ahead.
        let at = top.partition_point(|&(_, kept)| kept >= logit);
        top.insert(at, (id as u32, logit));
        top.truncate(n);
    }
    top
}

/// Largest logit above `-inf`, if any (NaN ignored). Eight running maxima, so it vectorises: a
/// pass over the vocabulary for every sampled token.
fn max_finite(logits: &[f32]) -> Option<f32> {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut rows = logits.chunks_exact(8);
    for row in &mut rows {
        for (m, &l) in lanes.iter_mut().zip(row) {
            // `>` is false for NaN, which never wins.
            *m = if l > *m { l } else { *m };
        }
    }
    for (m, &l) in lanes.iter_mut().zip(rows.remainder()) {
        *m = if l > *m { l } else { *m };
    }
    let max = lanes.into_iter().fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a });
    (max > f32::NEG_INFINITY).then_some(max)
}

/// ln Σ exp(logits), computed as max + ln Σ exp(l - max) so nothing overflows or underflows to a
/// wrong answer. `-inf` when every logit is `-inf` (there is no distribution); NaN when any logit
/// is NaN or +inf (broken logits: every log-probability from it is NaN, which is how generation
/// and scoring notice them without a pass of their own).
///
/// Every sampled token pays it over the whole vocabulary (its probability), and a speculative
/// pass once per row, so the exponentials are [`exp_nonpositive`] in f32, summed in f64 over 8
/// running sums in a fixed order: within 1e-6 of the sum in f64 with libm's `exp` (which took
/// ~0.3 ms per 49,152-token row) and the same bits on every platform, wasm included (plain
/// IEEE operations, no fused multiply-add).
pub fn logsumexp(logits: &[f32]) -> f64 {
    let Some(max) = max_finite(logits) else {
        let any_nan = logits.iter().any(|l| l.is_nan());
        return if any_nan { f64::NAN } else { f64::NEG_INFINITY };
    };
    // NaN - max is NaN, and +inf - max (max being +inf) is NaN too: either poisons the sum.
    let mut sums = [0f64; 8];
    let mut rows = logits.chunks_exact(8);
    for row in &mut rows {
        // Eight exponentials, then eight sums: a shape LLVM's vectoriser takes.
        let terms: [f32; 8] = std::array::from_fn(|k| exp_nonpositive(row[k] - max));
        for (sum, term) in sums.iter_mut().zip(terms) {
            *sum += term as f64;
        }
    }
    for (sum, &l) in sums.iter_mut().zip(rows.remainder()) {
        *sum += exp_nonpositive(l - max) as f64;
    }
    let sum =
        ((sums[0] + sums[4]) + (sums[2] + sums[6])) + ((sums[1] + sums[5]) + (sums[3] + sums[7]));
    max as f64 + sum.ln()
}

/// e^x for x <= 0 (NaN stays NaN), as Cephes' `expf`: x = n ln 2 + r (ln 2 in two parts, n
/// rounded by adding 1.5 * 2^23, so no libm call), e^r by a degree-6 polynomial, 2^n into the
/// exponent bits; within 2 units in the last place. Below -87.3 it gives e^-87.3 (~1.2e-38, where
/// 2^n stays a normal float): next to the 1 that the largest logit adds, nothing.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    use crate::cpu::kernels::{EXP_POLY, LN2_PARTS};
    // `<` is false for NaN, which goes on through and comes out NaN.
    let x = if x < -87.3 { -87.3 } else { x };
    const ROUND: f32 = 12_582_912.0;
    let t = x * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = x - n * LN2_PARTS[0];
    let r = r - n * LN2_PARTS[1];
    let mut p = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        p = p * r + c;
    }
    let e = p * r * r + r + 1.0;
    let exponent = (t.to_bits() as i32 - ROUND.to_bits() as i32) + 127;
    e * f32::from_bits((exponent << 23) as u32)
}

/// Probabilities of the logits at temperature 1. `-inf` logits get exactly 0; if all are `-inf`
/// there is no distribution and the result is all zeros (never NaN).
pub fn softmax(logits: &[f32]) -> Vec<f32> {
    let lse = logsumexp(logits);
    if lse == f64::NEG_INFINITY {
        return vec![0.0; logits.len()];
    }
    logits.iter().map(|&l| (l as f64 - lse).exp() as f32).collect()
}

/// ln P(id) under the softmax of `logits`: the logit minus logsumexp, never ln of a rounded
/// probability. Panics if `id` is not an index of `logits`.
pub fn log_softmax_at(logits: &[f32], id: u32) -> f64 {
    let lse = logsumexp(logits);
    if lse == f64::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    logits[id as usize] as f64 - lse
}

/// The k most likely next tokens, with the log-sum-exp of all the logits: the probability of
/// `ids[i]` under the full softmax is `exp(logits[i] - logsumexp)`.
#[derive(Debug, Clone, PartialEq)]
pub struct TopK {
    /// Best first; ties broken by smaller id.
    pub ids: Vec<u32>,
    pub logits: Vec<f32>,
    /// f64: on the CPU it is summed in f64, and beam search adds many of these up.
    pub logsumexp: f64,
}

impl TopK {
    /// The `k` best of one row of logits (fewer when the row is shorter; NaNs never ranked).
    pub fn from_logits(logits: &[f32], k: usize) -> TopK {
        let (ids, top_logits) = top_n(logits, k).into_iter().unzip();
        TopK { ids, logits: top_logits, logsumexp: logsumexp(logits) }
    }

    /// ln P(`ids[i]`) under the full softmax.
    pub fn logprob(&self, i: usize) -> f64 {
        self.logits[i] as f64 - self.logsumexp
    }
}

/// What a constrained step ranks ([`LanguageModel::forward_top_allowed_async`](crate::lm::LanguageModel::forward_top_allowed_async)).
#[derive(Debug, Clone, PartialEq)]
pub struct AllowedTop {
    /// The most likely tokens the constraint allows, best first (fewer when fewer are allowed).
    pub allowed: TopK,
    /// The most likely tokens of all, allowed or not: the model's own view.
    pub all: TopK,
}

impl AllowedTop {
    /// The `k` best allowed and the `shown` best of one row of logits.
    pub fn from_logits(logits: &[f32], k: usize, shown: usize, allowed: &AllowedSet) -> AllowedTop {
        let all = TopK::from_logits(logits, shown);
        let (ids, top_logits) = top_n(&allowed.mask(logits), k)
            .into_iter()
            .filter(|&(_, logit)| logit > f32::NEG_INFINITY)
            .unzip();
        AllowedTop { allowed: TopK { ids, logits: top_logits, logsumexp: all.logsumexp }, all }
    }
}
