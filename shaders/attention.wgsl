// Causal grouped-query attention, split over the sequence (flash-decoding), first pass: for a
// batch of queries at positions pos0 + t (pos0 = STEP[0] + start: read on the GPU from the step
// buffer), over the KV cache of one layer (keys in rows of kv_dim elements of type `kvt`, f32 or
// f16, the values from element v_base on). One workgroup per (head, token, chunk of `chunk`
// positions): a first pass computes the chunk's scores (kept in workgroup memory for the first
// SC positions, so each key is read once in chunks up to SC long) and their largest, a second
// walks its positions in tiles of WG, turning scores into exp(s - max) in workgroup memory, each
// thread accumulating its own output dimensions. The chunk's (max, sum of exponentials, unnormalised output) go to PART;
// attention_merge.wgsl combines the chunks (numerically stable: each is rescaled by
// exp(max_chunk - max_all)). Chunks past the token's last position do nothing. Query head h reads
// key/value head h / (n_head / n_head_kv). The head size is the constant HD (<= 4 * WG = 256, put
// before this source by Rust) and a full tile's walk has the constant length WG, so the loops over
// a key's elements and over a tile's values unroll and each thread issues their loads at once: on
// a real GPU the chain of loads a thread waits on one by one, not the bytes, is what this costs.

struct Params {
    n_head: u32,
    n_head_kv: u32,
    head_dim: u32,
    start: u32,
    scale: f32,
    v_base: u32,
    chunk: u32,
    max_chunks: u32,
}

@group(0) @binding(0) var<storage, read> Q: array<f32>;
@group(0) @binding(1) var<storage, read> KV: array<kvt>;
@group(0) @binding(2) var<storage, read> STEP: array<u32>;
@group(0) @binding(3) var<storage, read_write> PART: array<f32>;
@group(0) @binding(4) var<uniform> P: Params;

const WG: u32 = 64u;
var<workgroup> qs: array<f32, HD>;
var<workgroup> probs: array<f32, 64>;
var<workgroup> red: array<f32, 64>;
const SC: u32 = 1024u;
var<workgroup> scores: array<f32, 1024>; // SC

fn score(p: u32, kb: u32) -> f32 {
    let base = p * P.n_head_kv * HD + kb;
    var s = 0.0;
    for (var i = 0u; i < HD; i++) {
        s += qs[i] * f32(KV[base + i]);
    }
    return s * P.scale;
}

// Output dimension d summed over the n probabilities of the tile of values from position `base`.
fn weighted(base: u32, n: u32, d: u32, kv_dim: u32, kb: u32) -> f32 {
    let at = P.v_base + base * kv_dim + kb + d;
    var s = 0.0;
    if (n == WG) {
        for (var i = 0u; i < WG; i++) {
            s += probs[i] * f32(KV[at + i * kv_dim]);
        }
    } else {
        for (var i = 0u; i < n; i++) {
            s += probs[i] * f32(KV[at + i * kv_dim]);
        }
    }
    return s;
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let h = wg.x;
    let t = wg.y;
    let c = wg.z;
    let hd = HD;
    let kv_dim = P.n_head_kv * hd;
    let seen = STEP[0] + P.start + t + 1u;
    let p0 = c * P.chunk;
    if (p0 >= seen) {
        return;
    }
    let p1 = min(seen, p0 + P.chunk);
    let kb = (h / (P.n_head / P.n_head_kv)) * hd;
    let qb = (t * P.n_head + h) * hd;
    for (var d = lid; d < hd; d += WG) {
        qs[d] = Q[qb + d];
    }
    workgroupBarrier();

    var m = -3.0e38;
    // Thread lid handles positions p0 + lid + k * WG in both passes: it reads back only the
    // scores it wrote.
    for (var p = p0 + lid; p < p1; p += WG) {
        let s = score(p, kb);
        if (p - p0 < SC) {
            scores[p - p0] = s;
        }
        m = max(m, s);
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
    for (var base = p0; base < p1; base += WG) {
        let p = base + lid;
        var e = 0.0;
        if (p < p1) {
            var s = 0.0;
            if (p - p0 < SC) {
                s = scores[p - p0];
            } else {
                s = score(p, kb);
            }
            e = exp(s - mx);
        }
        probs[lid] = e;
        l += e;
        workgroupBarrier();
        let cnt = min(WG, p1 - base);
        for (var j = 0u; j < 4u; j++) {
            let d = lid + j * WG;
            if (d < hd) {
                acc[j] += weighted(base, cnt, d, kv_dim, kb);
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
    let out = ((t * P.n_head + h) * P.max_chunks + c) * (hd + 2u);
    if (lid == 0u) {
        PART[out] = mx;
        PART[out + 1u] = red[0];
    }
    for (var j = 0u; j < 4u; j++) {
        let d = lid + j * WG;
        if (d < hd) {
            PART[out + 2u + d] = acc[j];
        }
    }
}
