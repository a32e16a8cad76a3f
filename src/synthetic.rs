//! Random-weight GGUF models of a described shape: the one writer behind `nexttoken synth` (real
//! models' shapes, for benchmarks without downloading weights) and the tests' tiny models.
//!
//! The file is what llama.cpp writes for the architecture (its tensor names from `tensor_names`,
//! its metadata keys, a placeholder SentencePiece vocabulary or a real tokenizer's metadata copied
//! from another GGUF, [`VocabMeta`]), so llama.cpp loads it too. The
//! numbers mean nothing but stay tame: weight matrices are normal-ish with standard deviation
//! 1/sqrt(row length), so activations keep unit scale through any depth; norms are 1 + N(0, 0.1),
//! biases N(0, 0.1). Every tensor row has its own seed (from `Spec::seed`, the tensor's name and
//! the row), so the output depends neither on the thread count nor on which other tensors exist.
//!
//! Matrices are encoded as their type (`Spec::weight_type`, or a per-tensor override): F32, F16,
//! BF16, Q8_0, Q4_0, Q5_0 and Q5_1 by `quant::quantize` (ggml's reference quantisers); the K-quants as
//! random blocks (any bytes are valid) whose scales give the same magnitude, since the library
//! has no K-quant quantiser. A matrix whose rows are not whole blocks of its type is written F16
//! (F32 when F32 was asked for). Norms, biases and `rope_freqs` are always F32.

use half::f16;

use crate::gguf::{gguf_header, Gguf, GgufWriter, TensorHeader, Value};
use crate::model::Arch;
use crate::quant::{quantize, GgmlType};
use crate::tensor_names::{self as names, block};
use crate::{Error, Result};

/// What to write: the architecture, its dimensions and how the weights are stored.
#[derive(Debug, Clone, PartialEq)]
pub struct Spec {
    pub arch: Arch,
    /// `general.name`.
    pub name: String,
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    /// Written as `attention.key_length` / `value_length` when `n_head * head_dim != n_embd`.
    pub head_dim: usize,
    pub n_ff: usize,
    pub n_ctx: usize,
    pub norm_eps: f32,
    /// RoPE base and rotated dimensions per head (not written for gpt2, which has no RoPE;
    /// `rope.dimension_count` is written only when it is not `head_dim`).
    pub rope_theta: f32,
    pub rope_dims: usize,
    /// Llama 3's frequency divisors (`rope_dims / 2` of them), written as `rope_freqs.weight`.
    pub rope_freqs: Option<Vec<f32>>,
    /// Output projection tied to the token embeddings (no `output.weight`).
    pub tied: bool,
    /// Type of every weight matrix, embeddings included ...
    pub weight_type: GgmlType,
    /// ... except these, by full tensor name (e.g. `blk.0.ffn_down.weight`).
    pub type_overrides: Vec<(String, GgmlType)>,
    /// Placeholder vocabulary only (a [`VocabMeta`] carries its own ids).
    pub bos: u32,
    pub eos: u32,
    pub seed: u64,
    /// A real tokenizer written instead of the placeholder vocabulary (see [`Spec::with_vocab`]),
    /// so the file alone is a model with a usable tokenizer.
    pub vocab: Option<VocabMeta>,
    /// `tokenizer.chat_template`, written after the vocabulary's keys (in place of its own).
    pub chat_template: Option<String>,
}

/// A real tokenizer's metadata: every `tokenizer.*` key of a GGUF file (llama.cpp's
/// vocabulary-only `ggml-vocab-*.gguf` files, or any model), to write into a synthetic model.
#[derive(Clone, PartialEq)]
pub struct VocabMeta {
    keys: Vec<(String, Value)>,
    n_tokens: usize,
}

