//! Sessions: a generation or a beam search stepped from JS, on whichever backend is loaded.
//! The library's drivers (`Generation::step_async`, `BeamSearch::run_async`) run here awaited,
//! which is what lets the WebGPU model run them (the CPU and table models answer at once, so
//! `nextSync` may step them).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

use wasm_bindgen::prelude::*;

use super::js::{self, GenOptions};
use super::{clock, js_err};
use crate::chat::{reuse_prefix, Message};
use crate::generate::{self, BeamNode, BeamSearch, Generation, GenerationSummary, TokenEvent};
use crate::load::{AnyModel, AnyState};
use crate::{Error, LanguageModel, Result, Vocab};

/// The name results give for the backend that computed them: "table", "cpu" or "webgpu".
pub(super) fn backend_name(model: &AnyModel) -> &'static str {
    match model {
        AnyModel::Table(_) => "table",
        AnyModel::Cpu(_) => "cpu",
        AnyModel::Gpu(_) => "webgpu",
    }
}

type Owned = Generation<'static, AnyModel, Rc<AnyModel>, Rc<dyn Vocab>>;

/// A model state (KV cache) and the ids whose keys and values it holds.
pub(super) type Cache = (AnyState, Vec<u32>);

/// What a session steps.
pub(super) enum Stepper {
    /// Sampling, one forward pass per token.
    Sample(Box<Owned>),
    /// A beam search, run whole on the first step, then its best beam replayed token by token.
    Beam(Box<BeamRun>),
}

pub(super) struct BeamRun {
    model: Rc<AnyModel>,
    vocab: Rc<dyn Vocab>,
    prompt: Vec<u32>,
    /// Until the search has run.
    search: Option<BeamSearch<AnyState>>,
    events: VecDeque<TokenEvent>,
    summary: Option<GenerationSummary>,
    aborted: bool,
    /// Once searched: every extension considered, and the best beam's last node.
    tree: Vec<BeamNode>,
    best: Option<usize>,
}

impl Stepper {
    /// A session over `ids`, reusing what `previous` (the engine's last session, if it is not
    /// computing a token) holds in its KV cache: a sampling run keeps the longest prefix the two
    /// share and prefills only the rest (`reuse_prefix`: the logits are those of a fresh state).
    /// `extra_stops`: more end tokens (a chat template's end-of-turn markers).
    /// `draft`: the engine's draft model, which a sampling run guesses with unless `opts` say
    /// otherwise (`GenOptions::uses_draft`).
    pub fn start_after(
        model: &Rc<AnyModel>,
        draft: Option<&Rc<AnyModel>>,
        vocab: Rc<dyn Vocab>,
        ids: &[u32],
        opts: &GenOptions,
        previous: Option<Stepper>,
        extra_stops: &[u32],
    ) -> Result<Self> {
        let cache = previous.and_then(Stepper::into_cache);
        Stepper::start(model, draft, vocab, ids, opts, cache, extra_stops)
    }

