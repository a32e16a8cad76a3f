//! Autoregressive generation: feed the prompt, pick a token, feed it back, repeat. Plus the two
//! other things one does with P(x_t | x_<t): beam search (look for the most probable sequence
//! rather than sample one) and scoring (the chain rule: P(sequence) = Π P(token | prefix),
//! computed as a sum of logs).
//!
//! [`Generation`] is the loop unrolled into steps, so a browser worker can pull one token at a
//! time; [`generate`] drives it with a callback for native code and tests.

use std::borrow::Borrow;
use std::marker::PhantomData;

use crate::error::{Error, Result};
use crate::lm::{LanguageModel, Vocab};
use crate::sampling::{log_softmax_at, logsumexp, top_n, Pick, Sampler, SamplerConfig};

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Most tokens to generate (the end token included when it is sampled).
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Generation stops when the text contains one of these; the text is cut just before it.
    pub stop_strings: Vec<String>,
    /// Stop when the model samples one of its end tokens.
    pub stop_at_eos: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: 256,
            sampler: SamplerConfig::default(),
            stop_strings: Vec::new(),
            stop_at_eos: true,
        }
    }
}

/// One generated token, as the stream reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenEvent {
    pub id: u32,
    /// The text this token adds. Can be empty: the end token adds none, and an incomplete
    /// multi-byte character (byte-fallback tokens) is held back until its last byte arrives, as
    /// is text that could be the start of a stop string.
    pub text: String,
    /// What the model believed: plain-softmax probability of `id` (see [`Pick`]).
    pub prob: f32,
    pub logprob: f32,
    /// The five most probable ids at this step, with their probabilities.
    pub top: Vec<(u32, f32)>,
    /// Index of this token in the whole sequence (the prompt takes 0..prompt length).
    pub position: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The model chose an end token.
    Eos,
    /// The text reached a stop string.
    StopString,
    /// `max_tokens` were generated.
    MaxTokens,
    /// The sequence filled the model's context.
    ContextFull,
    /// The caller stopped it ([`Generation::abort`], or `on_token` returning false).
    Aborted,
}

#[derive(Clone, Debug, PartialEq)]
pub struct GenerationSummary {
    pub prompt_tokens: usize,
    /// Tokens sampled, the end token included.
    pub generated_tokens: usize,
    pub text: String,
    pub stop_reason: StopReason,
    /// The prompt's forward pass.
    pub prefill_ms: f64,
    /// Everything after the first token: one-token forward passes and sampling.
    pub decode_ms: f64,
    /// From the first step's start until the first token was known.
    pub ttft_ms: f64,
}

/// Milliseconds since some fixed origin. A plain `fn` so wasm can pass one that reads
/// `performance.now()`.
pub type Clock = fn() -> f64;

/// `Instant`-based natively. wasm has no `Instant`, so there this reads 0: timings stay 0 unless
/// the caller supplies a clock with [`Generation::with_clock`].
pub fn default_clock() -> f64 {
    #[cfg(not(target_arch = "wasm32"))]
    {
        use std::sync::OnceLock;
        use std::time::Instant;
        static ORIGIN: OnceLock<Instant> = OnceLock::new();
        ORIGIN.get_or_init(Instant::now).elapsed().as_secs_f64() * 1000.0
    }
    #[cfg(target_arch = "wasm32")]
    {
        0.0
    }
}

/// Prompt tokens decoded in front of the generated ones. Tokenizers drop the leading space of
/// the first token they decode; with a bit of prompt in front, the first generated word keeps
/// its space (" cat", not "cat") and can be appended to the prompt as is.
const ANCHOR_TOKENS: usize = 4;

