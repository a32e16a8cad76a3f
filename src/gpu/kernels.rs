//! The WGSL kernels (one family per file under `shaders/`), their pipelines, and `Pass`: a list
//! of dispatches and copies recorded first and then encoded into one command buffer and one
//! submission.
//!
//! Every kernel's bind group is storage buffers at bindings 0.. and then its parameters: a
//! uniform slot of `PARAM_SLOT` bytes bound with a dynamic offset into one parameter buffer. A
//! model keeps a [`Binder`]: one parameter buffer (rewritten only when the recorded parameters
//! change, which for decode steps they do not: the position is read on the GPU from a small step
//! buffer) and bind groups cached per (kernel, buffers). So a decode step creates no buffer and
//! no bind group.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::context::GpuContext;
use crate::quant::GgmlType;

/// The shaders, by file name, as compiled in.
const SHADERS: &[(&str, &str)] = &[
    ("dequant.wgsl", include_str!("../../shaders/dequant.wgsl")),
    ("matvec.wgsl", include_str!("../../shaders/matvec.wgsl")),
    ("matmul_tiled.wgsl", include_str!("../../shaders/matmul_tiled.wgsl")),
    ("embedding.wgsl", include_str!("../../shaders/embedding.wgsl")),
    ("rms_norm.wgsl", include_str!("../../shaders/rms_norm.wgsl")),
    ("layer_norm.wgsl", include_str!("../../shaders/layer_norm.wgsl")),
    ("rope.wgsl", include_str!("../../shaders/rope.wgsl")),
    ("attention.wgsl", include_str!("../../shaders/attention.wgsl")),
    ("attention_merge.wgsl", include_str!("../../shaders/attention_merge.wgsl")),
    ("attention_prefill.wgsl", include_str!("../../shaders/attention_prefill.wgsl")),
    ("add.wgsl", include_str!("../../shaders/add.wgsl")),
    ("silu_mul.wgsl", include_str!("../../shaders/silu_mul.wgsl")),
    ("gelu.wgsl", include_str!("../../shaders/gelu.wgsl")),
    ("read_bandwidth.wgsl", include_str!("../../shaders/read_bandwidth.wgsl")),
    ("topk.wgsl", include_str!("../../shaders/topk.wgsl")),
    ("topk_partial.wgsl", include_str!("../../shaders/topk_partial.wgsl")),
    ("topk_merge.wgsl", include_str!("../../shaders/topk_merge.wgsl")),
];

/// The text of `shaders/<file>`: as compiled in, or natively from the folder that
/// `NEXTTOKEN_SHADERS` names where it holds that file (to measure a variant of a kernel on a
/// machine that has a GPU but no Rust toolchain, without rebuilding).
fn shader(file: &str) -> std::borrow::Cow<'static, str> {
    #[cfg(not(target_arch = "wasm32"))]
    if let Some(dir) = std::env::var_os("NEXTTOKEN_SHADERS") {
        if let Ok(text) = std::fs::read_to_string(std::path::Path::new(&dir).join(file)) {
            return text.into();
        }
    }
    let (_, text) = SHADERS.iter().find(|(f, _)| *f == file).expect("a shader of shaders/");
    (*text).into()
}

/// Workgroups per dimension of a dispatch (WebGPU's guaranteed minimum of the limit).
pub const MAX_GROUPS: u32 = 65535;
/// Most tokens one matvec.wgsl dispatch handles (`TB`); larger batches use the tiled kernel.
pub const MATVEC_TOKENS: u32 = 8;
/// Threads of one matvec.wgsl workgroup (`WG`): `WG / team` rows, a team of threads each.
pub const MATVEC_THREADS: u32 = 256;
/// The output tile of one matmul_tiled.wgsl workgroup: rows x tokens (`TR` x `TT`), each
/// thread computing 4 x 4 of them. The largest keeps the most work per byte of workgroup memory
/// read; the smaller ones give products with few rows or tokens enough workgroups to fill a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tile {
    /// 64 x 64, 256 threads.
    Large,
    /// 64 x 32, 128 threads.
    Medium,
    /// 32 x 32, 64 threads.
    Small,
}

