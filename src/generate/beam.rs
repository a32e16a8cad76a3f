//! Beam search: look for the most probable continuation rather than sample one.
//!
//! [`BeamSearch`] is the search unrolled into forward passes, like [`Generation`](super::Generation),
//! so a model whose forward pass must be awaited (WebGPU in the browser) can run it; [`beam_search`]
//! drives it with [`LanguageModel::forward_top`]. Each pass needs only the hypothesis's best tokens
//! and the log-sum-exp of its logits ([`TopK`]), not the whole row.

use std::sync::Arc;

use super::{check_prompt, TextStream};
use super::{GenerationSummary, StopReason, TokenEvent};
use crate::constraint::{AllowedSet, Constraint, ConstraintSpec};
use crate::error::{Error, Result};
use crate::lm::{AllowedTop, LanguageModel, TopK, Vocab};
use crate::sampling::{bad_logits, TOP_SHOWN};

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

/// The most beams a search may keep. Every beam holds a copy of the model state (a KV cache), and
/// a device ranks at most 64 tokens per pass ([`BeamSearch::top_k`] asks for `beams` of them).
pub const MAX_BEAMS: usize = 64;

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
    /// Ended by itself: an end token, or (under a constraint) output that nothing can follow;
    /// rather than at `max_tokens` or the context's end.
    pub finished: bool,
    /// Why it ended: [`StopReason::Eos`], [`StopReason::ConstraintComplete`],
    /// [`StopReason::MaxTokens`] (also at the context's end), or under a constraint
    /// [`StopReason::Incomplete`] when its output does not match yet (such beams rank after
    /// every beam whose output does).
    pub stop_reason: StopReason,
    /// Each token as it was chosen, the end token included when finished: what the model
    /// thought at that step (for showing the beam token by token, see [`replay`]).
    pub tokens: Vec<BeamToken>,
    /// Its last token's node in [`BeamSearch::tree`] (`None` for a beam with no token).
    pub node: Option<usize>,
}

impl Beam {
    pub fn probability(&self) -> f64 {
        self.logprob.exp()
    }
}

/// One token of a beam and the distribution it was chosen from.
#[derive(Clone, Debug, PartialEq)]
pub struct BeamToken {
    pub id: u32,
    /// ln P(id | prompt and the beam's earlier tokens).
    pub logprob: f64,
    /// The most probable ids at this step (up to five) with their probabilities, best first.
    pub top: Vec<(u32, f32)>,
}

/// One extension the search considered, for drawing its tree: a hypothesis's token with the
/// total log P of the hypothesis it makes. `parent` indexes the search's nodes (`None` for the
/// first step's); `kept` when it survived its step's pruning, `finished` when it ended there
/// (an end token, max_tokens or the context).
#[derive(Clone, Debug, PartialEq)]
pub struct BeamNode {
    pub parent: Option<usize>,
    pub step: usize,
    pub id: u32,
    pub logprob: f64,
    pub kept: bool,
    pub finished: bool,
}

/// A live hypothesis: a beam, the model state that has seen it, and its next-token ranking once
/// the forward pass that computes it has run.
struct Hypothesis<S> {
    /// Its last token's node in the search's tree (`None` for the prompt).
    node: Option<usize>,
    ids: Vec<u32>,
    tokens: Vec<BeamToken>,
    logprob: f64,
    state: S,
    /// What the state still has to be fed: the prompt for the first hypothesis, afterwards the
    /// hypothesis's last token.
    input: Vec<u32>,
    top: Option<TopK>,
    /// Under a constraint: its state after this hypothesis's tokens, and the model's own
    /// ranking (allowed or not) for the alternatives a token shows.
    constraint: Option<Constraint>,
    alts: Option<TopK>,
    /// Set when the hypothesis cannot grow: why it ended.
    ended: Option<StopReason>,
}

/// A beam search in progress. At each step every live hypothesis is extended by its `beams` most
/// probable next tokens, and the best `beams` of all those candidates survive; those ending in an
/// end token are set aside as finished.
///
/// Drive it like [`Generation`](super::Generation): [`step_input`](BeamSearch::step_input) gives
/// the tokens of the next forward pass (`None` once the search is over); run them on
/// [`state_mut`](BeamSearch::state_mut) and hand the [`top_k`](BeamSearch::top_k) best tokens
/// to [`step_output`](BeamSearch::step_output); then [`finish`](BeamSearch::finish).
pub struct BeamSearch<S> {
    opts: BeamOptions,
    eos: Vec<u32>,
    context: usize,
    prompt_len: usize,
    live: Vec<Hypothesis<S>>,
    done: Vec<Beam>,
    /// Extensions made so far (the length of every live hypothesis).
    extensions: usize,
    over: bool,
    /// Every extension considered, kept or pruned: the search as a tree.
    nodes: Vec<BeamNode>,
    n_vocab: usize,
}

