//! What a model will cost, known before a byte of its weights is read: from its GGUF header alone
//! (the first kilobytes or megabytes of the file), its size, parameters, the bytes one decode step
//! reads and the KV cache's bytes per position; from those, the memory a load needs; and from a
//! short calibration on random models (of the CPU path, and of the GPU where one would run it),
//! the decode speed to expect on this machine. The browser's `preflight(url)` is built on it, to
//! say before a download whether a model fits and how fast it will run.

use serde::Serialize;

use std::sync::Arc;

use crate::backend::{cpu_decode_ms, cpu_decode_rate_for, gpu_decode_ms};
use crate::cpu::{CpuModel, Precision};
use crate::error::Result;
use crate::gguf::{Gguf, Header};
use crate::gpu::{GpuContext, GpuModel};
use crate::model::Model;
use crate::quant::GgmlType;
use crate::synthetic::Spec;

/// Bytes a loaded model needs beside its file and KV cache: the engine's code and heap, logits,
/// activations and scratch (an allowance, generous for the models the page runs).
const OVERHEAD_BYTES: usize = 48 << 20;

/// A model's numbers from its header.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ModelPlan {
    pub arch: String,
    pub parameters: usize,
    pub file_bytes: usize,
    /// The type most of its matrix bytes are in ("Q8_0", "Q4_K", ...).
    pub weight_type: String,
    /// Bytes of weights one decode step reads (every layer, the output projection, one
    /// embedding row): what decode speed is made of where memory is the limit.
    pub weight_bytes_per_token: usize,
    pub layers: usize,
    /// The width of its hidden state and of its feed-forward layer.
    pub embedding: usize,
    pub feed_forward: usize,
    pub vocab: usize,
    /// The context the model was trained for.
    pub context_length: usize,
    /// Bytes the KV cache takes per position (f32 keys and values, every layer): the browser's
    /// CPU path and the GPU keep them in f32.
    pub kv_bytes_per_position: usize,
}

/// What the first bytes of a file make: its plan, or how many bytes from the start the header
/// needs at least.
pub enum PlanFromPrefix {
    Plan(ModelPlan),
    NeedMore(usize),
}

impl ModelPlan {
    pub fn from_header(gguf: &Gguf, file_len: usize) -> Result<ModelPlan> {
        let (model, _) = Model::describe_header(gguf, file_len)?;
        let c = &model.config;
        let ty = main_weight_type(&model).unwrap_or(GgmlType::F32);
        Ok(ModelPlan {
            arch: c.arch.gguf_name().to_string(),
            parameters: model.parameter_count(),
            file_bytes: file_len,
            weight_type: ty.name().to_string(),
            weight_bytes_per_token: model.weight_bytes_per_token(),
            layers: c.n_layer,
            embedding: c.n_embd,
            feed_forward: c.n_ff,
            vocab: c.n_vocab,
            context_length: c.n_ctx,
            kv_bytes_per_position: c.n_layer * 2 * c.kv_dim() * 4,
        })
    }

    /// From the first bytes (`prefix`) of a GGUF file of `file_len` bytes; a hostile or
    /// truncated header is an error as soon as it is read ([`Gguf::parse_header`]).
    pub fn from_prefix(prefix: &[u8], file_len: usize) -> Result<PlanFromPrefix> {
        Ok(match Gguf::parse_header(prefix, file_len)? {
            Header::NeedMore(n) => PlanFromPrefix::NeedMore(n),
            Header::Complete(gguf) => {
                PlanFromPrefix::Plan(ModelPlan::from_header(&gguf, file_len)?)
            }
        })
    }

    /// The memory a load with a KV cache of `max_seq` positions needs where the weights are held
    /// in the engine's memory (the CPU path): the file once, the cache, and an allowance.
    pub fn memory_bytes(&self, max_seq: usize) -> usize {
        let positions = max_seq.min(self.context_length.max(1));
        self.file_bytes + self.kv_bytes_per_position * positions + OVERHEAD_BYTES
    }
}

/// The weight type most of `model`'s matrix bytes are in.
pub(crate) fn main_weight_type(model: &Model) -> Option<GgmlType> {
    let mut types: Vec<(GgmlType, usize)> = Vec::new();
    for t in model.tensors.iter().filter(|t| t.rows > 1 && t.cols > 1) {
        match types.iter_mut().find(|(ty, _)| *ty == t.ty) {
            Some((_, bytes)) => *bytes += t.size_bytes,
            None => types.push((t.ty, t.size_bytes)),
        }
    }
    types.into_iter().max_by_key(|&(_, bytes)| bytes).map(|(ty, _)| ty)
}

/// The CPU path's expected decode speed for a model, and what it is made of.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CpuEstimate {
    pub tokens_per_second: f64,
    /// A step's cost that does not grow with the weights' bytes (layers, heads, the vocabulary's
    /// softmax), measured on a narrow random model of the plan's shape.
    pub shape_ms: f64,
    /// How fast the kernels read the plan's weight type, measured on a random model past the
    /// caches.
    pub bytes_per_second: f64,
}

