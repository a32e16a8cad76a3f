//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn fixtures() -> PathBuf {
    repo().join("tests/fixtures")
}

/// `../shared` beside the repository, or None with a loud message so a stranger's checkout still
/// passes. CI sets NEXTTOKEN_REQUIRE_SHARED=1, which turns the skip into a failure.
pub fn shared() -> Option<PathBuf> {
    let dir = repo().join("../shared");
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
// Synthetic GGUF models: tiny, valid, random weights, written through the crate's own GgufWriter.
// ---------------------------------------------------------------------------------------------

use nexttoken::gguf::{GgufWriter, Value};
use nexttoken::quant::GgmlType;

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

/// Encode f32 values as `ty` (F32, F16, BF16, Q8_0 or Q4_0). Panics on other types: the helper
/// only writes what it can encode exactly like ggml does (Q4_0 through the library's quantiser,
/// which `cpu_kernels::synth_quantisers_follow_ggml` checks against ggml's definition).
pub fn encode_f32(ty: GgmlType, values: &[f32]) -> Vec<u8> {
    match ty {
        GgmlType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        GgmlType::F16 => {
            values.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect()
        }
        GgmlType::BF16 => {
            values.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect()
        }
        GgmlType::Q8_0 => quantize_q8_0(values),
        GgmlType::Q4_0 => {
            nexttoken::quant::quantize(ty, values).expect("Q4_0 needs whole blocks of 32")
        }
        other => panic!("synthetic models cannot encode {}", other.name()),
    }
}

/// ggml's `quantize_row_q8_0_ref`: per 32 values d = max|x| / 127 (stored as f16), q = round(x / d).
pub fn quantize_q8_0(values: &[f32]) -> Vec<u8> {
    assert!(values.len().is_multiple_of(32), "Q8_0 needs whole blocks of 32, got {}", values.len());
    let mut out = Vec::with_capacity(values.len() / 32 * 34);
    for block in values.chunks_exact(32) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
        for &x in block {
            out.push((x * id).round() as i8 as u8);
        }
    }
    out
}

/// One tensor of a synthetic model, before it is written.
#[derive(Clone, Debug)]
pub struct SynthTensor {
    pub name: String,
    pub ty: GgmlType,
    /// GGUF order: innermost (row length) first.
    pub dims: Vec<usize>,
    pub data: Vec<u8>,
}

/// The parts of a synthetic GGUF file, editable before writing (to break it on purpose).
#[derive(Clone, Debug)]
pub struct SynthParts {
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<SynthTensor>,
}

