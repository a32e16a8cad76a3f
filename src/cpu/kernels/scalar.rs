//! Portable Rust: the oracle every SIMD kernel is tested against.

use super::*;

pub fn dot_q8(ty: GgmlType, row: &[u8], act: &[BlockQ8]) -> f32 {
    match ty {
        GgmlType::Q8_0 => row
            .chunks_exact(34)
            .zip(act)
            .map(|(b, a)| {
                let s: i32 =
                    b[2..34].iter().zip(&a.qs).map(|(&w, &x)| (w as i8) as i32 * x as i32).sum();
                f16_at(b, 0) * a.d * s as f32
            })
            .sum(),
        GgmlType::Q4_0 => row
            .chunks_exact(18)
            .zip(act)
            .map(|(b, a)| {
                let qs = &b[2..18];
                let mut s = 0i32;
                // Byte j holds element j (low nibble) and element j + 16 (high nibble).
                for (j, &q) in qs.iter().enumerate() {
                    s += ((q & 0x0f) as i32 - 8) * a.qs[j] as i32;
                    s += ((q >> 4) as i32 - 8) * a.qs[j + 16] as i32;
                }
                f16_at(b, 0) * a.d * s as f32
            })
            .sum(),
        // sum((q - 16) x) = sum(q x) - 16 sum(x).
        GgmlType::Q5_0 => row
            .chunks_exact(22)
            .zip(act)
            .map(|(b, a)| f16_at(b, 0) * a.d * (five_bit_dot(&b[2..22], a) - 16 * a.sum) as f32)
            .sum(),
        // As Q5_0 after d and m, without an offset: w = d q + m.
        GgmlType::Q5_1 => row
            .chunks_exact(24)
            .zip(act)
            .map(|(b, a)| {
                let s = five_bit_dot(&b[4..24], a);
                a.d * (f16_at(b, 0) * s as f32 + f16_at(b, 2) * a.sum as f32)
            })
            .sum(),
        GgmlType::Q4_K | GgmlType::Q5_K => row
            .chunks_exact(ty.block_bytes())
            .zip(act.chunks_exact(QK_K / QK8))
            .map(|(b, a)| q4_k_block(b, a))
            .sum(),
        GgmlType::Q6_K => row
            .chunks_exact(210)
            .zip(act.chunks_exact(QK_K / QK8))
            .map(|(b, a)| q6_k_block(b, a))
            .sum(),
        other => panic!("dot_q8: {} rows take f32 activations", other.name()),
    }
}

/// sum(q x) over the 32 five-bit weights of Q5_0's and Q5_1's `qh` and nibbles (20 bytes from
/// `b`): byte j holds the low 4 bits of elements j and j + 16, bit j of `qh` the fifth.
fn five_bit_dot(b: &[u8], a: &BlockQ8) -> i32 {
    let qh = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let mut s = 0i32;
    for (j, &q) in b[4..20].iter().enumerate() {
        let lo = (q & 0x0f) as i32 | (((qh >> j) & 1) << 4) as i32;
        let hi = (q >> 4) as i32 | (((qh >> (j + 16)) & 1) << 4) as i32;
        s += lo * a.qs[j] as i32 + hi * a.qs[j + 16] as i32;
    }
    s
}

/// One Q4_K super-block (8 sub-blocks of 32, each with a 6-bit scale and min) times 8
/// activation blocks: sum_j d*sc_j*da_j*dot(q_j, a_j) - dmin*m_j*da_j*sum(a_j). Or one Q5_K
/// super-block (176 bytes): the same with a fifth bit per weight (bit j of byte l of `qh` for
/// element l of sub-block j) between the scales and the nibbles.
fn q4_k_block(b: &[u8], a: &[BlockQ8]) -> f32 {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let five = b.len() == 176;
    let (scales, qh, qs) = if five {
        (&b[4..16], &b[16..48], &b[48..176])
    } else {
        (&b[4..16], &[0u8; 32][..], &b[16..144])
    };
    let mut acc = 0f32;
    for (j, aj) in a.iter().enumerate() {
        let (sc, m) = q4_k_scale_min(j, scales);
        let q = &qs[(j / 2) * 32..(j / 2) * 32 + 32];
        let shift = 4 * (j % 2);
        let s: i32 = q
            .iter()
            .zip(qh)
            .zip(&aj.qs)
            .map(|((&w, &h), &x)| (((w >> shift) & 0x0f) | (((h >> j) & 1) << 4)) as i32 * x as i32)
            .sum();
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
        GgmlType::F32 => row
            .chunks_exact(4)
            .zip(x)
            .map(|(c, &v)| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * v)
            .sum(),
        GgmlType::F16 => row
            .chunks_exact(2)
            .zip(x)
            .map(|(c, &v)| f16::from_le_bytes([c[0], c[1]]).to_f32() * v)
            .sum(),
        GgmlType::BF16 => row
            .chunks_exact(2)
            .zip(x)
            .map(|(c, &v)| bf16::from_le_bytes([c[0], c[1]]).to_f32() * v)
            .sum(),
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

pub fn attention_scores(q: &[f32], keys: KvRows, stride: usize, scale: f32, out: &mut [f32]) {
    for (p, s) in out.iter_mut().enumerate() {
        *s = match keys {
            KvRows::F32(k) => dot_f32(q, &k[p * stride..][..q.len()]),
            KvRows::F16(k) => {
                q.iter().zip(&k[p * stride..][..q.len()]).map(|(a, b)| a * b.to_f32()).sum()
            }
        } * scale;
    }
}

pub fn attention_values(weights: &[f32], values: KvRows, stride: usize, out: &mut [f32]) {
    out.fill(0.0);
    for (p, &w) in weights.iter().enumerate() {
        match values {
            KvRows::F32(v) => axpy(w, &v[p * stride..][..out.len()], out),
            KvRows::F16(v) => {
                out.iter_mut().zip(&v[p * stride..]).for_each(|(o, x)| *o += w * x.to_f32())
            }
        }
    }
}

/// `x = exp(x - max x) / sum`, in place (attention weights).
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// `up[i] *= silu(gate[i])`, silu(g) = g / (1 + exp(-g)) (the gated feed-forward).
pub fn silu_mul(gate: &[f32], up: &mut [f32]) {
    for (u, &g) in up.iter_mut().zip(gate) {
        *u *= g / (1.0 + (-g).exp());
    }
}
