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

pub(super) fn load(b: &[u8], at: usize) -> v128 {
    // SAFETY: callers pass at + 16 <= b.len() (whole blocks); v128_load is unaligned.
    unsafe { v128_load(b[at..at + 16].as_ptr() as *const v128) }
}

pub(super) fn load_qs(a: &BlockQ8, at: usize) -> v128 {
    // SAFETY: at is 0 or 16 of 32 bytes.
    unsafe { v128_load(a.qs[at..at + 16].as_ptr() as *const v128) }
}

/// The high nibbles of 16 bytes, shifted in 16-bit lanes and masked: x86 has no byte shift, and
/// V8's `i8x16.shr_u` is a word shift plus a mask it builds each time (Q4_0 decode through the
/// relaxed-simd tile: 73 against 86 tok/s in Chromium with this).
pub(super) fn high_nibbles(bytes: v128) -> v128 {
    v128_and(u16x8_shr(bytes, 4), u8x16_splat(0x0f))
}

/// Bits 0..16 of `bits` as 16 bytes, 0x10 where the bit is set (Q5_0's and Q5_1's fifth bits).
pub(super) fn fifth_bits(bits: u16) -> v128 {
    let twice = i8x16_shuffle::<0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1>(
        u16x8_splat(bits),
        u16x8_splat(bits),
    );
    let bit = u8x16(1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128);
    v128_and(i8x16_ne(v128_and(twice, bit), i8x16_splat(0)), i8x16_splat(0x10))
}

