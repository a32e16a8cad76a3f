//! The CPU reference forward pass: plain Rust, one function per step of the transformer. It is
//! the oracle every GPU kernel is checked against and the fallback where WebGPU is missing.
//!
//! One pass handles a batch of tokens (the whole prompt at prefill, one token per decode step):
//! each weight row is decoded once and multiplied with every token of the batch.

use crate::error::{Error, Result};
use crate::lm::LanguageModel;
use crate::model::{Arch, Model, RopeStyle, Tensor};
use crate::quant::dequantize_row;

/// A model ready to run on the CPU.
pub struct CpuModel {
    pub model: Model,
    /// RoPE inverse frequency of each rotated pair (Llama 3's `rope_freqs` already applied).
    inv_freq: Vec<f32>,
    /// Sequence length the KV cache may grow to (the model's context unless capped).
    max_seq: usize,
}

/// What a sequence has seen so far: the keys and values of every layer at every position.
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    pub pos: usize,
    /// Per layer: `pos` rows of `kv_dim` floats.
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl CpuModel {
    pub fn new(model: Model) -> CpuModel {
        let c = &model.config;
        let half = c.rope_dims / 2;
        let factors = model.weights.rope_freqs.as_ref().map(|t| read_f32(&model, t));
        let inv_freq = (0..half)
            .map(|i| {
                let f = (c.rope_theta as f64).powf(-((2 * i) as f64) / c.rope_dims as f64);
                let divisor = factors.as_ref().map_or(1.0, |f| f[i] as f64);
                (f / divisor) as f32
            })
            .collect();
        let max_seq = c.n_ctx;
        CpuModel { model, inv_freq, max_seq }
    }

    /// Limit the sequence length (models advertise contexts far larger than a demo needs).
    pub fn with_max_seq(mut self, max_seq: usize) -> CpuModel {
        self.max_seq = max_seq.clamp(1, self.model.config.n_ctx);
        self
    }

    /// `out[t][r] = dot(W[r], x[t])` for a batch of `n` token vectors, plus the bias if any.
    fn matmul(&self, w: &Tensor, bias: Option<&Tensor>, x: &[f32], out: &mut [f32]) {
        let n = x.len() / w.cols;
        debug_assert_eq!(out.len(), n * w.rows);
        let bytes = self.model.bytes(w);
        let row_bytes = w.row_bytes();
        let mut row = vec![0f32; w.cols];
        for r in 0..w.rows {
            dequantize_row(w.ty, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut row);
            for t in 0..n {
                out[t * w.rows + r] = dot(&row, &x[t * w.cols..(t + 1) * w.cols]);
            }
        }
        if let Some(b) = bias {
            let b = read_f32(&self.model, b);
            for o in out.chunks_exact_mut(w.rows) {
                add_assign(o, &b);
            }
        }
    }

    /// Run the transformer over `tokens` at positions `cache.pos..`, appending to the cache.
    /// Returns the final hidden states (after the output norm), `tokens.len()` rows of n_embd.
    fn forward_hidden(&self, cache: &mut KvCache, tokens: &[u32]) -> Vec<f32> {
        let m = &self.model;
        let c = &m.config;
        let w = &m.weights;
        let (n, e) = (tokens.len(), c.n_embd);
        let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
        let pos0 = cache.pos;

        // Embedding lookup: decode the token's row (works for quantised embeddings too).
        let mut x = vec![0f32; n * e];
        let embd_bytes = m.bytes(&w.token_embd);
        let rb = w.token_embd.row_bytes();
        for (t, &tok) in tokens.iter().enumerate() {
            let id = tok as usize;
            dequantize_row(w.token_embd.ty, &embd_bytes[id * rb..(id + 1) * rb], &mut x[t * e..(t + 1) * e]);
        }
        if let Some(pe) = &w.pos_embd {
            let (bytes, rb) = (m.bytes(pe), pe.row_bytes());
            let mut row = vec![0f32; e];
            for t in 0..n {
                let p = pos0 + t;
                dequantize_row(pe.ty, &bytes[p * rb..(p + 1) * rb], &mut row);
                add_assign(&mut x[t * e..(t + 1) * e], &row);
            }
        }

        if cache.k.is_empty() {
            cache.k = vec![Vec::new(); c.n_layer];
            cache.v = vec![Vec::new(); c.n_layer];
        }
        let mut h = vec![0f32; n * e];
        let mut q = vec![0f32; n * q_dim];
        let mut k = vec![0f32; n * kv_dim];
        let mut v = vec![0f32; n * kv_dim];
        let mut attn = vec![0f32; n * q_dim];
        let mut proj = vec![0f32; n * e];
        let mut up = vec![0f32; n * c.n_ff];
        let mut gate = vec![0f32; n * c.n_ff];

        for (l, lw) in w.layers.iter().enumerate() {
            // Attention block.
            self.norm(&x, &lw.attn_norm, lw.attn_norm_b.as_ref(), &mut h);
            if let Some(wqkv) = &lw.wqkv {
                let mut qkv = vec![0f32; n * wqkv.rows];
                self.matmul(wqkv, lw.bqkv.as_ref(), &h, &mut qkv);
                for (t, row) in qkv.chunks_exact(wqkv.rows).enumerate() {
                    q[t * q_dim..(t + 1) * q_dim].copy_from_slice(&row[..q_dim]);
                    k[t * kv_dim..(t + 1) * kv_dim].copy_from_slice(&row[q_dim..q_dim + kv_dim]);
                    v[t * kv_dim..(t + 1) * kv_dim].copy_from_slice(&row[q_dim + kv_dim..]);
                }
            } else {
                fn get(t: &Option<Tensor>) -> &Tensor {
                    t.as_ref().expect("checked at load")
                }
                self.matmul(get(&lw.wq), lw.bq.as_ref(), &h, &mut q);
                self.matmul(get(&lw.wk), lw.bk.as_ref(), &h, &mut k);
                self.matmul(get(&lw.wv), lw.bv.as_ref(), &h, &mut v);
            }
            for t in 0..n {
                self.rope(&mut q[t * q_dim..(t + 1) * q_dim], pos0 + t);
                self.rope(&mut k[t * kv_dim..(t + 1) * kv_dim], pos0 + t);
            }
            cache.k[l].extend_from_slice(&k);
            cache.v[l].extend_from_slice(&v);
            attention(c.n_head, c.n_head_kv, c.head_dim, pos0, &q, &cache.k[l], &cache.v[l], &mut attn);
            self.matmul(&lw.wo, lw.bo.as_ref(), &attn, &mut proj);
            add_assign(&mut x, &proj);

            // Feed-forward block.
            self.norm(&x, &lw.ffn_norm, lw.ffn_norm_b.as_ref(), &mut h);
            self.matmul(&lw.ffn_up, lw.ffn_up_b.as_ref(), &h, &mut up);
            match &lw.ffn_gate {
                Some(g) => {
                    self.matmul(g, None, &h, &mut gate);
                    for (u, g) in up.iter_mut().zip(&gate) {
                        *u *= silu(*g);
                    }
                }
                None => up.iter_mut().for_each(|u| *u = gelu(*u)),
            }
            self.matmul(&lw.ffn_down, lw.ffn_down_b.as_ref(), &up, &mut proj);
            add_assign(&mut x, &proj);
        }
        cache.pos += n;

        self.norm(&x, &w.output_norm, w.output_norm_b.as_ref(), &mut h);
        h
    }

    /// RMSNorm (llama, qwen2) or LayerNorm with bias (gpt2), row by row.
    fn norm(&self, x: &[f32], weight: &Tensor, bias: Option<&Tensor>, out: &mut [f32]) {
        let e = self.model.config.n_embd;
        let eps = self.model.config.norm_eps;
        let wt = read_f32(&self.model, weight);
        let b = bias.map(|b| read_f32(&self.model, b));
        let layer_norm = self.model.config.arch == Arch::Gpt2;
        for (xr, o) in x.chunks_exact(e).zip(out.chunks_exact_mut(e)) {
            if layer_norm {
                let mean = xr.iter().sum::<f32>() / e as f32;
                let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / e as f32;
                let inv = 1.0 / (var + eps).sqrt();
                for i in 0..e {
                    o[i] = (xr[i] - mean) * inv * wt[i] + b.as_ref().map_or(0.0, |b| b[i]);
                }
            } else {
                let ms = xr.iter().map(|v| v * v).sum::<f32>() / e as f32;
                let inv = 1.0 / (ms + eps).sqrt();
                for i in 0..e {
                    o[i] = xr[i] * inv * wt[i];
                }
            }
        }
    }

    /// Rotate every head of one token's q or k vector by its position.
    fn rope(&self, x: &mut [f32], pos: usize) {
        let c = &self.model.config;
        let half = c.rope_dims / 2;
        for head in x.chunks_exact_mut(c.head_dim) {
            for i in 0..half {
                let angle = pos as f32 * self.inv_freq[i];
                let (sin, cos) = angle.sin_cos();
                let (a, b) = match c.rope {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::HalfSplit => (i, i + half),
                    RopeStyle::None => return,
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos - x1 * sin;
                head[b] = x0 * sin + x1 * cos;
            }
        }
    }

    fn check_tokens(&self, pos: usize, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::Input("no tokens to run".into()));
        }
        if pos + tokens.len() > self.max_seq {
            return Err(Error::Input(format!(
                "{} tokens after {pos} would exceed the context of {} tokens",
                tokens.len(),
                self.max_seq
            )));
        }
        let n_vocab = self.model.config.n_vocab;
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(Error::Input(format!("token id {bad} is outside the vocabulary of {n_vocab}")));
        }
        Ok(())
    }
}

