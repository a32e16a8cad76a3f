//! The WebGPU backend against the CPU reference: each kernel on random inputs of awkward sizes
//! for every weight type, then whole models (synthetic ones of each architecture and weight type,
//! and stories260K) logit by logit through a greedy decode.
//!
//! Without a GPU adapter every test prints a loud SKIP and passes, unless NEXTTOKEN_REQUIRE_GPU
//! is set (CI installs lavapipe, Mesa's software Vulkan, and sets it): then no adapter fails.
//!
//! Tolerances: the GPU decodes exactly the same weight values as the CPU (same formulas, f16
//! conversion is exact), so the quantisation type does not widen the gap: what differs is only
//! the order of float additions (workgroup reductions vs sequential sums), fused multiply-adds
//! and the GPU's exp/sqrt. Hence one absolute tolerance per quantity, the same for all types:
//! kernels 1e-4 relative to the magnitude of the result, whole-model logits 1e-3 absolute
//! (measured on lavapipe: about 1e-6 to 1e-5; the tests print the worst error they saw).
//!
//! Those whole-model tests pin the f32 path (`GpuOptions::f32()`). The f16 path (the default
//! where the device has shader-f16; lavapipe has it) rounds every key and value, and in prefill's
//! tiled products every weight and activation, to f16 (relative error 2^-11) and sums blocks of
//! 32 products in f16, so its logits get a looser tolerance: 5e-2 absolute (see `f16_*`).

mod common;

use std::io::Write;
use std::sync::{Arc, OnceLock};

use half::{bf16, f16};
use nexttoken::cpu::{dot, softmax_in_place, CpuModel, Precision};
use nexttoken::generate::{beam_search, score, BeamOptions};
use nexttoken::gguf::Gguf;
#[path = "gpu/host.rs"]
mod host;
use host::Elementwise;
use nexttoken::gpu::dispatch::RopeMode;
use nexttoken::gpu::kernels::Kernels;
use nexttoken::gpu::{is_device_lost, GpuContext, GpuModel, GpuOptions, GpuStream, NO_ADAPTER};
use nexttoken::lm::block_on;
use nexttoken::model::{Arch, Model};
use nexttoken::quant::{dequantize_row, GgmlType};
use nexttoken::synthetic::{self, Spec};
use nexttoken::LanguageModel;

// ---------------------------------------------------------------------------------------------
// Setup

fn context() -> Option<Arc<GpuContext>> {
    static CTX: OnceLock<Option<Arc<GpuContext>>> = OnceLock::new();
    CTX.get_or_init(|| {
        if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
            let dir = std::env::temp_dir().join("nexttoken-xdg");
            let _ = std::fs::create_dir_all(&dir);
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
            }
            std::env::set_var("XDG_RUNTIME_DIR", &dir);
        }
        match GpuContext::new() {
            Ok(ctx) => {
                // Straight to stderr: libtest captures eprintln! of passing tests.
                let _ = writeln!(std::io::stderr(), "gpu tests on {}", ctx.describe());
                Some(ctx)
            }
            Err(e) => {
                let required = std::env::var_os("NEXTTOKEN_REQUIRE_GPU").is_some_and(|v| v != "0");
                if required {
                    panic!("NEXTTOKEN_REQUIRE_GPU is set but the GPU is unusable: {e}");
                }
                assert!(e.to_string().contains(NO_ADAPTER), "GPU setup failed: {e}");
                let _ = writeln!(
                    std::io::stderr(),
                    "\n*** SKIPPED: {e}; GPU tests did not run (install mesa-vulkan-drivers for \
                     lavapipe, or set NEXTTOKEN_REQUIRE_GPU=1 to fail instead) ***\n"
                );
                None
            }
        }
    })
    .clone()
}

/// `model` on the GPU with `opts`.
fn gpu_model(ctx: &Arc<GpuContext>, model: Model, opts: GpuOptions) -> GpuModel {
    pollster::block_on(GpuModel::with_options(ctx.clone(), model, opts)).unwrap()
}

fn kernels() -> Option<Kernels> {
    context().map(Kernels::new)
}

/// SplitMix64: a tiny deterministic generator (tests need no statistical quality).
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn f(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// Random encoded weights: `rows` x `cols` of `ty`, values of magnitude around `scale`. Quantised
/// blocks are random bytes with their f16 scales overwritten by sane values.
fn random_weights(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize, scale: f32) -> Vec<u8> {
    let n = rows * cols;
    match ty {
        GgmlType::F32 => rng.vec(n, scale).iter().flat_map(|v| v.to_le_bytes()).collect(),
        GgmlType::F16 => {
            rng.vec(n, scale).iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect()
        }
        GgmlType::BF16 => {
            rng.vec(n, scale).iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect()
        }
        _ => {
            let (bb, blocks) = (ty.block_bytes(), n / ty.block_size());
            let mut b: Vec<u8> = (0..bb * blocks).map(|_| rng.next_u64() as u8).collect();
            for blk in b.chunks_exact_mut(bb) {
                let d = (0.5 + 0.5 * rng.f().abs()) * scale;
                match ty {
                    GgmlType::Q8_0 => put_f16(blk, 0, d / 127.0),
                    GgmlType::Q4_0 => put_f16(blk, 0, d / 8.0),
                    GgmlType::Q5_0 => put_f16(blk, 0, d / 16.0),
                    GgmlType::Q5_1 => {
                        // m = -16 d: the values d*q + m then centre on zero.
                        put_f16(blk, 0, d / 16.0);
                        put_f16(blk, 2, -d);
                    }
                    GgmlType::Q4_K => {
                        // dmin = 7.5 d: the values d*sc*q - dmin*m then centre on zero.
                        put_f16(blk, 0, d / (63.0 * 15.0) * 2.0);
                        put_f16(blk, 2, d / (63.0 * 15.0) * 15.0);
                    }
                    GgmlType::Q5_K => {
                        // dmin = 15.5 d, as for Q4_K with 5-bit q.
                        put_f16(blk, 0, d / (63.0 * 31.0) * 2.0);
                        put_f16(blk, 2, d / (63.0 * 31.0) * 31.0);
                    }
                    GgmlType::Q6_K => put_f16(blk, 208, d / (127.0 * 32.0) * 2.0),
                    _ => unreachable!(),
                }
            }
            b
        }
    }
}

fn dequant(ty: GgmlType, bytes: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * cols];
    let rb = ty.row_bytes(cols);
    for r in 0..rows {
        dequantize_row(ty, &bytes[r * rb..(r + 1) * rb], &mut out[r * cols..(r + 1) * cols]);
    }
    out
}

/// Largest |a - b|, asserting it is within `tol` times max(1, largest |b|).
fn check_close(what: &str, a: &[f32], b: &[f32], tol: f32) -> f32 {
    let scale = b.iter().fold(1f32, |m, v| m.max(v.abs()));
    check_abs(what, a, b, tol * scale)
}

/// Largest |a - b|, asserting it is within `tol`.
fn check_abs(what: &str, a: &[f32], b: &[f32], tol: f32) -> f32 {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    let scale = 1.0;
    let mut worst = (0f32, 0usize);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let d = (x - y).abs();
        assert!(d.is_finite(), "{what}: element {i} is {x}, expected {y}");
        if d > worst.0 {
            worst = (d, i);
        }
    }
    let (d, i) = worst;
    assert!(
        d <= tol * scale,
        "{what}: element {i} is {} expected {} (error {d}, tolerance {})",
        a[i],
        b[i],
        tol * scale
    );
    d
}

const ALL_TYPES: [GgmlType; 10] = GgmlType::ALL;

/// Column counts to try for a type: awkward ones where the block size allows.
fn col_options(ty: GgmlType) -> Vec<usize> {
    match ty.block_size() {
        1 => vec![1, 7, 33, 100, 513],
        32 => vec![32, 96, 160, 544],
        _ => vec![256, 768],
    }
}

// ---------------------------------------------------------------------------------------------
// Kernels

#[test]
fn matmul_every_type_and_shape() {
    let Some(k) = kernels() else { return };
    let mut rng = Rng(1);
    for ty in ALL_TYPES {
        for cols in col_options(ty) {
            for (rows, n_tok) in [(1, 1), (3, 1), (67, 1), (130, 9), (5, 17)] {
                let w = random_weights(&mut rng, ty, rows, cols, 0.5);
                let x = rng.vec(n_tok * cols, 1.0);
                let bias = (rows % 2 == 1).then(|| rng.vec(rows, 1.0));
                let got = host::matmul(&k, ty, &w, rows, cols, &x, bias.as_deref()).unwrap();
                let wf = dequant(ty, &w, rows, cols);
                let mut want = vec![0f32; n_tok * rows];
                for t in 0..n_tok {
                    for r in 0..rows {
                        want[t * rows + r] =
                            dot(&wf[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols])
                                + bias.as_ref().map_or(0.0, |b| b[r]);
                    }
                }
                check_close(
                    &format!("matmul {} {rows}x{cols} n={n_tok}", ty.name()),
                    &got,
                    &want,
                    1e-4,
                );
            }
        }
    }
}

