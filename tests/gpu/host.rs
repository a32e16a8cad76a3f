//! Run one kernel on host data: upload, dispatch, read back. For the per-kernel tests of
//! tests/gpu.rs against the CPU reference; native only (it blocks). It uses only the library's
//! public kernel API (`gpu::kernels`, `gpu::dispatch`), as any other program could.

#![allow(dead_code)]

use nexttoken::gpu::context::GpuContext;
use nexttoken::gpu::dispatch::{
    self, floats, step_words, AttentionShape, Columns, Fused, GpuTensor, Heads, KvBuffers, Lookup,
    NormOp, Out, RopeMode, RopeOut, Rows, Tokens, TopkBuffers,
};
pub use nexttoken::gpu::kernels::read;
use nexttoken::gpu::kernels::{storage, upload, Kernels, Pass};
use nexttoken::model::{cos_sin_table, Norm};
use nexttoken::quant::GgmlType;
use nexttoken::Result;

fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn upload_f32(ctx: &GpuContext, x: &[f32]) -> wgpu::Buffer {
    upload(ctx, "host input", &f32_bytes(x))
}

/// The buffers a fused product binds: `vectors` holds the bias (if any) at offset 0; the others
/// are stand-ins a plain product does not read.
struct Unfused {
    vectors: wgpu::Buffer,
    table: wgpu::Buffer,
    step: wgpu::Buffer,
    no_kv: wgpu::Buffer,
}

impl Unfused {
    fn new(ctx: &GpuContext, bias: Option<&[f32]>) -> Unfused {
        Unfused {
            vectors: bias.map_or_else(|| floats(ctx, "vectors", 4), |b| upload_f32(ctx, b)),
            table: floats(ctx, "table", 4),
            step: floats(ctx, "step", 4),
            no_kv: floats(ctx, "no kv", 4),
        }
    }

    fn fused(&self) -> Fused<'_> {
        Fused {
            vectors: &self.vectors,
            table: &self.table,
            step: &self.step,
            no_kv: &self.no_kv,
            f16_kv: false,
            f16_tiles: false,
        }
    }
}

/// `y[t][r] = W[r] . x[t] (+ bias[r])` for `x.len() / cols` tokens; W is `rows` x `cols` of `ty`
/// in its GGUF bytes.
pub fn matmul(
    k: &Kernels,
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    bias: Option<&[f32]>,
) -> Result<Vec<f32>> {
    let n_tok = x.len() / cols;
    matmul_with(k, ty, w, rows, cols, x, bias, !dispatch::fits_matvec(n_tok))
}

/// [`matmul`] with the kernel forced: `tiled` for the prefill (matrix-matrix) kernel.
#[allow(clippy::too_many_arguments)]
pub fn matmul_with(
    k: &Kernels,
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    bias: Option<&[f32]>,
    tiled: bool,
) -> Result<Vec<f32>> {
    let ctx = &k.ctx;
    let n_tok = x.len() / cols;
    let wt = GpuTensor::upload(ctx, "w", ty, rows, cols, w)?;
    let xb = upload_f32(ctx, x);
    let y = floats(ctx, "y", n_tok * rows);
    let unfused = Unfused::new(ctx, bias);
    let mut pass = Pass::new(k);
    let x = Rows { buf: &xb, row0: 0, n: n_tok };
    let out = Out { buf: &y, stride: rows, col0: 0 };
    let bias = bias.map(|_| 0);
    if tiled {
        dispatch::matmul_tiled(&mut pass, &wt, bias, x, out, &unfused.fused());
    } else {
        dispatch::matmul(&mut pass, &wt, bias, x, out, &unfused.fused());
    }
    pass.submit();
    read(ctx, &y, n_tok * rows)
}