impl VocabMeta {
    /// The `tokenizer.*` keys of `g`, refused unless they describe a tokenizer this library can
    /// build (so a synthetic model never carries one it cannot load).
    pub fn from_gguf(g: &Gguf) -> Result<VocabMeta> {
        crate::tokenizer::HfTokenizer::from_gguf(g)?;
        let n_tokens = g.str_array("tokenizer.ggml.tokens")?.map_or(0, |t| t.len());
        let mut keys: Vec<(String, Value)> = g
            .metadata
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        // The map's order is random; the file's bytes should not be.
        keys.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(VocabMeta { keys, n_tokens })
    }

    /// Tokens in the vocabulary: the model's `n_vocab`.
    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }

    /// `tokenizer.ggml.{name}_token_id`, when present.
    pub fn token_id(&self, name: &str) -> Option<u32> {
        let key = format!("tokenizer.ggml.{name}_token_id");
        let id = self.keys.iter().find(|(k, _)| *k == key)?.1.as_u64()?;
        u32::try_from(id).ok()
    }
}

/// Short: a vocabulary's Debug would print every token into error messages.
impl std::fmt::Debug for VocabMeta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "VocabMeta({} keys, {} tokens)", self.keys.len(), self.n_tokens)
    }
}

impl Spec {
    /// `arch` with these sizes and plain defaults: as many key/value heads as heads, head size
    /// n_embd / n_head, RoPE on the whole head with base 10000, eps 1e-5, untied F32 weights,
    /// BOS 1, EOS 2, seed 0.
    pub fn new(
        arch: Arch,
        n_vocab: usize,
        n_embd: usize,
        n_layer: usize,
        n_head: usize,
        n_ff: usize,
        n_ctx: usize,
    ) -> Spec {
        let head_dim = n_embd / n_head.max(1);
        Spec {
            arch,
            name: format!("synthetic {}", arch.gguf_name()),
            n_vocab,
            n_embd,
            n_layer,
            n_head,
            n_head_kv: n_head,
            head_dim,
            n_ff,
            n_ctx,
            norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_dims: head_dim,
            rope_freqs: None,
            tied: false,
            weight_type: GgmlType::F32,
            type_overrides: Vec::new(),
            bos: 1,
            eos: 2,
            seed: 0,
            vocab: None,
            chat_template: None,
        }
    }

    /// This spec with `vocab`'s tokenizer: `n_vocab` becomes its token count, and `bos`/`eos` its
    /// ids where it names them.
    pub fn with_vocab(self, vocab: VocabMeta) -> Spec {
        Spec {
            n_vocab: vocab.n_tokens(),
            bos: vocab.token_id("bos").unwrap_or(self.bos),
            eos: vocab.token_id("eos").unwrap_or(self.eos),
            vocab: Some(vocab),
            ..self
        }
    }

    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// The type matrix `name` is written in, before the whole-blocks fallback.
    fn type_of(&self, name: &str) -> GgmlType {
        self.type_overrides.iter().find(|(n, _)| n == name).map_or(self.weight_type, |o| o.1)
    }
}

/// One tensor of a model, encoded, before it is written.
#[derive(Debug, Clone, PartialEq)]
pub struct PartTensor {
    pub name: String,
    pub ty: GgmlType,
    /// GGUF order: innermost (row length) first.
    pub dims: Vec<usize>,
    pub data: Vec<u8>,
}

/// A GGUF file's metadata and tensors, editable before writing (tests break files on purpose).
#[derive(Debug, Clone, Default)]
pub struct Parts {
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<PartTensor>,
}

impl Parts {
    pub fn to_bytes(&self) -> Vec<u8> {
        self.clone().into_bytes()
    }

    /// The GGUF file, without copying the tensor data first.
    pub fn into_bytes(self) -> Vec<u8> {
        let mut w = GgufWriter::new();
        for (k, v) in self.metadata {
            w.metadata(&k, v);
        }
        for t in self.tensors {
            w.tensor(&t.name, t.ty, &t.dims, t.data);
        }
        w.to_bytes()
    }
}

/// The GGUF file `spec` describes.
pub fn write(spec: &Spec) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    write_to(spec, &mut out)?;
    Ok(out)
}

