//! Loading: the backend chosen first; then the model's bytes into wasm memory (the CPU path, a
//! table) or, on WebGPU, from the download straight into GPU buffers.

use std::rc::Rc;

use wasm_bindgen::prelude::*;

use std::cell::RefCell;

use super::js::{self, ChatOptions, GenOptions, InfoOut, LoadOptions};
use super::js_err;
use super::session::{backend_name, Session, Slot, Stepper};
use crate::backend::{self, software_adapter, BackendRequest};
use crate::chat::{fit_prompt, ChatTemplate, Overflow};
use crate::cpu::Precision;
use crate::generate::{continuation_ids, prompt_ids, Score};
use crate::gguf::Gguf;
use crate::gpu::{GpuContext, GpuModel, GpuOptions, GpuStream};
use crate::load::{AnyModel, CpuSettings, GgufVocab, Loaded};
use crate::model::Model;
use crate::table::TableModel;
use crate::{Error, LanguageModel};

/// Model bytes collected in wasm memory as they download.
#[wasm_bindgen]
pub struct ByteSink {
    buf: Vec<u8>,
}

#[wasm_bindgen]
impl ByteSink {
    /// `capacity`: the expected size (Content-Length), so the buffer is allocated once; 0 if
    /// unknown. Fails cleanly (instead of aborting) when wasm memory cannot grow that far.
    #[wasm_bindgen(constructor)]
    pub fn new(capacity: f64) -> Result<ByteSink, JsError> {
        let mut sink = ByteSink { buf: Vec::new() };
        sink.reserve(capacity)?;
        Ok(sink)
    }

    /// Room for `extra` more bytes, exactly: called before each later part of a split model with
    /// that part's size, so the buffer grows to the model's size and no further (`push` alone
    /// grows by doubling, which can reserve nearly twice what the model needs).
    pub fn reserve(&mut self, extra: f64) -> Result<(), JsError> {
        if extra > 0.0 {
            self.buf.try_reserve_exact(extra as usize).map_err(|_| {
                JsError::new(&format!(
                    "out of memory: cannot allocate {:.0} MB for the model in WebAssembly memory (the limit is 4 GB, and the browser may allow less)",
                    (self.buf.len() as f64 + extra) / 1e6
                ))
            })?;
        }
        Ok(())
    }

    /// Append a chunk (copied once, straight from the JS array into wasm memory).
    pub fn push(&mut self, chunk: &js_sys::Uint8Array) -> Result<(), JsError> {
        let n = chunk.length() as usize;
        let len = self.buf.len();
        self.buf.try_reserve(n).map_err(|_| {
            JsError::new(&format!(
                "out of memory after {:.0} MB: the model does not fit in WebAssembly memory",
                len as f64 / 1e6
            ))
        })?;
        self.buf.resize(len + n, 0);
        chunk.copy_to(&mut self.buf[len..]);
        Ok(())
    }

    #[wasm_bindgen(getter)]
    pub fn length(&self) -> f64 {
        self.buf.len() as f64
    }
}

/// The backend a GGUF model is to run on, chosen before its download: WebGPU (its device is
/// opened here) or the CPU path (and why). A WebGPU load can then stream the download straight
/// into GPU buffers ([`GgufStream`]); a CPU load needs the bytes in wasm memory ([`ByteSink`]).
#[wasm_bindgen]
pub struct BackendChoice {
    gpu: Option<std::sync::Arc<GpuContext>>,
    /// Why the CPU path, when it is the choice.
    cpu_why: String,
    /// Whether a failure on WebGPU may fall back to the CPU path (`backend: "auto"`).
    fallback: bool,
}