impl Tile {
    pub const ALL: [Tile; 3] = [Tile::Large, Tile::Medium, Tile::Small];

    /// (rows, tokens) of the tile.
    pub fn shape(self) -> (u32, u32) {
        match self {
            Tile::Large => (64, 64),
            Tile::Medium => (64, 32),
            Tile::Small => (32, 32),
        }
    }
}
/// Largest head size attention.wgsl supports.
pub const MAX_HEAD_DIM: usize = 256;
/// Largest k of the top-k kernels.
pub const MAX_TOP_K: usize = 64;
/// Bytes of uniform parameters per dispatch (the largest `min_uniform_buffer_offset_alignment`).
pub const PARAM_SLOT: u64 = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Weight matrix (of this type) times up to this many vectors (1, a decode step, or
    /// `MATVEC_TOKENS`), with the norm of its input and an epilogue fused in; `true`: the KV
    /// cache it may write is f16.
    Matvec(GgmlType, bool, u32),
    /// The same product tiled over rows and tokens (this output tile per workgroup), for
    /// prefill batches of many tokens; `true`: the tiles and each block's sums are f16.
    MatmulTiled(GgmlType, Tile, bool),
    /// Row lookup from a weight matrix of this type.
    Embedding(GgmlType),
    RmsNorm,
    LayerNorm,
    /// RoPE; `true`: the output is f16 (the key/value cache of the f16 variant).
    Rope(bool),
    /// Attention over one chunk of the sequence; `true`: the key/value cache is f16; the head
    /// size (a constant of the shader, so its loops unroll and their loads are issued at once).
    Attention(bool, u32),
    /// The merge of attention's chunks.
    AttentionMerge,
    /// Attention of a prefill batch in one pass (flash attention); `true`: the cache is f16; the
    /// head size (a constant: the query and output rows' registers are sized to it).
    AttentionPrefill(bool, u32),
    Add,
    SiluMul,
    Gelu,
    /// Per-workgroup top-k, max and sum of exponentials of a slice of a row of logits.
    TopkPartial,
    /// Merge of the partial top-k lists and log-sum-exp.
    TopkMerge,
    /// A plain buffer read (the benchmark's bandwidth reference).
    ReadBandwidth,
}

fn type_suffix(ty: GgmlType) -> &'static str {
    match ty {
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::BF16 => "bf16",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q5_0 => "q5_0",
        GgmlType::Q5_1 => "q5_1",
        GgmlType::Q4_K => "q4_k",
        GgmlType::Q5_K => "q5_k",
        GgmlType::Q6_K => "q6_k",
    }
}

/// The dequant prelude, the forwarder to the type's decoder, then the kernel.
fn with_dequant(ty: GgmlType, kernel: &str) -> String {
    let dequant = shader("dequant.wgsl");
    format!(
        "{kernel}\n{dequant}\nfn decode(rb: u32, c: u32, n: u32, v: ptr<function, array<f32, 32>>) {{\n    decode_{}(rb, c, n, v);\n}}\n",
        type_suffix(ty)
    )
}

/// matmul_tiled.wgsl's tile element type `tt`, its blocks per step `KB`, and how the norm's
/// f32 partial sums are kept in a `vec4<tt>` of the weights' tile once it is free: in f16 as
/// frexp's fraction in two halves (22 bits) and its exponent (naga cannot bitcast an f32 to two
/// halves).
const TILES_F32: &str = "alias tt = f32;
const KB: u32 = 1u;
fn to_tile(s: f32) -> vec4<f32> { return vec4<f32>(s, 0.0, 0.0, 0.0); }
fn from_tile(v: vec4<f32>) -> f32 { return v.x; }
";
const TILES_F16: &str = "enable f16;
alias tt = f16;
const KB: u32 = 2u;
fn to_tile(s: f32) -> vec4<f16> {
    let f = frexp(s);
    let hi = f16(f.fract);
    return vec4<f16>(hi, f16(f.fract - f32(hi)), f16(f.exp), 0.0h);
}
fn from_tile(v: vec4<f16>) -> f32 { return ldexp(f32(v.x) + f32(v.y), i32(v.z)); }
";

