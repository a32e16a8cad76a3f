//! The fast CPU path's dot products: weights are never expanded to f32.
//!
//! For the quantised weight types (Q8_0, Q4_0, Q4_K, Q6_K) the activation vector is first
//! quantised to [`BlockQ8`] blocks of 32 (as llama.cpp quantises activations to Q8_0, except that
//! the scale stays f32), and each weight block is multiplied with its activation block in integer
//! arithmetic: int8 x int8 (Q8_0), int4 x int8 (Q4_0, Q4_K), int6 x int8 (Q6_K), one float
//! multiply-add per block or sub-block. F32, F16 and BF16 rows are converted in registers and
//! multiplied with the f32 activations directly (fused; no row buffer).
//!
//! Every kernel has a portable scalar version, the oracle the SIMD versions are tested against
//! (`tests/cpu_kernels.rs`), and SIMD versions: x86-64 AVX2+FMA+F16C (picked at run time with
//! `is_x86_feature_detected!`) and wasm32 simd128 (picked at compile time, when the crate is built
//! with `-C target-feature=+simd128`). aarch64 NEON is not written yet: it uses the scalar path.

use half::{bf16, f16};

use crate::quant::{q4_k_scale_min, GgmlType, QK_K};

/// Elements per activation block.
pub const QK8: usize = 32;

/// 32 activations quantised to int8: `x[i] ~= d * qs[i]`, with `sum = sum(qs)` precomputed for the
/// weight types whose blocks carry an offset (Q4_0's -8, Q4_K's min).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(C)]
pub struct BlockQ8 {
    pub d: f32,
    pub sum: i32,
    pub qs: [i8; QK8],
}

/// Which instruction set a kernel uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust: the oracle.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// wasm32 simd128.
    Simd128,
}

impl Isa {
    /// The best instruction set this machine (or this wasm build) supports.
    pub fn detect() -> Isa {
        Isa::available().last().copied().unwrap_or(Isa::Scalar)
    }

    /// Every instruction set usable here, scalar first.
    pub fn available() -> Vec<Isa> {
        #[allow(unused_mut)]
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
            v.push(Isa::Avx2);
        }
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        v.push(Isa::Simd128);
        v
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Simd128 => "simd128",
        }
    }
}

/// Whether the fast path multiplies rows of `ty` with Q8-quantised activations (else f32).
pub fn uses_q8_activations(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_K | GgmlType::Q6_K)
}

/// Quantise `x` (a multiple of 32 long) to blocks: d = max|x| / 127, q = round(x / d).
pub fn quantize_activations(x: &[f32], out: &mut [BlockQ8]) {
    debug_assert_eq!(x.len(), out.len() * QK8);
    for (xb, o) in x.chunks_exact(QK8).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in o.qs.iter_mut().zip(xb) {
            *q = (v * id).round() as i8;
            sum += *q as i32;
        }
        o.d = d;
        o.sum = sum;
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dot product of one weight row of `ty` (Q8_0, Q4_0, Q4_K or Q6_K; `row` is its bytes) with the
/// quantised activations `act` (`cols / 32` blocks).
pub fn dot_q8(isa: Isa, ty: GgmlType, row: &[u8], act: &[BlockQ8]) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Isa::Avx2 is only produced by `available()` after detecting avx2, fma and f16c.
        Isa::Avx2 => unsafe { avx2::dot_q8(ty, row, act) },
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        Isa::Simd128 => simd128::dot_q8(ty, row, act),
        _ => scalar::dot_q8(ty, row, act),
    }
}

/// Dot product of one F32, F16 or BF16 weight row (`row` is its bytes) with f32 activations.
pub fn dot_float_row(isa: Isa, ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { avx2::dot_float_row(ty, row, x) },
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        Isa::Simd128 => simd128::dot_float_row(ty, row, x),
        _ => scalar::dot_float_row(ty, row, x),
    }
}

/// `sum(a[i] * b[i])`.
pub fn dot_f32(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { avx2::dot_f32(a, b) },
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        Isa::Simd128 => simd128::dot_f32(a, b),
        _ => scalar::dot_f32(a, b),
    }
}

/// `y[i] += a * x[i]`.
pub fn axpy(isa: Isa, a: f32, x: &[f32], y: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { avx2::axpy(a, x, y) },
        _ => scalar::axpy(a, x, y),
    }
}

/// The portable kernels: the oracle for the SIMD ones.
pub mod scalar {
    use super::*;

