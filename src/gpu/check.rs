//! The GPU at hand checked against the CPU oracle before it is trusted with a model: a driver can
//! compile a kernel wrongly, and a page cannot run `tests/gpu.rs` on its reader's GPU.
//!
//! The check runs a tiny random model built like the loaded one (its architecture, head size,
//! query heads per key/value head, rotated dimensions, weight types and the GPU options it runs
//! with) through both backends: a prefill of more than 8 tokens (the tiled products and flash
//! attention), single-token decode steps and a step of a few tokens (the matrix-vector products
//! for one token and for several), comparing every logit. Its kernels are the loaded model's, so
//! most are compiled already.

use super::context::gpu_err;
use super::model::GpuModel;
use crate::cpu::CpuModel;
use crate::error::Result;
use crate::lm::LanguageModel;
use crate::model::{Arch, Model};
use crate::quant::GgmlType;
use crate::sampling::argmax;
use crate::synthetic::{self, Spec};
use crate::tensor_names::{self as names, block};

/// What the check found.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Checked {
    /// The largest difference between a GPU logit and the CPU's.
    pub max_error: f32,
    /// What was allowed: the f32 kernels agree with the oracle to about 1e-4 on such models and
    /// the f16 path (KV cache, prefill tiles) to about 2e-2; a miscompiled kernel is off by whole
    /// units or gives NaN.
    pub tolerance: f32,
    /// Logit rows compared.
    pub rows: usize,
}

/// The prompt: more than 8 tokens, so the prefill takes the tiled kernels.
const PROMPT: [u32; 12] = [1, 17, 299, 42, 5, 250, 3, 77, 160, 9, 201, 33];

impl GpuModel {
    /// Run the check (see the module's documentation): `Ok` with the largest error when the GPU
    /// agrees with the CPU, an error naming the adapter when it does not.
    pub async fn check_against_cpu(&self) -> Result<Checked> {
        let bytes = synthetic::write(&check_spec(&self.model))?;
        let cpu = CpuModel::new(Model::from_bytes(bytes.clone())?);
        let gpu = GpuModel::with_shared_kernels(self, Model::from_bytes(bytes)?).await?;
        let tolerance =
            if self.options().f16_kv || self.options().f16_prefill { 0.1 } else { 5e-3 };
        let (mut cs, mut gs) = (cpu.new_state(), gpu.new_state());
        let mut max_error = 0f32;
        let mut rows = 0;
        let mut next = PROMPT[0];
        let steps: [&[u32]; 5] = [&PROMPT, &[0], &[0], &[0], &[0, 5, 9]];
        for (i, tokens) in steps.into_iter().enumerate() {
            // Decode steps feed the CPU's own pick, so both run the same sequence.
            let tokens: Vec<u32> = if i == 0 { tokens.to_vec() } else { fed(tokens, next) };
            let want = cpu.forward(&mut cs, &tokens, true)?;
            let got = gpu.forward_async(&mut gs, &tokens, true).await?;
            for (&g, &w) in got.iter().zip(&want) {
                // NaN compares false: count it as out of tolerance.
                let err = (g - w).abs();
                max_error = if err.is_nan() { f32::INFINITY } else { max_error.max(err) };
            }
            if got.len() != want.len() {
                max_error = f32::INFINITY;
            }
            rows += tokens.len();
            let vocab = cpu.vocab_size();
            next = argmax(&want[want.len() - vocab..]);
        }
        if max_error > tolerance {
            return Err(gpu_err(format!(
                "{} computes wrong results: on a test model its logits differ from the CPU path's by up to {max_error} (allowed {tolerance})",
                self.context().describe()
            )));
        }
        Ok(Checked { max_error, tolerance, rows })
    }
}

/// `tokens` with the first replaced by `next` (the previous step's pick).
fn fed(tokens: &[u32], next: u32) -> Vec<u32> {
    let mut t = tokens.to_vec();
    t[0] = next;
    t
}

/// A two-layer model of 300 tokens shaped like `model`: the same architecture, head size,
/// grouping of query heads, rotated dimensions and weight types (each type the file's matrices
/// use appears in at least one matrix, the most common one in the rest).
fn check_spec(model: &Model) -> Spec {
    let c = &model.config;
    // GPT-2 has no grouped heads and its fused q|k|v is as wide as the model.
    let (n_head, n_head_kv, n_embd) = match c.arch {
        Arch::Gpt2 => (2, 2, 2 * c.head_dim),
        _ => ((c.n_head / c.n_head_kv.max(1)).clamp(1, 8), 1, 256),
    };
    let mut spec = Spec {
        n_head_kv,
        head_dim: c.head_dim,
        rope_dims: c.rope_dims.min(c.head_dim),
        seed: 7,
        ..Spec::new(c.arch, 300, n_embd, 2, n_head, 512, 64)
    };
    let mut types: Vec<(GgmlType, usize)> = Vec::new();
    for t in model.tensors.iter().filter(|t| t.rows > 1 && t.cols > 1) {
        match types.iter_mut().find(|(ty, _)| *ty == t.ty) {
            Some((_, bytes)) => *bytes += t.size_bytes,
            None => types.push((t.ty, t.size_bytes)),
        }
    }
    types.sort_by_key(|&(_, bytes)| std::cmp::Reverse(bytes));
    if let Some(&(main, _)) = types.first() {
        spec.weight_type = main;
    }
    // The others, one matrix each (a type whose blocks do not fit a matrix's rows falls back to
    // the writer's whole-blocks type for it).
    let slots = [
        block(1, names::FFN_DOWN),
        block(1, names::ATTN_V),
        names::OUTPUT.to_string(),
        block(0, names::FFN_DOWN),
        block(1, names::FFN_UP),
        block(0, names::ATTN_V),
        block(1, names::ATTN_K),
        block(0, names::FFN_UP),
    ];
    spec.type_overrides = types.iter().skip(1).zip(slots).map(|(&(ty, _), n)| (n, ty)).collect();
    spec
}
