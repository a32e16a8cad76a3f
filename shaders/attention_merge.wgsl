// Causal attention, second pass: combine the chunks attention.wgsl wrote for each (head, token)
// into the output row, O[t][h * head_dim + d] = sum_c e_c acc_c[d] / sum_c e_c l_c with
// e_c = exp(max_c - max over all chunks). Only the chunks that hold positions up to the token's
// own are read. One workgroup per (head, token): the chunks' maxima and weights are found by
// all threads at once, and each output dimension's sum over the chunks issues four loads at a
// time, so no thread waits on one load after another (max_chunks <= 128).

struct Params {
    n_head: u32,
    head_dim: u32,
    start: u32,
    chunk: u32,
    max_chunks: u32,
}

@group(0) @binding(0) var<storage, read> PART: array<f32>;
@group(0) @binding(1) var<storage, read> STEP: array<u32>;
@group(0) @binding(2) var<storage, read_write> O: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;

const WG: u32 = 64u;
var<workgroup> weight: array<f32, 128>; // each chunk's exp(max_c - max over all)
var<workgroup> red: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let h = wg.x;
    let t = wg.y;
    let hd = P.head_dim;
    let stride = hd + 2u;
    let seen = STEP[0] + P.start + t + 1u;
    let n = min((seen + P.chunk - 1u) / P.chunk, P.max_chunks);
    let first = (t * P.n_head + h) * P.max_chunks * stride;
    var m = -3.0e38;
    for (var c = lid; c < n; c += WG) {
        m = max(m, PART[first + c * stride]);
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
    var l = 0.0;
    for (var c = lid; c < n; c += WG) {
        let at = first + c * stride;
        let e = exp(PART[at] - mx);
        weight[c] = e;
        l += e * PART[at + 1u];
    }
    red[lid] = l;
    workgroupBarrier();
    for (var k = WG / 2u; k > 0u; k >>= 1u) {
        if (lid < k) {
            red[lid] += red[lid + k];
        }
        workgroupBarrier();
    }
    let total = red[0];
    for (var d = lid; d < hd; d += WG) {
        let at = first + 2u + d;
        var s = 0.0;
        var c = 0u;
        for (; c + 4u <= n; c += 4u) {
            let a = PART[at + c * stride];
            let b = PART[at + (c + 1u) * stride];
            let e = PART[at + (c + 2u) * stride];
            let f = PART[at + (c + 3u) * stride];
            s += weight[c] * a + weight[c + 1u] * b + weight[c + 2u] * e + weight[c + 3u] * f;
        }
        for (; c < n; c++) {
            s += weight[c] * PART[at + c * stride];
        }
        O[(t * P.n_head + h) * hd + d] = s / total;
    }
}