/// Q5_0's and Q5_1's 32 weights (0..31) from their `qh` and 16 bytes of nibbles (20 bytes from
/// `b`), as two vectors: elements 0..16 and 16..32.
pub(super) fn five_bit_weights(b: &[u8]) -> (v128, v128) {
    let qh = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let bytes = load(b, 4);
    let lo = v128_or(v128_and(bytes, i8x16_splat(0x0f)), fifth_bits(qh as u16));
    let hi = v128_or(u8x16_shr(bytes, 4), fifth_bits((qh >> 16) as u16));
    (lo, hi)
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
        GgmlType::Q5_0 => row
            .chunks_exact(22)
            .zip(act)
            .map(|(b, a)| {
                let (lo, hi) = five_bit_weights(&b[2..22]);
                let sixteen = i8x16_splat(16);
                let (lo, hi) = (i8x16_sub(lo, sixteen), i8x16_sub(hi, sixteen));
                f16_at(b, 0) * a.d * hsum_i32(dot32(lo, hi, a)) as f32
            })
            .sum(),
        GgmlType::Q5_1 => row
            .chunks_exact(24)
            .zip(act)
            .map(|(b, a)| {
                let (lo, hi) = five_bit_weights(&b[4..24]);
                // w = d q + m: d da sum(q xq) + m da sum(xq).
                let s = hsum_i32(dot32(lo, hi, a)) as f32;
                a.d * (f16_at(b, 0) * s + f16_at(b, 2) * a.sum as f32)
            })
            .sum(),
        GgmlType::Q4_K | GgmlType::Q5_K => {
            // Q5_K: 32 bytes of fifth bits (bit j of byte l: element l of sub-block j) between
            // the scales and the nibbles.
            let five = ty == GgmlType::Q5_K;
            let (bb, qs) = if five { (176, 48) } else { (144, 16) };
            let mut acc = f32x4_splat(0.0);
            let mut mins = 0f32;
            let m4 = u8x16_splat(0x0f);
            for (b, a) in row.chunks_exact(bb).zip(act.chunks_exact(QK_K / QK8)) {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let high = if five { [load(b, 16), load(b, 32)] } else { [u8x16_splat(0); 2] };
                for chunk in 0..4 {
                    // 32 bytes: low nibbles are sub-block 2 * chunk, high nibbles 2 * chunk + 1.
                    let (q0, q1) = (load(b, qs + chunk * 32), load(b, qs + 16 + chunk * 32));
                    let lo = [v128_and(q0, m4), v128_and(q1, m4)];
                    let hi = [u8x16_shr(q0, 4), u8x16_shr(q1, 4)];
                    for (j, w) in [(2 * chunk, lo), (2 * chunk + 1, hi)] {
                        let w = if five {
                            [0, 1].map(|i| {
                                let bit = v128_and(u8x16_shr(high[i], j as u32), u8x16_splat(1));
                                v128_or(w[i], i8x16_shl(bit, 4))
                            })
                        } else {
                            w
                        };
                        let (sc, m) = q4_k_scale_min(j, &b[4..16]);
                        let aj = &a[j];
                        let s = f32x4_convert_i32x4(dot32(w[0], w[1], aj));
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

/// e^x for 4 floats, as AVX2's `exp_ps`: x = n ln2 + r (ln2 in two parts, |r| <= ln2 / 2), e^r
/// by Cephes' degree-6 polynomial, 2^n into the exponent bits; x clamped to [-87.3, 88.3] so 2^n
/// stays a normal float. Plain multiplies and adds (simd128 has no fused multiply-add).
#[inline(always)]
fn exp_ps(x: v128) -> v128 {
    let x = f32x4_min(f32x4_max(x, f32x4_splat(-87.3)), f32x4_splat(88.3));
    let n = f32x4_nearest(f32x4_mul(x, f32x4_splat(std::f32::consts::LOG2_E)));
    let r = f32x4_sub(x, f32x4_mul(n, f32x4_splat(LN2_PARTS[0])));
    let r = f32x4_sub(r, f32x4_mul(n, f32x4_splat(LN2_PARTS[1])));
    let mut p = f32x4_splat(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = f32x4_add(f32x4_mul(p, r), f32x4_splat(c));
    }
    let e = f32x4_add(f32x4_mul(f32x4_mul(p, r), r), f32x4_add(r, f32x4_splat(1.0)));
    let n = i32x4_add(i32x4_trunc_sat_f32x4(n), i32x4_splat(127));
    f32x4_mul(e, i32x4_shl(n, 23))
}

/// See `kernels::softmax`: libm's `exp` (a call per element in wasm) was the attention's
/// slowest part at long contexts.
pub fn softmax(x: &mut [f32]) {
    let main = x.len() / 4 * 4;
    let (body, tail) = x.split_at_mut(main);
    let mut m = f32x4_splat(f32::NEG_INFINITY);
    for c in body.chunks_exact(4) {
        m = f32x4_max(m, load_f32x4_f(c));
    }
    let lanes = [
        f32x4_extract_lane::<0>(m),
        f32x4_extract_lane::<1>(m),
        f32x4_extract_lane::<2>(m),
        f32x4_extract_lane::<3>(m),
    ];
    let max = lanes.into_iter().chain(tail.iter().copied()).fold(f32::NEG_INFINITY, f32::max);
    let (mv, mut sums) = (f32x4_splat(max), f32x4_splat(0.0));
    for c in body.chunks_exact_mut(4) {
        let e = exp_ps(f32x4_sub(load_f32x4_f(c), mv));
        // SAFETY: c is 4 floats; v128_store is unaligned.
        unsafe { v128_store(c.as_mut_ptr() as *mut v128, e) };
        sums = f32x4_add(sums, e);
    }
    let mut sum = hsum_f32(sums);
    for v in tail.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = f32x4_splat(1.0 / sum);
    for c in body.chunks_exact_mut(4) {
        // SAFETY: as above.
        unsafe { v128_store(c.as_mut_ptr() as *mut v128, f32x4_mul(load_f32x4_f(c), inv)) };
    }
    for v in tail {
        *v /= sum;
    }
}

/// See `kernels::silu_mul`.
pub fn silu_mul(gate: &[f32], up: &mut [f32]) {
    let main = up.len() / 4 * 4;
    let one = f32x4_splat(1.0);
    for (u, g) in up.chunks_exact_mut(4).zip(gate.chunks_exact(4)) {
        let g = load_f32x4_f(g);
        let silu = f32x4_div(g, f32x4_add(one, exp_ps(f32x4_neg(g))));
        // SAFETY: u is 4 floats; v128_store is unaligned.
        unsafe { v128_store(u.as_mut_ptr() as *mut v128, f32x4_mul(load_f32x4_f(u), silu)) };
    }
    scalar::silu_mul(&gate[main..], &mut up[main..]);
}

/// Whether [`dot_q8_tile`] has a tiled kernel for `ty` (the others loop over `dot_q8`).
pub fn has_tile(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q8_0
            | GgmlType::Q4_0
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
    )
}

/// See `kernels::dot_q8_tile`: each weight block is unpacked once for the `T` vectors and each
/// activation block used for `R` rows (a multiple of 4). The types of `has_tile`.
pub fn dot_q8_tile<const R: usize, const T: usize>(
    ty: GgmlType,
    rows: [&[u8]; R],
    acts: [&[BlockQ8]; T],
) -> [[f32; T]; R] {
    assert!(has_tile(ty), "dot_q8_tile: no simd128 tile for {}", ty.name());
    tiles_with::<R, T, Widened>(ty, rows, acts)
}

/// The tiles with `P`'s products (Q6_K has simd128's only).
pub(super) fn tiles_with<const R: usize, const T: usize, P: Products>(
    ty: GgmlType,
    rows: [&[u8]; R],
    acts: [&[BlockQ8]; T],
) -> [[f32; T]; R] {
    tiles_of_four(ty, rows, acts, |rows, acts| match ty {
        GgmlType::Q4_0 => tile4_blocks::<T, Q4_0, P>(rows, acts),
        GgmlType::Q5_0 => tile4_blocks::<T, Q5_0, P>(rows, acts),
        GgmlType::Q5_1 => tile4_blocks::<T, Q5_1, P>(rows, acts),
        GgmlType::Q4_K => tile4_q4_k::<T, false, P>(rows, acts),
        GgmlType::Q5_K => tile4_q4_k::<T, true, P>(rows, acts),
        GgmlType::Q6_K => tile4_q6_k::<T>(rows, acts),
        _ => tile4_blocks::<T, Q8_0, P>(rows, acts),
    })
}

/// `R` rows (a multiple of 4) by `T` activation vectors, four rows at a time through `tile4`,
/// which returns one vector per token: lane r the sum of row r. Four rows at a time, so that what
/// is per row in a scalar loop is one vector op for the four: the f16 scales are converted
/// together, and the integer sums of the four rows are folded into one vector that is converted
/// and scaled once per block and token.
fn tiles_of_four<const R: usize, const T: usize>(
    ty: GgmlType,
    rows: [&[u8]; R],
    acts: [&[BlockQ8]; T],
    tile4: impl Fn([&[u8]; 4], [&[BlockQ8]; T]) -> [v128; T],
) -> [[f32; T]; R] {
    assert!(R.is_multiple_of(4), "dot_q8_tile: wasm tiles take rows 4 at a time, not {R}");
    let nb = acts[0].len();
    assert!(rows.iter().all(|r| r.len() >= ty.row_bytes(nb * QK8)));
    assert!(acts.iter().all(|a| a.len() == nb));
    let mut out = [[0f32; T]; R];
    for (g, group) in out.chunks_exact_mut(4).enumerate() {
        let acc = tile4(std::array::from_fn(|r| rows[4 * g + r]), acts);
        let lanes: [[f32; 4]; T] = acc.map(|v| {
            // SAFETY: a v128 is 16 bytes, as [f32; 4] is; every bit pattern is a valid f32.
            unsafe { std::mem::transmute::<v128, [f32; 4]>(v) }
        });
        for (r, out_row) in group.iter_mut().enumerate() {
            *out_row = std::array::from_fn(|t| lanes[t][r]);
        }
    }
    out
}

/// The block types of `tile4_blocks` (const parameters).
const Q8_0: u8 = 0;
const Q4_0: u8 = 1;
const Q5_0: u8 = 2;
const Q5_1: u8 = 3;

/// How the tiles multiply one row's 32 weights (a block, or a K-quant sub-block) by an activation
/// block. simd128 widens both to i16 and multiplies with `i32x4.dot_i16x8_s` ([`Widened`]); the
/// relaxed-simd build multiplies bytes with `i16x8.relaxed_dot_i8x16_i7x16_s`
/// (`relaxed_simd::Bytes`). The tile loops are generic over it, so the two builds' tiles differ
/// only in these few operations.
pub(super) trait Products {
    /// One row's 32 weights, unpacked.
    type W: Copy;
    /// One activation block, unpacked for weights that are signed (Q8_0) or not.
    type X: Copy;
    /// Q8_0's signed bytes: elements 0..16 and 16..32.
    fn signed(lo: v128, hi: v128) -> Self::W;
    /// Unsigned bytes 0..=31 (Q5_0's and Q5_1's weights with their fifth bits).
    fn unsigned(lo: v128, hi: v128) -> Self::W;
    /// A Q4_0 block's 16 bytes of nibbles: byte j holds element j low, j + 16 high.
    fn nibbles(bytes: v128) -> Self::W;
    /// A Q4_K / Q5_K sub-block: the low (`high` false) or high nibbles of 32 bytes, and for Q5_K
    /// bit `j` of the 32 bytes of fifth bits (`fifth`: those bytes and j).
    fn sub_block(q0: v128, q1: v128, high: bool, fifth: Option<(v128, v128, u32)>) -> Self::W;
    fn acts(a: &BlockQ8, signed: bool) -> Self::X;
    /// The 32 products as 4 i32 partial sums (`k`: the constants, see [`Constants`]).
    fn dot(w: &Self::W, x: &Self::X, signed: bool, k: &Constants) -> v128;
    /// `sc` times the 32 products of unsigned weights (0..=31, a K-quant sub-block) as 4 i32
    /// partial sums; `scale` is `sc` (0..=63) in each i16 lane.
    fn dot_scaled(w: &Self::W, x: &Self::X, scale: v128) -> v128;
}

/// simd128's products: weights and activations widened to i16 (`i32x4.dot_i16x8_s`: one
/// multiply-add instruction per 8 on x86).
pub(super) struct Widened;

impl Products for Widened {
    type W = [v128; 4];
    type X = [v128; 4];
    #[inline(always)]
    fn signed(lo: v128, hi: v128) -> [v128; 4] {
        widen_i8(lo, hi)
    }
    #[inline(always)]
    fn unsigned(lo: v128, hi: v128) -> [v128; 4] {
        widen_i8(lo, hi)
    }
    #[inline(always)]
    fn nibbles(bytes: v128) -> [v128; 4] {
        nibbles_i16(bytes)
    }
    #[inline(always)]
    fn sub_block(q0: v128, q1: v128, high: bool, fifth: Option<(v128, v128, u32)>) -> [v128; 4] {
        let widen = |a, b| {
            [
                u16x8_extend_low_u8x16(a),
                u16x8_extend_high_u8x16(a),
                u16x8_extend_low_u8x16(b),
                u16x8_extend_high_u8x16(b),
            ]
        };
        let mut w =
            widen(q0, q1)
                .map(|v| if high { u16x8_shr(v, 4) } else { v128_and(v, u16x8_splat(0x0f)) });
        if let Some((h0, h1, j)) = fifth {
            for (wi, h) in w.iter_mut().zip(widen(h0, h1)) {
                let bit = v128_and(u16x8_shr(h, j), u16x8_splat(1));
                *wi = v128_or(*wi, i16x8_shl(bit, 4));
            }
        }
        w
    }
    #[inline(always)]
    fn acts(a: &BlockQ8, _signed: bool) -> [v128; 4] {
        widen_i8(load_qs(a, 0), load_qs(a, 16))
    }
    #[inline(always)]
    fn dot(w: &[v128; 4], x: &[v128; 4], _signed: bool, _k: &Constants) -> v128 {
        dot32_i16(w, x)
    }
    #[inline(always)]
    fn dot_scaled(w: &[v128; 4], x: &[v128; 4], scale: v128) -> v128 {
        // A weight times its scale is at most 31 · 63, inside i16.
        dot32_i16(&w.map(|v| i16x8_mul(v, scale)), x)
    }
}

/// `tile4`'s loop for Q8_0, Q4_0, Q5_0 or Q5_1 blocks (`KIND`), written out for four rows so that
/// everything stays in wasm locals (an array of rows indexed in a loop lives in linear memory).
#[inline(always)]
fn tile4_blocks<const T: usize, const KIND: u8, P: Products>(
    rows: [&[u8]; 4],
    acts: [&[BlockQ8]; T],
) -> [v128; T] {
    let bb = match KIND {
        Q4_0 => 18,
        Q5_0 => 22,
        Q5_1 => 24,
        _ => 34,
    };
    let [p0, p1, p2, p3] = rows.map(|r| r.as_ptr());
    // SAFETY (all): `b` is the start of a whole block of its row (the caller checked the rows'
    // lengths); v128_load and read_unaligned take any alignment.
    let half = |b: *const u8, at: usize| unsafe { (b.add(at) as *const u16).read_unaligned() };
    let weights = |b: *const u8| unsafe {
        match KIND {
            // The nibbles 0..15 as they are; the offset 8 is subtracted from the sums below.
            Q4_0 => P::nibbles(v128_load(b.add(2) as *const v128)),
            // 0..31: the nibbles with the fifth bits of qh (after d; Q5_1: after d and m).
            Q5_0 | Q5_1 => {
                let at = if KIND == Q5_0 { 2 } else { 4 };
                let bytes = v128_load(b.add(at + 4) as *const v128);
                let (lo, hi) = (half(b, at), half(b, at + 2));
                P::unsigned(
                    v128_or(v128_and(bytes, i8x16_splat(0x0f)), fifth_bits(lo)),
                    v128_or(high_nibbles(bytes), fifth_bits(hi)),
                )
            }
            _ => P::signed(v128_load(b.add(2) as *const v128), v128_load(b.add(18) as *const v128)),
        }
    };
    let k = Constants::opaque();
    // SAFETY: `at` is 0 or 2, inside each row's block.
    let four = |b: [*const u8; 4], at: usize| unsafe { four_f16(b, at, &k) };
    let offset = match KIND {
        Q4_0 => 8,
        Q5_0 => 16,
        _ => 0,
    };
    let mut acc = [f32x4_splat(0.0); T];
    #[allow(clippy::needless_range_loop)] // i indexes the rows (by pointer) and every token alike
    for i in 0..acts[0].len() {
        let at = i * bb;
        // SAFETY: block i of rows of at least nb blocks.
        let b = unsafe { [p0.add(at), p1.add(at), p2.add(at), p3.add(at)] };
        let d = four(b, 0);
        // Q5_1: w = d q + m, so + m da sum(xq).
        let m = if KIND == Q5_1 { four(b, 2) } else { f32x4_splat(0.0) };
        let (w0, w1, w2, w3) = (weights(b[0]), weights(b[1]), weights(b[2]), weights(b[3]));
        written_out::<T>(|t| {
            let a = &acts[t][i];
            let signed = KIND == Q8_0;
            let x = P::acts(a, signed);
            let sums = fold4([
                P::dot(&w0, &x, signed, &k),
                P::dot(&w1, &x, signed, &k),
                P::dot(&w2, &x, signed, &k),
                P::dot(&w3, &x, signed, &k),
            ]);
            let sums =
                if offset != 0 { i32x4_sub(sums, i32x4_splat(offset * a.sum)) } else { sums };
            let scaled = f32x4_mul(f32x4_convert_i32x4(sums), f32x4_mul(d, f32x4_splat(a.d)));
            acc[t] = f32x4_add(acc[t], scaled);
            if KIND == Q5_1 {
                acc[t] = f32x4_add(acc[t], f32x4_mul(m, f32x4_splat(a.d * a.sum as f32)));
            }
        });
    }
    acc
}

/// The f16 at `b[r] + at` for each of four rows, as floats in lanes 0..4. Each is put straight
/// into the low half of its u32 lane (LLVM makes each a `v128.load16_lane`, one `pinsrw` from
/// memory on x86, where four loads and a vector built of them were eight).
///
/// # Safety
/// `b[r] + at .. b[r] + at + 2` readable for each row.
#[inline(always)]
unsafe fn four_f16(b: [*const u8; 4], at: usize, k: &Constants) -> v128 {
    let half = |r: usize| unsafe { (b[r].add(at) as *const u16).read_unaligned() };
    let v = u16x8_replace_lane::<0>(u32x4_splat(0), half(0));
    let v = u16x8_replace_lane::<2>(v, half(1));
    let v = u16x8_replace_lane::<4>(v, half(2));
    f16_bits_to_f32_with(u16x8_replace_lane::<6>(v, half(3)), k)
}

/// `f(0)`, `f(1)` ... `f(N - 1)` written out, not a loop (a tile's tokens, its 4 rows). V8
/// placed work that the wasm computes before a loop inside it where only the loop uses it: as a
/// loop over a tile's tokens, the four rows' f16 scales were converted again for every token,
/// with the constants that takes, and the tokens' sums lived in memory, an array indexed in a
/// loop (Node 20's code, `perf annotate`; Q8_0 prefill 1.08-1.14x in Chromium,
/// docs/benchmarks.md).
#[inline(always)]
fn written_out<const N: usize>(mut f: impl FnMut(usize)) {
    const { assert!(N <= 8, "at most 8 calls") };
    macro_rules! calls {
        ($($t:literal)*) => { $(if N > $t { f($t) })* };
    }
    calls!(0 1 2 3 4 5 6 7);
}

/// `tile4`'s loop for Q4_K super-blocks (Q5_K with `FIVE`: the fifth bits, bit j of byte l for
/// element l of sub-block j, sit in 32 bytes between the scales and the nibbles). The
/// activations share one scale per super-block (`ActScales::PerSuperBlock`), so everything but
/// the floats (d, dmin, the activation scale: once per super-block for the four rows together)
/// is integers: each sub-block's products times its 6-bit scale (the multiply-add that widens
/// them takes the scale for its operand), and the mins times the activations' sub-block sums,
/// 8 of each in one `i32x4.dot_i16x8_s` a row. The rows and tokens are written out, so that
/// the sums stay in locals; the pairs of sub-blocks stay a loop (written out, V8 loaded all of
/// a super-block first and spilled most of it: decode about 1.2x slower).
#[inline(always)]
fn tile4_q4_k<const T: usize, const FIVE: bool, P: Products>(
    rows: [&[u8]; 4],
    acts: [&[BlockQ8]; T],
) -> [v128; T] {
    const SUB: usize = QK_K / QK8;
    let (bb, qs) = if FIVE { (176, 48) } else { (144, 16) };
    let k = Constants::opaque();
    let [p0, p1, p2, p3] = rows.map(|r| r.as_ptr());
    let mut acc = [f32x4_splat(0.0); T];
    for sb in 0..acts[0].len() / SUB {
        let at = sb * bb;
        // SAFETY (all): super-block sb of rows of at least nb / SUB of them (the caller checked
        // the rows' lengths); every offset below is inside its bb bytes.
        let b = unsafe { [p0.add(at), p1.add(at), p2.add(at), p3.add(at)] };
        let (d, dmin) = unsafe { (four_f16(b, 0, &k), four_f16(b, 2, &k)) };
        let load_at = |r: usize, at: usize| unsafe { v128_load(b[r].add(at) as *const v128) };
        let packed: [(u64, u64); 4] = std::array::from_fn(|r| {
            q4_k_scales_mins(unsafe { std::slice::from_raw_parts(b[r].add(4), 12) })
        });
        // The 8 mins of each row as i16.
        let mins = packed.map(|(_, m)| u16x8_extend_low_u8x16(u64x2(m, 0)));
        let mut isum = [[i32x4_splat(0); 4]; T];
        // Sub-blocks 2i and 2i + 1: the low and high nibbles of the same 32 bytes.
        for i in 0..SUB / 2 {
            let x = |j: usize| -> [P::X; T] {
                std::array::from_fn(|t| P::acts(&acts[t][sb * SUB + j], false))
            };
            let (x_low, x_high) = (x(2 * i), x(2 * i + 1));
            let at = qs + i * 32;
            written_out::<4>(|r| {
                let (q0, q1) = (load_at(r, at), load_at(r, at + 16));
                let scale = |j: usize| i16x8_splat((packed[r].0 >> (8 * j)) as u8 as i16);
                let fifth = |j: usize| FIVE.then(|| (load_at(r, 16), load_at(r, 32), j as u32));
                let low = P::sub_block(q0, q1, false, fifth(2 * i));
                let high = P::sub_block(q0, q1, true, fifth(2 * i + 1));
                let (s_low, s_high) = (scale(2 * i), scale(2 * i + 1));
                written_out::<T>(|t| {
                    let both = i32x4_add(
                        P::dot_scaled(&low, &x_low[t], s_low),
                        P::dot_scaled(&high, &x_high[t], s_high),
                    );
                    isum[t][r] = i32x4_add(isum[t][r], both);
                });
            });
        }
        written_out::<T>(|t| {
            let a = &acts[t][sb * SUB..(sb + 1) * SUB];
            // The token's 8 sub-block sums (each at most 32 · 127 in magnitude) as i16.
            let sums = i16x8(
                a[0].sum as i16,
                a[1].sum as i16,
                a[2].sum as i16,
                a[3].sum as i16,
                a[4].sum as i16,
                a[5].sum as i16,
                a[6].sum as i16,
                a[7].sum as i16,
            );
            let m = fold4(mins.map(|m| i32x4_dot_i16x8(m, sums)));
            // d da sum_j sc_j dot_j - dmin da sum_j m_j sum_j, four rows at once.
            let da = f32x4_splat(a[0].d);
            let dots = f32x4_convert_i32x4(fold4(isum[t]));
            let v = f32x4_sub(f32x4_mul(dots, d), f32x4_mul(f32x4_convert_i32x4(m), dmin));
            acc[t] = f32x4_add(acc[t], f32x4_mul(v, da));
        });
    }
    acc
}

/// `tile4`'s loop for Q6_K super-blocks: 16 groups of 16 six-bit weights (stored 0..63, meaning
/// q - 32) with signed 8-bit scales, multiplied in integers as in `tile4_q4_k`; one float scale
/// per super-block and row.
#[inline(always)]
fn tile4_q6_k<const T: usize>(rows: [&[u8]; 4], acts: [&[BlockQ8]; T]) -> [v128; T] {
    const SUB: usize = QK_K / QK8;
    let mut acc = [f32x4_splat(0.0); T];
    let widen = |v: v128, w: v128| {
        [
            u16x8_extend_low_u8x16(v),
            u16x8_extend_high_u8x16(v),
            u16x8_extend_low_u8x16(w),
            u16x8_extend_high_u8x16(w),
        ]
    };
    for sb in 0..acts[0].len() / SUB {
        let b: [&[u8]; 4] = std::array::from_fn(|r| &rows[r][sb * 210..(sb + 1) * 210]);
        let h = |r: usize| u16::from_le_bytes([b[r][208], b[r][209]]) as u32;
        let d = f16_bits_to_f32(u32x4(h(0), h(1), h(2), h(3)));
        let mut isum = [[i32x4_splat(0); 4]; T];
        for half in 0..2 {
            for k in 0..4 {
                let blk = half * 4 + k;
                let x: [[v128; 4]; T] = std::array::from_fn(|t| {
                    let a = &acts[t][sb * SUB + blk];
                    widen_i8(load_qs(a, 0), load_qs(a, 16))
                });
                for r in 0..4 {
                    // 4 low bits from ql[0..32] (k even) or ql[32..64] (k odd) of this half, the
                    // low nibbles for k < 2, high for k >= 2; 2 high bits at qh >> 2k.
                    let at = half * 64 + (k % 2) * 32;
                    let low = widen(load(b[r], at), load(b[r], at + 16));
                    let high = widen(load(b[r], 128 + half * 32), load(b[r], 144 + half * 32));
                    let w: [v128; 4] = std::array::from_fn(|i| {
                        let l = if k < 2 {
                            v128_and(low[i], u16x8_splat(0x0f))
                        } else {
                            u16x8_shr(low[i], 4)
                        };
                        let hb = v128_and(u16x8_shr(high[i], 2 * k as u32), u16x8_splat(3));
                        i16x8_sub(v128_or(l, i16x8_shl(hb, 4)), i16x8_splat(32))
                    });
                    // Elements 0..16 take scale 2k of this half, 16..32 scale 2k + 1.
                    let sc = |i: usize| i32x4_splat(b[r][192 + half * 8 + 2 * k + i] as i8 as i32);
                    for t in 0..T {
                        let xt = &x[t];
                        let g0 =
                            i32x4_add(i32x4_dot_i16x8(w[0], xt[0]), i32x4_dot_i16x8(w[1], xt[1]));
                        let g1 =
                            i32x4_add(i32x4_dot_i16x8(w[2], xt[2]), i32x4_dot_i16x8(w[3], xt[3]));
                        let s = i32x4_add(i32x4_mul(g0, sc(0)), i32x4_mul(g1, sc(1)));
                        isum[t][r] = i32x4_add(isum[t][r], s);
                    }
                }
            }
        }
        for t in 0..T {
            let da = f32x4_splat(acts[t][sb * SUB].d);
            let dots = f32x4_convert_i32x4(fold4(isum[t]));
            acc[t] = f32x4_add(acc[t], f32x4_mul(dots, f32x4_mul(d, da)));
        }
    }
    acc
}

/// 32 int8 values (two vectors) widened to i16: elements 0..8, 8..16, 16..24, 24..32.
fn widen_i8(lo: v128, hi: v128) -> [v128; 4] {
    [
        i16x8_extend_low_i8x16(lo),
        i16x8_extend_high_i8x16(lo),
        i16x8_extend_low_i8x16(hi),
        i16x8_extend_high_i8x16(hi),
    ]
}

/// A Q4_0 block's 16 bytes of nibbles as 32 i16 (0..15) in element order: byte j holds element
/// j in its low nibble and j + 16 in its high one.
fn nibbles_i16(bytes: v128) -> [v128; 4] {
    let (first, second) = (u16x8_extend_low_u8x16(bytes), u16x8_extend_high_u8x16(bytes));
    let low4 = u16x8_splat(0x0f);
    [v128_and(first, low4), v128_and(second, low4), u16x8_shr(first, 4), u16x8_shr(second, 4)]
}

/// 32 i16 weights x 32 i16 activations as 4 i32 partial sums (`i32x4.dot_i16x8_s`: one
/// multiply-add instruction per 8 on x86).
fn dot32_i16(w: &[v128; 4], x: &[v128; 4]) -> v128 {
    i32x4_add(
        i32x4_add(i32x4_dot_i16x8(w[0], x[0]), i32x4_dot_i16x8(w[1], x[1])),
        i32x4_add(i32x4_dot_i16x8(w[2], x[2]), i32x4_dot_i16x8(w[3], x[3])),
    )
}

/// Four vectors of partial sums to one vector of their totals: lane r is the sum of `v[r]`.
pub(super) fn fold4(v: [v128; 4]) -> v128 {
    let pair =
        |a, b| i32x4_add(i32x4_shuffle::<0, 4, 1, 5>(a, b), i32x4_shuffle::<2, 6, 3, 7>(a, b));
    // ab: [a0+a2, b0+b2, a1+a3, b1+b3]; cd likewise.
    let (ab, cd) = (pair(v[0], v[1]), pair(v[2], v[3]));
    i32x4_add(i32x4_shuffle::<0, 1, 4, 5>(ab, cd), i32x4_shuffle::<2, 3, 6, 7>(ab, cd))
}

/// Four f16 bit patterns (one per u32 lane) to f32, exactly: the magnitude's bits shifted into
/// place are the value times 2^-112 for normal and subnormal numbers alike; infinities and NaNs
/// (exponent 31) get the f32 exponent of all ones.
pub(super) fn f16_bits_to_f32(h: v128) -> v128 {
    f16_bits_to_f32_with(h, &CONSTANTS)
}

/// [`f16_bits_to_f32`] with its constants from `k` (see [`Constants::opaque`]).
#[inline(always)]
pub(super) fn f16_bits_to_f32_with(h: v128, k: &Constants) -> v128 {
    let mag = i32x4_shl(v128_and(h, k.f16_magnitude), 13);
    let sign = i32x4_shl(v128_and(h, k.f16_sign), 16);
    let finite = f32x4_mul(mag, k.f16_scale);
    let special = v128_or(mag, k.f32_exponent);
    let is_special = u32x4_ge(mag, k.f16_special);
    v128_or(v128_bitselect(special, finite, is_special), sign)
}

/// The vector constants of the tiles' block loops. V8 rebuilt some at each use, inside the loop
/// (`i32x4.extadd_pairwise_i16x8_s`'s operand of ones: its address moved into a register first)
/// or turned an operation with one into more instructions (`u32x4_ge`: four); the tiles take them
/// from [`Constants::opaque`], loaded from memory once per call, values that V8 keeps in a
/// register or reads from one stack slot (decode 1.08-1.15x, docs/benchmarks.md).
#[derive(Clone, Copy)]
pub(super) struct Constants {
    /// i16 ones: `i32x4.dot_i16x8_s` with it adds pairs as `extadd_pairwise` does (the
    /// relaxed-simd products; simd128's widened ones end in that instruction already).
    #[cfg_attr(not(target_feature = "relaxed-simd"), allow(dead_code))]
    pub ones_i16: v128,
    f16_magnitude: v128,
    f16_sign: v128,
    /// 2^112 as f32: an f16's magnitude bits shifted into an f32's place are its value / 2^112.
    f16_scale: v128,
    f32_exponent: v128,
    /// The magnitude, shifted, from which an f16 is infinite or NaN.
    f16_special: v128,
}

pub(super) const CONSTANTS: Constants = Constants {
    ones_i16: i16x8(1, 1, 1, 1, 1, 1, 1, 1),
    f16_magnitude: u32x4(0x7fff, 0x7fff, 0x7fff, 0x7fff),
    f16_sign: u32x4(0x8000, 0x8000, 0x8000, 0x8000),
    f16_scale: u32x4((127 + 112) << 23, (127 + 112) << 23, (127 + 112) << 23, (127 + 112) << 23),
    f32_exponent: u32x4(0x7f80_0000, 0x7f80_0000, 0x7f80_0000, 0x7f80_0000),
    f16_special: u32x4(0x7c00 << 13, 0x7c00 << 13, 0x7c00 << 13, 0x7c00 << 13),
};

static CONSTANTS_IN_MEMORY: Constants = CONSTANTS;

impl Constants {
    /// [`CONSTANTS`] by a volatile load, which neither LLVM nor wasm-opt folds back into
    /// constants, so the wasm holds loads of values, not `v128.const`s.
    #[inline(always)]
    pub(super) fn opaque() -> Constants {
        // SAFETY: a static of plain vectors, read as it is.
        unsafe { std::ptr::read_volatile(&CONSTANTS_IN_MEMORY) }
    }
}

/// f32 keys (the wasm build's cache; f16 goes to scalar), `q.len()` a multiple of 4: four keys
/// per pass, their four sums reduced together (a horizontal sum per key was as much work as its
/// dot product at head size 64).
pub fn attention_scores(q: &[f32], keys: KvRows, stride: usize, scale: f32, out: &mut [f32]) {
    let KvRows::F32(k) = keys else { return scalar::attention_scores(q, keys, stride, scale, out) };
    let (d, done) = (q.len(), out.len() / 4 * 4);
    for (b, o) in out[..done].chunks_exact_mut(4).enumerate() {
        let rows: [&[f32]; 4] = std::array::from_fn(|j| &k[(4 * b + j) * stride..][..d]);
        let mut acc = [f32x4_splat(0.0); 4];
        for i in (0..d).step_by(4) {
            let qv = load_f32x4_f(&q[i..i + 4]);
            for (a, row) in acc.iter_mut().zip(rows) {
                *a = f32x4_add(*a, f32x4_mul(qv, load_f32x4_f(&row[i..i + 4])));
            }
        }
        // [a0 a1 a2 a3] -> [sum a0, sum a1, sum a2, sum a3]
        let s01 = f32x4_add(
            i32x4_shuffle::<0, 4, 1, 5>(acc[0], acc[1]),
            i32x4_shuffle::<2, 6, 3, 7>(acc[0], acc[1]),
        );
        let s23 = f32x4_add(
            i32x4_shuffle::<0, 4, 1, 5>(acc[2], acc[3]),
            i32x4_shuffle::<2, 6, 3, 7>(acc[2], acc[3]),
        );
        let sums =
            f32x4_add(i32x4_shuffle::<0, 1, 4, 5>(s01, s23), i32x4_shuffle::<2, 3, 6, 7>(s01, s23));
        // SAFETY: o is 4 floats; v128_store is unaligned.
        unsafe { v128_store(o.as_mut_ptr() as *mut v128, f32x4_mul(sums, f32x4_splat(scale))) };
    }
    for (p, s) in out.iter_mut().enumerate().skip(done) {
        let kr = &k[p * stride..][..d];
        let mut acc = f32x4_splat(0.0);
        for i in (0..d).step_by(4) {
            acc =
                f32x4_add(acc, f32x4_mul(load_f32x4_f(&q[i..i + 4]), load_f32x4_f(&kr[i..i + 4])));
        }
        *s = hsum_f32(acc) * scale;
    }
}

/// f32 values, `out.len()` a multiple of 4: the output stays in registers while the values stream
/// past, 32 columns at a time in eight accumulators, narrower remainders over two interleaved sets
/// of positions (at least eight independent adds in flight).
pub fn attention_values(weights: &[f32], values: KvRows, stride: usize, out: &mut [f32]) {
    let KvRows::F32(v) = values else {
        return scalar::attention_values(weights, values, stride, out);
    };
    let d = out.len();
    let mut c = 0;
    while d - c >= 32 {
        values_columns::<8, 1>(weights, v, stride, c, out);
        c += 32;
    }
    for width in [4, 2, 1] {
        if d - c >= 4 * width {
            match width {
                4 => values_columns::<4, 2>(weights, v, stride, c, out),
                2 => values_columns::<2, 2>(weights, v, stride, c, out),
                _ => values_columns::<1, 2>(weights, v, stride, c, out),
            }
            c += 4 * width;
        }
    }
}

/// Columns `c..c + 4W` of [`attention_values`], with `S` sets of accumulators taking every
/// `S`-th position.
#[inline]
fn values_columns<const W: usize, const S: usize>(
    weights: &[f32],
    v: &[f32],
    stride: usize,
    c: usize,
    out: &mut [f32],
) {
    let mut acc = [[f32x4_splat(0.0); W]; S];
    let row = |p: usize| &v[p * stride + c..][..4 * W];
    let mut sets = weights.chunks_exact(S);
    for (r, ws) in sets.by_ref().enumerate() {
        for (s, (&w, a)) in ws.iter().zip(&mut acc).enumerate() {
            let (wv, vr) = (f32x4_splat(w), row(r * S + s));
            for (k, a) in a.iter_mut().enumerate() {
                *a = f32x4_add(*a, f32x4_mul(wv, load_f32x4_f(&vr[4 * k..4 * k + 4])));
            }
        }
    }
    let done = weights.len() - sets.remainder().len();
    for (p, &w) in sets.remainder().iter().enumerate() {
        let (wv, vr) = (f32x4_splat(w), row(done + p));
        for (k, a) in acc[0].iter_mut().enumerate() {
            *a = f32x4_add(*a, f32x4_mul(wv, load_f32x4_f(&vr[4 * k..4 * k + 4])));
        }
    }
    for k in 0..W {
        let mut sum = acc[0][k];
        for set in &acc[1..] {
            sum = f32x4_add(sum, set[k]);
        }
        // SAFETY: 4 floats inside out (c + 4W <= out.len()); v128_store is unaligned.
        unsafe { v128_store(out[c + 4 * k..c + 4 * k + 4].as_mut_ptr() as *mut v128, sum) };
    }
}
