//! The WGSL kernels (one family per file under `shaders/`), their pipelines, and `Pass`: a list
//! of dispatches and copies recorded first and then encoded into one command buffer and one
//! submission, each dispatch with its own slot of uniform parameters.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use wgpu::util::DeviceExt;

use super::context::GpuContext;
use crate::quant::GgmlType;

const DEQUANT: &str = include_str!("../../shaders/dequant.wgsl");
const MATMUL: &str = include_str!("../../shaders/matmul.wgsl");
const EMBEDDING: &str = include_str!("../../shaders/embedding.wgsl");
const RMS_NORM: &str = include_str!("../../shaders/rms_norm.wgsl");
const LAYER_NORM: &str = include_str!("../../shaders/layer_norm.wgsl");
const ROPE: &str = include_str!("../../shaders/rope.wgsl");
const ATTENTION: &str = include_str!("../../shaders/attention.wgsl");
const ADD: &str = include_str!("../../shaders/add.wgsl");
const SILU_MUL: &str = include_str!("../../shaders/silu_mul.wgsl");
const GELU: &str = include_str!("../../shaders/gelu.wgsl");

/// Workgroups per dimension of a dispatch (WebGPU's guaranteed minimum of the limit).
pub const MAX_GROUPS: u32 = 65535;
/// Tokens one matmul workgroup handles (`TB` in matmul.wgsl).
pub const MATMUL_TOKENS: u32 = 8;
/// Largest head size attention.wgsl supports.
pub const MAX_HEAD_DIM: usize = 256;
/// Bytes of uniform parameters per dispatch (the largest `min_uniform_buffer_offset_alignment`).
const PARAM_SLOT: u64 = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Weight matrix (of this type) times a batch of vectors, optional bias.
    Matmul(GgmlType),
    /// Row lookup from a weight matrix of this type.
    Embedding(GgmlType),
    RmsNorm,
    LayerNorm,
    Rope,
    Attention,
    Add,
    SiluMul,
    Gelu,
}

fn type_suffix(ty: GgmlType) -> &'static str {
    match ty {
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::BF16 => "bf16",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q4_K => "q4_k",
        GgmlType::Q6_K => "q6_k",
    }
}

/// The dequant prelude, the forwarder to the type's decoder, then the kernel.
fn with_dequant(ty: GgmlType, kernel: &str) -> String {
    format!(
        "{kernel}\n{DEQUANT}\nfn decode(rb: u32, c: u32, n: u32, v: ptr<function, array<f32, 32>>) {{\n    decode_{}(rb, c, n, v);\n}}\n",
        type_suffix(ty)
    )
}

impl Kernel {
    /// The complete WGSL source of this kernel.
    pub fn source(self) -> String {
        match self {
            Kernel::Matmul(ty) => with_dequant(ty, MATMUL),
            Kernel::Embedding(ty) => with_dequant(ty, EMBEDDING),
            Kernel::RmsNorm => RMS_NORM.into(),
            Kernel::LayerNorm => LAYER_NORM.into(),
            Kernel::Rope => ROPE.into(),
            Kernel::Attention => ATTENTION.into(),
            Kernel::Add => ADD.into(),
            Kernel::SiluMul => SILU_MUL.into(),
            Kernel::Gelu => GELU.into(),
        }
    }
}

/// A kernel's pipeline and the layout of its bind group (derived from the shader).
pub struct Compiled {
    pub pipeline: wgpu::ComputePipeline,
    pub layout: wgpu::BindGroupLayout,
}

/// Compiled pipelines, made on first use and kept.
pub struct Kernels {
    pub ctx: Arc<GpuContext>,
    pipelines: Mutex<HashMap<Kernel, Arc<Compiled>>>,
}

impl Kernels {
    pub fn new(ctx: Arc<GpuContext>) -> Kernels {
        Kernels { ctx, pipelines: Mutex::new(HashMap::new()) }
    }

    pub fn pipeline(&self, k: Kernel) -> Arc<Compiled> {
        let mut map = self.pipelines.lock().unwrap();
        map.entry(k)
            .or_insert_with(|| {
                let device = &self.ctx.device;
                let label = format!("{k:?}");
                let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some(&label),
                    source: wgpu::ShaderSource::Wgsl(k.source().into()),
                });
                let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(&label),
                    layout: None,
                    module: &module,
                    entry_point: Some("main"),
                    compilation_options: Default::default(),
                    cache: None,
                });
                let layout = pipeline.get_bind_group_layout(0);
                Arc::new(Compiled { pipeline, layout })
            })
            .clone()
    }

    /// Compile `kernels` now, reporting shader or pipeline errors as an error instead of a panic.
    pub async fn prepare(&self, kernels: &[Kernel]) -> crate::Result<()> {
        let scope = self.ctx.device.push_error_scope(wgpu::ErrorFilter::Validation);
        for &k in kernels {
            self.pipeline(k);
        }
        match scope.pop().await {
            None => Ok(()),
            Some(e) => Err(super::context::gpu_err(format!("compiling kernels: {e}"))),
        }
    }
}

