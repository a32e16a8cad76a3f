//! The fast CPU path's kernels (`nexttoken::cpu::kernels`) against two references, on awkward
//! sizes, for every instruction set this machine has (scalar, AVX2, ...):
//!
//! 1. the scalar kernel (the oracle): same math, so only float summation order differs —
//!    tolerance `1e-5 * sum |w_i x_i|` (+1e-6 absolute);
//! 2. the f32 reference `dot(dequantize_row(w), x)` computed in f64: the kernels quantise the
//!    activations to Q8 blocks (x_i ~= d_b * q_i with |error| <= d_b / 2, d_b = max|x in block| / 127),
//!    so the bound is `sum |w_i| * d_b(i) / 2` plus the summation term above. Float rows (F32,
//!    F16, BF16) take f32 activations: only the summation term.
//!
//! Then whole models: the fast path against the exact one on stories260K (greedy 64 tokens equal,
//! logits within `FAST_LOGIT_TOLERANCE`) and on synthetic llama / qwen2 / gpt2 files, and the
//! quantisers `synth` uses against ggml's definitions.

mod common;

use common::SplitMix64;
use half::f16;
use nexttoken::cpu::kernels::{self, BlockQ8, Isa, KvRows, QK8};
use nexttoken::cpu::{CpuModel, Precision};
use nexttoken::model::Model;
use nexttoken::quant::{dequantize_row, quantize, GgmlType};
use nexttoken::sampling::argmax;
use nexttoken::LanguageModel;

/// Max abs logit difference, fast path vs exact, over 64 greedy steps on stories260K. q8_0 file:
/// Q8 activations (measured 0.26 on logits of magnitude ~10-20; the greedy tokens stay equal);
/// f32 file: f32 activations, only the summation order differs (measured 1.4e-5).
const FAST_LOGIT_TOLERANCE_Q8: f32 = 0.5;
const FAST_LOGIT_TOLERANCE_F32: f32 = 1e-3;

/// Normal-ish activations with a few outliers, as real hidden states have.
fn activations(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let v = rng.uniform(1.0) + rng.uniform(1.0) + rng.uniform(1.0);
            if i % 37 == 5 {
                v * 20.0
            } else {
                v
            }
        })
        .collect()
}

/// A random row of `ty` with `cols` elements, as bytes (the library's self-check makes them).
fn random_row(rng: &mut SplitMix64, ty: GgmlType, cols: usize) -> Vec<u8> {
    kernels::check::random_row(ty, cols, &mut || (rng.next_u64() >> 32) as u32)
}

/// `x` quantised as the fast path does for rows of `ty` (K-quants: one scale per 256).
fn quantized(ty: GgmlType, x: &[f32]) -> Vec<BlockQ8> {
    let mut q = vec![BlockQ8::default(); x.len() / QK8];
    kernels::quantize_activations_for(ty, x, &mut q);
    q
}

