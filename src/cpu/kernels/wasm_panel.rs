//! wasm32 relaxed-simd prefill panels (see `kernels::Panel`): the layout of the AVX2 panels, read
//! as two 128-bit halves. `quants[8 b + j]` holds weights 4j..4j+4 of rows 0..4 in its first 16
//! bytes and of rows 4..8 in the rest, so one `i16x8.relaxed_dot_i8x16_i7x16_s` of a half with 4
//! activation bytes splatted gives each of those rows its two pairs of products, and a block of
//! them adds up in 16 bits before one widening add: the weights are unpacked once per product
//! (a tile unpacks them again for every 4 tokens) and each row's sums end in a lane of their own
//! (a tile folds them).
//!
//! The same rule as the relaxed-simd tiles keeps the sums exact on every CPU (see
//! `relaxed_simd.rs`): the second operand is always 0..=127. Unsigned weights (Q4_0, Q5_0, Q5_1,
//! Q4_K, Q5_K: 0..=31) are that operand against the signed activations; Q6_K's signed ones
//! (−32..=31) meet the activations split into x = x⁺ − x⁻, both 0..=127. Packing is simd128: each
//! row's block unpacked to 32 bytes, 4 rows at a time transposed by words.

use super::simd128::{five_bit_weights, high_nibbles, load, Products};
use super::*;
use std::arch::wasm32::*;

/// Whether there is a panel kernel for `ty`: every quantised type but Q8_0, whose tile multiplies
/// the bytes as they are in the file (nothing to unpack) and ran prefill as fast or faster in
/// Chromium than the panels tried (x⁺ and x⁻ against the signed weights, 1.04x; two planes of
/// nibbles, 0.73x).
pub fn has_panel(ty: GgmlType) -> bool {
    GgmlType::QUANTISED.contains(&ty) && ty != GgmlType::Q8_0
}

/// See `kernels::panel_gemm`.
pub fn panel_gemm(
    ty: GgmlType,
    rows: [&[u8]; PANEL_ROWS],
    acts: &[BlockQ8],
    panel: &mut Panel,
    out: &mut [f32],
) {
    pack(ty, rows, panel);
    panel_tiles!(panel, acts, out, |t, tile: T| {
        let sums = match panel.kind {
            PanelQuants::Nibbles => panel_tile::<T, NIBBLES>(panel, tile),
            PanelQuants::FiveBits => panel_tile::<T, FIVE_BITS>(panel, tile),
            PanelQuants::SixBits => panel_tile::<T, SIX_BITS>(panel, tile),
            PanelQuants::Bytes => unreachable!("no wasm panel for Q8_0"),
        };
        for (k, [lo, hi]) in sums.into_iter().enumerate() {
            let o = &mut out[(t + k) * PANEL_ROWS..(t + k + 1) * PANEL_ROWS];
            // SAFETY: 8 floats, two unaligned stores.
            unsafe {
                v128_store(o.as_mut_ptr() as *mut v128, lo);
                v128_store(o.as_mut_ptr().add(4) as *mut v128, hi);
            }
        }
    });
}

/// `PanelQuants` as const parameters of `panel_tile`.
const NIBBLES: u8 = 0;
const SIX_BITS: u8 = 2;
const FIVE_BITS: u8 = 3;

/// The activations split into x⁺ and x⁻ (elements 0..16 and 16..32 each), as the relaxed-simd
/// tiles split them for Q8_0.
#[inline(always)]
fn split(a: &BlockQ8) -> [v128; 4] {
    <super::relaxed_simd::Bytes as Products>::acts(a, true)
}

/// Word `j` (0..8) of a 32-byte vector pair, in every lane.
#[inline(always)]
fn word(v: &[v128], j: usize) -> v128 {
    let h = v[j / 4];
    match j % 4 {
        0 => i32x4_shuffle::<0, 0, 0, 0>(h, h),
        1 => i32x4_shuffle::<1, 1, 1, 1>(h, h),
        2 => i32x4_shuffle::<2, 2, 2, 2>(h, h),
        _ => i32x4_shuffle::<3, 3, 3, 3>(h, h),
    }
}

