//! wasm32 relaxed-simd tiles (the build with `-C target-feature=+simd128,+relaxed-simd`, which
//! pages load where the browser validates it): the int8 products of simd128's tiles through
//! `i16x8.relaxed_dot_i8x16_i7x16_s`, which multiplies bytes pairwise and adds each pair into an
//! i16 (one `pmaddubsw` on x86, `sdot`-class on ARM) where simd128 widens both operands to i16
//! first. Everything else is simd128's: the same tile loops (generic over [`Products`]) and the
//! same kernels for the rest.
//!
//! The instruction is "relaxed" in its second operand: a byte with its top bit set may be read as
//! signed or unsigned, and a pair's sum may saturate or wrap, depending on the CPU. Used here only
//! where neither can happen, so every browser computes the same sums as the scalar oracle:
//! - the second operand is always 0..=127: the unsigned weights (Q4_0, Q5_0, Q5_1, Q4_K, Q5_K:
//!   0..=31) against the signed activations; Q8_0's signed weights against the activations split
//!   into x = x⁺ − x⁻ (both 0..=127, since the activation quantiser gives −127..=127), two products
//!   subtracted, which is exact for every weight byte, −128 included (AVX2's sign trick would need
//!   |w| ≤ 127 here);
//! - each pair's sum is at most 2 · 128 · 127 = 32512 in magnitude, inside i16.
//!
//! Q6_K (0..=63 stored as q − 32, with 16-element scales) keeps simd128's tile.

use super::simd128::{high_nibbles, load_qs, tiles_with, Constants, Products};
use super::*;
use std::arch::wasm32::*;

/// Whether [`dot_q8_tile`] has a relaxed-simd tile for `ty` (the others take simd128's): all of
/// simd128's but Q6_K.
pub fn has_tile(ty: GgmlType) -> bool {
    super::simd128::has_tile(ty) && ty != GgmlType::Q6_K
}

/// See `kernels::dot_q8_tile`; `R` a multiple of 4, the types of [`has_tile`].
pub fn dot_q8_tile<const R: usize, const T: usize>(
    ty: GgmlType,
    rows: [&[u8]; R],
    acts: [&[BlockQ8]; T],
) -> [[f32; T]; R] {
    assert!(has_tile(ty), "dot_q8_tile: no relaxed-simd tile for {}", ty.name());
    tiles_with::<R, T, Bytes>(ty, rows, acts)
}

/// Products of bytes: the weights stay two vectors of 16 bytes.
pub(super) struct Bytes;

/// Pairwise products of the signed bytes `a` and the bytes `b` (each 0..=127), each pair summed
/// into an i16.
#[inline(always)]
fn pairs(a: v128, b: v128) -> v128 {
    i16x8_relaxed_dot_i8x16_i7x16(a, b)
}

/// Unsigned weights (0..=31) by the activations: the two halves' pairs added in i16 (a pair is
/// at most 2 · 31 · 128, the sum 15872).
#[inline(always)]
fn unsigned_pairs(w: &(v128, v128), x: &[v128; 4]) -> v128 {
    i16x8_add(pairs(x[0], w.0), pairs(x[1], w.1))
}

fn low_nibbles(bytes: v128) -> v128 {
    v128_and(bytes, u8x16_splat(0x0f))
}

impl Products for Bytes {
    type W = (v128, v128);
    /// The activations (signed weights: x⁺ and x⁻ as the quantiser split them, `BlockQ8::split`,
    /// elements 0..16 and 16..32; unsigned weights: the activations themselves, twice).
    type X = [v128; 4];
    #[inline(always)]
    fn signed(lo: v128, hi: v128) -> (v128, v128) {
        (lo, hi)
    }
    #[inline(always)]
    fn unsigned(lo: v128, hi: v128) -> (v128, v128) {
        (lo, hi)
    }
    #[inline(always)]
    fn nibbles(bytes: v128) -> (v128, v128) {
        (low_nibbles(bytes), high_nibbles(bytes))
    }
    #[inline(always)]
    fn sub_block(q0: v128, q1: v128, high: bool, fifth: Option<(v128, v128, u32)>) -> (v128, v128) {
        let nibbles = |q| if high { high_nibbles(q) } else { low_nibbles(q) };
        let (w0, w1) = (nibbles(q0), nibbles(q1));
        match fifth {
            Some((h0, h1, j)) => {
                // Bit j of each byte moved to bit 4, by word shifts (see `high_nibbles`).
                let bit = |h| v128_and(i16x8_shl(u16x8_shr(h, j), 4), u8x16_splat(0x10));
                (v128_or(w0, bit(h0)), v128_or(w1, bit(h1)))
            }
            None => (w0, w1),
        }
    }
    #[inline(always)]
    fn acts(a: &BlockQ8, signed: bool) -> [v128; 4] {
        if signed {
            // SAFETY: each load is 16 of a split's 32 bytes; v128_load takes any alignment.
            let half =
                |s: &[i8; QK8], at: usize| unsafe { v128_load(s[at..].as_ptr() as *const v128) };
            let [plus, minus] = &a.split;
            [half(plus, 0), half(plus, 16), half(minus, 0), half(minus, 16)]
        } else {
            let (x0, x1) = (load_qs(a, 0), load_qs(a, 16));
            [x0, x1, x0, x1]
        }
    }
    #[inline(always)]
    fn dot(w: &(v128, v128), x: &[v128; 4], signed: bool, k: &Constants) -> v128 {
        // Pairs of i16 added into i32 by a multiply-add with ones: V8's `extadd_pairwise` is
        // that instruction with its operand's address built at each use.
        let widen = |v| i32x4_dot_i16x8(v, k.ones_i16);
        if signed {
            // Each pair: w0 x0 + w1 x1 = (w0 x0⁺ + w1 x1⁺) − (w0 x0⁻ + w1 x1⁻); all three fit i16,
            // so the wrapping difference is exact.
            let lo = i16x8_sub(pairs(w.0, x[0]), pairs(w.0, x[2]));
            let hi = i16x8_sub(pairs(w.1, x[1]), pairs(w.1, x[3]));
            i32x4_add(widen(lo), widen(hi))
        } else {
            widen(unsigned_pairs(w, x))
        }
    }
    #[inline(always)]
    fn dot_scaled(w: &(v128, v128), x: &[v128; 4], scale: v128) -> v128 {
        // The pairs times the scale (at most 63) in the multiply-add that widens them to i32.
        i32x4_dot_i16x8(unsigned_pairs(w, x), scale)
    }
}
