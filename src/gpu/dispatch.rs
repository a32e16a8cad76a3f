//! Recording each kernel into a `Pass` with its parameters and grid: the one place that knows
//! each shader's bindings and `Params` layout. Used by the model and by the host helpers.

use super::context::{gpu_err, GpuContext};
pub use super::kernels::Tile;
use super::kernels::{
    grid, storage, upload, Kernel, Pass, MATVEC_THREADS, MATVEC_TOKENS, MAX_HEAD_DIM, MAX_TOP_K,
};
use crate::error::Result;
use crate::model::Norm;
use crate::quant::GgmlType;

/// A weight tensor on the GPU in its GGUF encoding, split by rows into buffers no larger than
/// one storage binding allows.
pub struct GpuTensor {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub row_bytes: usize,
    pub parts: Vec<Part>,
}

pub struct Part {
    pub row0: usize,
    pub rows: usize,
    pub buffer: wgpu::Buffer,
    /// Byte offset of the part's first row in `buffer` (tensors packed into one buffer).
    pub byte0: usize,
}

impl GpuTensor {
    /// Upload `bytes` (`rows` rows of `cols` elements of `ty`) at once (the host helpers; a
    /// model's weights are placed by `GpuModel::plan` and written as the file's bytes come).
    pub fn upload(
        ctx: &GpuContext,
        name: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> Result<GpuTensor> {
        GpuTensor::make(ctx, name, ty, rows, cols, bytes.len(), |row0, n, row_bytes| {
            upload(ctx, name, &bytes[row0 * row_bytes..(row0 + n) * row_bytes])
        })
    }

    /// Buffers (zeros) for a tensor of `rows` rows of `cols` elements of `ty` whose encoding
    /// takes `size_bytes`: one, or several parts of whole rows where the tensor exceeds the
    /// device's storage binding limit. Their bytes are written later (`stream::Filler`).
    pub fn alloc(
        ctx: &GpuContext,
        name: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        size_bytes: usize,
    ) -> Result<GpuTensor> {
        GpuTensor::make(ctx, name, ty, rows, cols, size_bytes, |_, n, row_bytes| {
            storage(ctx, name, (n * row_bytes) as u64)
        })
    }

    /// The tensor's parts (rows that fit one storage binding), each buffer from
    /// `buffer(first row, rows, row bytes)`.
    fn make(
        ctx: &GpuContext,
        name: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        size_bytes: usize,
        mut buffer: impl FnMut(usize, usize, usize) -> wgpu::Buffer,
    ) -> Result<GpuTensor> {
        let row_bytes = ty.row_bytes(cols);
        if !cols.is_multiple_of(ty.block_size()) || size_bytes != rows * row_bytes {
            return Err(gpu_err(format!(
                "tensor {name}: {size_bytes} bytes do not hold {rows} rows of {cols} {}",
                ty.name()
            )));
        }
        let per_part = (ctx.max_binding() / row_bytes.max(1) as u64) as usize;
        if per_part == 0 {
            return Err(gpu_err(format!(
                "tensor {name}: one row of {row_bytes} bytes exceeds the device's storage binding limit of {} bytes",
                ctx.max_binding()
            )));
        }
        let mut parts = Vec::new();
        let mut row0 = 0;
        while row0 < rows {
            let n = per_part.min(rows - row0);
            parts.push(Part { row0, rows: n, buffer: buffer(row0, n, row_bytes), byte0: 0 });
            row0 += n;
        }
        Ok(GpuTensor { ty, rows, cols, row_bytes, parts })
    }

    /// The single buffer of a small tensor (norm weights, biases).
    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.parts[0].buffer
    }

    /// One buffer (zeros) for tensors of one type and row length, each `(name, rows, size in
    /// bytes)`, one after the other, so one dispatch can multiply them all (q|k|v, gate|up).
    /// Returns the whole (all rows) and a view of each; `None` when they differ in type or
    /// length or do not fit in one storage binding (then they get buffers of their own).
    pub fn alloc_packed(
        ctx: &GpuContext,
        ty: GgmlType,
        cols: usize,
        pieces: &[(&str, usize, usize)],
    ) -> Option<(GpuTensor, Vec<GpuTensor>)> {
        let row_bytes = ty.row_bytes(cols);
        let rows: usize = pieces.iter().map(|p| p.1).sum();
        if !cols.is_multiple_of(ty.block_size())
            || pieces.iter().any(|&(_, r, b)| b != r * row_bytes)
            || (rows * row_bytes) as u64 > ctx.max_binding()
        {
            return None;
        }
        let label = pieces.iter().map(|p| p.0).collect::<Vec<_>>().join("|");
        let buffer = storage(ctx, &label, (rows * row_bytes) as u64);
        let tensor = |row_first: usize, rows: usize| GpuTensor {
            ty,
            rows,
            cols,
            row_bytes,
            parts: vec![Part {
                row0: 0,
                rows,
                buffer: buffer.clone(),
                byte0: row_first * row_bytes,
            }],
        };
        let mut views = Vec::new();
        let mut at = 0;
        for &(_, r, _) in pieces {
            views.push(tensor(at, r));
            at += r;
        }
        Some((tensor(0, rows), views))
    }
}