/// The panel times `T` activation vectors: for each, rows 0..4 and 4..8's dot products. Each
/// `i16x8.relaxed_dot_i8x16_i7x16_s` of a half with 4 activation bytes splatted gives lanes 2r
/// and 2r + 1 = row r's two pairs of products; unsigned weights add a whole block of them in 16
/// bits (nibbles: 8 x 2 x 15 x 127 < 2^15; five bits: half a block) before one widening add,
/// Q6_K's 16 weights before the `dot_i16x8` that applies their scale.
// Token t's registers are indexed in lockstep with its activations: ranges read better here.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn panel_tile<const T: usize, const KIND: u8>(
    panel: &Panel,
    acts: [&[BlockQ8]; T],
) -> [[v128; 2]; T] {
    let zero = i32x4_splat(0);
    let mut acc = [[f32x4_splat(0.0); 2]; T];
    // Words (4 weights) a 16-bit sum holds before it is widened.
    let run = if KIND == NIBBLES { 8 } else { 4 };
    let quants = panel.quants.as_ptr();
    for b in 0..panel.scales.len() {
        // SAFETY: block b < scales.len() of the panel (8 words each) and of every activation
        // vector (checked by the caller); each load is 16 of 32 bytes or 4 of an activation
        // block's 32.
        let half = |j: usize, h: usize| unsafe {
            v128_load((*quants.add(b * 8 + j)).as_ptr().add(16 * h) as *const v128)
        };
        let act = |t: usize| unsafe { acts[t].get_unchecked(b) };
        let xs: [[v128; 4]; T] =
            if KIND == SIX_BITS { std::array::from_fn(|t| split(act(t))) } else { [[zero; 4]; T] };
        let mut isum = [[zero; 2]; T];
        for g in 0..8 / run {
            let mut s16 = [[zero; 2]; T];
            for j in run * g..run * (g + 1) {
                let w = [half(j, 0), half(j, 1)];
                for t in 0..T {
                    if KIND == SIX_BITS {
                        // Signed weights against x⁺ and x⁻: every partial sum of true products
                        // fits 16 bits (at most 8 of 32 x 127), so the wrapping sums are exact.
                        let (p, m) = (word(&xs[t][..2], j), word(&xs[t][2..], j));
                        for h in 0..2 {
                            let d = i16x8_sub(
                                i16x8_relaxed_dot_i8x16_i7x16(w[h], p),
                                i16x8_relaxed_dot_i8x16_i7x16(w[h], m),
                            );
                            s16[t][h] = i16x8_add(s16[t][h], d);
                        }
                    } else {
                        let qs = act(t).qs.as_ptr();
                        // SAFETY: bytes 4j..4j + 4 of 32.
                        let x = unsafe { v128_load32_splat(qs.add(4 * j) as *const u32) };
                        for h in 0..2 {
                            let d = i16x8_relaxed_dot_i8x16_i7x16(x, w[h]);
                            s16[t][h] = i16x8_add(s16[t][h], d);
                        }
                    }
                }
            }
            for h in 0..2 {
                if KIND == SIX_BITS {
                    // Lanes 2r and 2r + 1 hold row r's scale: one `dot_i16x8` applies it.
                    let s = panel.int_scales[2 * b + g][8 * h..].as_ptr();
                    // SAFETY: 8 of the 16 i16.
                    let scale = unsafe { v128_load(s as *const v128) };
                    for t in 0..T {
                        isum[t][h] = i32x4_add(isum[t][h], i32x4_dot_i16x8(s16[t][h], scale));
                    }
                } else {
                    for t in 0..T {
                        let wide = i32x4_extadd_pairwise_i16x8(s16[t][h]);
                        isum[t][h] = i32x4_add(isum[t][h], wide);
                    }
                }
            }
        }
        let floats = |v: &[f32; PANEL_ROWS], h: usize| unsafe {
            // SAFETY: 4 of the 8 floats.
            v128_load(v[4 * h..].as_ptr() as *const v128)
        };
        for h in 0..2 {
            let d = floats(&panel.scales[b], h);
            let m = floats(&panel.offsets[b], h);
            for t in 0..T {
                let a = act(t);
                let scale = f32x4_mul(d, f32x4_splat(a.d));
                let sum = f32x4_mul(f32x4_convert_i32x4(isum[t][h]), scale);
                acc[t][h] = f32x4_add(acc[t][h], sum);
                if KIND != SIX_BITS {
                    // w = d q - m, so sum(w x) = da (d sum(q xq) - m sum(xq)).
                    let offset = f32x4_mul(m, f32x4_splat(a.d * a.sum as f32));
                    acc[t][h] = f32x4_sub(acc[t][h], offset);
                }
            }
        }
    }
    acc
}

