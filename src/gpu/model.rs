//! The transformer on the GPU: every weight uploaded once in its GGUF encoding, activations
//! allocated once, and each `forward` recorded into one command buffer and one submission. The
//! model description (`crate::model`: norm, MLP, q/k/v layout, the RoPE table) decides what to
//! compute, as for the CPU path in `crate::cpu`, which is this path's oracle.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::context::{gpu_err, GpuContext};
use super::kernels::{
    by_family, readback, BindCache, Binder, DispatchTime, FamilyTime, Kernel, Kernels, Pass, Tile,
    Timestamps, Timing, MATVEC_TOKENS, MAX_HEAD_DIM, MAX_TOP_K,
};
use super::ops::{
    self, floats, AttentionShape, Columns, Epilogue, Fused, GpuTensor, Heads, KvBuffers, Lookup,
    Matvec, NormIn, NormOp, Out, QkvOut, RopeMode, RopeOut, Rows, TiledOpts, Tokens, TopkBuffers,
};
use super::stream::{Dest, Filler, Pending};
use crate::constraint::AllowedSet;
use crate::error::{Error, Result};
use crate::lm::AllowedTop;
use crate::lm::LanguageModel;
pub use crate::lm::TopK;
use crate::model::{Ffn, Mlp, Model, Norm, NormWeights, Qkv, RopeStyle, Tensor, Weights};

/// Most tokens one pass over the layers handles (longer prompts run in several, in one
/// submission): large, because each pass reads every weight once and the tiled products need
/// hundreds of workgroups (tokens / 64 of them per 64 rows) to fill a large GPU.
const MAX_BATCH: usize = 512;
/// Most rows of logits computed at once (a prefill that returns every token's logits computes
/// them in pieces of this many, so the logits buffer stays small for large vocabularies).
const MAX_LOGIT_ROWS: usize = 64;

/// Activations for up to `batch` tokens, reused by every pass.
struct Scratch {
    /// The residual stream.
    x: wgpu::Buffer,
    /// Normed activations (prefill; decode norms inside the products).
    h: wgpu::Buffer,
    qkv: wgpu::Buffer,
    q: wgpu::Buffer,
    /// Attention's per-chunk partial results.
    chunks: wgpu::Buffer,
    attn: wgpu::Buffer,
    /// The MLP's hidden activations.
    up: wgpu::Buffer,
    /// gate|up side by side (prefill).
    gate_up: wgpu::Buffer,
    logits: wgpu::Buffer,
    /// Zeros of n_embd: the bias of a LayerNorm that has none.
    zeros: wgpu::Buffer,
    /// The KV cache binding of products that write none.
    no_kv: wgpu::Buffer,
}

/// A norm's weights (and LayerNorm's bias) as float offsets in the vectors buffer.
#[derive(Clone, Copy)]
pub(super) struct NormAt {
    weight: usize,
    bias: Option<usize>,
}

/// What the GPU adds to a layer's description: which products are packed into one buffer (so
/// one dispatch computes them) and where the layer's small vectors are in the vectors buffer.
pub(super) struct LayerPlan {
    /// The q|k|v products as (tensor, first row within q|k|v): one when packed or fused in the
    /// file, more when q, k and v differ in type.
    qkv: Vec<(Arc<GpuTensor>, usize)>,
    /// gate|up packed in one buffer, for a gated MLP whose two weights share a type.
    gate_up: Option<Arc<GpuTensor>>,
    attn_norm: NormAt,
    ffn_norm: NormAt,
    /// Biases: q|k|v side by side, the output projection, the MLP's up (and gate), down.
    qkv_bias: Option<usize>,
    attn_output_bias: Option<usize>,
    up_bias: Option<usize>,
    gate_bias: Option<usize>,
    down_bias: Option<usize>,
}

/// The weights' GPU buffers, each tensor given one once (a tied output projection shares its
/// embedding's buffer), keyed by its place in the file; where each tensor's bytes go is recorded
/// in `fill`, which writes them as the file's bytes come (all at once, or streamed).
struct Uploads<'m> {
    ctx: &'m GpuContext,
    cache: HashMap<(usize, usize), Arc<GpuTensor>>,
    fill: &'m mut Filler,
}

impl Uploads<'_> {
    fn key(t: &Tensor) -> (usize, usize) {
        (t.offset, t.size_bytes)
    }

    fn one(&mut self, t: &Tensor) -> Result<Arc<GpuTensor>> {
        if let Some(g) = self.cache.get(&Uploads::key(t)) {
            return Ok(g.clone());
        }
        let g = GpuTensor::alloc(self.ctx, &t.name, t.ty, t.rows, t.cols, t.size_bytes)?;
        for p in &g.parts {
            let len = p.rows * g.row_bytes;
            let buf = self.fill.add_buffer(p.buffer.clone(), len);
            let start = t.offset + p.row0 * g.row_bytes;
            self.fill.place(&t.name, start, len, Dest::Buffer { buf, at: 0 });
        }
        let g = Arc::new(g);
        self.cache.insert(Uploads::key(t), g.clone());
        Ok(g)
    }

    /// Tensors whose rows one product covers (q|k|v, gate|up): each run of one type and row
    /// length packed into one buffer (the tensors become views of it). Returns the products as
    /// (tensor, first row): one when all share a type; more when, as in Q4_K_M files, they differ.
    fn packed(&mut self, ts: &[&Tensor]) -> Result<Vec<(Arc<GpuTensor>, usize)>> {
        let mut products = Vec::new();
        let mut row0 = 0;
        for run in ts.chunk_by(|a, b| a.ty == b.ty && a.cols == b.cols) {
            let pieces: Vec<_> =
                run.iter().map(|t| (t.name.as_str(), t.rows, t.size_bytes)).collect();
            let packed = (run.len() > 1)
                .then(|| GpuTensor::alloc_packed(self.ctx, run[0].ty, run[0].cols, &pieces))
                .flatten();
            match packed {
                Some((whole, views)) => {
                    let part = &whole.parts[0];
                    let buf =
                        self.fill.add_buffer(part.buffer.clone(), whole.rows * whole.row_bytes);
                    for (t, view) in run.iter().zip(views) {
                        let at = view.parts[0].byte0 as u64;
                        self.fill.place(&t.name, t.offset, t.size_bytes, Dest::Buffer { buf, at });
                        self.cache.insert(Uploads::key(t), Arc::new(view));
                    }
                    products.push((Arc::new(whole), row0));
                }
                None => {
                    for (i, t) in run.iter().enumerate() {
                        let at = row0 + run[..i].iter().map(|t| t.rows).sum::<usize>();
                        products.push((self.one(t)?, at));
                    }
                }
            }
            row0 += run.iter().map(|t| t.rows).sum::<usize>();
        }
        Ok(products)
    }
}

/// The small vectors of a model (norm weights and biases, projection biases) decoded to f32 in
/// one buffer, so a fused product binds one buffer for all of them: their offsets (in floats),
/// and which tensor fills each.
#[derive(Default)]
struct Vectors {
    len: usize,
    /// (tensor, offset in floats).
    placed: Vec<(Tensor, usize)>,
}

impl Vectors {
    fn add(&mut self, t: &Tensor) -> usize {
        let at = self.len;
        self.len += t.rows * t.cols;
        self.placed.push((t.clone(), at));
        at
    }

    /// `n` zeros (a missing bias among q, k and v); their offset.
    fn zeros(&mut self, n: usize) -> usize {
        let at = self.len;
        self.len += n;
        at
    }

