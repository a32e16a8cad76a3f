//! Autoregressive generation: feed the prompt, pick a token, feed it back, repeat. Plus the two
//! other things one does with P(x_t | x_<t): beam search (look for the most probable sequence
//! rather than sample one) and scoring (the chain rule: P(sequence) = Π P(token | prefix),
//! computed as a sum of logs).
//!
//! Each is unrolled into forward passes that the caller runs, so a model whose forward pass must
//! be awaited (WebGPU in the browser) drives them as well as a blocking one: [`Generation`] (one
//! token per step; [`generate`] drives it with a callback), [`BeamSearch`] ([`beam_search`]) and
//! [`Scoring`] ([`score`]).

use std::borrow::Borrow;
use std::marker::PhantomData;

use std::sync::Arc;

use crate::constraint::{AllowedSet, Constraint, ConstraintSpec};
use crate::error::{Error, Result};
use crate::lm::{AllowedTop, LanguageModel, TopK, Vocab};
use crate::sampling::{bad_logits, logsumexp, top_n, Pick, Sampler, SamplerConfig, MAX_SHOWN};

pub mod beam;
pub mod score;
pub mod speculative;

pub use crate::timing::{default_clock, per_second, Clock};
pub use beam::{
    beam_search, beam_search_constrained, replay, Beam, BeamNode, BeamOptions, BeamReplay,
    BeamSearch, BeamToken,
};
pub use score::{continuation_ids, score, score_async, scored_pieces, Score, Scoring};
use speculative::{Draft, DraftLength, Drafter};
pub use speculative::{DraftSource, Outcome, Speculated, SpeculationStats, SpeculativeOptions};

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Most tokens to generate (the end token included when it is sampled).
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Generation stops when the text contains one of these; the text is cut just before it.
    pub stop_strings: Vec<String>,
    /// Stop when the model samples one of its end tokens.
    pub stop_at_eos: bool,
    /// More ids that end generation like the model's end tokens (when `stop_at_eos`): a chat
    /// template's end-of-turn markers such as `<|im_end|>` (`chat::ChatTemplate::stop_tokens`).
    pub stop_tokens: Vec<u32>,
    /// Tokens emitted first, in place of sampled ones, each with the probability the model gives
    /// it (a branch: the alternative the reader chose at a position). The sampler draws nothing
    /// for them.
    pub forced: Vec<u32>,
    /// How many of each step's most likely tokens (with their logits) the token events carry
    /// (`TokenEvent::candidates`); 0 for none.
    pub keep_candidates: usize,
    /// Structured output: only tokens that keep the output valid under this JSON schema, regex
    /// or grammar are chosen (the others get `-inf` before the sampler sees the logits; see
    /// [`constraint`](crate::constraint)). The model's end tokens (and `stop_tokens`) are
    /// allowed only once the output is complete; generation stops by itself when nothing can
    /// follow ([`StopReason::ConstraintComplete`]) and with [`StopReason::Incomplete`] when
    /// `max_tokens` or the context runs out first. Needs a tokenizer whose tokens are bytes
    /// ([`Vocab::constraint_vocab`]); cannot be combined with `stop_strings` (the constraint
    /// decides where the output ends). Forced tokens must be allowed by it.
    pub constraint: Option<ConstraintSpec>,
    /// With a constraint: the last this-many prompt ids are already output under it (a branch of
    /// a constrained generation continues from a prompt holding the tokens generated before the
    /// branch point). The constraint consumes them first; one it refuses is an error.
    pub constraint_prefix: usize,
    /// Speculative decoding: guess tokens cheaply and verify several in one forward pass
    /// ([`speculative`]); the output is what plain decoding gives (token for token with the same
    /// seed, unless a draft model samples its guesses). `None`: one pass per token.
    pub speculative: Option<SpeculativeOptions>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: 256,
            sampler: SamplerConfig::default(),
            stop_strings: Vec::new(),
            stop_at_eos: true,
            stop_tokens: Vec::new(),
            forced: Vec::new(),
            keep_candidates: 0,
            constraint: None,
            constraint_prefix: 0,
            speculative: None,
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
    /// The step's most likely tokens with their raw logits, best first, when
    /// `GenerateOptions::keep_candidates` asks for them: what a view of the sampler replays.
    /// Under a constraint, the most likely of the tokens it allowed (what the sampler chose
    /// from).
    pub candidates: Vec<(u32, f32)>,
    /// The log-sum-exp of the step's whole row of logits (the plain softmax's normaliser), when
    /// there are `candidates`: a candidate's probability as the model gives it (the token's
    /// `prob`, constrained or not) is `exp(logit - candidates_logsumexp)`. NaN otherwise.
    pub candidates_logsumexp: f64,
    /// Under a constraint: the tokens it removed at this step from among the model's most likely
    /// (the first `max(alternatives, keep_candidates)` of the plain distribution), with their
    /// plain-softmax probabilities, most likely first. Empty without a constraint.
    pub removed: Vec<(u32, f32)>,
    /// When a verification pass of speculative decoding made this token: which pass, which row,
    /// its draft, and whether the guess at this row was kept ([`Speculated`]).
    pub speculated: Option<Speculated>,
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
    /// The output is complete under the constraint ([`GenerateOptions::constraint`]) and nothing
    /// can follow it (a JSON value's last brace, the end of a fixed-length pattern).
    ConstraintComplete,
    /// `max_tokens` or the context ran out before the output matched the constraint: the text is
    /// not valid output (an unclosed JSON object, a pattern half matched).
    Incomplete,
}

impl StopReason {
    /// Whether the output is what was asked for: anything but [`StopReason::Incomplete`] and
    /// [`StopReason::Aborted`].
    pub fn is_complete(self) -> bool {
        !matches!(self, StopReason::Incomplete | StopReason::Aborted)
    }