/// A generation in progress. Each [`step`](Generation::step) yields one token.
///
/// It borrows its model and vocabulary ([`Generation::new`]) or holds them by any other handle
/// that borrows as them, e.g. `Rc<M>` and `Rc<dyn Vocab>` ([`Generation::with_handles`]), which
/// lets a wasm object own a model and a generation over it together.
pub struct Generation<'m, M: LanguageModel, R = &'m M, V = &'m dyn Vocab> {
    model: R,
    vocab: V,
    _borrows: PhantomData<(&'m (), fn() -> M)>,
    opts: GenerateOptions,
    sampler: Sampler,
    state: M::State,
    /// Prompt, then every sampled token: what the repetition penalty looks at.
    tokens: Vec<u32>,
    prompt_len: usize,
    prefilled: bool,
    /// Logits for the next token (once prefilled).
    logits: Vec<f32>,
    /// The last token, sampled but not yet fed to the model. It is fed at the start of the next
    /// step, so the caller gets each token before the model works on the one after.
    pending: Option<u32>,
    /// The anchor (last prompt tokens) followed by the generated tokens that make text (not the
    /// end token), and the text of the anchor alone: their difference is the generated text.
    decode_ids: Vec<u32>,
    anchor_len: usize,
    anchor_text: String,
    /// The text streamed so far.
    text: String,
    stop: Option<StopReason>,
    clock: Clock,
    prefill_ms: f64,
    decode_ms: f64,
    ttft_ms: Option<f64>,
    /// When the step in progress started (see [`Generation::step_input`]).
    step_start: f64,
}

impl<'m, M: LanguageModel> Generation<'m, M> {
    pub fn new(
        model: &'m M,
        vocab: &'m dyn Vocab,
        prompt_ids: &[u32],
        opts: GenerateOptions,
    ) -> Result<Self> {
        Generation::with_handles(model, vocab, prompt_ids, opts)
    }
}

