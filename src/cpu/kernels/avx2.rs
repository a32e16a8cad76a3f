//! x86-64 AVX2 + FMA + F16C kernels (picked at run time).

use super::*;
use std::arch::x86_64::*;

/// The f16 at byte `i`, converted by the F16C instruction (the `half` crate's conversion is
/// software unless the whole build targets F16C, and it ran once per 32 weights).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16c(b: &[u8], i: usize) -> f32 {
    let bits = u16::from_le_bytes([b[i], b[i + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(bits as i16)))
}

#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Signed int8 x signed int8, 32 lanes, to 8 i32 sums (llama.cpp's sign trick: maddubs needs
/// one unsigned operand, so take |w| and move w's sign onto x).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn mul_i8(w: __m256i, x: __m256i) -> __m256i {
    let p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    _mm256_madd_epi16(p, _mm256_set1_epi16(1))
}

/// Unsigned (0..=63) x signed int8, 32 lanes, to 8 i32 sums.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn mul_u8(w: __m256i, x: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
}

/// `ActScales::quantize` in AVX2: the same operations in the same order, so the same bytes
/// (`group` is 32 or 256 values per scale).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn quantize(group: usize, x: &[f32], out: &mut [BlockQ8]) {
    let magnitude = _mm256_set1_epi32(0x7fff_ffff);
    let sign = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
    let half = _mm256_set1_ps(0.5);
    // After the two packs the 4-byte groups are in the order a0 b0 c0 d0 a1 b1 c1 d1.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (xs, os) in x.chunks_exact(group).zip(out.chunks_exact_mut(group / QK8)) {
        let p = xs.as_ptr();
        let mut m = _mm256_setzero_si256();
        for i in (0..group).step_by(8) {
            let v = _mm256_loadu_si256(p.add(i) as *const __m256i);
            m = _mm256_max_epu32(m, _mm256_and_si256(v, magnitude));
        }
        let m = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
        let m = _mm_max_epu32(m, _mm_shuffle_epi32::<0b01_00_11_10>(m));
        let m = _mm_max_epu32(m, _mm_shuffle_epi32::<0b10_11_00_01>(m));
        let amax = f32::from_bits(_mm_cvtsi128_si32(m) as u32);
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
        for (b, o) in os.iter_mut().enumerate() {
            let q: [__m256i; 4] = std::array::from_fn(|k| {
                let r = _mm256_mul_ps(_mm256_loadu_ps(p.add(b * QK8 + 8 * k)), id);
                // Half away from zero, then truncate: as the scalar code.
                _mm256_cvttps_epi32(_mm256_add_ps(r, _mm256_or_ps(half, _mm256_and_ps(r, sign))))
            });
            let sums = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let sums =
                _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
            let sums = _mm_add_epi32(sums, _mm_shuffle_epi32::<0b01_00_11_10>(sums));
            let sums = _mm_add_epi32(sums, _mm_shuffle_epi32::<0b10_11_00_01>(sums));
            let bytes =
                _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            let bytes = _mm256_permutevar8x32_epi32(bytes, order);
            _mm256_storeu_si256(o.qs.as_mut_ptr() as *mut __m256i, bytes);
            o.d = d;
            o.sum = _mm_cvtsi128_si32(sums);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q8(ty: GgmlType, row: &[u8], act: &[BlockQ8]) -> f32 {
    match ty {
        GgmlType::Q8_0 => {
            let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let n = act.len().min(row.len() / 34);
            let mut i = 0;
            while i + 2 <= n {
                for (k, acc) in [&mut acc0, &mut acc1].into_iter().enumerate() {
                    let b = &row[(i + k) * 34..];
                    let a = &act[i + k];
                    let w = _mm256_loadu_si256(b.as_ptr().add(2) as *const __m256i);
                    let x = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
                    let d = _mm256_set1_ps(f16c(b, 0) * a.d);
                    *acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(mul_i8(w, x)), *acc);
                }
                i += 2;
            }
            let mut total = hsum_ps(_mm256_add_ps(acc0, acc1));
            if i < n {
                total += scalar::dot_q8(ty, &row[i * 34..n * 34], &act[i..n]);
            }
            total
        }
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let (mut acc, mut offset) = (_mm256_setzero_ps(), 0f32);
            let bias = unsigned_offset(ty);
            for (b, a) in row.chunks_exact(ty.block_bytes()).zip(act) {
                let w = block_weights(b.as_ptr(), ty);
                let x = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
                let d = f16c(b, 0) * a.d;
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(mul_u8(w, x)), acc);
                // sum((q - 8) * x) = sum(q * x) - 8 * sum(x) (Q5_0: 16); Q5_1: + m sum(x).
                offset += if ty == GgmlType::Q5_1 {
                    -f16c(b, 2) * a.d * a.sum as f32
                } else {
                    d * (bias * a.sum) as f32
                };
            }
            hsum_ps(acc) - offset
        }
        GgmlType::Q4_K => {
            let mut acc = _mm256_setzero_ps();
            let mut mins = 0f32;
            let mask = _mm256_set1_epi8(0x0f);
            for (b, a) in row.chunks_exact(144).zip(act.chunks_exact(QK_K / QK8)) {
                prefetch_block(b.as_ptr(), 144, PREFETCH_BYTES);
                let (d, dmin) = (f16c(b, 0), f16c(b, 2));
                let scales = &b[4..16];
                for chunk in 0..4 {
                    let bytes =
                        _mm256_loadu_si256(b.as_ptr().add(16 + chunk * 32) as *const __m256i);
                    let lo = _mm256_and_si256(bytes, mask);
                    let hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
                    for (j, w) in [(2 * chunk, lo), (2 * chunk + 1, hi)] {
                        let (sc, m) = q4_k_scale_min(j, scales);
                        let aj = &a[j];
                        let x = _mm256_loadu_si256(aj.qs.as_ptr() as *const __m256i);
                        let s = _mm256_set1_ps(d * sc as f32 * aj.d);
                        acc = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(mul_u8(w, x)), acc);
                        mins += dmin * m as f32 * aj.d * aj.sum as f32;
                    }
                }
            }
            hsum_ps(acc) - mins
        }
        GgmlType::Q5_K => q4_k_tile::<1, 1, true>([row], [act])[0][0],
        GgmlType::Q6_K => {
            let mut acc = _mm256_setzero_ps();
            for (b, a) in row.chunks_exact(210).zip(act.chunks_exact(QK_K / QK8)) {
                prefetch_block(b.as_ptr(), 210, PREFETCH_BYTES);
                let d = f16c(b, 208);
                for half in 0..2 {
                    let sc = &b[192 + half * 8..192 + half * 8 + 8];
                    let ws = q6_k_weights(b.as_ptr(), half);
                    for k in 0..4 {
                        let (ak, w) = (&a[half * 4 + k], ws[k]);
                        let x = _mm256_loadu_si256(ak.qs.as_ptr() as *const __m256i);
                        let p16 =
                            _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
                        // Elements 0..16 are the low 128-bit lane: scale sc[2k]; 16..32: sc[2k+1].
                        let s16 = _mm256_set_m128i(
                            _mm_set1_epi16((sc[2 * k + 1] as i8) as i16),
                            _mm_set1_epi16((sc[2 * k] as i8) as i16),
                        );
                        let s32 = _mm256_madd_epi16(p16, s16);
                        acc =
                            _mm256_fmadd_ps(_mm256_set1_ps(d * ak.d), _mm256_cvtepi32_ps(s32), acc);
                    }
                }
            }
            hsum_ps(acc)
        }
        _ => scalar::dot_q8(ty, row, act),
    }
}