/// (reference dot in f64, sum |w x|, activation-quantisation error bound) for a row and the
/// activations `x`, which were quantised with the scales in `xq` (each |error| <= d / 2).
fn reference(ty: GgmlType, row: &[u8], x: &[f32], xq: &[BlockQ8]) -> (f64, f64, f64) {
    let mut w = vec![0f32; x.len()];
    dequantize_row(ty, row, &mut w);
    let dot: f64 = w.iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum();
    let mag: f64 = w.iter().zip(x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
    let mut bound = 0f64;
    for (wb, a) in w.chunks(QK8).zip(xq) {
        bound += wb.iter().map(|&v| v.abs() as f64).sum::<f64>() * a.d as f64 / 2.0;
    }
    (dot, mag, bound)
}

#[test]
fn quantised_dot_products_match_scalar_and_reference() {
    let mut rng = SplitMix64(42);
    let isas = Isa::available();
    eprintln!("instruction sets: {:?}", isas);
    for ty in GgmlType::QUANTISED {
        let sizes: &[usize] =
            if ty.block_size() == 256 { &[256, 512, 1280] } else { &[32, 64, 96, 224, 576, 1056] };
        for &cols in sizes {
            for _ in 0..20 {
                let row = random_row(&mut rng, ty, cols);
                let x = activations(&mut rng, cols);
                let xq = quantized(ty, &x);
                let oracle = kernels::scalar::dot_q8(ty, &row, &xq);
                let (want, mag, bound) = reference(ty, &row, &x, &xq);
                let sum_tol = 1e-5 * mag + 1e-6;
                assert!(
                    (oracle as f64 - want).abs() <= bound + sum_tol,
                    "{} cols {cols}: scalar {oracle} vs f32 reference {want} (bound {bound})",
                    ty.name()
                );
                for &isa in &isas {
                    let got = kernels::dot_q8(isa, ty, &row, &xq);
                    assert!(
                        ((got - oracle) as f64).abs() <= sum_tol,
                        "{} cols {cols} {}: {got} vs scalar {oracle}",
                        ty.name(),
                        isa.name()
                    );
                    assert!(
                        (got as f64 - want).abs() <= bound + sum_tol,
                        "{} {}: vs reference",
                        ty.name(),
                        isa.name()
                    );
                }
            }
        }
    }
}

/// The tiles (R rows x T activation vectors at once) against the scalar single-row kernel.
#[test]
fn tiles_match_single_row_dot_products() {
    let mut rng = SplitMix64(99);
    for ty in GgmlType::QUANTISED {
        let sizes: &[usize] =
            if ty.block_size() == 256 { &[256, 768] } else { &[32, 96, 576, 1056] };
        for &cols in sizes {
            let rows: Vec<Vec<u8>> = (0..4).map(|_| random_row(&mut rng, ty, cols)).collect();
            let acts: Vec<Vec<BlockQ8>> =
                (0..3).map(|_| quantized(ty, &activations(&mut rng, cols))).collect();
            let tile: [&[u8]; 4] = std::array::from_fn(|r| rows[r].as_slice());
            for isa in Isa::available() {
                let one = kernels::dot_q8_tile(isa, ty, tile, [acts[0].as_slice()]);
                let two =
                    kernels::dot_q8_tile(isa, ty, tile, [acts[1].as_slice(), acts[2].as_slice()]);
                for r in 0..4 {
                    // One row at a time, as decode goes on some hosts (kernels::decode_walk).
                    let single = kernels::dot_q8_tile(isa, ty, [tile[r]], [acts[0].as_slice()]);
                    for (t, got) in
                        [(0, one[r][0]), (1, two[r][0]), (2, two[r][1]), (0, single[0][0])]
                    {
                        let want = kernels::scalar::dot_q8(ty, &rows[r], &acts[t]);
                        let mut x = vec![0f32; cols];
                        for (xb, a) in x.chunks_mut(QK8).zip(&acts[t]) {
                            xb.iter_mut().zip(&a.qs).for_each(|(v, &q)| *v = a.d * q as f32);
                        }
                        let (_, mag, _) = reference(ty, &rows[r], &x, &acts[t]);
                        assert!(
                            ((got - want) as f64).abs() <= 1e-5 * mag + 1e-6,
                            "{} cols {cols} {} row {r} vector {t}: tile {got} vs scalar {want}",
                            ty.name(),
                            isa.name()
                        );
                    }
                }
            }
        }
    }
}

/// The panels' 16-bit partial sums at their largest: every weight at the top of its range and
/// every activation 127 (a kernel that summed a whole Q5_0 block in 16 bits would overflow here).
#[test]
fn panels_hold_the_largest_sums() {
    let cols = 64;
    for (ty, block) in [
        // d = 1/64, nibbles all 15 (Q4_0: 15 - 8 = 7).
        (GgmlType::Q4_0, [&[0x00, 0x24][..], &[0xff; 16]].concat()),
        // d = 1/64, qh all ones and nibbles all 15: q = 31 (31 - 16 = 15).
        (GgmlType::Q5_0, [&[0x00, 0x24][..], &[0xff; 4], &[0xff; 16]].concat()),
        // d = 1/64, m = 0: q = 31.
        (GgmlType::Q5_1, [&[0x00, 0x24, 0, 0][..], &[0xff; 4], &[0xff; 16]].concat()),
    ] {
        let row: Vec<u8> = block.iter().copied().cycle().take(ty.row_bytes(cols)).collect();
        let rows: [&[u8]; kernels::PANEL_ROWS] = std::array::from_fn(|_| row.as_slice());
        let acts = quantized(ty, &vec![1.0; cols]);
        assert!(acts.iter().all(|a| a.qs.iter().all(|&q| q == 127)));
        let want = kernels::scalar::dot_q8(ty, &row, &acts);
        for isa in Isa::available().into_iter().filter(|&i| kernels::has_panel(i, ty)) {
            let mut out = vec![f32::NAN; kernels::PANEL_ROWS];
            kernels::panel_gemm(isa, ty, rows, &acts, &mut kernels::Panel::default(), &mut out);
            for got in out {
                assert!((got - want).abs() <= 1e-5 * want.abs(), "{}: {got} vs {want}", ty.name());
            }
        }
    }
}

/// Prefill's panels (8 rows unpacked and interleaved, then multiplied with n tokens a few at a
/// time) against the scalar single-row kernel, for token counts that leave every remainder.
#[test]
fn panels_match_single_row_dot_products() {
    let mut rng = SplitMix64(7);
    let mut tested = Vec::new();
    for ty in GgmlType::QUANTISED {
        let sizes: &[usize] = if ty.block_size() == 256 { &[256, 768] } else { &[32, 96, 1056] };
        for &cols in sizes {
            let rows: Vec<Vec<u8>> =
                (0..kernels::PANEL_ROWS).map(|_| random_row(&mut rng, ty, cols)).collect();
            let panel_rows: [&[u8]; kernels::PANEL_ROWS] =
                std::array::from_fn(|r| rows[r].as_slice());
            for n in [1, 2, 3, 5, 7, 12] {
                let acts: Vec<Vec<BlockQ8>> =
                    (0..n).map(|_| quantized(ty, &activations(&mut rng, cols))).collect();
                let all: Vec<BlockQ8> = acts.concat();
                for isa in Isa::available().into_iter().filter(|&i| kernels::has_panel(i, ty)) {
                    let mut panel = kernels::Panel::default();
                    let mut out = vec![f32::NAN; n * kernels::PANEL_ROWS];
                    kernels::panel_gemm(isa, ty, panel_rows, &all, &mut panel, &mut out);
                    for (t, a) in acts.iter().enumerate() {
                        for (r, row) in rows.iter().enumerate() {
                            let got = out[t * kernels::PANEL_ROWS + r];
                            let want = kernels::scalar::dot_q8(ty, row, a);
                            let mut x = vec![0f32; cols];
                            for (xb, b) in x.chunks_mut(QK8).zip(a) {
                                xb.iter_mut().zip(&b.qs).for_each(|(v, &q)| *v = b.d * q as f32);
                            }
                            let (_, mag, _) = reference(ty, row, &x, a);
                            assert!(
                                ((got - want) as f64).abs() <= 1e-5 * mag + 1e-6,
                                "{} cols {cols} {} n {n} row {r} token {t}: panel {got} vs scalar {want}",
                                ty.name(),
                                isa.name()
                            );
                        }
                    }
                    tested.push((isa, ty));
                }
            }
        }
    }
    eprintln!("panels tested: {tested:?}");
    // Where AVX2 exists its panels must have run: a panel kernel that silently stopped being
    // chosen would leave this test passing on nothing.
    if Isa::available().contains(&Isa::Avx2) {
        for ty in GgmlType::QUANTISED {
            assert!(tested.iter().any(|&(_, t)| t == ty), "no panel kernel ran for {}", ty.name());
        }
    }
}

/// The library's own self-check (what the browser runs for simd128), for every ISA here.
/// `NEXTTOKEN_REQUIRE_ISA=neon` (tools/test.sh under qemu) makes a missing instruction set a
/// failure, so an undetected one cannot pass by testing scalar against itself.
#[test]
fn library_self_check_passes() {
    let isas = Isa::available();
    if let Ok(want) = std::env::var("NEXTTOKEN_REQUIRE_ISA") {
        assert!(
            isas.iter().any(|isa| isa.name() == want),
            "NEXTTOKEN_REQUIRE_ISA={want}, but this machine has {isas:?}"
        );
    }
    for isa in isas {
        for seed in 0..3 {
            let summary =
                kernels::check_isa_against_scalar(isa, seed).unwrap_or_else(|e| panic!("{e}"));
            eprintln!("{summary}");
        }
    }
}

#[test]
fn float_row_dot_products_match_scalar_and_reference() {
    let mut rng = SplitMix64(7);
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        for cols in [1, 7, 8, 15, 16, 17, 31, 33, 64, 100, 172, 577] {
            let vals: Vec<f32> = (0..cols).map(|_| rng.uniform(0.5)).collect();
            let row = quantize(ty, &vals).unwrap();
            let x = activations(&mut rng, cols);
            let oracle = kernels::scalar::dot_float_row(ty, &row, &x);
            let (want, mag, _) = reference(ty, &row, &x, &[]);
            let tol = 1e-5 * mag + 1e-6;
            assert!(
                (oracle as f64 - want).abs() <= tol,
                "{} cols {cols}: scalar vs reference",
                ty.name()
            );
            for isa in Isa::available() {
                let got = kernels::dot_float_row(isa, ty, &row, &x);
                assert!(
                    ((got - oracle) as f64).abs() <= tol,
                    "{} cols {cols} {}: {got} vs {oracle}",
                    ty.name(),
                    isa.name()
                );
            }
        }
    }
}

