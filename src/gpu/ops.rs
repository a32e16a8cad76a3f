//! Recording each kernel into a `Pass` with its parameters and grid: the one place that knows
//! each shader's bindings and `Params` layout. Used by the model and by the host helpers.

use super::context::{gpu_err, GpuContext};
use super::kernels::{
    grid, storage, upload, Kernel, Pass, MATMUL_ROWS, MATMUL_TOKENS, MAX_TOP_K, TILED_ROWS,
    TILED_TOKENS,
};
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
    pub fn upload(
        ctx: &GpuContext,
        name: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> Result<GpuTensor> {
        let row_bytes = ty.row_bytes(cols);
        if !cols.is_multiple_of(ty.block_size()) || bytes.len() != rows * row_bytes {
            return Err(gpu_err(format!(
                "tensor {name}: {} bytes do not hold {rows} rows of {cols} {}",
                bytes.len(),
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
/// a missing bias (every binding must be bound). Batches of more than `MATMUL_TOKENS` tokens
/// (prefill) use the tiled kernel; smaller ones (decode) the matrix-vector one.
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
    matmul_with(pass, w, bias, dummy, x, x_row0, n_tok, y, u(n_tok) > MATMUL_TOKENS);
}

/// [`matmul`] with the kernel chosen by the caller: `tiled` for matmul_tiled.wgsl.
#[allow(clippy::too_many_arguments)]
pub fn matmul_with<'a>(
    pass: &mut Pass<'a>,
    w: &'a GpuTensor,
    bias: Option<&'a wgpu::Buffer>,
    dummy: &'a wgpu::Buffer,
    x: &'a wgpu::Buffer,
    x_row0: usize,
    n_tok: usize,
    y: Out<'a>,
    tiled: bool,
) {
    let (tile_rows, tile_tokens, kernel) = if tiled {
        (TILED_ROWS, TILED_TOKENS, Kernel::MatmulTiled(w.ty))
    } else {
        (MATMUL_ROWS, MATMUL_TOKENS, Kernel::Matmul(w.ty))
    };
    for part in &w.parts {
        let (gx, gy) = grid(u(part.rows).div_ceil(tile_rows));
        let gz = u(n_tok).div_ceil(tile_tokens);
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
        pass.dispatch(
            kernel,
            &[&part.buffer, x, bias.unwrap_or(dummy), y.buf],
            &params,
            [gx, gy, gz],
        );
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

/// Rows of `w` into `y` (`n_tok` rows of `w.cols`): token ids `step[STEP_IDS + id0 + t]`, or
/// with `pos_off` the rows `step[0] + pos_off + t` (learned positions); `accumulate` adds to
/// what `y` holds.
#[allow(clippy::too_many_arguments)]
pub fn embedding<'a>(
    pass: &mut Pass<'a>,
    w: &'a GpuTensor,
    step: &'a wgpu::Buffer,
    id0: usize,
    pos_off: Option<usize>,
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
            pos_off.is_some() as u32,
            u(pos_off.unwrap_or(0)),
            u(STEP_IDS + id0),
            accumulate as u32,
        ];
        pass.dispatch(Kernel::Embedding(w.ty), &[&part.buffer, step, y], &params, [u(n_tok), 1, 1]);
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

/// Where rope writes: rows `row0 + t` of `buf`, plus the token's position when `at_pos` (the
/// KV cache); `f16`: `buf` holds f16 (the f16 KV cache).
pub struct RopeOut<'a> {
    pub buf: &'a wgpu::Buffer,
    pub row0: usize,
    pub at_pos: bool,
    pub f16: bool,
}

/// Heads `n_head` x `head_dim` of each token, read at `x[t * in_stride + in_col0 ..]`, rotated by
/// the (cos, sin) table row of the token's position `step[0] + start + t`, written to
/// `y.buf[row * n_head * head_dim ..]`.
#[allow(clippy::too_many_arguments)]
pub fn rope<'a>(
    pass: &mut Pass<'a>,
    mode: RopeMode,
    x: &'a wgpu::Buffer,
    in_stride: usize,
    in_col0: usize,
    table: &'a wgpu::Buffer,
    step: &'a wgpu::Buffer,
    start: usize,
    n_tok: usize,
    n_head: usize,
    head_dim: usize,
    rope_dims: usize,
    y: RopeOut<'a>,
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
        u(y.row0),
        u(start),
        y.at_pos as u32,
    ];
    let (gx, gy) = grid(u(n_tok * n_head * head_dim).div_ceil(256));
    pass.dispatch(Kernel::Rope(y.f16), &[x, table, step, y.buf], &params, [gx, gy, 1]);
}

/// Causal attention of `n_tok` queries (rows of n_head * head_dim in `q`) at positions
/// `pos0 + t` (`pos0 = step[0] + start`) over caches (f16 when `f16`) holding positions
/// `0..pos0 + n_tok`.
#[allow(clippy::too_many_arguments)]
pub fn attention<'a>(
    pass: &mut Pass<'a>,
    q: &'a wgpu::Buffer,
    k: &'a wgpu::Buffer,
    v: &'a wgpu::Buffer,
    f16: bool,
    step: &'a wgpu::Buffer,
    start: usize,
    n_tok: usize,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    out: &'a wgpu::Buffer,
) {
    let scale = 1.0 / (head_dim as f32).sqrt();
    let params = [u(n_head), u(n_head_kv), u(head_dim), u(start), f(scale)];
    pass.dispatch(Kernel::Attention(f16), &[q, k, v, step, out], &params, [u(n_head), u(n_tok), 1]);
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

/// The `k` (1..=MAX_TOP_K) largest of the `n` logits at `x[x_off..]` and their log-sum-exp into
/// `out` = [lse, count, (id, logit) * count]; `cand` is scratch of `topk_scratch_words(n)`.
/// With `chain`, the best id is also written as the next step's token into `step` (and its
/// position advanced by one).
#[allow(clippy::too_many_arguments)]
pub fn topk<'a>(
    pass: &mut Pass<'a>,
    x: &'a wgpu::Buffer,
    x_off: usize,
    n: usize,
    k: usize,
    cand: &'a wgpu::Buffer,
    out: &'a wgpu::Buffer,
    step: &'a wgpu::Buffer,
    chain: bool,
) {
    assert!((1..=MAX_TOP_K).contains(&k), "top-k needs 1 <= k <= {MAX_TOP_K}");
    let (groups, slice) = topk_groups(n);
    pass.dispatch(
        Kernel::TopkPartial,
        &[x, cand],
        &[u(n), u(x_off), u(k), u(slice)],
        [u(groups), 1, 1],
    );
    pass.dispatch(
        Kernel::TopkMerge,
        &[cand, out, step],
        &[u(groups), u(k), chain as u32],
        [1, 1, 1],
    );
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