    /// A session over `ids`. `cache`: a state left by an earlier session with the ids it holds;
    /// a sampling run keeps the longest prefix they share with `ids` and prefills only the rest
    /// (`reuse_prefix`: the logits are those of a fresh state). `extra_stops`: more end tokens
    /// (a chat template's end-of-turn markers).
    fn start(
        model: &Rc<AnyModel>,
        draft: Option<&Rc<AnyModel>>,
        vocab: Rc<dyn Vocab>,
        ids: &[u32],
        opts: &GenOptions,
        cache: Option<Cache>,
        extra_stops: &[u32],
    ) -> Result<Self> {
        Ok(match opts.beam_options() {
            Some(beam_opts) => Stepper::Beam(Box::new(BeamRun {
                search: Some(match opts.constraint() {
                    Some(spec) => {
                        BeamSearch::new(&**model, ids, beam_opts)?.with_constraint(&*vocab, spec)?
                    }
                    None => BeamSearch::new(&**model, ids, beam_opts)?,
                }),
                model: model.clone(),
                vocab,
                prompt: ids.to_vec(),
                events: VecDeque::new(),
                summary: None,
                aborted: false,
                tree: Vec::new(),
                best: None,
            })),
            None => {
                let mut gen_opts = opts.generate_options();
                gen_opts.stop_tokens.extend_from_slice(extra_stops);
                let draft = draft.filter(|_| opts.uses_draft());
                if draft.is_some() {
                    gen_opts.speculative = Some(opts.draft_model_options());
                }
                let state = match cache {
                    Some((mut state, held)) => {
                        reuse_prefix(&**model, &mut state, &held, ids)?;
                        state
                    }
                    None => model.new_state(),
                };
                let mut generation = Generation::resume_with_clock(
                    model.clone(),
                    vocab,
                    state,
                    ids,
                    gen_opts,
                    clock,
                )?;
                if let Some(draft) = draft {
                    generation = generation.with_draft_model(draft.clone())?;
                }
                Stepper::Sample(Box::new(generation))
            }
        })
    }

    fn model(&self) -> &AnyModel {
        match self {
            Stepper::Sample(generation) => generation.model(),
            Stepper::Beam(run) => &run.model,
        }
    }

    /// What a sampling run leaves for the next session: its state and the ids it holds. (A
    /// beam search keeps no single state.)
    fn into_cache(self) -> Option<Cache> {
        match self {
            Stepper::Sample(generation) => {
                let held = generation.held_ids().to_vec();
                Some((generation.into_state(), held))
            }
            Stepper::Beam(_) => None,
        }
    }

    async fn next(&mut self) -> Result<Option<TokenEvent>> {
        match self {
            Stepper::Sample(generation) => generation.step_async().await,
            Stepper::Beam(run) => {
                if run.aborted {
                    return Ok(None);
                }
                if run.search.is_some() {
                    run.search_all().await?;
                }
                Ok(run.events.pop_front())
            }
        }
    }

    fn abort(&mut self) {
        match self {
            Stepper::Sample(generation) => generation.abort(),
            Stepper::Beam(run) => {
                run.aborted = true;
                let summary = run.summary.get_or_insert_with(|| GenerationSummary {
                    prompt_tokens: run.prompt.len(),
                    reused_tokens: 0,
                    generated_tokens: 0,
                    text: String::new(),
                    stop_reason: generate::StopReason::Aborted,
                    prefill_ms: 0.0,
                    decode_ms: 0.0,
                    ttft_ms: 0.0,
                    speculation: None,
                });
                summary.stop_reason = generate::StopReason::Aborted;
            }
        }
    }

    /// The totals once stopped.
    fn summary(&self) -> Option<GenerationSummary> {
        match self {
            Stepper::Sample(generation) => generation.summary(),
            Stepper::Beam(run) => {
                let over = run.aborted || (run.search.is_none() && run.events.is_empty());
                over.then(|| run.summary.clone()).flatten()
            }
        }
    }
}

impl BeamRun {
    async fn search_all(&mut self) -> Result<()> {
        let started = clock();
        let search = self.search.as_mut().expect("called while the search has not run");
        search.run_async(&*self.model).await?;
        let search = self.search.take().expect("checked above");
        self.tree = search.tree().to_vec();
        let beams = search.finish();
        let best = beams.first().ok_or_else(|| Error::Input("beam search found nothing".into()))?;
        self.best = best.node;
        let replay = generate::replay(&*self.vocab, &self.prompt, best);
        self.summary = Some(replay.summary(clock() - started));
        self.events = replay.events.into();
        Ok(())
    }
}

impl Stepper {
    fn next_now(&mut self) -> Result<Option<TokenEvent>> {
        let model = self.model();
        if !model.answers_at_once() {
            return Err(Error::Input(format!(
                "a {} generation steps asynchronously: use next()",
                backend_name(model)
            )));
        }
        crate::lm::block_on(self.next())
    }

