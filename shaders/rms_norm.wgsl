// RMSNorm, one workgroup per row of n: Y = X * (1 / sqrt(mean(X^2) + eps)) * w.

struct Params {
    n: u32,
    eps: f32,
}

@group(0) @binding(0) var<storage, read> X: array<f32>;
@group(0) @binding(1) var<storage, read> Wt: array<f32>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;

const WG: u32 = 64u;
var<workgroup> red: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let base = wg.x * P.n;
    var s = 0.0;
    for (var i = lid; i < P.n; i += WG) {
        let x = X[base + i];
        s += x * x;
    }
    red[lid] = s;
    workgroupBarrier();
    for (var k = WG / 2u; k > 0u; k >>= 1u) {
        if (lid < k) {
            red[lid] += red[lid + k];
        }
        workgroupBarrier();
    }
    let inv = 1.0 / sqrt(red[0] / f32(P.n) + P.eps);
    for (var i = lid; i < P.n; i += WG) {
        Y[base + i] = X[base + i] * inv * Wt[i];
    }
}
