//! Tensor element types and their block layouts (ggml's), dequantised on the fly.
//!
//! Quantised types store a row as blocks: a few scales plus packed small integers. The matmul
//! never expands a whole tensor to f32; it decodes one block at a time into a small buffer and
//! takes the dot product from there. These scalar decoders are the reference that every SIMD
//! and WGSL kernel is checked against, so they follow ggml's `dequantize_row_*` line by line.

use half::{bf16, f16};

/// Named as ggml names them (Q4_K, not Q4K), so they grep the same as llama.cpp.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q5_0,
    Q5_1,
    Q4_K,
    Q5_K,
    Q6_K,
}

/// Elements per super-block of the K-quants.
pub const QK_K: usize = 256;

impl GgmlType {
    pub const SUPPORTED: &'static str = "F32, F16, BF16, Q8_0, Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K";
    pub const ALL: [GgmlType; 10] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];
    /// The block-quantised types (the fast path multiplies them with int8 activations).
    pub const QUANTISED: [GgmlType; 7] = [
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];

    /// The type for ggml's numeric id, if we support it.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
            GgmlType::BF16 => 30,
        }
    }

    /// Name of a ggml type id for error messages, including the ones we do not support.
    pub fn describe_id(id: u32) -> String {
        const NAMES: [&str; 40] = [
            "F32",
            "F16",
            "Q4_0",
            "Q4_1",
            "Q4_2",
            "Q4_3",
            "Q5_0",
            "Q5_1",
            "Q8_0",
            "Q8_1",
            "Q2_K",
            "Q3_K",
            "Q4_K",
            "Q5_K",
            "Q6_K",
            "Q8_K",
            "IQ2_XXS",
            "IQ2_XS",
            "IQ3_XXS",
            "IQ1_S",
            "IQ4_NL",
            "IQ3_S",
            "IQ2_S",
            "IQ4_XS",
            "I8",
            "I16",
            "I32",
            "I64",
            "F64",
            "IQ1_M",
            "BF16",
            "Q4_0_4_4",
            "Q4_0_4_8",
            "Q4_0_8_8",
            "TQ1_0",
            "TQ2_0",
            "IQ4_NL_4_4",
            "IQ4_NL_4_8",
            "IQ4_NL_8_8",
            "MXFP4",
        ];
        match NAMES.get(id as usize) {
            Some(n) => format!("{n} (id {id})"),
            None => format!("unknown id {id}"),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
        }
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q5_1 => 32,
            GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q8_0 => 2 + 32,
            GgmlType::Q4_0 => 2 + 16,
            GgmlType::Q5_0 => 2 + 4 + 16,
            GgmlType::Q5_1 => 2 + 2 + 4 + 16,
            GgmlType::Q4_K => 2 + 2 + 12 + QK_K / 2,
            GgmlType::Q5_K => 2 + 2 + 12 + QK_K / 8 + QK_K / 2,
            GgmlType::Q6_K => QK_K / 2 + QK_K / 4 + QK_K / 16 + 2,
        }
    }

    /// Bytes for `n` elements in rows of `row_len`; None if a row is not whole blocks or on overflow.
    pub fn bytes_for(self, n: u64, row_len: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if !row_len.is_multiple_of(bs) {
            return None;
        }
        (n / bs).checked_mul(self.block_bytes() as u64)
    }

    /// Bytes of one row of `cols` elements (cols must be a multiple of the block size).
    pub fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_size() * self.block_bytes()
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Decode one block of `ty` (`ty.block_bytes()` bytes) into `out` (`ty.block_size()` floats).
pub fn dequantize_block(ty: GgmlType, b: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::F32 => out[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => out[0] = f16_at(b, 0),
        GgmlType::BF16 => out[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        GgmlType::Q8_0 => {
            // d: f16, then 32 signed bytes.
            let d = f16_at(b, 0);
            for (o, &q) in out.iter_mut().zip(&b[2..34]) {
                *o = d * (q as i8) as f32;
            }
        }
        GgmlType::Q4_0 => {
            // d: f16, then 16 bytes: low nibbles are elements 0..16, high nibbles 16..32, offset 8.
            let d = f16_at(b, 0);
            let qs = &b[2..18];
            for j in 0..16 {
                out[j] = d * ((qs[j] & 0x0f) as i32 - 8) as f32;
                out[j + 16] = d * ((qs[j] >> 4) as i32 - 8) as f32;
            }
        }
        GgmlType::Q5_0 => {
            // d: f16, qh: 32 fifth bits (bit j is element j's), then Q4_0's 16 bytes of nibbles;
            // offset 16. (Q4_K_M files take it for rows that are not whole super-blocks of 256:
            // SmolLM2's 576, Qwen2.5-0.5B's 896.)
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let qs = &b[6..22];
            for j in 0..16 {
                let lo = (qs[j] & 0x0f) as i32 | (((qh >> j) & 1) << 4) as i32;
                let hi = (qs[j] >> 4) as i32 | (((qh >> (j + 16)) & 1) << 4) as i32;
                out[j] = d * (lo - 16) as f32;
                out[j + 16] = d * (hi - 16) as f32;
            }
        }
        GgmlType::Q5_1 => {
            // d, m: f16, qh: 32 fifth bits, then 16 bytes of nibbles as Q5_0; w = d q + m.
            // (Q5_K_M files take it for rows that are not whole super-blocks of 256.)
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            let qs = &b[8..24];
            for j in 0..16 {
                let lo = (qs[j] & 0x0f) as u32 | (((qh >> j) & 1) << 4);
                let hi = (qs[j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
                out[j] = lo as f32 * d + m;
                out[j + 16] = hi as f32 * d + m;
            }
        }
        GgmlType::Q4_K => dequantize_q4_k(b, false, out),
        GgmlType::Q5_K => dequantize_q4_k(b, true, out),
        GgmlType::Q6_K => dequantize_q6_k(b, out),
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8), packed in Q4_K's 12 scale bytes.
pub(crate) fn q4_k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Q4_K: d, dmin (f16), 12 bytes of 6-bit scales/mins for 8 sub-blocks of 32, 128 bytes of
/// nibbles. With `five`, Q5_K: 32 bytes of fifth bits (bit j of byte l is element l of sub-block
/// j) between the scales and the nibbles.
fn dequantize_q4_k(b: &[u8], five: bool, out: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let (qh, qs) = if five { (&b[16..48], &b[48..176]) } else { (&[0u8; 32][..], &b[16..144]) };
    for chunk in 0..4 {
        // Each 32 bytes of nibbles hold two sub-blocks: low nibbles then high nibbles.
        let q = &qs[chunk * 32..chunk * 32 + 32];
        let (sc1, m1) = q4_k_scale_min(2 * chunk, scales);
        let (sc2, m2) = q4_k_scale_min(2 * chunk + 1, scales);
        let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, min2) = (d * sc2 as f32, dmin * m2 as f32);
        let o = &mut out[chunk * 64..chunk * 64 + 64];
        for l in 0..32 {
            let h1 = ((qh[l] >> (2 * chunk)) & 1) << 4;
            let h2 = ((qh[l] >> (2 * chunk + 1)) & 1) << 4;
            o[l] = d1 * ((q[l] & 0x0f) | h1) as f32 - min1;
            o[l + 32] = d2 * ((q[l] >> 4) | h2) as f32 - min2;
        }
    }
}

/// Q6_K: 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 signed 8-bit scales, d (f16).
fn dequantize_q6_k(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &b[half * 64..half * 64 + 64];
        let qh = &b[128 + half * 32..128 + half * 32 + 32];
        let sc = &b[192 + half * 8..192 + half * 8 + 8];
        let o = &mut out[half * 128..half * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            o[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            o[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            o[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            o[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

/// Decode a whole row (`out.len()` elements, a multiple of the block size).
pub fn dequantize_row(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    match ty {
        // Whole-row fast paths for the unquantised types.
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        _ => {
            let (bs, bb) = (ty.block_size(), ty.block_bytes());
            for (o, b) in out.chunks_exact_mut(bs).zip(bytes.chunks_exact(bb)) {
                dequantize_block(ty, b, o);
            }
        }
    }
}

/// ggml's `quantize_row_q8_0_ref`: per block of 32, d = max|x| / 127 (stored as f16) and
/// q = round(x / d). `values.len()` must be a multiple of 32.
pub fn quantize_row_q8_0(values: &[f32], out: &mut Vec<u8>) {
    assert!(values.len().is_multiple_of(32), "Q8_0 needs whole blocks of 32, got {}", values.len());
    for block in values.chunks_exact(32) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        for &x in block {
            out.push((x * id).round() as i8 as u8);
        }
    }
}

/// The value of largest magnitude in `block`, with its sign (the first of equal magnitudes).
fn signed_max(block: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in block {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// ggml's `quantize_row_q4_0_ref`: per block of 32, the value of largest magnitude `max` (with its
/// sign) gives d = max / -8, so it maps to -8 exactly; q = min(15, (int)(x / d + 8.5)).
pub fn quantize_row_q4_0(values: &[f32], out: &mut Vec<u8>) {
    assert!(values.len().is_multiple_of(32), "Q4_0 needs whole blocks of 32, got {}", values.len());
    for block in values.chunks_exact(32) {
        let d = signed_max(block) / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        for j in 0..16 {
            // C's (int8_t) cast truncates toward zero; x / d + 8.5 is >= 0.5 here.
            let x0 = ((block[j] * id + 8.5) as i8).min(15) as u8;
            let x1 = ((block[j + 16] * id + 8.5) as i8).min(15) as u8;
            out.push(x0 | (x1 << 4));
        }
    }
}

/// ggml's `quantize_row_q5_0_ref`: as Q4_0 with 5 bits, d = max / -16, q = min(31, (int)(x / d +
/// 16.5)); the fifth bits go to `qh` (bit j for element j).
pub fn quantize_row_q5_0(values: &[f32], out: &mut Vec<u8>) {
    assert!(values.len().is_multiple_of(32), "Q5_0 needs whole blocks of 32, got {}", values.len());
    for block in values.chunks_exact(32) {
        let d = signed_max(block) / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let (mut qh, mut qs) = (0u32, [0u8; 16]);
        for j in 0..16 {
            // C's (int8_t) cast truncates toward zero; x / d + 16.5 is >= 0.5 here.
            let x0 = ((block[j] * id + 16.5) as i8).min(31) as u8;
            let x1 = ((block[j + 16] * id + 16.5) as i8).min(31) as u8;
            qs[j] = (x0 & 0x0f) | ((x1 & 0x0f) << 4);
            qh |= ((x0 as u32 & 0x10) >> 4) << j;
            qh |= ((x1 as u32 & 0x10) >> 4) << (j + 16);
        }
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend_from_slice(&qh.to_le_bytes());
        out.extend_from_slice(&qs);
    }
}

/// ggml's `quantize_row_q5_1_ref`: per block of 32, d = (max - min) / 31 and m = min (both f16),
/// q = (int)((x - min) / d + 0.5); the fifth bits go to `qh` as in Q5_0.
pub fn quantize_row_q5_1(values: &[f32], out: &mut Vec<u8>) {
    assert!(values.len().is_multiple_of(32), "Q5_1 needs whole blocks of 32, got {}", values.len());
    for block in values.chunks_exact(32) {
        let min = block.iter().copied().fold(f32::MAX, f32::min);
        let max = block.iter().copied().fold(-f32::MAX, f32::max);
        let d = (max - min) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let (mut qh, mut qs) = (0u32, [0u8; 16]);
        for j in 0..16 {
            // C's (uint8_t) cast truncates; (x - min) / d + 0.5 is in 0.5..=31.5 here.
            let x0 = ((block[j] - min) * id + 0.5) as u8;
            let x1 = ((block[j + 16] - min) * id + 0.5) as u8;
            qs[j] = (x0 & 0x0f) | ((x1 & 0x0f) << 4);
            qh |= ((x0 as u32 & 0x10) >> 4) << j;
            qh |= ((x1 as u32 & 0x10) >> 4) << (j + 16);
        }
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
        out.extend_from_slice(&qh.to_le_bytes());
        out.extend_from_slice(&qs);
    }
}

/// Encode `values` (whole rows) as `ty`. Supports F32, F16, BF16, Q8_0, Q4_0, Q5_0 and Q5_1 (the
/// types `synth` quantises); None for the K-quants, which need ggml's search-based quantisers.
pub fn quantize(ty: GgmlType, values: &[f32]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(values.len() / ty.block_size() * ty.block_bytes());
    match ty {
        GgmlType::F32 => values.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        GgmlType::F16 => {
            values.iter().for_each(|&v| out.extend_from_slice(&f16::from_f32(v).to_le_bytes()))
        }
        GgmlType::BF16 => {
            values.iter().for_each(|&v| out.extend_from_slice(&bf16::from_f32(v).to_le_bytes()))
        }
        GgmlType::Q8_0 => quantize_row_q8_0(values, &mut out),
        GgmlType::Q4_0 => quantize_row_q4_0(values, &mut out),
        GgmlType::Q5_0 => quantize_row_q5_0(values, &mut out),
        GgmlType::Q5_1 => quantize_row_q5_1(values, &mut out),
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => return None,
    }
    Some(out)
}