/// Whether wgpu adds bounds checks to the kernels' buffer accesses: yes, unless natively
/// `NEXTTOKEN_GPU_BOUNDS_CHECKS=0` (to measure what they cost; the kernels' indices are
/// computed from shapes Rust checked, but the checks are what keeps a mistake from reading or
/// writing past a binding).
fn shader_bounds_checks() -> bool {
    #[cfg(not(target_arch = "wasm32"))]
    if std::env::var("NEXTTOKEN_GPU_BOUNDS_CHECKS").is_ok_and(|v| v == "0") {
        return false;
    }
    true
}

/// The element type of the key/value cache as a WGSL alias `kvt`.
fn with_kv_type(f16: bool, kernel: &str) -> String {
    if f16 {
        format!("enable f16;\nalias kvt = f16;\n{kernel}")
    } else {
        format!("alias kvt = f32;\n{kernel}")
    }
}

/// The head size as the constants `HD` (elements), `HD4` (vec4s) and `HV` (vec4s per lane of
/// attention_prefill.wgsl's four), at most `MAX_HEAD_DIM`.
fn with_head_dim(hd: u32, kernel: &str) -> String {
    let hd4 = hd.div_ceil(4);
    format!(
        "const HD: u32 = {hd}u;\nconst HD4: u32 = {hd4}u;\nconst HV: u32 = {}u;\n{kernel}",
        hd4.div_ceil(4)
    )
}

impl Kernel {
    /// The complete WGSL source of this kernel.
    pub fn source(self) -> String {
        match self {
            Kernel::Matvec(ty, h, tokens) => {
                let matvec = format!("const TB: u32 = {tokens}u;\n{}", shader("matvec.wgsl"));
                with_kv_type(h, &with_dequant(ty, &matvec))
            }
            Kernel::MatmulTiled(ty, tile, h) => {
                let (tr, tt) = tile.shape();
                let elem = if h { TILES_F16 } else { TILES_F32 };
                let tiled = shader("matmul_tiled.wgsl");
                let tiled =
                    format!("{elem}const TR: u32 = {tr}u;\nconst TT: u32 = {tt}u;\n{tiled}");
                with_dequant(ty, &tiled)
            }
            Kernel::Embedding(ty) => with_dequant(ty, &shader("embedding.wgsl")),
            Kernel::RmsNorm => shader("rms_norm.wgsl").into(),
            Kernel::LayerNorm => shader("layer_norm.wgsl").into(),
            Kernel::Rope(h) => with_kv_type(h, &shader("rope.wgsl")),
            Kernel::Attention(h, hd) => {
                with_kv_type(h, &with_head_dim(hd, &shader("attention.wgsl")))
            }
            Kernel::AttentionMerge => shader("attention_merge.wgsl").into(),
            Kernel::AttentionPrefill(h, hd) => {
                with_kv_type(h, &with_head_dim(hd, &shader("attention_prefill.wgsl")))
            }
            Kernel::Add => shader("add.wgsl").into(),
            Kernel::SiluMul => shader("silu_mul.wgsl").into(),
            Kernel::Gelu => shader("gelu.wgsl").into(),
            Kernel::TopkPartial => {
                format!("{}\n{}", shader("topk_partial.wgsl"), shader("topk.wgsl"))
            }
            Kernel::TopkMerge => format!("{}\n{}", shader("topk_merge.wgsl"), shader("topk.wgsl")),
            Kernel::ReadBandwidth => shader("read_bandwidth.wgsl").into(),
        }
    }

