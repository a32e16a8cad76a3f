//! The browser API (wasm-bindgen), used by `www/worker.js` through `www/nexttoken.js`.
//!
//! ```js
//! const sink = new ByteSink(totalBytes);          // the model's bytes go straight into wasm memory
//! for await (const chunk of download) sink.push(chunk);
//! const engine = await Engine.loadGguf(sink, tokenizerBytes, { backend: "auto", maxSeq: 2048 });
//! // or: Engine.loadTable(jsonText)
//! const session = engine.start("Once upon a time", { temperature: 0, maxTokens: 32 });
//! let t; while ((t = await session.next()) !== null) console.log(t.text, t.prob, t.top);
//! session.summary();   // prompt/generated tokens, prefill/decode ms and tok/s, TTFT, stop reason
//! engine.score("the cat sat");
//! ```
//!
//! A GGUF file is passed as a [`ByteSink`] that the download fills chunk by chunk, so the bytes
//! exist once (in wasm memory) rather than once in JS and once in wasm; `Model::from_bytes`
//! then takes that `Vec<u8>` by value and never copies it.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

use serde::{Deserialize, Serialize};
use wasm_bindgen::prelude::*;

use crate::cpu::{kernels::Isa, CpuModel, Precision};
use crate::generate::{
    self, BeamOptions, GenerateOptions, Generation, GenerationSummary, StopReason, TokenEvent,
};
use crate::gpu::{GpuContext, GpuModel};
use crate::model::Model;
use crate::sampling::{log_softmax_at, logsumexp, top_n, SamplerConfig};
use crate::table::TableModel;
use crate::tokenizer::HfTokenizer;
use crate::{Error, LanguageModel, Vocab};

#[wasm_bindgen(start)]
pub fn start() {
    console_error_panic_hook::set_once();
}

#[wasm_bindgen]
extern "C" {
    /// `performance.now()`: present on window and worker globals alike.
    #[wasm_bindgen(js_namespace = performance, js_name = now)]
    fn performance_now() -> f64;
}

fn clock() -> f64 {
    performance_now()
}

fn js_err(e: Error) -> JsError {
    JsError::new(&e.to_string())
}

fn to_js<T: Serialize>(value: &T) -> Result<JsValue, JsError> {
    value
        .serialize(&serde_wasm_bindgen::Serializer::json_compatible())
        .map_err(|e| JsError::new(&format!("cannot convert to JS: {e}")))
}

/// The library's version (Cargo.toml), for cache keys and the page's footer.
#[wasm_bindgen]
pub fn version() -> String {
    env!("CARGO_PKG_VERSION").to_string()
}

/// This build's fastest CPU kernels (simd128 in the `+simd128` build) against the scalar oracle
/// on random rows: `cargo test` cannot run wasm kernels, so the browser tests call this. Returns
/// a one-line summary naming the instruction set, or throws the first mismatch.
#[wasm_bindgen(js_name = kernelSelfTest)]
pub fn kernel_self_test() -> Result<String, JsError> {
    let isa = crate::cpu::kernels::Isa::detect();
    crate::cpu::kernels::check_isa_against_scalar(isa, 1).map_err(|e| JsError::new(&e))
}

/// Whether this is the threads build (nightly, +atomics: its memory is a SharedArrayBuffer, so
/// it only loads on a cross-origin isolated page), which can run the CPU path on several cores.
#[wasm_bindgen(js_name = threadsBuild)]
pub fn threads_build() -> bool {
    cfg!(target_feature = "atomics")
}

/// Threads build: start `n` Web Workers sharing this module's memory, as the CPU path's thread
/// pool. Call once, before loading a model. Resolves to the pool's size.
#[cfg(target_feature = "atomics")]
#[wasm_bindgen(js_name = initThreads)]
pub async fn init_threads(n: usize) -> Result<usize, JsValue> {
    let n = n.max(1);
    wasm_bindgen_futures::JsFuture::from(wasm_bindgen_rayon::init_thread_pool(n)).await?;
    crate::cpu::BROWSER_THREADS.store(n, std::sync::atomic::Ordering::Relaxed);
    Ok(n)
}