/// One word of a kernel's uniform `Params`.
pub trait Word: Copy {
    fn word(self) -> u32;
}

impl Word for u32 {
    fn word(self) -> u32 {
        self
    }
}

impl Word for f32 {
    fn word(self) -> u32 {
        self.to_bits()
    }
}

/// A kernel's uniform parameters as a Rust struct laid out like its WGSL `struct Params` (one
/// 4-byte scalar per field, in order; `tests/gpu.rs` checks each against its shader's source).
macro_rules! params {
    ($(#[$meta:meta])* $name:ident for $kernel:literal { $($field:ident: $ty:ident),* $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, Default)]
        pub struct $name {
            $(pub $field: $ty),*
        }

        impl $name {
            /// The shader file this struct mirrors.
            pub const SHADER: &'static str = $kernel;
            /// `(name, WGSL type)` of each field, in order.
            pub const FIELDS: &'static [(&'static str, &'static str)] =
                &[$((stringify!($field), stringify!($ty))),*];

            pub fn words(&self) -> Vec<u32> {
                vec![$(Word::word(self.$field)),*]
            }
        }
    };
}

params! {
    /// matvec.wgsl
    MatvecParams for "matvec.wgsl" {
        rows: u32, cols: u32, n_tok: u32, row_bytes: u32, w_byte0: u32, x_row0: u32, norm: u32,
        eps: f32, norm_w: u32, norm_b: u32, bias: u32, epilogue: u32, y_stride: u32,
        y_col0: u32, up_row: u32, row0: u32, q_dim: u32, kv_dim: u32, head_dim: u32,
        rope_dims: u32, rope_mode: u32, start: u32, v_base: u32, team: u32,
    }
}

params! {
    /// matmul_tiled.wgsl
    TiledParams for "matmul_tiled.wgsl" {
        rows: u32, cols: u32, n_tok: u32, row_bytes: u32, x_row0: u32, y_stride: u32,
        y_col0: u32, bias_row0: u32, has_bias: u32, w_byte0: u32, accumulate: u32,
        norm_w: u32, eps: f32,
    }
}

params! {
    /// attention.wgsl
    AttentionParams for "attention.wgsl" {
        n_head: u32, n_head_kv: u32, head_dim: u32, start: u32, scale: f32, v_base: u32,
        chunk: u32, max_chunks: u32,
    }
}

params! {
    /// attention_prefill.wgsl
    AttentionPrefillParams for "attention_prefill.wgsl" {
        n_head: u32, n_head_kv: u32, head_dim: u32, start: u32, scale: f32, v_base: u32,
        n_tok: u32,
    }
}

params! {
    /// attention_merge.wgsl
    MergeParams for "attention_merge.wgsl" {
        n_head: u32, head_dim: u32, start: u32, chunk: u32, max_chunks: u32,
    }
}

params! {
    /// embedding.wgsl
    EmbeddingParams for "embedding.wgsl" {
        n_tok: u32, cols: u32, row_bytes: u32, row0: u32, rows: u32, use_pos: u32,
        pos_off: u32, id0: u32, accumulate: u32,
    }
}

params! {
    /// rope.wgsl
    RopeParams for "rope.wgsl" {
        n_tok: u32, n_head: u32, head_dim: u32, rope_dims: u32, mode: u32, in_stride: u32,
        in_col0: u32, out_stride: u32, out_row0: u32, start: u32, out_at_pos: u32,
    }
}

params! {
    /// rms_norm.wgsl and layer_norm.wgsl
    NormParams for "rms_norm.wgsl" { n: u32, eps: f32 }
}

params! {
    /// silu_mul.wgsl
    SiluMulParams for "silu_mul.wgsl" { n: u32, width: u32 }
}

params! {
    /// add.wgsl and gelu.wgsl
    ElementwiseParams for "add.wgsl" { n: u32 }
}

params! {
    /// topk_partial.wgsl
    TopkPartialParams for "topk_partial.wgsl" { n: u32, x_off: u32, k: u32, slice: u32, masked: u32 }
}

params! {
    /// read_bandwidth.wgsl
    ReadParams for "read_bandwidth.wgsl" { n: u32, stride: u32 }
}

params! {
    /// topk_merge.wgsl
    TopkMergeParams for "topk_merge.wgsl" { groups: u32, k: u32, chain: u32 }
}

fn u(x: usize) -> u32 {
    u32::try_from(x).expect("size fits in u32")
}

/// `n` rows of activations (one per token) starting at row `row0` of `buf`.
#[derive(Clone, Copy)]
pub struct Rows<'a> {
    pub buf: &'a wgpu::Buffer,
    pub row0: usize,
    pub n: usize,
}

/// Where a matmul writes: `y[t * stride + col0 + r]`.
#[derive(Clone, Copy)]
pub struct Out<'a> {
    pub buf: &'a wgpu::Buffer,
    pub stride: usize,
    pub col0: usize,
}

/// Whether `n` tokens go through matvec.wgsl (decode) rather than the tiled kernel (prefill).
pub fn fits_matvec(n: usize) -> bool {
    n <= MATVEC_TOKENS as usize
}

