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
// and then each thread accumulates a 4 rows x 4 tokens block of Y: per pair of elements along
// the row, four vec2 reads of W (4 consecutive rows) and four of X (4 tokens), 32 multiply-adds.
// So a row is decoded once per TT tokens and an activation read once per TR rows. In f16 the
// tiles take half the memory, so a step covers two blocks (half the barriers, and twice the
// threads decode), the multiply-adds run on packed halves, and each block's 32 products are
// summed in f16 and then added to f32 accumulators: the rounding of f16 sums stays bounded by 32
// terms, whatever the row length.
//
// Both tiles hold pairs of consecutive elements of one row (a vec2: 8 bytes in f32, one 32-bit
// word in f16), pair-major ([pair][row or token]): each thread writes whole pairs of its own row
// or token, so no two threads ever write halves of one word (a WebGPU implementation may store
// an f16 by rewriting its whole word), consecutive threads write consecutive pairs, and the reads
// of 4 consecutive rows or tokens are contiguous. At most 16 KiB of workgroup memory (WebGPU's
// default limit): 2 * 64 * 16 * 8 bytes in f32, 2 * 64 * 32 * 4 in f16. Elements past the end of
// the row, rows past `rows` and tokens past `n_tok` are zero in the tiles. Grid: (x, y) cover the
// row tiles (x + y * nx), z the token tiles.

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
const KT: u32 = KB * CH; // elements of the row per step
const KP: u32 = KT / 2u; // pairs of elements per step

// Ws[p * TR + r]: elements 2p, 2p + 1 of the step for row r of the tile; Xs[p * TT + t]: the
// same for token t.
var<workgroup> Ws: array<vec2<tt>, KP * TR>;
var<workgroup> Xs: array<vec2<tt>, KP * TT>;

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
            for (var j = 0u; j < CH; j += 2u) {
                let w0 = select(0.0, v[j], ok && j < n);
                let w1 = select(0.0, v[j + 1u], ok && j + 1u < n);
                Ws[(b * CH + j) / 2u * TR + r] = vec2<tt>(tt(w0), tt(w1));
            }
        }
        // Token-fastest, so consecutive threads store consecutive pairs.
        for (var i = lid; i < TT * KP; i += WG) {
            let t = i % TT;
            let col = s * KT + 2u * (i / TT);
            var x = vec2<f32>(0.0);
            var g = vec2<f32>(1.0);
            if (t0 + t < P.n_tok) {
                let at = (P.x_row0 + t0 + t) * P.cols + col;
                if (col < P.cols) {
                    x.x = X[at];
                    if (normed) {
                        g.x = B[P.norm_w + col];
                    }
                }
                if (col + 1u < P.cols) {
                    x.y = X[at + 1u];
                    if (normed) {
                        g.y = B[P.norm_w + col + 1u];
                    }
                }
                sq += dot(x, x);
            }
            Xs[i] = vec2<tt>(x * g);
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
            for (var p = b * CH / 2u; p < (b + 1u) * CH / 2u; p++) {
                let w = p * TR + 4u * rq;
                let a0 = Ws[w];
                let a1 = Ws[w + 1u];
                let a2 = Ws[w + 2u];
                let a3 = Ws[w + 3u];
                // The 4 rows' first and second elements of the pair.
                let lo = vec4<tt>(a0.x, a1.x, a2.x, a3.x);
                let hi = vec4<tt>(a0.y, a1.y, a2.y, a3.y);
                let x = p * TT + 4u * tq;
                let x0 = Xs[x];
                let x1 = Xs[x + 1u];
                let x2 = Xs[x + 2u];
                let x3 = Xs[x + 3u];
                part[0] += lo * x0.x + hi * x0.y;
                part[1] += lo * x1.x + hi * x1.y;
                part[2] += lo * x2.x + hi * x2.y;
                part[3] += lo * x3.x + hi * x3.y;
            }
            acc[0] += vec4<f32>(part[0]);
            acc[1] += vec4<f32>(part[1]);
            acc[2] += vec4<f32>(part[2]);
            acc[3] += vec4<f32>(part[3]);
        }
        workgroupBarrier();
    }
    // Each of this thread's tokens' 1 / rms: the sum of the partial sums of the threads that
    // loaded it (kept in Ws, free now, by `put_sum`).
    var inv = vec4<f32>(1.0);
    if (normed) {
        put_sum(lid, sq);
        workgroupBarrier();
        for (var j = 0u; j < 4u; j++) {
            var s = 0.0;
            for (var i = 4u * tq + j; i < WG; i += TT) {
                s += get_sum(i);
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