/// Bytes per second of a `mib` MiB copy inside wasm memory (bytes read plus bytes written), best
/// of 5: the browser bench's reference for the bandwidth a decode step reaches.
#[wasm_bindgen(js_name = memcpyBandwidth)]
pub fn memcpy_bandwidth(mib: usize) -> f64 {
    let n = mib.max(1) << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = clock();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        best = best.min((clock() - t) / 1000.0);
    }
    2.0 * n as f64 / best.max(1e-9)
}

/// Bytes of wasm memory (it only grows: this is the peak the module has used).
#[wasm_bindgen(js_name = wasmMemoryBytes)]
pub fn wasm_memory_bytes() -> f64 {
    (core::arch::wasm32::memory_size(0) * 65536) as f64
}

// ---------------------------------------------------------------------------------------------
// Bytes in

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
        let mut buf = Vec::new();
        if capacity > 0.0 {
            buf.try_reserve_exact(capacity as usize).map_err(|_| {
                JsError::new(&format!(
                    "out of memory: cannot allocate {:.0} MB for the model in WebAssembly memory (the limit is 4 GB, and the browser may allow less)",
                    capacity / 1e6
                ))
            })?;
        }
        Ok(ByteSink { buf })
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

// ---------------------------------------------------------------------------------------------
// Options

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct LoadOptions {
    /// "auto" (WebGPU when the browser has an adapter, else CPU), "gpu" or "cpu".
    backend: Option<String>,
    /// Cap on the sequence length (models advertise far more than a page needs).
    max_seq: Option<usize>,
    /// CPU path: true for the exact reference (f32 activations) instead of the fast one (int8
    /// dot products, simd128). For comparing against the oracle; slower.
    exact: bool,
    /// CPU threads (threads build, after `initThreads`): default and cap, the pool's size.
    threads: Option<usize>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct GenOptions {
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
}

impl GenOptions {
    fn parse(options: JsValue) -> Result<GenOptions, JsError> {
        if options.is_undefined() || options.is_null() {
            return Ok(GenOptions::default());
        }
        serde_wasm_bindgen::from_value(options)
            .map_err(|e| JsError::new(&format!("bad generation options: {e}")))
    }

    fn generate_options(&self) -> GenerateOptions {
        let d = SamplerConfig::default();
        GenerateOptions {
            max_tokens: self.max_tokens.unwrap_or(256),
            sampler: SamplerConfig {
                temperature: self.temperature.unwrap_or(d.temperature),
                top_k: self.top_k.unwrap_or(d.top_k),
                top_p: self.top_p.unwrap_or(d.top_p),
                min_p: self.min_p.unwrap_or(d.min_p),
                repeat_penalty: self.repeat_penalty.unwrap_or(d.repeat_penalty),
                repeat_window: self.repeat_window.unwrap_or(d.repeat_window),
                seed: self.seed.map_or(d.seed, |s| s.max(0.0) as u64),
            },
            stop_strings: self.stop.iter().filter(|s| !s.is_empty()).cloned().collect(),
            ..GenerateOptions::default()
        }
    }
}

// ---------------------------------------------------------------------------------------------
// JS shapes

#[derive(Serialize)]
struct TopOut {
    id: u32,
    token: String,
    prob: f32,
}

#[derive(Serialize)]
struct TokenOut {
    id: u32,
    /// What the token adds to the text.
    text: String,
    /// The token as the vocabulary spells it ("▁cat", "<0x0A>").
    token: String,
    prob: f32,
    logprob: f32,
    top: Vec<TopOut>,
    position: usize,
}

fn token_out(vocab: &dyn Vocab, ev: TokenEvent) -> TokenOut {
    TokenOut {
        id: ev.id,
        token: vocab.token_text(ev.id),
        text: ev.text,
        prob: ev.prob,
        logprob: ev.logprob,
        top: ev
            .top
            .iter()
            .map(|&(id, prob)| TopOut { id, token: vocab.token_text(id), prob })
            .collect(),
        position: ev.position,
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct SummaryOut {
    prompt_tokens: usize,
    generated_tokens: usize,
    text: String,
    stop_reason: String,
    prefill_ms: f64,
    decode_ms: f64,
    ttft_ms: f64,
    prefill_tok_s: f64,
    decode_tok_s: f64,
}

fn per_second(tokens: usize, ms: f64) -> f64 {
    if ms > 0.0 {
        tokens as f64 * 1000.0 / ms
    } else {
        0.0
    }
}

fn summary_out(s: GenerationSummary) -> SummaryOut {
    SummaryOut {
        prompt_tokens: s.prompt_tokens,
        generated_tokens: s.generated_tokens,
        stop_reason: format!("{:?}", s.stop_reason),
        prefill_tok_s: per_second(s.prompt_tokens, s.prefill_ms),
        decode_tok_s: per_second(s.generated_tokens.saturating_sub(1), s.decode_ms),
        text: s.text,
        prefill_ms: s.prefill_ms,
        decode_ms: s.decode_ms,
        ttft_ms: s.ttft_ms,
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct InfoOut {
    /// "table" or "gguf".
    kind: &'static str,
    /// "table", "cpu" or "webgpu".
    backend: &'static str,
    /// Adapter name for WebGPU; why WebGPU was not used, for a CPU fallback.
    backend_detail: String,
    name: String,
    description: String,
    arch: String,
    n_vocab: usize,
    n_ctx: usize,
    n_layer: usize,
    n_embd: usize,
    parameters: usize,
    bytes: usize,
    /// Weight bytes one decode step reads (for the bench's bandwidth figure).
    weight_bytes_per_token: usize,
    /// Table models: their words, in id order.
    words: Vec<String>,
}

// ---------------------------------------------------------------------------------------------
// Engine

enum Loaded {
    Table(Rc<TableModel>),
    Cpu(Rc<CpuModel>, Rc<HfTokenizer>),
    /// The GPU model, plus a CPU view of the same bytes for what needs a synchronous forward
    /// pass (beam search, scoring).
    Gpu(Rc<GpuModel>, Rc<CpuModel>, Rc<HfTokenizer>),
}

/// A loaded model.
#[wasm_bindgen]
pub struct Engine {
    loaded: Loaded,
    info: InfoOut,
}

fn load_options(options: JsValue) -> Result<LoadOptions, JsError> {
    if options.is_undefined() || options.is_null() {
        return Ok(LoadOptions::default());
    }
    serde_wasm_bindgen::from_value(options)
        .map_err(|e| JsError::new(&format!("bad load options: {e}")))
}

fn gguf_info(model: &Model, backend: &'static str, detail: String) -> InfoOut {
    let c = &model.config;
    InfoOut {
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
        bytes: model.storage.len(),
        weight_bytes_per_token: model.weight_bytes_per_token(),
        words: Vec::new(),
    }
}

/// What the CPU path computes with, for the backend description.
fn cpu_kernels(precision: Precision, threads: usize) -> String {
    let threads = if threads == 1 { "1 thread".to_string() } else { format!("{threads} threads") };
    match precision {
        Precision::Exact => format!("exact reference kernels, {threads}"),
        Precision::Fast => format!("{} int8 kernels, {threads}", Isa::detect().name()),
    }
}

/// A second description of the same bytes (no copy: the storage is shared).
fn share(model: &Model) -> Model {
    Model {
        config: model.config.clone(),
        weights: model.weights.clone(),
        rope: model.rope.clone(),
        storage: model.storage.clone(),
        tensors: model.tensors.clone(),
    }
}

/// Open the browser's WebGPU, or say why not.
async fn webgpu() -> Result<std::sync::Arc<GpuContext>, String> {
    if !wgpu::util::is_browser_webgpu_supported().await {
        return Err("this browser has no WebGPU adapter (navigator.gpu missing or requestAdapter() gave none)".into());
    }
    GpuContext::new_async().await.map_err(|e| e.to_string())
}

#[wasm_bindgen]
impl Engine {
    /// A lesson table model from its JSON text.
    #[wasm_bindgen(js_name = loadTable)]
    pub fn load_table(json: &str) -> Result<Engine, JsError> {
        let table = TableModel::from_json(json).map_err(js_err)?;
        let info = InfoOut {
            kind: "table",
            backend: "table",
            backend_detail: "a lookup table: no matrix math".into(),
            name: table.name().to_string(),
            description: table.description().to_string(),
            arch: "bigram table".into(),
            n_vocab: table.vocab_size(),
            n_ctx: table.context_length(),
            n_layer: 0,
            n_embd: 0,
            parameters: table.vocab_size() * table.vocab_size(),
            bytes: json.len(),
            weight_bytes_per_token: 0,
            words: table.words().to_vec(),
        };
        Ok(Engine { loaded: Loaded::Table(Rc::new(table)), info })
    }

    /// A GGUF model (its bytes, collected in `sink`, which this consumes) and its
    /// `tokenizer.json`. Options: `backend` ("auto" | "gpu" | "cpu"), `maxSeq`, `exact` (CPU path:
    /// the reference kernels instead of the fast ones).
    #[wasm_bindgen(js_name = loadGguf)]
    pub async fn load_gguf(
        sink: ByteSink,
        tokenizer: Vec<u8>,
        options: JsValue,
    ) -> Result<Engine, JsError> {
        let opts = load_options(options)?;
        let tokenizer = Rc::new(HfTokenizer::from_bytes(&tokenizer).map_err(js_err)?);
        let model = Model::from_bytes(sink.buf).map_err(js_err)?;
        if tokenizer.vocab_size() > model.config.n_vocab {
            // More tokenizer ids than logits: a mismatched pair; ids past n_vocab would fail later.
            web_sys::console::warn_1(&JsValue::from_str(&format!(
                "tokenizer has {} tokens, the model {}: are they from the same model?",
                tokenizer.vocab_size(),
                model.config.n_vocab
            )));
        }
        let max_seq = opts.max_seq.unwrap_or(2048).max(1);
        let backend = opts.backend.as_deref().unwrap_or("auto");
        let precision = if opts.exact { Precision::Exact } else { Precision::Fast };
        let threads = opts.threads.unwrap_or(usize::MAX).clamp(1, crate::cpu::browser_threads());
        let cpu_model = |m: Model| {
            CpuModel::new(m).with_precision(precision).with_threads(threads).with_max_seq(max_seq)
        };
        let mut fallback_reason =
            format!("CPU backend chosen ({})", cpu_kernels(precision, threads));
        if backend != "cpu" {
            match webgpu().await {
                Ok(ctx) => {
                    // Browsers often hide the adapter's name.
                    let name = match (ctx.info.name.trim(), ctx.shader_f16) {
                        ("", f16) => format!("WebGPU{}", if f16 { " (shader-f16)" } else { "" }),
                        (n, f16) => {
                            format!("WebGPU: {n}{}", if f16 { " (shader-f16)" } else { "" })
                        }
                    };
                    let cpu_view = share(&model);
                    match GpuModel::with_context(ctx, model).await {
                        Ok(gpu) => {
                            let gpu = gpu.with_max_seq(max_seq);
                            let info = gguf_info(&gpu.model, "webgpu", name);
                            let cpu = cpu_model(cpu_view);
                            return Ok(Engine {
                                loaded: Loaded::Gpu(Rc::new(gpu), Rc::new(cpu), tokenizer),
                                info,
                            });
                        }
                        Err(e) if backend == "gpu" => return Err(js_err(e)),
                        Err(e) => {
                            fallback_reason = format!(
                                "WebGPU failed ({e}); running on the CPU ({})",
                                cpu_kernels(precision, threads)
                            );
                            let cpu = cpu_model(cpu_view);
                            let info = gguf_info(&cpu.model, "cpu", fallback_reason);
                            return Ok(Engine {
                                loaded: Loaded::Cpu(Rc::new(cpu), tokenizer),
                                info,
                            });
                        }
                    }
                }
                Err(e) if backend == "gpu" => return Err(JsError::new(&e)),
                Err(e) => {
                    fallback_reason = format!(
                        "{e}; running on the CPU (WebAssembly, {})",
                        cpu_kernels(precision, threads)
                    )
                }
            }
        }
        let cpu = cpu_model(model);
        let info = gguf_info(&cpu.model, "cpu", fallback_reason);
        Ok(Engine { loaded: Loaded::Cpu(Rc::new(cpu), tokenizer), info })
    }

    /// What was loaded: kind, backend (and why), architecture, sizes; table models' words.
    pub fn info(&self) -> Result<JsValue, JsError> {
        to_js(&self.info)
    }

    fn vocab(&self) -> Rc<dyn Vocab> {
        match &self.loaded {
            Loaded::Table(t) => t.clone(),
            Loaded::Cpu(_, tok) | Loaded::Gpu(_, _, tok) => tok.clone(),
        }
    }

    fn bos(&self) -> Option<u32> {
        match &self.loaded {
            Loaded::Table(t) => t.bos_token(),
            Loaded::Cpu(m, _) => m.bos_token(),
            Loaded::Gpu(m, _, _) => m.bos_token(),
        }
    }

    /// BOS (when the model wants one) followed by the text's tokens.
    fn prompt_ids(&self, text: &str) -> Result<Vec<u32>, JsError> {
        let mut ids: Vec<u32> = self.bos().into_iter().collect();
        ids.extend(self.vocab().encode(text).map_err(js_err)?);
        if ids.is_empty() {
            return Err(JsError::new(
                "the prompt is empty and the model has no BOS token to start from",
            ));
        }
        Ok(ids)
    }

    /// Token ids of `text` (no BOS).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, JsError> {
        self.vocab().encode(text).map_err(js_err)
    }

    /// Display form of one token.
    #[wasm_bindgen(js_name = tokenText)]
    pub fn token_text(&self, id: u32) -> String {
        self.vocab().token_text(id)
    }

    /// Start generating a continuation of `prompt`. Options (all optional): `maxTokens`,
    /// `temperature` (0 = greedy), `topK`, `topP`, `minP`, `repeatPenalty`, `repeatWindow`,
    /// `seed`, `stop` (strings), `beams` (> 1: beam search, then its best beam is replayed
    /// token by token), `lengthNormalise`.
    pub fn start(&self, prompt: &str, options: JsValue) -> Result<Session, JsError> {
        let opts = GenOptions::parse(options)?;
        let ids = self.prompt_ids(prompt)?;
        let vocab = self.vocab();
        let beams = opts.beams.unwrap_or(1);
        let gen_opts = opts.generate_options();
        let gen = if beams > 1 {
            let beam_opts = BeamOptions {
                beams,
                max_tokens: gen_opts.max_tokens,
                length_normalise: opts.length_normalise,
            };
            match &self.loaded {
                Loaded::Table(m) => Gen::Forced(replay_beam(&**m, &*vocab, &ids, beam_opts)?),
                Loaded::Cpu(m, _) | Loaded::Gpu(_, m, _) => {
                    Gen::Forced(replay_beam(&**m, &*vocab, &ids, beam_opts)?)
                }
            }
        } else {
            match &self.loaded {
                Loaded::Table(m) => Gen::Table(
                    Generation::with_handles(m.clone(), vocab.clone(), &ids, gen_opts)
                        .map_err(js_err)?
                        .with_clock(clock),
                ),
                Loaded::Cpu(m, _) => Gen::Cpu(
                    Generation::with_handles(m.clone(), vocab.clone(), &ids, gen_opts)
                        .map_err(js_err)?
                        .with_clock(clock),
                ),
                Loaded::Gpu(m, _, _) => Gen::Gpu(
                    Generation::with_handles(m.clone(), vocab.clone(), &ids, gen_opts)
                        .map_err(js_err)?
                        .with_clock(clock),
                    m.clone(),
                ),
            }
        };
        Ok(Session { gen: Rc::new(RefCell::new(Some(gen))), vocab, prompt_tokens: ids.len() })
    }

    /// The chain rule on `text`: each token's probability given the tokens before it, the
    /// total log P, average negative log-likelihood and perplexity. The first token (BOS, or
    /// the first word when there is none) is the context and is not scored.
    pub fn score(&self, text: &str) -> Result<JsValue, JsError> {
        let ids = self.prompt_ids(text)?;
        if ids.len() < 2 {
            return Err(JsError::new("the text needs at least one token after the first to score"));
        }
        let score = match &self.loaded {
            Loaded::Table(m) => generate::score(&**m, &ids),
            Loaded::Cpu(m, _) | Loaded::Gpu(_, m, _) => generate::score(&**m, &ids),
        }
        .map_err(js_err)?;
        let vocab = self.vocab();
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Scored {
            id: u32,
            token: String,
            prob: f64,
            logprob: f64,
        }
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct ScoreOut {
            tokens: Vec<Scored>,
            logprob: f64,
            probability: f64,
            avg_nll: f64,
            perplexity: f64,
        }
        let tokens = ids[1..]
            .iter()
            .zip(&score.token_logprobs)
            .map(|(&id, &lp)| Scored {
                id,
                token: vocab.token_text(id),
                prob: lp.exp(),
                logprob: lp,
            })
            .collect();
        to_js(&ScoreOut {
            tokens,
            logprob: score.total_logprob,
            probability: score.probability(),
            avg_nll: score.avg_nll,
            perplexity: score.perplexity,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Sessions

type Owned<M> = Generation<'static, M, Rc<M>, Rc<dyn Vocab>>;

enum Gen {
    Table(Owned<TableModel>),
    Cpu(Owned<CpuModel>),
    /// The generation and its model (whose forward pass is awaited outside the generation).
    Gpu(Owned<GpuModel>, Rc<GpuModel>),
    /// A finished beam search, replayed token by token.
    Forced(Forced),
}

struct Forced {
    events: VecDeque<TokenEvent>,
    summary: GenerationSummary,
    aborted: bool,
}

/// Beam search, then the best beam as token events: each token's probability and alternatives
/// come from one forward pass over prompt + beam with logits at every position.
fn replay_beam<M: LanguageModel>(
    model: &M,
    vocab: &dyn Vocab,
    ids: &[u32],
    opts: BeamOptions,
) -> Result<Forced, JsError> {
    let t0 = clock();
    let beams = generate::beam_search(model, ids, opts).map_err(js_err)?;
    let best = beams.into_iter().next().ok_or_else(|| JsError::new("beam search found nothing"))?;
    let mut all: Vec<u32> = ids.to_vec();
    all.extend(&best.ids);
    let eos = best.finished.then(|| model.eos_tokens().first().copied()).flatten();
    // The logits after the last generated token predict the end token, when the beam has one.
    let scored_len = if eos.is_some() { all.len() } else { all.len() - 1 };
    let mut state = model.new_state();
    let logits =
        model.forward(&mut state, &all[..scored_len.max(ids.len())], true).map_err(js_err)?;
    let n = model.vocab_size();
    let mut generated: Vec<u32> = best.ids.clone();
    if let Some(e) = eos {
        generated.push(e);
    }
    let anchor = &ids[ids.len().saturating_sub(4)..];
    let anchor_text = vocab.decode(anchor);
    let text_of = |k: usize| {
        let mut seq = anchor.to_vec();
        seq.extend(&best.ids[..k.min(best.ids.len())]);
        let full = vocab.decode(&seq);
        full.strip_prefix(anchor_text.as_str())
            .map(str::to_owned)
            .unwrap_or_else(|| vocab.decode(&best.ids[..k.min(best.ids.len())]))
    };
    let mut events = VecDeque::new();
    let mut shown = String::new();
    for (k, &id) in generated.iter().enumerate() {
        let row = ids.len() - 1 + k;
        let l = &logits[row * n..(row + 1) * n];
        let lse = logsumexp(l);
        let logprob = log_softmax_at(l, id);
        let top = top_n(l, 5)
            .into_iter()
            .map(|(t, logit)| (t, ((logit as f64) - lse).exp() as f32))
            .collect();
        let full = text_of(k + 1);
        let text = full.strip_prefix(shown.as_str()).map(str::to_owned).unwrap_or_default();
        shown = full;
        events.push_back(TokenEvent {
            id,
            text,
            prob: logprob.exp() as f32,
            logprob: logprob as f32,
            top,
            position: ids.len() + k,
        });
    }
    let ms = clock() - t0;
    let summary = GenerationSummary {
        prompt_tokens: ids.len(),
        generated_tokens: generated.len(),
        text: shown,
        stop_reason: if best.finished { StopReason::Eos } else { StopReason::MaxTokens },
        prefill_ms: 0.0,
        decode_ms: ms,
        ttft_ms: ms,
    };
    Ok(Forced { events, summary, aborted: false })
}

/// A generation in progress: call `next()` until it gives `null`.
#[wasm_bindgen]
pub struct Session {
    gen: Rc<RefCell<Option<Gen>>>,
    vocab: Rc<dyn Vocab>,
    prompt_tokens: usize,
}

const BUSY: &str =
    "this generation is already computing a token (await each next() before the next)";

async fn step(cell: Rc<RefCell<Option<Gen>>>) -> crate::Result<Option<TokenEvent>> {
    let taken = cell.borrow_mut().take();
    let Some(mut gen) = taken else {
        return Err(Error::Input(BUSY.into()));
    };
    let result = match &mut gen {
        Gen::Table(g) => g.step(),
        Gen::Cpu(g) => g.step(),
        Gen::Gpu(g, model) => match g.step_input() {
            None => Ok(None),
            Some(tokens) if tokens.is_empty() => Ok(Some(g.step_output(Vec::new()))),
            Some(tokens) => match model.forward_async(g.state_mut(), &tokens, false).await {
                Ok(logits) => Ok(Some(g.step_output(logits))),
                Err(e) => Err(e),
            },
        },
        Gen::Forced(f) => Ok(if f.aborted { None } else { f.events.pop_front() }),
    };
    *cell.borrow_mut() = Some(gen);
    result
}

#[wasm_bindgen]
impl Session {
    /// The next token `{id, text, token, prob, logprob, top: [{id, token, prob}], position}`,
    /// or `null` once generation has stopped. Returns a Promise (the WebGPU forward pass is
    /// asynchronous; the CPU one resolves at once).
    pub fn next(&self) -> js_sys::Promise {
        let cell = self.gen.clone();
        let vocab = self.vocab.clone();
        wasm_bindgen_futures::future_to_promise(async move {
            match step(cell).await {
                Ok(Some(ev)) => to_js(&token_out(&*vocab, ev)).map_err(JsValue::from),
                Ok(None) => Ok(JsValue::NULL),
                Err(e) => Err(JsError::new(&e.to_string()).into()),
            }
        })
    }

    /// The next token synchronously (CPU and table models only; errors for WebGPU).
    #[wasm_bindgen(js_name = nextSync)]
    pub fn next_sync(&self) -> Result<JsValue, JsError> {
        let mut slot = self.gen.borrow_mut();
        let gen = slot.as_mut().ok_or_else(|| JsError::new(BUSY))?;
        let ev = match gen {
            Gen::Table(g) => g.step(),
            Gen::Cpu(g) => g.step(),
            Gen::Gpu(..) => {
                return Err(JsError::new("a WebGPU generation steps asynchronously: use next()"))
            }
            Gen::Forced(f) => Ok(if f.aborted { None } else { f.events.pop_front() }),
        }
        .map_err(js_err)?;
        match ev {
            Some(ev) => to_js(&token_out(&*self.vocab, ev)),
            None => Ok(JsValue::NULL),
        }
    }

    /// Stop: later `next()` calls give `null`.
    pub fn abort(&self) {
        if let Some(gen) = self.gen.borrow_mut().as_mut() {
            match gen {
                Gen::Table(g) => g.abort(),
                Gen::Cpu(g) => g.abort(),
                Gen::Gpu(g, _) => g.abort(),
                Gen::Forced(f) => {
                    f.aborted = true;
                    f.summary.stop_reason = StopReason::Aborted;
                }
            }
        }
    }

    #[wasm_bindgen(getter, js_name = promptTokens)]
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// Totals once stopped (`null` before): `promptTokens`, `generatedTokens`, `text`,
    /// `stopReason`, `prefillMs`, `decodeMs`, `ttftMs`, `prefillTokS`, `decodeTokS`.
    pub fn summary(&self) -> Result<JsValue, JsError> {
        let slot = self.gen.borrow();
        let s = match slot.as_ref() {
            None => return Err(JsError::new(BUSY)),
            Some(Gen::Table(g)) => g.summary(),
            Some(Gen::Cpu(g)) => g.summary(),
            Some(Gen::Gpu(g, _)) => g.summary(),
            Some(Gen::Forced(f)) => (f.aborted || f.events.is_empty()).then(|| f.summary.clone()),
        };
        match s {
            Some(s) => to_js(&summary_out(s)),
            None => Ok(JsValue::NULL),
        }
    }
}
