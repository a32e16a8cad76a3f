// Top-k, pass 1: workgroup g takes the slice [g * slice, (g + 1) * slice) of a row of n logits
// (at X[x_off..]) and writes to C[g * (2 + 2k) ..]: the slice's max m, sum of exp(x - m), then
// its k best (index, value) pairs in order (index NONE past the slice's end). The top-k of the
// row is among these, and log-sum-exp of the row follows from the (m, sum) pairs.
//
// With `masked`, only tokens whose bit is set in MASK (token p: bit p % 32 of word p / 32, the
// allowed set of a structured-output constraint) are ranked; the (m, sum) pair is then 0, 0
// (a masked ranking's log-sum-exp comes from an unmasked pass over the same row).

struct Params {
    n: u32,
    x_off: u32,
    k: u32,
    slice: u32,
    masked: u32,
}

@group(0) @binding(0) var<storage, read> X: array<f32>;
@group(0) @binding(1) var<storage, read> MASK: array<u32>;
@group(0) @binding(2) var<storage, read_write> C: array<u32>;
@group(0) @binding(3) var<uniform> P: Params;

fn ranked(p: u32) -> bool {
    return P.masked == 0u || (MASK[p >> 5u] & (1u << (p & 31u))) != 0u;
}

@compute @workgroup_size(256)
fn partial(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let lo = wg.x * P.slice;
    let hi = min(P.n, lo + P.slice);
    let base = wg.x * (2u + 2u * P.k);
    var pv = 0.0;
    var pi = NONE;
    var mx = 0.0;
    for (var r = 0u; r < P.k; r++) {
        var bv = 0.0;
        var bi = NONE;
        for (var p = lo + lid; p < hi; p += WG) {
            let v = X[P.x_off + p];
            if (ranked(p) && after(v, p, pv, pi, r == 0u) && before(v, p, bv, bi)) {
                bv = v;
                bi = p;
            }
        }
        let b = reduce_best(lid, bv, bi);
        pv = bitcast<f32>(b.x);
        pi = b.y;
        if (r == 0u) {
            mx = pv;
        }
        if (lid == 0u) {
            C[base + 2u + 2u * r] = pi;
            C[base + 3u + 2u * r] = b.x;
        }
    }
    if (P.masked != 0u) {
        if (lid == 0u) {
            C[base] = 0u;
            C[base + 1u] = 0u;
        }
        return;
    }
    var s = 0.0;
    for (var p = lo + lid; p < hi; p += WG) {
        s += exp(X[P.x_off + p] - mx);
    }
    let sum = reduce_f32(lid, s, false);
    if (lid == 0u) {
        C[base] = bitcast<u32>(mx);
        C[base + 1u] = bitcast<u32>(sum);
    }
}