/// One decode product with its input normed, as the model records them: `x` holds rows of
/// `cols`, the product reads `n_tok` of them from row `x_row0`; the norm is RMSNorm (weights, no
/// bias) or LayerNorm (weights and bias); `y0` (`n_tok` rows of `rows`) is added to with
/// `add`, else overwritten. Returns the output.
pub struct NormedCase<'a> {
    pub ty: GgmlType,
    pub w: &'a [u8],
    pub rows: usize,
    pub cols: usize,
    pub x: &'a [f32],
    pub x_row0: usize,
    pub n_tok: usize,
    /// The norm's weights (no norm without them), and its bias for a LayerNorm.
    pub norm_weight: Option<&'a [f32]>,
    pub norm_bias: Option<&'a [f32]>,
    pub eps: f32,
    pub y0: &'a [f32],
    pub add: bool,
}

/// matvec.wgsl on a [`NormedCase`].
pub fn matvec_normed(k: &Kernels, c: &NormedCase) -> Result<Vec<f32>> {
    let ctx = &k.ctx;
    let wt = GpuTensor::upload(ctx, "w", c.ty, c.rows, c.cols, c.w)?;
    // The vectors buffer: the norm's weights, then its bias.
    let mut vectors = vec![0.0];
    let norm = c.norm_weight.map(|w| {
        let weight = vectors.len();
        vectors.extend_from_slice(w);
        let bias = c.norm_bias.map(|b| {
            let at = vectors.len();
            vectors.extend_from_slice(b);
            at
        });
        let kind = if bias.is_some() { Norm::Layer } else { Norm::Rms };
        dispatch::NormIn { kind, eps: c.eps, weight, bias }
    });
    let unfused = Unfused::new(ctx, Some(&vectors));
    let (xb, y) = (upload_f32(ctx, c.x), upload_f32(ctx, c.y0));
    let mut pass = Pass::new(k);
    let x = Rows { buf: &xb, row0: c.x_row0, n: c.n_tok };
    let out = Out { buf: &y, stride: c.rows, col0: 0 };
    let epilogue = if c.add { dispatch::Epilogue::Add } else { dispatch::Epilogue::Store };
    let m = dispatch::Matvec { norm, bias: None, epilogue };
    dispatch::matvec(&mut pass, &wt, x, out, m, &unfused.fused());
    pass.submit();
    read(ctx, &y, c.y0.len())
}

/// One tiled product as the model records them (for the tests of every tile): `w` holds
/// `w_rows` rows of which the product reads `rows` from row `w_row0` (a packed tensor: a view at
/// a byte offset); the input is `n_tok` rows of `x` from row `x_row0`; the bias (if any) sits
/// at float offset `bias_at` of the vectors buffer (zeros before it); the output goes to
/// `y[t * y_stride + y_col0 + r]` of a buffer holding `y0`, added to it with `accumulate`.
/// Returns the whole output buffer.
pub struct TiledCase<'a> {
    pub ty: GgmlType,
    pub w: &'a [u8],
    pub w_rows: usize,
    pub w_row0: usize,
    pub rows: usize,
    pub cols: usize,
    pub x: &'a [f32],
    pub x_row0: usize,
    pub n_tok: usize,
    pub bias: Option<&'a [f32]>,
    pub bias_at: usize,
    pub y0: &'a [f32],
    pub y_stride: usize,
    pub y_col0: usize,
    pub tile: dispatch::Tile,
    pub accumulate: bool,
    /// RMSNorm of the input rows with these weights (at float offset 0 of the vectors buffer).
    pub rms_norm: Option<(&'a [f32], f32)>,
    /// f16 tiles and per-block sums (needs the device's shader-f16).
    pub f16: bool,
}