    pub fn dot_q8(ty: GgmlType, row: &[u8], act: &[BlockQ8]) -> f32 {
        match ty {
            GgmlType::Q8_0 => row
                .chunks_exact(34)
                .zip(act)
                .map(|(b, a)| {
                    let s: i32 = b[2..34].iter().zip(&a.qs).map(|(&w, &x)| (w as i8) as i32 * x as i32).sum();
                    f16_at(b, 0) * a.d * s as f32
                })
                .sum(),
            GgmlType::Q4_0 => row
                .chunks_exact(18)
                .zip(act)
                .map(|(b, a)| {
                    let qs = &b[2..18];
                    let mut s = 0i32;
                    for j in 0..16 {
                        s += ((qs[j] & 0x0f) as i32 - 8) * a.qs[j] as i32;
                        s += ((qs[j] >> 4) as i32 - 8) * a.qs[j + 16] as i32;
                    }
                    f16_at(b, 0) * a.d * s as f32
                })
                .sum(),
            GgmlType::Q4_K => row.chunks_exact(144).zip(act.chunks_exact(QK_K / QK8)).map(|(b, a)| q4_k_block(b, a)).sum(),
            GgmlType::Q6_K => row.chunks_exact(210).zip(act.chunks_exact(QK_K / QK8)).map(|(b, a)| q6_k_block(b, a)).sum(),
            other => panic!("dot_q8: {} rows take f32 activations", other.name()),
        }
    }

    /// One Q4_K super-block (8 sub-blocks of 32, each with a 6-bit scale and min) times 8
    /// activation blocks: sum_j d*sc_j*da_j*dot(q_j, a_j) - dmin*m_j*da_j*sum(a_j).
    fn q4_k_block(b: &[u8], a: &[BlockQ8]) -> f32 {
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        let (scales, qs) = (&b[4..16], &b[16..144]);
        let mut acc = 0f32;
        for (j, aj) in a.iter().enumerate() {
            let (sc, m) = q4_k_scale_min(j, scales);
            let q = &qs[(j / 2) * 32..(j / 2) * 32 + 32];
            let shift = 4 * (j % 2);
            let s: i32 = q.iter().zip(&aj.qs).map(|(&w, &x)| ((w >> shift) & 0x0f) as i32 * x as i32).sum();
            acc += aj.d * (d * sc as f32 * s as f32 - dmin * m as f32 * aj.sum as f32);
        }
        acc
    }

    /// One Q6_K super-block (16 sub-blocks of 16 with int8 scales) times 8 activation blocks.
    fn q6_k_block(b: &[u8], a: &[BlockQ8]) -> f32 {
        let d = f16_at(b, 208);
        let mut acc = 0f32;
        for half in 0..2 {
            let ql = &b[half * 64..half * 64 + 64];
            let qh = &b[128 + half * 32..128 + half * 32 + 32];
            let sc = &b[192 + half * 8..192 + half * 8 + 8];
            for k in 0..4 {
                let ak = &a[half * 4 + k];
                let mut sums = [0i32; 2];
                for l in 0..32 {
                    let low = if k % 2 == 0 { ql[l] } else { ql[l + 32] };
                    let low = if k < 2 { low & 0x0f } else { low >> 4 };
                    let q = (low | (((qh[l] >> (2 * k)) & 3) << 4)) as i32 - 32;
                    sums[l / 16] += q * ak.qs[l] as i32;
                }
                let s = (sc[2 * k] as i8) as i32 * sums[0] + (sc[2 * k + 1] as i8) as i32 * sums[1];
                acc += d * ak.d * s as f32;
            }
        }
        acc
    }

    pub fn dot_float_row(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
        match ty {
            GgmlType::F32 => row.chunks_exact(4).zip(x).map(|(c, &v)| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * v).sum(),
            GgmlType::F16 => row.chunks_exact(2).zip(x).map(|(c, &v)| f16::from_le_bytes([c[0], c[1]]).to_f32() * v).sum(),
            GgmlType::BF16 => row.chunks_exact(2).zip(x).map(|(c, &v)| bf16::from_le_bytes([c[0], c[1]]).to_f32() * v).sum(),
            other => panic!("dot_float_row: {} is quantised", other.name()),
        }
    }