#[test]
fn f32_dot_and_axpy_match_scalar() {
    let mut rng = SplitMix64(3);
    for n in [0, 1, 7, 8, 15, 16, 17, 63, 64, 65, 100] {
        let a = activations(&mut rng, n);
        let b = activations(&mut rng, n);
        let oracle = kernels::scalar::dot_f32(&a, &b);
        let mag: f32 = a.iter().zip(&b).map(|(x, y)| (x * y).abs()).sum();
        for isa in Isa::available() {
            let got = kernels::dot_f32(isa, &a, &b);
            assert!((got - oracle).abs() <= 1e-5 * mag + 1e-6, "dot n {n} {}", isa.name());
            let mut y1 = b.clone();
            let mut y2 = b.clone();
            kernels::scalar::axpy(0.37, &a, &mut y1);
            kernels::axpy(isa, 0.37, &a, &mut y2);
            for (u, v) in y1.iter().zip(&y2) {
                assert!((u - v).abs() <= 1e-6 * (1.0 + u.abs()), "axpy n {n} {}", isa.name());
            }
        }
    }
}

/// The scalar attention kernels (the oracle `check_isa_against_scalar` holds the SIMD ones to)
/// against their definition in f64, on f32 and f16 caches.
#[test]
fn scalar_attention_kernels_match_their_definition() {
    let mut rng = SplitMix64(8);
    for (head_dim, stride) in [(64, 192), (40, 80)] {
        for seen in [1, 5, 17] {
            let q = activations(&mut rng, head_dim);
            let cache = activations(&mut rng, seen * stride);
            let cache16: Vec<f16> = cache.iter().map(|&v| f16::from_f32(v)).collect();
            let weights: Vec<f32> = (0..seen).map(|_| rng.next_f32()).collect();
            for rows in [KvRows::F32(&cache), KvRows::F16(&cache16)] {
                let at = |i: usize| match rows {
                    KvRows::F32(r) => r[i] as f64,
                    KvRows::F16(r) => r[i].to_f64(),
                };
                let mut scores = vec![0f32; seen];
                kernels::scalar::attention_scores(&q, rows, stride, 0.125, &mut scores);
                for (p, &s) in scores.iter().enumerate() {
                    let want: f64 =
                        (0..head_dim).map(|i| q[i] as f64 * at(p * stride + i)).sum::<f64>()
                            * 0.125;
                    assert!(
                        (s as f64 - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "scores {rows:?} p {p}: {s} vs {want}"
                    );
                }
                let mut out = vec![f32::NAN; head_dim]; // overwritten, not accumulated into
                kernels::scalar::attention_values(&weights, rows, stride, &mut out);
                for (i, &o) in out.iter().enumerate() {
                    let want: f64 = (0..seen).map(|p| weights[p] as f64 * at(p * stride + i)).sum();
                    assert!(
                        (o as f64 - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "values {rows:?} i {i}: {o} vs {want}"
                    );
                }
            }
        }
    }
}

/// One scale per block of 32 for Q8_0/Q4_0 rows, one per super-block of 256 for the K-quants:
/// d is the largest |x| of its group / 127 and every x within half a step of d * q.
/// The vectorised softmax and silu (a polynomial exp) against the scalar ones (libm's exp):
/// relative error within 2e-6, scores up to 100 apart (e^-100 underflows: ~1e-38 vs 0), gates
/// to -90 (e^90 overflows: silu ~1e-37 vs 0).
#[test]
fn softmax_and_silu_match_scalar() {
    let mut rng = SplitMix64(21);
    for n in [1, 7, 8, 9, 33, 1000] {
        let x: Vec<f32> =
            (0..n).map(|i| rng.uniform(30.0) - if i % 5 == 1 { 70.0 } else { 0.0 }).collect();
        let mut want = x.clone();
        kernels::scalar::softmax(&mut want);
        let gate: Vec<f32> = (0..n).map(|_| rng.uniform(90.0)).collect();
        let up: Vec<f32> = (0..n).map(|_| rng.uniform(3.0)).collect();
        let mut want_up = up.clone();
        kernels::scalar::silu_mul(&gate, &mut want_up);
        for isa in Isa::available() {
            let mut got = x.clone();
            kernels::softmax(isa, &mut got);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 2e-6 * w + 1e-30,
                    "softmax {} n {n} [{i}]: {g} vs {w}",
                    isa.name()
                );
            }
            let mut got_up = up.clone();
            kernels::silu_mul(isa, &gate, &mut got_up);
            for (i, (g, w)) in got_up.iter().zip(&want_up).enumerate() {
                assert!(
                    (g - w).abs() <= 2e-6 * w.abs() + 1e-30,
                    "silu {} n {n} [{i}]: {g} vs {w}",
                    isa.name()
                );
            }
        }
    }
}