    /// A sentence for a user, e.g. "the output does not match the constraint yet: ...".
    pub fn describe(self) -> &'static str {
        match self {
            StopReason::Eos => "the model ended the text",
            StopReason::StopString => "a stop string was reached",
            StopReason::MaxTokens => "max_tokens were generated",
            StopReason::ContextFull => "the context is full",
            StopReason::Aborted => "stopped by the caller",
            StopReason::ConstraintComplete => "the output is complete under the constraint",
            StopReason::Incomplete => {
                "the output does not match the constraint yet: max_tokens or the context ran out \
                 first, so it is not valid output"
            }
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct GenerationSummary {
    pub prompt_tokens: usize,
    /// Prompt tokens whose keys and values were already in the state it started from
    /// ([`Generation::resume`]); the prefill ran only the other `prompt_tokens - reused_tokens`.
    pub reused_tokens: usize,
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
    /// What speculative decoding did, when it was on.
    pub speculation: Option<SpeculationStats>,
}

impl GenerationSummary {
    /// Prompt tokens per second of prefill (the tokens it ran, not those reused).
    pub fn prefill_tokens_per_second(&self) -> f64 {
        per_second(self.prompt_tokens - self.reused_tokens, self.prefill_ms)
    }

    /// Tokens per second after the first (whose time is the prefill's and the first sample's).
    pub fn decode_tokens_per_second(&self) -> f64 {
        per_second(self.generated_tokens.saturating_sub(1), self.decode_ms)
    }
}

/// The ids a prompt starts generation from: BOS (when the model wants one, `bos`) followed by
/// the text's tokens.
pub fn prompt_ids(bos: Option<u32>, vocab: &dyn Vocab, text: &str) -> Result<Vec<u32>> {
    let mut ids: Vec<u32> = bos.into_iter().collect();
    ids.extend(vocab.encode(text)?);
    if ids.is_empty() {
        return Err(Error::Input(
            "the prompt is empty and the model has no BOS token to start from".into(),
        ));
    }
    Ok(ids)
}

/// Prompt tokens decoded in front of the generated ones. Tokenizers drop the leading space of
/// the first token they decode; with a bit of prompt in front, the first generated word keeps
/// its space (" cat", not "cat") and can be appended to the prompt as is.
pub(crate) const ANCHOR_TOKENS: usize = 4;

/// The text a stream of tokens adds, token by token, under one rule for every stream (a
/// generation's events, a beam's replay): a token's text is only what completes characters not
/// shown yet, so the events' texts, concatenated, are the final text byte for byte.
///
/// Text is decoded a segment at a time: the tokens since the last point where everything
/// decoded so far was shown, after up to [`ANCHOR_TOKENS`] tokens before them (their anchor,
/// decoded with them and then cut off, so a word keeps its leading space). A character whose
/// bytes are split over tokens decodes as U+FFFD until its last byte arrives, and is held until
/// then ([`visible_end`]); so is text that could be the start of a stop string. Decoding only
/// the open segment matters for SentencePiece's byte fallback, which turns a whole run of byte
/// tokens into U+FFFD while its last character is incomplete, complete characters before it
/// included: those were shown and closed their segment.
pub(crate) struct TextStream {
    /// The open segment's anchor, then its tokens.
    window: Vec<u32>,
    anchor_len: usize,
    anchor_text: String,
    /// Everything shown.
    text: String,
    /// Bytes at the end of `text` that the open segment shows.
    shown: usize,
}

impl TextStream {
    /// A stream after `prompt_ids` (its last tokens are the first anchor).
    pub(crate) fn new(vocab: &dyn Vocab, prompt_ids: &[u32]) -> TextStream {
        let mut stream = TextStream {
            window: prompt_ids.to_vec(),
            anchor_len: 0,
            anchor_text: String::new(),
            text: String::new(),
            shown: 0,
        };
        stream.close(vocab);
        stream
    }

    /// A token that makes text (not an end token).
    pub(crate) fn push(&mut self, id: u32) {
        self.window.push(id);
    }

    /// The text the tokens pushed since the last call add, and whether it reached one of
    /// `stop_strings` (the text then ends just before it). `last`: the stream ends here, so
    /// nothing is held back.
    pub(crate) fn take(
        &mut self,
        vocab: &dyn Vocab,
        stop_strings: &[String],
        last: bool,
    ) -> (String, bool) {
        let segment = text_after_anchor(vocab, &self.window, self.anchor_len, &self.anchor_text);
        let shown = &self.text[self.text.len() - self.shown..];
        if !segment.starts_with(shown) {
            // The decoder changed text already shown (a run of bytes that turned invalid): what
            // was shown stays, and the next token starts a new segment.
            self.close(vocab);
            return (String::new(), false);
        }
        let (end, hit_stop_string) = visible_end(&segment, self.shown, stop_strings, last);
        let new = segment[self.shown..end.max(self.shown)].to_string();
        self.text.push_str(&new);
        self.shown += new.len();
        if self.shown == segment.len() {
            self.close(vocab);
        }
        (new, hit_stop_string)
    }

    /// Everything shown: the concatenation of what [`take`](TextStream::take) returned.
    pub(crate) fn text(&self) -> &str {
        &self.text
    }

    /// Start a new segment after the open one (whose text is all shown): its anchor is the
    /// longest run of the last [`ANCHOR_TOKENS`] tokens that decodes without U+FFFD. One that
    /// began inside a character's bytes would join the next byte tokens into a run the decoder
    /// cannot read (SentencePiece's byte fallback then replaces the whole run).
    fn close(&mut self, vocab: &dyn Vocab) {
        let tail = &self.window[self.window.len().saturating_sub(ANCHOR_TOKENS)..];
        let (anchor, text) = (0..tail.len())
            .map(|skip| (&tail[skip..], vocab.decode(&tail[skip..])))
            .find(|(_, text)| !text.contains('\u{FFFD}'))
            .unwrap_or((&[], String::new()));
        self.anchor_text = text;
        self.anchor_len = anchor.len();
        self.window = anchor.to_vec();
        self.shown = 0;
    }
}

/// What a [`Generation`] borrows for `'m` and is generic over, without holding either.
type Borrows<'m, M> = PhantomData<(&'m (), fn() -> M)>;

/// A generation in progress. Each [`step`](Generation::step) yields one token.
///
/// It borrows its model and vocabulary ([`Generation::new`]) or holds them by any other handle
/// that borrows as them, e.g. `Rc<M>` and `Rc<dyn Vocab>` ([`Generation::with_handles`]), which
/// lets a wasm object own a model and a generation over it together.
pub struct Generation<'m, M: LanguageModel, R = &'m M, V = &'m dyn Vocab> {
    model: R,
    vocab: V,
    _borrows: Borrows<'m, M>,
    opts: GenerateOptions,
    sampler: Sampler,
    state: M::State,
    /// Prompt, then every sampled token: what the repetition penalty looks at.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Prompt tokens the state held when generation started: the prefill runs the rest.
    reused: usize,
    prefilled: bool,
    /// Logits for the next token (once prefilled).
    logits: Vec<f32>,
    /// The last token, sampled but not yet fed to the model. It is fed at the start of the next
    /// step, so the caller gets each token before the model works on the one after.
    pending: Option<u32>,
    /// The text streamed so far, and what the next tokens add.
    stream: TextStream,
    stop: Option<StopReason>,
    clock: Clock,
    prefill_ms: f64,
    decode_ms: f64,
    ttft_ms: Option<f64>,
    /// When the step in progress started (see [`Generation::step_input`]).
    step_start: f64,
    /// The structured-output constraint, when there is one.
    constraint: Option<Constraint>,
    /// Time spent building the constraint (compiling it, the first allowed set), then on its
    /// steps (consuming a token, the next allowed set), and the steps.
    constraint_build_ms: f64,
    constraint_ms: f64,
    constraint_steps: usize,
    /// Speculative decoding's drafter, draft length and counts, and the pass being emitted.
    speculation: Option<Speculation<M, R>>,
}

