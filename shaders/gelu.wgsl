// GELU, tanh approximation (GPT-2's gelu_new), in place:
// Y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). The tanh argument is clamped to +-15
// (where tanh is 1 in f32) because some drivers' tanh overflows to NaN for large inputs.

struct Params {
    n: u32,
}

@group(0) @binding(0) var<storage, read_write> Y: array<f32>;
@group(0) @binding(1) var<uniform> P: Params;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = (wg.x + wg.y * nwg.x) * 256u + lid;
    if (i < P.n) {
        let x = Y[i];
        let u = clamp(0.7978846 * (x + 0.044715 * x * x * x), -15.0, 15.0);
        Y[i] = 0.5 * x * (1.0 + tanh(u));
    }
}
