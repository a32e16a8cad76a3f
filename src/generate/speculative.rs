//! Speculative decoding: fewer sequential forward passes, the same output.
//!
//! A decode step reads every weight to make one token. A pass over k + 1 tokens reads them once
//! too, so verifying k guessed tokens costs about one decode step: when a cheap drafter guesses
//! right, the model moves several tokens per pass. [`Generation`](super::Generation) does it
//! when [`GenerateOptions::speculative`](super::GenerateOptions::speculative) asks:
//!
//! 1. the drafter guesses up to k tokens after the last one ([`DraftSource`]: prompt lookup, a
//!    draft model, or a replay of known acceptance for benchmarks);
//! 2. one forward pass runs the last token and the guesses, with a row of logits each: row i
//!    predicts the token after the first i guesses;
//! 3. the rows are sampled in order by the generation's own sampler (filters, repetition
//!    penalty, constraint, random stream: nothing differs from a plain step), and a guess is
//!    kept while the token sampled at its row is the guess itself; the first row that disagrees
//!    gives its own token instead, and when every guess is kept the row after the last is a
//!    token for free (the bonus);
//! 4. the KV cache is cut back past the first rejected guess (`LanguageModel::truncate`), so it
//!    holds exactly what plain decoding would have put there.
//!
//! Why the output is the model's: for a guess made without a distribution (prompt lookup, a
//! greedy draft model, a replay: a point mass q at d), the standard rejection rule (accept d
//! with min(1, p(d)/q(d)) = p(d), otherwise draw from max(0, p − q) renormalised, which is p
//! without d) gives each token with probability p, and so does "sample from p, keep d if the
//! sample is d" — which is what step 3 does, so with the same seed the tokens are the plain
//! run's, one for one. A draft model sampling at temperature > 0 guesses from a distribution q;
//! those guesses are judged by the rule itself ([`accept_probability`], [`residual`]), whose
//! output is distributed as p too (Leviathan et al. 2023, Chen et al. 2023), with more guesses
//! kept than comparing samples would.

use std::borrow::Borrow;

use crate::error::{Error, Result};
use crate::lm::LanguageModel;
use crate::sampling::{argmax, Sampler, SamplerConfig};

/// Speculative decoding's settings (see the [module docs](self)).
#[derive(Clone, Debug, PartialEq)]
pub struct SpeculativeOptions {
    pub source: DraftSource,
    /// The most tokens one pass verifies (k). The generation adapts k to what guesses keep and
    /// passes cost ([`DraftLength`]): the k expected to make the most tokens per millisecond,
    /// and none for a while after a pass that kept nothing, so a drafter that is always wrong
    /// costs almost nothing.
    pub max_draft: usize,
}

impl SpeculativeOptions {
    /// Prompt lookup with the default n-gram sizes and k.
    pub fn lookup() -> SpeculativeOptions {
        SpeculativeOptions { source: DraftSource::lookup(), max_draft: DEFAULT_MAX_DRAFT }
    }

    /// A draft model's guesses (the model is given with
    /// [`Generation::with_draft_model`](super::Generation::with_draft_model)).
    pub fn draft_model() -> SpeculativeOptions {
        SpeculativeOptions { source: DraftSource::DraftModel, max_draft: DEFAULT_MAX_DRAFT }
    }

    /// An [`Error::Input`] for options out of range: k must be 1 to [`MAX_DRAFT`], the n-gram
    /// sizes 1 to [`MAX_NGRAM`] with the smaller first.
    pub fn validate(&self) -> Result<()> {
        if !(1..=MAX_DRAFT).contains(&self.max_draft) {
            return Err(Error::Input(format!(
                "draft length {} is out of range: it must be 1 to {MAX_DRAFT}",
                self.max_draft
            )));
        }
        if let DraftSource::Lookup { min_ngram, max_ngram } = self.source {
            if !(1..=MAX_NGRAM).contains(&max_ngram) || !(1..=max_ngram).contains(&min_ngram) {
                return Err(Error::Input(format!(
                    "prompt lookup's n-gram sizes {min_ngram} to {max_ngram} are out of range: \
                     1 <= min <= max <= {MAX_NGRAM}"
                )));
            }
        }
        Ok(())
    }
}

