//! x86-64 AVX-512 VNNI, on 256-bit vectors (AVX-512VL): the int8 tiles with `vpdpbusd`, which
//! multiplies unsigned by signed bytes and adds each group of four into an i32 in one instruction
//! where AVX2 needs three (`maddubs`, `madd`, add), and 32 vector registers instead of 16, so a
//! prefill tile holds 4 rows x 4 tokens of sums. Everything else runs the AVX2 kernels.
//! Decode and verification passes take each row's blocks two at a time in 512-bit vectors
//! ([`pair_tile`]): Q8_0 on every such CPU, Q4_0 and Q5_0 in tiles of 4 rows where the CPU also
//! has AVX-512 VBMI (byte permutes).

use super::avx2::{hsum_ps, load_block, tile_prefetch, unsigned_offset};
use super::*;
use std::arch::x86_64::*;

/// Whether [`dot_q8_tile`] has a VNNI kernel for `ty` (the others take the AVX2 path).
pub fn has_tile(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0)
}

/// See `kernels::dot_q8_tile`. Q8_0, Q4_0 and Q5_0 only (`has_tile`).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn dot_q8_tile<const R: usize, const T: usize>(
    ty: GgmlType,
    rows: [&[u8]; R],
    acts: [&[BlockQ8]; T],
) -> [[f32; T]; R] {
    let nb = acts[0].len();
    let bb = ty.block_bytes();
    assert!(has_tile(ty), "dot_q8_tile: no VNNI tile for {}", ty.name());
    assert!(
        rows.iter().all(|r| r.len() >= nb * ty.block_bytes()) && acts.iter().all(|a| a.len() == nb)
    );
    let (signed, offset) = (ty == GgmlType::Q8_0, unsigned_offset(ty));
    let ahead = tile_prefetch::<R>(rows[0].len());
    // One chain of FMAs per row and token, whatever the tile's shape: decode row by row and a
    // pass of several tokens then sum a row in the same order, bit for bit (a one-row tile
    // that kept two chains, for even and odd blocks, hid the FMA's latency but broke that).
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for i in 0..nb {
        let mut w = [_mm256_setzero_si256(); R];
        let mut dw = [_mm256_setzero_ps(); R];
        for r in 0..R {
            (dw[r], w[r]) = load_block(rows[r].as_ptr().add(i * bb), ty, ahead);
        }
        // The unsigned operand: Q4_0's and Q5_0's bytes as they are; Q8_0's |w|, its sign
        // moved onto x.
        let unsigned_w: [__m256i; R] =
            std::array::from_fn(|r| if signed { _mm256_abs_epi8(w[r]) } else { w[r] });
        for t in 0..T {
            let a = acts[t].get_unchecked(i);
            let x = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
            let da = _mm256_set1_ps(a.d);
            // sum((q - offset) x) = sum(q x) - offset sum(x); the correction starts lane 0's sum.
            let start = if signed {
                _mm256_setzero_si256()
            } else {
                _mm256_zextsi128_si256(_mm_cvtsi32_si128(-offset * a.sum))
            };
            for r in 0..R {
                let signed_x = if signed { _mm256_sign_epi8(x, w[r]) } else { x };
                let sums = _mm256_dpbusd_epi32(start, unsigned_w[r], signed_x);
                acc[r][t] =
                    _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums), da), dw[r], acc[r][t]);
            }
        }
    }
    std::array::from_fn(|r| std::array::from_fn(|t| hsum_ps(acc[r][t])))
}

/// See `kernels::dot_q8_rows`: the one-row tile over consecutive rows (`has_tile`'s types;
/// Q8_0's is [`pair_tile`], its activations arranged once for all the rows).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn dot_q8_rows(
    ty: GgmlType,
    matrix: &[u8],
    row_bytes: usize,
    act: &[BlockQ8],
    out: &mut [f32],
) {
    if ty == GgmlType::Q8_0 {
        let pairs = arrange(ty, act);
        return each_decode_row(matrix, row_bytes, out, |w| q8_0_row(w, &pairs, act));
    }
    each_decode_row(matrix, row_bytes, out, |w| dot_q8_tile::<1, 1>(ty, [w], [act])[0][0])
}

/// [`pair_tile`]'s weight types, as its const parameter.
const PAIR_Q8_0: u8 = 0;
const PAIR_Q4_0: u8 = 1;
const PAIR_Q5_0: u8 = 2;