    /// The kernel family, for the per-kernel profile.
    pub fn family(self) -> &'static str {
        match self {
            Kernel::Matvec(..) => "matvec",
            Kernel::MatmulTiled(..) => "matmul tiled",
            Kernel::Embedding(_) => "embedding",
            Kernel::RmsNorm | Kernel::LayerNorm => "norm",
            Kernel::Rope(_) => "rope",
            Kernel::Attention(..) => "attention chunks",
            Kernel::AttentionMerge => "attention merge",
            Kernel::AttentionPrefill(..) => "attention prefill",
            Kernel::Add => "add",
            Kernel::SiluMul => "silu*up",
            Kernel::Gelu => "gelu",
            Kernel::TopkPartial | Kernel::TopkMerge => "top-k",
            Kernel::ReadBandwidth => "read bandwidth",
        }
    }

    fn entry(self) -> &'static str {
        match self {
            Kernel::TopkPartial => "partial",
            Kernel::TopkMerge => "merge",
            _ => "main",
        }
    }

    /// The storage bindings 0.. in order: `true` for read-write, `false` for read-only. The
    /// uniform parameters follow at the next binding.
    pub fn storage_bindings(self) -> &'static [bool] {
        match self {
            Kernel::Matvec(..) => &[false, false, false, false, false, true, true],
            Kernel::MatmulTiled(..) => &[false, false, false, true],
            Kernel::Embedding(_) => &[false, false, true],
            Kernel::RmsNorm => &[false, false, true],
            Kernel::LayerNorm => &[false, false, false, true],
            Kernel::Rope(_) => &[false, false, false, true],
            Kernel::Attention(..) | Kernel::AttentionPrefill(..) => &[false, false, false, true],
            Kernel::AttentionMerge => &[false, false, true],
            Kernel::Add | Kernel::SiluMul => &[false, true],
            Kernel::Gelu => &[true],
            Kernel::TopkPartial => &[false, false, true],
            Kernel::TopkMerge => &[false, true, true],
            Kernel::ReadBandwidth => &[false, true],
        }
    }
}

/// A kernel's pipeline and the layout of its bind group.
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
                let desc = wgpu::ShaderModuleDescriptor {
                    label: Some(&label),
                    source: wgpu::ShaderSource::Wgsl(k.source().into()),
                };
                // SAFETY: the one check turned off is naga's loop bounding (a 64-bit counter
                // and a break added to every loop), which is there to keep a driver from
                // treating an infinite loop as unreachable. Every loop in shaders/ counts towards
                // a bound that does not change inside it, by a step that is a positive constant
                // or a parameter the shader clamps to at least 1, and the bounds are model
                // shapes far below 2^32 (no counter wraps), so none is infinite. The counter kept NVIDIA's compiler from unrolling the
                // kernels' constant-bound loops, so their private arrays went to memory: on an
                // H200 every kernel ran several times slower (gfx-rs/wgpu#7698). Buffer
                // bounds checks stay on.
                let checks = wgpu::ShaderRuntimeChecks {
                    force_loop_bounding: false,
                    bounds_checks: shader_bounds_checks(),
                    ..wgpu::ShaderRuntimeChecks::checked()
                };
                let module = unsafe { device.create_shader_module_trusted(desc, checks) };
                let storage = k.storage_bindings();
                let mut entries: Vec<wgpu::BindGroupLayoutEntry> = storage
                    .iter()
                    .enumerate()
                    .map(|(i, &rw)| wgpu::BindGroupLayoutEntry {
                        binding: i as u32,
                        visibility: wgpu::ShaderStages::COMPUTE,
                        ty: wgpu::BindingType::Buffer {
                            ty: wgpu::BufferBindingType::Storage { read_only: !rw },
                            has_dynamic_offset: false,
                            min_binding_size: None,
                        },
                        count: None,
                    })
                    .collect();
                entries.push(wgpu::BindGroupLayoutEntry {
                    binding: storage.len() as u32,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Uniform,
                        has_dynamic_offset: true,
                        min_binding_size: wgpu::BufferSize::new(PARAM_SLOT),
                    },
                    count: None,
                });
                let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                    label: Some(&label),
                    entries: &entries,
                });
                let pl = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                    label: Some(&label),
                    bind_group_layouts: &[Some(&layout)],
                    immediate_size: 0,
                });
                let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(&label),
                    layout: Some(&pl),
                    module: &module,
                    entry_point: Some(k.entry()),
                    // Every kernel writes its workgroup memory before reading it, so none
                    // needs it zeroed first: natively wgpu would otherwise have one invocation
                    // store zeros over all of it (naga's polyfill) or leave it to the driver,
                    // before any work, in every workgroup (10 KiB in matvec.wgsl). Browsers
                    // zero it regardless (WebGPU requires it).
                    compilation_options: wgpu::PipelineCompilationOptions {
                        zero_initialize_workgroup_memory: false,
                        ..Default::default()
                    },
                    cache: None,
                });
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
    Dispatch {
        kernel: Kernel,
        buffers: Vec<&'a wgpu::Buffer>,
        slot: u64,
        groups: [u32; 3],
        /// What the profile calls it, and the weight bytes it reads (0: not a product).
        label: &'static str,
        bytes: u64,
    },
    Copy {
        src: &'a wgpu::Buffer,
        src_off: u64,
        dst: &'a wgpu::Buffer,
        dst_off: u64,
        size: u64,
    },
}