impl<S: Clone> BeamSearch<S> {
    pub fn new<M: LanguageModel<State = S>>(
        model: &M,
        prompt_ids: &[u32],
        opts: BeamOptions,
    ) -> Result<Self> {
        check_prompt(model, prompt_ids)?;
        if !(1..=MAX_BEAMS).contains(&opts.beams) {
            return Err(Error::Input(format!(
                "beams = {} is out of range: beam search needs 1 to {MAX_BEAMS} beams",
                opts.beams
            )));
        }
        let root = Hypothesis {
            node: None,
            ids: Vec::new(),
            tokens: Vec::new(),
            logprob: 0.0,
            state: model.new_state(),
            input: prompt_ids.to_vec(),
            top: None,
            constraint: None,
            alts: None,
            ended: None,
        };
        Ok(BeamSearch {
            opts,
            eos: model.eos_tokens().to_vec(),
            context: model.context_length(),
            prompt_len: prompt_ids.len(),
            live: vec![root],
            done: Vec::new(),
            extensions: 0,
            over: false,
            nodes: Vec::new(),
            n_vocab: model.vocab_size(),
        })
    }

    /// Search only among outputs valid under `spec` (structured output, see
    /// [`constraint`](crate::constraint)): each hypothesis extends by the best tokens the
    /// constraint allows it, the end tokens only once its output is complete, and a hypothesis
    /// whose output nothing can follow is finished. Drive the forward passes with
    /// [`allowed`](BeamSearch::allowed), [`LanguageModel::forward_top_allowed`] and
    /// [`step_output_allowed`](BeamSearch::step_output_allowed).
    pub fn with_constraint(mut self, vocab: &dyn Vocab, spec: &ConstraintSpec) -> Result<Self> {
        let constraint = Constraint::new(spec, vocab.constraint_vocab(self.n_vocab)?)?
            .with_end_tokens(&self.eos);
        if constraint.clone().allowed()?.count() == 0 {
            return Err(Error::Constraint(format!(
                "the {} allows no token of this vocabulary to start the output",
                constraint.kind()
            )));
        }
        for hyp in &mut self.live {
            hyp.constraint = Some(constraint.clone());
        }
        Ok(self)
    }

    /// Whether a constraint shapes this search.
    pub fn is_constrained(&self) -> bool {
        self.live.first().is_some_and(|h| h.constraint.is_some())
    }

    /// Under a constraint, the tokens it allows after the pending forward pass's hypothesis
    /// (pass them to [`LanguageModel::forward_top_allowed`]); `None` without one.
    ///
    /// # Panics
    /// When no forward pass is pending (`step_input` gave `None`).
    pub fn allowed(&mut self) -> Result<Option<Arc<AllowedSet>>> {
        match self.pending().constraint.as_mut() {
            None => Ok(None),
            Some(c) => c.allowed().map(Some),
        }
    }

    /// The search so far as a tree: every extension considered, in the order they were made
    /// (a node's parent comes before it), pruned ones with `kept` false.
    pub fn tree(&self) -> &[BeamNode] {
        &self.nodes
    }

    /// How many of the best next tokens each forward pass must return: the beam width, and at
    /// least the five alternatives [`BeamToken::top`] shows.
    pub fn top_k(&self) -> usize {
        self.opts.beams.max(TOP_SHOWN)
    }

    /// The tokens of the next forward pass, or `None` once the search is over. If a forward pass
    /// fails, nothing has changed and it can be tried again.
    pub fn step_input(&mut self) -> Option<Vec<u32>> {
        if self.over {
            return None;
        }
        self.live.iter().find(|h| h.top.is_none()).map(|hyp| hyp.input.clone())
    }

    /// The model state the tokens of [`step_input`](BeamSearch::step_input) go into.
    ///
    /// # Panics
    /// When no forward pass is pending (`step_input` gave `None`).
    pub fn state_mut(&mut self) -> &mut S {
        &mut self.pending().state
    }

    /// The next-token ranking from the forward pass of [`step_input`](BeamSearch::step_input).
    /// A ranking from NaN or infinite logits is an error ([`bad_logits`]); the search is over.
    ///
    /// # Panics
    /// When no forward pass is pending (`step_input` gave `None`).
    pub fn step_output(&mut self, top: TopK) -> Result<()> {
        if self.pending().constraint.is_some() {
            self.over = true;
            return Err(Error::Input(
                "a constrained search needs the allowed tokens' ranking (step_output_allowed)"
                    .into(),
            ));
        }
        self.rank(top, None)
    }

