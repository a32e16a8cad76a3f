//! The WebGPU device: one adapter, one device and queue, shared (behind an `Arc`) by the kernels,
//! the weights and every KV cache made from them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

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
    /// Whether the device can write timestamps at compute-pass boundaries (`timestamp-query`,
    /// requested whenever offered): the per-kernel profile needs it.
    pub timestamps: bool,
    /// Set by the device-lost callback (or a failed wait on the device): why it was lost.
    lost: Arc<Mutex<Option<String>>>,
    /// The last error no error scope caught (instead of wgpu's default handler, which panics).
    uncaptured: Arc<Mutex<Option<String>>>,
    /// Buffers created on this device so far (`GpuStats` shows that decode steps make none).
    pub buffers_created: AtomicU64,
}

/// Prefix of the error a lost device gives (the caller can fall back to the CPU path).
pub const DEVICE_LOST: &str = "GPU device lost";

/// Whether `e` says the GPU device was lost (so the caller should continue on the CPU).
pub fn is_device_lost(e: &Error) -> bool {
    e.to_string().contains(DEVICE_LOST)
}

pub(crate) fn gpu_err(msg: impl std::fmt::Display) -> Error {
    Error::Model(format!("GPU: {msg}"))
}

pub(crate) fn lost_err(why: &str) -> Error {
    Error::Model(format!("{DEVICE_LOST}: {why} (continue on the CPU path)"))
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
        let offered = adapter.features();
        let wanted = wgpu::Features::SHADER_F16 | wgpu::Features::TIMESTAMP_QUERY;
        let required_features = offered & wanted;
        let shader_f16 = required_features.contains(wgpu::Features::SHADER_F16);
        let timestamps = required_features.contains(wgpu::Features::TIMESTAMP_QUERY);
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
        let lost = Arc::new(Mutex::new(None));
        let l2 = lost.clone();
        device.set_device_lost_callback(move |reason, msg| {
            let mut l = l2.lock().unwrap_or_else(|p| p.into_inner());
            l.get_or_insert_with(|| format!("{reason:?}: {msg}"));
        });
        let uncaptured = Arc::new(Mutex::new(None));
        let u2 = uncaptured.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let mut u = u2.lock().unwrap_or_else(|p| p.into_inner());
            u.get_or_insert_with(|| e.to_string());
        }));
        Ok(Arc::new(GpuContext {
            device,
            queue,
            info,
            limits,
            shader_f16,
            timestamps,
            lost,
            uncaptured,
            buffers_created: AtomicU64::new(0),
        }))
    }

    /// Why the device was lost, if it was.
    pub fn lost_reason(&self) -> Option<String> {
        self.lost.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Mark the device lost (a wait on it failed, or the caller knows better).
    pub fn mark_lost(&self, why: impl Into<String>) {
        self.lost.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_with(|| why.into());
    }

    /// Err with "GPU device lost: ..." when the device is gone.
    pub fn check_lost(&self) -> Result<()> {
        match self.lost_reason() {
            Some(why) => Err(lost_err(&why)),
            None => Ok(()),
        }
    }

    /// Take the last error that no error scope caught (validation errors and the like).
    pub fn take_uncaptured_error(&self) -> Option<String> {
        self.uncaptured.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Destroy the device (as a driver reset would lose it): every later use errs with
    /// [`DEVICE_LOST`]. For tests of the fallback path.
    pub fn simulate_device_loss(&self) {
        self.device.destroy();
        self.mark_lost("Destroyed: simulated");
    }

    /// A buffer on this device, counted in the statistics.
    pub fn create_buffer(&self, label: &str, size: u64, usage: wgpu::BufferUsages) -> wgpu::Buffer {
        self.count();
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage,
            mapped_at_creation: false,
        })
    }

    /// Like [`GpuContext::create_buffer`], mapped for writing.
    pub fn create_buffer_mapped(
        &self,
        label: &str,
        size: u64,
        usage: wgpu::BufferUsages,
    ) -> wgpu::Buffer {
        self.count();
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage,
            mapped_at_creation: true,
        })
    }

    fn count(&self) {
        self.buffers_created.fetch_add(1, Ordering::Relaxed);
    }

    /// Blocking version of [`GpuContext::new_async`] (native only; the browser must await).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn new() -> Result<Arc<GpuContext>> {
        crate::lm::block_on(GpuContext::new_async())
    }

    /// Largest buffer one storage binding may cover, in bytes (a multiple of 4).
    pub fn max_binding(&self) -> u64 {
        let m = self.limits.max_storage_buffer_binding_size.min(self.limits.max_buffer_size);
        m & !3
    }

    /// One line for logs: adapter name and backend. Browsers may hide the adapter's name: then
    /// "WebGPU's adapter".
    pub fn describe(&self) -> String {
        let name = match self.info.name.trim() {
            "" => "WebGPU's adapter",
            name => name,
        };
        format!("{name} ({:?}, {:?})", self.info.backend, self.info.device_type)
    }

    /// Wait for `buffer` (MAP_READ) to map and return its bytes. Natively this polls the device
    /// to completion; in the browser the map callback resolves the future from the event loop.
    pub async fn read_buffer(&self, buffer: &wgpu::Buffer) -> Result<Vec<u8>> {
        self.check_lost()?;
        let r = self.read_buffer_inner(buffer).await;
        // A lost device shows up as a failed map or wait: say so.
        self.check_lost()?;
        r
    }

    async fn read_buffer_inner(&self, buffer: &wgpu::Buffer) -> Result<Vec<u8>> {
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
    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
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
