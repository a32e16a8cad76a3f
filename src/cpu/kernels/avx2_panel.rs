//! x86-64 AVX2 prefill panels (see `kernels::Panel`): 8 weight rows unpacked to one byte per
//! weight and interleaved, so one 256-bit vector holds 4 consecutive weights of each of the 8
//! rows. One broadcast of 4 activation bytes then multiplies all 8 rows in one `maddubs`; with
//! 4-bit weights (0..=15) the products of a whole block of 32 add up in 16-bit lanes
//! (8 x 2 x 15 x 127 < 2^15) before one `madd` (5-bit ones, Q5_0's, Q5_1's and Q5_K's 0..=31,
//! half a block), and the float work (the scales, Q4_0's -8, Q5_0's -16, Q5_1's m, the K-quants'
//! mins) is one vector for 8 rows.
//! Signed weights take llama.cpp's sign trick (`maddubs` wants one unsigned operand); Q6_K's
//! (-32..=31) add up in 16 bits over their 16 weights that share an integer scale, which one
//! `madd` then applies. The 4-row tiles instead unpack each
//! weight block again for every pair of tokens and do the float work per row and token.

use super::avx2::{block_weights, f16c_ptr, fifth_bit, q6_k_weights, unsigned_offset};
use super::*;
use std::arch::x86_64::*;

/// Whether there is a panel kernel for `ty`.
pub fn has_panel(ty: GgmlType) -> bool {
    GgmlType::QUANTISED.contains(&ty)
}

/// See `kernels::panel_gemm`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn panel_gemm(
    ty: GgmlType,
    rows: [&[u8]; PANEL_ROWS],
    acts: &[BlockQ8],
    panel: &mut Panel,
    out: &mut [f32],
) {
    panel_gemm_with::<false>(ty, rows, acts, panel, out)
}

/// [`panel_gemm`] where the CPU has AVX-512 VNNI (on 256-bit vectors): `vpdpbusd` multiplies
/// the unsigned weight bytes by the signed activation bytes and adds each group of four into the
/// 32-bit sums in one instruction, where AVX2 takes `maddubs`, an add in 16 bits and a widening
/// `madd`; Q6_K's scaled sums go in one `vpdpwssd`. The integer sums are exact either way, so
/// both give the same results bit for bit.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn panel_gemm_vnni(
    ty: GgmlType,
    rows: [&[u8]; PANEL_ROWS],
    acts: &[BlockQ8],
    panel: &mut Panel,
    out: &mut [f32],
) {
    panel_gemm_with::<true>(ty, rows, acts, panel, out)
}

/// The body of both: inlined into each, so it compiles with each one's instruction set (it has
/// no target features of its own, and no closures that call intrinsics, which would not inherit
/// them).
#[inline(always)]
unsafe fn panel_gemm_with<const VNNI: bool>(
    ty: GgmlType,
    rows: [&[u8]; PANEL_ROWS],
    acts: &[BlockQ8],
    panel: &mut Panel,
    out: &mut [f32],
) {
    pack(ty, rows, panel);
    panel_tiles!(panel, acts, out, |t, tile: T| {
        let sums = match panel.kind {
            PanelQuants::Nibbles => panel_tile::<T, NIBBLES, VNNI>(panel, tile),
            PanelQuants::Bytes => panel_tile::<T, BYTES, VNNI>(panel, tile),
            PanelQuants::SixBits => panel_tile::<T, SIX_BITS, VNNI>(panel, tile),
            PanelQuants::FiveBits => panel_tile::<T, FIVE_BITS, VNNI>(panel, tile),
        };
        for (k, s) in sums.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add((t + k) * PANEL_ROWS), *s);
        }
    });
}

/// `PanelQuants` as const parameters of `panel_tile`.
const NIBBLES: u8 = 0;
const BYTES: u8 = 1;
const SIX_BITS: u8 = 2;
const FIVE_BITS: u8 = 3;

