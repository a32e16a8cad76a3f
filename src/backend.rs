//! Which backend runs a model: the front ends' shared policy.
//!
//! `auto` never takes a software adapter (SwiftShader, lavapipe, llvmpipe: a CPU emulating a GPU
//! is far slower than the CPU path). On a real GPU it takes the faster backend for the model at
//! hand, measured: a few decode steps of the loaded model on the GPU against the CPU path's
//! (natively its own steps; in the browser, where the CPU path does not hold the weights, the
//! model's bytes per token over the CPU kernels' measured rate on a model of the same weight
//! type), after the GPU has passed the check against the CPU oracle (`gpu::check`). A 16-core
//! CPU decodes SmolLM2-135M faster than an H200 through wgpu (docs/gpu.md), so no size rule
//! holds everywhere.

use std::sync::Arc;

use crate::cpu::{CpuModel, Precision};
use crate::error::{Error, Result};
use crate::gpu::{Checked, GpuContext, GpuModel};
use crate::lm::LanguageModel;
use crate::model::{Arch, Model};
use crate::preflight::main_weight_type;
use crate::quant::GgmlType;
use crate::timing::default_clock;

/// What the user asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendRequest {
    /// The GPU when it is worth it, otherwise the CPU.
    Auto,
    Cpu,
    Gpu,
}

impl std::str::FromStr for BackendRequest {
    type Err = Error;
    fn from_str(name: &str) -> Result<Self> {
        match name {
            "auto" => Ok(BackendRequest::Auto),
            "cpu" => Ok(BackendRequest::Cpu),
            "gpu" => Ok(BackendRequest::Gpu),
            other => Err(Error::Input(format!("unknown backend {other:?}: auto, cpu or gpu"))),
        }
    }
}

/// The backend chosen, with a line saying which and why (for logs).
pub enum BackendChoice {
    Gpu { context: Arc<GpuContext>, reason: String },
    Cpu { reason: String },
}

impl BackendChoice {
    pub fn reason(&self) -> &str {
        match self {
            BackendChoice::Gpu { reason, .. } | BackendChoice::Cpu { reason } => reason,
        }
    }
}

/// Why an adapter is a software one (a CPU emulating a GPU: the platform says so, or its name
/// is one of the known emulators'), or `None` for real hardware. Browsers may hide adapter
/// names; WebGPU's `isFallbackAdapter` still says so for SwiftShader.
pub fn software_adapter(info: &wgpu::AdapterInfo) -> Option<String> {
    let name = info.name.to_lowercase();
    let known = ["swiftshader", "lavapipe", "llvmpipe", "softpipe", "microsoft basic render"];
    if known.iter().any(|k| name.contains(k)) {
        return Some(format!("the only GPU adapter is {}, a CPU emulating a GPU", info.name));
    }
    (info.device_type == wgpu::DeviceType::Cpu)
        .then(|| "the only GPU adapter is a software fallback (a CPU emulating a GPU)".to_string())
}

/// Decode steps each backend is timed on.
const TIMED_STEPS: usize = 4;

/// Milliseconds per decode step of `gpu`, ranking on the GPU as generation does (the top 64
/// come back), after a short prompt and one untimed step.
pub async fn gpu_decode_ms(gpu: &GpuModel) -> Result<f64> {
    let mut state = gpu.new_state();
    let prompt = timing_prompt(gpu.vocab_size());
    let mut tok = gpu.forward_topk_async(&mut state, &prompt, 64).await?.ids[0];
    tok = gpu.forward_topk_async(&mut state, &[tok], 64).await?.ids[0];
    let start = default_clock();
    for _ in 0..TIMED_STEPS {
        tok = gpu.forward_topk_async(&mut state, &[tok], 64).await?.ids[0];
    }
    Ok((default_clock() - start) / TIMED_STEPS as f64)
}

