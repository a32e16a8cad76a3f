// Causal grouped-query attention for a batch of queries at positions pos0 + t (pos0 = STEP[0] +
// start: the position is read on the GPU from the step buffer), over the KV cache of one layer
// (rows of kv_dim elements of type `kvt`, f32 or f16; positions 0..=pos0 + t). One workgroup per (head, token):
// a first pass finds the largest score, a second walks the positions in tiles of WG, turning
// scores into exp(s - max) in workgroup memory, each thread accumulating its own output
// dimensions; the sum of the exponentials divides at the end (numerically stable softmax).
// Query head h reads key/value head h / (n_head / n_head_kv). head_dim <= 4 * WG = 256.

struct Params {
    n_head: u32,
    n_head_kv: u32,
    head_dim: u32,
    start: u32,
    scale: f32,
}

@group(0) @binding(0) var<storage, read> Q: array<f32>;
@group(0) @binding(1) var<storage, read> K: array<kvt>;
@group(0) @binding(2) var<storage, read> V: array<kvt>;
@group(0) @binding(3) var<storage, read> STEP: array<u32>;
@group(0) @binding(4) var<storage, read_write> O: array<f32>;
@group(0) @binding(5) var<uniform> P: Params;

const WG: u32 = 64u;
var<workgroup> qs: array<f32, 256>;
var<workgroup> probs: array<f32, 64>;
var<workgroup> red: array<f32, 64>;

fn score(p: u32, kb: u32) -> f32 {
    let base = p * P.n_head_kv * P.head_dim + kb;
    var s = 0.0;
    for (var i = 0u; i < P.head_dim; i++) {
        s += qs[i] * f32(K[base + i]);
    }
    return s * P.scale;
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let h = wg.x;
    let t = wg.y;
    let hd = P.head_dim;
    let kv_dim = P.n_head_kv * hd;
    let seen = STEP[0] + P.start + t + 1u;
    let kb = (h / (P.n_head / P.n_head_kv)) * hd;
    let qb = (t * P.n_head + h) * hd;
    for (var d = lid; d < hd; d += WG) {
        qs[d] = Q[qb + d];
    }
    workgroupBarrier();

    var m = -3.0e38;
    for (var p = lid; p < seen; p += WG) {
        m = max(m, score(p, kb));
    }
    red[lid] = m;
    workgroupBarrier();
    for (var k = WG / 2u; k > 0u; k >>= 1u) {
        if (lid < k) {
            red[lid] = max(red[lid], red[lid + k]);
        }
        workgroupBarrier();
    }
    let mx = red[0];
    workgroupBarrier();

    var acc = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
    var l = 0.0;
    for (var base = 0u; base < seen; base += WG) {
        let p = base + lid;
        var e = 0.0;
        if (p < seen) {
            e = exp(score(p, kb) - mx);
        }
        probs[lid] = e;
        l += e;
        workgroupBarrier();
        let cnt = min(WG, seen - base);
        for (var j = 0u; j < 4u; j++) {
            let d = lid + j * WG;
            if (d < hd) {
                var s = acc[j];
                for (var i = 0u; i < cnt; i++) {
                    s += probs[i] * f32(V[(base + i) * kv_dim + kb + d]);
                }
                acc[j] = s;
            }
        }
        workgroupBarrier();
    }

    red[lid] = l;
    workgroupBarrier();
    for (var k = WG / 2u; k > 0u; k >>= 1u) {
        if (lid < k) {
            red[lid] += red[lid + k];
        }
        workgroupBarrier();
    }
    let sum = red[0];
    for (var j = 0u; j < 4u; j++) {
        let d = lid + j * WG;
        if (d < hd) {
            O[qb + d] = acc[j] / sum;
        }
    }
}
