//! wasm32 simd128 kernels (picked at compile time with `-C target-feature=+simd128`).

use super::*;
use std::arch::wasm32::*;

fn hsum_i32(v: v128) -> i32 {
    i32x4_extract_lane::<0>(v)
        + i32x4_extract_lane::<1>(v)
        + i32x4_extract_lane::<2>(v)
        + i32x4_extract_lane::<3>(v)
}

fn hsum_f32(v: v128) -> f32 {
    f32x4_extract_lane::<0>(v)
        + f32x4_extract_lane::<1>(v)
        + f32x4_extract_lane::<2>(v)
        + f32x4_extract_lane::<3>(v)
}

/// 16 signed int8 x 16 signed int8 -> 4 i32 partial sums.
fn mul16(w: v128, x: v128) -> v128 {
    i32x4_add(
        i32x4_extadd_pairwise_i16x8(i16x8_extmul_low_i8x16(w, x)),
        i32x4_extadd_pairwise_i16x8(i16x8_extmul_high_i8x16(w, x)),
    )
}

fn load(b: &[u8], at: usize) -> v128 {
    // SAFETY: callers pass at + 16 <= b.len() (whole blocks); v128_load is unaligned.
    unsafe { v128_load(b[at..at + 16].as_ptr() as *const v128) }
}

fn load_qs(a: &BlockQ8, at: usize) -> v128 {
    // SAFETY: at is 0 or 16 of 32 bytes.
    unsafe { v128_load(a.qs[at..at + 16].as_ptr() as *const v128) }
}

/// 32 int8 weights (two vectors) times one activation block, as 4 i32 partial sums.
fn dot32(w0: v128, w1: v128, a: &BlockQ8) -> v128 {
    i32x4_add(mul16(w0, load_qs(a, 0)), mul16(w1, load_qs(a, 16)))
}

pub fn dot_q8(ty: GgmlType, row: &[u8], act: &[BlockQ8]) -> f32 {
    match ty {
        GgmlType::Q8_0 => row
            .chunks_exact(34)
            .zip(act)
            .map(|(b, a)| f16_at(b, 0) * a.d * hsum_i32(dot32(load(b, 2), load(b, 18), a)) as f32)
            .sum(),
        GgmlType::Q4_0 => row
            .chunks_exact(18)
            .zip(act)
            .map(|(b, a)| {
                let bytes = load(b, 2);
                let eight = i8x16_splat(8);
                let lo = i8x16_sub(v128_and(bytes, i8x16_splat(0x0f)), eight);
                let hi = i8x16_sub(u8x16_shr(bytes, 4), eight);
                f16_at(b, 0) * a.d * hsum_i32(dot32(lo, hi, a)) as f32
            })
            .sum(),
        GgmlType::Q4_K => {
            let mut acc = f32x4_splat(0.0);
            let mut mins = 0f32;
            let m4 = u8x16_splat(0x0f);
            for (b, a) in row.chunks_exact(144).zip(act.chunks_exact(QK_K / QK8)) {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                for chunk in 0..4 {
                    // 32 bytes: low nibbles are sub-block 2 * chunk, high nibbles 2 * chunk + 1.
                    let (q0, q1) = (load(b, 16 + chunk * 32), load(b, 32 + chunk * 32));
                    let lo = (v128_and(q0, m4), v128_and(q1, m4));
                    let hi = (u8x16_shr(q0, 4), u8x16_shr(q1, 4));
                    for (j, (w0, w1)) in [(2 * chunk, lo), (2 * chunk + 1, hi)] {
                        let (sc, m) = q4_k_scale_min(j, &b[4..16]);
                        let aj = &a[j];
                        let s = f32x4_convert_i32x4(dot32(w0, w1, aj));
                        acc = f32x4_add(acc, f32x4_mul(s, f32x4_splat(d * sc as f32 * aj.d)));
                        mins += dmin * m as f32 * aj.d * aj.sum as f32;
                    }
                }
            }
            hsum_f32(acc) - mins
        }
        GgmlType::Q6_K => {
            let mut acc = f32x4_splat(0.0);
            let (m4, m2, m32) = (u8x16_splat(0x0f), u8x16_splat(3), i8x16_splat(32));
            for (b, a) in row.chunks_exact(210).zip(act.chunks_exact(QK_K / QK8)) {
                let d = f16_at(b, 208);
                for half in 0..2 {
                    let ql = [0, 16, 32, 48].map(|at| load(b, half * 64 + at));
                    let qh = [load(b, 128 + half * 32), load(b, 144 + half * 32)];
                    let sc = &b[192 + half * 8..200 + half * 8];
                    for k in 0..4 {
                        // Sub-block pair k: 4 low bits from ql[0..32] (k even) or ql[32..64] (k
                        // odd), low nibbles for k < 2, high for k >= 2; 2 high bits at qh >> 2k.
                        let w = [0, 1].map(|i| {
                            let l = ql[(k % 2) * 2 + i];
                            let low = if k < 2 { v128_and(l, m4) } else { u8x16_shr(l, 4) };
                            let high = i8x16_shl(v128_and(u8x16_shr(qh[i], 2 * k as u32), m2), 4);
                            i8x16_sub(v128_or(low, high), m32)
                        });
                        // Elements 0..16 have scale sc[2k], 16..32 sc[2k + 1].
                        let ak = &a[half * 4 + k];
                        let s0 = i32x4_mul(
                            mul16(w[0], load_qs(ak, 0)),
                            i32x4_splat((sc[2 * k] as i8) as i32),
                        );
                        let s1 = i32x4_mul(
                            mul16(w[1], load_qs(ak, 16)),
                            i32x4_splat((sc[2 * k + 1] as i8) as i32),
                        );
                        let s = f32x4_convert_i32x4(i32x4_add(s0, s1));
                        acc = f32x4_add(acc, f32x4_mul(s, f32x4_splat(d * ak.d)));
                    }
                }
            }
            hsum_f32(acc)
        }
        _ => scalar::dot_q8(ty, row, act),
    }
}