#[wasm_bindgen]
impl BackendChoice {
    /// Choose by the load options' `backend`: "cpu"; "gpu" (WebGPU or an error saying why
    /// not); "auto" (the default: WebGPU when the browser has a real adapter, else the CPU path:
    /// a software adapter such as SwiftShader is far slower than it; once the model is on the
    /// GPU, `Engine.autoVerdict` checks it and times both backends).
    pub async fn choose(options: JsValue) -> Result<BackendChoice, JsError> {
        let opts = LoadOptions::parse(options)?;
        let request: BackendRequest = match &opts.backend {
            Some(name) => {
                name.parse().map_err(|e: Error| JsError::new(&format!("load options: {e}")))?
            }
            None => BackendRequest::Auto,
        };
        let auto = request == BackendRequest::Auto;
        let cpu = |why: String| BackendChoice { gpu: None, cpu_why: why, fallback: false };
        match request {
            BackendRequest::Cpu => Ok(cpu("CPU backend chosen".into())),
            BackendRequest::Gpu | BackendRequest::Auto => match webgpu().await {
                Ok(ctx)
                    if auto
                        && !opts.allow_software_gpu
                        && software_adapter(&ctx.info).is_some() =>
                {
                    let why = software_adapter(&ctx.info).unwrap_or_default();
                    Ok(cpu(format!(
                        "auto: {why}, slower than the CPU path; backend \"gpu\" forces WebGPU"
                    )))
                }
                Ok(ctx) => {
                    Ok(BackendChoice { gpu: Some(ctx), cpu_why: String::new(), fallback: auto })
                }
                Err(e) if !auto => Err(JsError::new(&e)),
                Err(e) => Ok(cpu(format!("{e}; running on the CPU"))),
            },
        }
    }

    /// The CPU path, for `why` (e.g. after WebGPU failed on a streamed load).
    pub fn cpu(why: String) -> BackendChoice {
        BackendChoice { gpu: None, cpu_why: why, fallback: false }
    }

    /// Another handle on this choice (the same WebGPU device): for `Engine.loadGguf`, which
    /// takes the one it is given.
    pub fn share(&self) -> BackendChoice {
        BackendChoice {
            gpu: self.gpu.clone(),
            cpu_why: self.cpu_why.clone(),
            fallback: self.fallback,
        }
    }

    /// The WebGPU adapter's description ("WebGPU: NAME (shader-f16)"), "" on the CPU path.
    #[wasm_bindgen(getter)]
    pub fn adapter(&self) -> String {
        self.gpu.as_deref().map(adapter_name).unwrap_or_default()
    }

    /// "webgpu" or "cpu".
    #[wasm_bindgen(getter)]
    pub fn backend(&self) -> String {
        if self.gpu.is_some() { "webgpu" } else { "cpu" }.into()
    }

    /// Whether a failure on WebGPU may fall back to the CPU path (the backend was "auto").
    #[wasm_bindgen(getter, js_name = cpuFallback)]
    pub fn cpu_fallback(&self) -> bool {
        self.fallback
    }

    /// The preflight's GPU part: a Promise of the decode speed this WebGPU device can expect
    /// for the model whose GGUF starts with `prefix` (`fileLen` bytes in all; the header whole,
    /// as `preflightGguf` asked for), `preflight::gpu_estimate`'s `{tokensPerSecond, shapeMs,
    /// bytesPerSecond, adapter}`. Rejects on the CPU path.
    #[wasm_bindgen(js_name = gpuEstimate)]
    pub fn gpu_estimate(&self, prefix: &[u8], file_len: f64) -> js_sys::Promise {
        use crate::preflight::{ModelPlan, PlanFromPrefix};
        let Some(ctx) = self.gpu.clone() else {
            return js_sys::Promise::reject(&JsError::new("gpuEstimate: not on WebGPU").into());
        };
        let plan = ModelPlan::from_prefix(prefix, file_len as usize);
        wasm_bindgen_futures::future_to_promise(async move {
            let plan = match plan.map_err(js_err)? {
                PlanFromPrefix::Plan(plan) => plan,
                PlanFromPrefix::NeedMore(n) => {
                    return Err(
                        JsError::new(&format!("gpuEstimate: the header needs {n} bytes")).into()
                    )
                }
            };
            let estimate = crate::preflight::gpu_estimate(&plan, ctx).await.map_err(js_err)?;
            Ok(js::to_js(&estimate)?)
        })
    }
}

/// "WebGPU: ADAPTER (shader-f16)": browsers often hide the adapter's name.
fn adapter_name(ctx: &GpuContext) -> String {
    let f16 = if ctx.shader_f16 { " (shader-f16)" } else { "" };
    match ctx.info.name.trim() {
        "" => format!("WebGPU{f16}"),
        adapter => format!("WebGPU: {adapter}{f16}"),
    }
}

/// Bytes of one piece of the download copied into wasm memory at a time on its way to the GPU.
const STAGING_BYTES: usize = 1 << 20;

