//! aarch64 NEON kernels (picked at run time; every aarch64 Linux and macOS machine has NEON).
//!
//! The int8 products widen with `vmull_s8` and pair-add into i32 with `vpadalq_s16`, as
//! llama.cpp does without the dotprod extension: the `sdot` intrinsic (`vdotq_s32`) is still
//! unstable in Rust. Loads go through bounds-checked slices, so a short row panics instead of
//! reading past it.

use super::*;
use std::arch::aarch64::*;

/// 16 bytes at `at`.
#[inline]
#[target_feature(enable = "neon")]
fn load(b: &[u8], at: usize) -> uint8x16_t {
    let s = &b[at..at + 16];
    // SAFETY: `s` is 16 bytes; vld1q_u8 has no alignment requirement.
    unsafe { vld1q_u8(s.as_ptr()) }
}

/// An activation block's 32 int8s, as two vectors.
#[inline]
#[target_feature(enable = "neon")]
fn load_qs(a: &BlockQ8) -> [int8x16_t; 2] {
    // SAFETY: `qs` is 32 bytes.
    unsafe { [vld1q_s8(a.qs.as_ptr()), vld1q_s8(a.qs.as_ptr().add(16))] }
}

/// Bits 0..16 of `bits` as 16 bytes, 0x10 where the bit is set (Q5_0's and Q5_1's fifth bits).
#[inline]
#[target_feature(enable = "neon")]
fn fifth_bits(bits: u16) -> uint8x16_t {
    const BIT: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
    let [lo, hi] = bits.to_le_bytes();
    let spread = vcombine_u8(vdup_n_u8(lo), vdup_n_u8(hi));
    // SAFETY: BIT is 16 bytes; vld1q_u8 has no alignment requirement.
    let bit = unsafe { vld1q_u8(BIT.as_ptr()) };
    vandq_u8(vtstq_u8(spread, bit), vdupq_n_u8(0x10))
}

/// Q5_0's and Q5_1's 32 weights (0..31) from their `qh` and 16 bytes of nibbles (20 bytes from
/// `b`), as two vectors: elements 0..16 and 16..32.
#[inline]
#[target_feature(enable = "neon")]
fn five_bit_weights(b: &[u8]) -> [int8x16_t; 2] {
    let qh = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let (bytes, m4) = (load(b, 4), vdupq_n_u8(0x0f));
    let lo = vorrq_u8(vandq_u8(bytes, m4), fifth_bits(qh as u16));
    let hi = vorrq_u8(vshrq_n_u8::<4>(bytes), fifth_bits((qh >> 16) as u16));
    [signed(lo), signed(hi)]
}

#[inline]
#[target_feature(enable = "neon")]
fn signed(v: uint8x16_t) -> int8x16_t {
    vreinterpretq_s8_u8(v)
}

/// 16 int8 x 16 int8 added into 4 i32 lanes. Each product fits in i16 (at most -128 * -128 =
/// 2^14), so widening once and pair-adding into i32 cannot overflow, whatever bytes a file holds.
#[inline]
#[target_feature(enable = "neon")]
fn dot16(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
    let lo = vmull_s8(vget_low_s8(w), vget_low_s8(x));
    vpadalq_s16(vpadalq_s16(acc, lo), vmull_high_s8(w, x))
}

/// 32 int8 weights times one activation block, as 4 i32 partial sums.
#[inline]
#[target_feature(enable = "neon")]
fn dot32(w: [int8x16_t; 2], a: &BlockQ8) -> int32x4_t {
    let x = load_qs(a);
    dot16(dot16(vdupq_n_s32(0), w[0], x[0]), w[1], x[1])
}