/// k unless asked otherwise: the benchmark's target shape, and a pass of 5 tokens still costs
/// about one decode step on the CPU (tiles of 4 tokens) and the GPU (up to 8 tokens per
/// matrix-vector pass).
pub const DEFAULT_MAX_DRAFT: usize = 4;
/// The most guesses a pass may verify: past this a pass costs like a prefill, not a step.
pub const MAX_DRAFT: usize = 16;
/// The longest n-gram prompt lookup matches.
pub const MAX_NGRAM: usize = 8;

/// Where the guesses come from.
#[derive(Clone, Debug, PartialEq)]
pub enum DraftSource {
    /// Prompt lookup: find the latest earlier place where the sequence's last n tokens occurred
    /// (the prompt and the text so far; n from `max_ngram` down to `min_ngram`) and guess the
    /// tokens that followed there. No second model; strong wherever the output copies its input
    /// (code, JSON, quotations, a chat that repeats the question, a small model's loops).
    Lookup { min_ngram: usize, max_ngram: usize },
    /// A second model with the same vocabulary, run ahead of the main one with its own KV cache
    /// ([`Generation::with_draft_model`](super::Generation::with_draft_model)): greedy when the
    /// generation is, otherwise sampling with the same settings (judged by the rejection rule).
    DraftModel,
    /// A known continuation (a benchmark's drafter of known acceptance): the guess for the i-th
    /// generated token is `tokens[i]`, except that every `wrong_every`-th one (0: none; 1: all;
    /// 2: every other) is replaced by a token it is not.
    Replay { tokens: Vec<u32>, wrong_every: usize },
}

impl DraftSource {
    /// Prompt lookup matching 4 tokens down to 1 (llama.cpp's lookup decoding's range).
    pub fn lookup() -> DraftSource {
        DraftSource::Lookup { min_ngram: 1, max_ngram: 4 }
    }

    /// A name for reports: "prompt lookup", "draft model", "replay".
    pub fn name(&self) -> &'static str {
        match self {
            DraftSource::Lookup { .. } => "prompt lookup",
            DraftSource::DraftModel => "draft model",
            DraftSource::Replay { .. } => "replay",
        }
    }
}

/// What speculative decoding did in one generation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpeculationStats {
    /// The drafter's name ([`DraftSource::name`]).
    pub source: &'static str,
    /// Verification passes: the last token and a draft in one forward pass.
    pub passes: usize,
    /// Tokens guessed in those passes, and how many of them the model kept.
    pub drafted: usize,
    pub accepted: usize,
    /// Every forward pass after the prompt's (verification passes and plain steps): what the
    /// tokens after the first cost in passes.
    pub decode_passes: usize,
    /// Time spent guessing (the lookup, the draft model's passes), within the decode time.
    pub draft_ms: f64,
}

impl SpeculationStats {
    /// The share of guesses kept (0 when nothing was guessed).
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }

    /// Tokens per forward pass after the prompt's, for `generated` tokens (the first comes from
    /// the prompt's pass): 1 for plain decoding, up to k + 1.
    pub fn tokens_per_pass(&self, generated: usize) -> f64 {
        if self.decode_passes == 0 {
            1.0
        } else {
            generated.saturating_sub(1) as f64 / self.decode_passes as f64
        }
    }
}

/// How a generated token relates to the draft of the pass it came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The model's token at this row is the guess: kept.
    Accepted,
    /// The model's token differs from the guess (`Speculated::drafted[row]`): the guesses
    /// from here on were thrown away and the KV cache cut back.
    Rejected,
    /// Every guess was kept, and this is the row after the last: a token for free.
    Bonus,
}

impl Outcome {
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Accepted => "accepted",
            Outcome::Rejected => "rejected",
            Outcome::Bonus => "bonus",
        }
    }
}

