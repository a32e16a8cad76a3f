// Tiled matrix-matrix product for prefill: Y[t][y_col0 + r] = dot(W[r], X[x_row0 + t])
// (+ B[bias_row0 + r]), W's rows starting at byte w_byte0 (packed tensors share a buffer).
//
// One workgroup (64 threads) computes a TR x TT = 32 rows x 32 tokens tile of Y. For each chunk
// of CH = 32 along the row, threads 0..32 each decode one weight row's chunk (one block, by the
// dequant.wgsl prelude) into workgroup memory and threads 32..64 each load one token's 32
// activations; then every thread accumulates a 4 x 4 sub-tile (rows tr + 8i, tokens tt + 8j).
// So a row is decoded once per 32 tokens and an activation read once per 32 rows. Elements past
// the end of the row, rows past `rows` and tokens past `n_tok` are zero in the tiles.
// Grid: (x, y) cover the row tiles (x + y * nx), z the token tiles.

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
    w_byte0: u32,
}

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read> B: array<f32>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;
@group(0) @binding(4) var<uniform> P: Params;

const TR: u32 = 32u;
const TT: u32 = 32u;
const LD: u32 = 33u; // padded leading dimension of the tiles

var<workgroup> Ws: array<f32, 1056>; // TR * LD
var<workgroup> Xs: array<f32, 1056>; // TT * LD

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let r0 = (wg.x + wg.y * nwg.x) * TR;
    let t0 = wg.z * TT;
    let tr = lid % 8u;
    let tt = lid / 8u;
    var acc: array<f32, 16>;
    var v: array<f32, 32>;
    let n_chunks = (P.cols + CH - 1u) / CH;
    for (var c = 0u; c < n_chunks; c++) {
        let n = min(CH, P.cols - c * CH);
        if (lid < TR) {
            let row = r0 + lid;
            if (row < P.rows) {
                decode(P.w_byte0 + row * P.row_bytes, c, n, &v);
                for (var i = 0u; i < CH; i++) {
                    Ws[lid * LD + i] = select(0.0, v[i], i < n);
                }
            } else {
                for (var i = 0u; i < CH; i++) {
                    Ws[lid * LD + i] = 0.0;
                }
            }
        } else {
            let t = lid - TR;
            let ok = t0 + t < P.n_tok;
            let xb = (P.x_row0 + t0 + t) * P.cols + c * CH;
            for (var i = 0u; i < CH; i++) {
                var x = 0.0;
                if (ok && i < n) {
                    x = X[xb + i];
                }
                Xs[t * LD + i] = x;
            }
        }
        workgroupBarrier();
        for (var k = 0u; k < CH; k++) {
            var a: array<f32, 4>;
            var b: array<f32, 4>;
            for (var i = 0u; i < 4u; i++) {
                a[i] = Ws[(tr + 8u * i) * LD + k];
                b[i] = Xs[(tt + 8u * i) * LD + k];
            }
            for (var i = 0u; i < 4u; i++) {
                for (var j = 0u; j < 4u; j++) {
                    acc[i * 4u + j] += a[i] * b[j];
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let row = r0 + tr + 8u * i;
        if (row >= P.rows) {
            continue;
        }
        var bias = 0.0;
        if (P.has_bias != 0u) {
            bias = B[P.bias_row0 + row];
        }
        for (var j = 0u; j < 4u; j++) {
            let t = t0 + tt + 8u * j;
            if (t < P.n_tok) {
                Y[t * P.y_stride + P.y_col0 + row] = acc[i * 4u + j] + bias;
            }
        }
    }
}