/// The decode product with its input normed in the kernel: one token and several, rows wider
/// than the activations the kernel stages at once (2048 floats, shared by the tokens), RMSNorm
/// and LayerNorm, input rows after others, the residual add.
#[test]
fn matvec_normed_inputs_in_slabs() {
    let Some(k) = kernels() else { return };
    let mut rng = Rng(12);
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_K] {
        let wide = if ty.block_size() == 1 { 2085 } else { 2304 };
        let narrow = if ty.block_size() == 256 { 512 } else { 288 };
        for (cols, n_tok) in [(wide, 1), (narrow, 8), (narrow, 3), (wide, 2)] {
            for norm in 0..3 {
                let rows = 37;
                let x_row0 = 1;
                let w = random_weights(&mut rng, ty, rows, cols, 0.5);
                let x: Vec<f32> =
                    rng.vec((x_row0 + n_tok) * cols, 2.0).iter().map(|v| v + 0.3).collect();
                let nw = rng.vec(cols, 1.0);
                let nb = rng.vec(cols, 1.0);
                let y0 = rng.vec(n_tok * rows, 1.0);
                let eps = 1e-5;
                let add = norm == 1;
                let mut want = if add { y0.clone() } else { vec![0f32; n_tok * rows] };
                let wf = dequant(ty, &w, rows, cols);
                for t in 0..n_tok {
                    let xr = &x[(x_row0 + t) * cols..(x_row0 + t + 1) * cols];
                    let n = cols as f32;
                    let mean = if norm == 2 { xr.iter().sum::<f32>() / n } else { 0.0 };
                    let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
                    let inv = 1.0 / (var + eps).sqrt();
                    let xn: Vec<f32> = (0..cols)
                        .map(|i| match norm {
                            0 => xr[i],
                            1 => xr[i] * inv * nw[i],
                            _ => (xr[i] - mean) * inv * nw[i] + nb[i],
                        })
                        .collect();
                    for r in 0..rows {
                        want[t * rows + r] += dot(&wf[r * cols..(r + 1) * cols], &xn);
                    }
                }
                let case = host::NormedCase {
                    ty,
                    w: &w,
                    rows,
                    cols,
                    x: &x,
                    x_row0,
                    n_tok,
                    norm_weight: (norm > 0).then_some(&nw[..]),
                    norm_bias: (norm == 2).then_some(&nb[..]),
                    eps,
                    y0: &y0,
                    add,
                };
                let got = host::matvec_normed(&k, &case).unwrap();
                let what = format!("matvec {} {rows}x{cols} n={n_tok} norm {norm}", ty.name());
                check_close(&what, &got, &want, 1e-4);
            }
        }
    }
}

#[test]
fn matmul_tiled_every_type_and_shape() {
    // The prefill kernel (32 x 32 output tiles): rows and tokens not multiples of the tile,
    // forced as well onto a batch small enough for the decode kernel.
    let Some(k) = kernels() else { return };
    let mut rng = Rng(11);
    for ty in ALL_TYPES {
        let opts = col_options(ty);
        for (i, (rows, n_tok)) in [(37, 9), (70, 33), (5, 70), (33, 2)].into_iter().enumerate() {
            let cols = opts[i % opts.len()];
            let w = random_weights(&mut rng, ty, rows, cols, 0.5);
            let x = rng.vec(n_tok * cols, 1.0);
            let bias = (i % 2 == 0).then(|| rng.vec(rows, 1.0));
            let got = host::matmul_with(&k, ty, &w, rows, cols, &x, bias.as_deref(), true).unwrap();
            let wf = dequant(ty, &w, rows, cols);
            let mut want = vec![0f32; n_tok * rows];
            for t in 0..n_tok {
                for r in 0..rows {
                    want[t * rows + r] =
                        dot(&wf[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols])
                            + bias.as_ref().map_or(0.0, |b| b[r]);
                }
            }
            check_close(
                &format!("tiled matmul {} {rows}x{cols} n={n_tok}", ty.name()),
                &got,
                &want,
                1e-4,
            );
        }
    }
}

/// Every output tile of the prefill kernel with everything the model asks of it: rows and
/// tokens not multiples of the tile (and more than one tile of each), a packed tensor (rows read
/// from a byte offset), input rows from an offset, a bias at an offset, outputs at a column
/// offset of wider rows, the accumulating store (the residual add) onto what is there, and the
/// input's RMSNorm folded in; in f32 and, where the device has shader-f16, in f16.
///
/// The f16 kernel's oracle rounds what the kernel rounds (each dequantised weight, and each
/// activation times the norm's weight) to f16 and sums in f64, so what is left is the f16
/// summing of each block of 32 products. Its tolerance, 6e-3 of the largest output, is three
/// times the largest error measured on lavapipe (2e-3; the f32 kernel's tolerance is 1e-4); a
/// block added twice or left out, a weight or activation from the wrong column, is a larger
/// error than that.
#[test]
fn matmul_tiled_every_tile_type_and_layout() {
    let Some(k) = kernels() else { return };
    matmul_tiled_cases(&k, false, 1e-4);
    if k.ctx.shader_f16 {
        matmul_tiled_cases(&k, true, 6e-3);
    } else {
        eprintln!("no shader-f16 on this adapter: the f16 tiled products are not tested");
    }
}