/// Whether [`dot_q8_tile`] has a tiled kernel for `ty` (the others loop over `dot_q8`).
pub fn has_tile(ty: GgmlType) -> bool {
    GgmlType::QUANTISED.contains(&ty)
}

/// How far ahead of the current block the kernels prefetch each weight row, at least, in bytes:
/// the hardware prefetcher alone left a single core at a third of memory bandwidth on the short
/// rows of small models.
const PREFETCH_BYTES: usize = 3072;

/// See `kernels::dot_q8_tile`: the blocks of 32 here, the K-quants in their own tiles.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q8_tile<const R: usize, const T: usize>(
    ty: GgmlType,
    rows: [&[u8]; R],
    acts: [&[BlockQ8]; T],
) -> [[f32; T]; R] {
    match ty {
        GgmlType::Q4_K => return q4_k_tile::<R, T, false>(rows, acts),
        GgmlType::Q5_K => return q4_k_tile::<R, T, true>(rows, acts),
        GgmlType::Q6_K => return q6_k_tile(rows, acts),
        _ if folds(ty) && R == 4 => {
            let sums = folded_tile(ty, std::array::from_fn(|r| rows[r]), acts);
            return std::array::from_fn(|r| sums[r]);
        }
        _ if folds(ty) => {
            let mut out = [[0f32; T]; R];
            for r in 0..R {
                out[r] = folded_row(ty, rows[r], acts);
            }
            return out;
        }
        _ => {}
    }
    let nb = acts[0].len();
    let bb = ty.block_bytes();
    for r in rows {
        assert!(r.len() >= nb * bb);
    }
    for a in acts {
        assert_eq!(a.len(), nb);
    }
    // Q8_0, Q4_0 and Q5_0 fold (above); Q5_1, whose offset is a float, is left.
    assert!(ty == GgmlType::Q5_1, "dot_q8_tile: no AVX2 tile for {}", ty.name());
    let ones = _mm256_set1_epi16(1);
    let ahead = tile_prefetch::<R>(rows[0].len());
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for i in 0..nb {
        // The weights are unsigned bytes 0..=31, their offset m not yet applied.
        let mut w = [_mm256_setzero_si256(); R];
        let mut dw = [_mm256_setzero_ps(); R];
        let mut mw = [_mm256_setzero_ps(); R];
        for r in 0..R {
            let p = rows[r].as_ptr().add(i * bb);
            (dw[r], w[r]) = load_block(p, ty, ahead);
            mw[r] = f16_splat(p.add(2));
        }
        for t in 0..T {
            let a = acts[t].get_unchecked(i);
            let x = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
            let da = _mm256_set1_ps(a.d);
            // sum((d q + m) x) = d sum(q x) + m sum(x): m da sum(x) in lane 0 of the float sums.
            let dasum = _mm256_zextps128_ps256(_mm_set_ss(a.d * a.sum as f32));
            for r in 0..R {
                acc[r][t] = _mm256_fmadd_ps(mw[r], dasum, acc[r][t]);
                let sums = _mm256_madd_epi16(_mm256_maddubs_epi16(w[r], x), ones);
                acc[r][t] =
                    _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums), da), dw[r], acc[r][t]);
            }
        }
    }
    std::array::from_fn(|r| std::array::from_fn(|t| hsum_ps(acc[r][t])))
}