impl<'m, M, R, V> Generation<'m, M, R, V>
where
    M: LanguageModel,
    R: Borrow<M>,
    V: Borrow<dyn Vocab + 'm>,
{
    /// Like [`Generation::new`], with the model and vocabulary held through `R` and `V` (for
    /// example `Rc<M>` and `Rc<dyn Vocab>`) instead of borrowed.
    pub fn with_handles(
        model: R,
        vocab: V,
        prompt_ids: &[u32],
        opts: GenerateOptions,
    ) -> Result<Self> {
        let m: &M = Borrow::<M>::borrow(&model);
        check_prompt(m, prompt_ids)?;
        if opts.stop_strings.iter().any(String::is_empty) {
            return Err(Error::Input("a stop string is empty (it would match at once)".into()));
        }
        let anchor = &prompt_ids[prompt_ids.len().saturating_sub(ANCHOR_TOKENS)..];
        let state = m.new_state();
        let anchor_text = Borrow::<dyn Vocab + 'm>::borrow(&vocab).decode(anchor);
        Ok(Generation {
            model,
            vocab,
            _borrows: PhantomData,
            sampler: Sampler::new(opts.sampler.clone()),
            opts,
            state,
            tokens: prompt_ids.to_vec(),
            prompt_len: prompt_ids.len(),
            prefilled: false,
            logits: Vec::new(),
            pending: None,
            decode_ids: anchor.to_vec(),
            anchor_len: anchor.len(),
            anchor_text,
            text: String::new(),
            stop: None,
            clock: default_clock,
            prefill_ms: 0.0,
            decode_ms: 0.0,
            ttft_ms: None,
            step_start: 0.0,
        })
    }

    pub fn model(&self) -> &M {
        Borrow::<M>::borrow(&self.model)
    }

    pub fn vocab(&self) -> &dyn Vocab {
        Borrow::<dyn Vocab + 'm>::borrow(&self.vocab)
    }

    /// Time with `clock` instead of [`default_clock`].
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// The next token, or `None` once generation has stopped (see [`stop_reason`]). The first
    /// call runs the whole prompt through the model in one forward pass (prefill); each later
    /// call feeds the previous token (one-token forward pass) and samples the next.
    ///
    /// [`stop_reason`]: Generation::stop_reason
    pub fn step(&mut self) -> Result<Option<TokenEvent>> {
        let Some(tokens) = self.step_input() else {
            return Ok(None);
        };
        let logits = if tokens.is_empty() {
            Vec::new()
        } else {
            Borrow::<M>::borrow(&self.model).forward(&mut self.state, &tokens, false)?
        };
        Ok(Some(self.step_output(logits)))
    }

    /// [`step`](Generation::step) in parts, for a model whose forward pass must be awaited (WebGPU
    /// in the browser): `step_input` gives the tokens to run (`None` once generation has
    /// stopped); run them through the model on [`state_mut`](Generation::state_mut) (all logits
    /// off); hand the logits to [`step_output`](Generation::step_output), which samples the
    /// token. An empty list means no forward pass is needed: pass empty logits. If the forward
    /// pass fails, the state is unchanged and the step can be tried again.
    pub fn step_input(&mut self) -> Option<Vec<u32>> {
        if self.stop.is_some() {
            return None;
        }
        // Only reachable with max_tokens = 0 or a prompt that fills the context: later steps
        // see these coming and stop at the token that hits them.
        if self.opts.max_tokens == 0 {
            self.stop = Some(StopReason::MaxTokens);
            return None;
        }
        if self.prompt_len >= Borrow::<M>::borrow(&self.model).context_length() {
            self.stop = Some(StopReason::ContextFull);
            return None;
        }
        self.step_start = (self.clock)();
        if !self.prefilled {
            Some(self.tokens.clone())
        } else {
            Some(self.pending.map(|id| vec![id]).unwrap_or_default())
        }
    }

    /// The model state the tokens of [`step_input`](Generation::step_input) go into.
    pub fn state_mut(&mut self) -> &mut M::State {
        &mut self.state
    }

    /// Finish a step begun with [`step_input`](Generation::step_input): sample from `logits`
    /// (the last row of the forward pass; empty keeps the previous logits) and report the token.
    pub fn step_output(&mut self, logits: Vec<f32>) -> TokenEvent {
        let start = self.step_start;
        if !logits.is_empty() {
            self.logits = logits;
        }
        if !self.prefilled {
            self.prefilled = true;
            self.prefill_ms = (self.clock)() - start;
        } else {
            self.pending = None;
        }

        let pick = self.sampler.sample(&self.logits, &self.tokens);
        let event = self.accept(pick);

        let elapsed = (self.clock)() - start;
        match self.ttft_ms {
            None => self.ttft_ms = Some(elapsed),
            Some(_) => self.decode_ms += elapsed,
        }
        event
    }

    /// Record the sampled token, decide whether it is the last, and work out its text.
    fn accept(&mut self, pick: Pick) -> TokenEvent {
        let position = self.tokens.len();
        self.tokens.push(pick.id);
        if self.opts.stop_at_eos && Borrow::<M>::borrow(&self.model).eos_tokens().contains(&pick.id)
        {
            self.stop = Some(StopReason::Eos);
        } else {
            self.decode_ids.push(pick.id);
            if self.tokens.len() - self.prompt_len >= self.opts.max_tokens {
                self.stop = Some(StopReason::MaxTokens);
            } else if self.tokens.len() >= Borrow::<M>::borrow(&self.model).context_length() {
                self.stop = Some(StopReason::ContextFull);
            } else {
                self.pending = Some(pick.id);
            }
        }

        let full = self.generated_text();
        let (end, hit_stop_string) =
            visible_end(&full, self.text.len(), &self.opts.stop_strings, self.stop.is_some());
        if hit_stop_string {
            self.stop = Some(StopReason::StopString);
            self.pending = None;
        }
        let new_from = common_prefix_len(&self.text, &full).min(end);
        let text = full[new_from..end].to_string();
        self.text.truncate(new_from);
        self.text.push_str(&text);

        TokenEvent {
            id: pick.id,
            text,
            prob: pick.prob,
            logprob: pick.logprob,
            top: pick.top,
            position,
        }
    }

    /// Decode of everything generated so far, as a whole (so multi-byte characters split over
    /// tokens come out right), without the prompt.
    fn generated_text(&self) -> String {
        let full = Borrow::<dyn Vocab + 'm>::borrow(&self.vocab).decode(&self.decode_ids);
        match full.strip_prefix(self.anchor_text.as_str()) {
            Some(generated) => generated.to_string(),
            // The prompt's last tokens merged with the first generated ones: decode them alone.
            None => Borrow::<dyn Vocab + 'm>::borrow(&self.vocab)
                .decode(&self.decode_ids[self.anchor_len..]),
        }
    }

    /// Stop now; later steps return `None`. (No-op if already stopped.)
    pub fn abort(&mut self) {
        self.stop.get_or_insert(StopReason::Aborted);
        self.pending = None;
    }

    pub fn stop_reason(&self) -> Option<StopReason> {
        self.stop
    }

    pub fn is_done(&self) -> bool {
        self.stop.is_some()
    }

    pub fn prompt_ids(&self) -> &[u32] {
        &self.tokens[..self.prompt_len]
    }

    /// Every sampled id, the end token included if it was sampled.
    pub fn generated_ids(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// The text streamed so far (the concatenation of the events' `text`).
    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn prefill_ms(&self) -> f64 {
        self.prefill_ms
    }

    pub fn decode_ms(&self) -> f64 {
        self.decode_ms
    }

    /// Time to first token; `None` before it.
    pub fn ttft_ms(&self) -> Option<f64> {
        self.ttft_ms
    }

    /// The totals, once generation has stopped.
    pub fn summary(&self) -> Option<GenerationSummary> {
        Some(GenerationSummary {
            prompt_tokens: self.prompt_len,
            generated_tokens: self.generated_ids().len(),
            text: self.text.clone(),
            stop_reason: self.stop?,
            prefill_ms: self.prefill_ms,
            decode_ms: self.decode_ms,
            ttft_ms: self.ttft_ms.unwrap_or(0.0),
        })
    }
}

fn check_prompt<M: LanguageModel>(model: &M, prompt_ids: &[u32]) -> Result<()> {
    if prompt_ids.is_empty() {
        return Err(Error::Input(
            "the prompt is empty: it needs at least one token (usually BOS)".into(),
        ));
    }
    let context = model.context_length();
    if prompt_ids.len() > context {
        return Err(Error::Input(format!(
            "prompt has {} tokens but the model's context is {context}",
            prompt_ids.len()
        )));
    }
    Ok(())
}

/// How much of `full` (the generated text) may be shown, `shown` bytes of it being out already;
/// and whether a stop string was reached (the text then ends just before it). On the `last`
/// token everything goes out.
fn visible_end(full: &str, shown: usize, stop_strings: &[String], last: bool) -> (usize, bool) {
    // A stop string cannot start in text already shown (that text was held back while it could
    // be the start of one), so search the new part only.
    let from = if full.is_char_boundary(shown) { shown } else { 0 };
    let first_stop = stop_strings.iter().filter_map(|s| full[from..].find(s.as_str())).min();
    if let Some(at) = first_stop {
        return (from + at, true);
    }
    if last {
        return (full.len(), false);
    }

    // An incomplete multi-byte character decodes as U+FFFD until its last byte arrives.
    let new = full.get(from..).unwrap_or("");
    let new = new.trim_end_matches('\u{FFFD}');
    // Text that might be the beginning of a stop string waits until we know.
    let hold = stop_strings.iter().map(|s| stop_prefix_len(new, s)).max().unwrap_or(0);
    (from + new.len() - hold, false)
}

/// Length of the longest end of `text` that is a beginning of `stop`.
fn stop_prefix_len(text: &str, stop: &str) -> usize {
    (1..stop.len().min(text.len() + 1))
        .rev()
        .find(|&k| stop.is_char_boundary(k) && text.ends_with(&stop[..k]))
        .unwrap_or(0)
}

/// Bytes `a` and `b` share at the start, on a character boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|&((_, x), y)| x != y)
        .map_or(a.len().min(b.len()), |((i, _), _)| i)
}