/// `$body` with `$k` the const of `$ty`'s [`pair_tile`] (Q8_0, Q4_0 or Q5_0).
macro_rules! by_pair_type {
    ($ty:expr, $k:ident => $body:expr) => {
        match $ty {
            GgmlType::Q8_0 => {
                const $k: u8 = PAIR_Q8_0;
                $body
            }
            GgmlType::Q5_0 => {
                const $k: u8 = PAIR_Q5_0;
                $body
            }
            _ => {
                const $k: u8 = PAIR_Q4_0;
                $body
            }
        }
    };
}

/// Whether tiles of `rows` rows (1 or 4) of `ty` are [`pair_tile`]: Q8_0's always, Q4_0's and
/// Q5_0's of 4 rows where the CPU has VBMI (one row of them keeps the 256-bit tile, in decode and
/// passes alike).
pub fn has_pair_tile(ty: GgmlType, rows: usize) -> bool {
    match ty {
        GgmlType::Q8_0 => true,
        GgmlType::Q4_0 | GgmlType::Q5_0 => rows == TILE_ROWS && has_vbmi(),
        _ => false,
    }
}

/// Whether this CPU has AVX-512 VBMI, which [`pair_tile`] needs for Q4_0 and Q5_0 (Zen 4, Ice
/// Lake and later; not Cascade Lake). `std` caches the answer.
pub fn has_vbmi() -> bool {
    is_x86_feature_detected!("avx512vbmi")
}

/// See `kernels::dot_q8_decode_tiles`: the one-token [`pair_tile`] over the tiles
/// ([`has_pair_tile`] with 4 rows).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn pair_decode_tiles(
    ty: GgmlType,
    matrix: &[u8],
    row_bytes: usize,
    spread: bool,
    act: &[BlockQ8],
    out: &mut [f32],
) {
    let pairs = arrange(ty, act);
    by_pair_type!(ty, K => each_decode_tile(matrix, row_bytes, spread, out, |tile| {
        pair_tile::<K, 4, 1>(tile, [&pairs], [act]).map(|[sum]| sum)
    }))
}

/// [`pair_tile`] in `kernels::dot_q8_tile`'s shape, the activations arranged for this call.
///
/// # Safety
/// The CPU has AVX-512 VNNI, and VBMI for Q4_0 and Q5_0 ([`has_pair_tile`]).
pub unsafe fn pair_tile_of<const R: usize, const T: usize>(
    ty: GgmlType,
    rows: [&[u8]; R],
    acts: [&[BlockQ8]; T],
) -> [[f32; T]; R] {
    let pairs = acts.map(|a| arrange(ty, a));
    let pairs = std::array::from_fn(|t| pairs[t].as_slice());
    by_pair_type!(ty, K => pair_tile::<K, R, T>(rows, pairs, acts))
}

/// A pass's products over whole tiles of 4 rows (`matrix`, `row_bytes` a row) with the
/// activations `acts` (a token each), arranged once ([`arrange`]) for all the tiles: `store(t, r,
/// sum)` gets row r's sum with token t, decode's bits. `spread`: tile k takes row k of each
/// quarter of the rows, as decode's spread tiles do.
///
/// # Safety
/// The CPU has AVX-512 VNNI, and VBMI for Q4_0 and Q5_0 ([`has_pair_tile`] with 4 rows).
pub unsafe fn pair_pass_tiles(
    ty: GgmlType,
    matrix: &[u8],
    row_bytes: usize,
    spread: bool,
    acts: &[&[BlockQ8]],
    store: &mut dyn FnMut(usize, usize, f32),
) {
    by_pair_type!(ty, K => pass_tiles::<K>(matrix, row_bytes, spread, acts, store))
}