/// See `kernels::dot_q8_rows`: the one-row tile of `ty`, chosen once, over consecutive rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q8_rows(
    ty: GgmlType,
    matrix: &[u8],
    row_bytes: usize,
    act: &[BlockQ8],
    out: &mut [f32],
) {
    let (m, rb) = (matrix, row_bytes);
    match ty {
        GgmlType::Q4_K => {
            each_decode_row(m, rb, out, |w| q4_k_tile::<1, 1, false>([w], [act])[0][0])
        }
        GgmlType::Q5_K => {
            each_decode_row(m, rb, out, |w| q4_k_tile::<1, 1, true>([w], [act])[0][0])
        }
        GgmlType::Q6_K => each_decode_row(m, rb, out, |w| q6_k_tile::<1, 1>([w], [act])[0][0]),
        _ => each_decode_row(m, rb, out, |w| dot_q8_tile::<1, 1>(ty, [w], [act])[0][0]),
    }
}

/// See `kernels::dot_q8_decode_tiles`: the 4-row, one-token tile of `ty`, chosen once, over the
/// tiles.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q8_decode_tiles(
    ty: GgmlType,
    matrix: &[u8],
    row_bytes: usize,
    spread: bool,
    act: &[BlockQ8],
    out: &mut [f32],
) {
    let one = |sums: [[f32; 1]; 4]| sums.map(|s| s[0]);
    let (m, rb) = (matrix, row_bytes);
    match ty {
        GgmlType::Q4_K => {
            each_decode_tile(m, rb, spread, out, |w| one(q4_k_tile::<4, 1, false>(w, [act])))
        }
        GgmlType::Q5_K => {
            each_decode_tile(m, rb, spread, out, |w| one(q4_k_tile::<4, 1, true>(w, [act])))
        }
        GgmlType::Q6_K => {
            each_decode_tile(m, rb, spread, out, |w| one(q6_k_tile::<4, 1>(w, [act])))
        }
        _ if folds(ty) => each_decode_tile(m, rb, spread, out, |w| one(folded_tile(ty, w, [act]))),
        _ => each_decode_tile(m, rb, spread, out, |w| one(dot_q8_tile::<4, 1>(ty, w, [act]))),
    }
}

/// Whether the tiles of `ty` fold the rows' integer sums ([`folded_tile`], [`folded_row`]).
pub fn folds(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0)
}

/// Per 128-bit half of two rows' 8 sums: [a0 + a2, b0 + b2, a1 + a3, b1 + b3].
#[inline]
#[target_feature(enable = "avx2")]
fn fold_pair(a: __m256i, b: __m256i) -> __m256i {
    _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b))
}