type BindKey = (Kernel, Vec<wgpu::Buffer>);

/// Bind groups cached per (kernel, buffers). The cache holds the buffers alive, so it lives as
/// long as they do: the model's for its own buffers, each state's for those with its KV cache.
#[derive(Default)]
pub struct BindCache {
    groups: HashMap<BindKey, wgpu::BindGroup>,
}

/// A model's parameter buffer and bind group cache. The buffer keeps the parameters of the last
/// few distinct "plans" (the parameter blob of one kind of forward: a decode step, a top-k step,
/// a prefill of some length); a forward whose blob is already there uploads nothing and binds it
/// by dynamic offset. When the buffer is full it starts over (uploads are queue-ordered, so work
/// already submitted still sees its parameters).
#[derive(Default)]
pub struct Binder {
    params: Option<wgpu::Buffer>,
    /// (blob, byte offset in `params`).
    plans: Vec<(Vec<u8>, u64)>,
    used: u64,
    pub cache: BindCache,
    /// Bind groups created so far (for the no-creation-per-token check).
    pub bind_groups_created: u64,
    /// Bytes written to the parameter buffer so far.
    pub param_bytes_written: u64,
}

impl Binder {
    /// Bytes of the parameter buffer.
    pub fn bytes(&self) -> u64 {
        self.params.as_ref().map_or(0, |b| b.size())
    }
}

/// What one submission did.
#[derive(Default)]
pub struct PassStats {
    pub dispatches: usize,
    pub submissions: usize,
    /// With [`Pass::profile`] on a device with timestamps: where they will be readable.
    pub timestamps: Option<Timestamps>,
}

/// The timestamps of a profiled submission: a begin and end tick per dispatch, in `readback`
/// once the submission has run; `labels` and `bytes` per dispatch, in order.
pub struct Timestamps {
    pub readback: wgpu::Buffer,
    pub labels: Vec<&'static str>,
    pub bytes: Vec<u64>,
}

/// One dispatch's time in a profiled submission.
#[derive(Debug, Clone, PartialEq)]
pub struct DispatchTime {
    pub label: &'static str,
    pub micros: f64,
    /// Weight bytes it reads (0 for kernels that are not products).
    pub bytes: u64,
}

/// The dispatches of one profiled pass that share a label (a kernel family, and for products
/// what they fuse), summed; see [`by_family`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct FamilyTime {
    pub kernel: &'static str,
    pub dispatches: usize,
    pub micros: f64,
    /// Weight bytes read.
    pub bytes: u64,
}