/// `y[t][col0 + r] = W[r] . x[t] (+ bias[r])` for the rows of `x`: matvec.wgsl for a few tokens
/// (decode), the tiled kernel for more (prefill). `bias`: a float offset in `fused.vectors`.
pub fn matmul<'a>(
    pass: &mut Pass<'a>,
    w: &'a GpuTensor,
    bias: Option<usize>,
    x: Rows<'a>,
    y: Out<'a>,
    fused: &Fused<'a>,
) {
    product(pass, w, bias, x, y, fused, false)
}

/// `y[t][col0 + r] += W[r] . x[t] (+ bias[r])`: a product added to the residual stream, by the
/// matvec.wgsl ADD epilogue for a few tokens, the tiled kernel's accumulating store for more.
pub fn matmul_add<'a>(
    pass: &mut Pass<'a>,
    w: &'a GpuTensor,
    bias: Option<usize>,
    x: Rows<'a>,
    y: Out<'a>,
    fused: &Fused<'a>,
) {
    product(pass, w, bias, x, y, fused, true)
}

/// `matmul` (`add` false) or `matmul_add` (true).
fn product<'a>(
    pass: &mut Pass<'a>,
    w: &'a GpuTensor,
    bias: Option<usize>,
    x: Rows<'a>,
    y: Out<'a>,
    fused: &Fused<'a>,
    add: bool,
) {
    if fits_matvec(x.n) {
        let epilogue = if add { Epilogue::Add } else { Epilogue::Store };
        matvec(pass, w, x, y, Matvec { norm: None, bias, epilogue }, fused);
    } else {
        let opts = TiledOpts { accumulate: add, ..TiledOpts::default() };
        matmul_tiled_with(pass, w, bias, x, y, fused, opts);
    }
}

/// The tiled matrix-matrix product (matmul_tiled.wgsl), for any number of tokens.
pub fn matmul_tiled<'a>(
    pass: &mut Pass<'a>,
    w: &'a GpuTensor,
    bias: Option<usize>,
    x: Rows<'a>,
    y: Out<'a>,
    fused: &Fused<'a>,
) {
    matmul_tiled_with(pass, w, bias, x, y, fused, TiledOpts::default());
}

/// What a tiled product does besides `W . x + bias`.
#[derive(Clone, Copy, Default)]
pub struct TiledOpts {
    /// The output tile (`None`: [`tile_for`] the product's size).
    pub tile: Option<Tile>,
    /// Add the product to what the output holds (the residual stream).
    pub accumulate: bool,
    /// RMSNorm the input first: its weights' float offset in the vectors buffer, and epsilon.
    pub rms_norm: Option<(usize, f32)>,
}

/// Workgroups below which a product takes a smaller tile: a few per compute unit of a large GPU
/// (an H200 has 132), so a 576-row product of a 512-token batch still spreads over the device.
const TILED_MIN_GROUPS: u32 = 200;

/// The largest tile that gives a product of `rows` x `n_tok` at least [`TILED_MIN_GROUPS`]
/// workgroups (the smallest if none does).
pub fn tile_for(rows: usize, n_tok: usize) -> Tile {
    let groups = |t: Tile| {
        let (tr, tt) = t.shape();
        u(rows).div_ceil(tr) * u(n_tok).div_ceil(tt)
    };
    Tile::ALL.into_iter().find(|&t| groups(t) >= TILED_MIN_GROUPS).unwrap_or(Tile::Small)
}

/// [`matmul_tiled`] with [`TiledOpts`]: the tile, the accumulating store, the input's RMSNorm.
pub fn matmul_tiled_with<'a>(
    pass: &mut Pass<'a>,
    w: &'a GpuTensor,
    bias: Option<usize>,
    x: Rows<'a>,
    y: Out<'a>,
    fused: &Fused<'a>,
    opts: TiledOpts,
) {
    let TiledOpts { tile, accumulate, rms_norm } = opts;
    let tile = tile.unwrap_or_else(|| tile_for(w.rows, x.n));
    let (tr, tt) = tile.shape();
    for part in &w.parts {
        let (gx, gy) = grid(u(part.rows).div_ceil(tr));
        let gz = u(x.n).div_ceil(tt);
        let params = TiledParams {
            rows: u(part.rows),
            cols: u(w.cols),
            n_tok: u(x.n),
            row_bytes: u(w.row_bytes),
            x_row0: u(x.row0),
            y_stride: u(y.stride),
            y_col0: u(y.col0 + part.row0),
            bias_row0: u(bias.unwrap_or(0) + part.row0),
            has_bias: bias.is_some() as u32,
            w_byte0: u(part.byte0),
            accumulate: accumulate as u32,
            norm_w: rms_norm.map_or(NONE, |n| u(n.0)),
            eps: rms_norm.map_or(0.0, |n| n.1),
        };
        let buffers = [&part.buffer, x.buf, fused.vectors, y.buf];
        let kernel = Kernel::MatmulTiled(w.ty, tile, fused.f16_tiles);
        let bytes = (part.rows * w.row_bytes) as u64;
        let label = match (rms_norm.is_some(), accumulate) {
            (true, true) => "matmul tiled rms-norm +residual",
            (true, false) => "matmul tiled rms-norm",
            (false, true) => "matmul tiled +residual",
            (false, false) => "matmul tiled",
        };
        pass.dispatch_labelled(kernel, label, bytes, &buffers, &params.words(), [gx, gy, gz]);
    }
}