#[test]
fn activation_quantisation_is_within_half_a_step() {
    let mut rng = SplitMix64(11);
    let mut x = activations(&mut rng, 32 * 8 * 3);
    x[32..64].fill(0.0); // an all-zero block quantises to d = 0, q = 0 (per block)
    x[512..768].fill(0.0); // and an all-zero super-block (per super-block)
    for ty in GgmlType::QUANTISED {
        let q = quantized(ty, &x);
        let group = if ty.block_size() == 256 { 256 } else { QK8 };
        for (xs, qs) in x.chunks(group).zip(q.chunks(group / QK8)) {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (xb, b) in xs.chunks(QK8).zip(qs) {
                assert_eq!(b.d, amax / 127.0, "{}", ty.name());
                assert_eq!(b.sum, b.qs.iter().map(|&v| v as i32).sum::<i32>());
                for (&v, &qi) in xb.iter().zip(&b.qs) {
                    assert!((v - b.d * qi as f32).abs() <= b.d / 2.0 * 1.0001 + 1e-12);
                }
            }
        }
        assert_eq!(q[16].d, 0.0);
        assert_eq!(q[1].d == 0.0, group == QK8, "{}", ty.name());
    }
}

/// Each instruction set's quantiser gives the scalar one's bytes, halves included: a block
/// whose largest value is 127 has d = 1, so x.5 values sit exactly on the rounding boundary.
#[test]
fn activation_quantisers_match_scalar_bit_for_bit() {
    let mut rng = SplitMix64(12);
    let mut x = activations(&mut rng, 256 * 4);
    x[32..64].fill(0.0);
    for (i, v) in x[64..96].iter_mut().enumerate() {
        // -37.5, -35, -32.5, ...: every other one a half.
        *v = if i == 0 { 127.0 } else { (i as f32 - 16.0) * 2.5 };
    }
    x[100] = -3.5;
    for scales in [kernels::ActScales::PerBlock, kernels::ActScales::PerSuperBlock] {
        let mut want = vec![BlockQ8::default(); x.len() / QK8];
        scales.quantize(&x, &mut want);
        if scales == kernels::ActScales::PerBlock {
            assert_eq!(want[2].d, 1.0, "the block of halves has d = 1");
            assert_eq!(want[2].qs[1], -38, "-37.5 rounds away from zero");
        }
        for isa in Isa::available() {
            let mut got = vec![BlockQ8::default(); x.len() / QK8];
            scales.quantize_with(isa, &x, &mut got);
            assert_eq!(got, want, "{scales:?} {}", isa.name());
        }
    }
}