unsafe fn pass_tiles<const K: u8>(
    matrix: &[u8],
    row_bytes: usize,
    spread: bool,
    acts: &[&[BlockQ8]],
    store: &mut dyn FnMut(usize, usize, f32),
) {
    let pairs: Vec<Vec<ActPair>> = acts.iter().map(|a| arrange(pair_type(K), a)).collect();
    let n = acts.len();
    let q = matrix.len() / row_bytes / 4;
    for k in 0..q {
        let rows = tile_rows(k, q, spread);
        let tile = rows.map(|r| &matrix[r * row_bytes..(r + 1) * row_bytes]);
        let mut t = 0;
        // 5, 4, 3, 2 or 1 tokens a tile: with the rows' sums folded, a token's sums are one
        // register (4 rows x 5 tokens unfolded spilled through the stack).
        macro_rules! tiles {
            ($t:literal) => {
                #[allow(clippy::int_plus_one)] // `t + 1 <= n` reads as the others
                while t + $t <= n {
                    let sums = pair_tile::<K, 4, $t>(
                        tile,
                        std::array::from_fn(|j| pairs[t + j].as_slice()),
                        std::array::from_fn(|j| acts[t + j]),
                    );
                    for (&r, row) in rows.iter().zip(&sums) {
                        for (j, &sum) in row.iter().enumerate() {
                            store(t + j, r, sum);
                        }
                    }
                    t += $t;
                }
            };
        }
        tiles!(5);
        tiles!(4);
        tiles!(3);
        tiles!(2);
        tiles!(1);
    }
}

/// The weight type of [`pair_tile`]'s const `K`.
const fn pair_type(k: u8) -> GgmlType {
    match k {
        PAIR_Q8_0 => GgmlType::Q8_0,
        PAIR_Q5_0 => GgmlType::Q5_0,
        _ => GgmlType::Q4_0,
    }
}

/// A pair of blocks' activations as [`pair_tile`] multiplies them, made once per product and
/// token rather than once per tile: both blocks' quants in the order of the weights' lanes, and
/// each block's scale and offset correction (`-offset * sum`, which starts the integer sums) in
/// its lanes.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct ActPair {
    x: __m512i,
    da: __m512,
    start: __m512i,
}

/// `act` arranged for [`pair_tile`] over rows of `ty` (Q8_0, Q4_0 or Q5_0: their lanes and
/// offsets differ): one [`ActPair`] per whole pair of blocks.
fn arrange(ty: GgmlType, act: &[BlockQ8]) -> Vec<ActPair> {
    // SAFETY: AVX-512 was detected wherever a pair tile runs.
    unsafe { by_pair_type!(ty, K => arrange_pairs::<K>(act)) }
}

#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
unsafe fn arrange_pairs<const K: u8>(act: &[BlockQ8]) -> Vec<ActPair> {
    // Where the second block goes: Q8_0's weights are in order (lanes 8-15 are block i + 1's);
    // the nibble types' are quarter-blocks (64-bit words) of both blocks interleaved, and the
    // activations' words go the same way (block i + 1's in lanes 4-7 and 12-15).
    let (words, second, offset) = match K {
        PAIR_Q8_0 => (_mm512_set_epi64(11, 10, 9, 8, 3, 2, 1, 0), 0xff00u16, 128),
        PAIR_Q5_0 => (_mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), 0xf0f0, 16),
        _ => (_mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), 0xf0f0, 8),
    };
    let second_start = 1 << second.trailing_zeros();
    let mut pairs = Vec::with_capacity(act.len() / 2);
    for pair in act.chunks_exact(2) {
        let (a0, a1) = (&pair[0], &pair[1]);
        pairs.push(ActPair {
            x: _mm512_permutex2var_epi64(
                _mm512_castsi256_si512(_mm256_loadu_si256(a0.qs.as_ptr() as *const __m256i)),
                words,
                _mm512_castsi256_si512(_mm256_loadu_si256(a1.qs.as_ptr() as *const __m256i)),
            ),
            // sum((q - offset) x) = sum(q x) - offset sum(x), one correction per block.
            start: _mm512_mask_set1_epi32(
                _mm512_maskz_set1_epi32(0x0001, -offset * a0.sum),
                second_start,
                -offset * a1.sum,
            ),
            da: _mm512_mask_blend_ps(second, _mm512_set1_ps(a0.d), _mm512_set1_ps(a1.d)),
        });
    }
    pairs
}

/// Where a pair of blocks' quant bytes go: byte k of the unpacked vector takes byte
/// `NIBBLES[k]` of the pair (block i's at `first`.., block i + 1's at `bb + first`..) in lanes
/// 0-15 and 32-47 (block i's low and high nibbles) and 16-31 and 48-63 (block i + 1's).
const fn nibble_bytes(first: usize, bb: usize) -> [u8; 64] {
    let mut idx = [0u8; 64];
    let mut k = 0;
    while k < 64 {
        let block = (k / 16) % 2;
        idx[k] = (first + block * bb + k % 16) as u8;
        k += 1;
    }
    idx
}