    fn norm(&mut self, n: &NormWeights) -> NormAt {
        NormAt { weight: self.add(&n.weight), bias: n.bias.as_ref().map(|b| self.add(b)) }
    }
}

/// How to run a model on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuOptions {
    /// Keep the KV cache in f16 (half the memory and bandwidth of attention; needs the device's
    /// `shader-f16`). Logits then differ from the CPU's by up to about 1e-2 instead of 1e-5.
    pub f16_kv: bool,
    /// Prefill's tiled products in f16 (needs `shader-f16`): weights and activations rounded to
    /// f16 in workgroup memory, each block of 32 products summed in f16, the blocks in f32. Half
    /// the workgroup memory per element and packed half-precision arithmetic; the logits move
    /// by about as much as with the f16 KV cache.
    pub f16_prefill: bool,
}

impl GpuOptions {
    /// The default for `ctx`: f16 (KV cache and prefill products) where the device has
    /// `shader-f16`, unless the environment variable `NEXTTOKEN_GPU_F16=0` forces the f32 path.
    pub fn auto(ctx: &GpuContext) -> GpuOptions {
        let env_off = cfg!(not(target_arch = "wasm32"))
            && std::env::var("NEXTTOKEN_GPU_F16").is_ok_and(|v| v == "0");
        let h = ctx.shader_f16 && !env_off;
        GpuOptions { f16_kv: h, f16_prefill: h }
    }

    /// Everything in f32: the path whose logits match the CPU's to about 1e-5.
    pub fn f32() -> GpuOptions {
        GpuOptions { f16_kv: false, f16_prefill: false }
    }

    /// Everything f16 can do (the device must have `shader-f16`).
    pub fn f16() -> GpuOptions {
        GpuOptions { f16_kv: true, f16_prefill: true }
    }
}

/// Counters for benchmarks and checks (see [`GpuModel::stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuStats {
    /// Kernel dispatches recorded by the last forward (for a one-token forward: per decode step).
    pub dispatches_last: usize,
    /// Command buffer submissions of the last forward (one: a forward is recorded whole).
    pub submissions_last: usize,
    /// Bytes the last forward read back from the GPU: the full logits row, or for the top-k and
    /// greedy forwards only the picks.
    pub readback_bytes_last: u64,
    /// Bytes of GPU buffers this model holds: weights, activations, parameters, step and
    /// read-back buffers (not the KV caches, which belong to the states).
    pub model_bytes: u64,
    /// Bytes of the KV cache each state allocates.
    pub kv_bytes_per_state: u64,
    /// Bind groups created so far by this model (stops growing once each kind of step has run).
    pub bind_groups_created: u64,
    /// Buffers created so far on this model's device (by anything: also grows with states).
    pub buffers_created: u64,
    /// Bytes of kernel parameters uploaded so far (stops growing across decode steps).
    pub param_bytes_written: u64,
    /// Whether the KV cache is f16.
    pub f16_kv: bool,
    /// Whether prefill's tiled products are f16.
    pub f16_prefill: bool,
}

/// Buffers made on the first forward (sized by the final `max_seq`) and the per-step machinery.
#[derive(Default)]
struct Runtime {
    /// (cos, sin) of every rotated pair at every position, filled as positions are reached.
    table: Option<wgpu::Buffer>,
    table_rows: usize,
    /// `[pos, n, 0, 0, ids...]`: the only thing a decode step uploads.
    step: Option<wgpu::Buffer>,
    /// Top-k scratch and output; a constrained step's second output (the unmasked ranking) and
    /// its allowed set, uploaded each such step.
    cand: Option<wgpu::Buffer>,
    pick: Option<wgpu::Buffer>,
    pick_all: Option<wgpu::Buffer>,
    mask: Option<wgpu::Buffer>,
    /// Read-back buffers, reused (taken out while a read is pending).
    logits_rb: Option<wgpu::Buffer>,
    pick_rb: Option<wgpu::Buffer>,
    binder: Binder,
    bytes: u64,
    last: GpuStats,
}

/// What a forward returns.
#[derive(Clone, Copy)]
enum Output {
    Logits {
        all: bool,
    },
    TopK {
        k: usize,
    },
    /// The `k` best allowed tokens (the mask uploaded with the step), then the `shown` best of
    /// all with the row's log-sum-exp.
    TopKAllowed {
        k: usize,
        shown: usize,
    },
    Greedy,
    /// `steps` greedy picks, each fed back as the next input on the GPU.
    Chain {
        steps: usize,
    },
}

/// A model ready to run on the GPU.
pub struct GpuModel {
    pub model: Model,
    ctx: Arc<GpuContext>,
    /// Compiled pipelines: the model's own, or shared with the model it was made beside
    /// ([`GpuModel::with_shared_kernels`]).
    kernels: Arc<Kernels>,
    /// The model's weights, uploaded (a tied output projection shares its embedding's buffer;
    /// q|k|v and gate|up are views of packed buffers where their types agree).
    weights: Weights<Arc<GpuTensor>>,
    plans: Vec<LayerPlan>,
    vectors: wgpu::Buffer,
    output_norm: NormAt,
    /// Positions per attention chunk.
    chunk: usize,
    max_seq: usize,
    batch: usize,
    /// Rows of `scratch.logits`.
    logit_rows: usize,
    scratch: Scratch,
    opts: GpuOptions,
    /// Bytes of weights and activations.
    load_bytes: u64,
    rt: Mutex<Runtime>,
}

/// The KV cache of one sequence, on the GPU: per layer, `max_seq` rows of kv_dim values (f32, or
/// f16 with the f16 KV cache) for keys and for values. Cloning copies the filled rows on the GPU
/// (for beam search). Bind groups that use the cache are cached here (they die with it).
pub struct GpuState {
    pub pos: usize,
    /// Per layer: keys from element 0, values from `v_rows` rows on.
    kv: Vec<wgpu::Buffer>,
    v_rows: usize,
    kv_dim: usize,
    row_bytes: u64,
    ctx: Arc<GpuContext>,
    groups: Mutex<BindCache>,
}

/// Rows before the values in a layer's KV buffer: `max_seq`, made even so the values start at
/// a whole word with f16 elements too.
fn v_rows(max_seq: usize, kv_dim: usize) -> usize {
    if (max_seq * kv_dim).is_multiple_of(2) {
        max_seq
    } else {
        max_seq + 1
    }
}

impl GpuState {
    fn alloc(
        ctx: &Arc<GpuContext>,
        n_layer: usize,
        max_seq: usize,
        kv_dim: usize,
        elem: usize,
    ) -> GpuState {
        let row_bytes = (kv_dim * elem) as u64;
        let v_rows = v_rows(max_seq, kv_dim);
        let bytes = (v_rows + max_seq) as u64 * row_bytes;
        let kv = (0..n_layer).map(|_| super::kernels::storage(ctx, "kv cache", bytes)).collect();
        GpuState {
            pos: 0,
            kv,
            v_rows,
            kv_dim,
            row_bytes,
            ctx: ctx.clone(),
            groups: Mutex::new(BindCache::default()),
        }
    }

    fn buffers(&self) -> Vec<&wgpu::Buffer> {
        self.kv.iter().collect()
    }

    /// Element offset of the values in a layer's buffer.
    fn v_base(&self) -> usize {
        self.v_rows * self.kv_dim
    }
}