/// Dispatch times summed per label, in the order each label first runs.
pub fn by_family(times: &[DispatchTime]) -> Vec<FamilyTime> {
    let mut rows: Vec<FamilyTime> = Vec::new();
    for t in times {
        match rows.iter_mut().find(|r| r.kernel == t.label) {
            Some(r) => {
                r.dispatches += 1;
                r.micros += t.micros;
                r.bytes += t.bytes;
            }
            None => rows.push(FamilyTime {
                kernel: t.label,
                dispatches: 1,
                micros: t.micros,
                bytes: t.bytes,
            }),
        }
    }
    rows
}

impl Timestamps {
    /// The times of the dispatches, from the read-back ticks (`period`: nanoseconds per tick).
    pub fn times(&self, ticks: &[u8], period: f32) -> Vec<DispatchTime> {
        let tick = |i: usize| u64::from_le_bytes(ticks[8 * i..8 * i + 8].try_into().expect("8"));
        (0..self.labels.len())
            .map(|i| DispatchTime {
                label: self.labels[i],
                micros: tick(2 * i + 1).saturating_sub(tick(2 * i)) as f64 * period as f64 / 1e3,
                bytes: self.bytes[i],
            })
            .collect()
    }
}

/// Most dispatches one profiled submission times (two queries each).
const MAX_PROFILED: usize = 2048;

/// What a submission's timestamps time (where the device has timestamp queries).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timing {
    Off,
    /// Every dispatch in a compute pass of its own, timed: where the time goes, kernel by kernel
    /// (each pass's own start and end add a little to each).
    EachDispatch,
    /// The passes as they run untimed (all dispatches between two copies in one), each timed
    /// whole: the GPU's time for the submission, against which the wall time shows what
    /// recording, submitting and waiting cost.
    EachPass,
}

/// Work recorded for one submission.
pub struct Pass<'a> {
    kernels: &'a Kernels,
    ops: Vec<Op<'a>>,
    params: Vec<u8>,
    timing: Timing,
}

