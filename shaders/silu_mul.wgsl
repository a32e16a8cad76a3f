// Gated MLP activation for rows of gate|up side by side (GU: rows of 2 * width, the gate in the
// first half, up in the second): U[t][i] = up * silu(gate), silu(x) = x / (1 + exp(-x)), for
// i < n = tokens * width.

struct Params {
    n: u32,
    width: u32,
}

@group(0) @binding(0) var<storage, read> GU: array<f32>;
@group(0) @binding(1) var<storage, read_write> U: array<f32>;
@group(0) @binding(2) var<uniform> P: Params;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = (wg.x + wg.y * nwg.x) * 256u + lid;
    if (i < P.n) {
        let at = (i / P.width) * 2u * P.width + i % P.width;
        let g = GU[at];
        U[i] = GU[at + P.width] * (g / (1.0 + exp(-g)));
    }
}