fn matmul_tiled_cases(k: &Kernels, f16: bool, tol: f32) {
    use crate::host::TiledCase;
    use nexttoken::gpu::dispatch::Tile;
    let round = |v: f32| if f16 { half::f16::from_f32(v).to_f32() } else { v };
    let mut rng = Rng(12);
    let mut worst = 0f32;
    for ty in ALL_TYPES {
        let opts = col_options(ty);
        for (i, tile) in Tile::ALL.into_iter().enumerate() {
            for (j, (rows, n_tok)) in [(70, 9), (133, 65)].into_iter().enumerate() {
                let cols = opts[(i + j) % opts.len()];
                let (w_rows, w_row0) = (rows + 5, 3);
                let w = random_weights(&mut rng, ty, w_rows, cols, 0.5);
                let (x_row0, y_stride, y_col0) = (2, rows + 7, 4);
                let x = rng.vec((x_row0 + n_tok) * cols, 1.0);
                let bias = (j == 0).then(|| rng.vec(rows, 1.0));
                let y0 = rng.vec(n_tok * y_stride, 1.0);
                let accumulate = (i + j) % 2 == 1;
                // An RMSNorm folded in on one case of two (the other of each tile and type).
                let norm_w = (j == 1).then(|| rng.vec(cols, 1.0));
                let rms_norm = norm_w.as_deref().map(|g| (g, 1e-5));
                let case = TiledCase {
                    ty,
                    w: &w,
                    w_rows,
                    w_row0,
                    rows,
                    cols,
                    x: &x,
                    x_row0,
                    n_tok,
                    bias: bias.as_deref(),
                    bias_at: cols + 7,
                    y0: &y0,
                    y_stride,
                    y_col0,
                    tile,
                    accumulate,
                    rms_norm,
                    f16,
                };
                let got = host::matmul_tiled_case(k, &case).unwrap();
                let wf: Vec<f32> = dequant(ty, &w, w_rows, cols).into_iter().map(round).collect();
                let mut want = y0.clone();
                for t in 0..n_tok {
                    // The kernel's tile holds x * g (rounded in f16); 1 / rms comes after.
                    let mut xt = x[(x_row0 + t) * cols..][..cols].to_vec();
                    let mut inv = 1.0;
                    if let Some((g, eps)) = rms_norm {
                        let ms = xt.iter().map(|v| v * v).sum::<f32>() / cols as f32;
                        inv = 1.0 / (ms + eps).sqrt();
                        xt.iter_mut().zip(g).for_each(|(v, g)| *v *= g);
                    }
                    let xt: Vec<f32> = xt.into_iter().map(round).collect();
                    for r in 0..rows {
                        let wr = &wf[(w_row0 + r) * cols..][..cols];
                        let d: f64 = wr.iter().zip(&xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                        let v = d as f32 * inv + bias.as_ref().map_or(0.0, |b| b[r]);
                        let at = t * y_stride + y_col0 + r;
                        want[at] = if accumulate { want[at] + v } else { v };
                    }
                }
                let what = format!(
                    "tiled matmul {tile:?} {} {rows}x{cols} n={n_tok} accumulate {accumulate} norm {} f16 {f16}",
                    ty.name(),
                    rms_norm.is_some()
                );
                let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
                worst = worst.max(check_close(&what, &got, &want, tol) / scale);
            }
        }
    }
    eprintln!("tiled products (f16 {f16}): largest error {worst:.2e} of the largest output (tolerance {tol})");
}

#[test]
fn matmul_split_into_parts() {
    // A tensor larger than one binding is split by rows; test that path on small data.
    let Some(k) = kernels() else { return };
    let mut rng = Rng(2);
    for ty in [GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_K] {
        let cols = col_options(ty)[1];
        // 3 tokens: the decode kernel; 12: the tiled prefill kernel.
        for (rows, n_tok) in [(41, 3), (41, 12)] {
            let w = random_weights(&mut rng, ty, rows, cols, 0.5);
            let x = rng.vec(n_tok * cols, 1.0);
            let got = host::matmul_split(&k, ty, &w, rows, cols, &x, 8).unwrap();
            let whole = host::matmul(&k, ty, &w, rows, cols, &x, None).unwrap();
            check_close(&format!("split matmul {} n={n_tok}", ty.name()), &got, &whole, 1e-6);
        }
    }
}

#[test]
fn embedding_every_type() {
    let Some(k) = kernels() else { return };
    let mut rng = Rng(3);
    for ty in ALL_TYPES {
        for cols in col_options(ty) {
            let rows = 37;
            let w = random_weights(&mut rng, ty, rows, cols, 1.0);
            let ids: Vec<u32> =
                (0..11).map(|_| rng.below(rows) as u32).chain([0, rows as u32 - 1]).collect();
            let got = host::embedding(&k, ty, &w, rows, cols, &ids).unwrap();
            let wf = dequant(ty, &w, rows, cols);
            let want: Vec<f32> = ids
                .iter()
                .flat_map(|&i| wf[i as usize * cols..(i as usize + 1) * cols].to_vec())
                .collect();
            // Exact: the same decode, no arithmetic beyond it.
            assert_eq!(got, want, "embedding {} cols {cols}", ty.name());
        }
    }
}

#[test]
fn rms_and_layer_norm() {
    let Some(k) = kernels() else { return };
    let mut rng = Rng(4);
    for n in [1, 5, 64, 100, 1000] {
        for rows in [1, 3, 70] {
            let x: Vec<f32> = rng.vec(rows * n, 3.0).iter().map(|v| v + 0.5).collect();
            let w = rng.vec(n, 1.0);
            let b = rng.vec(n, 1.0);
            let eps = 1e-5;
            let mut rms = vec![0f32; rows * n];
            let mut ln = vec![0f32; rows * n];
            for r in 0..rows {
                let xr = &x[r * n..(r + 1) * n];
                let ms = xr.iter().map(|v| v * v).sum::<f32>() / n as f32;
                let inv = 1.0 / (ms + eps).sqrt();
                let mean = xr.iter().sum::<f32>() / n as f32;
                let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n as f32;
                let inv_ln = 1.0 / (var + eps).sqrt();
                for i in 0..n {
                    rms[r * n + i] = xr[i] * inv * w[i];
                    ln[r * n + i] = (xr[i] - mean) * inv_ln * w[i] + b[i];
                }
            }
            let got = host::norm(&k, &x, &w, None, eps).unwrap();
            check_close(&format!("rms_norm n={n} rows={rows}"), &got, &rms, 1e-5);
            let got = host::norm(&k, &x, &w, Some(&b), eps).unwrap();
            // n = 1: the LayerNorm output is the bias exactly (x - mean = 0).
            check_close(&format!("layer_norm n={n} rows={rows}"), &got, &ln, 1e-4);
        }
    }
}

#[test]
fn rope_both_layouts_and_partial() {
    let Some(k) = kernels() else { return };
    let mut rng = Rng(5);
    for (mode, n_head, head_dim, rope_dims, pos0) in [
        (RopeMode::Interleaved, 3, 8, 8, 0),
        (RopeMode::Interleaved, 2, 64, 32, 1000),
        (RopeMode::HalfSplit, 5, 24, 24, 7),
        (RopeMode::HalfSplit, 1, 16, 8, 3000),
        (RopeMode::Copy, 2, 6, 6, 5),
    ] {
        let n_tok = 6;
        let half = rope_dims / 2;
        let inv_freq: Vec<f32> =
            (0..half).map(|i| 10000f64.powf(-((2 * i) as f64) / rope_dims as f64) as f32).collect();
        let x = rng.vec(n_tok * n_head * head_dim, 2.0);
        let mut want = x.clone();
        for t in 0..n_tok {
            for head in
                want[t * n_head * head_dim..(t + 1) * n_head * head_dim].chunks_exact_mut(head_dim)
            {
                for (i, &f) in inv_freq.iter().enumerate() {
                    let (sin, cos) = ((pos0 + t) as f32 * f).sin_cos();
                    let (a, b) = match mode {
                        RopeMode::Interleaved => (2 * i, 2 * i + 1),
                        RopeMode::HalfSplit => (i, i + half),
                        RopeMode::Copy => break,
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * cos - x1 * sin;
                    head[b] = x0 * sin + x1 * cos;
                }
            }
        }
        let got = host::rope(&k, mode, &x, n_head, head_dim, rope_dims, pos0, &inv_freq).unwrap();
        check_close(
            &format!("rope {mode:?} {n_head}x{head_dim} dims {rope_dims} pos {pos0}"),
            &got,
            &want,
            1e-5,
        );
    }
}

/// Causal attention on the CPU: queries at positions `pos0 + t`, query head h reading key/value
/// head h / (n_head / n_head_kv).
fn attention_oracle(
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    (n_head, n_head_kv, head_dim): (usize, usize, usize),
    pos0: usize,
) -> Vec<f32> {
    let (q_dim, kv_dim) = (n_head * head_dim, n_head_kv * head_dim);
    let n_tok = q.len() / q_dim;
    let mut want = vec![0f32; n_tok * q_dim];
    let scale = 1.0 / (head_dim as f32).sqrt();
    for t in 0..n_tok {
        let s_len = pos0 + t + 1;
        for h in 0..n_head {
            let kvh = h / (n_head / n_head_kv);
            let qh = &q[t * q_dim + h * head_dim..][..head_dim];
            let mut s: Vec<f32> = (0..s_len)
                .map(|p| dot(qh, &kc[p * kv_dim + kvh * head_dim..][..head_dim]) * scale)
                .collect();
            softmax_in_place(&mut s);
            for d in 0..head_dim {
                want[t * q_dim + h * head_dim + d] =
                    (0..s_len).map(|p| s[p] * vc[p * kv_dim + kvh * head_dim + d]).sum();
            }
        }
    }
    want
}

#[test]
fn attention_causal_gqa() {
    let Some(k) = kernels() else { return };
    let mut rng = Rng(6);
    for (n_head, n_head_kv, head_dim, pos0, n_tok) in [
        (1, 1, 8, 0, 1),
        (4, 2, 16, 0, 5),
        (6, 2, 64, 130, 3),
        (2, 2, 100, 63, 2),
        (8, 1, 256, 7, 4),
        (3, 3, 32, 300, 1),
        // Chunks longer than the 1024 scores the kernel keeps.
        (2, 1, 16, 5200, 2),
    ] {
        let (q_dim, kv_dim) = (n_head * head_dim, n_head_kv * head_dim);
        let seen = pos0 + n_tok;
        // Large scores (scale 4) exercise the max subtraction.
        let q = rng.vec(n_tok * q_dim, 4.0);
        let kc = rng.vec(seen * kv_dim, 4.0);
        let vc = rng.vec(seen * kv_dim, 1.0);
        let want = attention_oracle(&q, &kc, &vc, (n_head, n_head_kv, head_dim), pos0);
        let got = host::attention(&k, &q, &kc, &vc, n_head, n_head_kv, head_dim, pos0).unwrap();
        check_close(
            &format!("attention {n_head}/{n_head_kv}x{head_dim} pos {pos0} n {n_tok}"),
            &got,
            &want,
            1e-4,
        );
    }
}

/// The prefill kernel (flash attention: key/value tiles, online softmax, causal tiles skipped)
/// on awkward sizes: token counts that are not multiples of its 16-row tiles, every GQA ratio
/// 1..4 (rows of a tile spanning tokens), head sizes 8 to 256 (tiles of 32 down to 6 keys), a
/// batch after cached positions, and the f16 cache (the oracle reads the same rounded values).
#[test]
fn attention_prefill_flash_every_shape() {
    let Some(k) = kernels() else { return };
    let mut rng = Rng(61);
    let mut caches = vec![false];
    if k.ctx.shader_f16 {
        caches.push(true);
    } else {
        eprintln!("no shader-f16 on this adapter: the f16 cache is not tested");
    }
    for f16_kv in caches {
        for (n_head, n_head_kv, head_dim, pos0, n_tok) in [
            (1, 1, 8, 0, 9),
            (4, 2, 48, 0, 33),
            (9, 3, 64, 0, 70),
            (6, 2, 64, 130, 17),
            (8, 2, 128, 5, 23),
            (4, 1, 256, 40, 11),
            (3, 3, 100, 63, 65),
            (12, 4, 48, 200, 9),
            (8, 8, 64, 31, 64),
        ] {
            let (q_dim, kv_dim) = (n_head * head_dim, n_head_kv * head_dim);
            let seen = pos0 + n_tok;
            let q = rng.vec(n_tok * q_dim, 4.0);
            let mut kc = rng.vec(seen * kv_dim, 4.0);
            let mut vc = rng.vec(seen * kv_dim, 1.0);
            if f16_kv {
                for v in kc.iter_mut().chain(vc.iter_mut()) {
                    *v = f16::from_f32(*v).to_f32();
                }
            }
            let shape = (n_head, n_head_kv, head_dim);
            let want = attention_oracle(&q, &kc, &vc, shape, pos0);
            let shape = nexttoken::gpu::dispatch::AttentionShape { n_head, n_head_kv, head_dim };
            let got = host::attention_with(&k, &q, [&kc, &vc], shape, pos0, true, f16_kv).unwrap();
            check_close(
                &format!(
                    "flash attention {n_head}/{n_head_kv}x{head_dim} pos {pos0} n {n_tok} f16 {f16_kv}"
                ),
                &got,
                &want,
                1e-4,
            );
        }
    }
}

#[test]
fn elementwise_kernels() {
    let Some(k) = kernels() else { return };
    let mut rng = Rng(7);
    for n in [1, 255, 258, 70_001] {
        let x = rng.vec(n, 8.0);
        let mut y = rng.vec(n, 8.0);
        y[0] = 60.0; // gelu of a large input must not be NaN
        let add: Vec<f32> = x.iter().zip(&y).map(|(a, b)| b + a).collect();
        let silu: Vec<f32> = x.iter().zip(&y).map(|(g, u)| u * (g / (1.0 + (-g).exp()))).collect();
        let gelu: Vec<f32> = y
            .iter()
            .map(|&v| 0.5 * v * (1.0 + (0.797_884_6f32 * (v + 0.044715 * v * v * v)).tanh()))
            .collect();
        check_close("add", &host::elementwise(&k, Elementwise::Add, &x, &y).unwrap(), &add, 1e-6);
        check_close(
            "silu_mul",
            &host::elementwise(&k, Elementwise::SiluMul, &x, &y).unwrap(),
            &silu,
            1e-5,
        );
        check_close(
            "gelu",
            &host::elementwise(&k, Elementwise::Gelu, &x, &y).unwrap(),
            &gelu,
            1e-5,
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Whole models

/// A small random model of `arch` with weight matrices (and embeddings) of type `ty`: 2 layers,
/// grouped-query attention (llama, qwen2), sizes that are not powers of two where `ty` allows.
fn synth_model(arch: Arch, ty: GgmlType, seed: u64, tied: bool) -> Model {
    let k_quant = ty.block_size() == 256;
    let (e, ff) = if k_quant { (256, 512) } else { (96, 160) };
    let spec = Spec {
        n_head_kv: if arch == Arch::Gpt2 { 4 } else { 2 },
        tied,
        weight_type: ty,
        seed,
        ..Spec::new(arch, 300, e, 2, 4, ff, 160)
    };
    Model::from_bytes(synthetic::write(&spec).unwrap()).unwrap()
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Prefill `prompt` (comparing every row of logits), then `steps` greedy decode steps comparing
/// the logits and the chosen token at each. Returns the largest logit error.
fn compare_decode(
    name: &str,
    cpu: &CpuModel,
    gpu: &GpuModel,
    prompt: &[u32],
    steps: usize,
    tol: f32,
) -> f32 {
    let (mut cs, mut gs) = (cpu.new_state(), gpu.new_state());
    let vocab = cpu.vocab_size();
    let want = cpu.forward(&mut cs, prompt, true).unwrap();
    let got = gpu.forward(&mut gs, prompt, true).unwrap();
    let mut worst = check_abs(&format!("{name}: prefill of {}", prompt.len()), &got, &want, tol);
    assert_eq!(gpu.position(&gs), prompt.len());
    let mut tok = argmax(&want[want.len() - vocab..]);
    assert_eq!(argmax(&got[got.len() - vocab..]), tok, "{name}: prefill's next token differs");
    for step in 0..steps {
        let want = cpu.forward(&mut cs, &[tok], false).unwrap();
        let got = gpu.forward(&mut gs, &[tok], false).unwrap();
        worst = worst.max(check_abs(&format!("{name}: step {step}"), &got, &want, tol));
        let next = argmax(&want);
        assert_eq!(argmax(&got), next, "{name}: greedy token differs at step {step}");
        tok = next;
    }
    worst
}

#[test]
fn synthetic_models_match_cpu() {
    let Some(ctx) = context() else { return };
    let mut report = Vec::new();
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Gpt2] {
        for (i, ty) in ALL_TYPES.into_iter().enumerate() {
            let tied = i % 2 == 1;
            let seed = 100 + i as u64;
            let cpu = CpuModel::new(synth_model(arch, ty, seed, tied));
            let gpu = gpu_model(&ctx, synth_model(arch, ty, seed, tied), GpuOptions::f32());
            let name = format!("{} {}", arch.gguf_name(), ty.name());
            let prompt = [1, 17, 299, 42, 5];
            let worst = compare_decode(&name, &cpu, &gpu, &prompt, 12, 1e-3);
            report.push(format!("{name}: {worst:.2e}"));
        }
    }
    eprintln!("largest logit error per synthetic model: {}", report.join(", "));
}

#[test]
fn tiled_prefill_every_type_and_stories() {
    // Prompts of more than 8 tokens: every weight matmul of the prefill takes the tiled kernel.
    let Some(ctx) = context() else { return };
    let prompt: Vec<u32> = (0..20).map(|i| (i * 53 % 300) as u32).collect();
    for (i, ty) in ALL_TYPES.into_iter().enumerate() {
        let arch = [Arch::Llama, Arch::Gpt2][i % 2];
        let cpu = CpuModel::new(synth_model(arch, ty, 40 + i as u64, false));
        let gpu = gpu_model(&ctx, synth_model(arch, ty, 40 + i as u64, false), GpuOptions::f32());
        compare_decode(
            &format!("tiled prefill {} {}", arch.gguf_name(), ty.name()),
            &cpu,
            &gpu,
            &prompt,
            1,
            1e-3,
        );
    }
    let Some(path) = stories_path("stories260K-q8_0.gguf") else { return };
    let cpu = CpuModel::new(Model::open(&path).unwrap());
    let gpu = gpu_model(&ctx, Model::open(&path).unwrap(), GpuOptions::f32());
    let prompt: Vec<u32> = (0..40).map(|i| (1 + i * 7 % 500) as u32).collect();
    compare_decode("stories260K q8_0 40-token prefill", &cpu, &gpu, &prompt, 2, 2e-3);
}

#[test]
fn long_prefill_runs_in_batches_and_states_fork() {
    let Some(ctx) = context() else { return };
    let (arch, ty) = (Arch::Qwen2, GgmlType::Q8_0);
    let cpu = CpuModel::new(synth_model(arch, ty, 9, false));
    let gpu =
        gpu_model(&ctx, synth_model(arch, ty, 9, false), GpuOptions::f32()).with_max_batch(64);
    // 150 tokens: more than one pass of at most 64 tokens, in one submission.
    let prompt: Vec<u32> = (0..150).map(|i| (i * 37 % 300) as u32).collect();
    let worst = compare_decode("qwen2 Q8_0 long prefill", &cpu, &gpu, &prompt, 3, 1e-3);
    eprintln!("long prefill: largest logit error {worst:.2e}");

    // The same prompt in one pass (up to 512 tokens): every token's logits come in pieces of at
    // most 64 rows. Then a prefill of 90 continuing after 60 cached positions.
    let one = gpu_model(&ctx, synth_model(arch, ty, 9, false), GpuOptions::f32());
    compare_decode("qwen2 Q8_0 long prefill in one pass", &cpu, &one, &prompt, 1, 1e-3);
    let (mut cs, mut gs) = (cpu.new_state(), one.new_state());
    cpu.forward(&mut cs, &prompt[..60], false).unwrap();
    one.forward(&mut gs, &prompt[..60], false).unwrap();
    let more: Vec<u32> = (0..90).map(|i| (i * 11 % 300) as u32).collect();
    let want = cpu.forward(&mut cs, &more, true).unwrap();
    let got = one.forward(&mut gs, &more, true).unwrap();
    check_abs("prefill after 60 cached positions", &got, &want, 1e-3);

    // Prefill without all_logits returns only the last row.
    let (mut cs, mut gs) = (cpu.new_state(), gpu.new_state());
    let want = cpu.forward(&mut cs, &prompt[..70], false).unwrap();
    let got = gpu.forward(&mut gs, &prompt[..70], false).unwrap();
    assert_eq!(got.len(), gpu.vocab_size());
    check_abs("last row only", &got, &want, 1e-3);

    // A cloned state continues independently of the original.
    let mut fork = gs.clone();
    let a = gpu.forward(&mut gs, &[3], false).unwrap();
    let b = gpu.forward(&mut fork, &[4], false).unwrap();
    let mut cs4 = cs.clone();
    check_abs("original after fork", &a, &cpu.forward(&mut cs, &[3], false).unwrap(), 1e-3);
    check_abs("fork", &b, &cpu.forward(&mut cs4, &[4], false).unwrap(), 1e-3);

    // Errors leave the state unchanged.
    let pos = gpu.position(&gs);
    assert!(gpu.forward(&mut gs, &[300], false).is_err());
    assert!(gpu.forward(&mut gs, &[], false).is_err());
    assert!(gpu.forward(&mut gs, &vec![1; 200], false).is_err());
    assert_eq!(gpu.position(&gs), pos);
}

fn stories_path(file: &str) -> Option<std::path::PathBuf> {
    Some(common::shared()?.join("models/stories260K").join(file))
}

fn stories(file: &str, tol: f32) {
    stories_with(file, tol, GpuOptions::f32(), 64);
}

fn stories_with(file: &str, tol: f32, opts: GpuOptions, steps: usize) {
    let Some(ctx) = context() else { return };
    let Some(path) = stories_path(file) else { return };
    let cpu = CpuModel::new(Model::open(&path).unwrap());
    let gpu = gpu_model(&ctx, Model::open(&path).unwrap(), opts);
    let bos = cpu.bos_token().unwrap_or(1);
    let worst = compare_decode(file, &cpu, &gpu, &[bos], steps, tol);
    eprintln!("{file} ({opts:?}): {steps}-token greedy decode, largest logit error {worst:.2e} (tolerance {tol})");
}

/// f32 weights: only summation order differs.
#[test]
fn stories260k_f32_matches_cpu() {
    stories("stories260K-f32.gguf", 1e-3);
}

/// Q8_0: both sides decode the same values, so the same tolerance holds.
#[test]
fn stories260k_q8_0_matches_cpu() {
    stories("stories260K-q8_0.gguf", 1e-3);
}

// ---------------------------------------------------------------------------------------------
// Picking on the GPU, execution, f16 KV cache, lost device

/// Indices of `x` sorted best first (ties: smaller index first), as the top-k kernels order them.
fn sorted_desc(x: &[f32]) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..x.len() as u32).collect();
    idx.sort_by(|&a, &b| x[b as usize].partial_cmp(&x[a as usize]).unwrap().then(a.cmp(&b)));
    idx
}

fn logsumexp(x: &[f32]) -> f64 {
    let m = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    m + x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln()
}

#[test]
fn topk_kernel_matches_a_stable_sort() {
    let Some(k) = kernels() else { return };
    let mut rng = Rng(11);
    for n in [1, 5, 64, 300, 1025, 5000, 70_001] {
        for top in [1, 7, 64] {
            // Values on a coarse grid: many ties, which must come out by smaller index.
            let x: Vec<f32> = (0..n).map(|_| (rng.f() * 40.0).round() / 4.0).collect();
            let (got, lse) = host::topk(&k, &x, top).unwrap();
            let want = sorted_desc(&x);
            let want: Vec<(u32, f32)> =
                want.iter().take(top).map(|&i| (i, x[i as usize])).collect();
            assert_eq!(got, want, "top-{top} of {n}");
            let wl = logsumexp(&x);
            assert!(
                (lse as f64 - wl).abs() <= 1e-5 * wl.abs().max(1.0),
                "logsumexp of {n}: {lse} vs {wl}"
            );
        }
    }
}

/// The masked top-k (structured output's allowed set applied in the kernel) against a stable
/// sort of the allowed values: sparse and dense masks, masks allowing fewer than k, none, or
/// only the last id; ties by smaller index.
#[test]
fn masked_topk_kernel_matches_a_sort_of_the_allowed() {
    let Some(k) = kernels() else { return };
    let mut rng = Rng(12);
    for n in [1usize, 33, 300, 1025, 5000, 70_001] {
        let x: Vec<f32> = (0..n).map(|_| (rng.f() * 40.0).round() / 4.0).collect();
        let words = n.div_ceil(32);
        let masks: Vec<Vec<bool>> = vec![
            (0..n).map(|_| rng.f() < 0.5).collect(),
            (0..n).map(|_| rng.f() < 0.001).collect(),
            (0..n).map(|i| i % 97 == 3).collect(),
            (0..n).map(|i| i + 1 == n).collect(),
            vec![false; n],
            vec![true; n],
        ];
        for allowed in &masks {
            let mut mask = vec![0u32; words];
            for (i, _) in allowed.iter().enumerate().filter(|(_, &a)| a) {
                mask[i / 32] |= 1 << (i % 32);
            }
            for top in [1, 5, 64] {
                let got = host::topk_masked(&k, &x, top, &mask).unwrap();
                let want: Vec<(u32, f32)> = sorted_desc(&x)
                    .into_iter()
                    .filter(|&i| allowed[i as usize])
                    .take(top)
                    .map(|i| (i, x[i as usize]))
                    .collect();
                assert_eq!(got, want, "top-{top} of {n}");
            }
        }
    }
}

#[test]
fn stories260k_picks_on_the_gpu() {
    let Some(ctx) = context() else { return };
    let Some(path) = stories_path("stories260K-f32.gguf") else { return };
    let cpu = CpuModel::new(Model::open(&path).unwrap());
    let gpu = gpu_model(&ctx, Model::open(&path).unwrap(), GpuOptions::f32());
    let bos = cpu.bos_token().unwrap_or(1);
    let (mut cs, mut gs) = (cpu.new_state(), gpu.new_state());
    let mut tok = bos;
    let mut worst_p = 0f64;
    for step in 0..64 {
        // The same step three ways on forks of the state: full logits, top-k, greedy.
        let mut g_full = gs.clone();
        let mut g_top = gs.clone();
        let logits = gpu.forward(&mut g_full, &[tok], false).unwrap();
        let top = block_on(gpu.forward_topk_async(&mut g_top, &[tok], 40)).unwrap();
        let greedy = block_on(gpu.forward_greedy_async(&mut gs, &[tok])).unwrap();
        assert_eq!(gpu.stats().readback_bytes_last, 4, "greedy reads back one id");
        assert_eq!(gpu.position(&gs), gpu.position(&g_top));
        // Against the GPU's own logits of the same step: the same computation, so exact.
        let order = sorted_desc(&logits);
        assert_eq!(top.ids, order[..40].to_vec(), "step {step}: top-k ids");
        let want_logits: Vec<f32> = order[..40].iter().map(|&i| logits[i as usize]).collect();
        assert_eq!(top.logits, want_logits, "step {step}: top-k logits");
        let lse = logsumexp(&logits);
        assert!(
            (top.logsumexp - lse).abs() < 1e-4,
            "step {step}: logsumexp {} vs {lse}",
            top.logsumexp
        );
        assert_eq!(greedy, order[0], "step {step}: greedy id");
        // Against the CPU: probabilities of the top-k under the full softmax.
        let mut probs = cpu.forward(&mut cs, &[tok], false).unwrap();
        let cpu_next = argmax(&probs);
        softmax_in_place(&mut probs);
        for (&id, &l) in top.ids.iter().zip(&top.logits) {
            let p = (l as f64 - top.logsumexp).exp();
            worst_p = worst_p.max((p - probs[id as usize] as f64).abs());
        }
        assert_eq!(greedy, cpu_next, "step {step}: greedy token differs from the CPU's");
        tok = greedy;
    }
    assert!(worst_p < 1e-4, "top-k probabilities differ from the CPU softmax by {worst_p}");

    // The whole greedy decode again, chained on the GPU in one submission: the same tokens.
    let mut st = gpu.new_state();
    let mut cs = cpu.new_state();
    let chain = block_on(gpu.forward_greedy_chain_async(&mut st, &[bos], 64)).unwrap();
    assert_eq!(gpu.stats().readback_bytes_last, 64 * 4);
    assert_eq!(gpu.position(&st), 64);
    let mut tok = bos;
    for (step, &got) in chain.iter().enumerate() {
        tok = argmax(&cpu.forward(&mut cs, &[tok], false).unwrap());
        assert_eq!(got, tok, "chained greedy step {step}");
    }
    // The state continues from there like any other.
    let next = block_on(gpu.forward_greedy_async(&mut st, &[chain[63]])).unwrap();
    assert_eq!(next, argmax(&cpu.forward(&mut cs, &[tok], false).unwrap()));
    // A chain from a longer prompt, from the middle of a sequence.
    let mut a = gpu.new_state();
    let mut b = gpu.new_state();
    let c1 = block_on(gpu.forward_greedy_chain_async(&mut a, &[bos, 300, 301], 5)).unwrap();
    let mut t = block_on(gpu.forward_greedy_async(&mut b, &[bos, 300, 301])).unwrap();
    let mut singles = vec![t];
    for _ in 1..5 {
        t = block_on(gpu.forward_greedy_async(&mut b, &[t])).unwrap();
        singles.push(t);
    }
    assert_eq!(c1, singles);
    assert!(block_on(gpu.forward_greedy_chain_async(&mut a, &[1], 10_000)).is_err());
    eprintln!("stories260K picks: 64 greedy steps match the CPU; top-40 probabilities within {worst_p:.2e}");
}

/// Beam search and scoring on the GPU model compute on the GPU (beam steps read back only the
/// top few) and agree with the CPU oracle: same beams, log P within the f32 summation-order noise.
#[test]
fn beam_search_and_scoring_run_on_the_gpu() {
    let Some(ctx) = context() else { return };
    let Some(path) = stories_path("stories260K-f32.gguf") else { return };
    let cpu = CpuModel::new(Model::open(&path).unwrap());
    let gpu = gpu_model(&ctx, Model::open(&path).unwrap(), GpuOptions::f32());
    let prompt = [1, 400, 20];
    let opts = BeamOptions { beams: 3, max_tokens: 12, length_normalise: false };
    let on_cpu = beam_search(&cpu, &prompt, opts).unwrap();
    let on_gpu = beam_search(&gpu, &prompt, opts).unwrap();
    let stats = gpu.stats();
    // The top 5 (3 beams, and the 5 alternatives each beam token shows) and the log-sum-exp.
    assert_eq!(stats.readback_bytes_last, (2 + 2 * 5) * 4, "a beam step reads back 5 picks");
    assert_eq!(on_gpu.len(), on_cpu.len());
    for (g, c) in on_gpu.iter().zip(&on_cpu) {
        assert_eq!(g.ids, c.ids, "beams differ");
        assert!((g.logprob - c.logprob).abs() < 1e-3, "log P {} vs {}", g.logprob, c.logprob);
    }
    let text: Vec<u32> = prompt.iter().copied().chain(on_cpu[0].ids.iter().copied()).collect();
    let (sg, sc) = (score(&gpu, &text).unwrap(), score(&cpu, &text).unwrap());
    for (g, c) in sg.token_logprobs.iter().zip(&sc.token_logprobs) {
        assert!((g - c).abs() < 1e-3, "token log P {g} vs {c}");
    }
    eprintln!(
        "beam search on the GPU: best log P {:.5} (CPU {:.5}); score {:.5} (CPU {:.5})",
        on_gpu[0].logprob, on_cpu[0].logprob, sg.total_logprob, sc.total_logprob
    );
}

#[test]
fn decode_steps_create_no_buffers_or_bind_groups() {
    if context().is_none() {
        return;
    }
    let Some(path) = stories_path("stories260K-f32.gguf") else { return };
    // A device of its own: the buffer counter is per device and other tests run in parallel.
    let ctx = GpuContext::new().unwrap();
    for opts in [GpuOptions::f32(), GpuOptions::auto(&ctx)] {
        let gpu = gpu_model(&ctx, Model::open(&path).unwrap(), opts);
        let mut st = gpu.new_state();
        let mut tok = block_on(gpu.forward_greedy_async(&mut st, &[1, 400, 20])).unwrap();
        // Warm up each kind of step once.
        let logits = gpu.forward(&mut st, &[tok], false).unwrap();
        let full = gpu.stats();
        tok = argmax(&logits);
        block_on(gpu.forward_topk_async(&mut st, &[tok], 64)).unwrap();
        let topk = gpu.stats();
        tok = block_on(gpu.forward_greedy_async(&mut st, &[tok])).unwrap();
        let before = gpu.stats();
        for i in 0..40 {
            tok = match i % 3 {
                0 => block_on(gpu.forward_greedy_async(&mut st, &[tok])).unwrap(),
                1 => block_on(gpu.forward_topk_async(&mut st, &[tok], 64)).unwrap().ids[0],
                _ => argmax(&gpu.forward(&mut st, &[tok], false).unwrap()),
            };
        }
        tok = block_on(gpu.forward_greedy_async(&mut st, &[tok])).unwrap();
        let after = gpu.stats();
        assert!(tok < 512);
        assert_eq!(after.buffers_created, before.buffers_created, "buffers created during decode");
        assert_eq!(
            after.bind_groups_created, before.bind_groups_created,
            "bind groups created during decode"
        );
        assert_eq!(
            after.param_bytes_written, before.param_bytes_written,
            "parameters re-uploaded during decode"
        );
        assert_eq!(after.submissions_last, 1);
        assert_eq!(after.dispatches_last, before.dispatches_last);
        eprintln!(
            "stories260K decode step ({opts:?}): {} dispatches, 1 submission; read back {} bytes (full logits), \
             {} (top-64), {} (greedy); GPU memory {} bytes for the model + {} per state; {} bind groups",
            full.dispatches_last,
            full.readback_bytes_last,
            topk.readback_bytes_last,
            after.readback_bytes_last,
            after.model_bytes,
            after.kv_bytes_per_state,
            after.bind_groups_created,
        );
    }
}

/// The f16 path (`GpuOptions::f16()`: the KV cache, and prefill's tiles, which a one-token prompt
/// does not use): keys and values rounded to f16, so a looser tolerance: 5e-2 on logits (measured
/// on lavapipe: about 2e-2 by the end of 64 steps of stories260K, 1e-3 to 1e-2 on the synthetic
/// models), and the greedy tokens still identical over 64 steps of stories260K.
#[test]
fn f16_kv_cache_stories260k() {
    let Some(ctx) = context() else { return };
    if !ctx.shader_f16 {
        eprintln!("SKIPPED f16 KV cache: the device has no shader-f16");
        return;
    }
    let opts = GpuOptions::f16();
    stories_with("stories260K-f32.gguf", 5e-2, opts, 64);
    stories_with("stories260K-q8_0.gguf", 5e-2, opts, 64);
}

/// The f16 path (KV cache and prefill products) on each architecture: a short prompt (the
/// decode kernels) and one long enough for the tiled products, then greedy decoding.
#[test]
fn f16_kv_cache_and_prefill_synthetic_models() {
    let Some(ctx) = context() else { return };
    if !ctx.shader_f16 {
        eprintln!("SKIPPED the f16 path: the device has no shader-f16");
        return;
    }
    let long: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 300).collect();
    let mut report = Vec::new();
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Gpt2] {
        let ty = GgmlType::Q8_0;
        let cpu = CpuModel::new(synth_model(arch, ty, 40, false));
        let gpu = gpu_model(&ctx, synth_model(arch, ty, 40, false), GpuOptions::f16());
        for prompt in [&[1, 17, 299, 42, 5][..], &long] {
            let name = format!("f16 {} prompt of {}", arch.gguf_name(), prompt.len());
            let worst = compare_decode(&name, &cpu, &gpu, prompt, 12, 5e-2);
            report.push(format!("{name}: {worst:.2e}"));
        }
        // Forks copy the f16 cache.
        let mut st = gpu.new_state();
        gpu.forward(&mut st, &[1, 2, 3], false).unwrap();
        let mut fork = st.clone();
        assert_eq!(
            gpu.forward(&mut st, &[7], false).unwrap(),
            gpu.forward(&mut fork, &[7], false).unwrap()
        );
    }
    eprintln!("largest logit error of the f16 path: {}", report.join(", "));
}

#[test]
fn lost_device_gives_a_clear_error_and_the_cpu_continues() {
    if context().is_none() {
        return;
    }
    let Some(path) = stories_path("stories260K-f32.gguf") else { return };
    let ctx = GpuContext::new().unwrap();
    let gpu = gpu_model(&ctx, Model::open(&path).unwrap(), GpuOptions::f32());
    let cpu = CpuModel::new(Model::open(&path).unwrap());
    let mut st = gpu.new_state();
    let first = block_on(gpu.forward_greedy_async(&mut st, &[1])).unwrap();
    ctx.simulate_device_loss();
    for e in [
        gpu.forward(&mut st, &[first], false).unwrap_err(),
        block_on(gpu.forward_greedy_async(&mut st, &[first])).unwrap_err(),
        pollster::block_on(GpuModel::with_context(ctx.clone(), Model::open(&path).unwrap()))
            .err()
            .unwrap(),
    ] {
        assert!(is_device_lost(&e), "not a lost-device error: {e}");
        assert!(e.to_string().contains("GPU device lost"), "{e}");
    }
    assert_eq!(gpu.position(&st), 1, "a failed step leaves the state as it was");
    // The caller continues on the CPU.
    let mut cs = cpu.new_state();
    let logits = cpu.forward(&mut cs, &[1], false).unwrap();
    assert_eq!(argmax(&logits), first);
}

/// Q4_K_M-style files keep some of q, k, v (and gate, up) in another type: the GPU then packs
/// only the runs of one type (q|k and v apart; gate and up apart) and must still match the CPU.
#[test]
fn mixed_weight_types_pack_what_they_can() {
    let Some(ctx) = context() else { return };
    use nexttoken::tensor_names::{self as names, block};
    for arch in [Arch::Llama, Arch::Qwen2] {
        let spec = Spec {
            n_head_kv: 2,
            weight_type: GgmlType::Q8_0,
            type_overrides: vec![
                (block(0, names::ATTN_V), GgmlType::F16),
                (block(1, names::ATTN_Q), GgmlType::Q4_0),
                (block(0, names::FFN_UP), GgmlType::F32),
                // What Q4_K_M files hold for rows that are not whole super-blocks of 256.
                (block(1, names::ATTN_K), GgmlType::Q5_0),
                (block(1, names::FFN_GATE), GgmlType::Q5_0),
                // And Q5_K_M files.
                (block(1, names::ATTN_V), GgmlType::Q5_1),
                (block(0, names::FFN_DOWN), GgmlType::Q5_1),
            ],
            seed: 77,
            ..Spec::new(arch, 300, 96, 2, 4, 160, 160)
        };
        let bytes = synthetic::write(&spec).unwrap();
        let cpu = CpuModel::new(Model::from_bytes(bytes.clone()).unwrap());
        let gpu = gpu_model(&ctx, Model::from_bytes(bytes).unwrap(), GpuOptions::f32());
        let name = format!("mixed types {}", arch.gguf_name());
        compare_decode(&name, &cpu, &gpu, &[1, 17, 299, 42, 5, 6, 7, 8, 9, 10, 11], 6, 1e-3);
    }
}

/// A decode step costs at most 8 dispatches per layer + 6 on every architecture (issue 11's
/// budget; today 6 per layer + 2, + 2 for the top-k pick), however long the context.
#[test]
fn decode_dispatches_stay_within_budget() {
    let Some(ctx) = context() else { return };
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Gpt2] {
        let layers = 2;
        let gpu = gpu_model(&ctx, synth_model(arch, GgmlType::Q8_0, 5, false), GpuOptions::f32());
        let mut st = gpu.new_state();
        let prompt: Vec<u32> = (1..100).collect();
        gpu.forward(&mut st, &prompt, false).unwrap();
        let mut tok = block_on(gpu.forward_greedy_async(&mut st, &[3])).unwrap();
        let greedy = gpu.stats().dispatches_last;
        tok = argmax(&gpu.forward(&mut st, &[tok], false).unwrap());
        let logits = gpu.stats().dispatches_last;
        block_on(gpu.forward_topk_async(&mut st, &[tok], 8)).unwrap();
        let topk = gpu.stats().dispatches_last;
        let budget = 8 * layers + 6;
        eprintln!(
            "{}: {logits} dispatches per decode step (logits), {greedy} (greedy), {topk} (top-k); budget {budget}",
            arch.gguf_name()
        );
        assert!(greedy <= budget && logits <= budget && topk <= budget, "{}", arch.gguf_name());
    }
}