/// The 4-row tile of Q8_0, Q4_0 or Q5_0 for `T` tokens with the rows' integer sums folded
/// into one vector per block and token (two unpacks and an add per pair of rows), so the
/// conversion to float, the scales (the 4 rows' f16 scales converted together) and the
/// multiply-add are paid once per block for 4 rows instead of once per row: lane r and lane
/// r + 4 hold row r's sums of the block's two halves. Decode (`T` = 1) and passes of a few
/// tokens alike, so a token's sums are the same bits in either ([`folded_row`] gives them for
/// one row).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn folded_tile<const T: usize>(
    ty: GgmlType,
    rows: [&[u8]; 4],
    acts: [&[BlockQ8]; T],
) -> [[f32; T]; 4] {
    let nb = acts[0].len();
    let bb = ty.block_bytes();
    assert!(rows.iter().all(|r| r.len() >= nb * bb) && acts.iter().all(|a| a.len() == nb));
    assert!(folds(ty));
    let (signed, offset) = (ty == GgmlType::Q8_0, unsigned_offset(ty));
    let ones = _mm256_set1_epi16(1);
    let ahead = tile_prefetch::<4>(rows[0].len());
    let mut acc = [_mm256_setzero_ps(); T];
    for i in 0..nb {
        // (No closures here: they would not inherit this function's target features.)
        let mut scales = 0u64;
        let mut w = [_mm256_setzero_si256(); 4];
        for r in 0..4 {
            let p = rows[r].as_ptr().add(i * bb);
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(ahead) as *const i8);
            scales |= ((p as *const u16).read_unaligned() as u64) << (16 * r);
            w[r] = block_weights(p, ty);
        }
        let dw = _mm_cvtph_ps(_mm_cvtsi64_si128(scales as i64));
        for t in 0..T {
            let a = acts[t].get_unchecked(i);
            let x = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
            let mut sums = [_mm256_setzero_si256(); 4];
            for r in 0..4 {
                sums[r] = if signed {
                    mul_i8(w[r], x)
                } else {
                    _mm256_madd_epi16(_mm256_maddubs_epi16(w[r], x), ones)
                };
            }
            // Per 128-bit half: [r0, r1, r0, r1] then [r0, r1, r2, r3], each lane a sum of 4 of
            // the row's 8 lanes.
            let s01 = fold_pair(sums[0], sums[1]);
            let s23 = fold_pair(sums[2], sums[3]);
            let folded =
                _mm256_add_epi32(_mm256_unpacklo_epi64(s01, s23), _mm256_unpackhi_epi64(s01, s23));
            // Q4_0: sum((q - 8) x) = sum(q x) - 8 sum(x) (Q5_0: 16), once per row: the low half.
            let folded =
                _mm256_add_epi32(folded, _mm256_zextsi128_si256(_mm_set1_epi32(-offset * a.sum)));
            let d = _mm_mul_ps(dw, _mm_set1_ps(a.d));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(folded), _mm256_set_m128(d, d), acc[t]);
        }
    }
    let mut out = [[0f32; T]; 4];
    for t in 0..T {
        let rows = _mm_add_ps(_mm256_castps256_ps128(acc[t]), _mm256_extractf128_ps::<1>(acc[t]));
        let mut sums = [0f32; 4];
        _mm_storeu_ps(sums.as_mut_ptr(), rows);
        for r in 0..4 {
            out[r][t] = sums[r];
        }
    }
    out
}

/// One row of [`folded_tile`], the same bits: the row's two half-block sums (lanes 0 and 1
/// here, lanes r and r + 4 there) through the same conversion, scale product and FMA. Decode
/// row by row and a matrix's last rows past its tiles take it.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn folded_row<const T: usize>(ty: GgmlType, row: &[u8], acts: [&[BlockQ8]; T]) -> [f32; T] {
    let nb = acts[0].len();
    let bb = ty.block_bytes();
    assert!(row.len() >= nb * bb && acts.iter().all(|a| a.len() == nb));
    assert!(folds(ty));
    let (signed, offset) = (ty == GgmlType::Q8_0, unsigned_offset(ty));
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm_setzero_ps(); T];
    for i in 0..nb {
        let p = row.as_ptr().add(i * bb);
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BYTES) as *const i8);
        let w = block_weights(p, ty);
        let dw = f16c_ptr(p);
        for t in 0..T {
            let a = acts[t].get_unchecked(i);
            let x = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
            let sums = if signed {
                mul_i8(w, x)
            } else {
                _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones)
            };
            // [low half's sum, high half's sum, the same again].
            let halves =
                _mm_hadd_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256::<1>(sums));
            let halves = _mm_hadd_epi32(halves, halves);
            let halves = _mm_add_epi32(halves, _mm_cvtsi32_si128(-offset * a.sum));
            let d = _mm_set1_ps(dw * a.d);
            acc[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(halves), d, acc[t]);
        }
    }
    let mut out = [0f32; T];
    for t in 0..T {
        out[t] = _mm_cvtss_f32(_mm_add_ss(acc[t], _mm_movehdup_ps(acc[t])));
    }
    out
}

/// One Q8_0, Q4_0 or Q5_0 block at `p` for the tiles (after prefetching `ahead` bytes on): its
/// scale broadcast, and its 32 weights as bytes ([`block_weights`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn load_block(p: *const u8, ty: GgmlType, ahead: usize) -> (__m256, __m256i) {
    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(ahead) as *const i8);
    (f16_splat(p), block_weights(p, ty))
}

/// What Q4_0 (8) and Q5_0 (16) rows subtract from the unsigned bytes of [`block_weights`]; 0 for
/// Q8_0, whose bytes are the signed weights, and Q5_1, whose offset is a float (`m`, at byte 2).
pub(super) fn unsigned_offset(ty: GgmlType) -> i32 {
    match ty {
        GgmlType::Q4_0 => 8,
        GgmlType::Q5_0 => 16,
        _ => 0,
    }
}

/// The 32 weights of the Q8_0, Q4_0, Q5_0 or Q5_1 block at `p` as bytes: Q8_0's signed bytes,
/// Q4_0's nibbles 0..15, Q5_0's and Q5_1's 0..31 (their offsets not yet applied).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn block_weights(p: *const u8, ty: GgmlType) -> __m256i {
    match ty {
        GgmlType::Q4_0 => nibbles(p.add(2)),
        // Q4_0's nibbles with the fifth bits of `qh` on top (Q5_1: after d and m).
        GgmlType::Q5_0 => _mm256_or_si256(nibbles(p.add(6)), fifth_bits(p.add(2))),
        GgmlType::Q5_1 => _mm256_or_si256(nibbles(p.add(8)), fifth_bits(p.add(4))),
        _ => _mm256_loadu_si256(p.add(2) as *const __m256i),
    }
}