/// A generation's speculative decoding (see [`speculative`]).
struct Speculation<M: LanguageModel, R> {
    drafter: Drafter<M, R>,
    length: DraftLength,
    stats: SpeculationStats,
    /// The verification pass whose rows are being sampled, if one is.
    pass: Option<VerifiedPass>,
    /// Between passes, a free drafter's guess for the token at this position, checked when the
    /// plain step makes it (`DraftLength::shadow`).
    shadow: Option<(usize, u32)>,
}

/// A verification pass's guesses and rows of logits, and the next row to sample.
struct VerifiedPass {
    draft: Draft,
    /// `draft.ids.len() + 1` rows of the vocabulary's logits.
    rows: Vec<f32>,
    row: usize,
    number: usize,
    /// Milliseconds of guessing and of the forward pass.
    ms: f64,
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

    /// A generation that starts from `state`, which holds the keys and values of the first
    /// `model.position(&state)` ids of `prompt_ids` (the caller's promise, e.g. the prefix a
    /// conversation's previous turns share with this prompt: `chat::reuse_prefix`). The prefill
    /// runs only the rest of the prompt, which must be at least one token; everything else
    /// (sampling, the repetition penalty's view of the prompt, positions) is as if the whole
    /// prompt had been run from an empty state.
    pub fn resume(
        model: &'m M,
        vocab: &'m dyn Vocab,
        state: M::State,
        prompt_ids: &[u32],
        opts: GenerateOptions,
    ) -> Result<Self> {
        Generation::resume_with_handles(model, vocab, state, prompt_ids, opts)
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
        let state = Borrow::<M>::borrow(&model).new_state();
        Generation::resume_with_handles(model, vocab, state, prompt_ids, opts)
    }

    /// Like [`Generation::resume`], with the model and vocabulary held through `R` and `V`.
    pub fn resume_with_handles(
        model: R,
        vocab: V,
        state: M::State,
        prompt_ids: &[u32],
        opts: GenerateOptions,
    ) -> Result<Self> {
        Generation::resume_with_clock(model, vocab, state, prompt_ids, opts, default_clock)
    }

