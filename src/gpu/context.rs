//! The WebGPU device: one adapter, one device and queue, shared (behind an `Arc`) by the kernels,
//! the weights and every KV cache made from them.

use std::sync::Arc;

use crate::error::{Error, Result};

/// Error text when there is no GPU to run on (tests match on it to skip instead of fail).
pub const NO_ADAPTER: &str = "no WebGPU/Vulkan adapter found";

pub struct GpuContext {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    /// The limits the device was created with (the adapter's own, so the largest it allows).
    pub limits: wgpu::Limits,
    /// Whether the device has `shader-f16` (requested whenever the adapter offers it).
    pub shader_f16: bool,
}

pub(crate) fn gpu_err(msg: impl std::fmt::Display) -> Error {
    Error::Model(format!("GPU: {msg}"))
}

impl GpuContext {
    /// Pick an adapter (a real GPU first, else a software one such as lavapipe) and open a device
    /// with the adapter's full limits. `WGPU_BACKEND` (e.g. `vulkan`) restricts the backends.
    pub async fn new_async() -> Result<Arc<GpuContext>> {
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = wgpu::Backends::from_env().unwrap_or(wgpu::Backends::PRIMARY);
        let instance = wgpu::Instance::new(desc);
        let mut adapter = None;
        for fallback in [false, true] {
            let opts = wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                force_fallback_adapter: fallback,
                ..Default::default()
            };
            if let Ok(a) = instance.request_adapter(&opts).await {
                adapter = Some(a);
                break;
            }
        }
        let adapter = adapter.ok_or_else(|| gpu_err(NO_ADAPTER))?;
        let info = adapter.get_info();
        let limits = adapter.limits();
        let shader_f16 = adapter.features().contains(wgpu::Features::SHADER_F16);
        let required_features =
            if shader_f16 { wgpu::Features::SHADER_F16 } else { wgpu::Features::empty() };
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("nexttoken"),
                required_features,
                required_limits: limits.clone(),
                memory_hints: wgpu::MemoryHints::Performance,
                ..Default::default()
            })
            .await
            .map_err(|e| gpu_err(format!("cannot open a device on {}: {e}", info.name)))?;
        Ok(Arc::new(GpuContext { device, queue, info, limits, shader_f16 }))
    }

    /// Blocking version of [`GpuContext::new_async`] (native only; the browser must await).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn new() -> Result<Arc<GpuContext>> {
        pollster::block_on(GpuContext::new_async())
    }

    /// Largest buffer one storage binding may cover, in bytes (a multiple of 4).
    pub fn max_binding(&self) -> u64 {
        let m = self.limits.max_storage_buffer_binding_size.min(self.limits.max_buffer_size);
        m & !3
    }

    /// One line for logs: adapter name and backend.
    pub fn describe(&self) -> String {
        format!("{} ({:?}, {:?})", self.info.name, self.info.backend, self.info.device_type)
    }

    /// Wait for `buffer` (MAP_READ) to map and return its bytes. Natively this polls the device
    /// to completion; in the browser the map callback resolves the future from the event loop.
    pub async fn read_buffer(&self, buffer: &wgpu::Buffer) -> Result<Vec<u8>> {
        let slot = Arc::new(std::sync::Mutex::new(MapSlot::default()));
        let s2 = slot.clone();
        buffer.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            let mut s = s2.lock().unwrap();
            s.result = Some(r.map_err(|e| e.to_string()));
            if let Some(w) = s.waker.take() {
                w.wake();
            }
        });
        #[cfg(not(target_arch = "wasm32"))]
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| gpu_err(format!("waiting for the device: {e}")))?;
        MapFuture { slot }.await.map_err(|e| gpu_err(format!("reading back a buffer: {e}")))?;
        let bytes = {
            let view = buffer.slice(..).get_mapped_range().map_err(gpu_err)?;
            view.to_vec()
        };
        buffer.unmap();
        Ok(bytes)
    }
}

#[derive(Default)]
struct MapSlot {
    result: Option<std::result::Result<(), String>>,
    waker: Option<std::task::Waker>,
}

/// Resolves when a `map_async` callback has run.
struct MapFuture {
    slot: Arc<std::sync::Mutex<MapSlot>>,
}

impl std::future::Future for MapFuture {
    type Output = std::result::Result<(), String>;
    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let mut s = self.slot.lock().unwrap();
        match s.result.take() {
            Some(r) => std::task::Poll::Ready(r),
            None => {
                s.waker = Some(cx.waker().clone());
                std::task::Poll::Pending
            }
        }
    }
}