/// A GGUF model streamed from its download straight into WebGPU buffers: each piece of the
/// download goes through a small staging buffer (at most 1 MiB) to the GPU, so the weights never
/// sit in wasm memory. The header is kept until it has been read (the tokenizer, the chat
/// template and the model's description are made from it as soon as it is whole, so a file that
/// is not a usable model fails in its first megabytes); the small vectors (norms, biases) wait
/// on the host until each is whole. A whole model in one file of known length: a split model,
/// or a download whose length is unknown, goes through a [`ByteSink`].
#[wasm_bindgen]
pub struct GgufStream {
    stream: GpuStream,
    detail: String,
    tokenizer_json: Option<Vec<u8>>,
    /// The tokenizer and chat template, made once the header has arrived.
    text: Option<GgufVocab>,
    max_seq: usize,
    staging: Vec<u8>,
    /// Why a piece was refused: the stream takes nothing more.
    failed: Option<String>,
}

#[wasm_bindgen]
impl GgufStream {
    /// A stream onto the WebGPU device of `choice` for a file of `size` bytes (its length must
    /// be known), with a `tokenizer.json`'s bytes or null (the GGUF's own tokenizer), and the
    /// load options (`maxSeq`).
    #[wasm_bindgen(constructor)]
    pub fn new(
        choice: &BackendChoice,
        size: f64,
        tokenizer: Option<Vec<u8>>,
        options: JsValue,
    ) -> Result<GgufStream, JsError> {
        let opts = LoadOptions::parse(options)?;
        let Some(ctx) = choice.gpu.clone() else {
            return Err(JsError::new(
                "a streamed load needs WebGPU; the CPU path loads from a ByteSink",
            ));
        };
        if !(size.is_finite() && size >= 0.0 && size.fract() == 0.0) {
            return Err(JsError::new(&format!("the model's size {size} is not a byte count")));
        }
        let detail = adapter_name(&ctx);
        let gpu_opts = GpuOptions::auto(&ctx);
        let stream = GpuStream::new(ctx, gpu_opts, size as usize).map_err(js_err)?;
        Ok(GgufStream {
            stream,
            detail,
            tokenizer_json: tokenizer.filter(|b| !b.is_empty()),
            text: None,
            max_seq: opts.max_seq.unwrap_or(2048).max(1),
            staging: Vec::new(),
            failed: None,
        })
    }

    /// The next piece of the file. Throws when the file is not a usable model (as soon as its
    /// header says so: "GGUF: ..." for the file, "tokenizer: ..." when only its tokenizer is
    /// missing or unsupported) or the GPU cannot take it ("model: GPU: ...").
    pub fn push(&mut self, chunk: &js_sys::Uint8Array) -> Result<(), JsError> {
        if let Some(why) = &self.failed {
            return Err(JsError::new(&format!("this load already failed: {why}")));
        }
        self.push_inner(chunk).map_err(|e| {
            let why = e.to_string();
            self.failed = Some(why.clone());
            JsError::new(&why)
        })
    }

    /// Bytes received so far.
    #[wasm_bindgen(getter)]
    pub fn received(&self) -> f64 {
        self.stream.received() as f64
    }

    /// The engine, once the whole file has arrived (an error if it ended early).
    pub async fn finish(self) -> Result<Engine, JsError> {
        let GgufStream { stream, detail, text, max_seq, failed, .. } = self;
        if let Some(why) = failed {
            return Err(JsError::new(&format!("this load already failed: {why}")));
        }
        let gpu = stream.finish().await.map_err(js_err)?.with_max_seq(max_seq);
        // Made with the header, which arrived (the stream would have said otherwise).
        let Some(text) = text else {
            return Err(JsError::new("the model's header never arrived"));
        };
        let loaded = Loaded::transformer(AnyModel::Gpu(gpu), text, detail);
        Ok(Engine::new(loaded, "streamed"))
    }
}