/// The buffers every matvec.wgsl dispatch binds besides its weights, input and output: the
/// model's small vectors (norm weights and biases, projection biases, as f32), the RoPE table,
/// the step buffer, and a KV cache (a stand-in for products that do not write one).
#[derive(Clone, Copy)]
pub struct Fused<'a> {
    pub vectors: &'a wgpu::Buffer,
    pub table: &'a wgpu::Buffer,
    pub step: &'a wgpu::Buffer,
    pub no_kv: &'a wgpu::Buffer,
    /// Whether KV caches (and `no_kv`) hold f16.
    pub f16_kv: bool,
    /// Whether the tiled products (prefill) use f16 tiles and per-block f16 sums.
    pub f16_tiles: bool,
}

/// A norm applied to the input of a product: weights (and LayerNorm's bias) at these float
/// offsets in the vectors buffer.
#[derive(Clone, Copy)]
pub struct NormIn {
    pub kind: Norm,
    pub eps: f32,
    pub weight: usize,
    pub bias: Option<usize>,
}

/// How the q|k|v rows are laid out and where keys and values go.
#[derive(Clone, Copy)]
pub struct QkvOut<'a> {
    /// First row of this product within q|k|v (a multiple of head_dim).
    pub row0: usize,
    pub q_dim: usize,
    pub kv_dim: usize,
    pub head_dim: usize,
    pub rope_dims: usize,
    pub mode: RopeMode,
    /// The layer's KV cache: keys, then values from element `v_base`.
    pub kv: &'a wgpu::Buffer,
    pub v_base: usize,
    /// Index of the first token in the step's batch.
    pub start: usize,
}

/// What happens to each output of a matvec.wgsl product (see the shader).
#[derive(Clone, Copy)]
pub enum Epilogue<'a> {
    Store,
    /// Add to the output (the residual stream).
    Add,
    /// `silu(gate) * up`: the weight's rows are the gate's, then from `up_row` the up's.
    Gated {
        up_row: usize,
    },
    Gelu,
    /// RoPE on q and k, q to the output, k and v into the KV cache.
    Qkv(QkvOut<'a>),
}

/// One fused product: norm of the input, bias (a float offset in the vectors buffer), epilogue.
#[derive(Clone, Copy)]
pub struct Matvec<'a> {
    pub norm: Option<NormIn>,
    pub bias: Option<usize>,
    pub epilogue: Epilogue<'a>,
}

const NONE: u32 = u32::MAX;

/// Threads per row of a matvec.wgsl product of rows of `cols` elements: a power of two from 8
/// to 16, so a workgroup holds 16 rows (32 for rows of under 8 chunks) and each thread decodes
/// a few chunks of 32 elements. Measured on an H200 (docs/gpu.md): 16 rows per workgroup
/// beat 4 and 8 on the 1B model's 2048-wide rows (fewer workgroups staging and norming the same
/// activations) and matched them on SmolLM2-135M's 576-wide ones. `NEXTTOKEN_MATVEC_TEAM=n`
/// (natively; a power of two, 8 to 128) sets it instead, to measure another GPU.
pub fn matvec_team(cols: usize) -> u32 {
    team_override().unwrap_or_else(|| (cols.div_ceil(32).next_power_of_two() as u32).clamp(8, 16))
}

fn team_override() -> Option<u32> {
    #[cfg(not(target_arch = "wasm32"))]
    {
        static TEAM: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
        *TEAM.get_or_init(|| {
            let v = std::env::var("NEXTTOKEN_MATVEC_TEAM").ok()?.parse::<u32>().ok()?;
            Some(v.clamp(8, 128).next_power_of_two())
        })
    }
    #[cfg(target_arch = "wasm32")]
    None
}