/// A prefill pass records 9 dispatches per layer on an RMSNorm model (the norms folded into the
/// products, the residual adds into their epilogue, attention in one pass: see ARCHITECTURE.md,
/// "The prefill plan"), 11 where the norm is a LayerNorm (its own kernel, twice), plus the
/// embedding (GPT-2: and the learned positions) and the last token's logits.
#[test]
fn prefill_dispatches_per_layer() {
    let Some(ctx) = context() else { return };
    for (arch, per_layer, extra) in [(Arch::Llama, 9, 2), (Arch::Qwen2, 9, 2), (Arch::Gpt2, 11, 3)]
    {
        let layers = 2;
        let gpu = gpu_model(&ctx, synth_model(arch, GgmlType::Q8_0, 5, false), GpuOptions::f32());
        let mut st = gpu.new_state();
        let prompt: Vec<u32> = (1..100).collect();
        gpu.forward(&mut st, &prompt, false).unwrap();
        let got = gpu.stats().dispatches_last;
        eprintln!("{}: {got} dispatches for a 99-token prefill", arch.gguf_name());
        assert_eq!(got, per_layer * layers + extra, "{}", arch.gguf_name());
    }
}

/// Each kernel's Rust parameter struct has its WGSL `struct Params`'s fields, in order, with the
/// same scalar types (so the words land where the shader reads them).
#[test]
fn kernel_parameter_structs_match_their_shaders() {
    use nexttoken::gpu::dispatch::*;
    let structs: &[(&str, &[(&str, &str)])] = &[
        (MatvecParams::SHADER, MatvecParams::FIELDS),
        (TiledParams::SHADER, TiledParams::FIELDS),
        (AttentionParams::SHADER, AttentionParams::FIELDS),
        (AttentionPrefillParams::SHADER, AttentionPrefillParams::FIELDS),
        (MergeParams::SHADER, MergeParams::FIELDS),
        (EmbeddingParams::SHADER, EmbeddingParams::FIELDS),
        (RopeParams::SHADER, RopeParams::FIELDS),
        (NormParams::SHADER, NormParams::FIELDS),
        ("layer_norm.wgsl", NormParams::FIELDS),
        (SiluMulParams::SHADER, SiluMulParams::FIELDS),
        (ElementwiseParams::SHADER, ElementwiseParams::FIELDS),
        ("gelu.wgsl", ElementwiseParams::FIELDS),
        (TopkPartialParams::SHADER, TopkPartialParams::FIELDS),
        (TopkMergeParams::SHADER, TopkMergeParams::FIELDS),
        (ReadParams::SHADER, ReadParams::FIELDS),
    ];
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|f| std::fs::read_to_string(dir.join(f)).unwrap().contains("struct Params"))
        .collect();
    files.sort();
    let mut covered: Vec<&str> = structs.iter().map(|s| s.0).collect();
    covered.sort();
    assert_eq!(files, covered, "every shader with Params has a Rust struct");
    for (file, fields) in structs {
        let src = std::fs::read_to_string(dir.join(file)).unwrap();
        let body = src.split("struct Params {").nth(1).unwrap().split('}').next().unwrap();
        let wgsl: Vec<(String, String)> = body
            .lines()
            .map(|l| l.split("//").next().unwrap().trim().trim_end_matches(','))
            .filter(|l| !l.is_empty())
            .map(|l| {
                let (name, ty) = l.split_once(':').unwrap();
                (name.trim().to_string(), ty.trim().to_string())
            })
            .collect();
        let rust: Vec<(String, String)> =
            fields.iter().map(|(n, t)| (n.to_string(), t.to_string())).collect();
        assert_eq!(wgsl, rust, "{file}");
    }
}