pub fn matmul_tiled_case(k: &Kernels, c: &TiledCase) -> Result<Vec<f32>> {
    let ctx = &k.ctx;
    let whole = GpuTensor::upload(ctx, "w", c.ty, c.w_rows, c.cols, c.w)?;
    let row_bytes = whole.row_bytes;
    let view = GpuTensor {
        ty: c.ty,
        rows: c.rows,
        cols: c.cols,
        row_bytes,
        parts: vec![dispatch::Part {
            row0: 0,
            rows: c.rows,
            buffer: whole.buffer().clone(),
            byte0: c.w_row0 * row_bytes,
        }],
    };
    // The norm's weights, then zeros up to the bias.
    let mut vectors = c.rms_norm.map_or(vec![], |n| n.0.to_vec());
    assert!(vectors.len() <= c.bias_at, "the bias comes after the norm's weights");
    vectors.resize(c.bias_at, 0.0);
    vectors.extend_from_slice(c.bias.unwrap_or(&[0.0]));
    let unfused = Unfused::new(ctx, Some(&vectors));
    let (xb, y) = (upload_f32(ctx, c.x), upload_f32(ctx, c.y0));
    let mut pass = Pass::new(k);
    let x = Rows { buf: &xb, row0: c.x_row0, n: c.n_tok };
    let out = Out { buf: &y, stride: c.y_stride, col0: c.y_col0 };
    let bias = c.bias.map(|_| c.bias_at);
    let fused = Fused { f16_tiles: c.f16, ..unfused.fused() };
    let opts = dispatch::TiledOpts {
        tile: Some(c.tile),
        accumulate: c.accumulate,
        rms_norm: c.rms_norm.map(|n| (0, n.1)),
    };
    dispatch::matmul_tiled_with(&mut pass, &view, bias, x, out, &fused, opts);
    pass.submit();
    read(ctx, &y, c.y0.len())
}

/// Like [`matmul`] but with W split into parts of at most `rows_per_part` rows (as a tensor
/// larger than the binding limit is), to test the split path on small data.
pub fn matmul_split(
    k: &Kernels,
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    rows_per_part: usize,
) -> Result<Vec<f32>> {
    let ctx = &k.ctx;
    let n_tok = x.len() / cols;
    let rb = ty.row_bytes(cols);
    let parts = (0..rows)
        .step_by(rows_per_part)
        .map(|r0| {
            let n = rows_per_part.min(rows - r0);
            dispatch::Part {
                row0: r0,
                rows: n,
                buffer: upload(ctx, "w part", &w[r0 * rb..(r0 + n) * rb]),
                byte0: 0,
            }
        })
        .collect();
    let wt = GpuTensor { ty, rows, cols, row_bytes: rb, parts };
    let xb = upload_f32(ctx, x);
    let y = floats(ctx, "y", n_tok * rows);
    let unfused = Unfused::new(ctx, None);
    let mut pass = Pass::new(k);
    let x = Rows { buf: &xb, row0: 0, n: n_tok };
    let out = Out { buf: &y, stride: rows, col0: 0 };
    dispatch::matmul(&mut pass, &wt, None, x, out, &unfused.fused());
    let emb = floats(ctx, "emb", n_tok.min(rows) * cols);
    let ids: Vec<u32> = (0..n_tok.min(rows) as u32).rev().collect();
    let idb = upload(ctx, "step", &step_words(0, &ids));
    let tokens = Tokens { step: &idb, start: 0, n: n_tok.min(rows) };
    dispatch::embedding(&mut pass, &wt, tokens, Lookup::Ids, &emb);
    pass.submit();
    read(ctx, &y, n_tok * rows)
}

/// Rows `ids` of W (`rows` x `cols` of `ty`).
pub fn embedding(
    k: &Kernels,
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    ids: &[u32],
) -> Result<Vec<f32>> {
    let ctx = &k.ctx;
    let wt = GpuTensor::upload(ctx, "w", ty, rows, cols, w)?;
    let idb = upload(ctx, "step", &step_words(0, ids));
    let y = floats(ctx, "y", ids.len() * cols);
    let mut pass = Pass::new(k);
    let tokens = Tokens { step: &idb, start: 0, n: ids.len() };
    dispatch::embedding(&mut pass, &wt, tokens, Lookup::Ids, &y);
    pass.submit();
    read(ctx, &y, ids.len() * cols)
}