#[test]
fn synth_quantisers_follow_ggml() {
    let mut rng = SplitMix64(5);
    let vals: Vec<f32> = (0..32 * 16).map(|_| rng.uniform(1.0)).collect();
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q5_0, GgmlType::Q5_1] {
        let bytes = quantize(ty, &vals).unwrap();
        assert_eq!(bytes.len(), ty.row_bytes(vals.len()));
        let mut back = vec![0f32; vals.len()];
        dequantize_row(ty, &bytes, &mut back);
        for (i, (b, v)) in back.chunks(32).zip(vals.chunks(32)).enumerate() {
            let d =
                f16::from_le_bytes([bytes[i * ty.block_bytes()], bytes[i * ty.block_bytes() + 1]])
                    .to_f32();
            for (x, y) in b.iter().zip(v) {
                // Half a step of rounding, plus the f16 rounding of d (2^-11 relative) times |q| <= 128.
                // Q4_0 (Q5_0) maps the largest magnitude to -8 (-16), so the other sign clips at +7
                // (+15): a whole step.
                // Q5_1 (min and max as the ends of its range) rounds to the nearest step.
                let steps = if matches!(ty, GgmlType::Q8_0 | GgmlType::Q5_1) { 0.5 } else { 1.0 };
                assert!(
                    (x - y).abs() <= d.abs() * (steps + 128.0 / 2048.0) + 1e-6,
                    "{}: {x} vs {y}",
                    ty.name()
                );
            }
            if ty == GgmlType::Q4_0 {
                // ggml: the value of largest magnitude maps to q = 0 (i.e. -8) exactly.
                let imax = (0..32).max_by(|&a, &b| v[a].abs().total_cmp(&v[b].abs())).unwrap();
                let byte = bytes[i * 18 + 2 + imax % 16];
                let q = if imax < 16 { byte & 15 } else { byte >> 4 };
                assert_eq!(q, 0, "block {i}");
            }
            if ty == GgmlType::Q5_0 {
                // The same for Q5_0: the largest magnitude is q = 0 (-16), fifth bit clear.
                let imax = (0..32).max_by(|&a, &b| v[a].abs().total_cmp(&v[b].abs())).unwrap();
                let blk = &bytes[i * 22..(i + 1) * 22];
                let byte = blk[6 + imax % 16];
                let low = if imax < 16 { byte & 15 } else { byte >> 4 };
                let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                assert_eq!((low, (qh >> imax) & 1), (0, 0), "block {i}");
            }
            if ty == GgmlType::Q5_1 {
                // The block's minimum is q = 0 and its maximum q = 31.
                let blk = &bytes[i * 24..(i + 1) * 24];
                let qh = u32::from_le_bytes([blk[4], blk[5], blk[6], blk[7]]);
                let q = |j: usize| {
                    let byte = blk[8 + j % 16];
                    let low = if j < 16 { byte & 15 } else { byte >> 4 };
                    low as u32 | ((qh >> j) & 1) << 4
                };
                let imin = (0..32).min_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap();
                let imax = (0..32).max_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap();
                assert_eq!((q(imin), q(imax)), (0, 31), "block {i}");
            }
        }
    }
}