/// The most bytes one tensor of a synthetic model may have (the largest of real models', Llama
/// 3 70B's F16 embeddings, are 2.1 GB) and the whole file (a 405B model in F16 is 810 GB).
pub const MAX_TENSOR_BYTES: u64 = 16 << 30;
pub const MAX_FILE_BYTES: u64 = 1 << 40;

/// Write the GGUF file `spec` describes to `out` as it is made: the header, then each tensor in
/// pieces of at most 64 MiB, so memory holds a piece at a time however large the model (writing
/// a 144 MB model used to take 295 MB). A shape whose tensors or file exceed
/// [`MAX_TENSOR_BYTES`] or [`MAX_FILE_BYTES`] is refused before anything is written. Returns the
/// bytes written.
pub fn write_to(spec: &Spec, out: &mut impl std::io::Write) -> Result<u64> {
    check(spec)?;
    let planned = plan(spec);
    // Each tensor's type (a matrix whose rows are not whole blocks of its type falls back, as
    // `matrix` does) and size, checked before anything is made.
    let mut layout = Vec::with_capacity(planned.len());
    let mut total = 0u64;
    for p in &planned {
        let ty = match p.kind {
            Kind::Matrix => matrix_type(p.cols, spec.type_of(&p.name)),
            _ => GgmlType::F32,
        };
        // In u64 (wasm32's usize is 32 bits), then a usize where the tensor fits one.
        let size = (ty.row_bytes(p.cols) as u64).saturating_mul(p.rows as u64);
        match usize::try_from(size) {
            Ok(bytes) if size <= MAX_TENSOR_BYTES => {
                total = total.saturating_add(size);
                layout.push((ty, bytes));
            }
            _ => {
                return Err(Error::Input(format!(
                    "synthetic model: {} would be {} x {} {} ({:.1} GB), more than the {} GB a \
                     tensor may have",
                    p.name,
                    p.rows,
                    p.cols,
                    ty.name(),
                    (p.rows as f64) * (ty.row_bytes(p.cols) as f64) / 1e9,
                    MAX_TENSOR_BYTES >> 30
                )))
            }
        }
    }
    if total > MAX_FILE_BYTES {
        return Err(Error::Input(format!(
            "synthetic model: the file would be {:.0} GB, more than {} GB",
            total as f64 / 1e9,
            MAX_FILE_BYTES >> 30
        )));
    }
    let dims: Vec<Vec<usize>> = planned
        .iter()
        .map(|p| if p.kind == Kind::Matrix { vec![p.cols, p.rows] } else { vec![p.cols] })
        .collect();
    let headers: Vec<TensorHeader> = planned
        .iter()
        .zip(&layout)
        .zip(&dims)
        .map(|((p, &(ty, size)), dims)| TensorHeader { name: &p.name, ty, dims, size })
        .collect();
    let metadata = metadata(spec);
    let (header, align) = gguf_header(&metadata, &headers);
    let io = |e: std::io::Error| Error::Input(format!("synthetic model: writing it: {e}"));
    out.write_all(&header).map_err(io)?;
    let mut written = header.len() as u64;
    for (p, &(ty, size)) in planned.iter().zip(&layout) {
        let seed = tensor_seed(spec.seed, &p.name);
        match p.kind {
            Kind::Matrix => {
                // Whole rows, at most 64 MiB (and at least a row) at a time.
                let row_bytes = ty.row_bytes(p.cols);
                let step = ((64 << 20) / row_bytes.max(1)).max(1);
                for first in (0..p.rows).step_by(step) {
                    let rows = step.min(p.rows - first);
                    out.write_all(&matrix_rows(seed, p.cols, first, rows, ty)).map_err(io)?;
                }
            }
            Kind::Norm => {
                out.write_all(&f32_bytes(normalish(seed, p.cols, 0.1, 1.0))).map_err(io)?
            }
            Kind::Bias => {
                out.write_all(&f32_bytes(normalish(seed, p.cols, 0.1, 0.0))).map_err(io)?
            }
            Kind::RopeFreqs => out
                .write_all(&f32_bytes(spec.rope_freqs.clone().unwrap_or_default()))
                .map_err(io)?,
        }
        let padded = size.div_ceil(align) * align;
        out.write_all(&vec![0u8; padded - size]).map_err(io)?;
        written += padded as u64;
    }
    Ok(written)
}