/// The per-kernel profile times every dispatch of a decode step (on adapters with timestamp
/// queries), labels the fused products by what they fuse, counts the weight bytes they read
/// (every matrix once: the weights' own size), and leaves the state as an ordinary step does.
#[test]
fn profile_times_every_dispatch_of_a_step() {
    let Some(ctx) = context() else { return };
    let model = synth_model(Arch::Llama, GgmlType::Q8_0, 9, false);
    let weight_bytes = model.weight_bytes_per_token() - model.weights.token_embd.row_bytes();
    let norms: usize = model.weights.output_norm.weight.size_bytes
        + model
            .weights
            .layers
            .iter()
            .map(|l| l.attn_norm.weight.size_bytes + l.ffn_norm.weight.size_bytes)
            .sum::<usize>();
    let gpu = gpu_model(&ctx, model, GpuOptions::f32());
    let mut st = gpu.new_state();
    gpu.forward(&mut st, &[1, 2, 3], false).unwrap();
    let mut plain = st.clone();
    gpu.forward(&mut plain, &[4], false).unwrap();
    let Some(times) = block_on(gpu.profile_async(&mut st, &[4])).unwrap() else {
        eprintln!("SKIPPED profile: the adapter has no timestamp queries");
        return;
    };
    assert_eq!(times.len(), gpu.stats().dispatches_last);
    assert!(times.iter().all(|t| t.micros >= 0.0));
    let labels: Vec<&str> = times.iter().map(|t| t.label).collect();
    assert_eq!(labels.iter().filter(|l| **l == "matvec q|k|v rope kv").count(), 2);
    assert_eq!(labels.iter().filter(|l| **l == "matvec gate|up silu").count(), 2);
    assert_eq!(labels.iter().filter(|l| **l == "attention chunks").count(), 2);
    // The products read every weight matrix once (norms are folded in, read as vectors).
    let read: u64 = times.iter().map(|t| t.bytes).sum();
    assert_eq!(read as usize, weight_bytes - norms, "{labels:?}");
    assert_eq!(gpu.position(&st), 4);
    let after = gpu.forward(&mut st, &[5], false).unwrap();
    let again = gpu.forward(&mut plain, &[5], false).unwrap();
    assert_eq!(after, again, "a profiled step leaves the state as a plain one does");

    // Per family (what bench --profile and the browser bench page show): every dispatch of the
    // same step counted once, under the label it ran with, and the same weight bytes.
    let families =
        block_on(gpu.profile_after_async(&[1, 2, 3, 4], 3)).unwrap().expect("timestamps");
    let count = |label: &str| labels.iter().filter(|l| **l == label).count();
    assert_eq!(families.iter().map(|f| f.dispatches).sum::<usize>(), times.len());
    for f in &families {
        assert_eq!(f.dispatches, count(f.kernel), "{}", f.kernel);
    }
    assert_eq!(families.iter().map(|f| f.bytes).sum::<u64>(), read);
    assert_eq!(families[0].kernel, labels[0], "in the order they first run");
}

