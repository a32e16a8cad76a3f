//! The browser API (wasm-bindgen), used by `www/worker.js` through `www/nexttoken.js`.
//!
//! ```js
//! // The backend first (WebGPU's device is opened here), then the download:
//! const choice = await BackendChoice.choose({ backend: "auto" });
//! // tokenizerBytes: a tokenizer.json, or null to use the one in the GGUF's own metadata
//! let engine;
//! if (choice.backend === "webgpu") {
//!   // from the download straight into GPU buffers: the weights never enter wasm memory
//!   const stream = new GgufStream(choice, totalBytes, tokenizerBytes, { maxSeq: 2048 });
//!   for await (const chunk of download) stream.push(chunk);
//!   engine = await stream.finish();
//! } else {
//!   const sink = new ByteSink(totalBytes);        // the CPU path reads the bytes in wasm memory
//!   for await (const chunk of download) sink.push(chunk);
//!   engine = await Engine.loadGguf(sink, tokenizerBytes, { maxSeq: 2048 }, choice);
//! }
//! // or: Engine.loadTable(jsonText)
//! const session = engine.start("Once upon a time", { temperature: 0, maxTokens: 32 });
//! let t; while ((t = await session.next()) !== null) console.log(t.text, t.prob, t.top);
//! session.summary();   // prompt/generated tokens, prefill/decode ms and tok/s, TTFT, stop reason, backend
//! await engine.score("the cat sat");
//! ```
//!
//! On the CPU path a GGUF file is passed as a [`ByteSink`] that the download fills chunk by
//! chunk, so the bytes exist once (in wasm memory) rather than once in JS and once in wasm;
//! `Model::from_bytes` then takes that `Vec<u8>` by value and never copies it. On WebGPU a
//! [`GgufStream`] writes each chunk to the GPU through a 1 MiB staging buffer, so wasm memory
//! holds the header's metadata (tokenizer, chat template) and not the weights
//! (`weightsInWasmBytes` in the model's info says how many bytes of the file are held).
//!
//! Modules: `engine` (loading), `session` (stepping generation, beam search and scoring with the
//! forward pass awaited, so WebGPU runs them all), `js` (the JS shapes). This file holds the
//! small exported functions.

use wasm_bindgen::prelude::*;

use crate::timing::default_clock as clock;
use crate::Error;

mod engine;
mod js;
#[cfg(target_feature = "atomics")]
mod pool;
mod session;

pub use engine::{BackendChoice, ByteSink, Engine, GgufStream};
pub use session::Session;

#[wasm_bindgen(start)]
pub fn start() {
    console_error_panic_hook::set_once();
}