/// `y = epilogue(W . norm(x) + bias)` for up to `MATVEC_TOKENS` tokens (matvec.wgsl). Gated and
/// q|k|v products need `w` in one part (the model packs them so).
pub fn matvec<'a>(
    pass: &mut Pass<'a>,
    w: &'a GpuTensor,
    x: Rows<'a>,
    y: Out<'a>,
    m: Matvec<'a>,
    fused: &Fused<'a>,
) {
    assert!(u(x.n) <= MATVEC_TOKENS, "matvec handles at most {MATVEC_TOKENS} tokens");
    let (epilogue, outputs, label) = match m.epilogue {
        Epilogue::Store => (0, w.rows, "matvec"),
        Epilogue::Add => (1, w.rows, "matvec +residual"),
        Epilogue::Gated { up_row } => (2, up_row, "matvec gate|up silu"),
        Epilogue::Gelu => (3, w.rows, "matvec up gelu"),
        Epilogue::Qkv(_) => (4, w.rows, "matvec q|k|v rope kv"),
    };
    if matches!(m.epilogue, Epilogue::Gated { .. } | Epilogue::Qkv(_)) {
        assert_eq!(w.parts.len(), 1, "gated and q|k|v products need one part");
    }
    let norm = m.norm.map_or(0, |n| match n.kind {
        Norm::Rms => 1,
        Norm::Layer => 2,
    });
    // One token (a decode step) has a kernel of its own, without the loops over tokens.
    let tokens = if x.n == 1 { 1 } else { MATVEC_TOKENS };
    for part in &w.parts {
        let rows = if let Epilogue::Gated { .. } = m.epilogue { outputs } else { part.rows };
        let mut p = MatvecParams {
            rows: u(rows),
            cols: u(w.cols),
            n_tok: u(x.n),
            row_bytes: u(w.row_bytes),
            w_byte0: u(part.byte0),
            x_row0: u(x.row0),
            norm,
            eps: m.norm.map_or(0.0, |n| n.eps),
            norm_w: m.norm.map_or(NONE, |n| u(n.weight)),
            norm_b: m.norm.and_then(|n| n.bias).map_or(NONE, u),
            bias: m.bias.map_or(NONE, |b| u(b + part.row0)),
            epilogue,
            y_stride: u(y.stride),
            y_col0: u(y.col0 + part.row0),
            up_row: if let Epilogue::Gated { up_row } = m.epilogue { u(up_row) } else { 0 },
            team: matvec_team(w.cols),
            ..MatvecParams::default()
        };
        let mut kv = fused.no_kv;
        if let Epilogue::Qkv(q) = m.epilogue {
            p.row0 = u(q.row0);
            p.q_dim = u(q.q_dim);
            p.kv_dim = u(q.kv_dim);
            p.head_dim = u(q.head_dim);
            p.rope_dims = u(q.rope_dims);
            p.rope_mode = q.mode as u32;
            p.start = u(q.start);
            p.v_base = u(q.v_base);
            kv = q.kv;
        }
        let rows_per_group = MATVEC_THREADS / p.team;
        let per_group = if epilogue == 2 { rows_per_group / 2 } else { rows_per_group };
        let (gx, gy) = grid(u(rows).div_ceil(per_group));
        let buffers = [&part.buffer, x.buf, fused.vectors, fused.table, fused.step, y.buf, kv];
        let (kernel, bytes) =
            (Kernel::Matvec(w.ty, fused.f16_kv, tokens), (part.rows * w.row_bytes) as u64);
        pass.dispatch_labelled(kernel, label, bytes, &buffers, &p.words(), [gx, gy, 1]);
    }
}

/// Words before the token ids in the step buffer: `[pos, n, 0, 0, ids...]`. Kernels read the
/// position of the call's first token from word 0, so decode steps differ only in this buffer.
pub const STEP_IDS: usize = 4;

/// The step buffer's contents for `tokens` at position `pos`.
pub fn step_words(pos: usize, tokens: &[u32]) -> Vec<u8> {
    let mut w = vec![u(pos), u(tokens.len()), 0, 0];
    w.extend_from_slice(tokens);
    w.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The tokens one dispatch covers: `start..start + n` of the step's batch. `step` holds their
/// ids (after `STEP_IDS` words) and, in word 0, the position of the batch's first token.
#[derive(Clone, Copy)]
pub struct Tokens<'a> {
    pub step: &'a wgpu::Buffer,
    pub start: usize,
    pub n: usize,
}

/// Which rows of an embedding table the tokens read.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// The token's id: written to `y`.
    Ids,
    /// The token's position (learned positions): added to `y`.
    Positions,
}

/// One row of `w` per token into `y` (rows of `w.cols`).
pub fn embedding<'a>(
    pass: &mut Pass<'a>,
    w: &'a GpuTensor,
    tokens: Tokens<'a>,
    lookup: Lookup,
    y: &'a wgpu::Buffer,
) {
    let by_position = lookup == Lookup::Positions;
    let (id0, pos_off) = if by_position { (0, tokens.start) } else { (tokens.start, 0) };
    for part in &w.parts {
        assert_eq!(part.byte0, 0, "embedding tables are not packed");
        let params = EmbeddingParams {
            n_tok: u(tokens.n),
            cols: u(w.cols),
            row_bytes: u(w.row_bytes),
            row0: u(part.row0),
            rows: u(part.rows),
            use_pos: by_position as u32,
            pos_off: u(pos_off),
            id0: u(STEP_IDS + id0),
            accumulate: by_position as u32,
        };
        let buffers = [&part.buffer, tokens.step, y];
        pass.dispatch(Kernel::Embedding(w.ty), &buffers, &params.words(), [u(tokens.n), 1, 1]);
    }
}

/// A norm as the model applies it: its kind, epsilon and weights (LayerNorm needs a bias
/// buffer: zeros if the model has none).
pub struct NormOp<'a> {
    pub kind: Norm,
    pub eps: f32,
    pub weight: &'a wgpu::Buffer,
    pub bias: Option<&'a wgpu::Buffer>,
}