/// On a token made by a verification pass: which pass, which row of it, and the pass's draft.
#[derive(Clone, Debug, PartialEq)]
pub struct Speculated {
    /// The pass's number in this generation (0, 1, ...).
    pub pass: usize,
    /// The row this token was sampled from: row i comes after the last token and the first i
    /// guesses.
    pub row: usize,
    /// Every guess the pass verified.
    pub drafted: Vec<u32>,
    pub outcome: Outcome,
}

/// One drafter's guesses, and for each the distribution it was drawn from when it was drawn
/// (a draft model sampling); empty `q` for guesses made without one.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Draft {
    pub ids: Vec<u32>,
    pub q: Vec<Vec<(u32, f32)>>,
}

/// The probability of keeping a guess that the target gives `p` and the drafter gave `q`:
/// min(1, p/q). (A guess the drafter could not have made, q = 0, is kept exactly when the
/// target can make it.)
pub fn accept_probability(p: f64, q: f64) -> f64 {
    if q <= 0.0 {
        return if p > 0.0 { 1.0 } else { 0.0 };
    }
    (p / q).min(1.0)
}

/// What a rejected guess is replaced with: max(0, p − q) renormalised, over the target's
/// tokens (`p`, `q`: (id, probability)). Tokens the target cannot make never come out. Empty
/// when p ≤ q everywhere, which happens only when p = q up to rounding, where a guess is
/// rejected with probability ~0: the caller draws from p then.
pub fn residual(p: &[(u32, f32)], q: &[(u32, f32)]) -> Vec<(u32, f32)> {
    let q_of = |id: u32| q.iter().find(|&&(i, _)| i == id).map_or(0.0, |&(_, w)| w as f64);
    let rest: Vec<(u32, f64)> = p
        .iter()
        .map(|&(id, w)| (id, (w as f64 - q_of(id)).max(0.0)))
        .filter(|&(_, w)| w > 0.0)
        .collect();
    let mass: f64 = rest.iter().map(|&(_, w)| w).sum();
    rest.into_iter().map(|(id, w)| (id, (w / mass) as f32)).collect()
}