/// The metadata and encoded tensors of the GGUF file `spec` describes.
pub fn parts(spec: &Spec) -> Result<Parts> {
    check(spec)?;
    let metadata = metadata(spec);
    let tensors = plan(spec)
        .into_iter()
        .map(|p| {
            let seed = tensor_seed(spec.seed, &p.name);
            let (ty, data) = match p.kind {
                Kind::Matrix => matrix(seed, p.cols, p.rows, spec.type_of(&p.name)),
                Kind::Norm => (GgmlType::F32, f32_bytes(normalish(seed, p.cols, 0.1, 1.0))),
                Kind::Bias => (GgmlType::F32, f32_bytes(normalish(seed, p.cols, 0.1, 0.0))),
                Kind::RopeFreqs => {
                    (GgmlType::F32, f32_bytes(spec.rope_freqs.clone().unwrap_or_default()))
                }
            };
            let dims = if p.kind == Kind::Matrix { vec![p.cols, p.rows] } else { vec![p.cols] };
            PartTensor { name: p.name, ty, dims, data }
        })
        .collect();
    Ok(Parts { metadata, tensors })
}

fn check(s: &Spec) -> Result<()> {
    let bad = |what: String| Err(Error::Input(format!("synthetic model: {what}")));
    let sizes =
        [s.n_vocab, s.n_embd, s.n_layer, s.n_head, s.n_head_kv, s.head_dim, s.n_ff, s.n_ctx];
    if sizes.contains(&0) {
        return bad(format!("every size must be positive: {s:?}"));
    }
    if !s.n_head.is_multiple_of(s.n_head_kv) {
        return bad(format!("{} heads cannot share {} key/value heads", s.n_head, s.n_head_kv));
    }
    if s.arch != Arch::Gpt2 && (s.rope_dims > s.head_dim || !s.rope_dims.is_multiple_of(2)) {
        return bad(format!("rope_dims {} does not fit head size {}", s.rope_dims, s.head_dim));
    }
    if let Some(f) = &s.rope_freqs {
        if f.len() != s.rope_dims / 2 {
            return bad(format!("{} rope_freqs for {} rope dims", f.len(), s.rope_dims));
        }
    }
    if let Some(v) = &s.vocab {
        if v.n_tokens() != s.n_vocab {
            return bad(format!(
                "n_vocab {} but the vocabulary has {} tokens",
                s.n_vocab,
                v.n_tokens()
            ));
        }
    }
    if s.bos as usize >= s.n_vocab || s.eos as usize >= s.n_vocab {
        return bad(format!("BOS {} / EOS {} outside the vocabulary", s.bos, s.eos));
    }
    Ok(())
}