    /// The seed a sampling run draws with.
    fn seed(&self) -> Option<u64> {
        match self {
            Stepper::Sample(g) => Some(g.sampler_config().seed),
            Stepper::Beam(_) => None,
        }
    }

    /// A constrained sampling run's time on its constraint.
    fn constraint_time(&self) -> Option<js::ConstraintTimeOut> {
        match self {
            Stepper::Sample(g) if g.is_constrained() => {
                let (steps_ms, steps) = g.constraint_time();
                Some(js::ConstraintTimeOut { build_ms: g.constraint_build_ms(), steps_ms, steps })
            }
            _ => None,
        }
    }

    /// A beam search's tree once it has run (the nodes and the best beam's last node).
    fn beam_tree(&self) -> Option<(&[BeamNode], Option<usize>)> {
        match self {
            Stepper::Beam(run) if !run.tree.is_empty() => Some((&run.tree[..], run.best)),
            _ => None,
        }
    }
}

/// A generation in progress: call `next()` until it gives `null`.
#[wasm_bindgen]
pub struct Session {
    /// Empty while a step is being computed (`next()` takes it out across the await), after a
    /// failed step, and once a newer session took over its KV cache.
    gen: Slot,
    vocab: Rc<dyn Vocab>,
    prompt_ids: Vec<u32>,
    /// A chat session's conversation as rendered (after dropping the oldest turns to fit).
    messages: Option<Vec<Message>>,
    /// How the model writes tool calls, when the chat offered tools.
    tool_format: Option<crate::tools::ToolFormat>,
}

/// Where a session's stepper lives; the engine holds a second handle to its latest session's,
/// so the next session can take over the KV cache.
pub(super) type Slot = Rc<RefCell<Option<Stepper>>>;

impl Session {
    pub(super) fn new(gen: Stepper, vocab: Rc<dyn Vocab>, prompt_ids: Vec<u32>) -> Session {
        Session {
            gen: Rc::new(RefCell::new(Some(gen))),
            vocab,
            prompt_ids,
            messages: None,
            tool_format: None,
        }
    }

    pub(super) fn with_tool_format(mut self, format: Option<crate::tools::ToolFormat>) -> Session {
        self.tool_format = format;
        self
    }

    pub(super) fn with_messages(mut self, messages: Vec<Message>) -> Session {
        self.messages = Some(messages);
        self
    }

    pub(super) fn slot(&self) -> Slot {
        self.gen.clone()
    }
}

const BUSY: &str = "this generation is computing a token (await each next() before the next), \
     failed, or was replaced by a newer generation on the same model";

async fn step(cell: Rc<RefCell<Option<Stepper>>>) -> Result<Option<TokenEvent>> {
    let taken = cell.borrow_mut().take();
    let Some(mut gen) = taken else {
        return Err(Error::Input(BUSY.into()));
    };
    let result = gen.next().await;
    // A failed step may leave the state half-written: the generation ends with it.
    if result.is_ok() {
        *cell.borrow_mut() = Some(gen);
    }
    result
}

#[wasm_bindgen]
impl Session {
    /// The next token `{id, text, token, prob, logprob, top: [{id, token, prob}], position}`,
    /// or `null` once generation has stopped. Returns a Promise (the WebGPU forward pass is
    /// asynchronous; the CPU one resolves at once). With beams, the first call runs the search.
    pub fn next(&self) -> js_sys::Promise {
        let cell = self.gen.clone();
        let vocab = self.vocab.clone();
        wasm_bindgen_futures::future_to_promise(async move {
            match step(cell).await {
                Ok(Some(ev)) => js::to_js(&js::token_out(&*vocab, ev)).map_err(JsValue::from),
                Ok(None) => Ok(JsValue::NULL),
                Err(e) => Err(js_err(e).into()),
            }
        })
    }