/// Run a whole generation, calling `on_token` for each token; `on_token` returning false stops
/// it (reason [`StopReason::Aborted`]).
pub fn generate<M: LanguageModel>(
    model: &M,
    vocab: &dyn Vocab,
    prompt_ids: &[u32],
    opts: GenerateOptions,
    mut on_token: impl FnMut(&TokenEvent) -> bool,
) -> Result<GenerationSummary> {
    let mut generation = Generation::new(model, vocab, prompt_ids, opts)?;
    while let Some(event) = generation.step()? {
        if !on_token(&event) {
            generation.abort();
        }
    }
    Ok(generation.summary().expect("the loop ends only once generation has stopped"))
}

// ---------------------------------------------------------------------------------------------
// Beam search

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BeamOptions {
    /// Hypotheses kept at each step. 1 is greedy decoding.
    pub beams: usize,
    /// Most tokens per hypothesis (the end token included).
    pub max_tokens: usize,
    /// Rank by log P / length instead of log P, so that long hypotheses (more factors below 1)
    /// are not penalised just for being long.
    pub length_normalise: bool,
}

/// The exponent α in score = log P / length^α; 1 is the plain per-token average.
const LENGTH_ALPHA: f64 = 1.0;

#[derive(Clone, Debug, PartialEq)]
pub struct Beam {
    /// Generated ids, without the end token.
    pub ids: Vec<u32>,
    /// ln P(ids, then the end token if finished | prompt).
    pub logprob: f64,
    /// What beams are ranked by: `logprob`, or `logprob / length^α` with length normalisation
    /// (length counting the end token).
    pub score: f64,
    /// Ended with an end token (rather than at `max_tokens` or the context's end).
    pub finished: bool,
}