fn greedy(model: &CpuModel, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut state = model.new_state();
    let mut logits = model.forward(&mut state, prompt, false).unwrap();
    let (mut ids, mut all) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let next = argmax(&logits);
        ids.push(next);
        all.push(logits);
        logits = model.forward(&mut state, &[next], false).unwrap();
    }
    (ids, all)
}

#[test]
fn fast_path_matches_exact_on_stories260k() {
    let Some(shared) = common::shared() else { return };
    let dir = shared.join("models/stories260K");
    for (file, tol) in [
        ("stories260K-f32.gguf", FAST_LOGIT_TOLERANCE_F32),
        ("stories260K-q8_0.gguf", FAST_LOGIT_TOLERANCE_Q8),
    ] {
        let open = || Model::open(&dir.join(file)).unwrap();
        let prompt = [1u32, 403, 407, 261, 378];
        let exact = CpuModel::new(open());
        let (want_ids, want_logits) = greedy(&exact, &prompt, 64);
        for isa in Isa::available() {
            for threads in [1, 2] {
                let fast = CpuModel::new(open())
                    .with_precision(Precision::Fast)
                    .with_isa(isa)
                    .with_threads(threads);
                let (ids, logits) = greedy(&fast, &prompt, 64);
                let worst = want_logits
                    .iter()
                    .zip(&logits)
                    .map(|(a, b)| common::max_abs_diff(a, b))
                    .fold(0f32, f32::max);
                eprintln!(
                    "{file} {} threads {threads}: max abs logit diff vs exact {worst:.2e}",
                    isa.name()
                );
                assert_eq!(
                    ids,
                    want_ids,
                    "{file} {}: greedy continuation differs from the exact path",
                    isa.name()
                );
                assert!(worst <= tol, "{file} {}: {worst} > {tol}", isa.name());
            }
        }
    }
}

/// The fast path's weights in huge pages (Linux): the same bytes at a new address, one copy (a
/// model whose bytes another handle shares stays where it is). The fast-vs-exact tests above
/// run on the copy.
#[cfg(target_os = "linux")]
#[test]
fn huge_page_copy_keeps_every_byte() {
    let Some(shared) = common::shared() else { return };
    let path = shared.join("models/stories260K/stories260K-q8_0.gguf");
    let file = std::fs::read(&path).unwrap();
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .is_ok_and(|mode| !mode.contains("[never]"));

    let mapped = Model::open(&path).unwrap();
    let before = mapped.storage.as_ptr();
    let moved = mapped.into_huge_pages();
    assert_eq!(&moved.storage[..], &file[..], "the copy differs from the file");
    if thp {
        assert_ne!(moved.storage.as_ptr(), before, "THP is on but the weights were not moved");
    }

    let mapped = Model::open(&path).unwrap();
    let handle = mapped.share();
    let before = mapped.storage.as_ptr();
    assert_eq!(mapped.into_huge_pages().storage.as_ptr(), before, "shared bytes were copied");
    drop(handle);
}

#[test]
fn fast_path_matches_exact_on_synthetic_models() {
    // Q8_0, Q4_0, Q5_0: Q8 activations (measured up to 0.06 on these random models); F16/F32: f32 activations.
    for arch in ["llama", "qwen2", "gpt2"] {
        for (ty, tol) in [
            (GgmlType::Q8_0, 0.15f32),
            (GgmlType::Q4_0, 0.15),
            (GgmlType::Q5_0, 0.15),
            (GgmlType::Q5_1, 0.15),
            (GgmlType::F16, 1e-4),
            (GgmlType::F32, 1e-4),
        ] {
            let bytes = common::synth_model(arch, ty, 1);
            // Prefill in pieces of 5, 2, 12 (prefill panels from 8 tokens on) and 1 token, then
            // decode: exercises the cache, the scratch reuse and each matrix-product kernel.
            let prompt = [1, 5, 9, 14, 30, 7, 3, 22, 11, 2, 17, 40, 8, 6, 31, 12, 19, 4, 25, 10];
            for (isa, worst) in fast_vs_exact(&bytes, &prompt, &[5, 7, 19]) {
                eprintln!(
                    "synthetic {arch} {} {}: max abs logit diff {worst:.2e}",
                    ty.name(),
                    isa.name()
                );
                assert!(
                    worst <= tol,
                    "synthetic {arch} {} {}: {worst} > {tol}",
                    ty.name(),
                    isa.name()
                );
            }
        }
    }
}