/// A greedy (or top-k) generation on the GPU ranks on the device: each step reads back the top
/// picks, not the logits row, and the tokens and probabilities are the CPU's.
#[test]
fn greedy_generation_reads_back_only_the_picks() {
    let Some(ctx) = context() else { return };
    use nexttoken::generate::{GenerateOptions, Generation};
    use nexttoken::sampling::SamplerConfig;
    let cpu = CpuModel::new(synth_model(Arch::Qwen2, GgmlType::Q8_0, 21, false));
    let gpu =
        gpu_model(&ctx, synth_model(Arch::Qwen2, GgmlType::Q8_0, 21, false), GpuOptions::f32());
    /// Token i reads " i": enough to drive a model by ids.
    struct Ids;
    impl nexttoken::Vocab for Ids {
        fn encode(&self, text: &str) -> nexttoken::Result<Vec<u32>> {
            Ok(text.split_whitespace().filter_map(|w| w.parse().ok()).collect())
        }
        fn decode(&self, ids: &[u32]) -> String {
            ids.iter().map(|i| format!(" {i}")).collect()
        }
        fn token_text(&self, id: u32) -> String {
            self.decode(&[id])
        }
    }
    let vocab = Ids;
    for sampler in [
        SamplerConfig::greedy(),
        SamplerConfig { top_k: 8, temperature: 0.8, seed: 3, ..SamplerConfig::default() },
    ] {
        let opts = GenerateOptions {
            max_tokens: 10,
            sampler: sampler.clone(),
            stop_at_eos: false,
            ..GenerateOptions::default()
        };
        let prompt = [1, 17, 299, 42];
        let mut on_cpu = Generation::new(&cpu, &vocab, &prompt, opts.clone()).unwrap();
        let mut on_gpu = Generation::new(&gpu, &vocab, &prompt, opts).unwrap();
        while let (Some(a), Some(b)) = (on_cpu.step().unwrap(), on_gpu.step().unwrap()) {
            assert_eq!(a.id, b.id, "{sampler:?}");
            assert!((a.prob - b.prob).abs() < 1e-3, "{} vs {}", a.prob, b.prob);
            assert!(gpu.stats().readback_bytes_last <= (2 + 2 * 64) * 4);
        }
        assert_eq!(on_cpu.generated_ids().len(), 10);
        assert_eq!(on_cpu.generated_ids(), on_gpu.generated_ids());
    }
}