/// Milliseconds per decode step of `cpu`, as [`gpu_decode_ms`] times the GPU: the median of 5
/// such runs, each from a fresh state (a step of a small model takes a fraction of a
/// millisecond, near a browser clock's resolution and easily stretched by another tab).
pub fn cpu_decode_ms(cpu: &CpuModel) -> Result<f64> {
    let prompt = timing_prompt(cpu.vocab_size());
    let mut runs = Vec::with_capacity(5);
    for _ in 0..5 {
        let mut state = cpu.new_state();
        let mut tok = cpu.forward_top(&mut state, &prompt, 64)?.ids[0];
        tok = cpu.forward_top(&mut state, &[tok], 64)?.ids[0];
        let start = default_clock();
        for _ in 0..TIMED_STEPS {
            tok = cpu.forward_top(&mut state, &[tok], 64)?.ids[0];
        }
        runs.push((default_clock() - start) / TIMED_STEPS as f64);
    }
    runs.sort_by(f64::total_cmp);
    Ok(runs[2])
}

/// Four tokens of a vocabulary of `n`.
fn timing_prompt(n: usize) -> Vec<u32> {
    (0..4).map(|i| crate::timing::bench_token(i, n)).collect()
}

/// Bytes of weights per second the CPU path decodes at with `precision` and `threads`, measured
/// on a one-layer random model (about 12 MB, past the caches) whose matrices have `model`'s most
/// common weight type: with the model's bytes per token, an estimate of its decode step where
/// the CPU path does not hold its weights.
pub fn cpu_decode_rate(model: &Model, precision: Precision, threads: usize) -> Result<f64> {
    let ty = main_weight_type(model).unwrap_or(GgmlType::Q8_0);
    cpu_decode_rate_for(model.config.arch, ty, precision, threads)
}

/// [`cpu_decode_rate`] for a model of `arch` whose matrices are `ty`.
pub fn cpu_decode_rate_for(
    arch: Arch,
    ty: GgmlType,
    precision: Precision,
    threads: usize,
) -> Result<f64> {
    let spec = crate::synthetic::Spec {
        weight_type: ty,
        ..crate::synthetic::Spec::new(arch, 256, 1024, 1, 16, 2816, 64)
    };
    let probe = Model::from_bytes(crate::synthetic::write(&spec)?)?;
    let bytes = probe.weight_bytes_per_token() as f64;
    let cpu = CpuModel::new(probe).with_precision(precision).with_threads(threads);
    Ok(bytes / (cpu_decode_ms(&cpu)?.max(1e-3) / 1e3))
}

/// What `auto` found for one model on one device, and what it runs on.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Verdict {
    /// Whether the GPU runs it.
    pub gpu: bool,
    /// One sentence for the stats: which backend and why.
    pub reason: String,
    pub gpu_ms_per_token: f64,
    pub cpu_ms_per_token: f64,
    /// The CPU figure is the model's bytes per token over the CPU kernels' measured rate, not
    /// the model's own steps.
    pub cpu_estimated: bool,
    /// The GPU's check against the CPU oracle.
    pub check: Checked,
}

impl Verdict {
    /// The faster backend (the GPU on a tie: it also prefills faster), from measured decode
    /// steps; `device` names the GPU in the reason.
    pub fn decide(
        device: &str,
        check: Checked,
        gpu_ms: f64,
        cpu_ms: f64,
        cpu_estimated: bool,
    ) -> Verdict {
        let gpu = gpu_ms <= cpu_ms;
        let how = if cpu_estimated { "estimated from its measured rate" } else { "measured" };
        let rate = |ms: f64| 1e3 / ms.max(1e-6);
        let reason = format!(
            "auto: {device} decodes at {:.0} tok/s, the CPU path at {:.0} tok/s ({how}): {}",
            rate(gpu_ms),
            rate(cpu_ms),
            if gpu { "the GPU runs it" } else { "the CPU path runs it" }
        );
        Verdict {
            gpu,
            reason,
            gpu_ms_per_token: gpu_ms,
            cpu_ms_per_token: cpu_ms,
            cpu_estimated,
            check,
        }
    }
}