/// The 32 bits at `p` (Q5_0's and Q5_1's `qh`) as 32 bytes, 0x10 where the bit is set
/// (llama.cpp's `bytes_from_bits_32`: byte j gets the bits' byte j / 8, then all bits but j % 8
/// are set, so it is all ones exactly when bit j was).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn fifth_bits(p: *const u8) -> __m256i {
    let qh = (p as *const i32).read_unaligned();
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(qh),
        _mm256_set_epi64x(0x0303_0303_0303_0303, 0x0202_0202_0202_0202, 0x0101_0101_0101_0101, 0),
    );
    let all_but_bit = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
    let set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, all_but_bit), _mm256_set1_epi8(-1));
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// 16 bytes at `p` as 32 nibbles: the low ones are elements 0..16, the high ones 16..32.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn nibbles(p: *const u8) -> __m256i {
    let bytes = _mm_loadu_si128(p as *const __m128i);
    _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(0x0f))
}

/// The Q4_K tile: per super-block of 256 and row, 8 sub-blocks of 32 with 6-bit scales and mins.
/// The activations share one scale `da` per super-block (`ActScales::PerSuperBlock`), so
/// `d da sum_j sc_j dot(q_j, x_j) - dmin da sum_j m_j sum(x_j)`: each sub-block's products are
/// multiplied by its scale in the `madd` that sums them (integers) and added up over the
/// super-block; floats once per super-block. The mins go into the same accumulator (the lanes
/// are summed at the end anyway). `FIVE`: the Q5_K tile, the same with 32 bytes of fifth bits
/// before the nibbles (bit j of byte l for element l of sub-block j; 5-bit weights x 127 x 2
/// still fit `maddubs`'s 16 bits, and x 63 `madd`'s 32).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_tile<const R: usize, const T: usize, const FIVE: bool>(
    rows: [&[u8]; R],
    acts: [&[BlockQ8]; T],
) -> [[f32; T]; R] {
    const SUB: usize = QK_K / QK8;
    let (bb, qs) = if FIVE { (176, 48) } else { (144, 16) };
    let nsb = super_blocks(rows, acts, bb);
    let mask = _mm256_set1_epi8(0x0f);
    let ahead = tile_prefetch::<R>(rows[0].len());
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for sb in 0..nsb {
        // Per vector: its scale, and its blocks' sums times it (for the mins).
        let mut da = [_mm256_setzero_ps(); T];
        let mut dasum = [_mm256_setzero_ps(); T];
        for t in 0..T {
            let a = acts[t].get_unchecked(sb * SUB..(sb + 1) * SUB);
            debug_assert!(a.iter().all(|b| b.d == a[0].d), "Q4_K wants per-super-block scales");
            let sums: [i32; SUB] = std::array::from_fn(|j| a[j].sum);
            da[t] = _mm256_set1_ps(a[0].d);
            let sums = _mm256_cvtepi32_ps(_mm256_loadu_si256(sums.as_ptr() as *const __m256i));
            dasum[t] = _mm256_mul_ps(da[t], sums);
        }
        for r in 0..R {
            let b = rows[r].get_unchecked(sb * bb..(sb + 1) * bb);
            prefetch_block(b.as_ptr(), bb, ahead);
            let (d, dmin) = (f16c(b, 0), f16c(b, 2));
            let (sc, m) = q4_k_scales_mins(&b[4..16]);
            let sc = _mm256_broadcastsi128_si256(_mm_cvtsi64_si128(sc as i64));
            let mv = _mm256_mul_ps(bytes_to_f32(m), _mm256_set1_ps(dmin));
            let mut isum = [_mm256_setzero_si256(); T];
            // Q5_K: each byte's next fifth bit in bit 0 (shifted right once per sub-block).
            let mut high = if FIVE {
                _mm256_loadu_si256(b.as_ptr().add(16) as *const __m256i)
            } else {
                _mm256_setzero_si256()
            };
            for chunk in 0..4 {
                let bytes = _mm256_loadu_si256(b.as_ptr().add(qs + chunk * 32) as *const __m256i);
                let lo = _mm256_and_si256(bytes, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
                for (j, mut w) in [(2 * chunk, lo), (2 * chunk + 1, hi)] {
                    if FIVE {
                        w = _mm256_or_si256(w, fifth_bit(high));
                        high = _mm256_srli_epi16(high, 1);
                    }
                    // Sub-block j's scale in every 16-bit lane (byte j, then a zero byte).
                    let s = _mm256_shuffle_epi8(sc, _mm256_set1_epi16((0x8000 | j) as i16));
                    for t in 0..T {
                        let x = _mm256_loadu_si256(
                            acts[t].get_unchecked(sb * SUB + j).qs.as_ptr() as *const __m256i
                        );
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), s);
                        isum[t] = _mm256_add_epi32(isum[t], p);
                    }
                }
            }
            let dv = _mm256_set1_ps(d);
            for t in 0..T {
                let scale = _mm256_mul_ps(dv, da[t]);
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), scale, acc[r][t]);
                acc[r][t] = _mm256_fnmadd_ps(mv, dasum[t], acc[r][t]);
            }
        }
    }
    std::array::from_fn(|r| std::array::from_fn(|t| hsum_ps(acc[r][t])))
}