#[target_feature(enable = "neon")]
pub unsafe fn dot_q8(ty: GgmlType, row: &[u8], act: &[BlockQ8]) -> f32 {
    // Per-block integer sums are scaled into a float vector; one horizontal add at the end.
    let mut acc = vdupq_n_f32(0.0);
    let mut offset = 0f32;
    let m4 = vdupq_n_u8(0x0f);
    match ty {
        GgmlType::Q8_0 => {
            for (b, a) in row.chunks_exact(34).zip(act) {
                let s = dot32([signed(load(b, 2)), signed(load(b, 18))], a);
                acc = vfmaq_n_f32(acc, vcvtq_f32_s32(s), f16_at(b, 0) * a.d);
            }
        }
        GgmlType::Q4_0 => {
            for (b, a) in row.chunks_exact(18).zip(act) {
                // Low nibbles are elements 0..16, high nibbles 16..32; values 0..15 (offset 8).
                let bytes = load(b, 2);
                let s = dot32([signed(vandq_u8(bytes, m4)), signed(vshrq_n_u8::<4>(bytes))], a);
                let d = f16_at(b, 0) * a.d;
                acc = vfmaq_n_f32(acc, vcvtq_f32_s32(s), d);
                // sum((q - 8) * x) = sum(q * x) - 8 * sum(x)
                offset += d * (8 * a.sum) as f32;
            }
        }
        GgmlType::Q5_0 => {
            for (b, a) in row.chunks_exact(22).zip(act) {
                // Q4_0's nibbles with the fifth bits of qh; offset 16.
                let s = dot32(five_bit_weights(&b[2..22]), a);
                let d = f16_at(b, 0) * a.d;
                acc = vfmaq_n_f32(acc, vcvtq_f32_s32(s), d);
                offset += d * (16 * a.sum) as f32;
            }
        }
        GgmlType::Q5_1 => {
            for (b, a) in row.chunks_exact(24).zip(act) {
                // Q5_0's layout after d and m; w = d q + m, so + m sum(x).
                let s = dot32(five_bit_weights(&b[4..24]), a);
                acc = vfmaq_n_f32(acc, vcvtq_f32_s32(s), f16_at(b, 0) * a.d);
                offset -= f16_at(b, 2) * a.d * a.sum as f32;
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            // Q5_K: 32 bytes of fifth bits (bit j of byte l: element l of sub-block j) between
            // the scales and the nibbles.
            let five = ty == GgmlType::Q5_K;
            let (bb, qs) = if five { (176, 48) } else { (144, 16) };
            let one = vdupq_n_u8(1);
            for (b, a) in row.chunks_exact(bb).zip(act.chunks_exact(QK_K / QK8)) {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let high = if five { [load(b, 16), load(b, 32)] } else { [vdupq_n_u8(0); 2] };
                for chunk in 0..4 {
                    // 32 bytes: low nibbles are sub-block 2 * chunk, high nibbles 2 * chunk + 1.
                    let q = [load(b, qs + chunk * 32), load(b, qs + 16 + chunk * 32)];
                    let lo = [vandq_u8(q[0], m4), vandq_u8(q[1], m4)];
                    let hi = [vshrq_n_u8::<4>(q[0]), vshrq_n_u8::<4>(q[1])];
                    for (j, w) in [(2 * chunk, lo), (2 * chunk + 1, hi)] {
                        let shift = vdupq_n_s8(-(j as i8));
                        let w = [0, 1].map(|i| {
                            let bit = vandq_u8(vshlq_u8(high[i], shift), one);
                            signed(vorrq_u8(w[i], vshlq_n_u8::<4>(bit)))
                        });
                        let (sc, m) = q4_k_scale_min(j, &b[4..16]);
                        let aj = &a[j];
                        acc = vfmaq_n_f32(acc, vcvtq_f32_s32(dot32(w, aj)), d * sc as f32 * aj.d);
                        offset += dmin * m as f32 * aj.d * aj.sum as f32;
                    }
                }
            }
        }
        GgmlType::Q6_K => {
            let (m2, m32) = (vdupq_n_u8(3), vdupq_n_s8(32));
            for (b, a) in row.chunks_exact(210).zip(act.chunks_exact(QK_K / QK8)) {
                let d = f16_at(b, 208);
                for half in 0..2 {
                    let ql = [0, 16, 32, 48].map(|at| load(b, half * 64 + at));
                    let qh = [load(b, 128 + half * 32), load(b, 144 + half * 32)];
                    let sc = &b[192 + half * 8..200 + half * 8];
                    for k in 0..4 {
                        // Sub-block pair k: 4 low bits from ql[0..32] (k even) or ql[32..64] (k
                        // odd), low nibbles for k < 2, high for k >= 2; 2 high bits at qh >> 2k.
                        let shift = vdupq_n_s8(-2 * k as i8);
                        let w = [0, 1].map(|i| {
                            let l = ql[(k % 2) * 2 + i];
                            let low = if k < 2 { vandq_u8(l, m4) } else { vshrq_n_u8::<4>(l) };
                            let high = vshlq_n_u8::<4>(vandq_u8(vshlq_u8(qh[i], shift), m2));
                            vsubq_s8(signed(vorrq_u8(low, high)), m32)
                        });
                        // Elements 0..16 have scale sc[2k], 16..32 sc[2k + 1].
                        let ak = &a[half * 4 + k];
                        let x = load_qs(ak);
                        let zero = vdupq_n_s32(0);
                        let s0 = vmulq_n_s32(dot16(zero, w[0], x[0]), (sc[2 * k] as i8) as i32);
                        let s =
                            vmlaq_n_s32(s0, dot16(zero, w[1], x[1]), (sc[2 * k + 1] as i8) as i32);
                        acc = vfmaq_n_f32(acc, vcvtq_f32_s32(s), d * ak.d);
                    }
                }
            }
        }
        _ => return scalar::dot_q8(ty, row, act),
    }
    vaddvq_f32(acc) - offset
}

/// Eight floats from `w` (32 bytes of F32 or 16 of BF16; a BF16 is the top half of an f32).
#[inline]
#[target_feature(enable = "neon")]
fn load_8_weights(ty: GgmlType, w: &[u8]) -> [float32x4_t; 2] {
    if ty == GgmlType::F32 {
        [vreinterpretq_f32_u8(load(w, 0)), vreinterpretq_f32_u8(load(w, 16))]
    } else {
        let h = vreinterpretq_u16_u8(load(w, 0));
        [
            vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(h))),
            vreinterpretq_f32_u32(vshll_high_n_u16::<16>(h)),
        ]
    }
}

