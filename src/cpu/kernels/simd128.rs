//! wasm32 simd128 kernels (picked at compile time with `-C target-feature=+simd128`).

use super::*;
use std::arch::wasm32::*;

fn hsum_i32(v: v128) -> i32 {
    i32x4_extract_lane::<0>(v) + i32x4_extract_lane::<1>(v) + i32x4_extract_lane::<2>(v) + i32x4_extract_lane::<3>(v)
}

fn hsum_f32(v: v128) -> f32 {
    f32x4_extract_lane::<0>(v) + f32x4_extract_lane::<1>(v) + f32x4_extract_lane::<2>(v) + f32x4_extract_lane::<3>(v)
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

pub fn dot_q8(ty: GgmlType, row: &[u8], act: &[BlockQ8]) -> f32 {
    match ty {
        GgmlType::Q8_0 => row
            .chunks_exact(34)
            .zip(act)
            .map(|(b, a)| {
                let s = i32x4_add(mul16(load(b, 2), load_qs(a, 0)), mul16(load(b, 18), load_qs(a, 16)));
                f16_at(b, 0) * a.d * hsum_i32(s) as f32
            })
            .sum(),
        GgmlType::Q4_0 => row
            .chunks_exact(18)
            .zip(act)
            .map(|(b, a)| {
                let bytes = load(b, 2);
                let eight = i8x16_splat(8);
                let lo = i8x16_sub(v128_and(bytes, i8x16_splat(0x0f)), eight);
                let hi = i8x16_sub(u8x16_shr(bytes, 4), eight);
                let s = i32x4_add(mul16(lo, load_qs(a, 0)), mul16(hi, load_qs(a, 16)));
                f16_at(b, 0) * a.d * hsum_i32(s) as f32
            })
            .sum(),
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