const Q4_0_NIBBLES: [u8; 64] = nibble_bytes(2, 18);
const Q5_0_NIBBLES: [u8; 64] = nibble_bytes(6, 22);

/// The tile of `R` rows x `T` tokens of Q8_0, Q4_0 or Q5_0 (`K`) with each row's blocks two at a
/// time in 512-bit vectors: decode's (4 x 1, and 1 x 1 for Q8_0) and a verification pass's,
/// which must sum a token as decode does, bit for bit (speculative decoding keeps the plain run's
/// tokens by it): every row and token gets the same operations in the same order whatever `R` and
/// `T`. `pairs` are `acts` arranged ([`arrange`]), once per product. Q8_0's is [`q8_0_tile`];
/// Q4_0's and Q5_0's [`nibble_pair_tile`].
#[inline(always)]
unsafe fn pair_tile<const K: u8, const R: usize, const T: usize>(
    rows: [&[u8]; R],
    pairs: [&[ActPair]; T],
    acts: [&[BlockQ8]; T],
) -> [[f32; T]; R] {
    match K {
        PAIR_Q8_0 => q8_0_pair_tile(rows, pairs, acts),
        _ => nibble_pair_tile::<K, R, T>(rows, pairs, acts),
    }
}

/// Q8_0's [`pair_tile`]: 4 rows folded ([`q8_0_tile`]), or one row at a time ([`q8_0_row`]), which
/// sums a row in the same order.
#[inline(always)]
unsafe fn q8_0_pair_tile<const R: usize, const T: usize>(
    rows: [&[u8]; R],
    pairs: [&[ActPair]; T],
    acts: [&[BlockQ8]; T],
) -> [[f32; T]; R] {
    let mut out = [[0f32; T]; R];
    if R == TILE_ROWS {
        let four = q8_0_tile::<T>(std::array::from_fn(|r| rows[r]), pairs, acts);
        out.copy_from_slice(&four[..R]);
    } else {
        for r in 0..R {
            for t in 0..T {
                out[r][t] = q8_0_row(rows[r], pairs[t], acts[t]);
            }
        }
    }
    out
}

/// The folded tiles' scales: lane 4c + r = row r's f16 scale of quarter c's block, from each
/// row's pair of blocks (`raw`, the scales' words where `scale_words` says:
/// [`folded_scale_words`]) by two `vpermt2w` (rows 0 and 1, rows 2 and 3) and a blend.
#[inline(always)]
unsafe fn folded_scales(raw: [__m512i; TILE_ROWS], scale_words: __m512i) -> __m512 {
    _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_mask_blend_epi16(
        0xcccc,
        _mm512_permutex2var_epi16(raw[0], scale_words, raw[1]),
        _mm512_permutex2var_epi16(raw[2], scale_words, raw[3]),
    )))
}

/// 4 rows' integer sums (16 lanes each) folded into one vector whose lane 4c + r holds row r's
/// sum of its quarter c (lanes 4c..4c + 4): per 128 bits [s0 0+2, s1 0+2, s0 1+3, s1 1+3], rows 2
/// and 3 the same, then lane r = row r's four. Exact integers; mostly shuffles, which run beside
/// the arithmetic.
#[inline(always)]
unsafe fn fold_rows(s: [__m512i; TILE_ROWS]) -> __m512i {
    let pairs = |u: __m512i, v: __m512i| {
        _mm512_add_epi32(_mm512_unpacklo_epi32(u, v), _mm512_unpackhi_epi32(u, v))
    };
    let (f01, f23) = (pairs(s[0], s[1]), pairs(s[2], s[3]));
    _mm512_add_epi32(_mm512_unpacklo_epi64(f01, f23), _mm512_unpackhi_epi64(f01, f23))
}

/// The 4 rows' sums of a folded accumulator: lane r = (quarter 0 + quarter 2) + (quarter 1 +
/// quarter 3), the order [`q8_0_row`] adds in.
#[inline(always)]
unsafe fn folded_sums(acc: __m512) -> [f32; TILE_ROWS] {
    let halves = _mm256_add_ps(
        _mm512_castps512_ps256(acc),
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc))),
    );
    let rows = _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps::<1>(halves));
    let mut four = [0f32; TILE_ROWS];
    _mm_storeu_ps(four.as_mut_ptr(), rows);
    four
}