/// Max abs logit difference, the fast path (each instruction set here, 2 threads) against the
/// exact one, over every position of `prompt`, fed to the fast path in pieces cut at `cuts`.
fn fast_vs_exact(bytes: &[u8], prompt: &[u32], cuts: &[usize]) -> Vec<(Isa, f32)> {
    let open = || Model::from_bytes(bytes.to_vec()).unwrap();
    let exact = CpuModel::new(open());
    let want = exact.forward(&mut exact.new_state(), prompt, true).unwrap();
    let bounds: Vec<usize> =
        [0].into_iter().chain(cuts.iter().copied()).chain([prompt.len()]).collect();
    Isa::available()
        .into_iter()
        .map(|isa| {
            let fast =
                CpuModel::new(open()).with_precision(Precision::Fast).with_isa(isa).with_threads(2);
            let mut s = fast.new_state();
            let mut got = Vec::new();
            for w in bounds.windows(2) {
                got.extend(fast.forward(&mut s, &prompt[w[0]..w[1]], true).unwrap());
            }
            (isa, common::max_abs_diff(&want, &got))
        })
        .collect()
}

/// K-quant models (rows of 256 and more, so the matrices really are Q4_K / Q6_K): the fast path
/// quantises activations with one scale per super-block (llama.cpp's Q8_K) and multiplies in
/// integers; its logits against the exact path's: measured up to 0.08 (Q4_K) and 0.13 (Q6_K) on
/// logits up to ~4 (with a scale per 32 instead, Q4_K was 0.04: the price of llama.cpp's layout).
#[test]
fn fast_path_matches_exact_on_k_quant_models() {
    use nexttoken::model::Arch;
    use nexttoken::synthetic::{self, Spec};
    for arch in [Arch::Llama, Arch::Qwen2] {
        for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
            let spec = Spec {
                n_head_kv: 2,
                tied: arch != Arch::Llama,
                weight_type: ty,
                seed: 3,
                ..Spec::new(arch, 300, 256, 2, 4, 512, 64)
            };
            let bytes = synthetic::write(&spec).unwrap();
            let m = Model::from_bytes(bytes.clone()).unwrap();
            assert_eq!(m.weights.layers[0].attn_output.weight.ty, ty, "{} matrices", ty.name());
            drop(m);
            // A prefill (tiles of several tokens), then single tokens (decode tiles).
            let prompt = [1u32, 5, 9, 14, 30, 7, 3, 22, 250, 101, 2];
            for (isa, worst) in fast_vs_exact(&bytes, &prompt, &[9, 10]) {
                eprintln!(
                    "synthetic {} {} {}: max abs logit diff {worst:.2e}",
                    arch.gguf_name(),
                    ty.name(),
                    isa.name()
                );
                assert!(
                    worst <= 0.25,
                    "{} {} {}: {worst}",
                    arch.gguf_name(),
                    ty.name(),
                    isa.name()
                );
            }
        }
    }
}

/// Decode in adjacent tiles, in streams, and timed (the first steps alternate): where streams
/// means spread tiles (the wasm build; natively Q4_0, Q5_0, Q5_1) every walk gives the same
/// logits bit for bit, so timing the walks changes no result; row by row (natively Q8_0 and the
/// K-quants) stays within the fast path's tolerance of adjacent tiles.
#[test]
fn decode_walks_give_the_same_logits() {
    use nexttoken::model::Arch;
    use nexttoken::synthetic::{self, Spec};
    let mut spread_seen = Vec::new();
    for ty in GgmlType::QUANTISED {
        let spec = Spec {
            n_head_kv: 2,
            weight_type: ty,
            seed: 5,
            // Rows of 256 (K-quants) and 301 vocabulary rows: a remainder past the last tile.
            ..Spec::new(Arch::Llama, 301, 256, 2, 4, 512, 64)
        };
        let bytes = synthetic::write(&spec).unwrap();
        let prompt = [1u32, 5, 9, 14, 30, 7];
        for isa in Isa::available() {
            for threads in [1, 2] {
                let run = |walk: Option<bool>| {
                    let model = CpuModel::new(Model::from_bytes(bytes.clone()).unwrap())
                        .with_precision(Precision::Fast)
                        .with_isa(isa)
                        .with_threads(threads)
                        .with_decode_walk(walk);
                    let (ids, logits) = greedy(&model, &prompt, 12);
                    (ids, logits, model.decode_in_streams())
                };
                let (tile_ids, tiles, _) = run(Some(false));
                let (_, streams, _) = run(Some(true));
                let (timed_ids, timed, settled) = run(None);
                assert!(settled.is_some(), "12 decode steps left the walk unsettled");
                let what = format!("{} {} threads {threads}", ty.name(), isa.name());
                if kernels::decode_walk(isa, ty, true) == kernels::DecodeWalk::SpreadTiles {
                    spread_seen.push(what.clone());
                    assert!(streams == tiles, "{what}: spread tiles changed the logits");
                    assert!(timed == tiles, "{what}: timing the walks changed the logits");
                    assert_eq!(timed_ids, tile_ids, "{what}");
                } else {
                    let worst = tiles
                        .iter()
                        .zip(&streams)
                        .map(|(a, b)| common::max_abs_diff(a, b))
                        .fold(0f32, f32::max);
                    assert!(worst <= 1e-2, "{what}: streams vs tiles {worst}");
                }
            }
        }
    }
    eprintln!("bit for bit in spread tiles: {spread_seen:?}");
    assert!(spread_seen.iter().any(|s| s.starts_with("Q4_0")), "no spread tiles tested");
}