impl GgufStream {
    fn push_inner(&mut self, chunk: &js_sys::Uint8Array) -> crate::Result<()> {
        let len = chunk.length() as usize;
        let mut at = 0;
        while at < len {
            let n = STAGING_BYTES.min(len - at);
            self.staging.resize(n, 0);
            chunk.subarray(at as u32, (at + n) as u32).copy_to(&mut self.staging);
            at += n;
            if let Some(header) = self.stream.push(&self.staging)? {
                let model = self.stream.model().ok_or_else(|| {
                    Error::Input("the stream gave a header without the model".into())
                })?;
                let json = self.tokenizer_json.as_deref();
                self.text = Some(GgufVocab::read(&header, json)?.fitting(model.config.n_vocab)?);
            }
        }
        Ok(())
    }
}

/// A loaded model.
#[wasm_bindgen]
pub struct Engine {
    loaded: Loaded,
    info: InfoOut,
    /// The latest session's stepper: the next session takes over its KV cache and keeps the
    /// prefix the two prompts share (a chat's earlier turns, a branch's common start).
    latest: RefCell<Option<Slot>>,
    /// A smaller model with the same vocabulary that sampling runs guess with (speculative
    /// decoding), when one was given (`setDraft`).
    draft: RefCell<Option<Rc<AnyModel>>>,
}

/// What `info()` says of a loaded model: its kind, backend and shapes. `load_path`: how its
/// bytes arrived ("wasm": through wasm memory; "streamed": straight into GPU buffers).
fn describe(loaded: &Loaded, load_path: &'static str) -> InfoOut {
    let backend = backend_name(&loaded.model);
    let chat_template = loaded.template.as_ref().ok().map(|t| t.source().to_string());
    let tool_format = loaded.template.as_ref().ok().and_then(ChatTemplate::tool_format);
    let detail = loaded.backend.clone();
    let model = match &*loaded.model {
        AnyModel::Table(table) => {
            return InfoOut {
                kind: "table",
                backend,
                backend_detail: detail,
                name: table.name().to_string(),
                description: table.description().to_string(),
                arch: "bigram table".into(),
                n_vocab: table.vocab_size(),
                n_ctx: table.context_length(),
                n_layer: 0,
                n_embd: 0,
                parameters: table.vocab_size() * table.vocab_size(),
                bytes: 0,
                weight_bytes_per_token: 0,
                words: table.words().to_vec(),
                chat_template,
                tool_format,
                weights_in_wasm_bytes: 0,
                load_path: "",
                draft_parameters: None,
            };
        }
        AnyModel::Cpu(m) => &m.model,
        AnyModel::Gpu(m) => &m.model,
    };
    let c = &model.config;
    InfoOut {
        chat_template,
        tool_format,
        kind: "gguf",
        backend,
        backend_detail: detail,
        name: String::new(),
        description: String::new(),
        arch: c.arch.gguf_name().to_string(),
        n_vocab: c.n_vocab,
        n_ctx: c.n_ctx,
        n_layer: c.n_layer,
        n_embd: c.n_embd,
        parameters: model.parameter_count(),
        bytes: model.file_len(),
        weight_bytes_per_token: model.weight_bytes_per_token(),
        words: Vec::new(),
        weights_in_wasm_bytes: model.held_bytes(),
        load_path,
        draft_parameters: None,
    }
}

/// Open the browser's WebGPU, or say why not.
async fn webgpu() -> Result<std::sync::Arc<GpuContext>, String> {
    if !wgpu::util::is_browser_webgpu_supported().await {
        return Err("this browser has no WebGPU adapter (navigator.gpu missing or requestAdapter() gave none)".into());
    }
    GpuContext::new_async().await.map_err(|e| e.to_string())
}

/// The promise `Engine::score` returns: the chain rule on `text`, or with `after`, on `text` as
/// the continuation of the prefix `after` (only its tokens are scored).
fn score_promise(
    model: Rc<AnyModel>,
    vocab: Rc<dyn crate::Vocab>,
    text: String,
    after: Option<String>,
) -> js_sys::Promise {
    wasm_bindgen_futures::future_to_promise(async move {
        let scored = async {
            let (ids, context) = match &after {
                None => (prompt_ids(model.bos_token(), &*vocab, &text)?, 1),
                Some(prefix) => continuation_ids(model.bos_token(), &*vocab, prefix, &text)?,
            };
            let score = crate::generate::score_async(&*model, &ids).await?;
            // Token i + 1 is scored by token_logprobs[i]: keep those of the continuation, with
            // the last token of the context before them (unscored), as `score_out` expects.
            let mine = Score::from_logprobs(score.token_logprobs[context - 1..].to_vec());
            let backend = backend_name(&model);
            Ok::<_, crate::Error>(js::score_out(&*vocab, &ids[context - 1..], &mine, backend))
        };
        let out = scored.await.map_err(js_err)?;
        Ok(js::to_js(&out)?)
    })
}

