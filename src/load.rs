//! One loader for every front end. The CLI and the browser both end with a [`Loaded`]: an
//! [`AnyModel`] (a lesson's table, a transformer on the CPU, or one on the GPU), the vocabulary
//! that turns its ids into text, and the chat template the file carries (or why there is none).
//!
//! `AnyModel` is itself a [`LanguageModel`], so each front end runs one instantiation of the
//! drivers (`Generation`, `BeamSearch`, `score`) whatever was loaded, and a new backend is one
//! more variant here rather than one more arm in every front end.
//!
//! What differs between the front ends is only where the bytes come from: the CLI opens (maps) a
//! file and decides the backend at once ([`on_native_backend`]); the browser chooses the backend
//! before the download, because on WebGPU the download streams straight into GPU buffers
//! (`web/engine.rs`). Both read the tokenizer and the chat template with [`GgufVocab`] and
//! build the CPU model with [`CpuSettings`].

use std::rc::Rc;

use crate::chat::ChatTemplate;
use crate::constraint::AllowedSet;
use crate::cpu::{kernels::Isa, CpuModel, KvCache, Precision};
use crate::error::{Error, Result};
use crate::gguf::Gguf;
use crate::gpu::{GpuModel, GpuState};
use crate::lm::{AllowedTop, LanguageModel, TopK, Vocab};
use crate::model::Model;
use crate::table::{TableModel, TableState};
use crate::tokenizer::HfTokenizer;

/// Whichever model a front end loaded.
// One per loaded model, behind an `Rc`: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub enum AnyModel {
    /// A lesson's table (shared: it is its own vocabulary too).
    Table(Rc<TableModel>),
    Cpu(CpuModel),
    Gpu(GpuModel),
}

/// The state of an [`AnyModel`]: its variant's state.
// The caches live on the heap; a few hundred bytes inline cost nothing beside them.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
pub enum AnyState {
    Table(TableState),
    Cpu(KvCache),
    Gpu(GpuState),
}

/// A state given to a model of another variant: the drivers only pass a model its own states.
fn foreign_state() -> Error {
    Error::Input("a model was given another model's state".into())
}

/// `$body` with `$m` bound to the model whatever its variant.
macro_rules! each_model {
    ($model:expr, $m:ident => $body:expr) => {
        match $model {
            AnyModel::Table($m) => $body,
            AnyModel::Cpu($m) => $body,
            AnyModel::Gpu($m) => $body,
        }
    };
}

/// `$body` with `$m` and `$s` bound to the model and its own state (an error when they are of
/// different variants).
macro_rules! with_state {
    ($model:expr, $state:expr, $m:ident, $s:ident => $body:expr) => {
        match ($model, $state) {
            (AnyModel::Table($m), AnyState::Table($s)) => $body,
            (AnyModel::Cpu($m), AnyState::Cpu($s)) => $body,
            (AnyModel::Gpu($m), AnyState::Gpu($s)) => $body,
            _ => Err(foreign_state()),
        }
    };
}

impl LanguageModel for AnyModel {
    type State = AnyState;