// ---------------------------------------------------------------------------------------------
// Streamed loading (the browser's download straight into GPU buffers)

/// `bytes` fed to a `GpuStream` in the pieces `cuts` makes (the offsets where a piece ends).
fn stream_in_pieces(
    ctx: &Arc<GpuContext>,
    bytes: &[u8],
    cuts: &[usize],
    opts: GpuOptions,
) -> nexttoken::Result<GpuModel> {
    let mut stream = GpuStream::new(ctx.clone(), opts, bytes.len())?;
    let mut headers = 0;
    let mut at = 0;
    for &cut in cuts.iter().chain([&bytes.len()]) {
        let cut = cut.clamp(at, bytes.len());
        if let Some(header) = stream.push(&bytes[at..cut])? {
            headers += 1;
            assert_eq!(header.tensors.len(), Gguf::parse(bytes).unwrap().tensors.len());
            // The header ends with the tensor infos; the padding after them (to the 32-byte
            // alignment) is not needed.
            assert!(
                cut + 32 > header.data_offset,
                "the header was complete before its end arrived"
            );
        }
        at = cut;
    }
    assert_eq!(headers, 1, "the header is handed over once");
    assert_eq!(stream.received(), bytes.len());
    pollster::block_on(stream.finish())
}

/// A model whose tensors end inside a GPU word: Q8_0 rows of 102 bytes, an odd number of rows
/// (301 embeddings, 161 gate and up rows: up starts 2 bytes into a word of the packed gate|up),
/// mixed types in q|k|v, F32 down projections of 161 columns, and Llama 3's RoPE factors.
fn awkward_model_bytes() -> Vec<u8> {
    use nexttoken::tensor_names::{self as names, block};
    let mut overrides = vec![(block(0, names::ATTN_V), GgmlType::F16)];
    for i in 0..2 {
        overrides.push((block(i, names::FFN_DOWN), GgmlType::F32));
    }
    let spec = Spec {
        n_head_kv: 2,
        weight_type: GgmlType::Q8_0,
        type_overrides: overrides,
        rope_freqs: Some((0..12).map(|i| 1.0 + i as f32 * 0.75).collect()),
        seed: 31,
        ..Spec::new(Arch::Llama, 301, 96, 2, 4, 161, 160)
    };
    synthetic::write(&spec).unwrap()
}

/// The streamed loader fed in odd pieces (1 byte, 7 bytes, pieces that end just inside or
/// just past each tensor's start, random sizes, everything at once) holds on the GPU exactly the
/// file's bytes of every tensor, the same vectors as the ordinary upload, and gives the same
/// logits as that upload and the CPU.
#[test]
fn streamed_load_in_odd_pieces_equals_the_upload() {
    let Some(ctx) = context() else { return };
    let synth = |arch, ty, tied| {
        let spec =
            Spec { tied, weight_type: ty, seed: 5, ..Spec::new(arch, 300, 96, 2, 4, 160, 64) };
        synthetic::write(&spec).unwrap()
    };
    let models = [
        ("awkward llama", awkward_model_bytes()),
        ("gpt2 q4_0 tied", synth(Arch::Gpt2, GgmlType::Q4_0, true)),
        ("qwen2 f16", synth(Arch::Qwen2, GgmlType::F16, false)),
    ];
    let prompt = [1, 17, 299, 42, 5];
    for (name, bytes) in &models {
        let header = Gguf::parse(bytes).unwrap();
        let cpu = CpuModel::new(Model::from_bytes(bytes.clone()).unwrap());
        let uploaded =
            gpu_model(&ctx, Model::from_bytes(bytes.clone()).unwrap(), GpuOptions::f32());
        let (want_weights, want_vectors) = pollster::block_on(uploaded.read_weights()).unwrap();
        // The upload holds the file's bytes (an independent check of the plan's placements).
        let reference = Model::from_bytes(bytes.clone()).unwrap();
        let file = reference.weights.try_map(|t| Ok(reference.bytes(t).to_vec())).unwrap();
        assert!(want_weights == file, "{name}: the uploaded weights differ from the file's bytes");
        let want_logits = uploaded.forward(&mut uploaded.new_state(), &prompt, true).unwrap();
        let cpu_logits = cpu.forward(&mut cpu.new_state(), &prompt, true).unwrap();
        check_abs(&format!("{name}: upload vs CPU"), &want_logits, &cpu_logits, 1e-3);

        let mut rng = Rng(0x5eed ^ bytes.len() as u64);
        let mut random = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            at += 1 + rng.below(3000);
            random.push(at);
        }
        // Each tensor's start straddled: a piece ends 3 bytes into it, the next 1 byte before
        // the following tensor.
        let straddle: Vec<usize> = header
            .tensors
            .iter()
            .flat_map(|t| [t.offset + 3.min(t.size_bytes - 1), t.offset + t.size_bytes - 1])
            .chain([header.data_offset - 1, header.data_offset + 1])
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        let every = |n: usize| (1..bytes.len().div_ceil(n)).map(|i| i * n).collect::<Vec<_>>();
        let small = bytes.len() < 400_000;
        let mut cuts = vec![("7-byte", every(7)), ("straddling", straddle), ("random", random)];
        cuts.push(("whole", Vec::new()));
        if small {
            cuts.push(("1-byte", every(1)));
        }
        let ways = cuts.len();
        for (how, cuts) in cuts {
            let gpu = stream_in_pieces(&ctx, bytes, &cuts, GpuOptions::f32())
                .unwrap_or_else(|e| panic!("{name}, {how} pieces: {e}"));
            let (weights, vectors) = pollster::block_on(gpu.read_weights()).unwrap();
            assert!(
                weights == want_weights,
                "{name}, {how} pieces: weights differ from the upload"
            );
            assert!(
                vectors == want_vectors,
                "{name}, {how} pieces: vectors differ from the upload"
            );
            assert_eq!(gpu.model.held_bytes(), 0, "{name}: the streamed model holds bytes");
            assert_eq!(gpu.model.file_len(), bytes.len());
            assert_eq!(gpu.model.rope.inv_freq, uploaded.model.rope.inv_freq, "{name}: RoPE");
            let logits = gpu.forward(&mut gpu.new_state(), &prompt, true).unwrap();
            assert!(logits == want_logits, "{name}, {how} pieces: logits differ from the upload's");
        }
        eprintln!("{name}: {} bytes streamed in {ways} ways, same weights and logits", bytes.len());
    }
    // The ordinary upload releases the file's bytes once they are on the GPU.
    let m = Model::from_bytes(models[0].1.clone()).unwrap();
    assert_eq!(m.held_bytes(), models[0].1.len());
    let uploaded = gpu_model(&ctx, m, GpuOptions::f32());
    assert_eq!((uploaded.model.held_bytes(), uploaded.model.file_len()), (0, models[0].1.len()));
}

