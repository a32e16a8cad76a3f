//! The JS side's shapes: options as JS passes them (camelCase, with snake_case aliases) and
//! results as JS receives them. Plain conversions; the numbers come from the library.

use serde::{Deserialize, Serialize};
use wasm_bindgen::prelude::*;

use crate::chat::Message;
use crate::constraint::ConstraintSpec;
use crate::generate::{
    scored_pieces, speculative::DEFAULT_MAX_DRAFT, BeamOptions, DraftSource, GenerateOptions,
    GenerationSummary, Score, SpeculativeOptions, TokenEvent,
};
use crate::sampling::SamplerConfig;
use crate::Vocab;

pub(super) fn to_js<T: Serialize>(value: &T) -> Result<JsValue, JsError> {
    value
        .serialize(&serde_wasm_bindgen::Serializer::json_compatible())
        .map_err(|e| JsError::new(&format!("cannot convert to JS: {e}")))
}

/// `undefined` and `null` mean all defaults.
fn from_js<T: for<'de> Deserialize<'de> + Default>(
    value: JsValue,
    what: &str,
) -> Result<T, JsError> {
    if value.is_undefined() || value.is_null() {
        return Ok(T::default());
    }
    serde_wasm_bindgen::from_value(value).map_err(|e| JsError::new(&format!("bad {what}: {e}")))
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
pub(super) struct LoadOptions {
    /// "auto" (WebGPU when the browser has a real adapter and it is faster for the model, else
    /// CPU), "gpu" or "cpu".
    pub backend: Option<String>,
    /// Cap on the sequence length (models advertise far more than a page needs).
    pub max_seq: Option<usize>,
    /// CPU path: true for the exact reference (f32 activations) instead of the fast one (int8
    /// dot products, simd128). For comparing against the oracle; slower.
    pub exact: bool,
    /// CPU threads (threads build, after `initThreads`): default and cap, the pool's size.
    pub threads: Option<usize>,
    /// "auto" treats a software adapter as a real GPU: for tests of auto's measurement where
    /// the only adapter is SwiftShader.
    pub allow_software_gpu: bool,
}

impl LoadOptions {
    pub fn parse(options: JsValue) -> Result<LoadOptions, JsError> {
        from_js(options, "load options")
    }
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
pub(super) struct GenOptions {
    #[serde(alias = "max_tokens")]
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    #[serde(alias = "top_k")]
    top_k: Option<usize>,
    #[serde(alias = "top_p")]
    top_p: Option<f32>,
    #[serde(alias = "min_p")]
    min_p: Option<f32>,
    #[serde(alias = "repeat_penalty")]
    repeat_penalty: Option<f32>,
    #[serde(alias = "repeat_window")]
    repeat_window: Option<usize>,
    seed: Option<f64>,
    stop: Vec<String>,
    beams: Option<usize>,
    #[serde(alias = "length_normalise")]
    length_normalise: bool,
    /// Alternatives reported with each token (default 5, at most 20).
    #[serde(alias = "top_logprobs")]
    top_logprobs: Option<usize>,
    /// Token ids emitted first whatever the sampler would pick (a branch's chosen token).
    #[serde(alias = "force_tokens")]
    force_tokens: Vec<u32>,
    /// Each token event carries the step's this-many most likely tokens with their logits (for
    /// the sampler view), at most 64.
    #[serde(alias = "keep_candidates")]
    keep_candidates: usize,
    /// Structured output: `{type: "json_schema", schema: {...}}`, `{type: "json_object"}`,
    /// `{type: "regex", pattern: "..."}` or `{type: "grammar", lark: "..."}`
    /// (`ConstraintSpec`). Only tokens that keep the output valid are sampled; each token event
    /// then carries `removed`, and the summary's `stopReason` is "ConstraintComplete" (nothing
    /// can follow), "Eos" (the model ended a complete output) or "Incomplete" (`maxTokens` or
    /// the context ran out first: not valid output).
    constraint: Option<ConstraintSpec>,
    /// With `constraint`, the last this-many ids of a prompt given as ids are output already
    /// under it (a branch of a constrained generation): they are checked against it first.
    #[serde(alias = "constraint_prefix")]
    constraint_prefix: usize,
    /// Speculative decoding by prompt lookup: guesses from what followed the last few tokens
    /// where they occurred before, verified several per forward pass. The output is the same
    /// (token for token with the same seed); each token event says which pass made it and
    /// whether its guess was kept (`speculated`), the summary how many were (`speculation`).
    lookup: bool,
    /// Speculative decoding: the most guesses one pass verifies (default 4, at most 16).
    #[serde(alias = "draft_max")]
    draft_max: Option<usize>,
    /// With a draft model loaded (`load(url, {draft})`): guess with it (the default), or not
    /// (`false`). `lookup` takes precedence.
    draft: Option<bool>,
    /// Benchmarks (the bench page): guesses of known acceptance, `{ids, wrongEvery}`: the guess
    /// for the i-th generated token is `ids[i]`, every `wrongEvery`-th one (0: none) replaced.
    #[serde(alias = "replay_draft")]
    replay_draft: Option<ReplayDraft>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReplayDraft {
    ids: Vec<u32>,
    #[serde(default)]
    wrong_every: usize,
}

impl GenOptions {
    /// The options given; without a `seed`, one drawn now (each run draws anew; the summary
    /// reports it, so a run can be reproduced).
    pub fn parse(options: JsValue) -> Result<GenOptions, JsError> {
        let mut opts: GenOptions = from_js(options, "generation options")?;
        opts.seed.get_or_insert_with(|| crate::sampling::fresh_seed() as f64);
        Ok(opts)
    }

    /// What was given over the library's defaults.
    pub fn generate_options(&self) -> GenerateOptions {
        let d = GenerateOptions::default();
        let s = SamplerConfig::default();
        GenerateOptions {
            max_tokens: self.max_tokens.unwrap_or(d.max_tokens),
            sampler: SamplerConfig {
                temperature: self.temperature.unwrap_or(s.temperature),
                top_k: self.top_k.unwrap_or(s.top_k),
                top_p: self.top_p.unwrap_or(s.top_p),
                min_p: self.min_p.unwrap_or(s.min_p),
                repeat_penalty: self.repeat_penalty.unwrap_or(s.repeat_penalty),
                repeat_window: self.repeat_window.unwrap_or(s.repeat_window),
                seed: self.seed.map_or(s.seed, |seed| seed.max(0.0) as u64),
                alternatives: self.top_logprobs.unwrap_or(s.alternatives),
            },
            stop_strings: self.stop.iter().filter(|s| !s.is_empty()).cloned().collect(),
            forced: self.force_tokens.clone(),
            keep_candidates: self.keep_candidates.min(MAX_CANDIDATES),
            constraint: self.constraint.clone(),
            constraint_prefix: self.constraint_prefix,
            speculative: self.speculative(),
            ..d
        }
    }

    /// Speculative decoding by prompt lookup or a replay, when asked for.
    fn speculative(&self) -> Option<SpeculativeOptions> {
        let source = match (&self.replay_draft, self.lookup) {
            (Some(r), _) => {
                DraftSource::Replay { tokens: r.ids.clone(), wrong_every: r.wrong_every }
            }
            (None, true) => DraftSource::lookup(),
            (None, false) => return None,
        };
        Some(SpeculativeOptions { source, max_draft: self.draft_max.unwrap_or(DEFAULT_MAX_DRAFT) })
    }

    /// Whether a sampling run guesses with the engine's draft model, when it has one.
    pub fn uses_draft(&self) -> bool {
        self.speculative().is_none() && self.draft.unwrap_or(true)
    }

    /// Speculative decoding with the draft model, `draftMax` guesses at most.
    pub fn draft_model_options(&self) -> SpeculativeOptions {
        SpeculativeOptions {
            max_draft: self.draft_max.unwrap_or(DEFAULT_MAX_DRAFT),
            ..SpeculativeOptions::draft_model()
        }
    }

    /// The constraint, if any (beam search takes it apart from the other options).
    pub fn constraint(&self) -> Option<&ConstraintSpec> {
        self.constraint.as_ref()
    }

    /// Generate under `spec` (a forced tool call's grammar); an error when the options bring a
    /// constraint of their own.
    pub fn force_constraint(&mut self, spec: ConstraintSpec) -> Result<(), JsError> {
        if self.constraint.is_some() {
            return Err(JsError::new(
                "tool_choice: a forced tool call is its own constraint; it cannot be combined with \
                 another (response_format, regex or grammar)",
            ));
        }
        self.constraint = Some(spec);
        Ok(())
    }

    /// Beam search options when other than one beam was asked for (0 goes to the search, which
    /// refuses it with a message, rather than quietly meaning 1).
    pub fn beam_options(&self) -> Option<BeamOptions> {
        let beams = self.beams.unwrap_or(1);
        (beams != 1).then(|| BeamOptions {
            beams,
            max_tokens: self.generate_options().max_tokens,
            length_normalise: self.length_normalise,
        })
    }
}

/// The most candidates a token event carries (the GPU ranks at most 64 per step).
const MAX_CANDIDATES: usize = 64;
/// Candidates a sampler view draws (and so labels).
const SHOWN_CANDIDATES: usize = 20;

/// `startChat`'s options beyond the generation options.
#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
pub(super) struct ChatOptions {
    /// Drop the oldest turns when the conversation does not fit the context.
    #[serde(alias = "drop_oldest")]
    pub drop_oldest: bool,
    /// Tools offered to the model (OpenAI's `[{type: "function", function: {...}}]`), given to
    /// its chat template.
    pub tools: Option<Vec<serde_json::Value>>,
    /// "auto" (default), "none", "required", a tool's name, or OpenAI's `{type: "function",
    /// function: {name}}`.
    #[serde(alias = "tool_choice")]
    pub tool_choice: Option<serde_json::Value>,
    /// With a forced call: one to `tools::MAX_PARALLEL_CALLS` calls (default), or exactly one.
    #[serde(alias = "parallel_tool_calls")]
    pub parallel_tool_calls: Option<bool>,
}

/// What a chat's tools ask of its reply: `None` to offer no tools ("none"), else whether (and
/// which) call is forced.
pub(super) fn tool_choice(
    choice: Option<&serde_json::Value>,
) -> Result<Option<Option<crate::tools::ForcedCall>>, JsError> {
    use crate::tools::ForcedCall;
    let bad = || {
        JsError::new(
            "tool_choice: expected \"auto\", \"none\", \"required\" or {type: \"function\", \
             function: {name}}",
        )
    };
    Ok(match choice {
        None => Some(None),
        Some(serde_json::Value::String(s)) => match s.as_str() {
            "auto" => Some(None),
            "none" => None,
            "required" => Some(Some(ForcedCall::Any)),
            name => Some(Some(ForcedCall::Named(name.to_string()))),
        },
        Some(v) => {
            let name = v.pointer("/function/name").and_then(|n| n.as_str()).ok_or_else(bad)?;
            Some(Some(ForcedCall::Named(name.to_string())))
        }
    })
}

impl ChatOptions {
    pub fn parse(options: JsValue) -> Result<ChatOptions, JsError> {
        from_js(options, "chat options")
    }
}

/// A conversation as JS gives it: `[{role, content}]` (other fields, e.g. `name`, ignored).
pub(super) fn messages(value: JsValue) -> Result<Vec<Message>, JsError> {
    if !js_sys::Array::is_array(&value) {
        return Err(JsError::new("messages: expected an array of {role, content} objects"));
    }
    serde_wasm_bindgen::from_value(value).map_err(|e| {
        JsError::new(&format!("messages: each must be {{role: string, content: string}} ({e})"))
    })
}

#[derive(Serialize)]
struct TopOut {
    id: u32,
    /// The token as the vocabulary spells it ("▁cat").
    token: String,
    /// The token alone as text (" cat"; a special token keeps its spelling).
    piece: String,
    prob: f32,
    /// ln `prob`, or -9999 where it underflows to 0 (OpenAI's convention for "never").
    logprob: f64,
}

#[derive(Serialize)]
pub(super) struct TokenOut {
    id: u32,
    /// What the token adds to the text.
    text: String,
    /// The token as the vocabulary spells it ("▁cat", "<0x0A>").
    token: String,
    /// The token alone as text.
    piece: String,
    prob: f32,
    logprob: f32,
    top: Vec<TopOut>,
    position: usize,
    /// The step's most likely tokens and their logits, when `keepCandidates` asked for them
    /// (under a constraint: the most likely of the tokens it allowed).
    #[serde(skip_serializing_if = "Option::is_none")]
    candidates: Option<CandidatesOut>,
    /// Under a constraint, the tokens it removed at this step from among the model's most likely
    /// (the first `max(topLogprobs, keepCandidates)`), most likely first; absent when it
    /// removed none of them (and without a constraint).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    removed: Vec<RemovedOut>,
    /// When a verification pass of speculative decoding made this token: the pass's number, the
    /// row this token was sampled from, the pass's guesses, and whether the guess at this row
    /// was "accepted", "rejected" (the model chose this token instead) or this is the "bonus"
    /// token after all of them.
    #[serde(skip_serializing_if = "Option::is_none")]
    speculated: Option<SpeculatedOut>,
}

#[derive(Serialize)]
struct SpeculatedOut {
    pass: usize,
    row: usize,
    drafted: Vec<GuessOut>,
    outcome: &'static str,
}

#[derive(Serialize)]
struct GuessOut {
    id: u32,
    /// The guess alone as text.
    piece: String,
}

#[derive(Serialize)]
struct RemovedOut {
    id: u32,
    /// The token as the vocabulary spells it.
    token: String,
    /// The token alone as text (the first 20 only, as for candidates).
    #[serde(skip_serializing_if = "Option::is_none")]
    piece: Option<String>,
    /// What the model gave it (plain softmax), before the constraint removed it.
    prob: f32,
    logprob: f64,
}

#[derive(Serialize)]
struct CandidatesOut {
    ids: Vec<u32>,
    logits: Vec<f32>,
    /// The first [`SHOWN_CANDIDATES`] candidates alone as text (what a view labels; decoding
    /// all of them would cost every decode step more than the view ever shows).
    pieces: Vec<String>,
    /// The log-sum-exp of the step's whole row of logits: a candidate's probability as the
    /// model gives it (the token events' `prob`) is `exp(logit - logsumexp)`, constrained or not.
    logsumexp: f64,
}

/// `id` decoded alone; special tokens (which decode to nothing) as spelled.
fn piece(vocab: &dyn Vocab, id: u32) -> String {
    let text = vocab.decode(&[id]);
    if text.is_empty() {
        vocab.token_text(id)
    } else {
        text
    }
}

/// Where a probability underflowed to 0, OpenAI's API reports a log-probability of -9999.
const NEVER_LOGPROB: f64 = -9999.0;

pub(super) fn token_out(vocab: &dyn Vocab, ev: TokenEvent) -> TokenOut {
    TokenOut {
        id: ev.id,
        token: vocab.token_text(ev.id),
        piece: piece(vocab, ev.id),
        text: ev.text,
        prob: ev.prob,
        logprob: ev.logprob,
        top: ev
            .top
            .iter()
            .map(|&(id, prob)| TopOut {
                id,
                token: vocab.token_text(id),
                piece: piece(vocab, id),
                prob,
                logprob: if prob > 0.0 { f64::from(prob).ln() } else { NEVER_LOGPROB },
            })
            .collect(),
        position: ev.position,
        removed: ev
            .removed
            .iter()
            .enumerate()
            .map(|(i, &(id, prob))| RemovedOut {
                id,
                token: vocab.token_text(id),
                piece: (i < SHOWN_CANDIDATES).then(|| piece(vocab, id)),
                prob,
                logprob: if prob > 0.0 { f64::from(prob).ln() } else { NEVER_LOGPROB },
            })
            .collect(),
        speculated: ev.speculated.as_ref().map(|s| SpeculatedOut {
            pass: s.pass,
            row: s.row,
            drafted: s.drafted.iter().map(|&id| GuessOut { id, piece: piece(vocab, id) }).collect(),
            outcome: s.outcome.name(),
        }),
        candidates: (!ev.candidates.is_empty()).then(|| CandidatesOut {
            ids: ev.candidates.iter().map(|&(id, _)| id).collect(),
            logits: ev.candidates.iter().map(|&(_, logit)| logit).collect(),
            pieces: ev
                .candidates
                .iter()
                .take(SHOWN_CANDIDATES)
                .map(|&(id, _)| piece(vocab, id))
                .collect(),
            logsumexp: ev.candidates_logsumexp,
        }),
    }
}

#[derive(Serialize)]
struct BeamNodeOut {
    parent: Option<usize>,
    step: usize,
    id: u32,
    /// The token alone as text.
    piece: String,
    /// Total log P of the hypothesis this node ends.
    logprob: f64,
    kept: bool,
    finished: bool,
}

#[derive(Serialize)]
pub(super) struct BeamTreeOut {
    nodes: Vec<BeamNodeOut>,
    best: Option<usize>,
}

pub(super) fn beam_tree_out(
    vocab: &dyn Vocab,
    nodes: &[crate::generate::BeamNode],
    best: Option<usize>,
) -> BeamTreeOut {
    let nodes = nodes
        .iter()
        .map(|n| BeamNodeOut {
            parent: n.parent,
            step: n.step,
            id: n.id,
            piece: piece(vocab, n.id),
            logprob: n.logprob,
            kept: n.kept,
            finished: n.finished,
        })
        .collect();
    BeamTreeOut { nodes, best }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct SummaryOut {
    prompt_tokens: usize,
    /// Of the prompt tokens, those whose keys and values were kept from the previous
    /// generation (only the rest were prefilled).
    reused_tokens: usize,
    generated_tokens: usize,
    text: String,
    stop_reason: String,
    prefill_ms: f64,
    decode_ms: f64,
    ttft_ms: f64,
    prefill_tok_s: f64,
    decode_tok_s: f64,
    /// What computed the tokens: "table", "cpu" or "webgpu".
    backend: &'static str,
    /// Under a constraint: milliseconds spent compiling it (and the first step's allowed set),
    /// then on all its steps (consuming each token and computing the next allowed set), and the
    /// steps; absent without one.
    #[serde(skip_serializing_if = "Option::is_none")]
    constraint: Option<ConstraintTimeOut>,
    /// The seed the sampler drew with (the one given, or the one drawn for this run: give it
    /// back as `seed` to reproduce the run); absent for beam search, which draws nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<f64>,
    /// What speculative decoding did, when it was on.
    #[serde(skip_serializing_if = "Option::is_none")]
    speculation: Option<SpeculationOut>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct SpeculationOut {
    /// "prompt lookup"
    drafter: &'static str,
    /// Verification passes, the guesses they checked and how many were kept.
    passes: usize,
    drafted: usize,
    accepted: usize,
    acceptance: f64,
    /// Tokens per forward pass after the prompt's (1 without speculation).
    tokens_per_pass: f64,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct ConstraintTimeOut {
    pub build_ms: f64,
    pub steps_ms: f64,
    pub steps: usize,
}

pub(super) fn summary_out(
    s: GenerationSummary,
    backend: &'static str,
    constraint: Option<ConstraintTimeOut>,
    seed: Option<u64>,
) -> SummaryOut {
    SummaryOut {
        constraint,
        // A JS number (a seed given past 2^53 is reported rounded, as JS held it).
        seed: seed.map(|s| s as f64),
        speculation: s.speculation.as_ref().map(|st| SpeculationOut {
            drafter: st.source,
            passes: st.passes,
            drafted: st.drafted,
            accepted: st.accepted,
            acceptance: st.acceptance_rate(),
            tokens_per_pass: st.tokens_per_pass(s.generated_tokens),
        }),
        prompt_tokens: s.prompt_tokens,
        reused_tokens: s.reused_tokens,
        generated_tokens: s.generated_tokens,
        stop_reason: format!("{:?}", s.stop_reason),
        prefill_tok_s: s.prefill_tokens_per_second(),
        decode_tok_s: s.decode_tokens_per_second(),
        text: s.text,
        prefill_ms: s.prefill_ms,
        decode_ms: s.decode_ms,
        ttft_ms: s.ttft_ms,
        backend,
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ScoredOut {
    id: u32,
    token: String,
    /// The text this token adds to the scored text (as generation would stream it: a word's
    /// space included; "" for a byte that only completes a character with a later token, or
    /// a token that makes no text): the pieces, concatenated, are the text.
    piece: String,
    prob: f64,
    logprob: f64,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct ScoreOut {
    tokens: Vec<ScoredOut>,
    logprob: f64,
    probability: f64,
    avg_nll: f64,
    perplexity: f64,
    /// What computed the logits: "table", "cpu" or "webgpu".
    backend: &'static str,
}

/// `ids[0]` is the unscored context; each later id has its log-probability in `score`.
pub(super) fn score_out(
    vocab: &dyn Vocab,
    ids: &[u32],
    score: &Score,
    backend: &'static str,
) -> ScoreOut {
    let tokens = ids[1..]
        .iter()
        .zip(&score.token_logprobs)
        .zip(scored_pieces(vocab, ids))
        .map(|((&id, &lp), piece)| ScoredOut {
            id,
            token: vocab.token_text(id),
            piece,
            prob: lp.exp(),
            logprob: lp,
        })
        .collect();
    ScoreOut {
        tokens,
        logprob: score.total_logprob,
        probability: score.probability(),
        avg_nll: score.avg_nll,
        perplexity: score.perplexity,
        backend,
    }
}

#[derive(Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct InfoOut {
    /// "table" or "gguf".
    pub kind: &'static str,
    /// "table", "cpu" or "webgpu".
    pub backend: &'static str,
    /// Adapter name for WebGPU; why WebGPU was not used, for a CPU fallback.
    pub backend_detail: String,
    pub name: String,
    pub description: String,
    pub arch: String,
    pub n_vocab: usize,
    pub n_ctx: usize,
    pub n_layer: usize,
    pub n_embd: usize,
    pub parameters: usize,
    pub bytes: usize,
    /// Weight bytes one decode step reads (for the bench's bandwidth figure).
    pub weight_bytes_per_token: usize,
    /// Table models: their words, in id order.
    pub words: Vec<String>,
    /// The GGUF's chat template (Jinja source), when it has one.
    pub chat_template: Option<String>,
    /// How the model writes tool calls ("hermes" or "llama_json"), when its template takes
    /// tools (`startChat`'s `tools`).
    pub tool_format: Option<crate::tools::ToolFormat>,
    /// Bytes of the model file this engine holds in wasm memory: the whole file on the CPU
    /// path (its kernels read the weights there), 0 on WebGPU (the weights are on the GPU only)
    /// and for a table model (parsed, not held as bytes).
    pub weights_in_wasm_bytes: usize,
    /// How the weights reached their backend: "wasm" (the download into wasm memory: the CPU
    /// path, and WebGPU for split models or a download of unknown length, whose bytes are
    /// released once uploaded) or "streamed" (WebGPU: from the download straight into GPU
    /// buffers, never in wasm memory). "" for table models.
    pub load_path: &'static str,
    /// The draft model's parameters, when one guesses for this model (`Engine::setDraft`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub draft_parameters: Option<usize>,
}