/// Split `groups` workgroups over x and y (each at most MAX_GROUPS); kernels index `x + y * nx`.
pub fn grid(groups: u32) -> (u32, u32) {
    if groups <= MAX_GROUPS {
        (groups.max(1), 1)
    } else {
        (MAX_GROUPS, groups.div_ceil(MAX_GROUPS))
    }
}

enum Op<'a> {
    Dispatch { pipeline: Arc<Compiled>, buffers: Vec<&'a wgpu::Buffer>, slot: u64, groups: [u32; 3] },
    Copy { src: &'a wgpu::Buffer, src_off: u64, dst: &'a wgpu::Buffer, dst_off: u64, size: u64 },
}

/// Work recorded for one submission.
pub struct Pass<'a> {
    kernels: &'a Kernels,
    ops: Vec<Op<'a>>,
    params: Vec<u8>,
}

impl<'a> Pass<'a> {
    pub fn new(kernels: &'a Kernels) -> Pass<'a> {
        Pass { kernels, ops: Vec::new(), params: Vec::new() }
    }

    /// Run `kernel` with storage `buffers` at bindings 0.., then `params` (u32 words; f32 as bits)
    /// as the uniform at the next binding.
    pub fn dispatch(&mut self, kernel: Kernel, buffers: &[&'a wgpu::Buffer], params: &[u32], groups: [u32; 3]) {
        let slot = self.params.len() as u64;
        for p in params {
            self.params.extend_from_slice(&p.to_le_bytes());
        }
        self.params.resize((slot + PARAM_SLOT) as usize, 0);
        let pipeline = self.kernels.pipeline(kernel);
        self.ops.push(Op::Dispatch { pipeline, buffers: buffers.to_vec(), slot, groups });
    }

    pub fn copy(&mut self, src: &'a wgpu::Buffer, src_off: u64, dst: &'a wgpu::Buffer, dst_off: u64, size: u64) {
        self.ops.push(Op::Copy { src, src_off, dst, dst_off, size });
    }

    /// Encode everything into one command buffer and submit it.
    pub fn submit(self) {
        let device = &self.kernels.ctx.device;
        let params = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("params"),
            contents: if self.params.is_empty() { &[0u8; 16] } else { &self.params },
            usage: wgpu::BufferUsages::UNIFORM,
        });
        let mut encoder = device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("forward") });
        let mut i = 0;
        while i < self.ops.len() {
            if let Op::Copy { src, src_off, dst, dst_off, size } = &self.ops[i] {
                encoder.copy_buffer_to_buffer(src, *src_off, dst, *dst_off, *size);
                i += 1;
                continue;
            }
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
            while let Some(Op::Dispatch { pipeline, buffers, slot, groups }) = self.ops.get(i) {
                let mut entries: Vec<wgpu::BindGroupEntry> = buffers
                    .iter()
                    .enumerate()
                    .map(|(b, buf)| wgpu::BindGroupEntry { binding: b as u32, resource: buf.as_entire_binding() })
                    .collect();
                entries.push(wgpu::BindGroupEntry {
                    binding: buffers.len() as u32,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: &params,
                        offset: *slot,
                        size: wgpu::BufferSize::new(PARAM_SLOT),
                    }),
                });
                let bind = device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: None,
                    layout: &pipeline.layout,
                    entries: &entries,
                });
                pass.set_pipeline(&pipeline.pipeline);
                pass.set_bind_group(0, &bind, &[]);
                pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
                i += 1;
            }
        }
        self.kernels.ctx.queue.submit([encoder.finish()]);
    }
}

/// A storage buffer holding `data` (padded to a whole number of words, at least 16 bytes).
pub fn upload(ctx: &GpuContext, label: &str, data: &[u8]) -> wgpu::Buffer {
    let size = (data.len().div_ceil(4) * 4).max(16) as u64;
    let buffer = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: true,
    });
    buffer.slice(..).get_mapped_range_mut().expect("freshly mapped").slice(..data.len()).copy_from_slice(data);
    buffer.unmap();
    buffer
}

/// A zeroed storage buffer of `bytes` (rounded up to whole words, at least 16).
pub fn storage(ctx: &GpuContext, label: &str, bytes: u64) -> wgpu::Buffer {
    ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size: (bytes.div_ceil(4) * 4).max(16),
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    })
}

/// A buffer to copy results into and map for reading.
pub fn readback(ctx: &GpuContext, bytes: u64) -> wgpu::Buffer {
    ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("readback"),
        size: (bytes.div_ceil(4) * 4).max(16),
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    })
}
