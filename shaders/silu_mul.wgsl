// Gated MLP activation: U[i] = U[i] * silu(G[i]), silu(x) = x / (1 + exp(-x)).

struct Params {
    n: u32,
}

@group(0) @binding(0) var<storage, read> G: array<f32>;
@group(0) @binding(1) var<storage, read_write> U: array<f32>;
@group(0) @binding(2) var<uniform> P: Params;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = (wg.x + wg.y * nwg.x) * 256u + lid;
    if (i < P.n) {
        let g = G[i];
        U[i] = U[i] * (g / (1.0 + exp(-g)));
    }
}