fn metadata(s: &Spec) -> Vec<(String, Value)> {
    let a = s.arch.gguf_name();
    let u32v = |v: usize| Value::U32(v as u32);
    let mut m: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(a.into())),
        ("general.name".into(), Value::String(s.name.clone())),
        ("general.file_type".into(), Value::U32(file_type(s.weight_type))),
        ("general.alignment".into(), Value::U32(32)),
    ];
    let mut key = |k: &str, v: Value| m.push((format!("{a}.{k}"), v));
    key("context_length", u32v(s.n_ctx));
    key("embedding_length", u32v(s.n_embd));
    key("block_count", u32v(s.n_layer));
    key("feed_forward_length", u32v(s.n_ff));
    key("attention.head_count", u32v(s.n_head));
    key("attention.head_count_kv", u32v(s.n_head_kv));
    key("vocab_size", u32v(s.n_vocab));
    if s.arch == Arch::Gpt2 {
        key("attention.layer_norm_epsilon", Value::F32(s.norm_eps));
    } else {
        key("attention.layer_norm_rms_epsilon", Value::F32(s.norm_eps));
        key("rope.freq_base", Value::F32(s.rope_theta));
        // Like the key and value lengths below, only where it differs from the readers' default.
        if s.rope_dims != s.head_dim {
            key("rope.dimension_count", u32v(s.rope_dims));
        }
    }
    if s.q_dim() != s.n_embd {
        key("attention.key_length", u32v(s.head_dim));
        key("attention.value_length", u32v(s.head_dim));
    }
    match &s.vocab {
        Some(v) => m.extend(v.keys.iter().cloned()),
        None => m.extend(vocabulary(s)),
    }
    if let Some(template) = &s.chat_template {
        let key = "tokenizer.chat_template";
        m.retain(|(k, _)| k != key);
        m.push((key.to_string(), Value::String(template.clone())));
    }
    m
}

/// Placeholder text (`<t123>`) in llama.cpp's "llama" (SentencePiece) format: `<unk>` at 0,
/// BOS/EOS as control tokens, then as many of the 256 byte tokens as fit, so llama.cpp loads it.
fn vocabulary(s: &Spec) -> Vec<(String, Value)> {
    let (n, bos, eos) = (s.n_vocab, s.bos as usize, s.eos as usize);
    let mut tokens: Vec<String> = (0..n).map(|i| format!("<t{i}>")).collect();
    let mut types = vec![1i32; n]; // NORMAL
    tokens[0] = "<unk>".into();
    types[0] = 2; // UNKNOWN
    tokens[bos] = "<s>".into();
    types[bos] = 3; // CONTROL
    if eos != bos {
        tokens[eos] = "</s>".into();
    }
    types[eos] = 3;
    let mut byte = 0usize;
    for id in 1..n {
        if byte == 256 {
            break;
        }
        if id != bos && id != eos {
            tokens[id] = format!("<0x{byte:02X}>");
            types[id] = 6; // BYTE
            byte += 1;
        }
    }
    let array = |v: Vec<Value>| Value::Array(v);
    vec![
        ("tokenizer.ggml.model".into(), Value::String("llama".into())),
        ("tokenizer.ggml.tokens".into(), array(tokens.into_iter().map(Value::String).collect())),
        ("tokenizer.ggml.scores".into(), array((0..n).map(|i| Value::F32(-(i as f32))).collect())),
        ("tokenizer.ggml.token_type".into(), array(types.into_iter().map(Value::I32).collect())),
        ("tokenizer.ggml.unknown_token_id".into(), Value::U32(0)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(s.bos)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(s.eos)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(s.arch == Arch::Llama)),
        ("tokenizer.ggml.add_eos_token".into(), Value::Bool(false)),
    ]
}

