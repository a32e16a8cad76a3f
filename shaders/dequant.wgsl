// Decoders for GGUF weight bytes, prepended to every kernel that reads weights.
//
// The including kernel declares `W: array<u32>` holding a tensor's raw little-endian bytes (padded
// to whole words) and Rust appends one `fn decode(...)` that forwards to the weight type's
// decoder. A row is decoded in chunks of CH = 32 elements (one Q8_0/Q4_0/Q5_0/Q5_1 block, one
// Q4_K/Q5_K sub-block, two Q6_K scale groups; for F32/F16/BF16 any 32 elements, the last chunk of a row
// possibly shorter: `n` valid elements). Blocks are not word-aligned (Q8_0 is 34 bytes, Q4_0 18),
// so bytes are read four at a time with word loads and shifts (`word_at`: at most two loads per
// four bytes, one where aligned). The formulas follow src/quant.rs line by line.

const CH: u32 = 32u;

fn byte_at(off: u32) -> u32 {
    return (W[off >> 2u] >> ((off & 3u) * 8u)) & 0xffu;
}

// Four bytes from any byte offset, little-endian. The second word is read only when the bytes
// straddle two words (so it holds data of the tensor).
fn word_at(off: u32) -> u32 {
    let w = off >> 2u;
    let sh = (off & 3u) * 8u;
    if (sh == 0u) {
        return W[w];
    }
    return (W[w] >> sh) | (W[w + 1u] << (32u - sh));
}

// A 16-bit value at an even byte offset (it never straddles two words).
fn u16_at(off: u32) -> u32 {
    return (W[off >> 2u] >> ((off & 2u) * 8u)) & 0xffffu;
}

fn f16_at(off: u32) -> f32 {
    return unpack2x16float(u16_at(off)).x;
}

fn bf16_at(off: u32) -> f32 {
    return bitcast<f32>(u16_at(off) << 16u);
}

// A byte read as a signed 8-bit integer.
fn i8_of(b: u32) -> f32 {
    return f32(bitcast<i32>(b << 24u) >> 24u);
}

// `rb`: byte offset of the row in W; `c`: chunk index in the row; `n`: valid elements (<= CH).
fn decode_f32(rb: u32, c: u32, n: u32, v: ptr<function, array<f32, 32>>) {
    let base = (rb >> 2u) + c * CH;
    for (var i = 0u; i < n; i++) {
        (*v)[i] = bitcast<f32>(W[base + i]);
    }
}

fn decode_f16(rb: u32, c: u32, n: u32, v: ptr<function, array<f32, 32>>) {
    let base = rb + c * CH * 2u;
    for (var i = 0u; i + 1u < n; i += 2u) {
        let h = unpack2x16float(word_at(base + 2u * i));
        (*v)[i] = h.x;
        (*v)[i + 1u] = h.y;
    }
    if ((n & 1u) != 0u) {
        (*v)[n - 1u] = f16_at(base + 2u * (n - 1u));
    }
}

fn decode_bf16(rb: u32, c: u32, n: u32, v: ptr<function, array<f32, 32>>) {
    let base = rb + c * CH * 2u;
    for (var i = 0u; i + 1u < n; i += 2u) {
        let p = word_at(base + 2u * i);
        (*v)[i] = bitcast<f32>(p << 16u);
        (*v)[i + 1u] = bitcast<f32>(p & 0xffff0000u);
    }
    if ((n & 1u) != 0u) {
        (*v)[n - 1u] = bf16_at(base + 2u * (n - 1u));
    }
}

// Q8_0: d (f16), then 32 signed bytes. 34 bytes per block.
fn decode_q8_0(rb: u32, c: u32, n: u32, v: ptr<function, array<f32, 32>>) {
    let off = rb + c * 34u;
    let d = f16_at(off);
    for (var j = 0u; j < 8u; j++) {
        let q = word_at(off + 2u + 4u * j);
        for (var b = 0u; b < 4u; b++) {
            (*v)[4u * j + b] = d * i8_of((q >> (8u * b)) & 0xffu);
        }
    }
}

// Q4_0: d (f16), 16 bytes: low nibbles are elements 0..16, high nibbles 16..32, offset 8.
fn decode_q4_0(rb: u32, c: u32, n: u32, v: ptr<function, array<f32, 32>>) {
    let off = rb + c * 18u;
    let d = f16_at(off);
    for (var w = 0u; w < 4u; w++) {
        let q = word_at(off + 2u + 4u * w);
        for (var k = 0u; k < 4u; k++) {
            let b = (q >> (8u * k)) & 0xffu;
            let j = 4u * w + k;
            (*v)[j] = d * f32(i32(b & 0xfu) - 8);
            (*v)[j + 16u] = d * f32(i32(b >> 4u) - 8);
        }
    }
}

// Q5_0: d (f16), qh (32 fifth bits, bit j for element j), then Q4_0's 16 bytes of nibbles;
// offset 16. 22 bytes per block.
fn decode_q5_0(rb: u32, c: u32, n: u32, v: ptr<function, array<f32, 32>>) {
    let off = rb + c * 22u;
    let d = f16_at(off);
    let qh = word_at(off + 2u);
    for (var w = 0u; w < 4u; w++) {
        let q = word_at(off + 6u + 4u * w);
        for (var k = 0u; k < 4u; k++) {
            let b = (q >> (8u * k)) & 0xffu;
            let j = 4u * w + k;
            let lo = (b & 0xfu) | (((qh >> j) & 1u) << 4u);
            let hi = (b >> 4u) | (((qh >> (j + 16u)) & 1u) << 4u);
            (*v)[j] = d * f32(i32(lo) - 16);
            (*v)[j + 16u] = d * f32(i32(hi) - 16);
        }
    }
}

