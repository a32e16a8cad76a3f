//! Recording each kernel into a `Pass` with its parameters and grid: the one place that knows
//! each shader's bindings and `Params` layout. Used by the model and by the host helpers.

use super::context::{gpu_err, GpuContext};
use super::kernels::{
    grid, storage, upload, Kernel, Pass, MATMUL_ROWS, MATMUL_TOKENS, MAX_TOP_K, TILED_ROWS,
    TILED_TOKENS,
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

/// `n` rows of activations (one per token) starting at row `row0` of `buf`.
#[derive(Clone, Copy)]
pub struct Rows<'a> {
    pub buf: &'a wgpu::Buffer,
    pub row0: usize,
    pub n: usize,
}

/// Where a matmul writes: `y[t * stride + col0 + r]`.
pub struct Out<'a> {
    pub buf: &'a wgpu::Buffer,
    pub stride: usize,
    pub col0: usize,
}

/// `y[t][col0 + r] = W[r] . x[t] (+ bias[r])` for the rows of `x`. Batches of more than
/// `MATMUL_TOKENS` tokens (prefill) use the tiled kernel; smaller ones (decode) the
/// matrix-vector one.
pub fn matmul<'a>(
    pass: &mut Pass<'a>,
    w: &'a GpuTensor,
    bias: Option<&'a wgpu::Buffer>,
    x: Rows<'a>,
    y: Out<'a>,
) {
    matmul_with(pass, w, bias, x, y, u(x.n) > MATMUL_TOKENS);
}

/// [`matmul`] with the kernel chosen by the caller: `tiled` for matmul_tiled.wgsl.
pub fn matmul_with<'a>(
    pass: &mut Pass<'a>,
    w: &'a GpuTensor,
    bias: Option<&'a wgpu::Buffer>,
    x: Rows<'a>,
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
        let gz = u(x.n).div_ceil(tile_tokens);
        let params = [
            u(part.rows),
            u(w.cols),
            u(x.n),
            u(w.row_bytes),
            u(x.row0),
            u(y.stride),
            u(y.col0 + part.row0),
            u(part.row0),
            bias.is_some() as u32,
        ];
        // Every binding must be bound: without a bias, the (unread) bias binding gets `x`.
        let bias = bias.unwrap_or(x.buf);
        pass.dispatch(kernel, &[&part.buffer, x.buf, bias, y.buf], &params, [gx, gy, gz]);
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
        let params = [
            u(tokens.n),
            u(w.cols),
            u(w.row_bytes),
            u(part.row0),
            u(part.rows),
            by_position as u32,
            u(pos_off),
            u(STEP_IDS + id0),
            by_position as u32,
        ];
        let buffers = [&part.buffer, tokens.step, y];
        pass.dispatch(Kernel::Embedding(w.ty), &buffers, &params, [u(tokens.n), 1, 1]);
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
    let params = [u(width), f(op.eps)];
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
    let params = [
        u(tokens.n),
        u(heads.n),
        u(heads.dim),
        u(heads.rotated),
        mode as u32,
        u(x.stride),
        u(x.col0),
        u(width),
        u(y.row0),
        u(tokens.start),
        y.at_pos as u32,
    ];
    let (gx, gy) = grid(u(tokens.n * width).div_ceil(256));
    let buffers = [x.buf, table, tokens.step, y.buf];
    pass.dispatch(Kernel::Rope(y.f16), &buffers, &params, [gx, gy, 1]);
}

/// One layer's KV cache: keys and values, f16 when `f16`.
#[derive(Clone, Copy)]
pub struct KvBuffers<'a> {
    pub k: &'a wgpu::Buffer,
    pub v: &'a wgpu::Buffer,
    pub f16: bool,
}

/// Query and key/value head counts and the head size.
#[derive(Clone, Copy)]
pub struct AttentionShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
}

/// Causal attention of the tokens' queries (rows of n_head * head_dim in `q`) at positions
/// `pos0 + t` (`pos0 = step[0] + start`) over caches holding positions `0..pos0 + n`.
pub fn attention<'a>(
    pass: &mut Pass<'a>,
    q: &'a wgpu::Buffer,
    kv: KvBuffers<'a>,
    tokens: Tokens<'a>,
    shape: AttentionShape,
    out: &'a wgpu::Buffer,
) {
    let AttentionShape { n_head, n_head_kv, head_dim } = shape;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let params = [u(n_head), u(n_head_kv), u(head_dim), u(tokens.start), f(scale)];
    let buffers = [q, kv.k, kv.v, tokens.step, out];
    pass.dispatch(Kernel::Attention(kv.f16), &buffers, &params, [u(n_head), u(tokens.n), 1]);
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
/// `[lse, count, (id, logit) * count]`; `step`, the step buffer a chained pick writes to.
pub struct TopkBuffers<'a> {
    pub cand: &'a wgpu::Buffer,
    pub out: &'a wgpu::Buffer,
    pub step: &'a wgpu::Buffer,
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
    assert!((1..=MAX_TOP_K).contains(&k), "top-k needs 1 <= k <= {MAX_TOP_K}");
    let (groups, slice) = topk_groups(n);
    pass.dispatch(
        Kernel::TopkPartial,
        &[x, bufs.cand],
        &[u(n), u(x_off), u(k), u(slice)],
        [u(groups), 1, 1],
    );
    pass.dispatch(
        Kernel::TopkMerge,
        &[bufs.cand, bufs.out, bufs.step],
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