impl Beam {
    pub fn probability(&self) -> f64 {
        self.logprob.exp()
    }
}

/// A live hypothesis: a beam plus the model state to extend it from.
struct Hypothesis<S> {
    ids: Vec<u32>,
    logprob: f64,
    state: S,
    logits: Vec<f32>,
}

/// Search for the most probable continuations of the prompt. At each step every live hypothesis
/// is extended by its `beams` most probable next tokens, and the best `beams` of all those
/// candidates survive; those ending in an end token are set aside as finished. Returns up to
/// `beams` hypotheses, finished or not, best score first.
pub fn beam_search<M: LanguageModel>(
    model: &M,
    prompt_ids: &[u32],
    opts: BeamOptions,
) -> Result<Vec<Beam>> {
    check_prompt(model, prompt_ids)?;
    if opts.beams == 0 {
        return Err(Error::Input("beam search needs at least one beam".into()));
    }
    let score = |logprob: f64, len: usize| {
        if opts.length_normalise && len > 0 {
            logprob / (len as f64).powf(LENGTH_ALPHA)
        } else {
            logprob
        }
    };
    let eos = model.eos_tokens();
    let context = model.context_length();

    let mut state = model.new_state();
    let logits = model.forward(&mut state, prompt_ids, false)?;
    let mut live = vec![Hypothesis { ids: Vec::new(), logprob: 0.0, state, logits }];
    let mut done: Vec<Beam> = Vec::new();

    for step in 0..opts.max_tokens {
        // Every live hypothesis's best extensions: (which hypothesis, token, total log P).
        let mut candidates: Vec<(usize, u32, f64)> = Vec::new();
        for (h, hyp) in live.iter().enumerate() {
            let lse = logsumexp(&hyp.logits);
            for (id, logit) in top_n(&hyp.logits, opts.beams) {
                if logit > f32::NEG_INFINITY {
                    candidates.push((h, id, hyp.logprob + (logit as f64 - lse)));
                }
            }
        }
        candidates.sort_by(|a, b| b.2.total_cmp(&a.2));
        candidates.truncate(opts.beams);

        let mut next = Vec::with_capacity(candidates.len());
        for (h, id, logprob) in candidates {
            let parent = &live[h];
            if eos.contains(&id) {
                let len = parent.ids.len() + 1;
                done.push(Beam {
                    ids: parent.ids.clone(),
                    logprob,
                    score: score(logprob, len),
                    finished: true,
                });
                continue;
            }
            let mut ids = parent.ids.clone();
            ids.push(id);
            let out_of_room =
                model.position(&parent.state) + 1 >= context || step + 1 == opts.max_tokens;
            if out_of_room {
                // Nothing more will be generated: skip the forward pass that would predict it.
                done.push(Beam { score: score(logprob, ids.len()), ids, logprob, finished: false });
                continue;
            }
            let mut state = parent.state.clone(); // fork: the parent may have other children
            let logits = model.forward(&mut state, &[id], false)?;
            next.push(Hypothesis { ids, logprob, state, logits });
        }
        live = next;

        if live.is_empty()
            || (!opts.length_normalise && cannot_improve(&live, &mut done, opts.beams))
        {
            break;
        }
    }

    // Hypotheses still alive when max_tokens or the context ran out.
    for hyp in live {
        done.push(Beam {
            score: score(hyp.logprob, hyp.ids.len()),
            ids: hyp.ids,
            logprob: hyp.logprob,
            finished: false,
        });
    }
    done.sort_by(|a, b| b.score.total_cmp(&a.score));
    done.truncate(opts.beams);
    Ok(done)
}