    /// The same expression as the reference path's `cpu::dot`, so results match it bit for bit.
    pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        for (yi, xi) in y.iter_mut().zip(x) {
            *yi += a * xi;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// The f16 at byte `i`, converted by the F16C instruction (the `half` crate's conversion is
    /// software unless the whole build targets F16C, and it ran once per 32 weights).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn f16c(b: &[u8], i: usize) -> f32 {
        let bits = u16::from_le_bytes([b[i], b[i + 1]]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum_ps(v: __m256) -> f32 {
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
            GgmlType::Q4_0 => {
                let mut acc = _mm256_setzero_ps();
                let mut offset = 0f32;
                let mask = _mm256_set1_epi8(0x0f);
                for (b, a) in row.chunks_exact(18).zip(act) {
                    let bytes = _mm_loadu_si128(b.as_ptr().add(2) as *const __m128i);
                    // Low nibbles are elements 0..16, high nibbles 16..32.
                    let both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);
                    let w = _mm256_and_si256(both, mask);
                    let x = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
                    let d = f16c(b, 0) * a.d;
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(mul_u8(w, x)), acc);
                    // sum((q - 8) * x) = sum(q * x) - 8 * sum(x)
                    offset += d * (8 * a.sum) as f32;
                }
                hsum_ps(acc) - offset
            }
            GgmlType::Q4_K => {
                let mut acc = _mm256_setzero_ps();
                let mut mins = 0f32;
                let mask = _mm256_set1_epi8(0x0f);
                for (b, a) in row.chunks_exact(144).zip(act.chunks_exact(QK_K / QK8)) {
                    let (d, dmin) = (f16c(b, 0), f16c(b, 2));
                    let scales = &b[4..16];
                    for chunk in 0..4 {
                        let bytes = _mm256_loadu_si256(b.as_ptr().add(16 + chunk * 32) as *const __m256i);
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
            GgmlType::Q6_K => {
                let mut acc = _mm256_setzero_ps();
                let m4 = _mm256_set1_epi8(0x0f);
                let m2 = _mm256_set1_epi8(3);
                let m32 = _mm256_set1_epi8(32);
                for (b, a) in row.chunks_exact(210).zip(act.chunks_exact(QK_K / QK8)) {
                    let d = f16c(b, 208);
                    for half in 0..2 {
                        let p = b.as_ptr();
                        let ql0 = _mm256_loadu_si256(p.add(half * 64) as *const __m256i);
                        let ql1 = _mm256_loadu_si256(p.add(half * 64 + 32) as *const __m256i);
                        let qh = _mm256_loadu_si256(p.add(128 + half * 32) as *const __m256i);
                        let sc = &b[192 + half * 8..192 + half * 8 + 8];
                        let lows = [
                            _mm256_and_si256(ql0, m4),
                            _mm256_and_si256(ql1, m4),
                            _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                            _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                        ];
                        let highs = [
                            _mm256_and_si256(qh, m2),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 4), m2),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 6), m2),
                        ];
                        for k in 0..4 {
                            let ak = &a[half * 4 + k];
                            let q = _mm256_or_si256(lows[k], _mm256_slli_epi16(highs[k], 4));
                            let w = _mm256_sub_epi8(q, m32);
                            let x = _mm256_loadu_si256(ak.qs.as_ptr() as *const __m256i);
                            let p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
                            // Elements 0..16 are the low 128-bit lane: scale sc[2k]; 16..32: sc[2k+1].
                            let s16 = _mm256_set_m128i(
                                _mm_set1_epi16((sc[2 * k + 1] as i8) as i16),
                                _mm_set1_epi16((sc[2 * k] as i8) as i16),
                            );
                            let s32 = _mm256_madd_epi16(p16, s16);
                            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * ak.d), _mm256_cvtepi32_ps(s32), acc);
                        }
                    }
                }
                hsum_ps(acc)
            }
            _ => scalar::dot_q8(ty, row, act),
        }
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
                    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(wp.add(i)), _mm256_loadu_ps(xp.add(i)), acc0);
                    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(wp.add(i + 8)), _mm256_loadu_ps(xp.add(i + 8)), acc1);
                }
                hsum_ps(_mm256_add_ps(acc0, acc1)) + scalar::dot_float_row(ty, &row[main * 4..], &x[main..])
            }
            GgmlType::F16 => {
                let wp = row.as_ptr() as *const __m128i;
                for i in (0..main).step_by(16) {
                    let w0 = _mm256_cvtph_ps(_mm_loadu_si128(wp.add(i / 8)));
                    let w1 = _mm256_cvtph_ps(_mm_loadu_si128(wp.add(i / 8 + 1)));
                    acc0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp.add(i)), acc0);
                    acc1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp.add(i + 8)), acc1);
                }
                hsum_ps(_mm256_add_ps(acc0, acc1)) + scalar::dot_float_row(ty, &row[main * 2..], &x[main..])
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
            acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(ap.add(i + 8)), _mm256_loadu_ps(bp.add(i + 8)), acc1);
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
            _mm256_storeu_ps(yp.add(i), _mm256_fmadd_ps(av, _mm256_loadu_ps(xp.add(i)), _mm256_loadu_ps(yp.add(i))));
        }
        scalar::axpy(a, &x[main..n], &mut y[main..n]);
    }
}

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod simd128 {
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
}