impl Engine {
    fn new(loaded: Loaded, load_path: &'static str) -> Engine {
        let info = describe(&loaded, load_path);
        Engine { loaded, info, latest: RefCell::new(None), draft: RefCell::new(None) }
    }

    fn template(&self) -> Result<&ChatTemplate, JsError> {
        self.loaded.template().map_err(js_err)
    }

    /// The model on WebGPU, `None` on the other backends.
    fn gpu(&self) -> Option<&GpuModel> {
        self.loaded.model.gpu()
    }

    /// A session over `ids` that takes over the latest session's KV cache (that session ends).
    fn start_ids(&self, ids: &[u32], opts: &GenOptions, stops: &[u32]) -> Result<Session, JsError> {
        let vocab = self.loaded.vocab.clone();
        // Taken even if this start fails: the old session's state may be cut back already.
        let previous = self.latest.borrow_mut().take().and_then(|slot| slot.borrow_mut().take());
        let model = &self.loaded.model;
        let draft = self.draft.borrow();
        let gen =
            Stepper::start_after(model, draft.as_ref(), vocab.clone(), ids, opts, previous, stops)
                .map_err(js_err)?;
        let session = Session::new(gen, vocab, ids.to_vec());
        *self.latest.borrow_mut() = Some(session.slot());
        Ok(session)
    }
}

#[wasm_bindgen]
impl Engine {
    /// A lesson table model from its JSON text.
    #[wasm_bindgen(js_name = loadTable)]
    pub fn load_table(json: &str) -> Result<Engine, JsError> {
        let table = TableModel::from_json(json).map_err(js_err)?;
        let mut engine = Engine::new(Loaded::table(table), "");
        engine.info.bytes = json.len();
        Ok(engine)
    }

    /// A GGUF model (its bytes, collected in `sink`, which this consumes) and its
    /// `tokenizer.json`, or null/undefined/empty bytes for the tokenizer the GGUF's own metadata
    /// describes. Options: `backend` ("auto" | "gpu" | "cpu"), `maxSeq`, `exact` (CPU path: the
    /// reference kernels instead of the fast ones), `threads`. `choice`: the backend chosen
    /// before the download ([`BackendChoice::choose`]), or undefined to choose now by `backend`.
    /// On WebGPU the bytes are uploaded, then released.
    #[wasm_bindgen(js_name = loadGguf)]
    pub async fn load_gguf(
        sink: ByteSink,
        tokenizer: Option<Vec<u8>>,
        options: JsValue,
        choice: Option<BackendChoice>,
    ) -> Result<Engine, JsError> {
        let opts = LoadOptions::parse(options.clone())?;
        let choice = match choice {
            Some(choice) => choice,
            None => BackendChoice::choose(options).await?,
        };
        // The header once: for the tokenizer, the chat template and the model.
        let header = Gguf::parse(&sink.buf).map_err(js_err)?;
        let json = tokenizer.filter(|b| !b.is_empty());
        let text = GgufVocab::read(&header, json.as_deref()).map_err(js_err)?;
        let model = Model::from_bytes_parsed(sink.buf, header).map_err(js_err)?;
        let text = text.fitting(model.config.n_vocab).map_err(js_err)?;
        let max_seq = opts.max_seq.unwrap_or(2048).max(1);
        let cpu = CpuSettings {
            precision: if opts.exact { Precision::Exact } else { Precision::Fast },
            threads: opts.threads.unwrap_or(usize::MAX).clamp(1, crate::cpu::browser_threads()),
            isa: None,
        };
        let on_cpu = |model: Model, why: &str, text: GgufVocab| {
            let reason = format!("{why} (WebAssembly, {})", cpu.describe());
            let loaded =
                Loaded::transformer(AnyModel::Cpu(cpu.model(model, max_seq)), text, reason);
            Engine::new(loaded, "wasm")
        };
        let Some(ctx) = choice.gpu else {
            return Ok(on_cpu(model, &choice.cpu_why, text));
        };
        let name = adapter_name(&ctx);
        let fallback = choice.fallback.then(|| model.share());
        match GpuModel::with_context(ctx, model).await {
            Ok(gpu) => {
                let gpu = AnyModel::Gpu(gpu.with_max_seq(max_seq));
                Ok(Engine::new(Loaded::transformer(gpu, text, name), "wasm"))
            }
            Err(e) => match fallback {
                Some(model) => {
                    Ok(on_cpu(model, &format!("WebGPU failed ({e}); running on the CPU"), text))
                }
                None => Err(js_err(e)),
            },
        }
    }