    fn vocab_size(&self) -> usize {
        each_model!(self, m => m.vocab_size())
    }
    fn context_length(&self) -> usize {
        each_model!(self, m => m.context_length())
    }
    fn bos_token(&self) -> Option<u32> {
        each_model!(self, m => m.bos_token())
    }
    fn eos_tokens(&self) -> &[u32] {
        each_model!(self, m => m.eos_tokens())
    }
    fn new_state(&self) -> AnyState {
        match self {
            AnyModel::Table(m) => AnyState::Table(m.new_state()),
            AnyModel::Cpu(m) => AnyState::Cpu(m.new_state()),
            AnyModel::Gpu(m) => AnyState::Gpu(m.new_state()),
        }
    }
    fn position(&self, state: &AnyState) -> usize {
        let held = with_state!(self, state, m, s => Ok(m.position(s)));
        held.expect("a model was given another model's state")
    }
    fn truncate(&self, state: &mut AnyState, len: usize) -> Result<()> {
        with_state!(self, state, m, s => m.truncate(s, len))
    }
    async fn forward_async(
        &self,
        state: &mut AnyState,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>> {
        with_state!(self, state, m, s => m.forward_async(s, tokens, all_logits).await)
    }
    async fn forward_top_async(
        &self,
        state: &mut AnyState,
        tokens: &[u32],
        k: usize,
    ) -> Result<TopK> {
        with_state!(self, state, m, s => m.forward_top_async(s, tokens, k).await)
    }
    async fn forward_top_allowed_async(
        &self,
        state: &mut AnyState,
        tokens: &[u32],
        k: usize,
        shown: usize,
        allowed: &AllowedSet,
    ) -> Result<AllowedTop> {
        with_state!(self, state, m, s => {
            m.forward_top_allowed_async(s, tokens, k, shown, allowed).await
        })
    }
    fn top_on_device(&self) -> Option<usize> {
        each_model!(self, m => m.top_on_device())
    }
    fn score_chunk(&self) -> usize {
        each_model!(self, m => m.score_chunk())
    }
    fn answers_at_once(&self) -> bool {
        each_model!(self, m => m.answers_at_once())
    }
}

impl AnyModel {
    /// The transformer's description (config, weights), `None` for a table.
    pub fn transformer(&self) -> Option<&Model> {
        match self {
            AnyModel::Table(_) => None,
            AnyModel::Cpu(m) => Some(&m.model),
            AnyModel::Gpu(m) => Some(&m.model),
        }
    }

    /// The GPU model, `None` on the other backends.
    pub fn gpu(&self) -> Option<&GpuModel> {
        match self {
            AnyModel::Gpu(m) => Some(m),
            _ => None,
        }
    }
}

/// How the CPU path computes: the precision, the threads and (natively) the kernels'
/// instruction set. The same settings make the CPU model natively and in the browser.
#[derive(Clone, Copy, Debug)]
pub struct CpuSettings {
    pub precision: Precision,
    pub threads: usize,
    /// `None`: the best this machine has.
    pub isa: Option<Isa>,
}

impl CpuSettings {
    /// `model` on the CPU with these settings, its KV cache sized for `max_seq` tokens.
    pub fn model(&self, model: Model, max_seq: usize) -> CpuModel {
        let mut cpu =
            CpuModel::new(model).with_precision(self.precision).with_threads(self.threads);
        if let Some(isa) = self.isa {
            cpu = cpu.with_isa(isa);
        }
        cpu.with_max_seq(max_seq)
    }

    /// What the CPU path computes with: "avx2 int8 kernels, 2 threads".
    pub fn describe(&self) -> String {
        let threads = match self.threads {
            1 => "1 thread".to_string(),
            n => format!("{n} threads"),
        };
        match self.precision {
            Precision::Exact => format!("exact reference kernels, {threads}"),
            Precision::Fast => {
                format!("{} int8 kernels, {threads}", self.isa.unwrap_or_else(Isa::detect).name())
            }
        }
    }
}

/// A GGUF model's text side: its tokenizer and its chat template.
pub struct GgufVocab {
    pub tokenizer: Rc<HfTokenizer>,
    /// The chat template, or why there is none (generation and scoring work without one): the
    /// reason as `Error::Template` words it, without its prefix.
    pub template: std::result::Result<ChatTemplate, String>,
}

impl GgufVocab {
    /// The tokenizer from `tokenizer_json` (a `tokenizer.json`'s bytes), else the one the
    /// header's metadata describes; and the chat template in the header.
    pub fn read(header: &Gguf, tokenizer_json: Option<&[u8]>) -> Result<GgufVocab> {
        let tokenizer = match tokenizer_json {
            Some(json) => HfTokenizer::from_bytes(json)?,
            None => HfTokenizer::from_gguf(header)?,
        };
        Ok(GgufVocab::with_tokenizer(header, tokenizer))
    }