pub fn dot_float_row(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    match ty {
        GgmlType::F32 => {
            let main = x.len() / 4 * 4;
            let mut acc = f32x4_splat(0.0);
            for i in (0..main).step_by(4) {
                let w = load_f32x4(&row[i * 4..i * 4 + 16]);
                let v = load_f32x4_f(&x[i..i + 4]);
                acc = f32x4_add(acc, f32x4_mul(w, v));
            }
            hsum_f32(acc) + scalar::dot_float_row(ty, &row[main * 4..], &x[main..])
        }
        _ => scalar::dot_float_row(ty, row, x),
    }
}

fn load_f32x4(b: &[u8]) -> v128 {
    // SAFETY: b is 16 bytes.
    unsafe { v128_load(b.as_ptr() as *const v128) }
}

fn load_f32x4_f(b: &[f32]) -> v128 {
    // SAFETY: b is 4 floats.
    unsafe { v128_load(b.as_ptr() as *const v128) }
}

pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let main = n / 4 * 4;
    let mut acc = f32x4_splat(0.0);
    for i in (0..main).step_by(4) {
        acc = f32x4_add(acc, f32x4_mul(load_f32x4_f(&a[i..i + 4]), load_f32x4_f(&b[i..i + 4])));
    }
    hsum_f32(acc) + scalar::dot_f32(&a[main..n], &b[main..n])
}

pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    // No fused multiply-add in simd128 (it is in relaxed-simd), so this rounds like the scalar loop.
    let av = f32x4_splat(a);
    for (yc, xc) in y.chunks_exact_mut(4).zip(x.chunks_exact(4)) {
        let r = f32x4_add(load_f32x4_f(yc), f32x4_mul(av, load_f32x4_f(xc)));
        // SAFETY: yc is 4 floats; v128_store is unaligned.
        unsafe { v128_store(yc.as_mut_ptr() as *mut v128, r) };
    }
    let main = x.len().min(y.len()) / 4 * 4;
    scalar::axpy(a, &x[main..], &mut y[main..]);
}