/// The decode speed the CPU path can expect for `plan` here, from two short measurements: a step
/// of a random model with the plan's layers and vocabulary but narrow matrices (its fixed cost),
/// and the rate the kernels read the plan's weight type; the plan's bytes per token beyond the
/// narrow model's are added at that rate. Both models are made in memory (about 12 MB at most):
/// nothing is downloaded.
pub fn cpu_estimate(plan: &ModelPlan, precision: Precision, threads: usize) -> Result<CpuEstimate> {
    let arch = crate::model::Arch::from_gguf_name(&plan.arch)?;
    let ty = GgmlType::ALL.into_iter().find(|t| t.name() == plan.weight_type);
    let ty = ty.unwrap_or(GgmlType::Q8_0);
    let bytes_per_second = cpu_decode_rate_for(arch, ty, precision, threads)?;
    // 32 wide (one Q8_0 block): the matrices cost next to nothing, what is left is the step's
    // work per layer and per vocabulary entry.
    let narrow = Spec {
        weight_type: GgmlType::Q8_0,
        tied: true,
        ..Spec::new(arch, plan.vocab.clamp(16, 1 << 16), 32, plan.layers.clamp(1, 256), 4, 64, 64)
    };
    let probe = Model::from_bytes(crate::synthetic::write(&narrow)?)?;
    let probe_bytes = probe.weight_bytes_per_token();
    let cpu = CpuModel::new(probe).with_precision(precision).with_threads(threads);
    let shape_ms = cpu_decode_ms(&cpu)?;
    let extra = plan.weight_bytes_per_token.saturating_sub(probe_bytes) as f64;
    let ms = shape_ms + 1e3 * extra / bytes_per_second.max(1.0);
    Ok(CpuEstimate { tokens_per_second: 1e3 / ms.max(1e-6), shape_ms, bytes_per_second })
}

/// Bytes of weights the GPU's rate is measured over (see [`gpu_estimate`]).
const RATE_PROBE_BYTES: usize = 32 << 20;

/// What the GPU's decode step should cost for a plan, from [`gpu_estimate`]'s measurements.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuEstimate {
    pub tokens_per_second: f64,
    /// A step's cost that does not grow with the weights' bytes (on a GPU mostly its dispatches,
    /// a few per layer, and the readback), measured on a narrow random model of the plan's shape.
    pub shape_ms: f64,
    /// How fast the kernels read the plan's weight type: the difference in bytes over the
    /// difference in time of two random models that differ only in width.
    pub bytes_per_second: f64,
    /// The adapter it was measured on.
    pub adapter: String,
}

/// The decode speed the GPU of `ctx` can expect for `plan`, as [`cpu_estimate`] makes the CPU
/// path's: a narrow random model with the plan's layers and vocabulary timed on the GPU (its
/// fixed cost), and the kernels' rate on the plan's weight type (Q8_0 where the kernels have
/// none for it) from a wide and a narrow model of as many layers: a GPU step of a small model is
/// mostly fixed cost, so one model's bytes over its time would understate the rate; the wide one
/// has the plan's widths, up to 1024 by 4096, and about 32 MB. Those are uploaded, then freed;
/// nothing is downloaded.
pub async fn gpu_estimate(plan: &ModelPlan, ctx: Arc<GpuContext>) -> Result<GpuEstimate> {
    let arch = crate::model::Arch::from_gguf_name(&plan.arch)?;
    let ty = GgmlType::ALL.into_iter().find(|t| t.name() == plan.weight_type);
    let timed = |spec: Spec| {
        let ctx = ctx.clone();
        async move {
            let model = Model::from_bytes(crate::synthetic::write(&spec)?)?;
            let bytes = model.weight_bytes_per_token();
            let gpu = GpuModel::with_context(ctx, model).await?;
            // The best of 3: whatever else the device does only ever stretches a run.
            let mut best = f64::MAX;
            for _ in 0..3 {
                best = best.min(gpu_decode_ms(&gpu).await?);
            }
            Ok::<_, crate::Error>((bytes as f64, best))
        }
    };
    // The rate at the plan's widths (a GPU's kernels read narrow matrices slower than wide
    // ones), at most 1024 by 4096 (wider models read at least as fast), over enough layers for
    // about 32 MB: the difference in time to a narrow model of as many layers must stand well
    // above a timer's steps (lavapipe's waits come in steps of about 8 ms).
    let dim = plan.embedding.clamp(128, 1024) / 64 * 64;
    let ffn = plan.feed_forward.clamp(128, 4096) / 64 * 64;
    let layer_bytes = (4 * dim * dim + 3 * dim * ffn) * 34 / 32; // Q8_0: 34 bytes per 32
    let layers = (RATE_PROBE_BYTES / layer_bytes).clamp(2, 32);
    let probe = |ty: GgmlType, dim: usize, ffn: usize| Spec {
        weight_type: ty,
        tied: true,
        ..Spec::new(arch, 256, dim, layers, dim / 64, ffn, 64)
    };
    let narrow_twin = timed(probe(GgmlType::Q8_0, 64, 64)).await?;
    let wide_type = ty.unwrap_or(GgmlType::Q8_0);
    let wide = match timed(probe(wide_type, dim, ffn)).await {
        Err(_) if wide_type != GgmlType::Q8_0 => timed(probe(GgmlType::Q8_0, dim, ffn)).await?,
        wide => wide?,
    };
    let bytes_per_second = if wide.1 > narrow_twin.1 {
        (wide.0 - narrow_twin.0) / ((wide.1 - narrow_twin.1) / 1e3)
    } else {
        wide.0 / (wide.1.max(1e-3) / 1e3)
    };
    let narrow = Spec {
        weight_type: GgmlType::Q8_0,
        tied: true,
        ..Spec::new(arch, plan.vocab.clamp(16, 1 << 16), 64, plan.layers.clamp(1, 256), 1, 64, 64)
    };
    let (probe_bytes, shape_ms) = timed(narrow).await?;
    let extra = (plan.weight_bytes_per_token as f64 - probe_bytes).max(0.0);
    let ms = shape_ms + 1e3 * extra / bytes_per_second.max(1.0);
    Ok(GpuEstimate {
        tokens_per_second: 1e3 / ms.max(1e-6),
        shape_ms,
        bytes_per_second,
        adapter: ctx.describe(),
    })
}