/// `auto` on a real GPU, for a model loaded on it: the GPU's check against the CPU oracle (an
/// error when it fails), its decode step timed, and the CPU path's from `cpu_ms` (milliseconds
/// per step, and whether that is an estimate); the faster runs it.
pub async fn verdict(
    gpu: &GpuModel,
    cpu_ms: impl FnOnce() -> Result<(f64, bool)>,
) -> Result<Verdict> {
    let check = gpu.check_against_cpu().await?;
    let gpu_ms = gpu_decode_ms(gpu).await?;
    let (cpu_ms, estimated) = cpu_ms()?;
    Ok(Verdict::decide(&gpu.context().describe(), check, gpu_ms, cpu_ms, estimated))
}

/// Natively: `Gpu` opens the GPU or fails; `Auto` uses it unless there is none or the only
/// adapter is a software one (lavapipe, SwiftShader: slower than the CPU path).
#[cfg(not(target_arch = "wasm32"))]
pub fn choose_native(request: BackendRequest) -> Result<BackendChoice> {
    let gpu = |context: Arc<GpuContext>| {
        let reason = format!("gpu, {}", context.describe());
        BackendChoice::Gpu { context, reason }
    };
    match request {
        BackendRequest::Cpu => Ok(BackendChoice::Cpu { reason: "cpu".into() }),
        BackendRequest::Gpu => Ok(gpu(GpuContext::new()?)),
        BackendRequest::Auto => Ok(match GpuContext::new() {
            Ok(ctx) if software_adapter(&ctx.info).is_some() => BackendChoice::Cpu {
                reason: format!(
                    "cpu (auto: {}, slower than the CPU path; --backend gpu forces it)",
                    software_adapter(&ctx.info).unwrap_or_default()
                ),
            },
            Ok(ctx) => gpu(ctx),
            Err(e) => BackendChoice::Cpu { reason: format!("cpu ({e})") },
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adapter(name: &str, device_type: wgpu::DeviceType) -> wgpu::AdapterInfo {
        wgpu::AdapterInfo {
            name: name.into(),
            ..wgpu::AdapterInfo::new(device_type, wgpu::Backend::Vulkan)
        }
    }

    #[test]
    fn software_adapters_are_recognised_by_type_or_name() {
        use wgpu::DeviceType::{Cpu, DiscreteGpu, IntegratedGpu, Other};
        // Chromium's SwiftShader: no name, WebGPU's isFallbackAdapter (wgpu: DeviceType::Cpu).
        assert!(software_adapter(&adapter("", Cpu)).unwrap().contains("software fallback"));
        for name in ["llvmpipe (LLVM 15.0.6, 256 bits)", "SwiftShader Device (Subzero)"] {
            let why = software_adapter(&adapter(name, Other)).unwrap();
            assert!(why.contains(name) && why.contains("CPU emulating a GPU"), "{why}");
        }
        assert_eq!(software_adapter(&adapter("NVIDIA H200", DiscreteGpu)), None);
        assert_eq!(software_adapter(&adapter("", IntegratedGpu)), None);
    }

    #[test]
    fn the_faster_backend_wins_and_the_reason_says_so() {
        let check = Checked { max_error: 1e-5, tolerance: 5e-3, rows: 18 };
        let v = Verdict::decide("NVIDIA H200", check.clone(), 2.5, 1.75, false);
        assert!(!v.gpu);
        assert_eq!(
            v.reason,
            "auto: NVIDIA H200 decodes at 400 tok/s, the CPU path at 571 tok/s (measured): the CPU path runs it"
        );
        let v = Verdict::decide("GPU", check.clone(), 3.0, 6.6, true);
        assert!(v.gpu && v.reason.ends_with("(estimated from its measured rate): the GPU runs it"));
        // A tie goes to the GPU, which also prefills faster.
        assert!(Verdict::decide("GPU", check, 2.0, 2.0, false).gpu);
    }
}