/// How many tokens to guess at each step: the k that makes the most tokens per millisecond,
/// judged from what passes have kept and what they cost so far.
///
/// - What guesses keep: for each guess position i (the first guess of a pass, the second, ...),
///   the share of passes that reached it and kept it, decayed at each pass so old passes fade,
///   and counted with a prior worth half a pass: the share of the position before (0.8 for the
///   first). So a position not tried lately drifts back to what the one before it keeps and gets
///   tried again; a fixed prior would leave k at 1 for good where a guess costs much (wasm: a
///   guess adds 0.6 of a step, and four guesses at a prior of 0.8 looked worse than one). A pass
///   of k guesses is then expected to make 1 + a₀ + a₀a₁ + ... + a₀···aₖ₋₁ tokens. Position by
///   position, not one rate for all: a drafter whose first guess is usually right and second
///   usually wrong is worth k = 1, where one overall rate (1/2) would say k = 2 for the same two
///   tokens at a dearer pass.
/// - What a pass costs, in plain steps (a moving average of a step's time): for each k, a
///   moving average over passes of k guesses (guessing included); about 1.2 steps for one guess
///   on a host where a step reads the weights from memory, near 2 where a step is compute-bound
///   (a tiny model, or wasm). A k not yet timed is priced from the timed ones: between two, on
///   the line between them; past the longest, each further guess at [`LONGER_PASS_GUESS`] of
///   what that one's guesses cost each (a tile of more tokens unpacks each weight block once
///   for all of them: in wasm a pass of one guess cost 0.98 of a step a guess and one of four
///   0.82; natively on Zen 4 0.17 and 0.29, and a price too low costs a pass or two before that
///   length has its own); short of the shortest, in proportion; none timed, at the
///   prior. One price a guess for every k, from the passes of one guess that begin a run, put
///   four guesses at 4.9 steps in wasm where they cost 4.3: five tokens for less than five
///   steps, never tried.
/// - The first pass of each length is not timed: it pays once for what later ones do not. In
///   wasm the engine compiles a tile's optimised code during its first calls (Node 24,
///   SmolLM2-135M Q8_0 shape, `tools/wasm_passes.mjs`: a pass of 2 tokens took 23.3 ms the first
///   time, 15.0 later); timed, that pass made a guess look dearer than a step.
///
/// The first decode step is a plain one, to have a step's time to weigh passes by; the first
/// passes guess once, since what a guess costs is not known before one is timed (where guesses
/// are dear, wasm, a first pass of four that kept nothing cost 3.5 steps): the second of them
/// times it. After a pass that kept nothing,
/// or when no k beats plain steps (passes that cost what their tokens do), no guessing for 1, 2,
/// 4, ... up to [`MAX_BACKOFF`] steps, then one guess to try: a draft model that is never right
/// costs one small pass in every few dozen steps, and a drafter that stops being right (prompt
/// lookup past the copied text) costs one pass, not the several its counts would need to fall.
///
/// A drafter that guesses for free (prompt lookup, a replay) is also asked between passes, and
/// its guess checked against the token the plain step makes ([`shadow`](DraftLength::shadow)):
/// what a one-guess pass would have kept, known without the pass (with a drafter that guesses
/// one token, the plain step's token is the guess exactly as often as the rejection rule keeps
/// it). Then no pass is tried, not even the first, until such a guess was right, and two right
/// in a row end a back-off at once where the counts say passes pay: a drafter that is never
/// right costs no pass at all (its probes cost 10-19 % of decode's speed where a guess costs
/// most, wasm and the 1B shape's Q4_0 passes), and one that becomes right is back within a few
/// steps.
#[derive(Clone, Debug)]
pub struct DraftLength {
    max: usize,
    /// Per guess position: passes that reached it, and that kept it (decayed counts).
    reached: Vec<f64>,
    kept: Vec<f64>,
    /// Per number of guesses (0 to `max`): what a pass of that many costs, in plain steps (a
    /// moving average), once one was timed.
    cost: Vec<Option<f64>>,
    /// Whether a pass has run without a clock to time it (then the prior prices every k).
    unclocked: bool,
    backoff: usize,
    wait: usize,
    /// A plain step's milliseconds (a moving average), once one was timed.
    step_ms: Option<f64>,
    /// Whether the drafter's guesses are checked between passes ([`shadowing`]), and whether
    /// one was right since the last pass.
    ///
    /// [`shadowing`]: DraftLength::shadowing
    shadowed: bool,
    shadow_right: bool,
    /// The guesses checked between passes that were right in a row, up to the last.
    shadow_run: usize,
    /// Per number of guesses (0 to `max`): whether a pass of that many has run (its first is
    /// not timed).
    ran: Vec<bool>,
}

/// `x` folded into the moving average `avg` (`x` itself for the first).
fn moving_average(avg: Option<f64>, x: f64) -> f64 {
    avg.map_or(x, |avg| 0.7 * avg + 0.3 * x)
}

/// The most plain steps between tries of a drafter that keeps failing.
pub const MAX_BACKOFF: usize = 32;

/// Each position's prior share of guesses kept, and what the prior weighs (in passes).
const PRIOR_KEPT: f64 = 0.8;
const PRIOR_WEIGHT: f64 = 0.5;
/// What each pass keeps of the counts before it.
const DECAY: f64 = 0.9;
/// What a guess adds to a pass before one was timed, in plain steps.
const PRIOR_PER_GUESS: f64 = 0.2;
/// What each guess beyond a timed pass's adds, as a share of what that pass's guesses cost
/// each (see [`DraftLength`]).
const LONGER_PASS_GUESS: f64 = 0.8;

impl DraftLength {
    pub fn new(max: usize) -> DraftLength {
        DraftLength {
            max,
            reached: vec![0.0; max],
            kept: vec![0.0; max],
            cost: vec![None; max + 1],
            unclocked: false,
            backoff: 0,
            wait: 1,
            step_ms: None,
            shadowed: false,
            shadow_right: false,
            shadow_run: 0,
            ran: vec![false; max + 1],
        }
    }