/// llama.cpp's `general.file_type` (LLAMA_FTYPE_*) for a model mostly of `ty`.
fn file_type(ty: GgmlType) -> u32 {
    match ty {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::Q4_0 => 2,
        GgmlType::Q8_0 => 7,
        GgmlType::Q5_0 => 8,
        GgmlType::Q5_1 => 9,
        GgmlType::Q4_K => 15,
        GgmlType::Q5_K => 17,
        GgmlType::Q6_K => 18,
        GgmlType::BF16 => 32,
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Matrix,
    Norm,
    Bias,
    RopeFreqs,
}

/// One tensor to write: `rows` rows of `cols` (vectors have one row).
struct Planned {
    name: String,
    kind: Kind,
    cols: usize,
    rows: usize,
}

/// Every tensor of the architecture, in llama.cpp's order.
fn plan(s: &Spec) -> Vec<Planned> {
    let (e, ff, v) = (s.n_embd, s.n_ff, s.n_vocab);
    let (q, kv) = (s.q_dim(), s.kv_dim());
    let gpt2 = s.arch == Arch::Gpt2;
    let mut out = Vec::new();
    let mut add = |name: String, kind: Kind, cols: usize, rows: usize| {
        out.push(Planned { name, kind, cols, rows })
    };
    use Kind::*;
    add(names::TOKEN_EMBD.into(), Matrix, e, v);
    if gpt2 {
        add(names::POSITION_EMBD.into(), Matrix, e, s.n_ctx);
    }
    if s.rope_freqs.is_some() {
        add(names::ROPE_FREQS.into(), RopeFreqs, s.rope_dims / 2, 1);
    }
    for i in 0..s.n_layer {
        let mut blk = |tensor: &str, kind: Kind, cols: usize, rows: usize| {
            add(block(i, tensor), kind, cols, rows)
        };
        blk(names::ATTN_NORM, Norm, e, 1);
        if gpt2 {
            blk(names::ATTN_NORM_BIAS, Bias, e, 1);
            blk(names::ATTN_QKV, Matrix, e, q + 2 * kv);
            blk(names::ATTN_QKV_BIAS, Bias, q + 2 * kv, 1);
        } else {
            blk(names::ATTN_Q, Matrix, e, q);
            blk(names::ATTN_K, Matrix, e, kv);
            blk(names::ATTN_V, Matrix, e, kv);
            if s.arch == Arch::Qwen2 {
                blk(names::ATTN_Q_BIAS, Bias, q, 1);
                blk(names::ATTN_K_BIAS, Bias, kv, 1);
                blk(names::ATTN_V_BIAS, Bias, kv, 1);
            }
        }
        blk(names::ATTN_OUTPUT, Matrix, q, e);
        if gpt2 {
            blk(names::ATTN_OUTPUT_BIAS, Bias, e, 1);
        }
        blk(names::FFN_NORM, Norm, e, 1);
        if gpt2 {
            blk(names::FFN_NORM_BIAS, Bias, e, 1);
            blk(names::FFN_UP, Matrix, e, ff);
            blk(names::FFN_UP_BIAS, Bias, ff, 1);
            blk(names::FFN_DOWN, Matrix, ff, e);
            blk(names::FFN_DOWN_BIAS, Bias, e, 1);
        } else {
            blk(names::FFN_GATE, Matrix, e, ff);
            blk(names::FFN_UP, Matrix, e, ff);
            blk(names::FFN_DOWN, Matrix, ff, e);
        }
    }
    add(names::OUTPUT_NORM.into(), Norm, e, 1);
    if gpt2 {
        add(names::OUTPUT_NORM_BIAS.into(), Bias, e, 1);
    }
    if !s.tied {
        add(names::OUTPUT.into(), Matrix, e, v);
    }
    out
}

/// splitmix64's step: the same stream on every platform.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A tensor's seed: the model's seed mixed with the name (FNV-1a), so adding or removing one
/// tensor leaves the others' values as they were.
fn tensor_seed(seed: u64, name: &str) -> u64 {
    let fnv = name
        .bytes()
        .fold(0xCBF2_9CE4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3));
    let mut s = seed ^ fnv;
    splitmix(&mut s)
}

fn row_seed(tensor_seed: u64, row: usize) -> u64 {
    tensor_seed ^ (row as u64).wrapping_mul(0xD1B5_4A32_D192_ED03)
}

/// `n` values of mean `mean` and standard deviation `std`: each is the sum of the four 16-bit
/// uniforms of one 64-bit draw (Irwin-Hall, close enough to normal for random weights).
fn normalish(seed: u64, n: usize, std: f32, mean: f32) -> Vec<f32> {
    let mut s = seed;
    // The sum of 4 U(0,1) has mean 2 and standard deviation sqrt(4/12).
    let scale = std / (4.0f32 / 12.0).sqrt() / 65536.0;
    (0..n)
        .map(|_| {
            let r = splitmix(&mut s);
            let sum = (r & 0xffff) + ((r >> 16) & 0xffff) + ((r >> 32) & 0xffff) + (r >> 48);
            mean + (sum as f32 - 2.0 * 65536.0) * scale
        })
        .collect()
}

