// Causal attention, second pass: combine the chunks attention.wgsl wrote for each (head, token)
// into the output row, O[t][h * head_dim + d] = sum_c e_c acc_c[d] / sum_c e_c l_c with
// e_c = exp(max_c - max over all chunks). Only the chunks that hold positions up to the token's
// own are read. One workgroup per (head, token).

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

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let h = wg.x;
    let t = wg.y;
    let hd = P.head_dim;
    let seen = STEP[0] + P.start + t + 1u;
    let n = (seen + P.chunk - 1u) / P.chunk;
    let first = (t * P.n_head + h) * P.max_chunks * (hd + 2u);
    var mx = -3.0e38;
    for (var c = 0u; c < n; c++) {
        mx = max(mx, PART[first + c * (hd + 2u)]);
    }
    var l = 0.0;
    for (var c = 0u; c < n; c++) {
        let at = first + c * (hd + 2u);
        l += exp(PART[at] - mx) * PART[at + 1u];
    }
    for (var d = lid; d < hd; d += WG) {
        var s = 0.0;
        for (var c = 0u; c < n; c++) {
            let at = first + c * (hd + 2u);
            s += exp(PART[at] - mx) * PART[at + 2u + d];
        }
        O[(t * P.n_head + h) * hd + d] = s / l;
    }
}
