// The achievable read bandwidth, for the benchmark's reference: every thread reads 16-byte words
// in a grid-stride loop and folds them into one word, written so the reads cannot be dropped.

struct Params {
    n: u32,
    stride: u32,
}

@group(0) @binding(0) var<storage, read> A: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> OUT: array<u32>;
@group(0) @binding(2) var<uniform> P: Params;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    var acc = vec4<u32>(0u);
    for (var i = gid.x; i < P.n; i += max(P.stride, 1u)) {
        acc ^= A[i];
    }
    OUT[gid.x % 4096u] = acc.x ^ acc.y ^ acc.z ^ acc.w;
}