/// 4 rows' 4 words each to 4 vectors of the rows' word j each.
#[inline(always)]
fn transpose4(v: [v128; 4]) -> [v128; 4] {
    let t0 = i32x4_shuffle::<0, 4, 1, 5>(v[0], v[1]);
    let t1 = i32x4_shuffle::<2, 6, 3, 7>(v[0], v[1]);
    let t2 = i32x4_shuffle::<0, 4, 1, 5>(v[2], v[3]);
    let t3 = i32x4_shuffle::<2, 6, 3, 7>(v[2], v[3]);
    [
        i32x4_shuffle::<0, 1, 4, 5>(t0, t2),
        i32x4_shuffle::<2, 3, 6, 7>(t0, t2),
        i32x4_shuffle::<0, 1, 4, 5>(t1, t3),
        i32x4_shuffle::<2, 3, 6, 7>(t1, t3),
    ]
}

/// Store a block's 32 weights of the 8 rows (`w[r]`: elements 0..16 and 16..32) interleaved, as
/// words `at..at + 8`.
// e (elements 0..16 or 16..32) and h (rows 0..4 or 4..8) index both the weights and the panel.
#[allow(clippy::needless_range_loop)]
fn store(panel: &mut Panel, at: usize, w: &[[v128; 2]; PANEL_ROWS]) {
    for e in 0..2 {
        for h in 0..2 {
            let words = transpose4(std::array::from_fn(|r| w[4 * h + r][e]));
            for (k, v) in words.into_iter().enumerate() {
                let dst = &mut panel.quants[at + 4 * e + k][16 * h..];
                // SAFETY: 16 of the 32 bytes.
                unsafe { v128_store(dst.as_mut_ptr() as *mut v128, v) };
            }
        }
    }
}

/// Q6_K's 256 weights of one super-block as q − 32 (−32..=31), in order (llama.cpp's layout:
/// 128 bytes of low nibbles, 64 of high bit pairs, per half of 128).
fn q6_k_weights(b: &[u8]) -> [i8; QK_K] {
    let mut w = [0i8; QK_K];
    for half in 0..2 {
        let (ql, qh) = (&b[64 * half..64 * half + 64], &b[128 + 32 * half..128 + 32 * half + 32]);
        let out = &mut w[128 * half..128 * half + 128];
        for l in 0..32 {
            let q = |low: u8, shift: u32| ((low & 0x0f) | (((qh[l] >> shift) & 3) << 4)) as i8 - 32;
            out[l] = q(ql[l], 0);
            out[l + 32] = q(ql[l + 32], 2);
            out[l + 64] = q(ql[l] >> 4, 4);
            out[l + 96] = q(ql[l + 32] >> 4, 6);
        }
    }
    w
}