/// `x` (rows of `w.len()`) normalised: RMSNorm, or LayerNorm when `bias` is given.
pub fn norm(k: &Kernels, x: &[f32], w: &[f32], bias: Option<&[f32]>, eps: f32) -> Result<Vec<f32>> {
    let ctx = &k.ctx;
    let n = w.len();
    let (xb, wb) = (upload_f32(ctx, x), upload_f32(ctx, w));
    let bb = bias.map(|b| upload_f32(ctx, b));
    let y = floats(ctx, "y", x.len());
    let mut pass = Pass::new(k);
    let kind = if bias.is_some() { Norm::Layer } else { Norm::Rms };
    let op = NormOp { kind, eps, weight: &wb, bias: bb.as_ref() };
    dispatch::norm(&mut pass, op, &xb, n, x.len() / n, &y);
    pass.submit();
    read(ctx, &y, x.len())
}

/// RoPE of `n_tok` rows of `n_head * head_dim` at positions `pos0 + t`.
#[allow(clippy::too_many_arguments)]
pub fn rope(
    k: &Kernels,
    mode: RopeMode,
    x: &[f32],
    n_head: usize,
    head_dim: usize,
    rope_dims: usize,
    pos0: usize,
    inv_freq: &[f32],
) -> Result<Vec<f32>> {
    let ctx = &k.ctx;
    let width = n_head * head_dim;
    let n_tok = x.len() / width;
    // The table holds every position up to the last (as the model's does).
    let mut table = vec![0f32; (pos0 + n_tok) * inv_freq.len() * 2];
    cos_sin_table(inv_freq, 0, &mut table);
    let (xb, tb) = (upload_f32(ctx, x), upload_f32(ctx, &table));
    let step = upload(ctx, "step", &step_words(pos0, &[]));
    let y = floats(ctx, "y", x.len());
    let mut pass = Pass::new(k);
    let out = RopeOut { buf: &y, row0: 0, at_pos: false, f16: false };
    let input = Columns { buf: &xb, stride: width, col0: 0 };
    let tokens = Tokens { step: &step, start: 0, n: n_tok };
    let heads = Heads { n: n_head, dim: head_dim, rotated: rope_dims };
    dispatch::rope(&mut pass, mode, input, &tb, tokens, heads, out);
    pass.submit();
    read(ctx, &y, x.len())
}

/// Attention of `q` (rows of n_head * head_dim) at positions `pos0 + t` over the caches.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    k: &Kernels,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    pos0: usize,
) -> Result<Vec<f32>> {
    let shape = AttentionShape { n_head, n_head_kv, head_dim };
    attention_with(k, q, [k_cache, v_cache], shape, pos0, false, false)
}

/// [`attention`] with the kernel forced (`prefill`: the one-pass flash kernel, else the split
/// one) and the cache in f16 when `f16` (the caches' values are rounded to f16 on upload).
pub fn attention_with(
    k: &Kernels,
    q: &[f32],
    [k_cache, v_cache]: [&[f32]; 2],
    shape: AttentionShape,
    pos0: usize,
    prefill: bool,
    f16: bool,
) -> Result<Vec<f32>> {
    let ctx = &k.ctx;
    let n_tok = q.len() / (shape.n_head * shape.head_dim);
    let kv_cache = [k_cache, v_cache].concat();
    let kv_bytes: Vec<u8> = if f16 {
        let mut b: Vec<u8> =
            kv_cache.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
        b.resize(b.len().next_multiple_of(4), 0);
        b
    } else {
        f32_bytes(&kv_cache)
    };
    let (qb, kvb) = (upload_f32(ctx, q), upload(ctx, "kv", &kv_bytes));
    let step = upload(ctx, "step", &step_words(pos0, &[]));
    let y = floats(ctx, "y", q.len());
    let mut pass = Pass::new(k);
    let kv = KvBuffers { kv: &kvb, v_base: k_cache.len(), f16 };
    let tokens = Tokens { step: &step, start: 0, n: n_tok };
    let chunk_floats = if prefill { 1 } else { dispatch::attention_scratch_floats(n_tok, shape) };
    let chunks = floats(ctx, "chunks", chunk_floats);
    if prefill {
        dispatch::attention_prefill(&mut pass, &qb, kv, tokens, shape, &y);
    } else {
        // About five chunks, so the merge of several is tested.
        let max_seen = pos0 + n_tok;
        let chunk = max_seen.div_ceil(5).max(1);
        dispatch::attention_split(&mut pass, &qb, kv, tokens, shape, chunk, max_seen, &chunks, &y);
    }
    pass.submit();
    read(ctx, &y, q.len())
}