impl<'a> Pass<'a> {
    pub fn new(kernels: &'a Kernels) -> Pass<'a> {
        Pass { kernels, ops: Vec::new(), params: Vec::new(), timing: Timing::Off }
    }

    /// Time the submission (where the device has timestamp queries). For profiles, not for speed.
    pub fn time(&mut self, timing: Timing) {
        self.timing = timing;
    }

    /// Run `kernel` with storage `buffers` at bindings 0.., then `params` (u32 words; f32 as bits)
    /// as the uniform at the next binding.
    pub fn dispatch(
        &mut self,
        kernel: Kernel,
        buffers: &[&'a wgpu::Buffer],
        params: &[u32],
        groups: [u32; 3],
    ) {
        self.dispatch_labelled(kernel, kernel.family(), 0, buffers, params, groups);
    }

    /// [`Pass::dispatch`] with the profile's name for it and the weight bytes it reads.
    pub fn dispatch_labelled(
        &mut self,
        kernel: Kernel,
        label: &'static str,
        bytes: u64,
        buffers: &[&'a wgpu::Buffer],
        params: &[u32],
        groups: [u32; 3],
    ) {
        debug_assert_eq!(buffers.len(), kernel.storage_bindings().len(), "{kernel:?}");
        let slot = self.params.len() as u64;
        for p in params {
            self.params.extend_from_slice(&p.to_le_bytes());
        }
        self.params.resize((slot + PARAM_SLOT) as usize, 0);
        let buffers = buffers.to_vec();
        self.ops.push(Op::Dispatch { kernel, buffers, slot, groups, label, bytes });
    }

    pub fn copy(
        &mut self,
        src: &'a wgpu::Buffer,
        src_off: u64,
        dst: &'a wgpu::Buffer,
        dst_off: u64,
        size: u64,
    ) {
        self.ops.push(Op::Copy { src, src_off, dst, dst_off, size });
    }

    /// Encode everything into one command buffer and submit it, with a parameter buffer and bind
    /// groups of its own (for one-off work: the host helpers).
    pub fn submit(self) -> PassStats {
        let mut binder = Binder::default();
        self.submit_with(&mut binder, None)
    }

    /// Encode and submit using `binder`'s parameter buffer and bind groups; dispatches that bind
    /// one of `state`'s buffers take their bind groups from `state`'s cache instead.
    pub fn submit_with(
        self,
        binder: &mut Binder,
        mut state: Option<(&[&wgpu::Buffer], &mut BindCache)>,
    ) -> PassStats {
        let ctx = &self.kernels.ctx;
        let device = &ctx.device;
        let need = (self.params.len() as u64).max(PARAM_SLOT);
        if binder.params.as_ref().is_none_or(|b| b.size() < need) {
            // Room for several plans. Grown: every cached bind group points at the old buffer.
            let size = (4 * need)
                .next_power_of_two()
                .max(64 << 10)
                .min(ctx.limits.max_buffer_size.max(need));
            binder.params = Some(ctx.create_buffer(
                "params",
                size,
                wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            ));
            binder.cache.groups.clear();
            if let Some((_, c)) = state.as_mut() {
                c.groups.clear();
            }
            binder.plans.clear();
            binder.used = 0;
        }
        let params = binder.params.clone().expect("just made");
        let base = match binder.plans.iter().find(|(blob, _)| *blob == self.params) {
            Some(&(_, base)) => base,
            None => {
                if binder.used + need > params.size() {
                    binder.plans.clear();
                    binder.used = 0;
                }
                let base = binder.used;
                if !self.params.is_empty() {
                    ctx.queue.write_buffer(&params, base, &self.params);
                    binder.param_bytes_written += self.params.len() as u64;
                }
                binder.used += need;
                binder.plans.push((self.params.clone(), base));
                base
            }
        };
        let mut stats = PassStats::default();
        let mut encoder = device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("forward") });
        let each = self.timing == Timing::EachDispatch;
        let dispatches = self.ops.iter().filter(|op| matches!(op, Op::Dispatch { .. })).count();
        // Passes: runs of dispatches between copies (one per dispatch when each is timed).
        let runs = self
            .ops
            .iter()
            .enumerate()
            .filter(|&(i, op)| {
                matches!(op, Op::Dispatch { .. })
                    && (i == 0 || !matches!(self.ops[i - 1], Op::Dispatch { .. }))
            })
            .count();
        let profiled = if each { dispatches } else { runs };
        let timed = self.timing != Timing::Off && ctx.timestamps && profiled <= MAX_PROFILED;
        let query_set = timed.then(|| {
            device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("profile"),
                ty: wgpu::QueryType::Timestamp,
                count: 2 * profiled as u32,
            })
        });
        let mut labels = Vec::new();
        let mut bytes = Vec::new();
        let mut i = 0;
        while i < self.ops.len() {
            if let Op::Copy { src, src_off, dst, dst_off, size } = &self.ops[i] {
                encoder.copy_buffer_to_buffer(src, *src_off, dst, *dst_off, *size);
                i += 1;
                continue;
            }
            // Profiled: one pass per dispatch, timestamps at its boundaries.
            let timestamp_writes = query_set.as_ref().map(|q| wgpu::ComputePassTimestampWrites {
                query_set: q,
                beginning_of_pass_write_index: Some(2 * labels.len() as u32),
                end_of_pass_write_index: Some(2 * labels.len() as u32 + 1),
            });
            let mut pass = encoder
                .begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes });
            let mut in_pass = 0;
            while let Some(Op::Dispatch { kernel, buffers, slot, groups, label, bytes: b }) =
                self.ops.get(i)
            {
                if each && query_set.is_some() && in_pass == 1 {
                    break;
                }
                in_pass += 1;
                let compiled = self.kernels.pipeline(*kernel);
                let in_state = state
                    .as_ref()
                    .is_some_and(|(bufs, _)| buffers.iter().any(|b| bufs.contains(b)));
                let cache = match state.as_mut() {
                    Some((_, c)) if in_state => &mut **c,
                    _ => &mut binder.cache,
                };
                let key: BindKey = (*kernel, buffers.iter().map(|b| (*b).clone()).collect());
                let bind = cache.groups.entry(key).or_insert_with(|| {
                    binder.bind_groups_created += 1;
                    let mut entries: Vec<wgpu::BindGroupEntry> = buffers
                        .iter()
                        .enumerate()
                        .map(|(b, buf)| wgpu::BindGroupEntry {
                            binding: b as u32,
                            resource: buf.as_entire_binding(),
                        })
                        .collect();
                    entries.push(wgpu::BindGroupEntry {
                        binding: buffers.len() as u32,
                        resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                            buffer: &params,
                            offset: 0,
                            size: wgpu::BufferSize::new(PARAM_SLOT),
                        }),
                    });
                    device.create_bind_group(&wgpu::BindGroupDescriptor {
                        label: None,
                        layout: &compiled.layout,
                        entries: &entries,
                    })
                });
                pass.set_pipeline(&compiled.pipeline);
                pass.set_bind_group(0, &*bind, &[(base + *slot) as u32]);
                pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
                stats.dispatches += 1;
                if each && query_set.is_some() {
                    labels.push(*label);
                    bytes.push(*b);
                }
                i += 1;
            }
            if !each && query_set.is_some() {
                labels.push("pass");
                bytes.push(0);
            }
        }
        if let Some(q) = &query_set {
            let size = 16 * profiled as u64;
            let resolve = ctx.create_buffer(
                "profile ticks",
                size,
                wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            );
            let readback = readback(ctx, size);
            encoder.resolve_query_set(q, 0..2 * profiled as u32, &resolve, 0);
            encoder.copy_buffer_to_buffer(&resolve, 0, &readback, 0, size);
            stats.timestamps = Some(Timestamps { readback, labels, bytes });
        }
        ctx.queue.submit([encoder.finish()]);
        stats.submissions += 1;
        stats
    }
}

