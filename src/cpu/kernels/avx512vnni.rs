//! x86-64 AVX-512 VNNI, on 256-bit vectors (AVX-512VL): the int8 tiles with `vpdpbusd`, which
//! multiplies unsigned by signed bytes and adds each group of four into an i32 in one instruction
//! where AVX2 needs three (`maddubs`, `madd`, add), and 32 vector registers instead of 16, so a
//! prefill tile holds 4 rows x 4 tokens of sums. Everything else runs the AVX2 kernels.

use super::avx2::{hsum_ps, load_block, tile_prefetch};
use super::*;
use std::arch::x86_64::*;

/// Whether [`dot_q8_tile`] has a VNNI kernel for `ty` (the others take the AVX2 path).
pub fn has_tile(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_0)
}

/// See `kernels::dot_q8_tile`. Q8_0 and Q4_0 only (`has_tile`).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn dot_q8_tile<const R: usize, const T: usize>(
    ty: GgmlType,
    rows: [&[u8]; R],
    acts: [&[BlockQ8]; T],
) -> [[f32; T]; R] {
    let nb = acts[0].len();
    let bb = ty.block_bytes();
    assert!(has_tile(ty), "dot_q8_tile: no VNNI tile for {}", ty.name());
    assert!(rows.iter().all(|r| r.len() >= nb * bb) && acts.iter().all(|a| a.len() == nb));
    let q4 = ty == GgmlType::Q4_0;
    let ahead = tile_prefetch::<R>(rows[0].len());
    // A one-row, one-token tile (decode row by row) keeps two sums, for even and odd blocks:
    // one chain of dependent FMAs would cost its latency on every block.
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut odd = [[_mm256_setzero_ps(); T]; R];
    macro_rules! block {
        ($i:expr, $acc:ident) => {{
            let i = $i;
            let mut w = [_mm256_setzero_si256(); R];
            let mut dw = [_mm256_setzero_ps(); R];
            for r in 0..R {
                (dw[r], w[r]) = load_block(rows[r].as_ptr().add(i * bb), ty, ahead);
            }
            // The unsigned operand: Q4_0's nibbles as they are; Q8_0's |w|, its sign moved onto x.
            let unsigned_w: [__m256i; R] =
                std::array::from_fn(|r| if q4 { w[r] } else { _mm256_abs_epi8(w[r]) });
            for t in 0..T {
                let a = acts[t].get_unchecked(i);
                let x = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
                let da = _mm256_set1_ps(a.d);
                // Q4_0: sum((q - 8) x) = sum(q x) - 8 sum(x); the correction starts lane 0's sum.
                let start = if q4 {
                    _mm256_zextsi128_si256(_mm_cvtsi32_si128(-8 * a.sum))
                } else {
                    _mm256_setzero_si256()
                };
                for r in 0..R {
                    let signed_x = if q4 { x } else { _mm256_sign_epi8(x, w[r]) };
                    let sums = _mm256_dpbusd_epi32(start, unsigned_w[r], signed_x);
                    $acc[r][t] = _mm256_fmadd_ps(
                        _mm256_mul_ps(_mm256_cvtepi32_ps(sums), da),
                        dw[r],
                        $acc[r][t],
                    );
                }
            }
        }};
    }
    let mut i = 0;
    if R * T == 1 {
        while i + 2 <= nb {
            block!(i, acc);
            block!(i + 1, odd);
            i += 2;
        }
    }
    while i < nb {
        block!(i, acc);
        i += 1;
    }
    let acc: [[__m256; T]; R] =
        std::array::from_fn(|r| std::array::from_fn(|t| _mm256_add_ps(acc[r][t], odd[r][t])));
    std::array::from_fn(|r| std::array::from_fn(|t| hsum_ps(acc[r][t])))
}
