// Rotary position embedding, read from one buffer and written to another (the q buffer, or the
// key/value cache, of element type `kvt`, at the token's position). One thread per output element.
// Positions come from the step buffer: token t of this call is at STEP[0] + start + t.
// mode 0: copy (no rotation: GPT-2, and values going to the cache);
// mode 1: interleaved pairs (2i, 2i+1) (llama); mode 2: half-split pairs (i, i + rope_dims/2) (qwen2).
// Dimensions at or past rope_dims are copied. CS holds (cos, sin) for pair i at position p at
// CS[p * rope_dims/2 + i], computed on the CPU exactly as the reference does. Output row:
// out_row0 + t, plus the token's position when out_at_pos (the cache).

struct Params {
    n_tok: u32,
    n_head: u32,
    head_dim: u32,
    rope_dims: u32,
    mode: u32,
    in_stride: u32,
    in_col0: u32,
    out_stride: u32,
    out_row0: u32,
    start: u32,
    out_at_pos: u32,
}

@group(0) @binding(0) var<storage, read> X: array<f32>;
@group(0) @binding(1) var<storage, read> CS: array<vec2<f32>>;
@group(0) @binding(2) var<storage, read> STEP: array<u32>;
@group(0) @binding(3) var<storage, read_write> Y: array<kvt>;
@group(0) @binding(4) var<uniform> P: Params;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let idx = (wg.x + wg.y * nwg.x) * 256u + lid;
    let width = P.n_head * P.head_dim;
    if (idx >= P.n_tok * width) {
        return;
    }
    let t = idx / width;
    let e = idx % width;
    let d = e % P.head_dim;
    let head0 = e - d;
    let src = t * P.in_stride + P.in_col0 + head0;
    let half = P.rope_dims / 2u;
    let pos = STEP[0] + P.start + t;
    var y = X[src + d];
    if (P.mode != 0u && d < P.rope_dims) {
        var i: u32;
        var a: u32;
        var b: u32;
        if (P.mode == 1u) {
            i = d / 2u;
            a = 2u * i;
            b = a + 1u;
        } else {
            i = d % half;
            a = i;
            b = i + half;
        }
        let cs = CS[pos * half + i];
        let x0 = X[src + a];
        let x1 = X[src + b];
        if (d == a) {
            y = x0 * cs.x - x1 * cs.y;
        } else {
            y = x0 * cs.y + x1 * cs.x;
        }
    }
    let row = P.out_row0 + t + select(0u, STEP[0] + P.start, P.out_at_pos != 0u);
    Y[row * P.out_stride + e] = kvt(y);
}
