//! Which backend runs a model: the front ends' shared policy.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::gpu::GpuContext;

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
            Ok(ctx) if ctx.info.device_type == wgpu::DeviceType::Cpu => BackendChoice::Cpu {
                reason: format!(
                    "cpu (the only adapter is software: {}; --backend gpu forces it)",
                    ctx.describe()
                ),
            },
            Ok(ctx) => gpu(ctx),
            Err(e) => BackendChoice::Cpu { reason: format!("cpu ({e})") },
        }),
    }
}