impl LanguageModel for CpuModel {
    type State = KvCache;

    fn vocab_size(&self) -> usize {
        self.model.config.n_vocab
    }
    fn context_length(&self) -> usize {
        self.max_seq
    }
    fn bos_token(&self) -> Option<u32> {
        let c = &self.model.config;
        c.bos_token.filter(|_| c.add_bos)
    }
    fn eos_tokens(&self) -> &[u32] {
        &self.model.config.eos_tokens
    }
    fn new_state(&self) -> KvCache {
        KvCache::default()
    }
    fn position(&self, state: &KvCache) -> usize {
        state.pos
    }

    fn forward(&self, state: &mut KvCache, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        self.check_tokens(state.pos, tokens)?;
        let hidden = self.forward_hidden(state, tokens);
        let e = self.model.config.n_embd;
        let rows = if all_logits { &hidden[..] } else { &hidden[hidden.len() - e..] };
        let mut logits = vec![0f32; rows.len() / e * self.model.config.n_vocab];
        self.matmul(&self.model.weights.output, None, rows, &mut logits);
        Ok(logits)
    }
}

/// Causal self-attention for a batch of `n` queries at positions `pos0..pos0+n`, against a cache
/// holding keys/values for positions `0..pos0+n`. Query head h reads key/value head
/// `h / (n_head / n_head_kv)` (grouped-query attention). The causal mask is the loop bound:
/// query t sees positions `0..=pos0+t`.
#[allow(clippy::too_many_arguments)]
fn attention(
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    pos0: usize,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    out: &mut [f32],
) {
    let (q_dim, kv_dim) = (n_head * head_dim, n_head_kv * head_dim);
    let group = n_head / n_head_kv;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let n = q.len() / q_dim;
    let mut scores = vec![0f32; pos0 + n];
    for t in 0..n {
        let seen = pos0 + t + 1;
        for h in 0..n_head {
            let kvh = h / group;
            let qh = &q[t * q_dim + h * head_dim..][..head_dim];
            for (p, s) in scores[..seen].iter_mut().enumerate() {
                *s = dot(qh, &k_cache[p * kv_dim + kvh * head_dim..][..head_dim]) * scale;
            }
            softmax_in_place(&mut scores[..seen]);
            let o = &mut out[t * q_dim + h * head_dim..][..head_dim];
            o.fill(0.0);
            for (p, &s) in scores[..seen].iter().enumerate() {
                let vp = &v_cache[p * kv_dim + kvh * head_dim..][..head_dim];
                for (oi, vi) in o.iter_mut().zip(vp) {
                    *oi += s * vi;
                }
            }
        }
    }
}

/// Softmax with the maximum subtracted first, so large scores do not overflow.
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn add_assign(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation (GPT-2's "gelu_new", and what ggml computes).
fn gelu(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
}

/// A small F32 tensor (norm weight, bias) as floats.
fn read_f32(model: &Model, t: &Tensor) -> Vec<f32> {
    let mut out = vec![0f32; t.rows * t.cols];
    dequantize_row(t.ty, model.bytes(t), &mut out);
    out
}
