//! The model description shared by every backend: hyperparameters from GGUF metadata and the
//! weight tensors by role. The CPU and GPU forward passes differ only in where the math runs.
//!
//! GGUF conventions that matter here (llama.cpp's):
//! - a weight matrix of GGUF shape `[in, out]` is `out` rows of `in` elements; `y = W x` is one
//!   dot product per row;
//! - `llama` files store q/k rows permuted so RoPE rotates adjacent pairs (2i, 2i+1)
//!   ("interleaved"); `qwen2` keeps Hugging Face's order and rotates (i, i + d/2) ("half split");
//! - a missing `output.weight` means the output projection is tied to `token_embd.weight`.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::gguf::{Gguf, TensorInfo, Value};
use crate::quant::GgmlType;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama 2/3, SmolLM2, TinyLlama, stories: RMSNorm, RoPE, SiLU-gated MLP.
    Llama,
    /// Llama plus biases on q, k, v and half-split RoPE.
    Qwen2,
    /// Learned positions, LayerNorm with bias, fused qkv, GELU MLP.
    Gpt2,
}

impl Arch {
    pub fn from_gguf_name(name: &str) -> Result<Arch> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "gpt2" => Ok(Arch::Gpt2),
            other => Err(Error::Model(format!(
                "unsupported architecture {other:?} (supported: llama, qwen2, gpt2)"
            ))),
        }
    }
    pub fn gguf_name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Gpt2 => "gpt2",
        }
    }
}

/// How RoPE pairs up the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Rotate (2i, 2i+1): llama.cpp's "norm" rope, used for `llama` GGUF files.
    Interleaved,
    /// Rotate (i, i + d/2): "neox" rope, used for `qwen2`.
    HalfSplit,
    /// No rotary embedding (GPT-2 learns absolute positions instead).
    None,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub arch: Arch,
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub n_ctx: usize,
    pub rope: RopeStyle,
    pub rope_theta: f32,
    /// Number of head dimensions RoPE rotates (usually all of them).
    pub rope_dims: usize,
    pub norm_eps: f32,
    pub bos_token: Option<u32>,
    /// Whether prompts start with BOS (`tokenizer.ggml.add_bos_token`, per-architecture default).
    pub add_bos: bool,
    pub eos_tokens: Vec<u32>,
}

impl Config {
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
    /// Whether `tokens` can be appended at position `pos` of a sequence of at most `max_seq`
    /// tokens: the same rule for every backend, so each refuses the same input the same way.
    pub fn check_tokens(&self, pos: usize, tokens: &[u32], max_seq: usize) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::Input("no tokens to run".into()));
        }
        if pos + tokens.len() > max_seq {
            return Err(Error::Input(format!(
                "{} tokens after {pos} would exceed the context of {max_seq} tokens",
                tokens.len()
            )));
        }
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= self.n_vocab) {
            return Err(Error::Input(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.n_vocab
            )));
        }
        Ok(())
    }

    /// The token a prompt starts with: BOS when the model has one and wants it prepended.
    pub fn prompt_start(&self) -> Option<u32> {
        self.bos_token.filter(|_| self.add_bos)
    }
}

/// One tensor: where its bytes are in the model file and how to read them.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub ty: GgmlType,
    /// Elements per row (GGUF `dims[0]`).
    pub cols: usize,
    pub rows: usize,
    pub offset: usize,
    pub size_bytes: usize,
}

impl Tensor {
    fn from_info(t: &TensorInfo) -> Tensor {
        Tensor {
            name: t.name.clone(),
            ty: t.ty,
            cols: t.cols(),
            rows: t.rows(),
            offset: t.offset,
            size_bytes: t.size_bytes,
        }
    }
    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols)
    }
}

/// The weights of one transformer block. Which ones exist depends on the architecture.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: Tensor,
    pub attn_norm_b: Option<Tensor>,
    /// Separate projections (llama, qwen2) ...
    pub wq: Option<Tensor>,
    pub wk: Option<Tensor>,
    pub wv: Option<Tensor>,
    pub bq: Option<Tensor>,
    pub bk: Option<Tensor>,
    pub bv: Option<Tensor>,
    /// ... or one fused q|k|v projection (gpt2).
    pub wqkv: Option<Tensor>,
    pub bqkv: Option<Tensor>,
    pub wo: Tensor,
    pub bo: Option<Tensor>,
    pub ffn_norm: Tensor,
    pub ffn_norm_b: Option<Tensor>,
    /// SiLU gate (llama, qwen2); absent for gpt2's plain GELU MLP.
    pub ffn_gate: Option<Tensor>,
    pub ffn_up: Tensor,
    pub ffn_up_b: Option<Tensor>,
    pub ffn_down: Tensor,
    pub ffn_down_b: Option<Tensor>,
}