/// A storage buffer holding `data` (padded to a whole number of words, at least 16 bytes).
pub fn upload(ctx: &GpuContext, label: &str, data: &[u8]) -> wgpu::Buffer {
    let size = (data.len().div_ceil(4) * 4).max(16) as u64;
    let usage =
        wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC;
    let buffer = ctx.create_buffer_mapped(label, size, usage);
    buffer
        .slice(..)
        .get_mapped_range_mut()
        .expect("freshly mapped")
        .slice(..data.len())
        .copy_from_slice(data);
    buffer.unmap();
    buffer
}

/// A zeroed storage buffer of `bytes` (rounded up to whole words, at least 16).
pub fn storage(ctx: &GpuContext, label: &str, bytes: u64) -> wgpu::Buffer {
    let usage =
        wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC;
    ctx.create_buffer(label, (bytes.div_ceil(4) * 4).max(16), usage)
}

/// A buffer to copy results into and map for reading.
pub fn readback(ctx: &GpuContext, bytes: u64) -> wgpu::Buffer {
    ctx.create_buffer(
        "readback",
        (bytes.div_ceil(4) * 4).max(16),
        wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
    )
}

#[cfg(not(target_arch = "wasm32"))]
/// Copy the first `n` floats of `buf` back to the host (after everything submitted before;
/// blocks: the host helpers, tests and benchmarks).
pub fn read(ctx: &GpuContext, buf: &wgpu::Buffer, n: usize) -> crate::Result<Vec<f32>> {
    let rb = readback(ctx, n as u64 * 4);
    let mut enc =
        ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("read") });
    if n > 0 {
        enc.copy_buffer_to_buffer(buf, 0, &rb, 0, n as u64 * 4);
    }
    ctx.queue.submit([enc.finish()]);
    let bytes = crate::lm::block_on(ctx.read_buffer(&rb))?;
    // A kernel that failed to compile or a dispatch that failed validation left `buf` as it
    // was: say so rather than return it.
    if let Some(e) = ctx.take_uncaptured_error() {
        return Err(super::context::gpu_err(format!("a GPU command failed: {e}")));
    }
    Ok(bytes[..n * 4]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}