/// Without length normalisation a hypothesis's log P only falls as it grows, so once `beams`
/// finished ones all beat the best live one, nothing live can enter the result.
fn cannot_improve<S>(live: &[Hypothesis<S>], done: &mut [Beam], beams: usize) -> bool {
    if done.len() < beams {
        return false;
    }
    done.sort_by(|a, b| b.score.total_cmp(&a.score));
    let worst_kept = done[beams - 1].score;
    live.iter().all(|hyp| hyp.logprob <= worst_kept)
}

// ---------------------------------------------------------------------------------------------
// Scoring

/// How probable a sequence is under a model, token by token. Everything is in log space: a
/// product of hundreds of probabilities underflows even f64, a sum of their logs does not.
#[derive(Clone, Debug, PartialEq)]
pub struct Score {
    /// ln P(token | prefix) for each scored token.
    pub token_logprobs: Vec<f64>,
    /// Their sum: ln P(sequence | its first token).
    pub total_logprob: f64,
    /// Average negative log-likelihood per token, in nats.
    pub avg_nll: f64,
    /// exp(avg_nll): the number of equally likely choices the model was, on average, torn
    /// between. 1 is certainty.
    pub perplexity: f64,
}

impl Score {
    /// From per-token log-probabilities. An empty list scores 0 nats, perplexity 1.
    pub fn from_logprobs(token_logprobs: Vec<f64>) -> Score {
        let total_logprob: f64 = token_logprobs.iter().sum();
        let n = token_logprobs.len();
        let avg_nll = if n == 0 { 0.0 } else { -total_logprob / n as f64 };
        Score { token_logprobs, total_logprob, avg_nll, perplexity: avg_nll.exp() }
    }

    /// From per-token probabilities (each is logged; they are never multiplied).
    pub fn from_probs(probs: &[f64]) -> Score {
        Score::from_logprobs(probs.iter().map(|p| p.ln()).collect())
    }

    /// P(sequence | its first token) = exp(total_logprob); 0 when that underflows.
    pub fn probability(&self) -> f64 {
        self.total_logprob.exp()
    }
}

/// Score `ids` with one forward pass that returns logits at every position. `ids[0]` is the
/// context start (usually BOS) and is not scored; each later token is scored given all before it.
pub fn score<M: LanguageModel>(model: &M, ids: &[u32]) -> Result<Score> {
    if ids.len() < 2 {
        return Err(Error::Input(format!(
            "scoring needs a first token and at least one token to score; got {} ids",
            ids.len()
        )));
    }
    let mut state = model.new_state();
    let logits = model.forward(&mut state, ids, true)?;
    let vocab = model.vocab_size();
    // Row i predicts ids[i + 1].
    let token_logprobs = ids[1..]
        .iter()
        .enumerate()
        .map(|(i, &id)| log_softmax_at(&logits[i * vocab..(i + 1) * vocab], id))
        .collect();
    Ok(Score::from_logprobs(token_logprobs))
}