#[derive(Debug, Clone)]
pub struct Weights {
    pub token_embd: Tensor,
    pub pos_embd: Option<Tensor>,
    pub layers: Vec<LayerWeights>,
    pub output_norm: Tensor,
    pub output_norm_b: Option<Tensor>,
    /// The output projection; `token_embd` itself when the embeddings are tied.
    pub output: Tensor,
    /// Llama 3's per-dimension RoPE frequency divisors (`rope_freqs.weight`), if present.
    pub rope_freqs: Option<Tensor>,
}

/// The bytes of a model file: mapped natively, owned in the browser. Never copied.
pub enum Storage {
    Owned(Vec<u8>),
    /// Bytes compiled into the binary (the embedded default model).
    Static(&'static [u8]),
    #[cfg(not(target_arch = "wasm32"))]
    Mapped(memmap2::Mmap),
}

impl std::ops::Deref for Storage {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Storage::Owned(v) => v,
            Storage::Static(s) => s,
            #[cfg(not(target_arch = "wasm32"))]
            Storage::Mapped(m) => m,
        }
    }
}

/// A loaded model: its description and the file bytes the tensors point into.
pub struct Model {
    pub config: Config,
    pub weights: Weights,
    pub storage: Arc<Storage>,
    /// Every tensor of the file, for `info`.
    pub tensors: Vec<Tensor>,
}

impl Model {
    /// Describe the model in `bytes` (a whole GGUF file).
    pub fn from_storage(storage: Storage) -> Result<Model> {
        let gguf = Gguf::parse(&storage)?;
        let config = read_config(&gguf)?;
        let weights = read_weights(&gguf, &config)?;
        let tensors = gguf.tensors.iter().map(Tensor::from_info).collect();
        Ok(Model { config, weights, storage: Arc::new(storage), tensors })
    }

    /// Bytes of weights one decode step reads: every layer's tensors, the output projection, the
    /// output norm, one embedding row (and one position row).
    pub fn weight_bytes_per_token(&self) -> usize {
        let w = &self.weights;
        let mut total = w.output.size_bytes + w.token_embd.row_bytes() + w.output_norm.size_bytes;
        total += w.pos_embd.as_ref().map_or(0, |t| t.row_bytes());
        total += w.output_norm_b.as_ref().map_or(0, |t| t.size_bytes);
        for l in &w.layers {
            let ts = [
                Some(&l.attn_norm),
                l.attn_norm_b.as_ref(),
                l.wq.as_ref(),
                l.wk.as_ref(),
                l.wv.as_ref(),
                l.bq.as_ref(),
                l.bk.as_ref(),
                l.bv.as_ref(),
                l.wqkv.as_ref(),
                l.bqkv.as_ref(),
                Some(&l.wo),
                l.bo.as_ref(),
                Some(&l.ffn_norm),
                l.ffn_norm_b.as_ref(),
                l.ffn_gate.as_ref(),
                Some(&l.ffn_up),
                l.ffn_up_b.as_ref(),
                Some(&l.ffn_down),
                l.ffn_down_b.as_ref(),
            ];
            total += ts.iter().flatten().map(|t| t.size_bytes).sum::<usize>();
        }
        total
    }

    pub fn from_bytes(bytes: Vec<u8>) -> Result<Model> {
        Model::from_storage(Storage::Owned(bytes))
    }