    /// This length for a drafter that guesses for free, whose guesses between passes are
    /// checked ([`shadow`](DraftLength::shadow)).
    pub fn shadowing(self) -> DraftLength {
        DraftLength { shadowed: true, ..self }
    }

    /// The guesses to make at this step: 0 while backing off.
    pub fn for_this_step(&mut self) -> usize {
        if self.wait > 0 {
            self.wait -= 1;
            return 0;
        }
        // The first pass, and the first after a back-off: one guess to try (the cheapest pass,
        // which also times what a guess costs); the counts choose after it. Not while the
        // guesses checked between passes have all been wrong: the try would keep nothing.
        if self.backoff > 0 || !self.priced() {
            return (!self.shadowed || self.shadow_right) as usize;
        }
        self.best().map_or(1, |(k, _)| k)
    }

    /// A plain decode step took `ms` (its forward pass).
    pub fn time_plain_step(&mut self, ms: f64) {
        self.step_ms = Some(moving_average(self.step_ms, ms));
    }

    /// A pass verified `drafted` guesses and kept `accepted` in `ms` (guessing and its forward
    /// pass).
    pub fn record(&mut self, drafted: usize, accepted: usize, ms: f64) {
        let drafted = drafted.min(self.max);
        self.decay();
        self.shadow_right = false;
        self.shadow_run = 0;
        // Positions 0..accepted were kept; the first rejected one was reached.
        for i in 0..(accepted + 1).min(drafted) {
            self.reached[i] += 1.0;
            self.kept[i] += (i < accepted) as u8 as f64;
        }
        // The first pass of this length is not what the next ones will cost.
        let first = !std::mem::replace(&mut self.ran[drafted], true);
        match self.step_ms.filter(|&s| s > 0.0) {
            Some(step) if drafted > 0 && !first => {
                let steps = (ms / step).clamp(1.0, 1.0 + 4.0 * drafted as f64);
                self.cost[drafted] = Some(moving_average(self.cost[drafted], steps));
            }
            Some(_) => {}
            None => self.unclocked = true,
        }
        // A pass that kept nothing never paid, whatever the counts still say.
        if accepted == 0 || self.best().is_none() {
            self.backoff = (self.backoff * 2).clamp(1, MAX_BACKOFF);
            self.wait = self.backoff;
        } else {
            self.backoff = 0;
        }
    }

    /// Between passes, the drafter's guess for the token a plain step made was `right` or not:
    /// counted as a one-guess pass would have been.
    pub fn shadow(&mut self, right: bool) {
        self.decay();
        self.reached[0] += 1.0;
        self.kept[0] += right as u8 as f64;
        self.shadow_right |= right;
        self.shadow_run = if right { self.shadow_run + 1 } else { 0 };
        // Right twice in a row (a run, as where lookup's copying begins; one right guess says
        // little about the next: a drafter right every other token would pass on its wrong
        // ones) and passes pay by the counts: no need to wait out the back-off.
        if self.shadow_run >= 2 && self.priced() && self.best().is_some() {
            self.wait = 0;
        }
    }

    /// Old counts fade: each pass, or guess checked between passes, keeps `DECAY` of them.
    fn decay(&mut self) {
        for i in 0..self.max {
            self.reached[i] *= DECAY;
            self.kept[i] *= DECAY;
        }
    }

    /// The share of passes reaching each guess position that keep it.
    pub fn kept_shares(&self) -> Vec<f64> {
        let mut prior = PRIOR_KEPT;
        (0..self.max)
            .map(|i| {
                prior = (self.kept[i] + prior * PRIOR_WEIGHT) / (self.reached[i] + PRIOR_WEIGHT);
                prior
            })
            .collect()
    }

    /// Whether passes have a price: one was timed, or ran with no clock to time it.
    fn priced(&self) -> bool {
        self.unclocked || self.cost.iter().any(Option::is_some)
    }