    /// Another engine over this one's model: the same weights (nothing is copied) and draft
    /// model, its own KV cache. Each page or element that uses one loaded model holds its own
    /// share (the shared worker's one copy for every tab), so one's generations never cut back
    /// another's cache; the weights go when the last share is freed.
    pub fn share(&self) -> Engine {
        Engine {
            loaded: self.loaded.clone(),
            info: self.info.clone(),
            latest: RefCell::new(None),
            draft: RefCell::new(self.draft.borrow().clone()),
        }
    }

    /// What was loaded: kind, backend (and why), architecture, sizes; table models' words.
    pub fn info(&self) -> Result<JsValue, JsError> {
        js::to_js(&self.info)
    }

    /// How the CPU path's decode steps walk the weight rows: "tiles" (adjacent), "streams"
    /// (spread tiles), or "timing" while the first decode steps still time both (`cpu::walk`);
    /// `undefined` off the CPU path.
    /// Guess with `draft`'s model (speculative decoding): a GGUF model with this one's
    /// vocabulary, usually much smaller. Sampling runs then verify its guesses several per
    /// forward pass (`draft: false` in a run's options turns it off); the output is this model's.
    /// `draft` itself may be freed after.
    #[wasm_bindgen(js_name = setDraft)]
    pub fn set_draft(&mut self, draft: &Engine) -> Result<(), JsError> {
        let (main, guesser) = (&self.loaded.model, &draft.loaded.model);
        if matches!(**main, AnyModel::Table(_)) || matches!(**guesser, AnyModel::Table(_)) {
            return Err(JsError::new(
                "a draft model speeds up a GGUF model with another GGUF model",
            ));
        }
        if guesser.vocab_size() != main.vocab_size() || guesser.bos_token() != main.bos_token() {
            return Err(JsError::new(&format!(
                "the draft model's vocabulary ({} tokens, BOS {:?}) is not the model's ({} tokens, \
                 BOS {:?}): a draft model must share the model's tokenizer",
                guesser.vocab_size(),
                guesser.bos_token(),
                main.vocab_size(),
                main.bos_token()
            )));
        }
        self.info.draft_parameters = Some(draft.info.parameters);
        *self.draft.borrow_mut() = Some(guesser.clone());
        Ok(())
    }

    #[wasm_bindgen(js_name = decodeWalk)]
    pub fn decode_walk(&self) -> Option<String> {
        match &*self.loaded.model {
            AnyModel::Cpu(m) => Some(
                match m.decode_in_streams() {
                    None => "timing",
                    Some(true) => "streams",
                    Some(false) => "tiles",
                }
                .into(),
            ),
            _ => None,
        }
    }

    /// The WebGPU kernels' times in one decode step after `context` positions, per kernel
    /// family (`[{kernel, dispatches, micros, bytes}]`, as `nexttoken bench --profile`), on a
    /// state of its own (the sessions' caches untouched). A Promise of `null` off WebGPU or where
    /// the browser does not expose `timestamp-query`.
    #[wasm_bindgen(js_name = gpuProfile)]
    pub fn gpu_profile(&self, context: usize) -> js_sys::Promise {
        if self.gpu().is_none() {
            return js_sys::Promise::resolve(&JsValue::NULL);
        }
        let model = self.loaded.model.clone();
        wasm_bindgen_futures::future_to_promise(async move {
            let m = model.gpu().ok_or_else(|| JsError::new("not on WebGPU"))?;
            let context = context.clamp(1, m.context_length().saturating_sub(1).max(1));
            let vocab = m.vocab_size();
            if vocab <= 3 {
                return Err(JsError::new(
                    "gpuProfile: the model's vocabulary has 3 tokens or fewer",
                )
                .into());
            }
            let ids: Vec<u32> =
                (0..=context).map(|i| crate::timing::bench_token(i, vocab)).collect();
            match m.profile_after_async(&ids, context).await.map_err(js_err)? {
                Some(rows) => Ok(js::to_js(&rows)?),
                None => Ok(JsValue::NULL),
            }
        })
    }