/// `n_tok` rows of `width` of `x` normalised into `y`.
pub fn norm<'a>(
    pass: &mut Pass<'a>,
    op: NormOp<'a>,
    x: &'a wgpu::Buffer,
    width: usize,
    n_tok: usize,
    y: &'a wgpu::Buffer,
) {
    let params = NormParams { n: u(width), eps: op.eps }.words();
    match op.kind {
        Norm::Layer => {
            let b = op.bias.expect("layer norm needs a bias buffer (zeros if the model has none)");
            pass.dispatch(Kernel::LayerNorm, &[x, op.weight, b, y], &params, [u(n_tok), 1, 1]);
        }
        Norm::Rms => pass.dispatch(Kernel::RmsNorm, &[x, op.weight, y], &params, [u(n_tok), 1, 1]),
    }
}

/// RoPE mode: 0 copy, 1 interleaved, 2 half split (see rope.wgsl).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeMode {
    Copy = 0,
    Interleaved = 1,
    HalfSplit = 2,
}

/// Where rope writes: rows `row0 + t` of `buf`, plus the token's position when `at_pos` (the
/// KV cache); `f16`: `buf` holds f16 (the f16 KV cache).
pub struct RopeOut<'a> {
    pub buf: &'a wgpu::Buffer,
    pub row0: usize,
    pub at_pos: bool,
    pub f16: bool,
}

/// Where rope reads: each token's row `t` of `buf` at `buf[t * stride + col0 ..]`.
#[derive(Clone, Copy)]
pub struct Columns<'a> {
    pub buf: &'a wgpu::Buffer,
    pub stride: usize,
    pub col0: usize,
}

/// `n` heads of `dim`, of which RoPE rotates the first `rotated` dimensions.
#[derive(Clone, Copy)]
pub struct Heads {
    pub n: usize,
    pub dim: usize,
    pub rotated: usize,
}

/// Each token's heads, read from `x`, rotated by the (cos, sin) table row of the token's
/// position, written to `y.buf[row * heads.n * heads.dim ..]`.
pub fn rope<'a>(
    pass: &mut Pass<'a>,
    mode: RopeMode,
    x: Columns<'a>,
    table: &'a wgpu::Buffer,
    tokens: Tokens<'a>,
    heads: Heads,
    y: RopeOut<'a>,
) {
    let width = heads.n * heads.dim;
    let params = RopeParams {
        n_tok: u(tokens.n),
        n_head: u(heads.n),
        head_dim: u(heads.dim),
        rope_dims: u(heads.rotated),
        mode: mode as u32,
        in_stride: u(x.stride),
        in_col0: u(x.col0),
        out_stride: u(width),
        out_row0: u(y.row0),
        start: u(tokens.start),
        out_at_pos: y.at_pos as u32,
    };
    let (gx, gy) = grid(u(tokens.n * width).div_ceil(256));
    let buffers = [x.buf, table, tokens.step, y.buf];
    pass.dispatch(Kernel::Rope(y.f16), &buffers, &params.words(), [gx, gy, 1]);
}

/// One layer's KV cache: keys, then from element `v_base` the values; f16 when `f16`.
#[derive(Clone, Copy)]
pub struct KvBuffers<'a> {
    pub kv: &'a wgpu::Buffer,
    pub v_base: usize,
    pub f16: bool,
}

/// Query and key/value head counts and the head size.
#[derive(Clone, Copy)]
pub struct AttentionShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
}

/// Most chunks attention splits a sequence into (the scratch holds this many per head and token):
/// enough workgroups to fill a large GPU at a few thousand positions, and chunks of at most
/// 1024 positions (attention.wgsl keeps that many scores) up to 128k positions.
pub const MAX_CHUNKS: usize = 128;

/// Positions per attention chunk for a cache of `max_seq` positions: at least 64, and few
/// enough chunks for the scratch. Fixed per model, so decode steps keep their parameters.
pub fn attention_chunk(max_seq: usize) -> usize {
    max_seq.div_ceil(MAX_CHUNKS).next_multiple_of(64).max(64)
}

/// Floats of attention scratch for `n_tok` tokens.
pub fn attention_scratch_floats(n_tok: usize, shape: AttentionShape) -> usize {
    n_tok * shape.n_head * MAX_CHUNKS * (shape.head_dim + 2)
}

/// Query rows (a token's query head) one attention_prefill.wgsl workgroup handles (`QR`).
pub const PREFILL_QUERY_ROWS: usize = 16;

/// Causal attention of the tokens' queries (rows of n_head * head_dim in `q`) at positions
/// `pos0 + t` (`pos0 = step[0] + start`) over caches holding positions `0..pos0 + n`. A batch of
/// many tokens (prefill) takes the one-pass flash kernel ([`attention_prefill`]); a few tokens
/// (decode) split the sequence in chunks of `chunk` positions (attention.wgsl), then merge
/// them (attention_merge.wgsl), so a single query still fills the GPU. `max_seen`: the most
/// positions any token of this dispatch sees (sizes the split kernel's grid).
#[allow(clippy::too_many_arguments)]
pub fn attention<'a>(
    pass: &mut Pass<'a>,
    q: &'a wgpu::Buffer,
    kv: KvBuffers<'a>,
    tokens: Tokens<'a>,
    shape: AttentionShape,
    chunk: usize,
    max_seen: usize,
    scratch: &'a wgpu::Buffer,
    out: &'a wgpu::Buffer,
) {
    if fits_matvec(tokens.n) {
        attention_split(pass, q, kv, tokens, shape, chunk, max_seen, scratch, out);
    } else {
        attention_prefill(pass, q, kv, tokens, shape, out);
    }
}