/// Whether [`dot_q8_tile`] has a tiled kernel for `ty` (the others loop over `dot_q8`).
pub fn has_tile(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_0)
}

/// See `kernels::dot_q8_tile`: each weight block is unpacked once for the `T` vectors and each
/// activation block used for `R` rows. Q8_0 and Q4_0 (`has_tile`).
pub fn dot_q8_tile<const R: usize, const T: usize>(
    ty: GgmlType,
    rows: [&[u8]; R],
    acts: [&[BlockQ8]; T],
) -> [[f32; T]; R] {
    let nb = acts[0].len();
    let bb = ty.block_bytes();
    assert!(has_tile(ty), "dot_q8_tile: no simd128 tile for {}", ty.name());
    assert!(rows.iter().all(|r| r.len() >= nb * bb) && acts.iter().all(|a| a.len() == nb));
    let mut acc = [[f32x4_splat(0.0); T]; R];
    for i in 0..nb {
        let w: [(f32, v128, v128); R] = std::array::from_fn(|r| {
            let b = &rows[r][i * bb..(i + 1) * bb];
            if ty == GgmlType::Q8_0 {
                (f16_at(b, 0), load(b, 2), load(b, 18))
            } else {
                let bytes = load(b, 2);
                let eight = i8x16_splat(8);
                (
                    f16_at(b, 0),
                    i8x16_sub(v128_and(bytes, i8x16_splat(0x0f)), eight),
                    i8x16_sub(u8x16_shr(bytes, 4), eight),
                )
            }
        });
        for t in 0..T {
            let a = &acts[t][i];
            for r in 0..R {
                let s = f32x4_convert_i32x4(dot32(w[r].1, w[r].2, a));
                acc[r][t] = f32x4_add(acc[r][t], f32x4_mul(s, f32x4_splat(w[r].0 * a.d)));
            }
        }
    }
    std::array::from_fn(|r| std::array::from_fn(|t| hsum_f32(acc[r][t])))
}

/// f32 keys (the wasm build's cache; f16 goes to scalar), `q.len()` a multiple of 4.
pub fn attention_scores(q: &[f32], keys: KvRows, stride: usize, scale: f32, out: &mut [f32]) {
    let KvRows::F32(k) = keys else { return scalar::attention_scores(q, keys, stride, scale, out) };
    let d = q.len();
    for (p, s) in out.iter_mut().enumerate() {
        let kr = &k[p * stride..][..d];
        let mut acc = f32x4_splat(0.0);
        for i in (0..d).step_by(4) {
            acc =
                f32x4_add(acc, f32x4_mul(load_f32x4_f(&q[i..i + 4]), load_f32x4_f(&kr[i..i + 4])));
        }
        *s = hsum_f32(acc) * scale;
    }
}

/// f32 values, `out.len()` a multiple of 4: the output stays in registers (16 floats at a time)
/// while the values stream past.
pub fn attention_values(weights: &[f32], values: KvRows, stride: usize, out: &mut [f32]) {
    let KvRows::F32(v) = values else {
        return scalar::attention_values(weights, values, stride, out);
    };
    for (c, oc) in out.chunks_mut(16).enumerate() {
        let mut acc = [f32x4_splat(0.0); 4];
        let width = oc.len() / 4;
        for (p, &w) in weights.iter().enumerate() {
            let row = &v[p * stride + c * 16..][..oc.len()];
            let wv = f32x4_splat(w);
            for (k, a) in acc.iter_mut().enumerate().take(width) {
                *a = f32x4_add(*a, f32x4_mul(wv, load_f32x4_f(&row[4 * k..4 * k + 4])));
            }
        }
        for (k, a) in acc.iter().enumerate().take(width) {
            // SAFETY: 4 floats inside oc; v128_store is unaligned.
            unsafe { v128_store(oc[4 * k..4 * k + 4].as_mut_ptr() as *mut v128, *a) };
        }
    }
}
