//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn fixtures() -> PathBuf {
    repo().join("tests/fixtures")
}

/// `../shared` beside the repository (or the folder `NEXTTOKEN_SHARED` names), or None with a
/// loud message so a stranger's checkout still passes. CI sets NEXTTOKEN_REQUIRE_SHARED=1, which
/// turns the skip into a failure.
pub fn shared() -> Option<PathBuf> {
    // NEXTTOKEN_SHARED names it elsewhere: a test binary packed for a GPU machine
    // (tools/gpu_bench.sh --pack) carries the files it reads beside it.
    let dir = std::env::var_os("NEXTTOKEN_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("../shared"));
    if dir.is_dir() {
        return Some(dir);
    }
    if std::env::var_os("NEXTTOKEN_REQUIRE_SHARED").is_some() {
        panic!("../shared is missing but NEXTTOKEN_REQUIRE_SHARED is set");
    }
    eprintln!(
        "\n*** SKIPPED: ../shared is absent; tests on shared models and vectors did not run ***\n"
    );
    None
}

// ---------------------------------------------------------------------------------------------
// Synthetic GGUF models: tiny, valid, random weights, from the library's writer
// (`nexttoken::synthetic`), editable before writing to break them on purpose.
// ---------------------------------------------------------------------------------------------

use nexttoken::gguf::Value;
use nexttoken::model::Arch;
use nexttoken::quant::GgmlType;
use nexttoken::synthetic::{self, Spec};
pub use nexttoken::synthetic::{PartTensor as SynthTensor, Parts as SynthParts};

/// Shape of every synthetic model (see `synth_model`).
pub const SYNTH_EMBD: usize = 64;
pub const SYNTH_LAYERS: usize = 2;
pub const SYNTH_HEADS: usize = 4;
/// KV heads for llama and qwen2 (grouped-query attention); gpt2 uses `SYNTH_HEADS` like the real one.
pub const SYNTH_HEADS_KV: usize = 2;
pub const SYNTH_FF: usize = 96;
pub const SYNTH_VOCAB: usize = 50;
pub const SYNTH_CTX: usize = 32;
pub const SYNTH_BOS: u32 = 1;
pub const SYNTH_EOS: u32 = 2;

/// splitmix64: a tiny deterministic PRNG, the same stream on every platform.
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Uniform in [-a, a).
    pub fn uniform(&mut self, a: f32) -> f32 {
        (self.next_f32() * 2.0 - 1.0) * a
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// Edits of a synthetic file's parts; each panics when what it edits is absent.
pub trait EditParts {
    /// Replace the value of `key` (or add it).
    fn set_meta(&mut self, key: &str, value: Value) -> &mut Self;
    fn remove_meta(&mut self, key: &str) -> &mut Self;
    fn remove_tensor(&mut self, name: &str) -> &mut Self;
    fn tensor_mut(&mut self, name: &str) -> &mut SynthTensor;
    fn push_tensor(&mut self, name: &str, ty: GgmlType, dims: &[usize], data: Vec<u8>)
        -> &mut Self;
}

impl EditParts for SynthParts {
    fn set_meta(&mut self, key: &str, value: Value) -> &mut Self {
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => self.metadata.push((key.to_owned(), value)),
        }
        self
    }
    fn remove_meta(&mut self, key: &str) -> &mut Self {
        let before = self.metadata.len();
        self.metadata.retain(|(k, _)| k != key);
        assert_ne!(before, self.metadata.len(), "no metadata key {key}");
        self
    }
    fn remove_tensor(&mut self, name: &str) -> &mut Self {
        let before = self.tensors.len();
        self.tensors.retain(|t| t.name != name);
        assert_ne!(before, self.tensors.len(), "no tensor {name}");
        self
    }
    fn tensor_mut(&mut self, name: &str) -> &mut SynthTensor {
        self.tensors
            .iter_mut()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no tensor {name}"))
    }
    fn push_tensor(
        &mut self,
        name: &str,
        ty: GgmlType,
        dims: &[usize],
        data: Vec<u8>,
    ) -> &mut Self {
        self.tensors.push(SynthTensor { name: name.to_owned(), ty, dims: dims.to_vec(), data });
        self
    }
}

/// The description of `synth_model(arch, ty, seed)`.
pub fn synth_spec(arch: &str, ty: GgmlType, seed: u64) -> Spec {
    let arch = Arch::from_gguf_name(arch).expect("synth_model: llama, qwen2 or gpt2");
    let spec =
        Spec::new(arch, SYNTH_VOCAB, SYNTH_EMBD, SYNTH_LAYERS, SYNTH_HEADS, SYNTH_FF, SYNTH_CTX);
    Spec {
        name: format!("synthetic {} {}", arch.gguf_name(), ty.name()),
        n_head_kv: if arch == Arch::Gpt2 { SYNTH_HEADS } else { SYNTH_HEADS_KV },
        // llama has its own output projection; qwen2 and gpt2 tie it to the embeddings.
        tied: arch != Arch::Llama,
        weight_type: ty,
        bos: SYNTH_BOS,
        eos: SYNTH_EOS,
        seed,
        ..spec
    }
}

/// The parts of `synth_model(arch, ty, seed)`, for tests that edit them before writing.
pub fn synth_parts(arch: &str, ty: GgmlType, seed: u64) -> SynthParts {
    synthetic::parts(&synth_spec(arch, ty, seed)).unwrap()
}

/// A tiny valid GGUF model with random weights: `arch` is "llama" (untied output), "qwen2" (q/k/v
/// biases, tied output) or "gpt2" (fused qkv with biases, learned positions, LayerNorm with
/// biases, GELU MLP, tied output). n_embd 64, 2 layers, 4 heads (2 kv heads except gpt2), n_ff 96,
/// vocab 50, context 32. Weight matrices are `ty`; norms and biases F32.
pub fn synth_model(arch: &str, ty: GgmlType, seed: u64) -> Vec<u8> {
    synthetic::write(&synth_spec(arch, ty, seed)).unwrap()
}

/// Byte position of the tensor info of `name` in a GGUF header (the start of its name length),
/// found by searching for the length-prefixed name. Panics if absent or ambiguous.
pub fn tensor_info_pos(bytes: &[u8], name: &str) -> usize {
    let mut needle = (name.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(name.as_bytes());
    let hits: Vec<usize> = bytes
        .windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(hits.len(), 1, "tensor info {name:?} found {} times", hits.len());
    hits[0]
}

/// Position of the u32 type field of tensor info `name`, and of its u64 offset field.
pub fn tensor_type_and_offset_pos(bytes: &[u8], name: &str) -> (usize, usize) {
    let p = tensor_info_pos(bytes, name) + 8 + name.len();
    let n_dims = u32::from_le_bytes(bytes[p..p + 4].try_into().unwrap()) as usize;
    let ty = p + 4 + 8 * n_dims;
    (ty, ty + 4)
}

/// Position of the u32 value-type field of metadata `key` (right after the key string).
pub fn metadata_type_pos(bytes: &[u8], key: &str) -> usize {
    tensor_info_pos(bytes, key) + 8 + key.len()
}

pub fn put_u32(bytes: &mut [u8], at: usize, v: u32) {
    bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

pub fn put_u64(bytes: &mut [u8], at: usize, v: u64) {
    bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Largest absolute difference between two equal-length slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Index of the largest value (first on ties).
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

/// The GPU, or None with a loud message when no adapter exists. CI sets NEXTTOKEN_REQUIRE_GPU=1
/// (and installs lavapipe), which turns the skip into a failure.
pub fn gpu_context() -> Option<std::sync::Arc<nexttoken::gpu::GpuContext>> {
    match nexttoken::gpu::GpuContext::new() {
        Ok(ctx) => Some(ctx),
        Err(e) => {
            if std::env::var_os("NEXTTOKEN_REQUIRE_GPU").is_some_and(|v| v != "0") {
                panic!("NEXTTOKEN_REQUIRE_GPU is set but no GPU is usable: {e}");
            }
            eprintln!("\n*** SKIPPED: no GPU adapter ({e}); GPU checks did not run ***\n");
            None
        }
    }
}

/// Greedy continuation of `prompt` with the KV cache: one prefill, then one token per forward.
pub fn greedy<M: nexttoken::LanguageModel>(model: &M, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut state = model.new_state();
    let mut logits = model.forward(&mut state, prompt, false).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let next = nexttoken::sampling::argmax(&logits);
        out.push(next);
        if out.len() < n {
            logits = model.forward(&mut state, &[next], false).unwrap();
        }
    }
    out
}

/// A fixture's list of token ids.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// A fixture's rows of logits.
pub fn rows(v: &serde_json::Value) -> Vec<Vec<f32>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
        .collect()
}
