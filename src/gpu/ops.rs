//! Recording each kernel into a `Pass` with its parameters and grid: the one place that knows
//! each shader's bindings and `Params` layout. Used by the model and by the host helpers.

use super::context::{gpu_err, GpuContext};
use super::kernels::{grid, storage, upload, Kernel, Pass, MATMUL_TOKENS};
use crate::error::Result;
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
}

impl GpuTensor {
    /// Upload `bytes` (`rows` rows of `cols` elements of `ty`).
    pub fn upload(ctx: &GpuContext, name: &str, ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Result<GpuTensor> {
        let row_bytes = ty.row_bytes(cols);
        if !cols.is_multiple_of(ty.block_size()) || bytes.len() != rows * row_bytes {
            return Err(gpu_err(format!("tensor {name}: {} bytes do not hold {rows} rows of {cols} {}", bytes.len(), ty.name())));
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
            let data = &bytes[row0 * row_bytes..(row0 + n) * row_bytes];
            parts.push(Part { row0, rows: n, buffer: upload(ctx, name, data) });
            row0 += n;
        }
        Ok(GpuTensor { ty, rows, cols, row_bytes, parts })
    }

    /// The single buffer of a small tensor (norm weights, biases).
    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.parts[0].buffer
    }
}

fn f(x: f32) -> u32 {
    x.to_bits()
}

fn u(x: usize) -> u32 {
    u32::try_from(x).expect("size fits in u32")
}

/// Where a matmul writes: `y[t * stride + col0 + r]`.
pub struct Out<'a> {
    pub buf: &'a wgpu::Buffer,
    pub stride: usize,
    pub col0: usize,
}

/// `y[t][col0 + r] = W[r] . x[x_row0 + t] (+ bias[r])` for `n_tok` tokens. `dummy` stands in for
/// a missing bias (every binding must be bound).
#[allow(clippy::too_many_arguments)]
pub fn matmul<'a>(
    pass: &mut Pass<'a>,
    w: &'a GpuTensor,
    bias: Option<&'a wgpu::Buffer>,
    dummy: &'a wgpu::Buffer,
    x: &'a wgpu::Buffer,
    x_row0: usize,
    n_tok: usize,
    y: Out<'a>,
) {
    for part in &w.parts {
        let (gx, gy) = grid(u(part.rows));
        let gz = u(n_tok).div_ceil(MATMUL_TOKENS);
        let params = [
            u(part.rows),
            u(w.cols),
            u(n_tok),
            u(w.row_bytes),
            u(x_row0),
            u(y.stride),
            u(y.col0 + part.row0),
            u(part.row0),
            bias.is_some() as u32,
        ];
        pass.dispatch(Kernel::Matmul(w.ty), &[&part.buffer, x, bias.unwrap_or(dummy), y.buf], &params, [gx, gy, gz]);
    }
}

/// Rows of `w` into `y` (`n_tok` rows of `w.cols`): token ids `ids[id0 + t]`, or with `pos0`
/// the rows `pos0 + t` (learned positions); `accumulate` adds to what `y` holds.
#[allow(clippy::too_many_arguments)]
pub fn embedding<'a>(
    pass: &mut Pass<'a>,
    w: &'a GpuTensor,
    ids: &'a wgpu::Buffer,
    id0: usize,
    pos0: Option<usize>,
    n_tok: usize,
    accumulate: bool,
    y: &'a wgpu::Buffer,
) {
    for part in &w.parts {
        let params = [
            u(n_tok),
            u(w.cols),
            u(w.row_bytes),
            u(part.row0),
            u(part.rows),
            pos0.is_some() as u32,
            u(pos0.unwrap_or(0)),
            u(id0),
            accumulate as u32,
        ];
        pass.dispatch(Kernel::Embedding(w.ty), &[&part.buffer, ids, y], &params, [u(n_tok), 1, 1]);
    }
}

