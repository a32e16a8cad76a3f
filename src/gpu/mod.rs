//! The WebGPU backend (wgpu): the same forward pass as `cpu`, in WGSL compute kernels.
//!
//! - `context`: adapter and device (Vulkan/Metal/DX12 natively, the browser's WebGPU in wasm);
//! - `kernels`: the shaders under `shaders/` (one kernel family per file; the weight decoders of
//!   `dequant.wgsl` are prepended to the kernels that read weights), pipelines, and `Pass`, which
//!   records a whole forward pass into one submission;
//! - `dispatch`: how each kernel is dispatched (bindings, parameters, grid), one typed function
//!   per kernel, over `kernels`' pipelines;
//! - `model`: `GpuModel`, a `LanguageModel` whose state is a KV cache on the GPU (f32, or f16
//!   where the device has `shader-f16`); besides full logits it picks on the GPU (argmax, top-k
//!   with the log-sum-exp) so a decode step reads back a few bytes;
//! - `stream`: `GpuStream`, a model loaded from its file's bytes as they arrive (a download),
//!   straight into the GPU buffers, never holding the file; the ordinary upload is the same path;
//! - `check`: the GPU at hand against the CPU oracle on a tiny model shaped like the loaded one
//!   (a miscompiling driver is caught at load, before it answers);
//!
//! Weights stay in their GGUF encoding on the GPU and are decoded in the shader, so a Q4_K model
//! takes the same memory there as on disk.

// In the browser wgpu's handles are JS objects, neither Send nor Sync; natively the same `Arc`s
// share them across threads, so the lint only misfires on wasm32.
#![cfg_attr(target_arch = "wasm32", allow(clippy::arc_with_non_send_sync))]

pub mod check;
pub mod context;
pub mod dispatch;
mod encode;
pub mod kernels;
pub mod model;
pub mod stream;

pub use check::Checked;
pub use context::{is_device_lost, GpuContext, DEVICE_LOST, NO_ADAPTER};
pub use model::{GpuModel, GpuOptions, GpuState, GpuStats, TopK};
pub use stream::GpuStream;
