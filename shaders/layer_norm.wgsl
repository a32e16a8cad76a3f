// LayerNorm with bias, one workgroup per row of n:
// Y = (X - mean) * (1 / sqrt(var + eps)) * w + b, mean and variance in two passes.

struct Params {
    n: u32,
    eps: f32,
}

@group(0) @binding(0) var<storage, read> X: array<f32>;
@group(0) @binding(1) var<storage, read> Wt: array<f32>;
@group(0) @binding(2) var<storage, read> Bs: array<f32>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;
@group(0) @binding(4) var<uniform> P: Params;

const WG: u32 = 64u;
var<workgroup> red: array<f32, 64>;

fn reduce_sum(lid: u32, v: f32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var k = WG / 2u; k > 0u; k >>= 1u) {
        if (lid < k) {
            red[lid] += red[lid + k];
        }
        workgroupBarrier();
    }
    let total = red[0];
    workgroupBarrier();
    return total;
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let base = wg.x * P.n;
    var s = 0.0;
    for (var i = lid; i < P.n; i += WG) {
        s += X[base + i];
    }
    let mean = reduce_sum(lid, s) / f32(P.n);
    var q = 0.0;
    for (var i = lid; i < P.n; i += WG) {
        let d = X[base + i] - mean;
        q += d * d;
    }
    let inv = 1.0 / sqrt(reduce_sum(lid, q) / f32(P.n) + P.eps);
    for (var i = lid; i < P.n; i += WG) {
        Y[base + i] = (X[base + i] - mean) * inv * Wt[i] + Bs[i];
    }
}