/// `vpermt2w` indices for [`folded_scales`]: lane 4c + r takes row r's scale of quarter c's
/// block, word 0 of the pair or `second` (the second block's scale), from the first (r even) or
/// the second (r odd) of two rows' pairs.
const fn folded_scale_words(second: usize, q8_0: bool) -> [u16; 32] {
    let mut idx = [0u16; 32];
    let mut k = 0;
    while k < 16 {
        // Q8_0's quarters are blocks i, i, i + 1, i + 1; the nibble types' i, i + 1, i, i + 1.
        let block = if q8_0 { k / 8 } else { (k / 4) % 2 };
        idx[k] = (block * second + k % 2 * 32) as u16;
        k += 1;
    }
    idx
}

const Q8_0_FOLDED_SCALES: [u16; 32] = folded_scale_words(17, true);
const Q4_0_FOLDED_SCALES: [u16; 32] = folded_scale_words(9, false);
const Q5_0_FOLDED_SCALES: [u16; 32] = folded_scale_words(11, false);

/// Q8_0's tile of 4 rows x `T` tokens, a row's blocks two at a time in 512-bit vectors, the 4
/// rows' integer sums folded before the float work. Each row's pair of blocks (68 bytes: two
/// 32-byte loads) becomes the unsigned operand of `vpdpbusd` by adding 128 (an xor), which the
/// activations' correction takes back (-128 x sum(x), as Q4_0's offset 8), so the sign needs no
/// work per token. The 4 rows' 16 lanes of sums fold into one vector whose lane 4c + r holds row
/// r's sum of quarter c (blocks i, i, i + 1, i + 1): two unpacks and an add per two rows, then
/// per two pairs of rows, all exact integers and mostly shuffles, which run beside the
/// arithmetic. Then one conversion, one multiply (the 4 rows' f16 scales, spread by `vpermt2w`,
/// times the token's) and one FMA per token cover 4 x 64 weights, where a row at a time took 4
/// of each: on a core with one 512-bit FMA unit (this Intel Xeon) those were the bound: with the
/// rows in L2, 5 tokens ran at 27 GMAC/s in the 256-bit tile, 40 unfolded, 57 folded. [`q8_0_row`]
/// sums a row alone in the same order, bit for bit.
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q8_0_tile<const T: usize>(
    rows: [&[u8]; TILE_ROWS],
    pairs: [&[ActPair]; T],
    acts: [&[BlockQ8]; T],
) -> [[f32; T]; TILE_ROWS] {
    let unsigned = _mm512_set1_epi8(-128);
    let scale_words = _mm512_loadu_si512(Q8_0_FOLDED_SCALES.as_ptr() as *const __m512i);
    folded_tile(GgmlType::Q8_0, rows, pairs, acts, scale_words, |p| q8_0_pair(p, unsigned))
}