/// The `k` largest of `x` (best first, ties by smaller index) as (id, value) pairs, and the
/// log-sum-exp of all of `x`, by the two top-k kernels.
pub fn topk(k: &Kernels, x: &[f32], top: usize) -> Result<(Vec<(u32, f32)>, f32)> {
    run_topk(k, x, top, None)
}

/// The `k` largest of `x` among the ids whose bit is set in `mask` (id i: bit i % 32 of word
/// i / 32; `dispatch::mask_words(x.len())` words), by the masked top-k kernels.
pub fn topk_masked(k: &Kernels, x: &[f32], top: usize, mask: &[u32]) -> Result<Vec<(u32, f32)>> {
    Ok(run_topk(k, x, top, Some(mask))?.0)
}

fn run_topk(
    k: &Kernels,
    x: &[f32],
    top: usize,
    mask: Option<&[u32]>,
) -> Result<(Vec<(u32, f32)>, f32)> {
    let ctx = &k.ctx;
    let xb = upload_f32(ctx, x);
    let cand = storage(ctx, "cand", dispatch::topk_scratch_words(x.len()) as u64 * 4);
    let out = storage(ctx, "out", (2 + 2 * top as u64) * 4);
    let step = upload(ctx, "step", &step_words(0, &[0]));
    let zeros = vec![0u32; dispatch::mask_words(x.len())];
    let words: Vec<u8> = mask.unwrap_or(&zeros).iter().flat_map(|w| w.to_le_bytes()).collect();
    let mask_buf = upload(ctx, "mask", &words);
    let mut pass = Pass::new(k);
    let bufs = TopkBuffers { cand: &cand, out: &out, step: &step, mask: &mask_buf };
    match mask {
        None => dispatch::topk(&mut pass, &xb, 0, x.len(), top, &bufs, false),
        Some(_) => dispatch::topk_masked(&mut pass, &xb, 0, x.len(), top, &bufs),
    }
    pass.submit();
    let w = read(ctx, &out, 2 + 2 * top)?;
    let count = w[1].to_bits() as usize;
    let pairs = (0..count).map(|i| (w[2 + 2 * i].to_bits(), w[3 + 2 * i])).collect();
    Ok((pairs, w[0]))
}

/// Elementwise kernels on host data.
pub enum Elementwise {
    /// y + x
    Add,
    /// y * silu(x) (x the gate, y up)
    SiluMul,
    /// gelu(y) (x unused)
    Gelu,
}

pub fn elementwise(k: &Kernels, op: Elementwise, x: &[f32], y: &[f32]) -> Result<Vec<f32>> {
    let ctx = &k.ctx;
    let (xb, yb) = (upload_f32(ctx, x), upload_f32(ctx, y));
    // silu_mul reads rows of gate|up: two rows for an even length, so the row arithmetic is
    // exercised.
    let rows = if y.len().is_multiple_of(2) { 2 } else { 1 };
    let width = y.len() / rows;
    let gate_up: Vec<f32> = (0..rows)
        .flat_map(|r| [&x[r * width..(r + 1) * width], &y[r * width..(r + 1) * width]].concat())
        .collect();
    let gub = upload_f32(ctx, &gate_up);
    let mut pass = Pass::new(k);
    match op {
        Elementwise::Add => dispatch::add(&mut pass, &xb, &yb, y.len()),
        Elementwise::SiluMul => dispatch::silu_mul(&mut pass, &gub, &yb, rows, width),
        Elementwise::Gelu => dispatch::gelu(&mut pass, &yb, y.len()),
    }
    pass.submit();
    read(ctx, &yb, y.len())
}
