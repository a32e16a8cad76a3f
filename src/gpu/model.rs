//! The transformer on the GPU: every weight uploaded once in its GGUF encoding, activations
//! allocated once, and each `forward` recorded into one command buffer and one submission. It
//! follows `cpu.rs` step by step (same RoPE table, same norms, same order of operations), so the
//! CPU path is its oracle.

use std::collections::HashMap;
use std::sync::Arc;

use super::context::{gpu_err, GpuContext};
use super::kernels::{readback, upload, Kernel, Kernels, Pass, MAX_HEAD_DIM};
use super::ops::{self, floats, GpuTensor, Out, RopeMode};
use crate::error::{Error, Result};
use crate::lm::LanguageModel;
use crate::model::{Arch, Model, RopeStyle, Tensor};
use crate::quant::dequantize_row;

/// Most tokens one pass over the layers handles (longer prompts run in several, in one submission).
const MAX_BATCH: usize = 64;

struct Layer {
    attn_norm: Arc<GpuTensor>,
    attn_norm_b: Option<Arc<GpuTensor>>,
    /// q, k, v projections (or the one fused qkv) with their biases and the column of the
    /// qkv activation they write at.
    qkv: Vec<(Arc<GpuTensor>, Option<Arc<GpuTensor>>, usize)>,
    wo: Arc<GpuTensor>,
    bo: Option<Arc<GpuTensor>>,
    ffn_norm: Arc<GpuTensor>,
    ffn_norm_b: Option<Arc<GpuTensor>>,
    gate: Option<Arc<GpuTensor>>,
    up: Arc<GpuTensor>,
    up_b: Option<Arc<GpuTensor>>,
    down: Arc<GpuTensor>,
    down_b: Option<Arc<GpuTensor>>,
}

/// Activations for up to `batch` tokens, reused by every pass.
struct Scratch {
    x: wgpu::Buffer,
    h: wgpu::Buffer,
    qkv: wgpu::Buffer,
    q: wgpu::Buffer,
    attn: wgpu::Buffer,
    proj: wgpu::Buffer,
    up: wgpu::Buffer,
    gate: wgpu::Buffer,
    logits: wgpu::Buffer,
    /// Zeros of n_embd: the bias of a LayerNorm that has none; also the stand-in for absent biases.
    zeros: wgpu::Buffer,
}

/// A model ready to run on the GPU.
pub struct GpuModel {
    pub model: Model,
    ctx: Arc<GpuContext>,
    kernels: Kernels,
    token_embd: Arc<GpuTensor>,
    pos_embd: Option<Arc<GpuTensor>>,
    layers: Vec<Layer>,
    output_norm: Arc<GpuTensor>,
    output_norm_b: Option<Arc<GpuTensor>>,
    output: Arc<GpuTensor>,
    inv_freq: Vec<f32>,
    max_seq: usize,
    batch: usize,
    scratch: Scratch,
}

/// The KV cache of one sequence, on the GPU: per layer, `max_seq` rows of kv_dim floats for keys
/// and for values. Cloning copies the filled rows on the GPU (for beam search).
pub struct GpuState {
    pub pos: usize,
    k: Vec<wgpu::Buffer>,
    v: Vec<wgpu::Buffer>,
    row_bytes: u64,
    ctx: Arc<GpuContext>,
}

impl GpuState {
    fn alloc(ctx: &Arc<GpuContext>, n_layer: usize, max_seq: usize, kv_dim: usize) -> GpuState {
        let bytes = (max_seq * kv_dim * 4) as u64;
        let mk = |name: &str| (0..n_layer).map(|_| super::kernels::storage(ctx, name, bytes)).collect();
        GpuState { pos: 0, k: mk("k cache"), v: mk("v cache"), row_bytes: (kv_dim * 4) as u64, ctx: ctx.clone() }
    }
}

impl Clone for GpuState {
    fn clone(&self) -> GpuState {
        let ctx = &self.ctx;
        let bytes = self.k.first().map_or(16, |b| b.size());
        let mk = |name: &str| -> Vec<wgpu::Buffer> {
            (0..self.k.len()).map(|_| super::kernels::storage(ctx, name, bytes)).collect()
        };
        let (k, v) = (mk("k cache"), mk("v cache"));
        let used = self.pos as u64 * self.row_bytes;
        if used > 0 {
            let mut enc = ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("clone kv") });
            for (src, dst) in self.k.iter().zip(&k).chain(self.v.iter().zip(&v)) {
                enc.copy_buffer_to_buffer(src, 0, dst, 0, used);
            }
            ctx.queue.submit([enc.finish()]);
        }
        GpuState { pos: self.pos, k, v, row_bytes: self.row_bytes, ctx: ctx.clone() }
    }
}