/// [`q8_0_tile`]'s and [`nibble_pair_tile`]'s loop: `unpack(p)` makes the pair of blocks of a row
/// at `p` `vpdpbusd`'s unsigned operand, and gives the bytes their scales are read from (the
/// words `scale_words` names, [`folded_scales`]). Inlined into each, with its target features.
#[inline(always)]
unsafe fn folded_tile<const T: usize>(
    ty: GgmlType,
    rows: [&[u8]; TILE_ROWS],
    pairs: [&[ActPair]; T],
    acts: [&[BlockQ8]; T],
    scale_words: __m512i,
    unpack: impl Fn(*const u8) -> (__m512i, __m512i),
) -> [[f32; T]; TILE_ROWS] {
    let bb = ty.block_bytes();
    let nb = acts[0].len();
    assert!(rows.iter().all(|r| r.len() >= nb * bb) && acts.iter().all(|a| a.len() == nb));
    assert!(pairs.iter().all(|p| p.len() == nb / 2));
    let ahead = tile_prefetch::<TILE_ROWS>(rows[0].len());
    let mut acc = [_mm512_setzero_ps(); T];
    let mut i = 0;
    while i + 2 <= nb {
        let mut w = [_mm512_setzero_si512(); TILE_ROWS];
        let mut raw = [_mm512_setzero_si512(); TILE_ROWS];
        for r in 0..TILE_ROWS {
            let p = rows[r].as_ptr().add(i * bb);
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(ahead) as *const i8);
            (w[r], raw[r]) = unpack(p);
        }
        let dw = folded_scales(raw, scale_words);
        for t in 0..T {
            let a = &*pairs[t].as_ptr().add(i / 2);
            let sums = fold_rows([
                _mm512_dpbusd_epi32(a.start, w[0], a.x),
                _mm512_dpbusd_epi32(a.start, w[1], a.x),
                _mm512_dpbusd_epi32(a.start, w[2], a.x),
                _mm512_dpbusd_epi32(a.start, w[3], a.x),
            ]);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(dw, a.da), acc[t]);
        }
        i += 2;
    }
    let mut out = [[0f32; T]; TILE_ROWS];
    for t in 0..T {
        let four = folded_sums(acc[t]);
        for r in 0..TILE_ROWS {
            out[r][t] = four[r];
        }
    }
    if i < nb {
        let tail =
            dot_q8_tile::<TILE_ROWS, T>(ty, rows.map(|r| &r[i * bb..]), acts.map(|a| &a[i..]));
        for r in 0..TILE_ROWS {
            for t in 0..T {
                out[r][t] += tail[r][t];
            }
        }
    }
    out
}

/// A Q8_0 row's pair of blocks at `p`: the 64 quants plus 128 (`unsigned`: -128 in each byte,
/// an xor), and the two f16 scales (words 0 and 17; a masked load: the other 64 bytes from `p`
/// made LLVM build the quants' load at byte 2 from that one with 6 shuffles).
#[inline(always)]
unsafe fn q8_0_pair(p: *const u8, unsigned: __m512i) -> (__m512i, __m512i) {
    let block = |b: usize| _mm256_loadu_si256(p.add(b * 34 + 2) as *const __m256i);
    let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(block(0)), block(1));
    let scales = _mm512_maskz_loadu_epi8(0b11 | 0b11 << 34, p as *const i8);
    (_mm512_xor_si512(both, unsigned), scales)
}

/// One Q8_0 row with one token as [`q8_0_tile`] sums it, bit for bit: the same integer sums of
/// each quarter (lanes 0, 4, 8 and 12 of a 128-bit vector's worth here), times the same scales,
/// into 4 lanes added in the same order. Decode row by row (AMD) and the rows past a matrix's
/// last tile take it.
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q8_0_row(row: &[u8], pairs: &[ActPair], act: &[BlockQ8]) -> f32 {
    const BB: usize = 34;
    let nb = act.len();
    assert!(row.len() >= nb * BB && pairs.len() == nb / 2);
    let ahead = tile_prefetch::<1>(row.len());
    let unsigned = _mm512_set1_epi8(-128);
    let quarters = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    let scale_words = _mm512_castsi128_si512(_mm_setr_epi16(0, 0, 17, 17, 0, 0, 0, 0));
    let mut acc = _mm_setzero_ps();
    let mut i = 0;
    while i + 2 <= nb {
        let p = row.as_ptr().add(i * BB);
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(ahead) as *const i8);
        let (w, scales) = q8_0_pair(p, unsigned);
        let dw =
            _mm_cvtph_ps(_mm512_castsi512_si128(_mm512_permutexvar_epi16(scale_words, scales)));
        let a = &*pairs.as_ptr().add(i / 2);
        let s = _mm512_dpbusd_epi32(a.start, w, a.x);
        // Each 128 bits' 4 lanes added (exact integers), then lanes 0, 4, 8, 12.
        let s = _mm512_add_epi32(s, _mm512_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm512_add_epi32(s, _mm512_shuffle_epi32::<0b10_11_00_01>(s));
        let sums = _mm512_castsi512_si128(_mm512_permutexvar_epi32(quarters, s));
        let da = _mm512_castps512_ps128(_mm512_permutexvar_ps(quarters, a.da));
        acc = _mm_fmadd_ps(_mm_cvtepi32_ps(sums), _mm_mul_ps(dw, da), acc);
        i += 2;
    }
    let halves = _mm_add_ps(acc, _mm_movehl_ps(acc, acc));
    let mut out = _mm_cvtss_f32(halves) + _mm_cvtss_f32(_mm_shuffle_ps::<1>(halves, halves));
    if i < nb {
        out += dot_q8_tile::<1, 1>(GgmlType::Q8_0, [&row[i * BB..]], [&act[i..]])[0][0];
    }
    out
}