/// A token's logits do not depend on the pass it is in: after a prompt, passes of 2 to 7 tokens
/// (speculative decoding verifies its guesses in such passes) give each token the logits
/// one-token steps give it, bit for bit, for every quantised type, instruction set and decode
/// walk, with a vocabulary that leaves rows past the last tile. Passes of 8 tokens and more go
/// through prefill's panels, which sum in their own order.
#[test]
fn a_tokens_logits_do_not_depend_on_its_pass() {
    use nexttoken::model::Arch;
    use nexttoken::synthetic::{self, Spec};
    let vocab = 301;
    for ty in GgmlType::QUANTISED {
        let spec = Spec {
            n_head_kv: 2,
            weight_type: ty,
            seed: 8,
            ..Spec::new(Arch::Llama, vocab, 256, 2, 4, 512, 64)
        };
        let bytes = synthetic::write(&spec).unwrap();
        let prompt = [1u32, 5, 9, 14, 30, 7];
        let next = [3u32, 44, 17, 250, 99, 8, 61];
        for isa in Isa::available() {
            for streams in [false, true] {
                let model = CpuModel::new(Model::from_bytes(bytes.clone()).unwrap())
                    .with_precision(Precision::Fast)
                    .with_isa(isa)
                    .with_threads(2)
                    .with_decode_walk(Some(streams));
                let after_prompt = || {
                    let mut state = model.new_state();
                    model.forward(&mut state, &prompt, false).unwrap();
                    state
                };
                let what = format!("{} {} streams {streams}", ty.name(), isa.name());
                passes_give_their_steps_bits(&model, after_prompt, &next, vocab, &what);
            }
        }
    }
}

/// After `start()`, each token of `next` in passes of 2 to all its tokens gets the logits it gets
/// in one-token steps, bit for bit.
fn passes_give_their_steps_bits(
    model: &CpuModel,
    start: impl Fn() -> <CpuModel as LanguageModel>::State,
    next: &[u32],
    vocab: usize,
    what: &str,
) {
    let mut state = start();
    let steps: Vec<Vec<f32>> =
        next.iter().map(|&t| model.forward(&mut state, &[t], false).unwrap()).collect();
    for n in 2..=next.len() {
        let rows = model.forward(&mut start(), &next[..n], true).unwrap();
        for (k, row) in rows.chunks_exact(vocab).enumerate() {
            let same = row.iter().zip(&steps[k]).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{what}: token {k} of a pass of {n} differs from its one-token step (max diff {})",
                common::max_abs_diff(row, &steps[k])
            );
        }
    }
}

#[test]
fn a_real_models_logits_do_not_depend_on_its_pass() {
    // stories260K's feed-forward is 172 wide, not a multiple of a SIMD vector: an element-wise
    // kernel over several tokens at once (SIMD lanes and the scalar tail round apart) gave a
    // token other bits in a pass than alone. Passes of 2 to 5 tokens from positions 5 to 14.
    let Some(shared) = common::shared() else { return };
    let path = shared.join("models/stories260K/stories260K-q8_0.gguf");
    let bytes = std::fs::read(path).unwrap();
    let (vocab, prompt) = (512, [1u32, 403, 407, 261, 378]);
    let text = [432u32, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267];
    for isa in Isa::available() {
        let model = CpuModel::new(Model::from_bytes(bytes.clone()).unwrap())
            .with_precision(Precision::Fast)
            .with_isa(isa)
            .with_threads(1);
        for m in 0..10 {
            let after = || {
                let mut state = model.new_state();
                model.forward(&mut state, &prompt, false).unwrap();
                for &t in &text[..m] {
                    model.forward(&mut state, &[t], false).unwrap();
                }
                state
            };
            let what = format!("{} after {} tokens", isa.name(), prompt.len() + m);
            passes_give_their_steps_bits(&model, after, &text[m..m + 5], vocab, &what);
        }
    }
}

#[test]
fn exact_path_does_not_depend_on_threads() {
    let open = || Model::from_bytes(common::synth_model("llama", GgmlType::Q8_0, 2)).unwrap();
    let prompt = [1u32, 4, 8, 15, 16, 23, 42];
    let one = CpuModel::new(open());
    let two = CpuModel::new(open()).with_threads(2);
    let (mut s1, mut s2) = (one.new_state(), two.new_state());
    assert_eq!(
        one.forward(&mut s1, &prompt, true).unwrap(),
        two.forward(&mut s2, &prompt, true).unwrap()
    );
}