    /// [`resume_with_handles`](Generation::resume_with_handles) timed by `clock` from the start
    /// (building a constraint included), as [`with_clock`](Generation::with_clock) would after.
    pub fn resume_with_clock(
        model: R,
        vocab: V,
        state: M::State,
        prompt_ids: &[u32],
        opts: GenerateOptions,
        clock: Clock,
    ) -> Result<Self> {
        let m: &M = Borrow::<M>::borrow(&model);
        check_prompt(m, prompt_ids)?;
        let reused = m.position(&state);
        if reused >= prompt_ids.len() {
            return Err(Error::Input(format!(
                "the state already holds {reused} tokens; the prompt of {} must add at least one",
                prompt_ids.len()
            )));
        }
        if let Some(&id) = opts.forced.iter().find(|&&id| id as usize >= m.vocab_size()) {
            return Err(Error::Input(format!(
                "forced token id {id} is outside the model's vocabulary of {}",
                m.vocab_size()
            )));
        }
        opts.sampler.validate()?;
        if opts.stop_strings.iter().any(String::is_empty) {
            return Err(Error::Input("a stop string is empty (it would match at once)".into()));
        }
        let started = clock();
        let constraint =
            start_constraint(m, Borrow::<dyn Vocab + 'm>::borrow(&vocab), prompt_ids, &opts)?;
        let stream = TextStream::new(Borrow::<dyn Vocab + 'm>::borrow(&vocab), prompt_ids);
        let speculation = match &opts.speculative {
            None => None,
            Some(spec) => {
                spec.validate()?;
                let drafter = Drafter::new(&spec.source);
                let length = DraftLength::new(spec.max_draft);
                Some(Speculation {
                    length: if drafter.guesses_for_free() { length.shadowing() } else { length },
                    drafter,
                    stats: SpeculationStats { source: spec.source.name(), ..Default::default() },
                    pass: None,
                    shadow: None,
                })
            }
        };
        Ok(Generation {
            speculation,
            reused,
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
            stream,
            stop: None,
            clock,
            prefill_ms: 0.0,
            decode_ms: 0.0,
            ttft_ms: None,
            step_start: 0.0,
            constraint_build_ms: if constraint.is_some() { clock() - started } else { 0.0 },
            constraint_ms: 0.0,
            constraint_steps: 0,
            constraint,
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
    /// call feeds the previous token (one-token forward pass) and samples the next. Where the
    /// model ranks on its device (the GPU's top-k kernel) and the sampler needs only the top
    /// tokens, only those come back; under a constraint, among the tokens it allows.
    ///
    /// [`stop_reason`]: Generation::stop_reason
    pub async fn step_async(&mut self) -> Result<Option<TokenEvent>> {
        let Some(tokens) = self.step_input() else {
            return Ok(None);
        };
        if tokens.is_empty() {
            return self.step_output(Vec::new()).map(Some);
        }
        if self.prefilled {
            if let Some(draft) = self.draft_async().await? {
                let mut input = tokens;
                input.extend_from_slice(&draft.ids);
                let model = Borrow::<M>::borrow(&self.model);
                let rows = model.forward_async(&mut self.state, &input, true).await?;
                return self.step_verified(draft, rows).map(Some);
            }
            if let Some(spec) = self.speculation.as_mut() {
                spec.stats.decode_passes += 1;
            }
        }
        let model = Borrow::<M>::borrow(&self.model);
        if let Some(k) = model.top_on_device().and_then(|limit| self.top_needed(limit)) {
            if let Some(c) = self.constraint.as_mut() {
                let allowed = c.allowed()?;
                let shown = self.shown_needed();
                let top = model
                    .forward_top_allowed_async(&mut self.state, &tokens, k, shown, &allowed)
                    .await?;
                self.time_plain_step();
                return self.step_output_allowed(top).map(Some);
            }
            let top = model.forward_top_async(&mut self.state, &tokens, k).await?;
            self.time_plain_step();
            return self.step_output_top(top).map(Some);
        }
        let logits = model.forward_async(&mut self.state, &tokens, false).await?;
        self.time_plain_step();
        self.step_output(logits).map(Some)
    }

    /// A plain decode step's pass has just ended: what a verification pass is weighed against.
    fn time_plain_step(&mut self) {
        if !self.prefilled {
            return;
        }
        if let Some(spec) = self.speculation.as_mut() {
            spec.length.time_plain_step((self.clock)() - self.step_start);
        }
    }

    /// Speculative decoding's guesses for this step, when it is on and guesses (none while
    /// forced tokens remain, nor where the pass could not emit more than one token).
    async fn draft_async(&mut self) -> Result<Option<Draft>> {
        let forced = self.next_forced().is_some();
        let Some(spec) = self.speculation.as_mut() else { return Ok(None) };
        let model = Borrow::<M>::borrow(&self.model);
        let generated = self.tokens.len() - self.prompt_len;
        // A pass of k guesses emits up to k + 1 tokens and leaves the state holding
        // tokens.len() + k.
        let room = (self.opts.max_tokens.saturating_sub(generated + 1))
            .min(model.context_length().saturating_sub(self.tokens.len()));
        // A forced step counts as a plain one (its time is a step's time).
        let k = spec.length.for_this_step().min(room);
        // A plain step: a free drafter's guess for its token, to check.
        let shadow = k == 0 && spec.drafter.guesses_for_free();
        if forced || (k == 0 && !shadow) {
            return Ok(None);
        }
        let start = (self.clock)();
        let draft =
            spec.drafter.draft(&self.tokens, generated, k.max(1), model.vocab_size()).await?;
        spec.stats.draft_ms += (self.clock)() - start;
        if shadow {
            spec.shadow = draft.ids.first().map(|&id| (self.tokens.len(), id));
            return Ok(None);
        }
        Ok((!draft.ids.is_empty()).then_some(draft))
    }

    /// Begin emitting a verification pass: `rows` holds a row of logits for the last token and
    /// one for each guess of `draft`. Samples the first row.
    fn step_verified(&mut self, draft: Draft, rows: Vec<f32>) -> Result<TokenEvent> {
        let n = self.model().vocab_size();
        let spec = self.speculation.as_mut().expect("only a speculation drafts");
        spec.stats.passes += 1;
        spec.stats.decode_passes += 1;
        spec.stats.drafted += draft.ids.len();
        self.logits.clear();
        self.logits.extend_from_slice(&rows[..n]);
        // What guessing and the pass cost, against plain steps.
        let ms = (self.clock)() - self.step_start;
        spec.pass = Some(VerifiedPass { draft, rows, row: 0, number: spec.stats.passes - 1, ms });
        self.step_output(Vec::new())
    }

    /// The guess at the current row of a verification pass and the distribution it was drawn
    /// from, when it was drawn from one (a draft model sampling): judged by the rejection rule.
    fn drawn_guess(&self) -> Option<(u32, Vec<(u32, f32)>)> {
        let pass = self.speculation.as_ref()?.pass.as_ref()?;
        let q = pass.draft.q.get(pass.row)?;
        Some((pass.draft.ids[pass.row], q.clone()))
    }

    /// After a row of a verification pass gave `event`'s token: mark the event, and either go
    /// on to the next row (the guess was kept: the state holds it already) or end the pass.
    fn after_row(&mut self, event: &mut TokenEvent) -> Result<()> {
        let n = self.model().vocab_size();
        let Some(spec) = self.speculation.as_mut() else { return Ok(()) };
        let Some(pass) = spec.pass.as_mut() else { return Ok(()) };
        let row = pass.row;
        pass.row += 1;
        let outcome = match pass.draft.ids.get(row) {
            None => Outcome::Bonus,
            Some(&guess) if guess == event.id => Outcome::Accepted,
            Some(_) => Outcome::Rejected,
        };
        event.speculated =
            Some(Speculated { pass: pass.number, row, drafted: pass.draft.ids.clone(), outcome });
        if outcome == Outcome::Accepted {
            spec.stats.accepted += 1;
            if self.stop.is_none() {
                self.pending = None;
                self.logits.clear();
                self.logits.extend_from_slice(&pass.rows[(row + 1) * n..(row + 2) * n]);
                return Ok(());
            }
        }
        let kept = row + (outcome == Outcome::Accepted) as usize;
        spec.length.record(pass.draft.ids.len(), kept, pass.ms);
        self.close_pass()
    }

    /// End the verification pass in progress, if any: the state is cut back to what plain
    /// decoding holds here (every token but the last, which is fed at the next step).
    fn close_pass(&mut self) -> Result<()> {
        let Some(spec) = self.speculation.as_mut() else { return Ok(()) };
        if spec.pass.take().is_none() {
            return Ok(());
        }
        let keep = self.tokens.len() - 1;
        let model = Borrow::<M>::borrow(&self.model);
        if model.position(&self.state) > keep {
            model.truncate(&mut self.state, keep)?;
        }
        Ok(())
    }

    /// Draft with `draft`, a second model with this one's vocabulary, when
    /// [`GenerateOptions::speculative`] asks for [`DraftSource::DraftModel`].
    pub fn with_draft_model(mut self, draft: R) -> Result<Self> {
        let model = Borrow::<M>::borrow(&self.model);
        let Some(spec) = self.speculation.as_mut() else {
            return Err(Error::Input(
                "a draft model was given but speculative decoding is off".into(),
            ));
        };
        spec.drafter.set_model(model, draft, self.sampler.config())?;
        Ok(self)
    }

    /// What speculative decoding has done so far, when it is on.
    pub fn speculation_stats(&self) -> Option<&SpeculationStats> {
        self.speculation.as_ref().map(|s| &s.stats)
    }

    /// [`step_async`](Generation::step_async), run to its end on this thread.
    pub fn step(&mut self) -> Result<Option<TokenEvent>> {
        crate::lm::block_on(self.step_async())
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
            self.stop = Some(self.out_of_room(StopReason::MaxTokens));
            return None;
        }
        if self.prompt_len >= Borrow::<M>::borrow(&self.model).context_length() {
            self.stop = Some(self.out_of_room(StopReason::ContextFull));
            return None;
        }
        self.step_start = (self.clock)();
        if !self.prefilled {
            Some(self.tokens[self.reused..].to_vec())
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
    /// Logits holding NaN or +inf are an error ([`bad_logits`]), which ends the generation.
    pub fn step_output(&mut self, logits: Vec<f32>) -> Result<TokenEvent> {
        if !logits.is_empty() {
            self.logits = logits;
        }
        let allowed = self.allowed()?;
        let guess = self.drawn_guess();
        let event = self.finish_step(|g| match (g.next_forced(), &allowed, guess) {
            (Some(id), _, _) => Ok(g.sampler.describe(&g.logits, id)),
            (None, allowed, Some((guess, q))) => {
                let (logits, history) = (&g.logits, &g.tokens);
                let id = g.sampler.judge_draft(logits, allowed.as_deref(), history, guess, &q);
                let pick = g.sampler.describe(&g.logits, id);
                match allowed {
                    Some(allowed) => g.check_possible(pick, allowed),
                    None => Ok(pick),
                }
            }
            (None, None, None) => Ok(g.sampler.sample(&g.logits, &g.tokens)),
            (None, Some(allowed), None) => {
                let pick = g.sampler.sample_allowed(&g.logits, allowed, &g.tokens);
                g.check_possible(pick, allowed)
            }
        });
        let mut event = match event {
            Ok(event) => event,
            Err(e) => {
                let _ = self.close_pass();
                return Err(e);
            }
        };
        // The log-sum-exp the pick's plain probability came from (no second pass over the row),
        // for what the constraint removed and the candidates' probabilities.
        let lse = || match self.logits.get(event.id as usize) {
            Some(&logit) if event.logprob.is_finite() => logit as f64 - event.logprob as f64,
            _ => logsumexp(&self.logits),
        };
        let lse =
            (allowed.is_some() || self.opts.keep_candidates > 0).then(lse).unwrap_or(f64::NAN);
        if let Some(allowed) = &allowed {
            let shown = top_n(&self.logits, self.shown_needed());
            event.removed = removed(&shown, allowed, |logit| (logit as f64 - lse).exp() as f32);
        }
        if self.opts.keep_candidates > 0 {
            // Impossible tokens (-inf) are no candidates (and JSON has no infinity).
            event.candidates = match &allowed {
                Some(allowed) => top_n(&allowed.mask(&self.logits), self.opts.keep_candidates),
                None => top_n(&self.logits, self.opts.keep_candidates),
            };
            event.candidates.retain(|&(_, logit)| logit.is_finite());
            event.candidates_logsumexp = lse;
        }
        // Last: on a kept guess this moves the next row of the pass into `self.logits`.
        self.after_row(&mut event)?;
        Ok(event)
    }

    /// Under a constraint, the tokens it allows at this step (computed once per step: the
    /// constraint's cost); `None` without one. A step that ranks on the model's device passes
    /// this to [`LanguageModel::forward_top_allowed`] and ends with
    /// [`step_output_allowed`](Generation::step_output_allowed).
    pub fn allowed(&mut self) -> Result<Option<Arc<AllowedSet>>> {
        let Some(c) = self.constraint.as_mut() else { return Ok(None) };
        let start = (self.clock)();
        let allowed = c.allowed();
        self.constraint_ms += (self.clock)() - start;
        allowed.map(Some)
    }

    /// Whether a constraint shapes this generation.
    pub fn is_constrained(&self) -> bool {
        self.constraint.is_some()
    }

    /// Milliseconds spent on the constraint's steps so far (consuming each token, computing the
    /// next allowed set) and how many tokens it consumed: the per-step cost of structured
    /// output, which `nexttoken bench` reports as a share of the step time.
    pub fn constraint_time(&self) -> (f64, usize) {
        (self.constraint_ms, self.constraint_steps)
    }

    /// Milliseconds spent building the constraint: compiling the schema, regex or grammar, and
    /// the first token's allowed set (0 without a constraint).
    pub fn constraint_build_ms(&self) -> f64 {
        self.constraint_build_ms
    }

    /// How many of the model's most likely tokens a constrained step ranks besides the allowed
    /// ones (`shown` of [`LanguageModel::forward_top_allowed`]): what a token event shows of the
    /// model's own view and of what the constraint removed.
    pub fn shown_needed(&self) -> usize {
        self.sampler.config().alternatives.min(MAX_SHOWN).max(self.opts.keep_candidates).max(1)
    }

    /// The forced token this step emits, if any is left (`GenerateOptions::forced`).
    fn next_forced(&self) -> Option<u32> {
        self.opts.forced.get(self.tokens.len() - self.prompt_len).copied()
    }

    /// When the sampler can pick from the `k` most likely tokens alone (greedy, or top-k
    /// sampling with k <= `limit`, no repetition penalty), that k: a model that ranks on its
    /// device ([`LanguageModel::forward_top`]) then sends back only those, and the step ends
    /// with [`step_output_top`](Generation::step_output_top).
    pub fn top_needed(&self, limit: usize) -> Option<usize> {
        // A forced token may be anywhere in the distribution: its step needs the whole row.
        if self.next_forced().is_some() || self.opts.keep_candidates > limit {
            return None;
        }
        let k = self.sampler.top_needed(limit)?;
        Some(k.max(self.opts.keep_candidates))
    }

    /// [`step_output`](Generation::step_output) from the forward pass's `k` most likely tokens
    /// and log-sum-exp (`k` from [`top_needed`](Generation::top_needed)). Under a constraint
    /// use [`step_output_allowed`](Generation::step_output_allowed).
    pub fn step_output_top(&mut self, top: TopK) -> Result<TokenEvent> {
        if self.constraint.is_some() {
            return Err(Error::Input(
                "a constrained step needs the allowed tokens' ranking (step_output_allowed)".into(),
            ));
        }
        let mut event = self.finish_step(|g| Ok(g.sampler.sample_top(&top)))?;
        let keep = self.opts.keep_candidates.min(top.ids.len());
        let ranked = top.ids[..keep].iter().copied().zip(top.logits[..keep].iter().copied());
        event.candidates = ranked.filter(|&(_, logit)| logit.is_finite()).collect();
        event.candidates_logsumexp = top.logsumexp;
        Ok(event)
    }

    /// [`step_output`](Generation::step_output) for a constrained step from
    /// [`LanguageModel::forward_top_allowed`] with this step's [`allowed`](Generation::allowed)
    /// set, `k` from [`top_needed`](Generation::top_needed) and `shown` from
    /// [`shown_needed`](Generation::shown_needed).
    pub fn step_output_allowed(&mut self, top: AllowedTop) -> Result<TokenEvent> {
        let Some(allowed) = self.allowed()? else {
            return self.step_output_top(top.all);
        };
        let shown = self.sampler.config().alternatives.min(MAX_SHOWN);
        let mut event = self.finish_step(|g| {
            if top.allowed.ids.is_empty() && !top.all.logsumexp.is_nan() {
                // Every allowed token has a -inf logit (NaN logits are reported as such below).
                let none = Pick { id: 0, prob: 0.0, logprob: f32::NEG_INFINITY, top: Vec::new() };
                return g.check_possible(none, &allowed);
            }
            let mut pick = g.sampler.sample_top(&top.allowed);
            // The model's own alternatives, not only the allowed ones.
            let lse = top.all.logsumexp;
            let all = top.all.ids.iter().zip(&top.all.logits).take(shown);
            pick.top = all.map(|(&id, &logit)| (id, (logit as f64 - lse).exp() as f32)).collect();
            g.check_possible(pick, &allowed)
        })?;
        let all: Vec<(u32, f32)> =
            top.all.ids.iter().copied().zip(top.all.logits.iter().copied()).collect();
        let lse = top.all.logsumexp;
        event.removed = removed(&all, &allowed, |logit| (logit as f64 - lse).exp() as f32);
        let keep = self.opts.keep_candidates.min(top.allowed.ids.len());
        let ranked =
            top.allowed.ids[..keep].iter().copied().zip(top.allowed.logits[..keep].iter().copied());
        event.candidates = ranked.filter(|&(_, logit)| logit.is_finite()).collect();
        event.candidates_logsumexp = lse;
        Ok(event)
    }

    fn finish_step(&mut self, pick: impl FnOnce(&mut Self) -> Result<Pick>) -> Result<TokenEvent> {
        let start = self.step_start;
        if !self.prefilled {
            self.prefilled = true;
            self.prefill_ms = (self.clock)() - start;
        } else {
            self.pending = None;
        }

        let pick = pick(self);
        let pick = match pick {
            // The one check for broken logits: they make the pick's log-probability NaN.
            Ok(pick) if pick.logprob.is_nan() => Err(bad_logits(self.tokens.len())),
            other => other,
        };
        let event = match pick.and_then(|pick| self.accept(pick)) {
            Ok(event) => event,
            Err(e) => {
                self.stop = Some(StopReason::Aborted);
                self.pending = None;
                return Err(e);
            }
        };

        let elapsed = (self.clock)() - start;
        match self.ttft_ms {
            None => self.ttft_ms = Some(elapsed),
            Some(_) => self.decode_ms += elapsed,
        }
        Ok(event)
    }

    /// Record the sampled token, decide whether it is the last, and work out its text. Under a
    /// constraint, the token must be one it allows; it is consumed, and the next step's allowed
    /// set computed (which tells whether anything can follow).
    fn accept(&mut self, pick: Pick) -> Result<TokenEvent> {
        let position = self.tokens.len();
        if let Some(spec) = self.speculation.as_mut() {
            if let Some((at, guess)) = spec.shadow.take() {
                if at == position {
                    spec.length.shadow(guess == pick.id);
                }
            }
        }
        let model = Borrow::<M>::borrow(&self.model);
        let is_end = self.opts.stop_at_eos
            && (model.eos_tokens().contains(&pick.id) || self.opts.stop_tokens.contains(&pick.id));
        if let Some(allowed) = self.allowed()? {
            if !allowed.contains(pick.id) {
                return Err(self.refused(pick.id, position, &allowed));
            }
        }
        self.tokens.push(pick.id);
        if is_end {
            self.stop = Some(StopReason::Eos);
        } else {
            self.stream.push(pick.id);
            let start = (self.clock)();
            if let Some(c) = self.constraint.as_mut() {
                c.consume(pick.id)?;
                self.constraint_steps += 1;
            }
            self.constraint_ms += (self.clock)() - start;
            // A complete output that nothing can follow ends here, even on the last token allowed.
            if self.constraint_finished()? {
                self.stop = Some(StopReason::ConstraintComplete);
            } else if self.tokens.len() - self.prompt_len >= self.opts.max_tokens {
                self.stop = Some(self.out_of_room(StopReason::MaxTokens));
            } else if self.tokens.len() >= Borrow::<M>::borrow(&self.model).context_length() {
                self.stop = Some(self.out_of_room(StopReason::ContextFull));
            } else {
                self.pending = Some(pick.id);
            }
        }

        let vocab = Borrow::<dyn Vocab + 'm>::borrow(&self.vocab);
        let (text, hit_stop_string) =
            self.stream.take(vocab, &self.opts.stop_strings, self.stop.is_some());
        if hit_stop_string {
            self.stop = Some(StopReason::StopString);
            self.pending = None;
        }

        Ok(TokenEvent {
            candidates: Vec::new(),
            candidates_logsumexp: f64::NAN,
            removed: Vec::new(),
            speculated: None,
            id: pick.id,
            text,
            prob: pick.prob,
            logprob: pick.logprob,
            top: pick.top,
            position,
        })
    }

    /// `pick`, unless it is a constrained pick of probability 0 or outside `allowed`: every
    /// token the constraint allows has a `-inf` logit, so there is nothing to choose. (A NaN
    /// pick goes on, to be reported as broken logits.)
    fn check_possible(&self, pick: Pick, allowed: &AllowedSet) -> Result<Pick> {
        if pick.logprob.is_nan() {
            return Ok(pick);
        }
        if pick.logprob == f32::NEG_INFINITY || !allowed.contains(pick.id) {
            return Err(Error::Constraint(format!(
                "every token the constraint allows at position {} has probability 0 (-inf \
                 logits): nothing can be chosen",
                self.tokens.len()
            )));
        }
        Ok(pick)
    }

    /// `reason` (out of tokens or context), or [`StopReason::Incomplete`] when the output does
    /// not match the constraint yet.
    fn out_of_room(&mut self, reason: StopReason) -> StopReason {
        match self.constraint.as_mut().map(|c| c.is_complete()) {
            Some(false) => StopReason::Incomplete,
            _ => reason,
        }
    }

    /// Whether nothing can follow the output under the constraint (computing the next step's
    /// allowed set). A dead end, where nothing can follow an output that is not complete, is an
    /// error.
    fn constraint_finished(&mut self) -> Result<bool> {
        let start = (self.clock)();
        let finished = match self.constraint.as_mut() {
            None => Ok(false),
            Some(c) => c.is_finished().and_then(|finished| {
                if finished && !c.is_complete() {
                    Err(Error::Constraint(format!(
                        "no token of this vocabulary can continue the output under the {} \
                         (after {} tokens), and it is not complete",
                        c.kind(),
                        c.consumed()
                    )))
                } else {
                    Ok(finished)
                }
            }),
        };
        self.constraint_ms += (self.clock)() - start;
        finished
    }

    /// The error for a token the constraint does not allow at `position`.
    fn refused(&self, id: u32, position: usize, allowed: &AllowedSet) -> Error {
        let text = self.vocab().token_text(id);
        if self.next_forced().is_some() {
            return Error::Constraint(format!(
                "forced token {id} ({text:?}) at position {position} is not allowed by the constraint"
            ));
        }
        if allowed.count() == 0 {
            return Error::Constraint(format!(
                "the constraint allows no token at position {position}"
            ));
        }
        Error::Constraint(format!(
            "token {id} ({text:?}) at position {position} is not allowed by the constraint"
        ))
    }

    /// Stop now; later steps return `None`. (No-op if already stopped.)
    pub fn abort(&mut self) {
        self.stop.get_or_insert(StopReason::Aborted);
        self.pending = None;
        // Cutting a state back to fewer tokens than it holds cannot fail.
        let _ = self.close_pass();
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

    /// Prompt tokens that were already in the state it started from (0 unless
    /// [`resume`](Generation::resume)d).
    pub fn reused_tokens(&self) -> usize {
        self.reused
    }

    /// The ids whose keys and values the state holds: the prompt and every sampled token that
    /// was fed back (the last sampled token never is). A conversation keeps them with the state
    /// ([`into_state`](Generation::into_state)) to reuse the prefix its next prompt shares.
    pub fn held_ids(&self) -> &[u32] {
        let held = self.model().position(&self.state).min(self.tokens.len());
        &self.tokens[..held]
    }

    /// The model state (KV cache), e.g. to continue a conversation after this reply.
    pub fn into_state(mut self) -> M::State {
        // Cutting a state back to fewer tokens than it holds cannot fail.
        let _ = self.close_pass();
        self.state
    }

    /// The text streamed so far (the concatenation of the events' `text`).
    pub fn text(&self) -> &str {
        self.stream.text()
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

    /// The sampler's settings (the seed a run drew, for one).
    pub fn sampler_config(&self) -> &SamplerConfig {
        self.sampler.config()
    }

    /// The totals, once generation has stopped.
    pub fn summary(&self) -> Option<GenerationSummary> {
        Some(GenerationSummary {
            prompt_tokens: self.prompt_len,
            reused_tokens: self.reused,
            generated_tokens: self.generated_ids().len(),
            text: self.stream.text().to_string(),
            stop_reason: self.stop?,
            prefill_ms: self.prefill_ms,
            decode_ms: self.decode_ms,
            ttft_ms: self.ttft_ms.unwrap_or(0.0),
            speculation: self.speculation_stats().cloned(),
        })
    }
}

/// The text of `anchored` (an anchor of `anchor_len` prompt tokens, whose text is `anchor_text`,
/// then generated tokens) after the anchor.
fn text_after_anchor(
    vocab: &dyn Vocab,
    anchored: &[u32],
    anchor_len: usize,
    anchor_text: &str,
) -> String {
    let full = vocab.decode(anchored);
    match full.strip_prefix(anchor_text) {
        Some(generated) => generated.to_string(),
        // The prompt's last tokens merged with the first generated ones: decode them alone.
        None => vocab.decode(&anchored[anchor_len..]),
    }
}

/// The constraint `opts` asks for, over `vocab`, with the end tokens allowed when complete and
/// the last `opts.constraint_prefix` prompt ids consumed; `None` without one.
fn start_constraint<M: LanguageModel>(
    model: &M,
    vocab: &dyn Vocab,
    prompt_ids: &[u32],
    opts: &GenerateOptions,
) -> Result<Option<Constraint>> {
    let Some(spec) = &opts.constraint else {
        if opts.constraint_prefix > 0 {
            return Err(Error::Input("constraint_prefix is set but there is no constraint".into()));
        }
        return Ok(None);
    };
    if !opts.stop_strings.is_empty() {
        return Err(Error::Input(
            "stop strings cannot be combined with a constraint: the constraint decides where the \
             output ends (a stop string could cut it into invalid output)"
                .into(),
        ));
    }
    let mut ends: Vec<u32> = Vec::new();
    if opts.stop_at_eos {
        ends.extend(model.eos_tokens());
        ends.extend(&opts.stop_tokens);
    }
    let vocab = vocab.constraint_vocab(model.vocab_size())?;
    let mut constraint = Constraint::new(spec, vocab)?.with_end_tokens(&ends);
    let prefix = opts.constraint_prefix;
    if prefix >= prompt_ids.len() {
        return Err(Error::Input(format!(
            "constraint_prefix = {prefix}: the prompt has only {} tokens (the prefix is output \
             after at least one prompt token)",
            prompt_ids.len()
        )));
    }
    let from = prompt_ids.len() - prefix;
    for (i, &id) in prompt_ids[from..].iter().enumerate() {
        constraint.consume(id).map_err(|e| {
            Error::Constraint(format!(
                "the constraint refuses prompt token {id} at position {} (constraint_prefix): {e}",
                from + i
            ))
        })?;
    }
    // The first step's allowed set: an output that cannot even start is an error now.
    let allowed = constraint.allowed()?;
    if allowed.count() == 0 {
        return Err(Error::Constraint(format!(
            "the {} allows no token of this vocabulary to start the output",
            constraint.kind()
        )));
    }
    Ok(Some(constraint))
}

/// The tokens of `ranked` (id, logit; most likely first) outside `allowed`, with their
/// probabilities by `prob`.
fn removed(
    ranked: &[(u32, f32)],
    allowed: &AllowedSet,
    prob: impl Fn(f32) -> f32,
) -> Vec<(u32, f32)> {
    ranked.iter().filter(|&&(id, _)| !allowed.contains(id)).map(|&(id, l)| (id, prob(l))).collect()
}

fn check_prompt<M: LanguageModel>(model: &M, prompt_ids: &[u32]) -> Result<()> {
    if prompt_ids.is_empty() {
        return Err(Error::Input(
            "the prompt is empty: it needs at least one token (usually BOS)".into(),
        ));
    }
    let n_vocab = model.vocab_size();
    if let Some(&id) = prompt_ids.iter().find(|&&id| id as usize >= n_vocab) {
        return Err(Error::Input(format!(
            "token id {id} is outside the model's vocabulary of {n_vocab}"
        )));
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