fn f32_bytes(v: Vec<f32>) -> Vec<u8> {
    v.into_iter().flat_map(f32::to_le_bytes).collect()
}

/// A random matrix of `rows` x `cols` in `ty`, or in the fallback when rows are not whole blocks.
fn matrix(seed: u64, cols: usize, rows: usize, ty: GgmlType) -> (GgmlType, Vec<u8>) {
    let ty = matrix_type(cols, ty);
    (ty, matrix_rows(seed, cols, 0, rows, ty))
}

/// The type a matrix of rows of `cols` is written in when `ty` is asked for: `ty` where the rows
/// are whole blocks of it, else F32 or F16.
fn matrix_type(cols: usize, ty: GgmlType) -> GgmlType {
    if cols.is_multiple_of(ty.block_size()) {
        ty
    } else if ty == GgmlType::F32 {
        GgmlType::F32
    } else {
        GgmlType::F16
    }
}

/// Rows `first .. first + rows` of a random matrix of type `ty` (from [`matrix_type`]): each
/// row from its own seed, so any range of rows is the same bytes as in the whole.
fn matrix_rows(seed: u64, cols: usize, first: usize, rows: usize, ty: GgmlType) -> Vec<u8> {
    let std = 1.0 / (cols as f32).sqrt();
    let row_bytes = ty.row_bytes(cols);
    let mut data = vec![0u8; rows * row_bytes];
    let fill = |first_row: usize, out: &mut [u8]| {
        for (i, o) in out.chunks_exact_mut(row_bytes).enumerate() {
            let seed = row_seed(seed, first_row + i);
            match ty {
                GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
                    random_k_quant_row(ty, seed, std, o)
                }
                _ => o.copy_from_slice(
                    &quantize(ty, &normalish(seed, cols, std, 0.0)).expect("a quantisable type"),
                ),
            }
        }
    };
    #[cfg(any(not(target_arch = "wasm32"), target_feature = "atomics"))]
    {
        use rayon::prelude::*;
        const ROWS_PER_TASK: usize = 64;
        data.par_chunks_mut(row_bytes * ROWS_PER_TASK)
            .enumerate()
            .for_each(|(task, out)| fill(first + task * ROWS_PER_TASK, out));
    }
    #[cfg(all(target_arch = "wasm32", not(target_feature = "atomics")))]
    fill(first, &mut data);
    data
}

/// Random Q4_K, Q5_K or Q6_K blocks (any bytes are valid) with their f16 super-block scales set so the
/// values have about standard deviation `std` and mean 0.
fn random_k_quant_row(ty: GgmlType, seed: u64, std: f32, out: &mut [u8]) {
    let mut s = seed;
    for chunk in out.chunks_mut(8) {
        let r = splitmix(&mut s).to_le_bytes();
        chunk.copy_from_slice(&r[..chunk.len()]);
    }
    let put = |b: &mut [u8], at: usize, v: f32| {
        b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes())
    };
    for blk in out.chunks_exact_mut(ty.block_bytes()) {
        match ty {
            // x = d * scale * q - dmin * min, scale and min uniform 6-bit, q uniform 4-bit: the
            // mean is 0 when dmin = 7.5 d, and the standard deviation is then about 245 d.
            GgmlType::Q4_K => {
                let d = std / 245.0;
                put(blk, 0, d);
                put(blk, 2, 7.5 * d);
            }
            // The same with q uniform 5-bit: mean 0 when dmin = 15.5 d, deviation about 527 d.
            GgmlType::Q5_K => {
                let d = std / 527.0;
                put(blk, 0, d);
                put(blk, 2, 15.5 * d);
            }
            // x = d * scale * (q - 32), scale a uniform i8, q uniform 6-bit: about 1370 d.
            GgmlType::Q6_K => put(blk, 208, std / 1370.0),
            _ => unreachable!("only K-quants are written as random blocks"),
        }
    }
}