    /// [`step_output`](BeamSearch::step_output) under a constraint: the ranking of
    /// [`LanguageModel::forward_top_allowed`] with [`top_k`](BeamSearch::top_k) allowed tokens,
    /// [`TOP_SHOWN`] of all, and the set from [`allowed`](BeamSearch::allowed).
    ///
    /// # Panics
    /// When no forward pass is pending (`step_input` gave `None`).
    pub fn step_output_allowed(&mut self, top: AllowedTop) -> Result<()> {
        if self.pending().constraint.is_none() {
            return self.rank(top.all, None);
        }
        self.rank(top.allowed, Some(top.all))
    }

    fn rank(&mut self, top: TopK, alts: Option<TopK>) -> Result<()> {
        // NaN or +inf logits make the log-sum-exp NaN, or (on a GPU) leave nothing ranked.
        let all = alts.as_ref().unwrap_or(&top);
        if all.ids.is_empty() || all.logsumexp.is_nan() || all.logsumexp == f64::INFINITY {
            let hyp = self.pending();
            let position = hyp.tokens.len();
            self.over = true;
            return Err(bad_logits(self.prompt_len + position));
        }
        let hyp = self.pending();
        hyp.top = Some(top);
        hyp.alts = alts;
        if self.live.iter().all(|h| h.top.is_some()) {
            if let Err(e) = self.extend() {
                self.over = true;
                return Err(e);
            }
        }
        Ok(())
    }

    fn pending(&mut self) -> &mut Hypothesis<S> {
        self.live
            .iter_mut()
            .find(|h| h.top.is_none())
            .expect("a forward pass is pending: step_input gave tokens")
    }

    pub fn is_done(&self) -> bool {
        self.over
    }

    /// Run every step of the search on `model` (the one driver of both the blocking
    /// [`beam_search`] and the browser's awaited one); then [`tree`](BeamSearch::tree) and
    /// [`finish`](BeamSearch::finish). Under a constraint each pass ranks among the tokens it
    /// allows (on the GPU, in its top-k kernel).
    pub async fn run_async<M: LanguageModel<State = S>>(&mut self, model: &M) -> Result<()> {
        while let Some(tokens) = self.step_input() {
            let k = self.top_k();
            match self.allowed()? {
                Some(allowed) => {
                    let state = self.state_mut();
                    let top = model
                        .forward_top_allowed_async(state, &tokens, k, TOP_SHOWN, &allowed)
                        .await?;
                    self.step_output_allowed(top)?;
                }
                None => {
                    let top = model.forward_top_async(self.state_mut(), &tokens, k).await?;
                    self.step_output(top)?;
                }
            }
        }
        Ok(())
    }

    /// Up to `beams` hypotheses, finished or not, best score first. Called before the search is
    /// over (an aborted search), it ranks what it has, live hypotheses as unfinished.
    pub fn finish(self) -> Vec<Beam> {
        let opts = self.opts;
        let mut done = self.done;
        // Hypotheses still alive when max_tokens or the context ran out.
        for mut hyp in self.live {
            let stop_reason = match hyp.constraint.as_mut().map(|c| c.is_complete()) {
                Some(false) => StopReason::Incomplete,
                _ => StopReason::MaxTokens,
            };
            done.push(Beam {
                node: hyp.node,
                score: rank_score(opts, hyp.logprob, hyp.tokens.len()),
                ids: hyp.ids,
                logprob: hyp.logprob,
                finished: false,
                stop_reason,
                tokens: hyp.tokens,
            });
        }
        sort_beams(&mut done);
        done.truncate(opts.beams);
        done
    }