/// A stream that stops early, or is not a model, gives an error naming the problem (never a
/// hang or a model with missing weights).
#[test]
fn streamed_load_of_a_broken_file_says_what_is_wrong() {
    let Some(ctx) = context() else { return };
    let bytes = awkward_model_bytes();
    let header = Gguf::parse(&bytes).unwrap();
    let last = header.tensors.iter().max_by_key(|t| t.offset).unwrap().clone();
    let feed = |data: &[u8], len: usize| -> String {
        let mut stream = GpuStream::new(ctx.clone(), GpuOptions::f32(), len).unwrap();
        let mut result = Ok(None);
        for piece in data.chunks(4096) {
            result = stream.push(piece);
            if result.is_err() {
                break;
            }
        }
        match result {
            Err(e) => e.to_string(),
            Ok(_) => match pollster::block_on(stream.finish()) {
                Err(e) => e.to_string(),
                Ok(_) => "loaded".into(),
            },
        }
    };
    let cases: Vec<(&str, String, &str)> = vec![
        // The download stopped inside the header, inside the last tensor, after it.
        ("ends in the header", feed(&bytes[..100], bytes.len()), "before its header was complete"),
        (
            "ends in a tensor",
            feed(&bytes[..last.offset + 5], bytes.len()),
            "inside or before tensor",
        ),
        (
            "ends in the padding",
            feed(&bytes[..bytes.len() - 1], bytes.len()),
            if last.offset + last.size_bytes < bytes.len() {
                "after its last tensor"
            } else {
                "inside or before tensor"
            },
        ),
        // A file whose header says its tensors run past the length the server announced.
        (
            "shorter than its header says",
            feed(&bytes[..bytes.len() / 2], bytes.len() / 2),
            "past the end of the file",
        ),
        ("not a GGUF", feed(b"<!doctype html><html>not found</html>", 37), "HTML"),
        ("more than announced", feed(&bytes, bytes.len() - 10), "more than the"),
    ];
    for (what, got, want) in cases {
        assert!(got.contains(want), "{what}: {got:?} does not say {want:?}");
        eprintln!("{what}: {got}");
    }
    assert_eq!(feed(&bytes, bytes.len()), "loaded");
    assert!(GpuStream::new(ctx.clone(), GpuOptions::f32(), 0).is_err(), "an empty file");
}

/// The load-time check (`gpu::check`) passes on a working GPU for every architecture, the f32
/// and the f16 paths, mixed weight types (a Q4_K_M-like file) and a real model, and reports
/// what it compared.
#[test]
fn load_check_agrees_with_the_cpu_on_a_working_gpu() {
    let Some(ctx) = context() else { return };
    let mut options = vec![GpuOptions::f32()];
    if ctx.shader_f16 {
        options.push(GpuOptions::f16());
    }
    let mixed = |arch| {
        let spec = Spec {
            n_head_kv: 2,
            weight_type: GgmlType::Q4_K,
            type_overrides: vec![
                ("blk.0.ffn_down.weight".into(), GgmlType::Q6_K),
                ("output.weight".into(), GgmlType::Q8_0),
            ],
            ..Spec::new(arch, 300, 256, 2, 4, 512, 160)
        };
        Model::from_bytes(synthetic::write(&spec).unwrap()).unwrap()
    };
    for opts in options {
        for arch in [Arch::Llama, Arch::Qwen2, Arch::Gpt2] {
            let gpu = gpu_model(&ctx, mixed(arch), opts);
            let checked = pollster::block_on(gpu.check_against_cpu()).unwrap();
            eprintln!("{} {opts:?}: {checked:?}", arch.gguf_name());
            assert!(checked.max_error <= checked.tolerance && checked.rows == 18);
        }
    }
    let Some(path) = stories_path("stories260K-q8_0.gguf") else { return };
    let gpu = gpu_model(&ctx, Model::open(&path).unwrap(), GpuOptions::f32());
    let checked = pollster::block_on(gpu.check_against_cpu()).unwrap();
    assert!(checked.max_error < 1e-3, "{checked:?}");
}

/// `auto`'s verdict: the check, both backends timed on the model, the faster one named with its
/// numbers; the reason says which and how fast.
#[test]
fn auto_verdict_times_both_backends() {
    let Some(ctx) = context() else { return };
    let model = synth_model(Arch::Llama, GgmlType::Q8_0, 3, false);
    let cpu = CpuModel::new(model.share());
    let gpu = gpu_model(&ctx, model, GpuOptions::f32());
    let cpu_ms = || Ok((nexttoken::backend::cpu_decode_ms(&cpu)?, false));
    let v = pollster::block_on(nexttoken::backend::verdict(&gpu, cpu_ms)).unwrap();
    eprintln!("{v:?}");
    assert!(v.gpu_ms_per_token > 0.0 && v.cpu_ms_per_token > 0.0);
    assert_eq!(v.gpu, v.gpu_ms_per_token <= v.cpu_ms_per_token);
    let runs = if v.gpu { "the GPU runs it" } else { "the CPU path runs it" };
    assert!(v.reason.starts_with("auto: ") && v.reason.ends_with(runs), "{}", v.reason);
    // The browser's estimate: the model's bytes per token over a measured rate.
    let rate = nexttoken::backend::cpu_decode_rate(&gpu.model, Precision::Fast, 1).unwrap();
    assert!(rate > 1e6, "{rate} bytes/s");
}

/// Speculative decoding on the GPU: a verification pass (up to 8 tokens: the decode plan's
/// matrix-vector products with several tokens) gives the same greedy tokens as one-token steps,
/// whatever the guesses, and the CPU's greedy tokens.
#[test]
fn speculative_greedy_is_plain_greedy() {
    use nexttoken::generate::{DraftSource, GenerateOptions, Generation, SpeculativeOptions};
    use nexttoken::lm::IdsOnly;
    use nexttoken::sampling::SamplerConfig;
    let Some(ctx) = context() else { return };
    let mut models = Vec::new();
    for (arch, ty) in
        [(Arch::Llama, GgmlType::Q8_0), (Arch::Qwen2, GgmlType::Q4_0), (Arch::Gpt2, GgmlType::F16)]
    {
        let name = format!("{} {}", arch.gguf_name(), ty.name());
        models.push((name, synth_model(arch, ty, 7, false), synth_model(arch, ty, 7, false)));
    }
    if let Some(path) = stories_path("stories260K-q8_0.gguf") {
        models.push((
            "stories260K q8_0".into(),
            Model::open(&path).unwrap(),
            Model::open(&path).unwrap(),
        ));
    }
    for (name, for_cpu, for_gpu) in models {
        let cpu = CpuModel::new(for_cpu);
        // All-f32, so the GPU's greedy tokens can be the CPU's too.
        let gpu = gpu_model(&ctx, for_gpu, GpuOptions::f32());
        let prompt = [1, 17, 299, 42, 5];
        let plain = GenerateOptions {
            max_tokens: 40,
            sampler: SamplerConfig::greedy(),
            stop_at_eos: false,
            ..GenerateOptions::default()
        };
        let run = |opts: GenerateOptions| {
            let mut g = Generation::new(&gpu, &IdsOnly, &prompt, opts).unwrap();
            while g.step().unwrap().is_some() {}
            (g.generated_ids().to_vec(), g.speculation_stats().cloned())
        };
        let (want, _) = run(plain.clone());
        assert_eq!(want, common::greedy(&cpu, &prompt, 40), "{name}: GPU greedy is the CPU's");
        for (source, k) in [
            (DraftSource::Replay { tokens: want.clone(), wrong_every: 0 }, 4),
            (DraftSource::Replay { tokens: want.clone(), wrong_every: 2 }, 7),
            (DraftSource::lookup(), 4),
        ] {
            let spec = SpeculativeOptions { source: source.clone(), max_draft: k };
            let (got, stats) = run(GenerateOptions { speculative: Some(spec), ..plain.clone() });
            assert_eq!(got, want, "{name}: {source:?}, k = {k}");
            assert!(stats.unwrap().passes > 0, "{name}: {source:?} never verified a guess");
        }
    }
}
