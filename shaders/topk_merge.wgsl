// Top-k, pass 2 (one workgroup): merges the `groups` partial lists of topk_partial.wgsl into
// OUT = [log-sum-exp of the row, count, then count (index, value) pairs, best first].
// With `chain`, the best index also becomes the next step's input token: STEP = [pos, n, _, _,
// ids...] becomes [pos + n, 1, _, _, best, ...] (greedy decoding without a round trip to the host).

struct Params {
    groups: u32,
    k: u32,
    chain: u32,
}

@group(0) @binding(0) var<storage, read> C: array<u32>;
@group(0) @binding(1) var<storage, read_write> OUT: array<u32>;
@group(0) @binding(2) var<storage, read_write> STEP: array<u32>;
@group(0) @binding(3) var<uniform> P: Params;

@compute @workgroup_size(256)
fn merge(@builtin(local_invocation_index) lid: u32) {
    let stride = 2u + 2u * P.k;
    var m = -3.4e38;
    for (var g = lid; g < P.groups; g += WG) {
        m = max(m, bitcast<f32>(C[g * stride]));
    }
    let mx = reduce_f32(lid, m, true);
    var s = 0.0;
    for (var g = lid; g < P.groups; g += WG) {
        s += bitcast<f32>(C[g * stride + 1u]) * exp(bitcast<f32>(C[g * stride]) - mx);
    }
    let sum = reduce_f32(lid, s, false);

    let total = P.groups * P.k;
    var pv = 0.0;
    var pi = NONE;
    var count = 0u;
    var best = NONE;
    for (var r = 0u; r < P.k; r++) {
        var bv = 0.0;
        var bi = NONE;
        for (var j = lid; j < total; j += WG) {
            let at = (j / P.k) * stride + 2u + 2u * (j % P.k);
            let i = C[at];
            let v = bitcast<f32>(C[at + 1u]);
            if (i != NONE && after(v, i, pv, pi, r == 0u) && before(v, i, bv, bi)) {
                bv = v;
                bi = i;
            }
        }
        let b = reduce_best(lid, bv, bi);
        pv = bitcast<f32>(b.x);
        pi = b.y;
        if (r == 0u) {
            best = pi;
        }
        if (pi != NONE) {
            count += 1u;
        }
        if (lid == 0u) {
            OUT[2u + 2u * r] = pi;
            OUT[3u + 2u * r] = b.x;
        }
    }
    if (lid == 0u) {
        OUT[0] = bitcast<u32>(mx + log(sum));
        OUT[1] = count;
        if (P.chain != 0u) {
            STEP[4] = best;
            STEP[0] = STEP[0] + STEP[1];
            STEP[1] = 1u;
        }
    }
}