    /// One step of the search, once every live hypothesis has its ranking.
    fn extend(&mut self) -> Result<()> {
        if self.extensions == self.opts.max_tokens {
            self.over = true;
            return Ok(());
        }
        self.extensions += 1;
        let last_step = self.extensions == self.opts.max_tokens;
        let beams = self.opts.beams;

        // Every live hypothesis's best extensions: (which hypothesis, rank, total log P).
        let mut candidates: Vec<(usize, usize, f64)> = Vec::new();
        for (h, hyp) in self.live.iter().enumerate() {
            let top = hyp.top.as_ref().expect("extend runs once every ranking is known");
            for rank in 0..top.ids.len().min(beams) {
                if top.logits[rank] > f32::NEG_INFINITY {
                    candidates.push((h, rank, hyp.logprob + top.logprob(rank)));
                }
            }
        }
        candidates.sort_by(|a, b| b.2.total_cmp(&a.2));
        // Into the tree, all of them: the first `beams` survive this step.
        let first_node = self.nodes.len();
        for (i, &(h, rank, logprob)) in candidates.iter().enumerate() {
            let parent = &self.live[h];
            let id = parent.top.as_ref().expect("ranked above").ids[rank];
            self.nodes.push(BeamNode {
                parent: parent.node,
                step: self.extensions - 1,
                id,
                logprob,
                kept: i < beams,
                finished: false,
            });
        }
        candidates.truncate(beams);

        // The children, before any parent state is moved into one of them.
        let mut children: Vec<(usize, Hypothesis<()>)> = Vec::with_capacity(candidates.len());
        for (i, &(h, rank, logprob)) in candidates.iter().enumerate() {
            let parent = &self.live[h];
            let top = parent.top.as_ref().expect("ranked above");
            let id = top.ids[rank];
            let mut tokens = parent.tokens.clone();
            let shown = alternatives(parent.alts.as_ref().unwrap_or(top));
            tokens.push(BeamToken { id, logprob: top.logprob(rank), top: shown });
            let mut ids = parent.ids.clone();
            let mut ended = None;
            let mut constraint = parent.constraint.clone();
            if self.eos.contains(&id) {
                ended = Some(StopReason::Eos);
            } else {
                ids.push(id);
                if let Some(c) = constraint.as_mut() {
                    c.consume(id)?;
                    if c.is_finished()? {
                        ended = Some(match c.is_complete() {
                            true => StopReason::ConstraintComplete,
                            // A dead end: nothing can follow, and the output is not valid.
                            false => StopReason::Incomplete,
                        });
                    }
                }
            }
            let node = Some(first_node + i);
            let input = vec![id];
            let child = Hypothesis {
                node,
                ids,
                tokens,
                logprob,
                state: (),
                input,
                top: None,
                constraint,
                alts: None,
                ended,
            };
            children.push((h, child));
        }
        let grows = |child: &Hypothesis<()>| {
            // Out of room: nothing more will be generated, so skip the forward pass that would
            // predict it.
            let full = self.prompt_len + child.ids.len() >= self.context;
            child.ended.is_none() && !full && !last_step
        };
        // Each parent's state goes to its last growing child, the others get copies (forks).
        let mut forks_left = vec![0usize; self.live.len()];
        for (h, child) in &children {
            forks_left[*h] += grows(child) as usize;
        }
        let growing: Vec<bool> = children.iter().map(|(_, c)| grows(c)).collect();
        let mut states: Vec<Option<S>> =
            std::mem::take(&mut self.live).into_iter().map(|h| Some(h.state)).collect();
        for ((h, mut child), grows) in children.into_iter().zip(growing) {
            if !grows {
                let complete = child.constraint.as_mut().map(|c| c.is_complete());
                let stop_reason = match (child.ended, complete) {
                    (Some(reason), _) => reason,
                    (None, Some(false)) => StopReason::Incomplete,
                    (None, _) => StopReason::MaxTokens,
                };
                let finished =
                    matches!(stop_reason, StopReason::Eos | StopReason::ConstraintComplete);
                if let Some(node) = child.node {
                    self.nodes[node].finished = true;
                }
                self.done.push(Beam {
                    node: child.node,
                    score: rank_score(self.opts, child.logprob, child.tokens.len()),
                    ids: child.ids,
                    logprob: child.logprob,
                    finished,
                    stop_reason,
                    tokens: child.tokens,
                });
                continue;
            }
            forks_left[h] -= 1;
            let state = if forks_left[h] == 0 {
                states[h].take().expect("a parent state is moved once")
            } else {
                states[h].clone().expect("moved only to the last child")
            };
            let Hypothesis {
                node, ids, tokens, logprob, input, top, constraint, alts, ended, ..
            } = child;
            self.live.push(Hypothesis {
                node,
                ids,
                tokens,
                logprob,
                state,
                input,
                top,
                constraint,
                alts,
                ended,
            });
        }

        if self.live.is_empty()
            || (!self.opts.length_normalise && cannot_improve(&self.live, &mut self.done, beams))
        {
            self.over = true;
        }
        Ok(())
    }
}

/// What beams are ranked by; `len` counts the end token.
fn rank_score(opts: BeamOptions, logprob: f64, len: usize) -> f64 {
    if opts.length_normalise && len > 0 {
        logprob / (len as f64).powf(LENGTH_ALPHA)
    } else {
        logprob
    }
}