/// The panel times `T` activation vectors: for each, the 8 rows' dot products in one vector.
/// `NIBBLES`: a block's 4 x 2 x 15 x 127 products fit 16 bits; `BYTES` (Q8_0's -128..=127):
/// two products of 128 x 127 already fill 16 bits, so every `maddubs` is widened to 32;
/// `SIX_BITS`: 16 weights fit (8 x 32 x 127), then times their scale in the widening `madd`;
/// `FIVE_BITS`: half a block fits (4 x 2 x 31 x 127), so two widening `madd`s a block.
/// `VNNI`: `vpdpbusd` into the 32-bit sums directly (see [`panel_gemm_vnni`]).
// Token t's registers are indexed in lockstep with its activations: ranges read better here.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn panel_tile<const T: usize, const KIND: u8, const VNNI: bool>(
    panel: &Panel,
    acts: [&[BlockQ8]; T],
) -> [__m256; T] {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..panel.scales.len() {
        let q = panel.quants.as_ptr().add(b * 8) as *const __m256i;
        let mut x = [std::ptr::null::<i32>(); T];
        for t in 0..T {
            x[t] = acts[t].get_unchecked(b).qs.as_ptr() as *const i32;
        }
        // Four activations of vector t, broadcast: they meet weights 4j..4j+4 of every row.
        macro_rules! xj {
            ($t:expr, $j:expr) => {
                _mm256_set1_epi32(x[$t].add($j).read_unaligned())
            };
        }
        let mut isum = [_mm256_setzero_si256(); T];
        match KIND {
            NIBBLES | FIVE_BITS if VNNI => {
                for j in 0..8 {
                    let w = _mm256_loadu_si256(q.add(j));
                    for t in 0..T {
                        isum[t] = _mm256_dpbusd_epi32(isum[t], w, xj!(t, j));
                    }
                }
            }
            NIBBLES => {
                for j in 0..8 {
                    let w = _mm256_loadu_si256(q.add(j));
                    for t in 0..T {
                        isum[t] = _mm256_add_epi16(isum[t], _mm256_maddubs_epi16(w, xj!(t, j)));
                    }
                }
                for t in 0..T {
                    isum[t] = _mm256_madd_epi16(isum[t], ones);
                }
            }
            FIVE_BITS => {
                for h in 0..2 {
                    let mut half = [_mm256_setzero_si256(); T];
                    for j in 4 * h..4 * h + 4 {
                        let w = _mm256_loadu_si256(q.add(j));
                        for t in 0..T {
                            half[t] = _mm256_add_epi16(half[t], _mm256_maddubs_epi16(w, xj!(t, j)));
                        }
                    }
                    for t in 0..T {
                        isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(half[t], ones));
                    }
                }
            }
            BYTES => {
                for j in 0..8 {
                    let w = _mm256_loadu_si256(q.add(j));
                    let abs_w = _mm256_sign_epi8(w, w);
                    for t in 0..T {
                        let signed_x = _mm256_sign_epi8(xj!(t, j), w);
                        isum[t] = if VNNI {
                            _mm256_dpbusd_epi32(isum[t], abs_w, signed_x)
                        } else {
                            let p = _mm256_maddubs_epi16(abs_w, signed_x);
                            _mm256_add_epi32(isum[t], _mm256_madd_epi16(p, ones))
                        };
                    }
                }
            }
            _ => {
                for h in 0..2 {
                    let mut half = [_mm256_setzero_si256(); T];
                    for j in 4 * h..4 * h + 4 {
                        let w = _mm256_loadu_si256(q.add(j));
                        let abs_w = _mm256_sign_epi8(w, w);
                        for t in 0..T {
                            let p = _mm256_maddubs_epi16(abs_w, _mm256_sign_epi8(xj!(t, j), w));
                            half[t] = _mm256_add_epi16(half[t], p);
                        }
                    }
                    let scale = panel.int_scales.get_unchecked(2 * b + h).as_ptr();
                    let scale = _mm256_loadu_si256(scale as *const __m256i);
                    for t in 0..T {
                        isum[t] = if VNNI {
                            _mm256_dpwssd_epi32(isum[t], half[t], scale)
                        } else {
                            _mm256_add_epi32(isum[t], _mm256_madd_epi16(half[t], scale))
                        };
                    }
                }
            }
        }
        let d = _mm256_loadu_ps(panel.scales.get_unchecked(b).as_ptr());
        let m = _mm256_loadu_ps(panel.offsets.get_unchecked(b).as_ptr());
        for t in 0..T {
            let a = acts[t].get_unchecked(b);
            let scale = _mm256_mul_ps(d, _mm256_set1_ps(a.d));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), scale, acc[t]);
            if KIND == NIBBLES || KIND == FIVE_BITS {
                // w = d q - m, so sum(w x) = da (d sum(q xq) - m sum(xq)).
                acc[t] = _mm256_fnmadd_ps(m, _mm256_set1_ps(a.d * a.sum as f32), acc[t]);
            }
        }
    }
    acc
}