    /// What a pass of `k` guesses costs, in plain steps: timed, or priced from the nearest
    /// timed length (see [`DraftLength`]).
    fn pass_cost(&self, k: usize) -> f64 {
        if let Some(c) = self.cost[k] {
            return c;
        }
        let per_guess = |j: usize, c: f64| (c - 1.0) / j as f64;
        let below = (1..k).rev().find_map(|j| self.cost[j].map(|c| (j, c)));
        let above = (k + 1..=self.max).find_map(|j| self.cost[j].map(|c| (j, c)));
        match (below, above) {
            (Some((i, a)), Some((j, b))) => a + (b - a) * (k - i) as f64 / (j - i) as f64,
            (Some((j, c)), None) => c + (k - j) as f64 * LONGER_PASS_GUESS * per_guess(j, c),
            (None, Some((j, c))) => 1.0 + k as f64 * per_guess(j, c),
            (None, None) => 1.0 + k as f64 * PRIOR_PER_GUESS,
        }
    }

    /// The k (1 to the most) expected to make the most tokens per plain step's time, with that
    /// rate; `None` when none beats plain steps (1 token a step).
    pub fn best(&self) -> Option<(usize, f64)> {
        let (mut tokens, mut reach) = (1.0, 1.0);
        let mut best: Option<(usize, f64)> = None;
        for (k, share) in (1..=self.max).zip(self.kept_shares()) {
            reach *= share;
            tokens += reach;
            let rate = tokens / self.pass_cost(k);
            // Ties go to the longer draft (more tokens a pass).
            if rate > 1.0 && best.is_none_or(|(_, r)| rate >= r) {
                best = Some((k, rate));
            }
        }
        best
    }
}

/// The guesses after `tokens` by prompt lookup: the tokens that followed the latest earlier
/// occurrence of its last n tokens, n from `max_ngram` down to `min_ngram`, at most `k`.
pub fn lookup(tokens: &[u32], min_ngram: usize, max_ngram: usize, k: usize) -> Vec<u32> {
    let len = tokens.len();
    for n in (min_ngram.max(1)..=max_ngram).rev() {
        if n >= len {
            continue;
        }
        let pattern = &tokens[len - n..];
        // The latest start j whose n tokens match and have at least one token after them
        // (j + n < len), the match at the end itself excluded.
        let found = (0..len - n).rev().find(|&j| &tokens[j..j + n] == pattern);
        if let Some(j) = found {
            let from = j + n;
            return tokens[from..(from + k).min(len)].to_vec();
        }
    }
    Vec::new()
}

/// The guesses for the generated tokens from `generated` on, from a replay (see
/// [`DraftSource::Replay`]).
fn replay(
    tokens: &[u32],
    wrong_every: usize,
    n_vocab: usize,
    generated: usize,
    k: usize,
) -> Vec<u32> {
    let end = (generated + k).min(tokens.len());
    (generated.min(end)..end)
        .map(|i| {
            let wrong = wrong_every > 0 && i % wrong_every == wrong_every - 1;
            if wrong {
                (tokens[i] + 1) % n_vocab as u32
            } else {
                tokens[i]
            }
        })
        .collect()
}

/// A draft model run ahead of the main one.
pub(crate) struct DraftRunner<M: LanguageModel, R> {
    model: R,
    state: M::State,
    /// The ids the state holds.
    held: Vec<u32>,
    /// Its own random stream (the main sampler's must draw only what a plain run draws).
    sampler: Sampler,
}

/// The drafter a generation runs.
pub(crate) enum Drafter<M: LanguageModel, R> {
    Lookup {
        min_ngram: usize,
        max_ngram: usize,
    },
    Replay {
        tokens: Vec<u32>,
        wrong_every: usize,
    },
    /// A draft model, once given.
    Model(Option<DraftRunner<M, R>>),
}

impl<M: LanguageModel, R: Borrow<M>> Drafter<M, R> {
    pub(crate) fn new(source: &DraftSource) -> Drafter<M, R> {
        match source {
            &DraftSource::Lookup { min_ngram, max_ngram } => {
                Drafter::Lookup { min_ngram, max_ngram }
            }
            DraftSource::Replay { tokens, wrong_every } => {
                Drafter::Replay { tokens: tokens.clone(), wrong_every: *wrong_every }
            }
            DraftSource::DraftModel => Drafter::Model(None),
        }
    }