/// Bit 0 of each byte of `v` moved to bit 4 (0x10 where it is set), the rest cleared.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn fifth_bit(v: __m256i) -> __m256i {
    // In 16-bit lanes bit 0 of either byte lands on bit 4 of the same byte.
    _mm256_and_si256(_mm256_slli_epi16(v, 4), _mm256_set1_epi8(0x10))
}

/// The Q6_K tile: per super-block of 256 and row, 16 groups of 16 six-bit weights (stored
/// 0..63, meaning q - 32) with signed 8-bit scales. As in the Q4_K tile, the activations share
/// one scale per super-block, so the groups' scales multiply in the integer `madd` and floats
/// come once per super-block.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_tile<const R: usize, const T: usize>(
    rows: [&[u8]; R],
    acts: [&[BlockQ8]; T],
) -> [[f32; T]; R] {
    const SUB: usize = QK_K / QK8;
    let nsb = super_blocks(rows, acts, 210);
    let ahead = tile_prefetch::<R>(rows[0].len());
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for sb in 0..nsb {
        let mut da = [_mm256_setzero_ps(); T];
        for t in 0..T {
            let a = acts[t].get_unchecked(sb * SUB..(sb + 1) * SUB);
            debug_assert!(a.iter().all(|b| b.d == a[0].d), "Q6_K wants per-super-block scales");
            da[t] = _mm256_set1_ps(a[0].d);
        }
        for r in 0..R {
            let b = rows[r].get_unchecked(sb * 210..(sb + 1) * 210);
            prefetch_block(b.as_ptr(), 210, ahead);
            let p = b.as_ptr();
            let scales = _mm_loadu_si128(p.add(192) as *const __m128i);
            let mut isum = [_mm256_setzero_si256(); T];
            for half in 0..2 {
                let ws = q6_k_weights(p, half);
                for (k, &w) in ws.iter().enumerate() {
                    let abs_w = _mm256_sign_epi8(w, w);
                    // Elements 0..16 (the low 128-bit lane) take scale 2k, 16..32 scale 2k + 1.
                    let i = (half * 8 + 2 * k) as u8;
                    let pick =
                        _mm_set_epi64x(i64::from_ne_bytes([i + 1; 8]), i64::from_ne_bytes([i; 8]));
                    let s16 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, pick));
                    for t in 0..T {
                        let x = _mm256_loadu_si256(
                            acts[t].get_unchecked(sb * SUB + half * 4 + k).qs.as_ptr()
                                as *const __m256i,
                        );
                        let prod = _mm256_maddubs_epi16(abs_w, _mm256_sign_epi8(x, w));
                        isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(prod, s16));
                    }
                }
            }
            let dv = f16_splat(b.as_ptr().add(208));
            for t in 0..T {
                let scale = _mm256_mul_ps(dv, da[t]);
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), scale, acc[r][t]);
            }
        }
    }
    std::array::from_fn(|r| std::array::from_fn(|t| hsum_ps(acc[r][t])))
}

/// Half `half` (0 or 1) of the Q6_K super-block at `b`: its 128 weights as 4 vectors of 32
/// signed bytes (q - 32). Group k takes ql[0..32]'s (k even) or ql[32..64]'s (k odd) low (k < 2)
/// or high nibbles, with bits 2k, 2k+1 of qh on top.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn q6_k_weights(b: *const u8, half: usize) -> [__m256i; 4] {
    let (m4, m2, m32) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(3), _mm256_set1_epi8(32));
    let ql0 = _mm256_loadu_si256(b.add(half * 64) as *const __m256i);
    let ql1 = _mm256_loadu_si256(b.add(half * 64 + 32) as *const __m256i);
    let qh = _mm256_loadu_si256(b.add(128 + half * 32) as *const __m256i);
    let lows = [ql0, ql1, _mm256_srli_epi16(ql0, 4), _mm256_srli_epi16(ql1, 4)];
    let highs = [qh, _mm256_srli_epi16(qh, 2), _mm256_srli_epi16(qh, 4), _mm256_srli_epi16(qh, 6)];
    std::array::from_fn(|k| {
        let low = _mm256_and_si256(lows[k], m4);
        let high = _mm256_slli_epi16(_mm256_and_si256(highs[k], m2), 4);
        _mm256_sub_epi8(_mm256_or_si256(low, high), m32)
    })
}

/// The super-blocks of 256 a K-quant tile multiplies (`block_bytes` each in the rows), after
/// checking that every row holds them and every activation vector has their blocks.
fn super_blocks<const R: usize, const T: usize>(
    rows: [&[u8]; R],
    acts: [&[BlockQ8]; T],
    block_bytes: usize,
) -> usize {
    let nsb = acts[0].len() / (QK_K / QK8);
    assert!(rows.iter().all(|r| r.len() >= nsb * block_bytes), "K-quant tile: rows too short");
    assert!(acts.iter().all(|a| a.len() == nsb * (QK_K / QK8)), "K-quant tile: activations");
    nsb
}

