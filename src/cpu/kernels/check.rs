//! One instruction set's kernels against the scalar oracle, on random data at awkward sizes.
//!
//! It lives in the library, not only in `tests/`, because `cargo test` cannot run every build:
//! the wasm32 simd128 kernels run only in a browser, whose test suite calls this through
//! `web::kernel_self_test`. `tests/cpu_kernels.rs` runs it natively for every instruction set.

use super::*;
use crate::quant::{dequantize_row, quantize};
use crate::sampling::Rng;

/// A random row of `ty` (`cols` elements) as bytes, from the random source `next`: uniform values
/// through the library's quantiser for Q8_0, Q4_0, Q5_0, Q5_1 and the float types; random bytes for
/// the K-quants (any bytes are a valid block) except their f16 scales, which get sane magnitudes.
pub fn random_row(ty: GgmlType, cols: usize, next: &mut impl FnMut() -> u32) -> Vec<u8> {
    let mut unit = || (next() >> 8) as f32 / (1u32 << 24) as f32;
    match ty {
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
            let mut b: Vec<u8> = (0..ty.row_bytes(cols)).map(|_| (unit() * 256.0) as u8).collect();
            for blk in b.chunks_exact_mut(ty.block_bytes()) {
                let d = f16::from_f32(0.001 + unit() * 0.01).to_le_bytes();
                if ty != GgmlType::Q6_K {
                    blk[0..2].copy_from_slice(&d);
                    blk[2..4].copy_from_slice(&f16::from_f32(unit() * 0.01).to_le_bytes());
                } else {
                    blk[208..210].copy_from_slice(&d);
                }
            }
            b
        }
        _ => {
            let vals: Vec<f32> = (0..cols).map(|_| (unit() * 2.0 - 1.0) * 0.1).collect();
            quantize(ty, &vals).expect("random_row: a type the library quantises")
        }
    }
}

/// Normal-ish activations with an outlier every 37 values, as real hidden states have.
fn activations(n: usize, next: &mut impl FnMut() -> u32) -> Vec<f32> {
    let mut uniform = || (next() >> 8) as f32 / (1u32 << 23) as f32 - 1.0;
    (0..n)
        .map(|i| {
            let v = uniform() + uniform() + uniform();
            if i % 37 == 5 {
                v * 20.0
            } else {
                v
            }
        })
        .collect()
}

/// Counts comparisons and reports the first one out of tolerance.
struct Checker {
    isa: Isa,
    checks: usize,
}

impl Checker {
    /// `got` bit for bit as `want`: one token's sum in a one-token step vs in a pass of several
    /// (speculative decoding verifies guesses in such passes and keeps the plain run's tokens).
    fn same(&mut self, what: impl FnOnce() -> String, got: f32, want: f32) -> Result<(), String> {
        self.checks += 1;
        if got.to_bits() == want.to_bits() {
            Ok(())
        } else {
            Err(format!(
                "{} {}: {got} in one pass, {want} in another: a token's sums must not depend on \
                 the pass it is in",
                self.isa.name(),
                what()
            ))
        }
    }

    /// `got` vs the scalar `want` within `2e-6 |want| + 1e-30`: a polynomial exp against libm's
    /// (a few units in the last place; ~1e-38 where libm underflows to 0).
    fn close(&mut self, what: impl FnOnce() -> String, got: f32, want: f32) -> Result<(), String> {
        self.within(what, got, want, 2e-6 * want.abs() as f64 + 1e-30)
    }

    /// `got` vs the scalar `want`, allowing for float summation order: `1e-5 * mag + 1e-6`,
    /// where `mag` is the sum of |products| that went into the result.
    fn check(
        &mut self,
        what: impl FnOnce() -> String,
        got: f32,
        want: f32,
        mag: f64,
    ) -> Result<(), String> {
        self.within(what, got, want, 1e-5 * mag + 1e-6)
    }

    fn within(
        &mut self,
        what: impl FnOnce() -> String,
        got: f32,
        want: f32,
        tol: f64,
    ) -> Result<(), String> {
        self.checks += 1;
        // Written so that NaN fails.
        if ((got - want) as f64).abs() <= tol {
            Ok(())
        } else {
            Err(format!(
                "{} {}: {got} vs scalar {want} (tolerance {tol:.2e})",
                self.isa.name(),
                what()
            ))
        }
    }
}