    /// Give the drafter its model: one with the main model's vocabulary size and BOS.
    pub(crate) fn set_model(&mut self, main: &M, model: R, cfg: &SamplerConfig) -> Result<()> {
        let Drafter::Model(slot) = self else {
            return Err(Error::Input(
                "a draft model was given but the generation does not draft with one".into(),
            ));
        };
        let m: &M = model.borrow();
        if m.vocab_size() != main.vocab_size() || m.bos_token() != main.bos_token() {
            return Err(Error::Input(format!(
                "the draft model's vocabulary ({} tokens, BOS {:?}) is not the model's ({} \
                 tokens, BOS {:?}): a draft model must share the model's tokenizer",
                m.vocab_size(),
                m.bos_token(),
                main.vocab_size(),
                main.bos_token()
            )));
        }
        // Its own stream, apart from the main sampler's, so the main one draws what a plain
        // run would.
        let cfg = SamplerConfig { seed: cfg.seed ^ 0x5EC0_1A7E_D7AF_7000, ..cfg.clone() };
        *slot = Some(DraftRunner {
            state: m.new_state(),
            model,
            held: Vec::new(),
            sampler: Sampler::new(cfg),
        });
        Ok(())
    }

    /// Whether guessing costs next to nothing (no model runs): such guesses are checked between
    /// passes too ([`DraftLength::shadowing`]).
    pub(crate) fn guesses_for_free(&self) -> bool {
        !matches!(self, Drafter::Model(_))
    }

    /// Up to `k` guesses after `tokens` (the prompt, then `generated` tokens).
    pub(crate) async fn draft(
        &mut self,
        tokens: &[u32],
        generated: usize,
        k: usize,
        n_vocab: usize,
    ) -> Result<Draft> {
        match self {
            Drafter::Lookup { min_ngram, max_ngram } => {
                Ok(Draft { ids: lookup(tokens, *min_ngram, *max_ngram, k), q: Vec::new() })
            }
            Drafter::Replay { tokens: replayed, wrong_every } => Ok(Draft {
                ids: replay(replayed, *wrong_every, n_vocab, generated, k),
                q: Vec::new(),
            }),
            Drafter::Model(None) => Err(Error::Input(
                "speculative decoding with a draft model needs one: none was loaded".into(),
            )),
            Drafter::Model(Some(runner)) => runner.draft(tokens, k).await,
        }
    }
}

impl<M: LanguageModel, R: Borrow<M>> DraftRunner<M, R> {
    /// Catch the draft model up with `tokens` (keeping the prefix its cache shares with them),
    /// then guess `k` tokens one pass at a time: the argmax when the main sampler is greedy,
    /// otherwise a draw from the draft's own reshaped distribution, reported as `q`.
    async fn draft(&mut self, tokens: &[u32], k: usize) -> Result<Draft> {
        let model: &M = self.model.borrow();
        let k = k.min(model.context_length().saturating_sub(tokens.len()));
        if k == 0 {
            return Ok(Draft::default());
        }
        let keep = crate::chat::common_prefix(&self.held, tokens).min(tokens.len() - 1);
        model.truncate(&mut self.state, keep)?;
        self.held.truncate(keep);
        let mut row = model.forward_async(&mut self.state, &tokens[keep..], false).await?;
        self.held.extend_from_slice(&tokens[keep..]);
        let greedy = self.sampler.config().is_greedy();
        let mut history = tokens.to_vec();
        let mut draft = Draft::default();
        for i in 0..k {
            let id = if greedy {
                argmax(&row)
            } else {
                let q = self.sampler.kept(&row, &history);
                let id = self.sampler.draw_from(&q);
                draft.q.push(q);
                id
            };
            draft.ids.push(id);
            history.push(id);
            if i + 1 < k {
                row = model.forward_async(&mut self.state, &[id], false).await?;
                self.held.push(id);
            }
        }
        Ok(draft)
    }
}