// Q5_1: d, m (f16), qh (32 fifth bits), then 16 bytes of nibbles as Q5_0; w = d q + m. 24 bytes.
fn decode_q5_1(rb: u32, c: u32, n: u32, v: ptr<function, array<f32, 32>>) {
    let off = rb + c * 24u;
    let d = f16_at(off);
    let m = f16_at(off + 2u);
    let qh = word_at(off + 4u);
    for (var w = 0u; w < 4u; w++) {
        let q = word_at(off + 8u + 4u * w);
        for (var k = 0u; k < 4u; k++) {
            let b = (q >> (8u * k)) & 0xffu;
            let j = 4u * w + k;
            let lo = (b & 0xfu) | (((qh >> j) & 1u) << 4u);
            let hi = (b >> 4u) | (((qh >> (j + 16u)) & 1u) << 4u);
            (*v)[j] = f32(lo) * d + m;
            (*v)[j + 16u] = f32(hi) * d + m;
        }
    }
}

// The 6-bit scale and min of Q4_K sub-block j (0..8) from the 12 scale bytes at `sc`.
fn q4_k_scale_min(sc: u32, j: u32) -> vec2<u32> {
    if (j < 4u) {
        return vec2<u32>(byte_at(sc + j) & 63u, byte_at(sc + j + 4u) & 63u);
    }
    let a = byte_at(sc + j + 4u);
    return vec2<u32>(
        (a & 0xfu) | ((byte_at(sc + j - 4u) >> 6u) << 4u),
        (a >> 4u) | ((byte_at(sc + j) >> 6u) << 4u),
    );
}

// Q4_K: d, dmin (f16), 12 scale bytes, 128 bytes of nibbles; 144 bytes per 256 elements.
// Chunk c is sub-block j = c % 8: nibbles of byte group j / 2, low for even j, high for odd.
fn decode_q4_k(rb: u32, c: u32, n: u32, v: ptr<function, array<f32, 32>>) {
    decode_k_nibbles(rb + (c / 8u) * 144u, c % 8u, false, v);
}

// Q5_K: Q4_K's d, dmin and 12 scale bytes, 32 bytes of fifth bits (bit j of byte l: element l of
// sub-block j), then Q4_K's 128 bytes of nibbles; 176 bytes per 256 elements.
fn decode_q5_k(rb: u32, c: u32, n: u32, v: ptr<function, array<f32, 32>>) {
    decode_k_nibbles(rb + (c / 8u) * 176u, c % 8u, true, v);
}

// Sub-block j of the Q4_K (or, with `five`, Q5_K) super-block at byte `off`.
fn decode_k_nibbles(off: u32, j: u32, five: bool, v: ptr<function, array<f32, 32>>) {
    let d = f16_at(off);
    let dmin = f16_at(off + 2u);
    let sm = q4_k_scale_min(off + 4u, j);
    let d1 = d * f32(sm.x);
    let m1 = dmin * f32(sm.y);
    let q = off + select(16u, 48u, five) + (j / 2u) * 32u;
    let shift = (j & 1u) * 4u;
    for (var w = 0u; w < 8u; w++) {
        let qw = word_at(q + 4u * w) >> shift;
        var hw = 0u;
        if (five) {
            hw = word_at(off + 16u + 4u * w) >> j;
        }
        for (var k = 0u; k < 4u; k++) {
            let q5 = ((qw >> (8u * k)) & 0xfu) | (((hw >> (8u * k)) & 1u) << 4u);
            (*v)[4u * w + k] = d1 * f32(q5) - m1;
        }
    }
}

// Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 signed scales, d (f16); 210 bytes per 256.
// Chunk c: half h = j / 4 (128 elements each), quarter k = j % 4 within it (j = c % 8).
fn decode_q6_k(rb: u32, c: u32, n: u32, v: ptr<function, array<f32, 32>>) {
    let off = rb + (c / 8u) * 210u;
    let j = c % 8u;
    let h = j / 4u;
    let k = j % 4u;
    let d = f16_at(off + 208u);
    let ql = off + h * 64u + (k & 1u) * 32u;
    let qh = off + 128u + h * 32u;
    let sc = off + 192u + h * 8u + 2u * k;
    let lo_shift = (k / 2u) * 4u;
    let hi_shift = 2u * k;
    let s0 = d * i8_of(byte_at(sc));
    let s1 = d * i8_of(byte_at(sc + 1u));
    for (var w = 0u; w < 8u; w++) {
        let lw = word_at(ql + 4u * w) >> lo_shift;
        let hw = word_at(qh + 4u * w) >> hi_shift;
        let s = select(s1, s0, w < 4u);
        for (var k = 0u; k < 4u; k++) {
            let lo = (lw >> (8u * k)) & 0xfu;
            let hi = (hw >> (8u * k)) & 3u;
            let q = i32(lo | (hi << 4u)) - 32;
            (*v)[4u * w + k] = s * f32(q);
        }
    }
}