/// [`attention`] in one pass (attention_prefill.wgsl): one workgroup per key/value head and
/// 16 of the batch's (token, query head) rows, key/value tiles in workgroup memory, online
/// softmax, the output written directly.
pub fn attention_prefill<'a>(
    pass: &mut Pass<'a>,
    q: &'a wgpu::Buffer,
    kv: KvBuffers<'a>,
    tokens: Tokens<'a>,
    shape: AttentionShape,
    out: &'a wgpu::Buffer,
) {
    let AttentionShape { n_head, n_head_kv, head_dim } = shape;
    assert!(head_dim <= MAX_HEAD_DIM && n_head.is_multiple_of(n_head_kv));
    let params = AttentionPrefillParams {
        n_head: u(n_head),
        n_head_kv: u(n_head_kv),
        head_dim: u(head_dim),
        start: u(tokens.start),
        scale: 1.0 / (head_dim as f32).sqrt(),
        v_base: u(kv.v_base),
        n_tok: u(tokens.n),
    };
    let rows = tokens.n * (n_head / n_head_kv);
    let groups = [u(rows.div_ceil(PREFILL_QUERY_ROWS)), u(n_head_kv), 1];
    let buffers = [q, kv.kv, tokens.step, out];
    pass.dispatch(Kernel::AttentionPrefill(kv.f16, u(head_dim)), &buffers, &params.words(), groups);
}

/// [`attention`] split over the sequence (flash-decoding): attention.wgsl per chunk of `chunk`
/// positions, then attention_merge.wgsl.
#[allow(clippy::too_many_arguments)]
pub fn attention_split<'a>(
    pass: &mut Pass<'a>,
    q: &'a wgpu::Buffer,
    kv: KvBuffers<'a>,
    tokens: Tokens<'a>,
    shape: AttentionShape,
    chunk: usize,
    max_seen: usize,
    scratch: &'a wgpu::Buffer,
    out: &'a wgpu::Buffer,
) {
    let AttentionShape { n_head, n_head_kv, head_dim } = shape;
    let chunks = max_seen.div_ceil(chunk).clamp(1, MAX_CHUNKS);
    let params = AttentionParams {
        n_head: u(n_head),
        n_head_kv: u(n_head_kv),
        head_dim: u(head_dim),
        start: u(tokens.start),
        scale: 1.0 / (head_dim as f32).sqrt(),
        v_base: u(kv.v_base),
        chunk: u(chunk),
        max_chunks: u(MAX_CHUNKS),
    };
    let buffers = [q, kv.kv, tokens.step, scratch];
    let groups = [u(n_head), u(tokens.n), u(chunks)];
    pass.dispatch(Kernel::Attention(kv.f16, u(head_dim)), &buffers, &params.words(), groups);
    let merge = MergeParams {
        n_head: u(n_head),
        head_dim: u(head_dim),
        start: u(tokens.start),
        chunk: u(chunk),
        max_chunks: u(MAX_CHUNKS),
    };
    let buffers = [scratch, tokens.step, out];
    pass.dispatch(Kernel::AttentionMerge, &buffers, &merge.words(), [u(n_head), u(tokens.n), 1]);
}

/// Workgroups and slice length of the first top-k pass over `n` logits.
pub fn topk_groups(n: usize) -> (usize, usize) {
    let slice = n.div_ceil(64).max(1024);
    (n.div_ceil(slice).max(1), slice)
}

/// Words of the candidates buffer the top-k of `n` logits needs (at most `MAX_TOP_K`).
pub fn topk_scratch_words(n: usize) -> usize {
    topk_groups(n).0 * (2 + 2 * MAX_TOP_K)
}

/// The top-k kernels' buffers: `cand`, scratch of `topk_scratch_words(n)`; `out`, the result
/// `[lse, count, (id, logit) * count]`; `step`, the step buffer a chained pick writes to;
/// `mask`, the allowed set a masked ranking reads (`n.div_ceil(32)` words; bound, unread, by an
/// unmasked one).
pub struct TopkBuffers<'a> {
    pub cand: &'a wgpu::Buffer,
    pub out: &'a wgpu::Buffer,
    pub step: &'a wgpu::Buffer,
    pub mask: &'a wgpu::Buffer,
}

/// Words of an allowed-set mask over `n` tokens (one bit each).
pub fn mask_words(n: usize) -> usize {
    n.div_ceil(32).max(1)
}