/// Unpack and interleave 8 rows of `ty` into `panel` (rows of equal length).
// Row r's weights, scales and offsets are indexed in lockstep: ranges read better here.
#[allow(clippy::needless_range_loop)]
fn pack(ty: GgmlType, rows: [&[u8]; PANEL_ROWS], panel: &mut Panel) {
    let bb = ty.block_bytes();
    let per_block = ty.block_size() / QK8;
    assert!(rows.iter().all(|r| r.len() == rows[0].len()), "panel: rows of equal length");
    let nb = rows[0].len() / bb * per_block;
    panel.quants.resize(nb * 8, [0; 32]);
    panel.scales.resize(nb, [0.0; 8]);
    panel.offsets.resize(nb, [0.0; 8]);
    panel.kind = match ty {
        GgmlType::Q6_K => PanelQuants::SixBits,
        GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5_K => PanelQuants::FiveBits,
        _ => PanelQuants::Nibbles,
    };
    let block = |r: usize, sb: usize| &rows[r][sb * bb..(sb + 1) * bb];
    let zero = i8x16_splat(0);
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q5_1 => {
            for b in 0..nb {
                let mut w = [[zero; 2]; PANEL_ROWS];
                for r in 0..PANEL_ROWS {
                    let p = block(r, b);
                    let d = f16_at(p, 0);
                    let (lo, hi, offset) = match ty {
                        GgmlType::Q4_0 => {
                            let bytes = load(p, 2);
                            (v128_and(bytes, u8x16_splat(0x0f)), high_nibbles(bytes), 8.0 * d)
                        }
                        GgmlType::Q5_0 => {
                            let (lo, hi) = five_bit_weights(&p[2..22]);
                            (lo, hi, 16.0 * d)
                        }
                        // w = d q + m: the offset subtracted is -m.
                        _ => {
                            let (lo, hi) = five_bit_weights(&p[4..24]);
                            (lo, hi, -f16_at(p, 2))
                        }
                    };
                    w[r] = [lo, hi];
                    panel.scales[b][r] = d;
                    panel.offsets[b][r] = offset;
                }
                store(panel, b * 8, &w);
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            // Q5_K: the fifth bits (32 bytes; bit j of byte l: element l of sub-block j) sit
            // between the scales and the nibbles.
            let five = ty == GgmlType::Q5_K;
            let qs = if five { 48 } else { 16 };
            for sb in 0..nb / per_block {
                let mut w = [[[zero; 2]; PANEL_ROWS]; 8];
                for r in 0..PANEL_ROWS {
                    let p = block(r, sb);
                    let (d, dmin) = (f16_at(p, 0), f16_at(p, 2));
                    let (scales, mins) = q4_k_scales_mins(&p[4..16]);
                    let high = if five { [load(p, 16), load(p, 32)] } else { [zero; 2] };
                    for j in 0..8 {
                        // Each 32 bytes of nibbles hold sub-blocks 2c (low) and 2c + 1 (high).
                        let c = j / 2;
                        for e in 0..2 {
                            let bytes = load(p, qs + 32 * c + 16 * e);
                            let mut v = if j % 2 == 0 {
                                v128_and(bytes, u8x16_splat(0x0f))
                            } else {
                                high_nibbles(bytes)
                            };
                            if five {
                                // Bit j moved to bit 4, by word shifts.
                                let bit = i16x8_shl(u16x8_shr(high[e], j as u32), 4);
                                v = v128_or(v, v128_and(bit, u8x16_splat(0x10)));
                            }
                            w[j][r][e] = v;
                        }
                        let byte = |v: u64| (v >> (8 * j)) as u8 as f32;
                        panel.scales[sb * 8 + j][r] = d * byte(scales);
                        panel.offsets[sb * 8 + j][r] = dmin * byte(mins);
                    }
                }
                for (j, w) in w.iter().enumerate() {
                    store(panel, (sb * 8 + j) * 8, w);
                }
            }
        }
        GgmlType::Q6_K => {
            panel.int_scales.resize(2 * nb, [0; 16]);
            for sb in 0..nb / per_block {
                let weights: [[i8; QK_K]; PANEL_ROWS] =
                    std::array::from_fn(|r| q6_k_weights(block(r, sb)));
                for kb in 0..8 {
                    let b = sb * 8 + kb;
                    let w = std::array::from_fn(|r| {
                        let e = &weights[r][32 * kb..];
                        [0, 16].map(|at| {
                            // SAFETY: 16 of the 32 weights of block kb.
                            unsafe { v128_load(e[at..].as_ptr() as *const v128) }
                        })
                    });
                    store(panel, b * 8, &w);
                    for r in 0..PANEL_ROWS {
                        let p = block(r, sb);
                        panel.scales[b][r] = f16_at(p, 208);
                        panel.offsets[b][r] = 0.0;
                        // Block kb's first 16 weights take scale 2 kb, the rest 2 kb + 1.
                        for h in 0..2 {
                            let sc = p[192 + 2 * kb + h] as i8 as i16;
                            panel.int_scales[2 * b + h][2 * r] = sc;
                            panel.int_scales[2 * b + h][2 * r + 1] = sc;
                        }
                    }
                }
            }
        }
        other => panic!("panel: no wasm panel for {}", other.name()),
    }
}