/// Unpack and interleave 8 rows of `ty` into `panel` (every block of the shortest row's length
/// is assumed present: the rows are `Tensor` rows of equal length).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack(ty: GgmlType, rows: [&[u8]; PANEL_ROWS], panel: &mut Panel) {
    let bb = ty.block_bytes();
    let per_block = ty.block_size() / QK8;
    let nb = rows[0].len() / bb * per_block;
    assert!(rows.iter().all(|r| r.len() == rows[0].len()), "panel: rows of equal length");
    panel.quants.resize(nb * 8, [0; 32]);
    panel.scales.resize(nb, [0.0; 8]);
    panel.offsets.resize(nb, [0.0; 8]);
    panel.kind = match ty {
        GgmlType::Q8_0 => PanelQuants::Bytes,
        GgmlType::Q6_K => PanelQuants::SixBits,
        GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5_K => PanelQuants::FiveBits,
        _ => PanelQuants::Nibbles,
    };
    let mask = _mm256_set1_epi8(0x0f);
    let quants = panel.quants.as_mut_ptr() as *mut __m256i;
    let store = |b: usize, v: [__m256i; 8]| {
        for (j, v) in transpose(v).into_iter().enumerate() {
            _mm256_storeu_si256(quants.add(b * 8 + j), v);
        }
    };
    match ty {
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let offset = unsigned_offset(ty) as f32;
            for b in 0..nb {
                let p: [*const u8; 8] = std::array::from_fn(|r| rows[r].as_ptr().add(b * bb));
                // Plain loops: a closure (`array::from_fn`) around the intrinsics was left a
                // call once `block_weights` had more callers (Q4_0 packing took 2.8x the
                // instructions).
                let mut w = [_mm256_setzero_si256(); 8];
                let mut d = [0f32; 8];
                for r in 0..8 {
                    w[r] = block_weights(p[r], ty);
                    d[r] = f16c_ptr(p[r]);
                }
                store(b, w);
                panel.scales[b] = d;
                panel.offsets[b] = if ty == GgmlType::Q5_1 {
                    // w = d q + m: the offset subtracted is -m.
                    std::array::from_fn(|r| -f16c_ptr(p[r].add(2)))
                } else {
                    d.map(|d| offset * d)
                };
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            // Q5_K: the fifth bits (32 bytes) sit between the scales and the nibbles.
            let five = ty == GgmlType::Q5_K;
            let qs = if five { 48 } else { 16 };
            for sb in 0..nb / per_block {
                let p: [*const u8; 8] = std::array::from_fn(|r| rows[r].as_ptr().add(sb * bb));
                let (d, dmin): ([f32; 8], [f32; 8]) = (
                    std::array::from_fn(|r| f16c_ptr(p[r])),
                    std::array::from_fn(|r| f16c_ptr(p[r].add(2))),
                );
                let packed: [(u64, u64); 8] = std::array::from_fn(|r| {
                    q4_k_scales_mins(std::slice::from_raw_parts(p[r].add(4), 12))
                });
                let mut high: [__m256i; 8] = std::array::from_fn(|r| {
                    if five {
                        _mm256_loadu_si256(p[r].add(16) as *const __m256i)
                    } else {
                        _mm256_setzero_si256()
                    }
                });
                // Each 32 bytes of nibbles hold sub-blocks 2c (low nibbles) and 2c + 1 (high).
                for c in 0..4 {
                    let bytes: [__m256i; 8] = std::array::from_fn(|r| {
                        _mm256_loadu_si256(p[r].add(qs + 32 * c) as *const __m256i)
                    });
                    let lo = bytes.map(|v| _mm256_and_si256(v, mask));
                    let hi = bytes.map(|v| _mm256_and_si256(_mm256_srli_epi16(v, 4), mask));
                    for (j, mut v) in [(2 * c, lo), (2 * c + 1, hi)] {
                        let b = sb * 8 + j;
                        if five {
                            // Sub-block j's fifth bits: bit 0 of `high` by now.
                            v = std::array::from_fn(|r| _mm256_or_si256(v[r], fifth_bit(high[r])));
                            high = high.map(|h| _mm256_srli_epi16(h, 1));
                        }
                        store(b, v);
                        let byte = |v: u64| (v >> (8 * j)) as u8 as f32;
                        panel.scales[b] = std::array::from_fn(|r| d[r] * byte(packed[r].0));
                        panel.offsets[b] = std::array::from_fn(|r| dmin[r] * byte(packed[r].1));
                    }
                }
            }
        }
        GgmlType::Q6_K => {
            panel.int_scales.resize(2 * nb, [0; 16]);
            for sb in 0..nb / per_block {
                let p: [*const u8; 8] = std::array::from_fn(|r| rows[r].as_ptr().add(sb * bb));
                let d: [f32; 8] = std::array::from_fn(|r| f16c_ptr(p[r].add(208)));
                for half in 0..2 {
                    let ws: [[__m256i; 4]; 8] = std::array::from_fn(|r| q6_k_weights(p[r], half));
                    for (k, _) in ws[0].iter().enumerate() {
                        // Block k of this half: its first 16 weights take scale 2 kb, the rest
                        // 2 kb + 1.
                        let kb = 4 * half + k;
                        let b = sb * 8 + kb;
                        store(b, std::array::from_fn(|r| ws[r][k]));
                        panel.scales[b] = d;
                        panel.offsets[b] = [0.0; 8];
                        for h in 0..2 {
                            let sc: [i16; 8] =
                                std::array::from_fn(|r| *p[r].add(192 + 2 * kb + h) as i8 as i16);
                            panel.int_scales[2 * b + h] = std::array::from_fn(|i| sc[i / 2]);
                        }
                    }
                }
            }
        }
        other => panic!("panel: no AVX2 panel for {}", other.name()),
    }
}