/// The `k` (1..=MAX_TOP_K) largest of the `n` logits at `x[x_off..]` and their log-sum-exp.
/// With `chain`, the best id is also written as the next step's token into `bufs.step` (and its
/// position advanced by one).
pub fn topk<'a>(
    pass: &mut Pass<'a>,
    x: &'a wgpu::Buffer,
    x_off: usize,
    n: usize,
    k: usize,
    bufs: &TopkBuffers<'a>,
    chain: bool,
) {
    rank(pass, x, x_off, n, k, bufs, chain, false);
}

/// [`topk`] among the tokens whose bit is set in `bufs.mask` only (the allowed set of a
/// structured-output constraint). The result's log-sum-exp is not the row's (take it from an
/// unmasked [`topk`]); fewer than `k` pairs come back when fewer tokens are allowed.
pub fn topk_masked<'a>(
    pass: &mut Pass<'a>,
    x: &'a wgpu::Buffer,
    x_off: usize,
    n: usize,
    k: usize,
    bufs: &TopkBuffers<'a>,
) {
    rank(pass, x, x_off, n, k, bufs, false, true);
}

#[allow(clippy::too_many_arguments)]
fn rank<'a>(
    pass: &mut Pass<'a>,
    x: &'a wgpu::Buffer,
    x_off: usize,
    n: usize,
    k: usize,
    bufs: &TopkBuffers<'a>,
    chain: bool,
    masked: bool,
) {
    assert!((1..=MAX_TOP_K).contains(&k), "top-k needs 1 <= k <= {MAX_TOP_K}");
    let (groups, slice) = topk_groups(n);
    let partial = TopkPartialParams {
        n: u(n),
        x_off: u(x_off),
        k: u(k),
        slice: u(slice),
        masked: masked as u32,
    };
    let buffers = [x, bufs.mask, bufs.cand];
    pass.dispatch(Kernel::TopkPartial, &buffers, &partial.words(), [u(groups), 1, 1]);
    let merge = TopkMergeParams { groups: u(groups), k: u(k), chain: chain as u32 };
    pass.dispatch(Kernel::TopkMerge, &[bufs.cand, bufs.out, bufs.step], &merge.words(), [1, 1, 1]);
}

fn elementwise<'a>(pass: &mut Pass<'a>, k: Kernel, bufs: &[&'a wgpu::Buffer], n: usize) {
    let (gx, gy) = grid(u(n).div_ceil(256));
    pass.dispatch(k, bufs, &ElementwiseParams { n: u(n) }.words(), [gx, gy, 1]);
}

/// `y += x` over `n` floats.
pub fn add<'a>(pass: &mut Pass<'a>, x: &'a wgpu::Buffer, y: &'a wgpu::Buffer, n: usize) {
    elementwise(pass, Kernel::Add, &[x, y], n);
}

/// `out[t][i] = silu(gate) * up` for `n_tok` rows of `width`, from `gate_up`'s rows of gate then
/// up (2 * width each).
pub fn silu_mul<'a>(
    pass: &mut Pass<'a>,
    gate_up: &'a wgpu::Buffer,
    out: &'a wgpu::Buffer,
    n_tok: usize,
    width: usize,
) {
    let n = n_tok * width;
    let (gx, gy) = grid(u(n).div_ceil(256));
    let params = SiluMulParams { n: u(n), width: u(width) };
    pass.dispatch(Kernel::SiluMul, &[gate_up, out], &params.words(), [gx, gy, 1]);
}

/// `y = gelu(y)` over `n` floats.
pub fn gelu<'a>(pass: &mut Pass<'a>, y: &'a wgpu::Buffer, n: usize) {
    elementwise(pass, Kernel::Gelu, &[y], n);
}

/// A zeroed storage buffer for `n` floats.
pub fn floats(ctx: &GpuContext, label: &str, n: usize) -> wgpu::Buffer {
    storage(ctx, label, n as u64 * 4)
}

/// The device's read bandwidth in bytes per second: a plain kernel reads a buffer of `bytes`
/// (at most one storage binding) `reps` times in one submission (native; blocks). The reference
/// the benchmark compares the weights' read rate with.
#[cfg(not(target_arch = "wasm32"))]
pub fn read_bandwidth(kernels: &super::kernels::Kernels, bytes: u64, reps: usize) -> Result<f64> {
    let ctx = &kernels.ctx;
    let bytes = bytes.min(ctx.max_binding()) / 16 * 16;
    let data = storage(ctx, "bandwidth data", bytes);
    let out = storage(ctx, "bandwidth out", 4096 * 4);
    let n = u(bytes as usize / 16);
    let groups = n.div_ceil(256).min(16_384);
    let params = ReadParams { n, stride: groups * 256 };
    let run = |reps: usize| -> Result<f64> {
        let mut pass = Pass::new(kernels);
        for _ in 0..reps {
            pass.dispatch(Kernel::ReadBandwidth, &[&data, &out], &params.words(), [groups, 1, 1]);
        }
        let start = std::time::Instant::now();
        pass.submit();
        super::kernels::read(ctx, &out, 1)?;
        Ok(start.elapsed().as_secs_f64())
    };
    run(1)?;
    // The difference of two runs removes the submit-and-wait floor.
    let (one, many) = (run(1)?, run(reps + 1)?);
    Ok(reps as f64 * bytes as f64 / (many - one).max(1e-9))
}
