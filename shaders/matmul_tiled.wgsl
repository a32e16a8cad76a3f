// Matrix-matrix product for prefill batches: Y[t * y_stride + y_col0 + r] = dot(W[r], x_t)
// (+ B[bias_row0 + r]) (+ the Y already there, when `accumulate`: the residual add), W's rows
// starting at byte w_byte0 (packed tensors share a buffer), x_t = X[x_row0 + t], or with an
// RMSNorm (norm_w != NONE) x_t = X[x_row0 + t] * g / rms(X[x_row0 + t]), g = B[norm_w ..]: g is
// applied as the activations are loaded and 1 / rms in the epilogue, from the sum of squares the
// loads accumulate on the way (every workgroup reads its tokens' whole rows anyway).
//
// One workgroup of TR * TT / 16 threads computes a TR rows x TT tokens tile of Y; TR and TT are
// set per pipeline by Rust (kernels.rs, `Tile`: 64 x 64 with 256 threads for large products,
// smaller tiles where a large one would leave the GPU with too few workgroups), and so is the
// tiles' element type `tt` with the blocks per step KB: f32 and 1, or where the device has
// shader-f16 and the model asks for it, f16 and 2. For each step of KT = KB * 32 along the row,
// TR * KB threads each decode one weight block (one row's 32 elements, by the dequant.wgsl
// prelude) into workgroup memory, every thread loads a share of the TT tokens' KT activations,
// and then each thread accumulates a 4 rows x 4 tokens block from two vec4 reads per element
// (4 consecutive rows of W, 4 tokens of X): 16 multiply-adds per two loads. So a row is decoded
// once per TT tokens and an activation read once per TR rows. In f16 the tiles take half the
// memory, so a step covers two blocks (half the barriers, and twice the threads decode), the
// multiply-adds run on packed halves, and each block's 32 products are summed in f16 and then
// added to f32 accumulators: the rounding of f16 sums stays bounded by 32 terms, whatever the
// row length. Both tiles are stored k-major ([k][row or token]), so the stores of the loads and
// the vec4 reads are free of bank conflicts; at most 16 KiB of workgroup memory (WebGPU's
// default limit): 2 * 32 * 64 * 4 bytes in f32, 2 * 64 * 64 * 2 in f16. Elements past the end
// of the row, rows past `rows` and tokens past `n_tok` are zero in the tiles. Grid: (x, y)
// cover the row tiles (x + y * nx), z the token tiles.

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
    accumulate: u32,
    norm_w: u32,
    eps: f32,
}

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read> B: array<f32>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;
@group(0) @binding(4) var<uniform> P: Params;

const NONE: u32 = 0xffffffffu;
const WG: u32 = TR * TT / 16u; // a multiple of TT: each thread loads the activations of one token
const RQ: u32 = TR / 4u; // groups of 4 rows
const TQ: u32 = TT / 4u; // groups of 4 tokens
const KT: u32 = KB * CH; // elements of the row per step

// Ws[k * RQ + i][j]: row 4i + j of the tile at k; Xs[k * TQ + i][j]: token 4i + j at k.
var<workgroup> Ws: array<vec4<tt>, RQ * KT>;
var<workgroup> Xs: array<vec4<tt>, TQ * KT>;

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let r0 = (wg.x + wg.y * nwg.x) * TR;
    let t0 = wg.z * TT;
    let rq = lid % RQ;
    let tq = lid / RQ;
    var acc: array<vec4<f32>, 4>; // acc[j]: token 4 tq + j, rows 4 rq .. 4 rq + 4
    var v: array<f32, 32>;
    var sq = 0.0; // sum of squares of the loaded activations of token lid % TT
    let normed = P.norm_w != NONE;
    let n_steps = (P.cols + KT - 1u) / KT;
    for (var s = 0u; s < n_steps; s++) {
        // Block b of this step of row r of the tile.
        for (var i = lid; i < TR * KB; i += WG) {
            let r = i % TR;
            let b = i / TR;
            let c = s * KB + b;
            let n = min(CH, max(P.cols, c * CH) - c * CH);
            let ok = r0 + r < P.rows && n > 0u;
            if (ok) {
                decode(P.w_byte0 + (r0 + r) * P.row_bytes, c, n, &v);
            }
            for (var j = 0u; j < CH; j++) {
                Ws[(b * CH + j) * RQ + r / 4u][r % 4u] = tt(select(0.0, v[j], ok && j < n));
            }
        }
        // Token-fastest, so consecutive threads store consecutive words.
        for (var i = lid; i < TT * KT; i += WG) {
            let t = i % TT;
            let k = i / TT;
            let col = s * KT + k;
            var x = 0.0;
            if (t0 + t < P.n_tok && col < P.cols) {
                x = X[(P.x_row0 + t0 + t) * P.cols + col];
                sq += x * x;
                if (normed) {
                    x *= B[P.norm_w + col];
                }
            }
            Xs[k * TQ + t / 4u][t % 4u] = tt(x);
        }
        workgroupBarrier();
        for (var b = 0u; b < KB; b++) {
            // This block's sums, in the tiles' type (zeroed by hand: Chromium's SwiftShader
            // did not zero a var declared in the loop on each iteration).
            var part: array<vec4<tt>, 4>;
            part[0] = vec4<tt>(0.0);
            part[1] = vec4<tt>(0.0);
            part[2] = vec4<tt>(0.0);
            part[3] = vec4<tt>(0.0);
            for (var k = b * CH; k < b * CH + CH; k++) {
                let a = Ws[k * RQ + rq];
                let x = Xs[k * TQ + tq];
                part[0] += a * x.x;
                part[1] += a * x.y;
                part[2] += a * x.z;
                part[3] += a * x.w;
            }
            acc[0] += vec4<f32>(part[0]);
            acc[1] += vec4<f32>(part[1]);
            acc[2] += vec4<f32>(part[2]);
            acc[3] += vec4<f32>(part[3]);
        }
        workgroupBarrier();
    }
    // Each of this thread's tokens' 1 / rms: the sum of the partial sums of the threads that
    // loaded it (Ws is free now; `to_tile` keeps an f32 whole in a vec4 of the tiles' type).
    var inv = vec4<f32>(1.0);
    if (normed) {
        Ws[lid] = to_tile(sq);
        workgroupBarrier();
        for (var j = 0u; j < 4u; j++) {
            var s = 0.0;
            for (var i = 4u * tq + j; i < WG; i += TT) {
                s += from_tile(Ws[i]);
            }
            inv[j] = 1.0 / sqrt(s / f32(P.cols) + P.eps);
        }
    }
    for (var j = 0u; j < 4u; j++) {
        let t = t0 + 4u * tq + j;
        if (t >= P.n_tok) {
            continue;
        }
        for (var i = 0u; i < 4u; i++) {
            let row = r0 + 4u * rq + i;
            if (row >= P.rows) {
                continue;
            }
            var y = acc[j][i] * inv[j];
            if (P.has_bias != 0u) {
                y += B[P.bias_row0 + row];
            }
            let at = t * P.y_stride + P.y_col0 + row;
            if (P.accumulate != 0u) {
                y += Y[at];
            }
            Y[at] = y;
        }
    }
}
