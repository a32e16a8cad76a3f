//! The transformer on the GPU: every weight uploaded once in its GGUF encoding, activations
//! allocated once, and each `forward` recorded into one command buffer and one submission. The
//! model description (`crate::model`: norm, MLP, q/k/v layout, the RoPE table) decides what to
//! compute, as for the CPU path in `crate::cpu`, which is this path's oracle.
//!
//! Three rooms: this file is the model and its state as callers see them (options, the forward
//! passes, the GPU's own rankings, profiles); `stream.rs` makes it (the plan of buffers, the
//! constructors, the bytes as they arrive); `encode.rs` records a pass.

use std::sync::{Arc, Mutex};

use super::context::{gpu_err, GpuContext};
use super::dispatch::{self, GpuTensor};
use super::kernels::{
    by_family, readback, BindCache, Binder, DispatchTime, FamilyTime, Kernels, Timing, MAX_TOP_K,
};
use crate::constraint::AllowedSet;
use crate::error::{Error, Result};
use crate::lm::AllowedTop;
use crate::lm::LanguageModel;
pub use crate::lm::TopK;
use crate::model::{Model, Weights};

/// Activations for up to `batch` tokens, reused by every pass.
pub(super) struct Scratch {
    /// The residual stream.
    pub(super) x: wgpu::Buffer,
    /// Normed activations (prefill; decode norms inside the products).
    pub(super) h: wgpu::Buffer,
    pub(super) qkv: wgpu::Buffer,
    pub(super) q: wgpu::Buffer,
    /// Attention's per-chunk partial results.
    pub(super) chunks: wgpu::Buffer,
    pub(super) attn: wgpu::Buffer,
    /// The MLP's hidden activations.
    pub(super) up: wgpu::Buffer,
    /// gate|up side by side (prefill).
    pub(super) gate_up: wgpu::Buffer,
    pub(super) logits: wgpu::Buffer,
    /// Zeros of n_embd: the bias of a LayerNorm that has none.
    pub(super) zeros: wgpu::Buffer,
    /// The KV cache binding of products that write none.
    pub(super) no_kv: wgpu::Buffer,
}

/// A norm's weights (and LayerNorm's bias) as float offsets in the vectors buffer.
#[derive(Clone, Copy)]
pub(super) struct NormAt {
    pub(super) weight: usize,
    pub(super) bias: Option<usize>,
}

/// What the GPU adds to a layer's description: which products are packed into one buffer (so
/// one dispatch computes them) and where the layer's small vectors are in the vectors buffer.
pub(super) struct LayerPlan {
    /// The q|k|v products as (tensor, first row within q|k|v): one when packed or fused in the
    /// file, more when q, k and v differ in type.
    pub(super) qkv: Vec<(Arc<GpuTensor>, usize)>,
    /// gate|up packed in one buffer, for a gated MLP whose two weights share a type.
    pub(super) gate_up: Option<Arc<GpuTensor>>,
    pub(super) attn_norm: NormAt,
    pub(super) ffn_norm: NormAt,
    /// Biases: q|k|v side by side, the output projection, the MLP's up (and gate), down.
    pub(super) qkv_bias: Option<usize>,
    pub(super) attn_output_bias: Option<usize>,
    pub(super) up_bias: Option<usize>,
    pub(super) gate_bias: Option<usize>,
    pub(super) down_bias: Option<usize>,
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
pub(super) struct Runtime {
    /// (cos, sin) of every rotated pair at every position, filled as positions are reached.
    pub(super) table: Option<wgpu::Buffer>,
    pub(super) table_rows: usize,
    /// `[pos, n, 0, 0, ids...]`: the only thing a decode step uploads.
    pub(super) step: Option<wgpu::Buffer>,
    /// Top-k scratch and output; a constrained step's second output (the unmasked ranking) and
    /// its allowed set, uploaded each such step.
    pub(super) cand: Option<wgpu::Buffer>,
    pub(super) pick: Option<wgpu::Buffer>,
    pub(super) pick_all: Option<wgpu::Buffer>,
    pub(super) mask: Option<wgpu::Buffer>,
    /// Read-back buffers, reused (taken out while a read is pending).
    pub(super) logits_rb: Option<wgpu::Buffer>,
    pub(super) pick_rb: Option<wgpu::Buffer>,
    pub(super) binder: Binder,
    pub(super) bytes: u64,
    pub(super) last: GpuStats,
}

/// What a forward returns.
#[derive(Clone, Copy)]
pub(super) enum Output {
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
    pub(super) ctx: Arc<GpuContext>,
    /// Compiled pipelines: the model's own, or shared with the model it was made beside
    /// ([`GpuModel::with_shared_kernels`]).
    pub(super) kernels: Arc<Kernels>,
    /// The model's weights, uploaded (a tied output projection shares its embedding's buffer;
    /// q|k|v and gate|up are views of packed buffers where their types agree).
    pub(super) weights: Weights<Arc<GpuTensor>>,
    pub(super) plans: Vec<LayerPlan>,
    pub(super) vectors: wgpu::Buffer,
    pub(super) output_norm: NormAt,
    /// Positions per attention chunk.
    pub(super) chunk: usize,
    pub(super) max_seq: usize,
    pub(super) batch: usize,
    /// Rows of `scratch.logits`.
    pub(super) logit_rows: usize,
    pub(super) scratch: Scratch,
    pub(super) opts: GpuOptions,
    /// Bytes of weights and activations.
    pub(super) load_bytes: u64,
    pub(super) rt: Mutex<Runtime>,
}

/// The KV cache of one sequence, on the GPU: per layer, `max_seq` rows of kv_dim values (f32, or
/// f16 with the f16 KV cache) for keys and for values. Cloning copies the filled rows on the GPU
/// (for beam search). Bind groups that use the cache are cached here (they die with it).
pub struct GpuState {
    pub pos: usize,
    /// Per layer: keys from element 0, values from `v_rows` rows on.
    pub(super) kv: Vec<wgpu::Buffer>,
    pub(super) v_rows: usize,
    pub(super) kv_dim: usize,
    pub(super) row_bytes: u64,
    pub(super) ctx: Arc<GpuContext>,
    pub(super) groups: Mutex<BindCache>,
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

    pub(super) fn buffers(&self) -> Vec<&wgpu::Buffer> {
        self.kv.iter().collect()
    }

    /// Element offset of the values in a layer's buffer.
    pub(super) fn v_base(&self) -> usize {
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
        self.chunk = dispatch::attention_chunk(self.max_seq);
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