/// sum |w_i x_i| for a weight row of `ty` and f32 activations.
fn magnitude(ty: GgmlType, row: &[u8], x: &[f32]) -> f64 {
    let mut w = vec![0f32; x.len()];
    dequantize_row(ty, row, &mut w);
    w.iter().zip(x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum()
}

/// Checks `isa`'s `dot_q8` (every type of `GgmlType::QUANTISED`), `dot_q8_tile` (1 x 1, 4 x 1, 4 x 2, 4 x 4,
/// 4 x 3, 4 x 5; and that a token's sums are the same bits whatever the pass: `Checker::same`),
/// `panel_gemm` where the ISA has panels (8 rows, 7 tokens),
/// `dot_float_row` (F32, F16, BF16), `dot_f32`, `axpy`, `softmax`, `silu_mul` and the attention
/// kernels (f32 and f16 rows) against the scalar kernels on data
/// drawn from `seed`. Returns a one-line summary, or the first mismatch.
pub fn check_isa_against_scalar(isa: Isa, seed: u64) -> Result<String, String> {
    if !Isa::available().contains(&isa) {
        return Err(format!("{} is not available on this machine or in this build", isa.name()));
    }
    let mut rng = Rng::new(seed);
    let next = &mut || rng.next_u32();
    let mut c = Checker { isa, checks: 0 };

    for ty in GgmlType::QUANTISED {
        let sizes: &[usize] =
            if ty.block_size() == QK_K { &[256, 768, 1280] } else { &[32, 64, 96, 224, 1056] };
        for &cols in sizes {
            let mut rows: Vec<Vec<u8>> =
                (0..TILE_ROWS).map(|_| random_row(ty, cols, next)).collect();
            if ty.block_size() == QK8 {
                // Scales a converter can get wrong: subnormal f16 (a tiny row), and -0.
                rows[1][..2].copy_from_slice(&0x0123u16.to_le_bytes());
                rows[2][..2].copy_from_slice(&0x8000u16.to_le_bytes());
            }
            if ty == GgmlType::Q8_0 {
                // -128, which the quantiser never writes but a file may hold: kernels that move
                // a sign onto the other operand (|w| as 0..=127) get it wrong.
                for (i, q) in rows[3].iter_mut().enumerate() {
                    if i % 34 >= 2 && i % 3 == 0 {
                        *q = 0x80;
                    }
                }
            }
            let acts: Vec<Vec<BlockQ8>> = (0..4)
                .map(|_| {
                    let mut q = vec![BlockQ8::default(); cols / QK8];
                    quantize_activations_for(ty, &activations(cols, next), &mut q);
                    q
                })
                .collect();
            let tile: [&[u8]; TILE_ROWS] = std::array::from_fn(|r| rows[r].as_slice());
            let one = dot_q8_tile(isa, ty, tile, [acts[0].as_slice()]);
            let two = dot_q8_tile(isa, ty, tile, [acts[0].as_slice(), acts[1].as_slice()]);
            let four =
                dot_q8_tile(isa, ty, tile, std::array::from_fn::<_, 4, _>(|t| acts[t].as_slice()));
            for (t, act) in acts.iter().enumerate() {
                // The activations the integer kernels actually see, for the magnitude.
                let x: Vec<f32> = act.iter().flat_map(|a| a.qs.map(|q| a.d * q as f32)).collect();
                for (r, row) in rows.iter().enumerate() {
                    let want = scalar::dot_q8(ty, row, act);
                    let mag = magnitude(ty, row, &x);
                    let what = |kernel: &'static str| {
                        move || format!("{kernel} {} cols {cols} row {r} vector {t}", ty.name())
                    };
                    c.check(what("dot_q8"), dot_q8(isa, ty, row, act), want, mag)?;
                    let single = dot_q8_tile::<1, 1>(isa, ty, [row.as_slice()], [act.as_slice()]);
                    c.check(what("dot_q8_tile<1, 1>"), single[0][0], want, mag)?;
                    c.check(what("dot_q8_tile<4, 4>"), four[r][t], want, mag)?;
                    if t < 2 {
                        c.check(what("dot_q8_tile<4, 2>"), two[r][t], want, mag)?;
                    }
                    if t == 0 {
                        c.check(what("dot_q8_tile<4, 1>"), one[r][0], want, mag)?;
                    }
                }
            }
            // A token's sums do not depend on the pass it is in: 3 and 5 tokens at once (the
            // widest tile) give each token what one gives it, bit for bit.
            let three =
                dot_q8_tile(isa, ty, tile, std::array::from_fn::<_, 3, _>(|t| acts[t].as_slice()));
            let five = {
                let mut five_acts = acts.clone();
                five_acts.push(five_acts[0].clone());
                dot_q8_tile(
                    isa,
                    ty,
                    tile,
                    std::array::from_fn::<_, 5, _>(|t| five_acts[t].as_slice()),
                )
            };
            for (t, act) in acts.iter().enumerate() {
                let alone = dot_q8_tile(isa, ty, tile, [act.as_slice()]);
                for r in 0..TILE_ROWS {
                    let mut passes = vec![(4, four[r][t]), (5, five[r][t])];
                    if t < 2 {
                        passes.push((2, two[r][t]));
                    }
                    if t < 3 {
                        passes.push((3, three[r][t]));
                    }
                    for (n, got) in passes {
                        c.same(
                            || format!("{} cols {cols} row {r}: token {t} of {n}", ty.name()),
                            got,
                            alone[r][0],
                        )?;
                    }
                }
            }
            // Decode's calls over a whole range of rows: the tiles in both walks, row by row.
            let more: Vec<Vec<u8>> = (0..TILE_ROWS).map(|_| random_row(ty, cols, next)).collect();
            let all: Vec<&Vec<u8>> = rows.iter().chain(&more).collect();
            let matrix: Vec<u8> = all.iter().flat_map(|r| r.iter().copied()).collect();
            let row_bytes = ty.row_bytes(cols);
            let act = acts[0].as_slice();
            let x: Vec<f32> = act.iter().flat_map(|a| a.qs.map(|q| a.d * q as f32)).collect();
            for walk in ["adjacent tiles", "spread tiles", "rows"] {
                let mut out = vec![f32::NAN; all.len()];
                match walk {
                    "rows" => dot_q8_rows(isa, ty, &matrix, row_bytes, act, &mut out),
                    _ => {
                        let spread = walk == "spread tiles";
                        dot_q8_decode_tiles(isa, ty, &matrix, row_bytes, spread, act, &mut out)
                    }
                }
                // The walks this host may take give what a pass of several tokens does.
                let may_walk = walk != "rows" || decode_walk(isa, ty, true) == DecodeWalk::RowByRow;
                for (r, row) in all.iter().enumerate() {
                    let what = || format!("decode in {walk} {} cols {cols} row {r}", ty.name());
                    let want = scalar::dot_q8(ty, row, act);
                    c.check(what, out[r], want, magnitude(ty, row, &x))?;
                    if may_walk {
                        let k = r / TILE_ROWS * TILE_ROWS;
                        let tile: [&[u8]; TILE_ROWS] =
                            std::array::from_fn(|j| all[k + j].as_slice());
                        let acts = [act, acts[1].as_slice()];
                        let in_pass = dot_q8_tile(isa, ty, tile, acts)[r - k][0];
                        c.same(what, out[r], in_pass)?;
                    }
                }
            }
            // Prefill's panels: the 8 rows packed, times 7 tokens (tiles of 4, 2 and 1).
            if has_panel(isa, ty) {
                let acts: Vec<Vec<BlockQ8>> = (0..7).map(|t| acts[t % 4].clone()).collect();
                let flat: Vec<BlockQ8> = acts.iter().flatten().copied().collect();
                let rows: [&[u8]; PANEL_ROWS] = std::array::from_fn(|r| all[r].as_slice());
                let mut out = vec![f32::NAN; acts.len() * PANEL_ROWS];
                panel_gemm(isa, ty, rows, &flat, &mut Panel::default(), &mut out);
                for (t, act) in acts.iter().enumerate() {
                    let x: Vec<f32> =
                        act.iter().flat_map(|a| a.qs.map(|q| a.d * q as f32)).collect();
                    for (r, row) in rows.iter().enumerate() {
                        let what = || format!("panel {} cols {cols} row {r} token {t}", ty.name());
                        let want = scalar::dot_q8(ty, row, act);
                        c.check(what, out[t * PANEL_ROWS + r], want, magnitude(ty, row, &x))?;
                    }
                }
            }
        }
    }

    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        for cols in [1, 7, 8, 15, 16, 17, 33, 100, 577] {
            let row = random_row(ty, cols, next);
            let x = activations(cols, next);
            let want = scalar::dot_float_row(ty, &row, &x);
            let what = || format!("dot_float_row {} cols {cols}", ty.name());
            c.check(what, dot_float_row(isa, ty, &row, &x), want, magnitude(ty, &row, &x))?;
        }
    }

    for n in [0, 1, 3, 4, 7, 8, 15, 16, 17, 63, 65, 100] {
        let (a, b) = (activations(n, next), activations(n, next));
        let mag: f64 = a.iter().zip(&b).map(|(u, v)| (u * v).abs() as f64).sum();
        c.check(|| format!("dot_f32 n {n}"), dot_f32(isa, &a, &b), scalar::dot_f32(&a, &b), mag)?;
        let (mut want, mut got) = (b.clone(), b.clone());
        scalar::axpy(0.37, &a, &mut want);
        axpy(isa, 0.37, &a, &mut got);
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            let mag = (0.37 * a[i]).abs() as f64 + b[i].abs() as f64;
            c.check(|| format!("axpy n {n} element {i}"), g, w, mag)?;
        }
    }

    // softmax and silu (a polynomial exp where vectorised): scores ~±30 and some 70 lower, gates
    // ~±90 and some ±1800 (e^90 overflows a float: silu ~1e-37 against 0).
    for n in [1, 3, 4, 5, 8, 9, 33, 1000] {
        let scale = |v: Vec<f32>, by: f32| v.into_iter().map(|x| x * by).collect::<Vec<f32>>();
        let mut want = scale(activations(n, next), 10.0);
        for (i, v) in want.iter_mut().enumerate() {
            if i % 5 == 1 {
                *v -= 70.0;
            }
        }
        let mut got = want.clone();
        scalar::softmax(&mut want);
        softmax(isa, &mut got);
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            c.close(|| format!("softmax n {n} element {i}"), g, w)?;
        }
        let gate = scale(activations(n, next), 30.0);
        let mut want = activations(n, next);
        let mut got = want.clone();
        scalar::silu_mul(&gate, &mut want);
        silu_mul(isa, &gate, &mut got);
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            c.close(|| format!("silu_mul n {n} element {i}"), g, w)?;
        }
    }

    // Attention over a cache of f32 or f16 rows, `stride` apart (one head's rows, or several
    // heads interleaved); head sizes that take each column width of the SIMD values kernels.
    for (head_dim, stride) in [(64, 192), (128, 128), (40, 80), (8, 24), (96, 96), (24, 48)] {
        for seen in [1, 3, 4, 5, 17, 64] {
            let q = activations(head_dim, next);
            let cache = activations(seen * stride, next);
            let cache16: Vec<f16> = cache.iter().map(|&v| f16::from_f32(v)).collect();
            let weights: Vec<f32> =
                (0..seen).map(|_| (next() >> 8) as f32 / (1u32 << 24) as f32).collect();
            for rows in [KvRows::F32(&cache), KvRows::F16(&cache16)] {
                let at = |i: usize| match rows {
                    KvRows::F32(r) => r[i],
                    KvRows::F16(r) => r[i].to_f32(),
                };
                let kind = if matches!(rows, KvRows::F32(_)) { "f32" } else { "f16" };
                let (mut want, mut got) = (vec![0f32; seen], vec![0f32; seen]);
                scalar::attention_scores(&q, rows, stride, 0.125, &mut want);
                attention_scores(isa, &q, rows, stride, 0.125, &mut got);
                for p in 0..seen {
                    let mag = (0..head_dim)
                        .map(|i| (q[i] * at(p * stride + i)).abs() as f64)
                        .sum::<f64>()
                        * 0.125;
                    c.check(
                        || format!("attention_scores {kind} d {head_dim} seen {seen} key {p}"),
                        got[p],
                        want[p],
                        mag,
                    )?;
                }
                let (mut want, mut got) = (vec![0f32; head_dim], vec![f32::NAN; head_dim]);
                scalar::attention_values(&weights, rows, stride, &mut want);
                attention_values(isa, &weights, rows, stride, &mut got);
                for i in 0..head_dim {
                    let mag = (0..seen)
                        .map(|p| (weights[p] * at(p * stride + i)).abs() as f64)
                        .sum::<f64>();
                    c.check(
                        || format!("attention_values {kind} d {head_dim} seen {seen} element {i}"),
                        got[i],
                        want[i],
                        mag,
                    )?;
                }
            }
        }
    }

    let panels = GgmlType::QUANTISED.iter().any(|&ty| has_panel(isa, ty));
    Ok(format!(
        "{}: {} results match scalar (dot_q8, 1x1, 4x1, 4x2, 4x4 tiles{} and decode's tiles and rows on Q8_0 Q4_0 Q5_0 Q5_1 Q4_K Q5_K Q6_K; dot_float_row on F32 F16 BF16; dot_f32; axpy; softmax; silu; attention scores and values on f32 and f16 rows; a token's sums the same bits in passes of 1 to 5 tokens and in decode's walks), seed {seed}",
        isa.name(),
        c.checks,
        if panels { ", prefill's 8-row panels" } else { "" }
    ))
}