/// Q4_0's or Q5_0's [`pair_tile`] (with VBMI).
///
/// Decode is this kernel's arithmetic, not the memory, on one core of AMD Zen 4 (the 256-bit tile
/// ran at ~12 GB/s of weights with the rows in L2, below a core's ~20 GB/s read from memory): per
/// 32 weights it spent ~16 instructions, half of them on the float side (the block's f16 scale
/// converted and broadcast, the sum converted, scaled and added). Here one 64-byte load takes two
/// blocks of a row (36 or 44 bytes, masked: the last pair of a tensor must not read past it);
/// `vpermb` puts both blocks' nibble bytes where the low and the high nibbles go, a per-half
/// shift and a mask unpack them (lanes 0-15 block i's weights 0-15, 16-31 block i + 1's 0-15,
/// then both blocks' 16-31), Q5_0's fifth bits add 16 under a mask built from the two `qh`
/// words. A row's unpacked pair serves every token, and the 4 rows' sums fold as in
/// [`q8_0_tile`] (quarters: blocks i, i + 1, i, i + 1), so one conversion, one multiply and one
/// FMA per token cover 4 x 64 weights. Per row (before the fold) this was 1.15-1.3x the 256-bit
/// Q4_0 tile's rate at decode on Zen 4 (in L2 and from memory); folded, on an Intel Xeon,
/// passes of the Llama-3.2-1B Q4_0 shape of 5 tokens 1.4x faster (131-136 -> 93-94 ms on one
/// thread), one-token steps the same. An odd last block goes through the 256-bit tile.
// Not inlined into the walk over the tiles: there LLVM kept the loop's constants live across
// tiles and decoded Qwen2.5-0.5B Q4_0 4 % slower on one Zen 4 core.
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn nibble_pair_tile<const K: u8, const R: usize, const T: usize>(
    rows: [&[u8]; R],
    pairs: [&[ActPair]; T],
    acts: [&[BlockQ8]; T],
) -> [[f32; T]; R] {
    assert_eq!(R, TILE_ROWS, "a nibble pair tile has 4 rows");
    let ty = pair_type(K);
    let bb = ty.block_bytes();
    let (nibbles, scales) = if K == PAIR_Q5_0 {
        (&Q5_0_NIBBLES, &Q5_0_FOLDED_SCALES)
    } else {
        (&Q4_0_NIBBLES, &Q4_0_FOLDED_SCALES)
    };
    let nibble_bytes = _mm512_loadu_si512(nibbles.as_ptr() as *const __m512i);
    let scale_words = _mm512_loadu_si512(scales.as_ptr() as *const __m512i);
    // The high nibbles (upper 256 bits) shift down by 4, the low ones stay.
    let shifts = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4));
    let low4 = _mm512_set1_epi8(0x0f);
    let fifth = _mm512_set1_epi8(0x10);
    let pair_mask: __mmask64 = (1 << (2 * bb)) - 1;
    let unpack = |p: *const u8| {
        let raw = _mm512_maskz_loadu_epi8(pair_mask, p as *const i8);
        let w = _mm512_and_si512(
            _mm512_srlv_epi16(_mm512_permutexvar_epi8(nibble_bytes, raw), shifts),
            low4,
        );
        if K != PAIR_Q5_0 {
            return (w, raw);
        }
        // Weight e's fifth bit is bit e of its block's `qh` (bytes 2..6).
        let qh = |b: usize| (p.add(b * bb + 2) as *const u32).read_unaligned() as u64;
        let (h0, h1) = (qh(0), qh(1));
        let bits = (h0 & 0xffff) | (h1 & 0xffff) << 16 | (h0 >> 16) << 32 | (h1 >> 16) << 48;
        (_mm512_mask_add_epi8(w, bits, w, fifth), raw)
    };
    let four =
        folded_tile(ty, [rows[0], rows[1], rows[2], rows[3]], pairs, acts, scale_words, unpack);
    let mut out = [[0f32; T]; R];
    out.copy_from_slice(&four[..R]);
    out
}