    /// [`read`](GgufVocab::read) with a tokenizer found elsewhere (the CLI looks beside the
    /// model file). The template is read with the tokenizer, for the token strings the file
    /// lacks.
    pub fn with_tokenizer(header: &Gguf, tokenizer: HfTokenizer) -> GgufVocab {
        let template =
            ChatTemplate::from_gguf_with_vocab(header, Some(&tokenizer)).map_err(|e| match e {
                Error::Template(why) => why,
                other => other.to_string(),
            });
        GgufVocab { tokenizer: Rc::new(tokenizer), template }
    }

    /// This vocabulary, checked against a model of `n_vocab` logits (an error when the
    /// tokenizer has ids the model cannot score).
    pub fn fitting(self, n_vocab: usize) -> Result<GgufVocab> {
        self.tokenizer.check_fits(n_vocab)?;
        Ok(self)
    }
}

/// A model ready to run: the model, its vocabulary, its chat template, and a line saying which
/// backend runs it and why. A clone shares the model (weights are not copied).
#[derive(Clone)]
pub struct Loaded {
    pub model: Rc<AnyModel>,
    pub vocab: Rc<dyn Vocab>,
    pub template: std::result::Result<ChatTemplate, String>,
    pub backend: String,
}

impl Loaded {
    /// A lesson's table model: its own vocabulary, no chat template.
    pub fn table(table: TableModel) -> Loaded {
        let table = Rc::new(table);
        Loaded {
            vocab: table.clone(),
            model: Rc::new(AnyModel::Table(table)),
            template: Err("table models have no chat template".into()),
            backend: "table (a lookup table: no matrix math)".into(),
        }
    }

    /// A transformer (`model`: a CPU or GPU model) with its tokenizer and chat template.
    pub fn transformer(model: AnyModel, text: GgufVocab, backend: String) -> Loaded {
        Loaded { model: Rc::new(model), vocab: text.tokenizer, template: text.template, backend }
    }

    /// The chat template, or an error saying why the model has none.
    pub fn template(&self) -> Result<&ChatTemplate> {
        self.template.as_ref().map_err(|why| Error::Template(why.clone()))
    }
}

/// `model` on the backend `request` names, natively: `cpu`, `gpu`, or `auto` (the GPU checked
/// against the CPU oracle, then both timed on this model; the faster runs it: `backend`'s
/// policy). Returns the model and the line saying which backend and why.
#[cfg(not(target_arch = "wasm32"))]
pub async fn on_native_backend(
    model: Model,
    request: crate::backend::BackendRequest,
    cpu: CpuSettings,
    max_seq: usize,
) -> Result<(AnyModel, String)> {
    use crate::backend::{self, BackendChoice, BackendRequest};
    let context = match backend::choose_native(request)? {
        BackendChoice::Cpu { reason } => {
            return Ok((AnyModel::Cpu(cpu.model(model, max_seq)), reason))
        }
        BackendChoice::Gpu { context, reason } if request == BackendRequest::Gpu => {
            let gpu = GpuModel::with_context(context, model).await?.with_max_seq(max_seq);
            return Ok((AnyModel::Gpu(gpu), reason));
        }
        BackendChoice::Gpu { context, .. } => context,
    };
    let cpu = cpu.model(model.share(), max_seq);
    let gpu = GpuModel::with_context(context, model).await?.with_max_seq(max_seq);
    match backend::verdict(&gpu, || Ok((backend::cpu_decode_ms(&cpu)?, false))).await {
        Ok(v) if v.gpu => {
            let reason = format!("gpu, {} ({})", gpu.context().describe(), v.reason);
            Ok((AnyModel::Gpu(gpu), reason))
        }
        Ok(v) => Ok((AnyModel::Cpu(cpu), format!("cpu ({})", v.reason))),
        Err(e) => Ok((AnyModel::Cpu(cpu), format!("cpu ({e})"))),
    }
}