    /// Map and describe the GGUF file at `path`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn open(path: &std::path::Path) -> Result<Model> {
        let io = |source| Error::Io { path: path.display().to_string(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only; a file changed underneath us while it runs gives wrong
        // numbers, not memory unsafety in our code (which only reads bytes).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Model::from_storage(Storage::Mapped(map))
    }

    /// The raw bytes of a tensor.
    pub fn bytes(&self, t: &Tensor) -> &[u8] {
        &self.storage[t.offset..t.offset + t.size_bytes]
    }

    pub fn parameter_count(&self) -> usize {
        self.tensors.iter().map(|t| t.rows * t.cols).sum()
    }
}

fn read_config(g: &Gguf) -> Result<Config> {
    let arch = Arch::from_gguf_name(g.architecture().map_err(|e| Error::Model(e.to_string()))?)?;
    let a = arch.gguf_name();
    let key = |k: &str| format!("{a}.{k}");
    let req = |k: &str| -> Result<usize> {
        let full = key(k);
        match g.get(&full).and_then(Value::as_u64) {
            Some(v) if v > 0 && v <= 1 << 24 => Ok(v as usize),
            Some(v) => Err(Error::Model(format!("{full} = {v} is out of range"))),
            None => Err(Error::Model(format!("missing or non-integer metadata {full}"))),
        }
    };
    let opt_f = |k: &str| g.get(&key(k)).and_then(Value::as_f64);

    let token_embd = g
        .tensor("token_embd.weight")
        .ok_or_else(|| Error::Model("missing tensor token_embd.weight".into()))?;
    let n_embd = req("embedding_length")?;
    let n_vocab = token_embd.rows();
    let n_head = req("attention.head_count")?;
    let n_head_kv = match g.get(&key("attention.head_count_kv")) {
        None => n_head,
        Some(_) => req("attention.head_count_kv")?,
    };
    if n_embd % n_head != 0 && g.get(&key("attention.key_length")).is_none() {
        return Err(Error::Model(format!(
            "embedding length {n_embd} is not a multiple of {n_head} heads"
        )));
    }
    let head_dim = match g.get(&key("attention.key_length")) {
        None => n_embd / n_head,
        Some(_) => req("attention.key_length")?,
    };
    if n_head % n_head_kv != 0 {
        return Err(Error::Model(format!(
            "{n_head} attention heads cannot be shared by {n_head_kv} key/value heads"
        )));
    }
    let (rope, norm_eps_key, add_bos_default) = match arch {
        Arch::Llama => (RopeStyle::Interleaved, "attention.layer_norm_rms_epsilon", true),
        Arch::Qwen2 => (RopeStyle::HalfSplit, "attention.layer_norm_rms_epsilon", false),
        Arch::Gpt2 => (RopeStyle::None, "attention.layer_norm_epsilon", false),
    };
    let rope_dims = match g.get(&key("rope.dimension_count")) {
        None => head_dim,
        Some(_) => req("rope.dimension_count")?,
    };
    if rope != RopeStyle::None && (rope_dims > head_dim || rope_dims % 2 != 0) {
        return Err(Error::Model(format!(
            "rope dimension count {rope_dims} does not fit head size {head_dim}"
        )));
    }
    let token_id = |k: &str| -> Option<u32> {
        g.get(k).and_then(Value::as_u64).filter(|&v| (v as usize) < n_vocab).map(|v| v as u32)
    };
    let bos_token = token_id("tokenizer.ggml.bos_token_id");
    let add_bos =
        g.get("tokenizer.ggml.add_bos_token").and_then(Value::as_bool).unwrap_or(add_bos_default)
            && bos_token.is_some();
    let mut eos_tokens: Vec<u32> = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"]
        .iter()
        .filter_map(|k| token_id(k))
        .collect();
    eos_tokens.dedup();

    let config = Config {
        arch,
        n_vocab,
        n_embd,
        n_layer: req("block_count")?,
        n_head,
        n_head_kv,
        head_dim,
        n_ff: req("feed_forward_length")?,
        n_ctx: req("context_length")?,
        rope,
        rope_theta: opt_f("rope.freq_base").unwrap_or(10000.0) as f32,
        rope_dims,
        norm_eps: opt_f(norm_eps_key).unwrap_or(1e-5) as f32,
        bos_token,
        add_bos,
        eos_tokens,
    };
    if config.n_layer > 1024 {
        return Err(Error::Model(format!("block_count {} is absurd", config.n_layer)));
    }
    Ok(config)
}

fn read_weights(g: &Gguf, c: &Config) -> Result<Weights> {
    // Look a tensor up and check its shape: `[cols, rows]` as GGUF writes it.
    let get = |name: &str, cols: usize, rows: usize| -> Result<Option<Tensor>> {
        let Some(info) = g.tensor(name) else { return Ok(None) };
        let t = Tensor::from_info(info);
        if t.cols != cols || t.rows != rows {
            return Err(Error::Model(format!(
                "tensor {name} has shape {:?}, expected [{cols}, {rows}]",
                info.dims
            )));
        }
        Ok(Some(t))
    };
    let req = |name: &str, cols: usize, rows: usize| -> Result<Tensor> {
        get(name, cols, rows)?.ok_or_else(|| Error::Model(format!("missing tensor {name}")))
    };
    let vector = |name: &str, n: usize| -> Result<Option<Tensor>> {
        let t = get(name, n, 1)?;
        match &t {
            Some(t) if t.ty != GgmlType::F32 => Err(Error::Model(format!(
                "tensor {name} is {}; norms and biases must be F32",
                t.ty.name()
            ))),
            _ => Ok(t),
        }
    };
    let req_vector = |name: &str, n: usize| -> Result<Tensor> {
        vector(name, n)?.ok_or_else(|| Error::Model(format!("missing tensor {name}")))
    };

    let (e, q, kv, ff) = (c.n_embd, c.q_dim(), c.kv_dim(), c.n_ff);
    let is_gpt2 = c.arch == Arch::Gpt2;
    let mut layers = Vec::with_capacity(c.n_layer);
    for i in 0..c.n_layer {
        let n = |s: &str| format!("blk.{i}.{s}");
        let bias = |s: &str, len: usize| if is_gpt2 { vector(&n(s), len) } else { Ok(None) };
        let layer = LayerWeights {
            attn_norm: req_vector(&n("attn_norm.weight"), e)?,
            attn_norm_b: bias("attn_norm.bias", e)?,
            wq: get(&n("attn_q.weight"), e, q)?,
            wk: get(&n("attn_k.weight"), e, kv)?,
            wv: get(&n("attn_v.weight"), e, kv)?,
            bq: vector(&n("attn_q.bias"), q)?,
            bk: vector(&n("attn_k.bias"), kv)?,
            bv: vector(&n("attn_v.bias"), kv)?,
            wqkv: get(&n("attn_qkv.weight"), e, q + 2 * kv)?,
            bqkv: vector(&n("attn_qkv.bias"), q + 2 * kv)?,
            wo: req(&n("attn_output.weight"), q, e)?,
            bo: bias("attn_output.bias", e)?,
            ffn_norm: req_vector(&n("ffn_norm.weight"), e)?,
            ffn_norm_b: bias("ffn_norm.bias", e)?,
            ffn_gate: if is_gpt2 { None } else { Some(req(&n("ffn_gate.weight"), e, ff)?) },
            ffn_up: req(&n("ffn_up.weight"), e, ff)?,
            ffn_up_b: bias("ffn_up.bias", ff)?,
            ffn_down: req(&n("ffn_down.weight"), ff, e)?,
            ffn_down_b: bias("ffn_down.bias", e)?,
        };
        let separate = layer.wq.is_some() && layer.wk.is_some() && layer.wv.is_some();
        if !separate && layer.wqkv.is_none() {
            return Err(Error::Model(format!(
                "layer {i} has neither attn_q/attn_k/attn_v nor a fused attn_qkv weight"
            )));
        }
        if c.arch == Arch::Qwen2 && (layer.bq.is_none() || layer.bk.is_none() || layer.bv.is_none())
        {
            return Err(Error::Model(format!("qwen2 layer {i} is missing its q/k/v biases")));
        }
        layers.push(layer);
    }

    let token_embd = req("token_embd.weight", e, c.n_vocab)?;
    let output = get("output.weight", e, c.n_vocab)?.unwrap_or_else(|| token_embd.clone());
    Ok(Weights {
        pos_embd: if is_gpt2 { Some(req("position_embd.weight", e, c.n_ctx)?) } else { None },
        token_embd,
        layers,
        output_norm: req_vector("output_norm.weight", e)?,
        output_norm_b: if is_gpt2 { vector("output_norm.bias", e)? } else { None },
        output,
        rope_freqs: vector("rope_freqs.weight", c.rope_dims / 2)?,
    })
}