/// The alternatives a [`BeamToken`] shows, as probabilities.
fn alternatives(top: &TopK) -> Vec<(u32, f32)> {
    (0..top.ids.len().min(TOP_SHOWN)).map(|i| (top.ids[i], top.logprob(i).exp() as f32)).collect()
}

/// Beams whose output is valid first (all of them, without a constraint), then by score.
fn sort_beams(beams: &mut [Beam]) {
    let invalid = |b: &Beam| b.stop_reason == StopReason::Incomplete;
    beams.sort_by(|a, b| invalid(a).cmp(&invalid(b)).then(b.score.total_cmp(&a.score)));
}

/// Without length normalisation a hypothesis's log P only falls as it grows, so once `beams`
/// finished ones with valid output all beat the best live one, nothing live can enter the
/// result.
fn cannot_improve<S>(live: &[Hypothesis<S>], done: &mut [Beam], beams: usize) -> bool {
    sort_beams(done);
    let valid = done.iter().filter(|b| b.stop_reason != StopReason::Incomplete).count();
    if valid < beams {
        return false;
    }
    let worst_kept = done[beams - 1].score;
    live.iter().all(|hyp| hyp.logprob <= worst_kept)
}

/// Search for the most probable continuations of the prompt (see [`BeamSearch`]). Returns up to
/// `beams` hypotheses, finished or not, best score first.
pub fn beam_search<M: LanguageModel>(
    model: &M,
    prompt_ids: &[u32],
    opts: BeamOptions,
) -> Result<Vec<Beam>> {
    beam_search_constrained(model, prompt_ids, opts, None)
}

/// [`beam_search`] among the outputs valid under a constraint (see
/// [`BeamSearch::with_constraint`]), when `constraint` gives one with the tokenizer it reads.
pub fn beam_search_constrained<M: LanguageModel>(
    model: &M,
    prompt_ids: &[u32],
    opts: BeamOptions,
    constraint: Option<(&dyn Vocab, &ConstraintSpec)>,
) -> Result<Vec<Beam>> {
    let mut search = BeamSearch::new(model, prompt_ids, opts)?;
    if let Some((vocab, spec)) = constraint {
        search = search.with_constraint(vocab, spec)?;
    }
    crate::lm::block_on(search.run_async(model))?;
    Ok(search.finish())
}

/// A beam shown as if it had been generated token by token.
#[derive(Clone, Debug, PartialEq)]
pub struct BeamReplay {
    /// One event per token (the end token included when the beam finished), each with the
    /// text it adds and the distribution it was chosen from.
    pub events: Vec<TokenEvent>,
    pub prompt_tokens: usize,
    /// The whole generated text.
    pub text: String,
    /// The beam's [`Beam::stop_reason`].
    pub stop_reason: StopReason,
}

/// The token events of `beam`, a continuation of `prompt_ids`, with the texts a
/// [`Generation`](super::Generation) would have streamed.
pub fn replay(vocab: &dyn Vocab, prompt_ids: &[u32], beam: &Beam) -> BeamReplay {
    let mut stream = TextStream::new(vocab, prompt_ids);
    let mut events = Vec::with_capacity(beam.tokens.len());
    for (k, token) in beam.tokens.iter().enumerate() {
        if k < beam.ids.len() {
            stream.push(token.id);
        }
        let last = k + 1 == beam.tokens.len();
        let (text, _) = stream.take(vocab, &[], last);
        events.push(TokenEvent {
            candidates: Vec::new(),
            candidates_logsumexp: f64::NAN,
            removed: Vec::new(),
            speculated: None,
            id: token.id,
            text,
            prob: token.logprob.exp() as f32,
            logprob: token.logprob as f32,
            top: token.top.clone(),
            position: prompt_ids.len() + k,
        });
    }
    BeamReplay {
        events,
        prompt_tokens: prompt_ids.len(),
        text: stream.text().to_string(),
        stop_reason: beam.stop_reason,
    }
}

impl BeamReplay {
    /// The totals, the whole search (`search_ms`) counting as decoding: a beam's first token is
    /// only known once the search is over.
    pub fn summary(&self, search_ms: f64) -> GenerationSummary {
        GenerationSummary {
            prompt_tokens: self.prompt_tokens,
            reused_tokens: 0,
            generated_tokens: self.events.len(),
            text: self.text.clone(),
            stop_reason: self.stop_reason,
            prefill_ms: 0.0,
            decode_ms: search_ms,
            ttft_ms: search_ms,
            speculation: None,
        }
    }
}