impl Clone for GpuState {
    fn clone(&self) -> GpuState {
        let ctx = &self.ctx;
        let bytes = self.kv.first().map_or(16, |b| b.size());
        let kv: Vec<wgpu::Buffer> =
            (0..self.kv.len()).map(|_| super::kernels::storage(ctx, "kv cache", bytes)).collect();
        // Whole words (an f16 cache row of an odd kv_dim is not).
        let v_at = self.v_rows as u64 * self.row_bytes;
        let used = (self.pos as u64 * self.row_bytes).div_ceil(4) * 4;
        let used = used.min(v_at);
        if used > 0 {
            let mut enc = ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("clone kv"),
            });
            for (src, dst) in self.kv.iter().zip(&kv) {
                enc.copy_buffer_to_buffer(src, 0, dst, 0, used);
                enc.copy_buffer_to_buffer(src, v_at, dst, v_at, used.min(bytes - v_at));
            }
            ctx.queue.submit([enc.finish()]);
        }
        GpuState {
            pos: self.pos,
            kv,
            v_rows: self.v_rows,
            kv_dim: self.kv_dim,
            row_bytes: self.row_bytes,
            ctx: ctx.clone(),
            groups: Mutex::new(BindCache::default()),
        }
    }
}

fn words(bytes: &[u8]) -> impl Iterator<Item = u32> + '_ {
    bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// A top-k kernel's result `[logsumexp, count, (id, logit) * count]` as read back, at most `k`.
fn top_from_words(w: &[u32], k: usize) -> TopK {
    let count = (w[1] as usize).min(k);
    TopK {
        ids: (0..count).map(|i| w[2 + 2 * i]).collect(),
        logits: (0..count).map(|i| f32::from_bits(w[3 + 2 * i])).collect(),
        logsumexp: f32::from_bits(w[0]) as f64,
    }
}