fn js_err(e: Error) -> JsError {
    JsError::new(&e.to_string())
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

/// Token ids of `text` (no BOS) by the tokenizer the GGUF file in `gguf` describes in its
/// metadata (a vocabulary-only file is enough): for the browser tests, which run llama.cpp's
/// tokenizer vectors through the wasm build. Throws when the file has no usable tokenizer.
#[wasm_bindgen(js_name = tokenizeWithGguf)]
pub fn tokenize_with_gguf(gguf: &[u8], text: &str) -> Result<Vec<u32>, JsError> {
    use crate::Vocab;
    let tokenizer = crate::tokenizer::HfTokenizer::from_gguf_bytes(gguf).map_err(js_err)?;
    tokenizer.encode(text).map_err(js_err)
}

/// [`tokenize_with_gguf`] on each of `texts` with one tokenizer (building it takes most of the
/// time: up to a second for a 150k-token vocabulary): an array of `Uint32Array`s.
#[wasm_bindgen(js_name = tokenizeEachWithGguf)]
pub fn tokenize_each_with_gguf(gguf: &[u8], texts: Vec<String>) -> Result<js_sys::Array, JsError> {
    use crate::Vocab;
    let tokenizer = crate::tokenizer::HfTokenizer::from_gguf_bytes(gguf).map_err(js_err)?;
    texts
        .iter()
        .map(|text| {
            let ids = tokenizer.encode(text).map_err(js_err)?;
            Ok(JsValue::from(js_sys::Uint32Array::from(&ids[..])))
        })
        .collect()
}

/// What the sampler does with one step's stored candidates (`keepCandidates` in the generation
/// options gives each token event `candidates: {ids, logits}`): the tokens `options` (as
/// `Engine.start` takes them: temperature, topK, topP, minP, repeatPenalty, repeatWindow) keep,
/// with the probabilities the draw would use, `[{id, prob}]`, most probable first. `history`:
/// the ids before that step (prompt included), which only the repetition penalty reads. The
/// library's sampler itself (`Sampler::kept`), so the page shows what generation does.
#[wasm_bindgen(js_name = samplerView)]
pub fn sampler_view(
    ids: Vec<u32>,
    logits: Vec<f32>,
    options: JsValue,
    history: Vec<u32>,
) -> Result<JsValue, JsError> {
    if ids.len() != logits.len() || ids.is_empty() {
        return Err(JsError::new("samplerView: ids and logits must be non-empty and as long"));
    }
    let config = js::GenOptions::parse(options)?.generate_options().sampler;
    config.validate().map_err(js_err)?;
    // The stored candidates as a row (every other token impossible), ids as they are.
    let len = ids.iter().max().map_or(0, |&m| m as usize + 1);
    let mut row = vec![f32::NEG_INFINITY; len];
    for (&id, &logit) in ids.iter().zip(&logits) {
        row[id as usize] = logit;
    }
    let kept = crate::sampling::Sampler::new(config).kept(&row, &history);
    #[derive(serde::Serialize)]
    struct Kept {
        id: u32,
        prob: f32,
    }
    js::to_js(&kept.into_iter().map(|(id, prob)| Kept { id, prob }).collect::<Vec<_>>())
}

/// Whether this is the threads build (nightly, +atomics: its memory is a SharedArrayBuffer, so
/// it only loads on a cross-origin isolated page), which can run the CPU path on several cores.
#[wasm_bindgen(js_name = threadsBuild)]
pub fn threads_build() -> bool {
    cfg!(target_feature = "atomics")
}

/// Bytes per second of a `mib` MiB copy inside wasm memory (bytes read plus bytes written), best
/// of 5: the browser bench's reference for the bandwidth a decode step reaches.
#[wasm_bindgen(js_name = memcpyBandwidth)]
pub fn memcpy_bandwidth(mib: usize) -> f64 {
    crate::timing::memcpy_bandwidth(mib.max(1) << 20, clock)
}

/// Bytes of wasm memory (it only grows: this is the peak the module has used).
#[wasm_bindgen(js_name = wasmMemoryBytes)]
pub fn wasm_memory_bytes() -> f64 {
    (core::arch::wasm32::memory_size(0) * 65536) as f64
}

/// A model's preflight from the first bytes of its GGUF file (`fileLen` bytes in all): `{needMore:
/// n}` while its header runs past `prefix` (n bytes from the start at least), else `{plan, cpu}`:
/// the header's numbers (`preflight::ModelPlan`, with `memoryBytes` at `maxSeq` positions) and
/// the CPU path's expected decode speed here with `exact` and `threads`, from a short
/// calibration on random models made in memory (`preflight::cpu_estimate`). A file that is not
/// a GGUF, or whose header lies, throws.
#[wasm_bindgen(js_name = preflightGguf)]
pub fn preflight_gguf(
    prefix: &[u8],
    file_len: f64,
    max_seq: usize,
    exact: bool,
    threads: usize,
) -> Result<JsValue, JsError> {
    use crate::preflight::{cpu_estimate, ModelPlan, PlanFromPrefix};
    let plan = match ModelPlan::from_prefix(prefix, file_len as usize).map_err(js_err)? {
        PlanFromPrefix::NeedMore(n) => return js::to_js(&serde_json::json!({ "needMore": n })),
        PlanFromPrefix::Plan(plan) => plan,
    };
    let precision = if exact { crate::cpu::Precision::Exact } else { crate::cpu::Precision::Fast };
    let threads = threads.clamp(1, crate::cpu::browser_threads());
    let cpu = cpu_estimate(&plan, precision, threads).map_err(js_err)?;
    let memory_bytes = plan.memory_bytes(max_seq.max(1));
    js::to_js(&serde_json::json!({ "plan": plan, "memoryBytes": memory_bytes, "cpu": cpu }))
}