/// RMSNorm (no bias) or LayerNorm (with bias) of `n_tok` rows of `n`.
#[allow(clippy::too_many_arguments)]
pub fn norm<'a>(
    pass: &mut Pass<'a>,
    x: &'a wgpu::Buffer,
    weight: &'a wgpu::Buffer,
    bias: Option<&'a wgpu::Buffer>,
    layer_norm: bool,
    n: usize,
    n_tok: usize,
    eps: f32,
    y: &'a wgpu::Buffer,
) {
    let params = [u(n), f(eps)];
    if layer_norm {
        let b = bias.expect("layer norm needs a bias buffer (zeros if the model has none)");
        pass.dispatch(Kernel::LayerNorm, &[x, weight, b, y], &params, [u(n_tok), 1, 1]);
    } else {
        pass.dispatch(Kernel::RmsNorm, &[x, weight, y], &params, [u(n_tok), 1, 1]);
    }
}

/// RoPE mode: 0 copy, 1 interleaved, 2 half split (see rope.wgsl).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeMode {
    Copy = 0,
    Interleaved = 1,
    HalfSplit = 2,
}

/// Heads `n_head` x `head_dim` of each token, read at `x[t * in_stride + in_col0 ..]`, rotated by
/// the (cos, sin) table rows `tab_row0 + t`, written to `y[(out_row0 + t) * n_head * head_dim ..]`.
#[allow(clippy::too_many_arguments)]
pub fn rope<'a>(
    pass: &mut Pass<'a>,
    mode: RopeMode,
    x: &'a wgpu::Buffer,
    in_stride: usize,
    in_col0: usize,
    table: &'a wgpu::Buffer,
    tab_row0: usize,
    n_tok: usize,
    n_head: usize,
    head_dim: usize,
    rope_dims: usize,
    y: &'a wgpu::Buffer,
    out_row0: usize,
) {
    let params = [
        u(n_tok),
        u(n_head),
        u(head_dim),
        u(rope_dims),
        mode as u32,
        u(in_stride),
        u(in_col0),
        u(n_head * head_dim),
        u(out_row0),
        u(tab_row0),
    ];
    let (gx, gy) = grid(u(n_tok * n_head * head_dim).div_ceil(256));
    pass.dispatch(Kernel::Rope, &[x, table, y], &params, [gx, gy, 1]);
}

/// Causal attention of `n_tok` queries (rows of n_head * head_dim in `q`) at positions
/// `pos0 + t` over caches holding positions `0..pos0 + n_tok`.
#[allow(clippy::too_many_arguments)]
pub fn attention<'a>(
    pass: &mut Pass<'a>,
    q: &'a wgpu::Buffer,
    k: &'a wgpu::Buffer,
    v: &'a wgpu::Buffer,
    n_tok: usize,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    pos0: usize,
    out: &'a wgpu::Buffer,
) {
    let scale = 1.0 / (head_dim as f32).sqrt();
    let params = [u(n_head), u(n_head_kv), u(head_dim), u(pos0), f(scale)];
    pass.dispatch(Kernel::Attention, &[q, k, v, out], &params, [u(n_head), u(n_tok), 1]);
}

fn elementwise<'a>(pass: &mut Pass<'a>, k: Kernel, bufs: &[&'a wgpu::Buffer], n: usize) {
    let (gx, gy) = grid(u(n).div_ceil(256));
    pass.dispatch(k, bufs, &[u(n)], [gx, gy, 1]);
}

/// `y += x` over `n` floats.
pub fn add<'a>(pass: &mut Pass<'a>, x: &'a wgpu::Buffer, y: &'a wgpu::Buffer, n: usize) {
    elementwise(pass, Kernel::Add, &[x, y], n);
}

/// `up *= silu(gate)` over `n` floats.
pub fn silu_mul<'a>(pass: &mut Pass<'a>, gate: &'a wgpu::Buffer, up: &'a wgpu::Buffer, n: usize) {
    elementwise(pass, Kernel::SiluMul, &[gate, up], n);
}

/// `y = gelu(y)` over `n` floats.
pub fn gelu<'a>(pass: &mut Pass<'a>, y: &'a wgpu::Buffer, n: usize) {
    elementwise(pass, Kernel::Gelu, &[y], n);
}

/// A zeroed storage buffer for `n` floats.
pub fn floats(ctx: &GpuContext, label: &str, n: usize) -> wgpu::Buffer {
    storage(ctx, label, n as u64 * 4)
}