    /// `backend: "auto"` on WebGPU, once the model is loaded there: the GPU checked against the
    /// CPU oracle on a tiny model shaped like this one (rejects, naming the adapter, when it
    /// computes wrongly), then a few decode steps timed against the CPU path's estimate (the
    /// model's bytes per token over the CPU kernels' rate, measured now with `exact` and
    /// `threads` as a CPU load would run). A Promise of `{gpu, reason, gpuMsPerToken,
    /// cpuMsPerToken, cpuEstimated, check}`: `gpu` false means the CPU path is faster here.
    #[wasm_bindgen(js_name = autoVerdict)]
    pub fn auto_verdict(&self, exact: bool, threads: usize) -> js_sys::Promise {
        if self.gpu().is_none() {
            return js_sys::Promise::reject(&JsError::new("autoVerdict: not on WebGPU").into());
        }
        let model = self.loaded.model.clone();
        let precision = if exact { Precision::Exact } else { Precision::Fast };
        let threads = threads.clamp(1, crate::cpu::browser_threads());
        wasm_bindgen_futures::future_to_promise(async move {
            let m = model.gpu().ok_or_else(|| JsError::new("not on WebGPU"))?;
            let cpu_ms = || {
                let rate = backend::cpu_decode_rate(&m.model, precision, threads)?;
                Ok((m.model.weight_bytes_per_token() as f64 / rate * 1e3, true))
            };
            let verdict = backend::verdict(m, cpu_ms).await.map_err(js_err)?;
            Ok(js::to_js(&verdict)?)
        })
    }

    /// Destroy this model's WebGPU device, as a driver reset would lose it (every later use errs
    /// with "GPU device lost"): for tests of the fallback to the CPU path. Nothing off WebGPU.
    #[wasm_bindgen(js_name = simulateGpuLoss)]
    pub fn simulate_gpu_loss(&self) {
        if let Some(m) = self.gpu() {
            m.context().simulate_device_loss();
        }
    }

    /// The load-time check alone (`autoVerdict`'s first part): a Promise of `{maxError,
    /// tolerance, rows}`, rejected with a message naming the adapter when the GPU computes
    /// wrongly. For a model whose backend was decided before (a remembered verdict, or
    /// `backend: "gpu"`).
    #[wasm_bindgen(js_name = checkGpu)]
    pub fn check_gpu(&self) -> js_sys::Promise {
        if self.gpu().is_none() {
            return js_sys::Promise::reject(&JsError::new("checkGpu: not on WebGPU").into());
        }
        let model = self.loaded.model.clone();
        wasm_bindgen_futures::future_to_promise(async move {
            let m = model.gpu().ok_or_else(|| JsError::new("not on WebGPU"))?;
            let checked = m.check_against_cpu().await.map_err(js_err)?;
            Ok(js::to_js(&checked)?)
        })
    }

    fn bos(&self) -> Option<u32> {
        self.loaded.model.bos_token()
    }