    /// The next token synchronously (CPU and table models only; errors for WebGPU).
    #[wasm_bindgen(js_name = nextSync)]
    pub fn next_sync(&self) -> std::result::Result<JsValue, JsError> {
        let mut slot = self.gen.borrow_mut();
        let gen = slot.as_mut().ok_or_else(|| JsError::new(BUSY))?;
        match gen.next_now().map_err(js_err)? {
            Some(ev) => js::to_js(&js::token_out(&*self.vocab, ev)),
            None => Ok(JsValue::NULL),
        }
    }

    /// Stop: later `next()` calls give `null`.
    pub fn abort(&self) {
        if let Some(gen) = self.gen.borrow_mut().as_mut() {
            gen.abort();
        }
    }

    #[wasm_bindgen(getter, js_name = promptTokens)]
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_ids.len()
    }

    /// The prompt's token ids (BOS included when the model wants it): with the generated ids,
    /// what a branch from a later position starts from.
    #[wasm_bindgen(getter, js_name = promptIds)]
    pub fn prompt_ids(&self) -> Vec<u32> {
        self.prompt_ids.clone()
    }

    /// A beam search's tree, once its first `next()` has run it: `{nodes: [{parent, step, id,
    /// piece, logprob, kept, finished}], best}` (every extension considered, with its total log
    /// P; `best`: the best beam's last node). `undefined` for sampling.
    #[wasm_bindgen(getter, js_name = beamTree)]
    pub fn beam_tree(&self) -> std::result::Result<JsValue, JsError> {
        let slot = self.gen.borrow();
        let Some((nodes, best)) = slot.as_ref().and_then(Stepper::beam_tree) else {
            return Ok(JsValue::UNDEFINED);
        };
        js::to_js(&js::beam_tree_out(&*self.vocab, nodes, best))
    }

    /// A chat session's messages as the prompt holds them: the conversation given, less the
    /// oldest turns dropped to fit the context (`dropOldest`). `undefined` for a plain prompt.
    #[wasm_bindgen(getter)]
    pub fn messages(&self) -> std::result::Result<JsValue, JsError> {
        match &self.messages {
            Some(messages) => js::to_js(messages),
            None => Ok(JsValue::UNDEFINED),
        }
    }

    /// A chat with tools, once stopped: the reply read for calls, `{content, toolCalls: [{id,
    /// type, function: {name, arguments}}]}` (`arguments` the JSON object; `content` the text
    /// around the calls). `undefined` without tools, `null` before the end.
    #[wasm_bindgen(getter)]
    pub fn reply(&self) -> std::result::Result<JsValue, JsError> {
        let Some(format) = self.tool_format else { return Ok(JsValue::UNDEFINED) };
        let slot = self.gen.borrow();
        let gen = slot.as_ref().ok_or_else(|| JsError::new(BUSY))?;
        match gen.summary() {
            Some(summary) => {
                let parsed = crate::tools::parse_reply(format, &summary.text);
                js::to_js(&serde_json::json!({
                    "content": parsed.content,
                    "toolCalls": parsed.tool_calls,
                }))
            }
            None => Ok(JsValue::NULL),
        }
    }

    /// Totals once stopped (`null` before): `promptTokens`, `generatedTokens`, `text`,
    /// `stopReason`, `prefillMs`, `decodeMs`, `ttftMs`, `prefillTokS`, `decodeTokS`, and
    /// `backend` ("table", "cpu" or "webgpu": what computed the tokens); under a constraint,
    /// `constraint: {buildMs, stepsMs, steps}` (its cost).
    pub fn summary(&self) -> std::result::Result<JsValue, JsError> {
        let slot = self.gen.borrow();
        let gen = slot.as_ref().ok_or_else(|| JsError::new(BUSY))?;
        match gen.summary() {
            Some(summary) => js::to_js(&js::summary_out(
                summary,
                backend_name(gen.model()),
                gen.constraint_time(),
                gen.seed(),
            )),
            None => Ok(JsValue::NULL),
        }
    }
}