impl GpuModel {
    /// Open the GPU and upload `model` (native; blocks).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn new(model: Model) -> Result<GpuModel> {
        crate::lm::block_on(async {
            GpuModel::with_context(GpuContext::new_async().await?, model).await
        })
    }

    /// Upload `model` to the device of `ctx` and compile its kernels, with the default options
    /// ([`GpuOptions::auto`]: the f16 KV cache where the device supports it).
    pub async fn with_context(ctx: Arc<GpuContext>, model: Model) -> Result<GpuModel> {
        let opts = GpuOptions::auto(&ctx);
        GpuModel::with_options(ctx, model, opts).await
    }

    /// Upload `model` to the device of `ctx` and compile its kernels. The model keeps only its
    /// description: its bytes are released once they are on the GPU (freed, unless another
    /// handle shares them).
    pub async fn with_options(
        ctx: Arc<GpuContext>,
        model: Model,
        opts: GpuOptions,
    ) -> Result<GpuModel> {
        // The same path as a streamed load (`GpuStream`), with the whole file as one piece.
        let mut pending = GpuModel::plan(ctx, &model, opts, None)?;
        pending.fill.feed(&model.storage)?;
        pending.finish(model.release_bytes()).await
    }

    /// Upload `model` beside `other`, on its device, with its options and its compiled kernels
    /// (those `model` needs beyond them are compiled): a second model that costs no recompiling
    /// of what they share, such as [`GpuModel::check_against_cpu`]'s.
    pub async fn with_shared_kernels(other: &GpuModel, model: Model) -> Result<GpuModel> {
        let mut pending = GpuModel::plan(other.ctx.clone(), &model, other.opts, None)?;
        pending.kernels = Some(other.kernels.clone());
        pending.fill.feed(&model.storage)?;
        pending.finish(model.release_bytes()).await
    }

    /// Make every buffer of the model described by `model` (none of its bytes are read), and
    /// record where each tensor's bytes go: the weights (q|k|v and gate|up of one type packed
    /// into one buffer each), the small vectors decoded to f32 into one buffer, and
    /// `rope_freqs` (Llama 3's RoPE factors: for `Pending::finish` to give the model) when the
    /// model does not have them yet. The file's bytes then go to `Pending::fill` in order.
    pub(super) fn plan(
        ctx: Arc<GpuContext>,
        model: &Model,
        opts: GpuOptions,
        rope_freqs: Option<&Tensor>,
    ) -> Result<Pending> {
        ctx.check_lost()?;
        if (opts.f16_kv || opts.f16_prefill) && !ctx.shader_f16 {
            return Err(gpu_err(format!(
                "{opts:?} needs shader-f16 (f16 in shaders), which this device lacks"
            )));
        }
        let c = &model.config;
        if c.head_dim > MAX_HEAD_DIM {
            return Err(gpu_err(format!(
                "head size {} exceeds the kernels' {MAX_HEAD_DIM}",
                c.head_dim
            )));
        }
        // Running out of memory while the buffers are made or written is reported by `finish`.
        let oom = ctx.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let mut fill = Filler::new(ctx.clone());
        // The plans: q|k|v and gate|up of one type packed into one buffer each (the tensors
        // become views of it), and the small vectors' offsets. Then every other tensor.
        let mut uploads = Uploads { ctx: &ctx, cache: HashMap::new(), fill: &mut fill };
        let mut vectors = Vectors::default();
        let mut plans = Vec::new();
        for lw in &model.weights.layers {
            let (qkv, qkv_bias) = match &lw.qkv {
                Qkv::Fused(l) => {
                    (vec![(uploads.one(&l.weight)?, 0)], l.bias.as_ref().map(|b| vectors.add(b)))
                }
                Qkv::Separate { q, k, v } => {
                    let pieces = uploads.packed(&[&q.weight, &k.weight, &v.weight])?;
                    // One bias vector for q|k|v: zeros where one of them has none.
                    let bias = [q, k, v].iter().any(|l| l.bias.is_some()).then(|| {
                        let at = vectors.len;
                        for l in [q, k, v] {
                            match &l.bias {
                                Some(t) => vectors.add(t),
                                None => vectors.zeros(l.weight.rows),
                            };
                        }
                        at
                    });
                    (pieces, bias)
                }
            };
            let gate_up = match &lw.ffn {
                Ffn::GatedSilu { gate, up, .. } => {
                    let pieces = uploads.packed(&[&gate.weight, &up.weight])?;
                    (pieces.len() == 1).then(|| pieces[0].0.clone())
                }
                Ffn::Gelu { .. } => None,
            };
            let (gate_bias, up_bias, down_bias) = match &lw.ffn {
                Ffn::GatedSilu { gate, up, down } => (
                    gate.bias.as_ref().map(|b| vectors.add(b)),
                    up.bias.as_ref().map(|b| vectors.add(b)),
                    down.bias.as_ref().map(|b| vectors.add(b)),
                ),
                Ffn::Gelu { up, down } => (
                    None,
                    up.bias.as_ref().map(|b| vectors.add(b)),
                    down.bias.as_ref().map(|b| vectors.add(b)),
                ),
            };
            plans.push(LayerPlan {
                qkv,
                gate_up,
                attn_norm: vectors.norm(&lw.attn_norm),
                ffn_norm: vectors.norm(&lw.ffn_norm),
                qkv_bias,
                attn_output_bias: lw.attn_output.bias.as_ref().map(|b| vectors.add(b)),
                up_bias,
                gate_bias,
                down_bias,
            });
        }
        let weights = model.weights.try_map(|t: &Tensor| uploads.one(t))?;
        let cache = uploads.cache;
        let output_norm = vectors.norm(&model.weights.output_norm);
        let vectors_buffer = super::kernels::storage(&ctx, "vectors", (vectors.len * 4) as u64);
        let buf = fill.add_buffer(vectors_buffer.clone(), vectors.len * 4);
        for (t, at) in &vectors.placed {
            let n = t.rows * t.cols;
            fill.place(&t.name, t.offset, t.size_bytes, Dest::Vector { buf, at: *at, n, ty: t.ty });
        }
        if let Some(t) = rope_freqs {
            fill.place(&t.name, t.offset, t.size_bytes, Dest::RopeFreqs);
        }
        fill.seal();
        Ok(Pending {
            ctx,
            opts,
            weights,
            plans,
            vectors: vectors_buffer,
            output_norm,
            tensors: cache.into_values().collect(),
            fill,
            oom: Some(oom),
            kernels: None,
        })
    }

    /// The rest of [`GpuModel::with_options`] once the weights are written: activations,
    /// kernels, and the model itself.
    pub(super) async fn assemble(p: Pending, model: Model) -> Result<GpuModel> {
        let Pending { ctx, opts, weights, plans, vectors, output_norm, tensors, kernels, .. } = p;
        let c = model.config.clone();
        let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());

        let limit = ctx.max_binding();
        let shape =
            AttentionShape { n_head: c.n_head, n_head_kv: c.n_head_kv, head_dim: c.head_dim };
        let widest = [c.n_embd, q_dim + 2 * kv_dim, 2 * c.n_ff]
            .into_iter()
            .chain([ops::attention_scratch_floats(1, shape)])
            .max()
            .unwrap_or(1);
        let batch = ((limit / (widest as u64 * 4)) as usize).clamp(1, MAX_BATCH);
        let logit_rows =
            ((limit / (c.n_vocab.max(1) as u64 * 4)) as usize).clamp(1, MAX_LOGIT_ROWS.min(batch));
        // Keys and values share one buffer per layer.
        let max_seq = c.n_ctx.min((limit / (kv_dim as u64 * 8)) as usize).saturating_sub(1).max(1);
        let scratch = Scratch {
            x: floats(&ctx, "x", batch * c.n_embd),
            h: floats(&ctx, "h", batch * c.n_embd),
            qkv: floats(&ctx, "qkv", batch * (q_dim + 2 * kv_dim)),
            q: floats(&ctx, "q", batch * q_dim),
            // Only decode batches (a few tokens) split attention into chunks.
            chunks: floats(
                &ctx,
                "attention chunks",
                ops::attention_scratch_floats(batch.min(MATVEC_TOKENS as usize), shape),
            ),
            attn: floats(&ctx, "attn", batch * q_dim),
            up: floats(&ctx, "up", batch * c.n_ff),
            gate_up: floats(&ctx, "gate|up", batch * 2 * c.n_ff),
            logits: floats(&ctx, "logits", logit_rows * c.n_vocab),
            zeros: floats(&ctx, "zeros", c.n_embd.max(4)),
            no_kv: floats(&ctx, "no kv", 4),
        };
        let kernels = kernels.unwrap_or_else(|| Arc::new(Kernels::new(ctx.clone())));
        let h = opts.f16_kv;
        let mut needed = vec![
            Kernel::Rope(false),
            Kernel::Rope(h),
            Kernel::Attention(h, shape.head_dim as u32),
            Kernel::AttentionMerge,
            Kernel::AttentionPrefill(h, shape.head_dim as u32),
            Kernel::Embedding(weights.token_embd.ty),
        ];
        needed.extend([Kernel::TopkPartial, Kernel::TopkMerge]);
        needed.push(match c.norm {
            Norm::Rms => Kernel::RmsNorm,
            Norm::Layer => Kernel::LayerNorm,
        });
        needed.push(match c.mlp {
            Mlp::GatedSilu => Kernel::SiluMul,
            Mlp::Gelu => Kernel::Gelu,
        });
        if let Some(p) = &weights.pos_embd {
            needed.push(Kernel::Embedding(p.ty));
        }
        for t in &tensors {
            needed.push(Kernel::Matvec(t.ty, h, 1));
            needed.push(Kernel::Matvec(t.ty, h, MATVEC_TOKENS));
            needed.extend(Tile::ALL.map(|tile| Kernel::MatmulTiled(t.ty, tile, opts.f16_prefill)));
        }
        needed.sort_by_key(|k| format!("{k:?}"));
        needed.dedup();
        kernels.prepare(&needed).await?;

        let mut buffers: Vec<&wgpu::Buffer> = Vec::new();
        for t in &tensors {
            for p in &t.parts {
                if !buffers.contains(&&p.buffer) {
                    buffers.push(&p.buffer);
                }
            }
        }
        let s = &scratch;
        buffers.extend([&s.x, &s.h, &s.qkv, &s.q, &s.chunks, &s.attn, &s.up, &s.gate_up]);
        buffers.extend([&s.logits, &s.zeros, &s.no_kv, &vectors]);
        let load_bytes = buffers.iter().map(|b| b.size()).sum::<u64>();
        Ok(GpuModel {
            chunk: ops::attention_chunk(max_seq),
            model,
            ctx,
            kernels,
            weights,
            plans,
            vectors,
            output_norm,
            max_seq,
            batch,
            logit_rows,
            scratch,
            opts,
            load_bytes,
            rt: Mutex::new(Runtime::default()),
        })
    }

    /// What the GPU holds of each weight, read back: every tensor's bytes (in the file's
    /// encoding), by role, and the small vectors as the f32 bytes of the vectors buffer. For
    /// tests: however a model was loaded (uploaded whole, streamed in any pieces) the weights
    /// must be the file's bytes.
    pub async fn read_weights(&self) -> Result<(Weights<Vec<u8>>, Vec<u8>)> {
        let mut list = Vec::new();
        let index = self.weights.try_map(|t| {
            list.push(t.clone());
            Ok(list.len() - 1)
        })?;
        let mut bytes = Vec::new();
        for t in &list {
            let mut out = Vec::with_capacity(t.rows * t.row_bytes);
            for p in &t.parts {
                let whole = self.read_back(&p.buffer).await?;
                out.extend_from_slice(&whole[p.byte0..][..p.rows * t.row_bytes]);
            }
            bytes.push(out);
        }
        let weights = index.try_map(|&i| Ok(std::mem::take(&mut bytes[i])))?;
        Ok((weights, self.read_back(&self.vectors).await?))
    }

    /// A copy of `buffer`'s bytes (a COPY_SRC storage buffer).
    async fn read_back(&self, buffer: &wgpu::Buffer) -> Result<Vec<u8>> {
        let rb = readback(&self.ctx, buffer.size());
        let mut enc = self.ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("read weights"),
        });
        enc.copy_buffer_to_buffer(buffer, 0, &rb, 0, buffer.size());
        self.ctx.queue.submit([enc.finish()]);
        self.ctx.read_buffer(&rb).await
    }

    /// Limit the tokens of one pass over the layers (longer prompts run in several passes):
    /// for tests of the multi-pass path.
    pub fn with_max_batch(mut self, batch: usize) -> GpuModel {
        self.batch = batch.clamp(1, self.batch);
        self
    }

    /// Limit the sequence length (and so the KV cache each state allocates).
    pub fn with_max_seq(mut self, max_seq: usize) -> GpuModel {
        self.max_seq = max_seq.clamp(1, self.max_seq);
        self.chunk = ops::attention_chunk(self.max_seq);
        // Buffers sized by max_seq are made on the first forward; drop any made before.
        self.rt = Mutex::new(Runtime::default());
        self
    }

    pub fn context(&self) -> &Arc<GpuContext> {
        &self.ctx
    }

    pub fn options(&self) -> GpuOptions {
        self.opts
    }

    /// Counters of the last forward and of the model's GPU memory.
    pub fn stats(&self) -> GpuStats {
        let rt = self.rt.lock().unwrap_or_else(|p| p.into_inner());
        let c = &self.model.config;
        let elem = if self.opts.f16_kv { 2 } else { 4 };
        GpuStats {
            model_bytes: self.load_bytes + rt.bytes + rt.binder.bytes(),
            kv_bytes_per_state: 2
                * c.n_layer as u64
                * self.max_seq as u64
                * (c.kv_dim() * elem) as u64,
            bind_groups_created: rt.binder.bind_groups_created,
            buffers_created: self.ctx.buffers_created.load(std::sync::atomic::Ordering::Relaxed),
            param_bytes_written: rt.binder.param_bytes_written,
            f16_kv: self.opts.f16_kv,
            f16_prefill: self.opts.f16_prefill,
            ..rt.last
        }
    }

    fn check_tokens(&self, pos: usize, tokens: &[u32]) -> Result<()> {
        self.model.config.check_tokens(pos, tokens, self.max_seq)
    }

    /// Append `tokens` and return the `k` (1..=64, at most the vocabulary) most likely next
    /// tokens with the log-sum-exp of all logits, chosen on the GPU: only these come back.
    pub async fn forward_topk_async(
        &self,
        state: &mut GpuState,
        tokens: &[u32],
        k: usize,
    ) -> Result<TopK> {
        if !(1..=MAX_TOP_K).contains(&k) {
            return Err(Error::Input(format!(
                "top-k on the GPU needs 1 <= k <= {MAX_TOP_K}, got {k}"
            )));
        }
        let k = k.min(self.model.config.n_vocab);
        let bytes = self.run(state, tokens, Output::TopK { k }).await?;
        let w: Vec<u32> = words(&bytes).collect();
        Ok(top_from_words(&w, k))
    }

    /// Append `tokens` and rank for a constrained step on the GPU: the `k` (1..=64) most likely
    /// tokens of `allowed` (its bits uploaded with the step and applied in the top-k kernel) and
    /// the `shown` (1..=64) most likely of all, with the log-sum-exp of all the logits. Only
    /// these pairs come back (`(2 + 2k) + (2 + 2 shown)` words).
    pub async fn forward_topk_allowed_async(
        &self,
        state: &mut GpuState,
        tokens: &[u32],
        k: usize,
        shown: usize,
        allowed: &AllowedSet,
    ) -> Result<AllowedTop> {
        let n_vocab = self.model.config.n_vocab;
        if !(1..=MAX_TOP_K).contains(&k) || !(1..=MAX_TOP_K).contains(&shown) {
            return Err(Error::Input(format!(
                "top-k on the GPU needs 1 <= k <= {MAX_TOP_K}, got {k} and {shown}"
            )));
        }
        if allowed.len() != n_vocab {
            return Err(Error::Input(format!(
                "the allowed set covers {} tokens; the model has {n_vocab}",
                allowed.len()
            )));
        }
        let (k, shown) = (k.min(n_vocab), shown.min(n_vocab));
        let output = Output::TopKAllowed { k, shown };
        let bytes = self.run_masked(state, tokens, output, Some(allowed.words())).await?;
        let w: Vec<u32> = words(&bytes).collect();
        let (masked, all) = w.split_at(2 + 2 * k);
        let all = top_from_words(all, shown);
        let mut allowed = top_from_words(masked, k);
        // The log-sum-exp of all the logits, not of the allowed ones.
        allowed.logsumexp = all.logsumexp;
        // An allowed token with a -inf logit is no candidate (as on the CPU).
        let keep = allowed.logits.iter().take_while(|&&l| l > f32::NEG_INFINITY).count();
        allowed.ids.truncate(keep);
        allowed.logits.truncate(keep);
        Ok(AllowedTop { allowed, all })
    }

    /// Append `tokens` and return the most likely next token (the argmax of the logits, the
    /// smallest id among equals), chosen on the GPU: 4 bytes come back.
    pub async fn forward_greedy_async(&self, state: &mut GpuState, tokens: &[u32]) -> Result<u32> {
        let bytes = self.run(state, tokens, Output::Greedy).await?;
        let id = words(&bytes).next().expect("one word");
        Ok(id)
    }

    /// Greedy decoding of `steps` tokens in one submission: append `tokens`, pick the most likely
    /// next token on the GPU, feed it back on the GPU, and so on; returns the `steps` picks (4
    /// bytes each come back, once). The state then holds `tokens` and all picks but the last (as
    /// after feeding each pick but the last to [`GpuModel::forward_greedy_async`]). The caller
    /// truncates at an end-of-sequence token itself (the GPU does not stop at one).
    pub async fn forward_greedy_chain_async(
        &self,
        state: &mut GpuState,
        tokens: &[u32],
        steps: usize,
    ) -> Result<Vec<u32>> {
        if steps == 0 {
            return Err(Error::Input("a greedy chain needs at least one step".into()));
        }
        let bytes = self.run(state, tokens, Output::Chain { steps }).await?;
        Ok(words(&bytes).collect())
    }

    /// One forward: record and submit under the runtime lock (no await in between, so the step
    /// and parameter uploads pair with their submission), then wait for the read-back.
    async fn run(&self, state: &mut GpuState, tokens: &[u32], output: Output) -> Result<Vec<u8>> {
        self.run_masked(state, tokens, output, None).await
    }

    /// [`run`](Self::run) with an allowed set to upload for a masked ranking.
    async fn run_masked(
        &self,
        state: &mut GpuState,
        tokens: &[u32],
        output: Output,
        mask: Option<&[u32]>,
    ) -> Result<Vec<u8>> {
        Ok(self.run_profiled(state, tokens, output, mask, Timing::Off).await?.0)
    }

    /// Append `tokens` (typically one: a decode step) with every dispatch timed by the GPU's
    /// timestamps, in order, each with its label and the weight bytes it reads; `None` when the
    /// device has no timestamp queries. Each dispatch runs in a compute pass of its own, so the
    /// total is a little above an ordinary step's; the split between kernels is what it shows.
    pub async fn profile_async(
        &self,
        state: &mut GpuState,
        tokens: &[u32],
    ) -> Result<Option<Vec<DispatchTime>>> {
        let output = Output::Logits { all: false };
        let (_, times) =
            self.run_profiled(state, tokens, output, None, Timing::EachDispatch).await?;
        Ok(times)
    }

    /// Append `tokens` as [`LanguageModel::forward`] does (the logits of the last) and return the
    /// GPU's time for it in µs, from timestamps at the ends of its passes (the dispatches run as
    /// untimed, all in one pass); `None` when the device has no timestamp queries. Against the
    /// wall time of a step it shows what recording, submitting and reading back cost.
    pub async fn gpu_micros_async(
        &self,
        state: &mut GpuState,
        tokens: &[u32],
    ) -> Result<Option<f64>> {
        let output = Output::Logits { all: false };
        let (_, times) = self.run_profiled(state, tokens, output, None, Timing::EachPass).await?;
        Ok(times.map(|t| t.iter().map(|d| d.micros).sum()))
    }

    /// Per kernel family, the times of a forward pass of `ids[context..]` (one token: a decode
    /// step; more: a prefill) after `ids[..context]` fill a fresh cache (in passes of up to 256
    /// tokens, untimed); `None` when the device has no timestamp queries. What `bench --profile`
    /// and the browser bench page print.
    pub async fn profile_after_async(
        &self,
        ids: &[u32],
        context: usize,
    ) -> Result<Option<Vec<FamilyTime>>> {
        let mut state = self.new_state();
        for piece in ids[..context].chunks(256) {
            self.forward_async(&mut state, piece, false).await?;
        }
        let times = self.profile_async(&mut state, &ids[context..]).await?;
        Ok(times.map(|t| by_family(&t)))
    }

    async fn run_profiled(
        &self,
        state: &mut GpuState,
        tokens: &[u32],
        output: Output,
        mask: Option<&[u32]>,
        timing: Timing,
    ) -> Result<(Vec<u8>, Option<Vec<DispatchTime>>)> {
        self.ctx.check_lost()?;
        self.check_tokens(state.pos, tokens)?;
        // Tokens a chained decode feeds itself (all but its last pick).
        let chain_extra = match output {
            Output::Chain { steps } => steps - 1,
            _ => 0,
        };
        if state.pos + tokens.len() + chain_extra > self.max_seq {
            return Err(Error::Input(format!(
                "{} tokens and {chain_extra} more decoded after {} would exceed the context of {} tokens",
                tokens.len(),
                state.pos,
                self.max_seq
            )));
        }
        let (rb, len, timestamps) = self.submit(state, tokens, output, mask, chain_extra, timing);
        let read = self.ctx.read_buffer(&rb).await;
        {
            let mut rt = self.rt.lock().unwrap_or_else(|p| p.into_inner());
            let slot = if matches!(output, Output::Logits { .. }) {
                &mut rt.logits_rb
            } else {
                &mut rt.pick_rb
            };
            if slot.as_ref().is_none_or(|b| b.size() < rb.size()) {
                *slot = Some(rb);
            }
        }
        if let Some(e) = self.ctx.take_uncaptured_error() {
            self.ctx.check_lost()?;
            return Err(gpu_err(format!("the forward pass failed: {e}")));
        }
        let bytes = read?;
        state.pos += tokens.len() + chain_extra;
        let times = match timestamps {
            Some(ts) => {
                let ticks = self.ctx.read_buffer(&ts.readback).await?;
                Some(ts.times(&ticks, self.ctx.queue.get_timestamp_period()))
            }
            None => None,
        };
        Ok((bytes[..len].to_vec(), times))
    }

    /// Record the forward of `tokens` and submit it; returns the read-back buffer (its copy is
    /// submitted) and how many of its bytes hold the result.
    fn submit(
        &self,
        state: &mut GpuState,
        tokens: &[u32],
        output: Output,
        mask: Option<&[u32]>,
        extra: usize,
        timing: Timing,
    ) -> (wgpu::Buffer, usize, Option<Timestamps>) {
        let c = &self.model.config;
        let ctx = &self.ctx;
        let (n, vocab, pos0) = (tokens.len(), c.n_vocab, state.pos);
        let mut guard = self.rt.lock().unwrap_or_else(|p| p.into_inner());
        let rt = &mut *guard;
        self.ensure_runtime(rt, pos0 + n + extra);
        let step = rt.step.clone().expect("made");
        let table = rt.table.clone().expect("made");
        let (cand, pick) = (rt.cand.clone().expect("made"), rt.pick.clone().expect("made"));
        let pick_all = rt.pick_all.clone().expect("made");
        let mask_buf = rt.mask.clone().expect("made");
        ctx.queue.write_buffer(&step, 0, &ops::step_words(pos0, tokens));
        if let Some(words) = mask {
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            ctx.queue.write_buffer(&mask_buf, 0, &bytes);
        }

        let row_bytes = (vocab * 4) as u64;
        let (out_len, is_logits) = match output {
            Output::Logits { all } => ((if all { n } else { 1 }) * vocab * 4, true),
            Output::TopK { k } => ((2 + 2 * k) * 4, false),
            Output::TopKAllowed { k, shown } => ((2 + 2 * k + 2 + 2 * shown) * 4, false),
            Output::Greedy => (4, false),
            Output::Chain { steps } => (4 * steps, false),
        };
        let slot = if is_logits { &mut rt.logits_rb } else { &mut rt.pick_rb };
        let rb = match slot.take() {
            Some(b) if b.size() >= out_len as u64 => b,
            _ => {
                let b = readback(ctx, out_len as u64);
                rt.bytes += b.size();
                b
            }
        };

        let mut pass = Pass::new(&self.kernels);
        if timing != Timing::Off {
            pass.time(timing);
        }
        let s = &self.scratch;
        let fused = Fused {
            vectors: &self.vectors,
            table: &table,
            step: &step,
            no_kv: &s.no_kv,
            f16_kv: self.opts.f16_kv,
            f16_tiles: self.opts.f16_prefill,
        };
        let picks = TopkBuffers { cand: &cand, out: &pick, step: &step, mask: &mask_buf };
        let picks_all = TopkBuffers { cand: &cand, out: &pick_all, step: &step, mask: &mask_buf };
        // The most positions any token of this forward sees (sizes attention's grid).
        let max_seen = pos0 + n + extra;
        let mut start = 0;
        while start < n {
            let len = self.batch.min(n - start);
            let tokens = Tokens { step: &step, start, n: len };
            self.encode_layers(&mut pass, state, &fused, tokens, max_seen);
            match output {
                Output::Logits { all: true } => {
                    for r0 in (0..len).step_by(self.logit_rows) {
                        let m = self.logit_rows.min(len - r0);
                        self.encode_logits(&mut pass, &fused, r0, m);
                        let at = (start + r0) as u64 * row_bytes;
                        pass.copy(&s.logits, 0, &rb, at, m as u64 * row_bytes);
                    }
                }
                _ if start + len == n => {
                    self.encode_logits(&mut pass, &fused, len - 1, 1);
                    match output {
                        Output::Logits { .. } => pass.copy(&s.logits, 0, &rb, 0, row_bytes),
                        Output::TopK { k } => {
                            ops::topk(&mut pass, &s.logits, 0, vocab, k, &picks, false);
                            pass.copy(&pick, 0, &rb, 0, out_len as u64);
                        }
                        Output::TopKAllowed { k, shown } => {
                            ops::topk_masked(&mut pass, &s.logits, 0, vocab, k, &picks);
                            let first = ((2 + 2 * k) * 4) as u64;
                            pass.copy(&pick, 0, &rb, 0, first);
                            ops::topk(&mut pass, &s.logits, 0, vocab, shown, &picks_all, false);
                            pass.copy(&pick_all, 0, &rb, first, out_len as u64 - first);
                        }
                        Output::Greedy => {
                            ops::topk(&mut pass, &s.logits, 0, vocab, 1, &picks, false);
                            pass.copy(&pick, 8, &rb, 0, 4);
                        }
                        Output::Chain { steps } => {
                            ops::topk(&mut pass, &s.logits, 0, vocab, 1, &picks, true);
                            pass.copy(&pick, 8, &rb, 0, 4);
                            // Each further step reads its token and position from the step buffer
                            // the previous pick wrote.
                            for i in 1..steps {
                                let next = Tokens { step: &step, start: 0, n: 1 };
                                self.encode_layers(&mut pass, state, &fused, next, max_seen);
                                self.encode_logits(&mut pass, &fused, 0, 1);
                                ops::topk(&mut pass, &s.logits, 0, vocab, 1, &picks, true);
                                pass.copy(&pick, 8, &rb, 4 * i as u64, 4);
                            }
                        }
                    }
                }
                _ => {}
            }
            start += len;
        }
        let state_bufs = state.buffers();
        let mut groups = state.groups.lock().unwrap_or_else(|p| p.into_inner());
        let stats = pass.submit_with(&mut rt.binder, Some((&state_bufs, &mut groups)));
        rt.last = GpuStats {
            dispatches_last: stats.dispatches,
            submissions_last: stats.submissions,
            readback_bytes_last: out_len as u64,
            ..GpuStats::default()
        };
        (rb, out_len, stats.timestamps)
    }

    /// Make the buffers sized by `max_seq` if not yet made, and fill the RoPE table up to `rows`
    /// positions.
    fn ensure_runtime(&self, rt: &mut Runtime, rows: usize) {
        let ctx = &self.ctx;
        let rope = &self.model.rope;
        let half = rope.pairs();
        if rt.step.is_none() {
            let mk = |rt: &mut Runtime, label: &str, bytes: u64| {
                let b = super::kernels::storage(ctx, label, bytes);
                rt.bytes += b.size();
                b
            };
            rt.table = Some(mk(rt, "rope table", (self.max_seq * half.max(1) * 8) as u64));
            rt.step = Some(mk(rt, "step", ((ops::STEP_IDS + self.max_seq) * 4) as u64));
            rt.cand = Some(mk(
                rt,
                "top-k candidates",
                (ops::topk_scratch_words(self.model.config.n_vocab) * 4) as u64,
            ));
            rt.pick = Some(mk(rt, "top-k", ((2 + 2 * MAX_TOP_K) * 4) as u64));
            rt.pick_all = Some(mk(rt, "top-k of all", ((2 + 2 * MAX_TOP_K) * 4) as u64));
            let mask_words = ops::mask_words(self.model.config.n_vocab);
            rt.mask = Some(mk(rt, "allowed tokens", (mask_words * 4) as u64));
        }
        if rows > rt.table_rows && half > 0 {
            // In blocks of 256 positions, so decoding uploads a block every 256 tokens.
            let to = rows.next_multiple_of(256).min(self.max_seq);
            let mut cos_sin = vec![0f32; (to - rt.table_rows) * half * 2];
            rope.fill_cos_sin(rt.table_rows, &mut cos_sin);
            let bytes: Vec<u8> = cos_sin.iter().flat_map(|v| v.to_le_bytes()).collect();
            let table = rt.table.as_ref().expect("made");
            ctx.queue.write_buffer(table, (rt.table_rows * half * 8) as u64, &bytes);
            rt.table_rows = to;
        }
    }

    /// Logits of `n` tokens from row `row0` of the residual stream (`scratch.x`) into
    /// `scratch.logits`: the final norm fused into the product (the tiled one for many tokens;
    /// a LayerNorm there is a kernel of its own first).
    fn encode_logits<'a>(&'a self, pass: &mut Pass<'a>, fused: &Fused<'a>, row0: usize, n: usize) {
        let c = &self.model.config;
        let s = &self.scratch;
        let out = Out { buf: &s.logits, stride: c.n_vocab, col0: 0 };
        let rows = Rows { buf: &s.x, row0, n };
        if ops::fits_matvec(n) {
            let m = Matvec {
                norm: Some(self.norm_in(self.output_norm)),
                bias: None,
                epilogue: Epilogue::Store,
            };
            ops::matvec(pass, &self.weights.output, rows, out, m, fused);
        } else if c.norm == Norm::Rms {
            let rms_norm = Some((self.output_norm.weight, c.norm_eps));
            let opts = TiledOpts { rms_norm, ..TiledOpts::default() };
            ops::matmul_tiled_with(pass, &self.weights.output, None, rows, out, fused, opts);
        } else {
            self.norm(pass, &self.weights.output_norm, row0 + n);
            let rows = Rows { buf: &s.h, row0, n };
            ops::matmul(pass, &self.weights.output, None, rows, out, fused);
        }
    }

    fn norm_in(&self, at: NormAt) -> NormIn {
        let c = &self.model.config;
        NormIn { kind: c.norm, eps: c.norm_eps, weight: at.weight, bias: at.bias }
    }

    /// The norm kernel: the first `n` rows of `scratch.x` into `scratch.h`.
    fn norm<'a>(&'a self, pass: &mut Pass<'a>, w: &'a NormWeights<Arc<GpuTensor>>, n: usize) {
        let c = &self.model.config;
        let s = &self.scratch;
        // A LayerNorm without a bias adds zeros.
        let bias = Some(w.bias.as_ref().map_or(&s.zeros, |b| b.buffer()));
        let op = NormOp { kind: c.norm, eps: c.norm_eps, weight: w.weight.buffer(), bias };
        ops::norm(pass, op, &s.x, c.n_embd, n, &s.h);
    }

    /// Record the layers for `tokens`, leaving the final residual stream in `scratch.x`.
    ///
    /// Decode (a few tokens) runs each layer as six dispatches: norm + q|k|v + bias + RoPE + KV
    /// write; attention over chunks of the sequence and their merge; output projection + residual;
    /// norm + gate|up + SiLU·up (or up + GELU); down projection + residual. Prefill runs the
    /// norms, RoPE and activations as kernels of their own around tiled products (the residual
    /// adds in the products' epilogue) and attention in one pass (see ARCHITECTURE.md).
    fn encode_layers<'a>(
        &'a self,
        pass: &mut Pass<'a>,
        state: &'a GpuState,
        fused: &Fused<'a>,
        tokens: Tokens<'a>,
        max_seen: usize,
    ) {
        let len = tokens.n;
        let c = &self.model.config;
        let w = &self.weights;
        let s = &self.scratch;
        let (e, ff) = (c.n_embd, c.n_ff);
        let shape =
            AttentionShape { n_head: c.n_head, n_head_kv: c.n_head_kv, head_dim: c.head_dim };
        let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
        let qkv_w = q_dim + 2 * kv_dim;
        let h16 = self.opts.f16_kv;
        let mode = match c.rope {
            RopeStyle::Interleaved => RopeMode::Interleaved,
            RopeStyle::HalfSplit => RopeMode::HalfSplit,
            RopeStyle::None => RopeMode::Copy,
        };
        let few = ops::fits_matvec(len);
        let rows = |buf| Rows { buf, row0: 0, n: len };
        let out = |buf, stride, col0| Out { buf, stride, col0 };
        let bias = |b: Option<usize>, row0: usize| b.map(|o| o + row0);
        // The input of the products after a norm: for a prefill batch of a model with RMSNorm,
        // the residual stream itself (the products fold the norm in); otherwise the norm kernel's
        // output.
        let fold_norm = !few && c.norm == Norm::Rms;
        let normed = |pass: &mut Pass<'a>, nw: &'a NormWeights<Arc<GpuTensor>>, at: NormAt| {
            if fold_norm {
                (&s.x, Some((at.weight, c.norm_eps)))
            } else {
                self.norm(pass, nw, len);
                (&s.h, None)
            }
        };
        let product = |pass: &mut Pass<'a>, t: &'a GpuTensor, b, x, rms_norm: Option<_>, y| {
            if rms_norm.is_some() {
                let opts = TiledOpts { rms_norm, ..TiledOpts::default() };
                ops::matmul_tiled_with(pass, t, b, rows(x), y, fused, opts);
            } else {
                ops::matmul(pass, t, b, rows(x), y, fused);
            }
        };
        // A product whose output is added to the residual stream (in the product's epilogue).
        let residual = |pass: &mut Pass<'a>, t: &'a GpuTensor, x, b: Option<usize>| {
            ops::matmul_add(pass, t, bias(b, 0), rows(x), out(&s.x, e, 0), fused);
        };

        ops::embedding(pass, &w.token_embd, tokens, Lookup::Ids, &s.x);
        if let Some(pe) = &w.pos_embd {
            ops::embedding(pass, pe, tokens, Lookup::Positions, &s.x);
        }
        for ((l, lw), plan) in w.layers.iter().enumerate().zip(&self.plans) {
            let kv = KvBuffers { kv: &state.kv[l], v_base: state.v_base(), f16: h16 };
            // Attention block.
            if few && plan.qkv.iter().all(|(t, _)| t.parts.len() == 1) {
                for (t, row0) in &plan.qkv {
                    let qkv = QkvOut {
                        row0: *row0,
                        q_dim,
                        kv_dim,
                        head_dim: c.head_dim,
                        rope_dims: c.rope_dims,
                        mode,
                        kv: kv.kv,
                        v_base: kv.v_base,
                        start: tokens.start,
                    };
                    let m = Matvec {
                        norm: Some(self.norm_in(plan.attn_norm)),
                        bias: bias(plan.qkv_bias, *row0),
                        epilogue: Epilogue::Qkv(qkv),
                    };
                    ops::matvec(pass, t, rows(&s.x), out(&s.q, q_dim, 0), m, fused);
                }
            } else {
                let (x, rms) = normed(pass, &lw.attn_norm, plan.attn_norm);
                for (t, row0) in &plan.qkv {
                    let o = out(&s.qkv, qkv_w, *row0);
                    product(pass, t, bias(plan.qkv_bias, *row0), x, rms, o);
                }
                let rope = |pass: &mut Pass<'a>, mode, col0, n_head, y| {
                    let x = Columns { buf: &s.qkv, stride: qkv_w, col0 };
                    let heads = Heads { n: n_head, dim: c.head_dim, rotated: c.rope_dims };
                    ops::rope(pass, mode, x, fused.table, tokens, heads, y);
                };
                let q_out = RopeOut { buf: &s.q, row0: 0, at_pos: false, f16: false };
                rope(pass, mode, 0, c.n_head, q_out);
                let k_out = RopeOut { buf: kv.kv, row0: 0, at_pos: true, f16: h16 };
                rope(pass, mode, q_dim, c.n_head_kv, k_out);
                let v_out = RopeOut { buf: kv.kv, row0: state.v_rows, at_pos: true, f16: h16 };
                rope(pass, RopeMode::Copy, q_dim + kv_dim, c.n_head_kv, v_out);
            }
            ops::attention(pass, &s.q, kv, tokens, shape, self.chunk, max_seen, &s.chunks, &s.attn);
            residual(pass, &lw.attn_output.weight, &s.attn, plan.attn_output_bias);

            // Feed-forward block.
            let norm = Some(self.norm_in(plan.ffn_norm));
            match (&lw.ffn, &plan.gate_up) {
                (Ffn::GatedSilu { down, .. }, Some(gate_up))
                    if few && plan.gate_bias.is_none() && plan.up_bias.is_none() =>
                {
                    let m = Matvec { norm, bias: None, epilogue: Epilogue::Gated { up_row: ff } };
                    ops::matvec(pass, gate_up, rows(&s.x), out(&s.up, ff, 0), m, fused);
                    residual(pass, &down.weight, &s.up, plan.down_bias);
                }
                (Ffn::Gelu { up, down }, _) if few => {
                    let m = Matvec { norm, bias: bias(plan.up_bias, 0), epilogue: Epilogue::Gelu };
                    ops::matvec(pass, &up.weight, rows(&s.x), out(&s.up, ff, 0), m, fused);
                    residual(pass, &down.weight, &s.up, plan.down_bias);
                }
                (Ffn::GatedSilu { gate, up, down }, packed) => {
                    let (x, rms) = normed(pass, &lw.ffn_norm, plan.ffn_norm);
                    match packed {
                        Some(gu) if plan.gate_bias.is_none() && plan.up_bias.is_none() => {
                            product(pass, gu, None, x, rms, out(&s.gate_up, 2 * ff, 0));
                        }
                        _ => {
                            let (g, u) = (&gate.weight, &up.weight);
                            let o = out(&s.gate_up, 2 * ff, 0);
                            product(pass, g, bias(plan.gate_bias, 0), x, rms, o);
                            let o = out(&s.gate_up, 2 * ff, ff);
                            product(pass, u, bias(plan.up_bias, 0), x, rms, o);
                        }
                    }
                    ops::silu_mul(pass, &s.gate_up, &s.up, len, ff);
                    residual(pass, &down.weight, &s.up, plan.down_bias);
                }
                (Ffn::Gelu { up, down }, _) => {
                    let (x, rms) = normed(pass, &lw.ffn_norm, plan.ffn_norm);
                    let o = out(&s.up, ff, 0);
                    product(pass, &up.weight, bias(plan.up_bias, 0), x, rms, o);
                    ops::gelu(pass, &s.up, len * ff);
                    residual(pass, &down.weight, &s.up, plan.down_bias);
                }
            }
        }
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
        self.model.config.prompt_start()
    }
    fn eos_tokens(&self) -> &[u32] {
        &self.model.config.eos_tokens
    }
    fn new_state(&self) -> GpuState {
        let c = &self.model.config;
        GpuState::alloc(
            &self.ctx,
            c.n_layer,
            self.max_seq,
            c.kv_dim(),
            if self.opts.f16_kv { 2 } else { 4 },
        )
    }
    fn position(&self, state: &GpuState) -> usize {
        state.pos
    }
    /// The rows past `len` stay in the buffers but are never read (attention stops at the
    /// position) and the next tokens overwrite them.
    fn truncate(&self, state: &mut GpuState, len: usize) -> Result<()> {
        crate::lm::check_truncate(state.pos, len)?;
        state.pos = len;
        Ok(())
    }

    async fn forward_async(
        &self,
        state: &mut GpuState,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>> {
        let bytes = self.run(state, tokens, Output::Logits { all: all_logits }).await?;
        Ok(words(&bytes).map(f32::from_bits).collect())
    }

    /// Top-k on the GPU, so only k (id, logit) pairs and the log-sum-exp come back; past the
    /// kernel's k, from the whole row.
    async fn forward_top_async(
        &self,
        state: &mut GpuState,
        tokens: &[u32],
        k: usize,
    ) -> Result<TopK> {
        if (1..=MAX_TOP_K).contains(&k) {
            self.forward_topk_async(state, tokens, k).await
        } else {
            Ok(TopK::from_logits(&self.forward_async(state, tokens, false).await?, k))
        }
    }

    /// The masked top-k kernel: a constrained step uploads its allowed set and reads back only
    /// the picks.
    async fn forward_top_allowed_async(
        &self,
        state: &mut GpuState,
        tokens: &[u32],
        k: usize,
        shown: usize,
        allowed: &AllowedSet,
    ) -> Result<AllowedTop> {
        if (1..=MAX_TOP_K).contains(&k) && (1..=MAX_TOP_K).contains(&shown) {
            self.forward_topk_allowed_async(state, tokens, k, shown, allowed).await
        } else {
            let logits = self.forward_async(state, tokens, false).await?;
            Ok(AllowedTop::from_logits(&logits, k, shown, allowed))
        }
    }

    /// The top-k kernel: a greedy or top-k step reads back only the picks.
    fn top_on_device(&self) -> Option<usize> {
        Some(MAX_TOP_K)
    }

    /// One batch: the read-back stays at 64 rows of logits however long the text.
    fn score_chunk(&self) -> usize {
        64
    }

    /// The GPU's passes wait for the device.
    fn answers_at_once(&self) -> bool {
        false
    }
}