/// 8 bytes (in a u64, first byte lowest) as 8 floats.
#[inline]
#[target_feature(enable = "avx2")]
fn bytes_to_f32(v: u64) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi64x(0, v as i64)))
}

/// Prefetch the cache lines `ahead` bytes past a super-block of `len` bytes at `p`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn prefetch_block(p: *const u8, len: usize, ahead: usize) {
    for off in (0..len).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(ahead + off) as *const i8);
    }
}

/// How far ahead a tile of `R` rows prefetches: the rows are contiguous, so the same place in
/// the next tile (long rows), or `PREFETCH_BYTES` when that is nearer (short rows).
pub(super) fn tile_prefetch<const R: usize>(row_len: usize) -> usize {
    PREFETCH_BYTES.max(R * row_len)
}

/// The f16 at `p`, by F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16c_ptr(p: *const u8) -> f32 {
    let bits = (p as *const u16).read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(bits as i16)))
}

/// The f16 at `p` in all 8 lanes: its bits broadcast (`vpbroadcastw`), then converted; two
/// instructions, where converting lane 0 and broadcasting the float took three (and LLVM made
/// the first a `vpinsrw`, which merges into a stale register).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16_splat(p: *const u8) -> __m256 {
    let bits = (p as *const u16).read_unaligned();
    _mm256_cvtph_ps(_mm_set1_epi16(bits as i16))
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_float_row(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    let n = x.len();
    let main = n / 16 * 16;
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let xp = x.as_ptr();
    match ty {
        GgmlType::F32 => {
            let wp = row.as_ptr() as *const f32;
            for i in (0..main).step_by(16) {
                acc0 =
                    _mm256_fmadd_ps(_mm256_loadu_ps(wp.add(i)), _mm256_loadu_ps(xp.add(i)), acc0);
                acc1 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(wp.add(i + 8)),
                    _mm256_loadu_ps(xp.add(i + 8)),
                    acc1,
                );
            }
            hsum_ps(_mm256_add_ps(acc0, acc1))
                + scalar::dot_float_row(ty, &row[main * 4..], &x[main..])
        }
        GgmlType::F16 => {
            let wp = row.as_ptr() as *const __m128i;
            for i in (0..main).step_by(16) {
                let w0 = _mm256_cvtph_ps(_mm_loadu_si128(wp.add(i / 8)));
                let w1 = _mm256_cvtph_ps(_mm_loadu_si128(wp.add(i / 8 + 1)));
                acc0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp.add(i)), acc0);
                acc1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp.add(i + 8)), acc1);
            }
            hsum_ps(_mm256_add_ps(acc0, acc1))
                + scalar::dot_float_row(ty, &row[main * 2..], &x[main..])
        }
        _ => scalar::dot_float_row(ty, row, x),
    }
}

#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let main = n / 16 * 16;
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    for i in (0..main).step_by(16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(ap.add(i)), _mm256_loadu_ps(bp.add(i)), acc0);
        acc1 =
            _mm256_fmadd_ps(_mm256_loadu_ps(ap.add(i + 8)), _mm256_loadu_ps(bp.add(i + 8)), acc1);
    }
    hsum_ps(_mm256_add_ps(acc0, acc1)) + scalar::dot_f32(&a[main..n], &b[main..n])
}

#[target_feature(enable = "avx2,fma")]
pub unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len().min(y.len());
    let main = n / 8 * 8;
    let av = _mm256_set1_ps(a);
    let (xp, yp) = (x.as_ptr(), y.as_mut_ptr());
    for i in (0..main).step_by(8) {
        _mm256_storeu_ps(
            yp.add(i),
            _mm256_fmadd_ps(av, _mm256_loadu_ps(xp.add(i)), _mm256_loadu_ps(yp.add(i))),
        );
    }
    scalar::axpy(a, &x[main..n], &mut y[main..n]);
}

/// Eight cached floats at element `i` of `rows`: loaded, or converted from f16 by F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8(rows: KvRows, i: usize) -> __m256 {
    match rows {
        KvRows::F32(r) => _mm256_loadu_ps(r.as_ptr().add(i)),
        KvRows::F16(r) => _mm256_cvtph_ps(_mm_loadu_si128(r.as_ptr().add(i) as *const __m128i)),
    }
}

/// Four keys at a time: four dot products accumulate side by side, then one reduction gives all
/// four (a call and a horizontal sum per key were most of the time at long contexts).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn attention_scores(
    q: &[f32],
    keys: KvRows,
    stride: usize,
    scale: f32,
    out: &mut [f32],
) {
    let d = q.len();
    let qp = q.as_ptr();
    let n = out.len();
    let mut p = 0;
    while p + 4 <= n {
        let mut acc = [_mm256_setzero_ps(); 4];
        for i in (0..d).step_by(8) {
            let qv = _mm256_loadu_ps(qp.add(i));
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(qv, load8(keys, (p + j) * stride + i), *a);
            }
        }
        // [s0 s1 s2 s3] from four vectors of eight partial sums.
        let t = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
        let s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
        _mm_storeu_ps(out.as_mut_ptr().add(p), _mm_mul_ps(s, _mm_set1_ps(scale)));
        p += 4;
    }
    for (p, o) in out.iter_mut().enumerate().skip(p) {
        let mut acc = _mm256_setzero_ps();
        for i in (0..d).step_by(8) {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(i)), load8(keys, p * stride + i), acc);
        }
        *o = hsum_ps(acc) * scale;
    }
}