/// 8 rows of 8 words (4 weights each) to 8 vectors of the rows' word j each.
#[inline]
#[target_feature(enable = "avx2")]
fn transpose(v: [__m256i; 8]) -> [__m256i; 8] {
    let v = v.map(|v| _mm256_castsi256_ps(v));
    // Pairs of rows interleaved word by word, then groups of four, then the 128-bit halves.
    let t: [__m256; 8] = std::array::from_fn(|k| {
        let (a, b) = (v[k / 2 * 2], v[k / 2 * 2 + 1]);
        if k % 2 == 0 {
            _mm256_unpacklo_ps(a, b)
        } else {
            _mm256_unpackhi_ps(a, b)
        }
    });
    // s[4h + k]: words k (and k + 4) of rows 4h..4h+4; t[4h + 2i + lo/hi] pairs rows.
    let s: [__m256; 8] = std::array::from_fn(|i| {
        let (h, k) = (i / 4, i % 4);
        let (a, b) = (t[4 * h + k / 2], t[4 * h + 2 + k / 2]);
        if k % 2 == 0 {
            _mm256_shuffle_ps::<0x44>(a, b)
        } else {
            _mm256_shuffle_ps::<0xee>(a, b)
        }
    });
    std::array::from_fn(|j| {
        let (a, b) = (s[j % 4], s[4 + j % 4]);
        _mm256_castps_si256(if j < 4 {
            _mm256_permute2f128_ps::<0x20>(a, b)
        } else {
            _mm256_permute2f128_ps::<0x31>(a, b)
        })
    })
}