impl GpuModel {
    /// Open the GPU and upload `model` (native; blocks).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn new(model: Model) -> Result<GpuModel> {
        pollster::block_on(async { GpuModel::with_context(GpuContext::new_async().await?, model).await })
    }

    /// Upload `model` to the device of `ctx` and compile its kernels.
    pub async fn with_context(ctx: Arc<GpuContext>, model: Model) -> Result<GpuModel> {
        let c = model.config.clone();
        let w = &model.weights;
        if c.head_dim > MAX_HEAD_DIM {
            return Err(gpu_err(format!("head size {} exceeds the kernels' {MAX_HEAD_DIM}", c.head_dim)));
        }
        let mut cache: HashMap<(usize, usize), Arc<GpuTensor>> = HashMap::new();
        let mut up = |t: &Tensor| -> Result<Arc<GpuTensor>> {
            if let Some(g) = cache.get(&(t.offset, t.size_bytes)) {
                return Ok(g.clone());
            }
            let g = Arc::new(GpuTensor::upload(&ctx, &t.name, t.ty, t.rows, t.cols, model.bytes(t))?);
            cache.insert((t.offset, t.size_bytes), g.clone());
            Ok(g)
        };
        let opt = |t: &Option<Tensor>, up: &mut dyn FnMut(&Tensor) -> Result<Arc<GpuTensor>>| {
            t.as_ref().map(&mut *up).transpose()
        };
        let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
        let mut layers = Vec::with_capacity(c.n_layer);
        for lw in &w.layers {
            let qkv = match &lw.wqkv {
                Some(wqkv) => vec![(up(wqkv)?, opt(&lw.bqkv, &mut up)?, 0)],
                None => {
                    let get = |t: &Option<Tensor>| t.clone().expect("checked at load");
                    vec![
                        (up(&get(&lw.wq))?, opt(&lw.bq, &mut up)?, 0),
                        (up(&get(&lw.wk))?, opt(&lw.bk, &mut up)?, q_dim),
                        (up(&get(&lw.wv))?, opt(&lw.bv, &mut up)?, q_dim + kv_dim),
                    ]
                }
            };
            layers.push(Layer {
                attn_norm: up(&lw.attn_norm)?,
                attn_norm_b: opt(&lw.attn_norm_b, &mut up)?,
                qkv,
                wo: up(&lw.wo)?,
                bo: opt(&lw.bo, &mut up)?,
                ffn_norm: up(&lw.ffn_norm)?,
                ffn_norm_b: opt(&lw.ffn_norm_b, &mut up)?,
                gate: opt(&lw.ffn_gate, &mut up)?,
                up: up(&lw.ffn_up)?,
                up_b: opt(&lw.ffn_up_b, &mut up)?,
                down: up(&lw.ffn_down)?,
                down_b: opt(&lw.ffn_down_b, &mut up)?,
            });
        }
        let token_embd = up(&w.token_embd)?;
        let pos_embd = opt(&w.pos_embd, &mut up)?;
        let output_norm = up(&w.output_norm)?;
        let output_norm_b = opt(&w.output_norm_b, &mut up)?;
        let output = up(&w.output)?;

        // RoPE inverse frequencies exactly as cpu.rs computes them.
        let half = c.rope_dims / 2;
        let factors = w.rope_freqs.as_ref().map(|t| {
            let mut out = vec![0f32; t.rows * t.cols];
            dequantize_row(t.ty, model.bytes(t), &mut out);
            out
        });
        let inv_freq = (0..half)
            .map(|i| {
                let f = (c.rope_theta as f64).powf(-((2 * i) as f64) / c.rope_dims as f64);
                let divisor = factors.as_ref().map_or(1.0, |f| f[i] as f64);
                (f / divisor) as f32
            })
            .collect();

        let limit = ctx.max_binding();
        let widest = [c.n_embd, q_dim + 2 * kv_dim, c.n_ff, c.n_vocab].into_iter().max().unwrap_or(1);
        let batch = ((limit / (widest as u64 * 4)) as usize).clamp(1, MAX_BATCH);
        let max_seq = c.n_ctx.min((limit / (kv_dim as u64 * 4)) as usize).max(1);
        let scratch = Scratch {
            x: floats(&ctx, "x", batch * c.n_embd),
            h: floats(&ctx, "h", batch * c.n_embd),
            qkv: floats(&ctx, "qkv", batch * (q_dim + 2 * kv_dim)),
            q: floats(&ctx, "q", batch * q_dim),
            attn: floats(&ctx, "attn", batch * q_dim),
            proj: floats(&ctx, "proj", batch * c.n_embd),
            up: floats(&ctx, "up", batch * c.n_ff),
            gate: floats(&ctx, "gate", batch * c.n_ff),
            logits: floats(&ctx, "logits", batch * c.n_vocab),
            zeros: floats(&ctx, "zeros", c.n_embd.max(4)),
        };

        let kernels = Kernels::new(ctx.clone());
        let mut needed = vec![Kernel::Rope, Kernel::Attention, Kernel::Add, Kernel::Embedding(token_embd.ty)];
        needed.push(if c.arch == Arch::Gpt2 { Kernel::LayerNorm } else { Kernel::RmsNorm });
        needed.push(if c.arch == Arch::Gpt2 { Kernel::Gelu } else { Kernel::SiluMul });
        if let Some(p) = &pos_embd {
            needed.push(Kernel::Embedding(p.ty));
        }
        for t in cache.values() {
            needed.push(Kernel::Matmul(t.ty));
        }
        needed.sort_by_key(|k| format!("{k:?}"));
        needed.dedup();
        kernels.prepare(&needed).await?;

        Ok(GpuModel {
            model,
            ctx,
            kernels,
            token_embd,
            pos_embd,
            layers,
            output_norm,
            output_norm_b,
            output,
            inv_freq,
            max_seq,
            batch,
            scratch,
        })
    }

    /// Limit the sequence length (and so the KV cache each state allocates).
    pub fn with_max_seq(mut self, max_seq: usize) -> GpuModel {
        self.max_seq = max_seq.clamp(1, self.max_seq);
        self
    }

    pub fn context(&self) -> &Arc<GpuContext> {
        &self.ctx
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

    /// [`LanguageModel::forward`], awaitable (the only way in the browser).
    pub async fn forward_async(&self, state: &mut GpuState, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        self.check_tokens(state.pos, tokens)?;
        let c = &self.model.config;
        let ctx = &self.ctx;
        let (n, vocab, pos0) = (tokens.len(), c.n_vocab, state.pos);

        let ids_bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let ids = upload(ctx, "ids", &ids_bytes);
        // (cos, sin) per token and rotated pair, from the same f32 arithmetic as cpu.rs.
        let mut table = Vec::with_capacity(n * self.inv_freq.len() * 2);
        for t in 0..n {
            for &f in &self.inv_freq {
                let (sin, cos) = ((pos0 + t) as f32 * f).sin_cos();
                table.extend_from_slice(&[cos, sin]);
            }
        }
        let table_bytes: Vec<u8> = table.iter().flat_map(|x| x.to_le_bytes()).collect();
        let table = upload(ctx, "rope table", &table_bytes);
        let out_rows = if all_logits { n } else { 1 };
        let row_bytes = (vocab * 4) as u64;
        let rb = readback(ctx, out_rows as u64 * row_bytes);

        let mut pass = Pass::new(&self.kernels);
        let mut start = 0;
        while start < n {
            let len = self.batch.min(n - start);
            self.encode_layers(&mut pass, state, &ids, &table, start, len, pos0 + start);
            let s = &self.scratch;
            let logits = Out { buf: &s.logits, stride: vocab, col0: 0 };
            if all_logits {
                ops::matmul(&mut pass, &self.output, None, &s.zeros, &s.h, 0, len, logits);
                pass.copy(&s.logits, 0, &rb, start as u64 * row_bytes, len as u64 * row_bytes);
            } else if start + len == n {
                ops::matmul(&mut pass, &self.output, None, &s.zeros, &s.h, len - 1, 1, logits);
                pass.copy(&s.logits, 0, &rb, 0, row_bytes);
            }
            start += len;
        }
        pass.submit();
        let bytes = ctx.read_buffer(&rb).await?;
        state.pos += n;
        Ok(bytes[..out_rows * vocab * 4]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// Record the layers for `len` tokens (call tokens `start..`, positions `p0..`), leaving the
    /// normed final hidden states in `scratch.h`.
    #[allow(clippy::too_many_arguments)]
    fn encode_layers<'a>(
        &'a self,
        pass: &mut Pass<'a>,
        state: &'a GpuState,
        ids: &'a wgpu::Buffer,
        table: &'a wgpu::Buffer,
        start: usize,
        len: usize,
        p0: usize,
    ) {
        let c = &self.model.config;
        let s = &self.scratch;
        let (e, hd, ff) = (c.n_embd, c.head_dim, c.n_ff);
        let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
        let qkv_w = q_dim + 2 * kv_dim;
        let layer_norm = c.arch == Arch::Gpt2;
        let mode = match c.rope {
            RopeStyle::Interleaved => RopeMode::Interleaved,
            RopeStyle::HalfSplit => RopeMode::HalfSplit,
            RopeStyle::None => RopeMode::Copy,
        };
        let bias = |b: &'a Option<Arc<GpuTensor>>| b.as_ref().map(|b| b.buffer());
        let norm_bias = |b: &'a Option<Arc<GpuTensor>>| Some(bias(b).unwrap_or(&s.zeros));

        ops::embedding(pass, &self.token_embd, ids, start, None, len, false, &s.x);
        if let Some(pe) = &self.pos_embd {
            ops::embedding(pass, pe, ids, 0, Some(p0), len, true, &s.x);
        }
        for (l, lw) in self.layers.iter().enumerate() {
            ops::norm(pass, &s.x, lw.attn_norm.buffer(), norm_bias(&lw.attn_norm_b), layer_norm, e, len, c.norm_eps, &s.h);
            for (w, b, col0) in &lw.qkv {
                let out = Out { buf: &s.qkv, stride: qkv_w, col0: *col0 };
                ops::matmul(pass, w, bias(b), &s.zeros, &s.h, 0, len, out);
            }
            let rd = c.rope_dims;
            ops::rope(pass, mode, &s.qkv, qkv_w, 0, table, start, len, c.n_head, hd, rd, &s.q, 0);
            ops::rope(pass, mode, &s.qkv, qkv_w, q_dim, table, start, len, c.n_head_kv, hd, rd, &state.k[l], p0);
            ops::rope(pass, RopeMode::Copy, &s.qkv, qkv_w, q_dim + kv_dim, table, start, len, c.n_head_kv, hd, rd, &state.v[l], p0);
            ops::attention(pass, &s.q, &state.k[l], &state.v[l], len, c.n_head, c.n_head_kv, hd, p0, &s.attn);
            ops::matmul(pass, &lw.wo, bias(&lw.bo), &s.zeros, &s.attn, 0, len, Out { buf: &s.proj, stride: e, col0: 0 });
            ops::add(pass, &s.proj, &s.x, len * e);

            ops::norm(pass, &s.x, lw.ffn_norm.buffer(), norm_bias(&lw.ffn_norm_b), layer_norm, e, len, c.norm_eps, &s.h);
            ops::matmul(pass, &lw.up, bias(&lw.up_b), &s.zeros, &s.h, 0, len, Out { buf: &s.up, stride: ff, col0: 0 });
            match &lw.gate {
                Some(g) => {
                    ops::matmul(pass, g, None, &s.zeros, &s.h, 0, len, Out { buf: &s.gate, stride: ff, col0: 0 });
                    ops::silu_mul(pass, &s.gate, &s.up, len * ff);
                }
                None => ops::gelu(pass, &s.up, len * ff),
            }
            ops::matmul(pass, &lw.down, bias(&lw.down_b), &s.zeros, &s.up, 0, len, Out { buf: &s.proj, stride: e, col0: 0 });
            ops::add(pass, &s.proj, &s.x, len * e);
        }
        let ob = norm_bias(&self.output_norm_b);
        ops::norm(pass, &s.x, self.output_norm.buffer(), ob, layer_norm, e, len, c.norm_eps, &s.h);
    }
}

impl LanguageModel for GpuModel {
    type State = GpuState;

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
    fn new_state(&self) -> GpuState {
        let c = &self.model.config;
        GpuState::alloc(&self.ctx, c.n_layer, self.max_seq, c.kv_dim())
    }
    fn position(&self, state: &GpuState) -> usize {
        state.pos
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn forward(&self, state: &mut GpuState, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        pollster::block_on(self.forward_async(state, tokens, all_logits))
    }

    /// The browser cannot block on the GPU: use [`GpuModel::forward_async`].
    #[cfg(target_arch = "wasm32")]
    fn forward(&self, _state: &mut GpuState, _tokens: &[u32], _all_logits: bool) -> Result<Vec<f32>> {
        Err(gpu_err("in the browser the GPU model runs through forward_async"))
    }
}