/// The output stays in registers while the values stream past: 64 columns at a time in eight
/// accumulators, narrower remainders over two interleaved sets of positions, so at least eight
/// independent multiply-adds are in flight (one chain per accumulator waited on the adder's
/// latency: half the speed).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn attention_values(weights: &[f32], values: KvRows, stride: usize, out: &mut [f32]) {
    let d = out.len();
    let mut c = 0;
    while d - c >= 64 {
        values_columns::<8, 1>(weights, values, stride, c, out);
        c += 64;
    }
    for width in [4, 2, 1] {
        if d - c >= 8 * width {
            match width {
                4 => values_columns::<4, 2>(weights, values, stride, c, out),
                2 => values_columns::<2, 2>(weights, values, stride, c, out),
                _ => values_columns::<1, 2>(weights, values, stride, c, out),
            }
            c += 8 * width;
        }
    }
}

/// Columns `c..c + 8W` of [`attention_values`], with `S` sets of accumulators taking every
/// `S`-th position.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn values_columns<const W: usize, const S: usize>(
    weights: &[f32],
    values: KvRows,
    stride: usize,
    c: usize,
    out: &mut [f32],
) {
    let mut acc = [[_mm256_setzero_ps(); W]; S];
    let mut rows = weights.chunks_exact(S);
    for (r, ws) in rows.by_ref().enumerate() {
        for (s, (&w, a)) in ws.iter().zip(&mut acc).enumerate() {
            let (wv, at) = (_mm256_set1_ps(w), (r * S + s) * stride + c);
            for (k, a) in a.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(wv, load8(values, at + 8 * k), *a);
            }
        }
    }
    let done = weights.len() - rows.remainder().len();
    for (p, &w) in rows.remainder().iter().enumerate() {
        let (wv, at) = (_mm256_set1_ps(w), (done + p) * stride + c);
        for (k, a) in acc[0].iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(wv, load8(values, at + 8 * k), *a);
        }
    }
    for k in 0..W {
        let mut sum = acc[0][k];
        for set in &acc[1..] {
            sum = _mm256_add_ps(sum, set[k]);
        }
        _mm256_storeu_ps(out.as_mut_ptr().add(c + 8 * k), sum);
    }
}

/// e^x for 8 floats: x = n ln2 + r (ln2 in two parts, |r| <= ln2 / 2), e^r by Cephes' degree-6
/// polynomial, 2^n into the exponent bits. x is clamped to [-87.3, 88.3] so 2^n stays a normal
/// float (e^-87.3 ~ 1.2e-38 stands for anything smaller, 0 included).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp_ps(x: __m256) -> __m256 {
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3)), _mm256_set1_ps(88.3));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_PARTS[0]), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_PARTS[1]), r);
    let mut p = _mm256_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let e = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0)));
    let n = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    _mm256_mul_ps(e, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(n)))
}

#[target_feature(enable = "avx2,fma")]
pub unsafe fn softmax(x: &mut [f32]) {
    let main = x.len() / 8 * 8;
    let p = x.as_mut_ptr();
    let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
    for i in (0..main).step_by(8) {
        m = _mm256_max_ps(m, _mm256_loadu_ps(p.add(i)));
    }
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_movehdup_ps(m));
    let max = x[main..].iter().fold(_mm_cvtss_f32(m), |a, &b| a.max(b));
    let (mv, mut sums) = (_mm256_set1_ps(max), _mm256_setzero_ps());
    for i in (0..main).step_by(8) {
        let e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), mv));
        _mm256_storeu_ps(p.add(i), e);
        sums = _mm256_add_ps(sums, e);
    }
    let mut sum = hsum_ps(sums);
    for v in &mut x[main..] {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = _mm256_set1_ps(1.0 / sum);
    for i in (0..main).step_by(8) {
        _mm256_storeu_ps(p.add(i), _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), inv));
    }
    for v in &mut x[main..] {
        *v /= sum;
    }
}

#[target_feature(enable = "avx2,fma")]
pub unsafe fn silu_mul(gate: &[f32], up: &mut [f32]) {
    let main = up.len() / 8 * 8;
    let (g, u) = (gate.as_ptr(), up.as_mut_ptr());
    let one = _mm256_set1_ps(1.0);
    for i in (0..main).step_by(8) {
        let gv = _mm256_loadu_ps(g.add(i));
        let e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        let silu = _mm256_div_ps(gv, _mm256_add_ps(one, e));
        _mm256_storeu_ps(u.add(i), _mm256_mul_ps(_mm256_loadu_ps(u.add(i)), silu));
    }
    scalar::silu_mul(&gate[main..], &mut up[main..]);
}