    /// Token ids of `text` (no BOS).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, JsError> {
        self.loaded.vocab.encode(text).map_err(js_err)
    }

    /// Display form of one token.
    #[wasm_bindgen(js_name = tokenText)]
    pub fn token_text(&self, id: u32) -> String {
        self.loaded.vocab.token_text(id)
    }

    /// Start generating a continuation of `prompt`. Options (all optional): `maxTokens`,
    /// `temperature` (0 = greedy), `topK`, `topP`, `minP`, `repeatPenalty`, `repeatWindow`,
    /// `seed`, `stop` (strings), `topLogprobs` (alternatives reported per token, default 5, at
    /// most 20), `beams` (> 1: beam search, run on the first `next()`, then its best beam is
    /// replayed token by token), `lengthNormalise`, `forceTokens`, `keepCandidates`,
    /// `constraint` (structured output: `{type: "json_schema", schema}`, `{type:
    /// "json_object"}`, `{type: "regex", pattern}` or `{type: "grammar", lark}`; see
    /// ARCHITECTURE.md) and `constraintPrefix`. The KV cache of the previous generation is
    /// kept for the prefix the two prompts share (`reusedTokens` in the summary); that
    /// generation ends.
    pub fn start(&self, prompt: &str, options: JsValue) -> Result<Session, JsError> {
        let opts = GenOptions::parse(options)?;
        let ids = prompt_ids(self.bos(), &*self.loaded.vocab, prompt).map_err(js_err)?;
        self.start_ids(&ids, &opts, &[])
    }

    /// Start generating after the token ids `ids` (as they are: no BOS is added), e.g. a
    /// branch: the ids a session gave (`promptIds`, then its tokens up to a position) with
    /// another token at the end. Options as `start`; the KV cache of the prefix these ids share
    /// with the previous generation's is reused (only the branch's new tokens are computed).
    #[wasm_bindgen(js_name = startIds)]
    pub fn start_ids_js(&self, ids: Vec<u32>, options: JsValue) -> Result<Session, JsError> {
        let opts = GenOptions::parse(options)?;
        self.start_ids(&ids, &opts, &[])
    }

    /// Start the assistant's reply to `messages` (`[{role, content}]`, OpenAI's shape), rendered
    /// by the model's chat template; it ends at the template's end-of-turn token. Options: as
    /// `start`, and `dropOldest` (a conversation too long for the context loses its oldest turns,
    /// see `messages` on the session, instead of failing). Only the tokens after the prefix the
    /// previous generation's cache shares are prefilled: earlier turns are reused.
    #[wasm_bindgen(js_name = startChat)]
    pub fn start_chat(&self, messages: JsValue, options: JsValue) -> Result<Session, JsError> {
        let mut template = std::borrow::Cow::Borrowed(self.template()?);
        let mut messages = js::messages(messages)?;
        let mut opts = GenOptions::parse(options.clone())?;
        let context = self.loaded.model.context_length();
        let chat = ChatOptions::parse(options)?;
        // Tools: given to the template; a forced call generated under its grammar; the reply's
        // calls read back (`Session.reply`).
        let mut tool_format = None;
        if let (Some(tools), Some(forced)) =
            (chat.tools.filter(|t| !t.is_empty()), js::tool_choice(chat.tool_choice.as_ref())?)
        {
            let parallel = chat.parallel_tool_calls.unwrap_or(true);
            let (offered, format, constraint) =
                crate::tools::offer(template.into_owned(), tools, forced.as_ref(), parallel)
                    .map_err(js_err)?;
            if let Some(constraint) = constraint {
                opts.force_constraint(constraint)?;
            }
            tool_format = Some(format);
            template = std::borrow::Cow::Owned(offered);
        }
        let overflow =
            Overflow::for_reply(chat.drop_oldest, opts.generate_options().max_tokens, context);
        let vocab = self.loaded.vocab.clone();
        let (ids, _) = fit_prompt(&template, &*vocab, self.bos(), &mut messages, context, overflow)
            .map_err(js_err)?;
        let session = self.start_ids(&ids, &opts, template.stop_tokens())?.with_messages(messages);
        Ok(session.with_tool_format(tool_format))
    }

    /// The prompt text the chat template makes of `messages` (with the assistant turn's opening
    /// when `addGenerationPrompt`): what the model reads.
    #[wasm_bindgen(js_name = renderChat)]
    pub fn render_chat(
        &self,
        messages: JsValue,
        add_generation_prompt: bool,
    ) -> Result<String, JsError> {
        let messages = js::messages(messages)?;
        self.template()?.render(&messages, add_generation_prompt).map_err(js_err)
    }

    /// The chain rule on `text`: each token's probability given the tokens before it, the
    /// total log P, average negative log-likelihood and perplexity, and the `backend` that
    /// computed them. The first token (BOS, or the first word when there is none) is the
    /// context and is not scored. With `after` (a prefix), `text` is scored as its
    /// continuation: P(text | after), only the continuation's tokens (candidates compared after
    /// one prefix). Returns a Promise (the WebGPU forward pass is asynchronous).
    pub fn score(&self, text: &str, after: Option<String>) -> js_sys::Promise {
        score_promise(self.loaded.model.clone(), self.loaded.vocab.clone(), text.into(), after)
    }
}