#[inline]
#[target_feature(enable = "neon")]
fn load_f32(x: &[f32]) -> float32x4_t {
    let s = &x[..4];
    // SAFETY: `s` is 4 floats.
    unsafe { vld1q_f32(s.as_ptr()) }
}

/// F32 and BF16 in registers; F16 is scalar (the f16 vector types are unstable in Rust).
#[target_feature(enable = "neon")]
pub unsafe fn dot_float_row(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    let width = match ty {
        GgmlType::F32 => 4,
        GgmlType::BF16 => 2,
        _ => return scalar::dot_float_row(ty, row, x),
    };
    let (mut acc0, mut acc1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
    for (w, v) in row.chunks_exact(8 * width).zip(x.chunks_exact(8)) {
        let w = load_8_weights(ty, w);
        acc0 = vfmaq_f32(acc0, w[0], load_f32(v));
        acc1 = vfmaq_f32(acc1, w[1], load_f32(&v[4..]));
    }
    let main = (x.len() / 8 * 8).min(row.len() / width / 8 * 8);
    vaddvq_f32(vaddq_f32(acc0, acc1)) + scalar::dot_float_row(ty, &row[main * width..], &x[main..])
}

#[target_feature(enable = "neon")]
pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let (mut acc0, mut acc1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
    for (u, v) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        acc0 = vfmaq_f32(acc0, load_f32(u), load_f32(v));
        acc1 = vfmaq_f32(acc1, load_f32(&u[4..]), load_f32(&v[4..]));
    }
    let main = a.len().min(b.len()) / 8 * 8;
    vaddvq_f32(vaddq_f32(acc0, acc1)) + scalar::dot_f32(&a[main..], &b[main..])
}

#[target_feature(enable = "neon")]
pub unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yc, xc) in y.chunks_exact_mut(4).zip(x.chunks_exact(4)) {
        let r = vfmaq_n_f32(load_f32(yc), load_f32(xc), a);
        // SAFETY: `yc` is 4 floats.
        unsafe { vst1q_f32(yc.as_mut_ptr(), r) };
    }
    let main = x.len().min(y.len()) / 4 * 4;
    scalar::axpy(a, &x[main..], &mut y[main..]);
}