impl SynthParts {
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = GgufWriter::new();
        for (k, v) in &self.metadata {
            w.metadata(k, v.clone());
        }
        for t in &self.tensors {
            w.tensor(&t.name, t.ty, &t.dims, t.data.clone());
        }
        w.to_bytes()
    }
    /// Replace the value of `key` (or add it).
    pub fn set_meta(&mut self, key: &str, value: Value) -> &mut Self {
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => self.metadata.push((key.to_owned(), value)),
        }
        self
    }
    pub fn remove_meta(&mut self, key: &str) -> &mut Self {
        let before = self.metadata.len();
        self.metadata.retain(|(k, _)| k != key);
        assert_ne!(before, self.metadata.len(), "no metadata key {key}");
        self
    }
    pub fn remove_tensor(&mut self, name: &str) -> &mut Self {
        let before = self.tensors.len();
        self.tensors.retain(|t| t.name != name);
        assert_ne!(before, self.tensors.len(), "no tensor {name}");
        self
    }
    pub fn tensor_mut(&mut self, name: &str) -> &mut SynthTensor {
        self.tensors
            .iter_mut()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no tensor {name}"))
    }
    pub fn push_tensor(
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

/// The parts of `synth_model(arch, ty, seed)`, for tests that edit them before writing.
pub fn synth_parts(arch: &str, ty: GgmlType, seed: u64) -> SynthParts {
    let (e, ff, vocab, ctx, layers) = (SYNTH_EMBD, SYNTH_FF, SYNTH_VOCAB, SYNTH_CTX, SYNTH_LAYERS);
    let heads = SYNTH_HEADS;
    let is_gpt2 = arch == "gpt2";
    let heads_kv = if is_gpt2 { SYNTH_HEADS } else { SYNTH_HEADS_KV };
    let head_dim = e / heads;
    let (q, kv) = (heads * head_dim, heads_kv * head_dim);
    assert!(matches!(arch, "llama" | "qwen2" | "gpt2"), "synth_model: unknown arch {arch}");

    let mut rng = SplitMix64(seed ^ 0x5EED_0000_0000_0000);
    let a = |k: &str| format!("{arch}.{k}");
    let mut metadata: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("general.name".into(), Value::String(format!("synthetic {arch} {}", ty.name()))),
        ("general.alignment".into(), Value::U32(32)),
        (a("context_length"), Value::U32(ctx as u32)),
        (a("embedding_length"), Value::U32(e as u32)),
        (a("block_count"), Value::U32(layers as u32)),
        (a("feed_forward_length"), Value::U32(ff as u32)),
        (a("attention.head_count"), Value::U32(heads as u32)),
        (a("attention.head_count_kv"), Value::U32(heads_kv as u32)),
    ];
    if is_gpt2 {
        metadata.push((a("attention.layer_norm_epsilon"), Value::F32(1e-5)));
    } else {
        metadata.push((a("rope.freq_base"), Value::F32(10000.0)));
        metadata.push((a("attention.layer_norm_rms_epsilon"), Value::F32(1e-5)));
    }
    metadata.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(SYNTH_BOS)));
    metadata.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(SYNTH_EOS)));
    metadata.push((
        "tokenizer.ggml.tokens".into(),
        Value::Array((0..vocab).map(|i| Value::String(format!("t{i}"))).collect()),
    ));

    let mut tensors = Vec::new();
    // A weight matrix of `rows` rows of `cols`, in `ty`, scaled so activations stay O(1).
    let mut matrix = |rng: &mut SplitMix64, name: String, cols: usize, rows: usize, scale: f32| {
        let vals: Vec<f32> = (0..cols * rows).map(|_| rng.uniform(scale)).collect();
        tensors.push(SynthTensor { name, ty, dims: vec![cols, rows], data: encode_f32(ty, &vals) });
    };
    let w_in = 1.7 / (e as f32).sqrt();
    let w_ff = 1.7 / (ff as f32).sqrt();
    // Small embeddings: with tied outputs, a residual stream dominated by the input token would
    // make greedy decoding repeat one token forever.
    matrix(&mut rng, "token_embd.weight".into(), e, vocab, 0.2);
    if is_gpt2 {
        matrix(&mut rng, "position_embd.weight".into(), e, ctx, 0.2);
    }
    for i in 0..layers {
        let n = |s: &str| format!("blk.{i}.{s}");
        if is_gpt2 {
            matrix(&mut rng, n("attn_qkv.weight"), e, q + 2 * kv, w_in);
        } else {
            matrix(&mut rng, n("attn_q.weight"), e, q, w_in);
            matrix(&mut rng, n("attn_k.weight"), e, kv, w_in);
            matrix(&mut rng, n("attn_v.weight"), e, kv, w_in);
        }
        matrix(&mut rng, n("attn_output.weight"), q, e, w_in);
        if !is_gpt2 {
            matrix(&mut rng, n("ffn_gate.weight"), e, ff, w_in);
        }
        matrix(&mut rng, n("ffn_up.weight"), e, ff, w_in);
        matrix(&mut rng, n("ffn_down.weight"), ff, e, w_ff);
    }
    // llama has its own output projection; qwen2 and gpt2 tie it to the embeddings.
    if arch == "llama" {
        matrix(&mut rng, "output.weight".into(), e, vocab, w_in);
    }

    // Norms and biases: always F32.
    let mut vector = |rng: &mut SplitMix64, name: String, len: usize, center: f32, spread: f32| {
        let vals: Vec<f32> = (0..len).map(|_| center + rng.uniform(spread)).collect();
        tensors.push(SynthTensor {
            name,
            ty: GgmlType::F32,
            dims: vec![len],
            data: encode_f32(GgmlType::F32, &vals),
        });
    };
    for i in 0..layers {
        let n = |s: &str| format!("blk.{i}.{s}");
        vector(&mut rng, n("attn_norm.weight"), e, 1.0, 0.2);
        vector(&mut rng, n("ffn_norm.weight"), e, 1.0, 0.2);
        if arch == "qwen2" {
            vector(&mut rng, n("attn_q.bias"), q, 0.0, 0.2);
            vector(&mut rng, n("attn_k.bias"), kv, 0.0, 0.2);
            vector(&mut rng, n("attn_v.bias"), kv, 0.0, 0.2);
        }
        if is_gpt2 {
            vector(&mut rng, n("attn_norm.bias"), e, 0.0, 0.1);
            vector(&mut rng, n("attn_qkv.bias"), q + 2 * kv, 0.0, 0.2);
            vector(&mut rng, n("attn_output.bias"), e, 0.0, 0.1);
            vector(&mut rng, n("ffn_norm.bias"), e, 0.0, 0.1);
            vector(&mut rng, n("ffn_up.bias"), ff, 0.0, 0.2);
            vector(&mut rng, n("ffn_down.bias"), e, 0.0, 0.1);
        }
    }
    vector(&mut rng, "output_norm.weight".into(), e, 1.0, 0.2);
    if is_gpt2 {
        vector(&mut rng, "output_norm.bias".into(), e, 0.0, 0.1);
    }
    SynthParts { metadata, tensors }
}

/// A tiny valid GGUF model with random weights: `arch` is "llama" (untied output), "qwen2" (q/k/v
/// biases, tied output) or "gpt2" (fused qkv with biases, learned positions, LayerNorm with
/// biases, GELU MLP, tied output). n_embd 64, 2 layers, 4 heads (2 kv heads except gpt2), n_ff 96,
/// vocab 50, context 32. Weight matrices are `ty` (F32, F16, BF16 or Q8_0); norms and biases F32.
pub fn synth_model(arch: &str, ty: GgmlType, seed: u64) -> Vec<u8> {
    synth_parts(arch, ty, seed).to_bytes()
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
