// Y[t][y_col0 + r] = dot(W[r], X[x_row0 + t]) (+ B[bias_row0 + r]) for a batch of tokens.
//
// W is a weight matrix in its GGUF encoding (decoded by the dequant.wgsl prelude, which reads
// whole words). One workgroup computes RPW = 4 rows for up to TB tokens (so a row is decoded once
// per TB tokens; with one token this is the decode-step matrix-vector product): a team of
// TEAM = 16 threads per row splits the row's chunks of 32 and reduces in workgroup memory.
// Several rows per workgroup keep the threads busy on narrow matrices. Grid: (x, y) cover the
// groups of rows (x + y * nx), z the token groups.

struct Params {
    rows: u32,
    cols: u32,
    n_tok: u32,
    row_bytes: u32,
    x_row0: u32,
    y_stride: u32,
    y_col0: u32,
    bias_row0: u32,
    has_bias: u32,
}

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read> B: array<f32>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;
@group(0) @binding(4) var<uniform> P: Params;

const WG: u32 = 64u;
const TB: u32 = 8u;
const RPW: u32 = 4u;
const TEAM: u32 = 16u; // WG / RPW

var<workgroup> partial: array<f32, 512>; // TB * WG

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let team = lid / TEAM;
    let lane = lid % TEAM;
    let row = (wg.x + wg.y * nwg.x) * RPW + team;
    let t0 = wg.z * TB;
    let nt = min(TB, P.n_tok - t0);
    var acc: array<f32, 8>;
    var v: array<f32, 32>;
    if (row < P.rows) {
        let n_chunks = (P.cols + CH - 1u) / CH;
        let rb = row * P.row_bytes;
        for (var c = lane; c < n_chunks; c += TEAM) {
            let n = min(CH, P.cols - c * CH);
            decode(rb, c, n, &v);
            for (var t = 0u; t < nt; t++) {
                let xb = (P.x_row0 + t0 + t) * P.cols + c * CH;
                var s = 0.0;
                for (var i = 0u; i < n; i++) {
                    s += v[i] * X[xb + i];
                }
                acc[t] += s;
            }
        }
    }
    for (var t = 0u; t < TB; t++) {
        partial[t * WG + lid] = acc[t];
    }
    workgroupBarrier();
    for (var s = TEAM / 2u; s > 0u; s >>= 1u) {
        if (lane < s) {
            for (var t = 0u; t < TB; t++) {
                partial[t * WG + lid] += partial[t * WG + lid + s];
            }
        }
        workgroupBarrier();
    }
    if (row < P.rows && lane < nt) {
        var y = partial[lane * WG + team * TEAM];
        if (P.has_bias != 0u) {
            y += B[P.bias_row0 + row];
        }
        Y[(t0 + lane) * P.y_stride + P.y_col0 + row] = y;
    }
}
