// Decode-step products with their neighbours fused in. For up to TB = 8 tokens:
//
//     Y = epilogue(W · norm(X) + bias)
//
// norm: none, RMSNorm or LayerNorm of each token's row of X, computed by every workgroup from X
// itself (so normed activations never go through memory and the norm costs no dispatch). The
// epilogue is one of:
//   STORE  Y[t][col0 + r] = y
//   ADD    Y[t][col0 + r] += y            the residual add after the output and down projections
//   GATED  Y[t][col0 + j] = silu(g_j) * u_j   W holds the gate rows, and the up rows from up_row
//   GELU   Y[t][col0 + r] = gelu(y)
//   QKV    rows of q|k|v: RoPE on q and k, q to Y, k and v into the KV cache at the token's position
//
// W is a weight matrix in its GGUF encoding (decoded by the dequant.wgsl prelude); its rows start
// at byte w_byte0 (packed tensors share a buffer). VEC holds the model's small vectors (norm
// weights and biases, projection biases) at the offsets in Params. A workgroup of WG = 64
// threads computes RPW = 4 rows (small workgroups: many of them for small matrices, and cheap
// barriers where a GPU is emulated on the CPU): a team of TEAM = 16 threads per row splits the row's chunks of
// 32 and the team's sums are reduced in workgroup memory. Loops over chunk elements and tokens
// have constant bounds, so the private arrays stay in registers. Grid: (x, y) cover the groups of
// rows (x + y * nx).
//
// The activations are staged in workgroup memory, normed, in slabs of up to XS floats (all of a
// row at once for one token up to 2048 wide): each is read from memory once per workgroup, the
// norm's weight and bias applied once, and the products' inner loop reads only workgroup memory
// besides the weights, 4 floats per load (scalar reads of workgroup memory made the kernel twice
// as slow on lavapipe as reading X itself). Where a token's whole row fits, the norm's statistics come from the staged
// copy too; otherwise from X before the first slab.
//
// QKV: a workgroup's rows are taken in an order that puts both members of each RoPE pair in
// adjacent slots (for the half-split layout, pair i of a head is rows i and i + rope_dims / 2), so
// the rotation happens in the epilogue. The dispatch covers whole heads (row0 is a multiple of
// head_dim). Positions come from the step buffer: token t is at STEP[0] + start + t.

struct Params {
    rows: u32,
    cols: u32,
    n_tok: u32,
    row_bytes: u32,
    w_byte0: u32,
    x_row0: u32,
    norm: u32,
    eps: f32,
    norm_w: u32,
    norm_b: u32,
    bias: u32,
    epilogue: u32,
    y_stride: u32,
    y_col0: u32,
    up_row: u32,
    row0: u32,
    q_dim: u32,
    kv_dim: u32,
    head_dim: u32,
    rope_dims: u32,
    rope_mode: u32,
    start: u32,
    v_base: u32,
}

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read> VEC: array<f32>;
@group(0) @binding(3) var<storage, read> CS: array<vec2<f32>>;
@group(0) @binding(4) var<storage, read> STEP: array<u32>;
@group(0) @binding(5) var<storage, read_write> Y: array<f32>;
@group(0) @binding(6) var<storage, read_write> KV: array<kvt>;
@group(0) @binding(7) var<uniform> P: Params;

const WG: u32 = 64u;
const TB: u32 = 8u;
const TEAM: u32 = 16u;
const RPW: u32 = 4u; // WG / TEAM
const NONE: u32 = 0xffffffffu;

const NORM_RMS: u32 = 1u;
const NORM_LAYER: u32 = 2u;

const STORE: u32 = 0u;
const ADD: u32 = 1u;
const GATED: u32 = 2u;
const GELU: u32 = 3u;
const QKV: u32 = 4u;

const XS: u32 = 2048u;

// A slab of the normed activations, token-major, each token's part padded with zeros to whole
// chunks (so a chunk reads 8 vec4s, none past its token's part).
var<workgroup> xs: array<vec4<f32>, 512>; // XS / 4
var<workgroup> red: array<f32, 512>; // TB * WG
var<workgroup> stat: array<f32, 16>; // per token: mean, 1 / standard deviation
var<workgroup> sums: array<f32, 32>; // TB * RPW

// Sum red[t * WG + 0..WG] into red[t * WG] for the nt tokens (workgroup memory may be indexed
// by a loop bound that is not constant; private arrays may not, or they spill).
fn reduce_all(lid: u32, nt: u32) {
    workgroupBarrier();
    for (var k = WG / 2u; k > 0u; k >>= 1u) {
        if (lid < k) {
            for (var t = 0u; t < nt; t++) {
                red[t * WG + lid] += red[t * WG + lid + k];
            }
        }
        workgroupBarrier();
    }
}

fn xs_get(j: u32) -> f32 {
    return xs[j >> 2u][j & 3u];
}

fn xs_set(j: u32, x: f32) {
    xs[j >> 2u][j & 3u] = x;
}

// Element i of token t's row: from the staged slab (a token every `stride`) when it holds the
// whole row, else from X.
fn x_at(t: u32, i: u32, staged: bool, stride: u32) -> f32 {
    if (staged) {
        return xs_get(t * stride + i);
    }
    return X[(P.x_row0 + t) * P.cols + i];
}

// Per token: the mean (LayerNorm; 0 for RMSNorm) and 1 / sqrt(variance + eps).
fn norm_stats(lid: u32, nt: u32, staged: bool, stride: u32) {
    let n = f32(P.cols);
    if (P.norm == NORM_LAYER) {
        for (var t = 0u; t < TB; t++) {
            var s = 0.0;
            if (t < nt) {
                for (var i = lid; i < P.cols; i += WG) {
                    s += x_at(t, i, staged, stride);
                }
            }
            red[t * WG + lid] = s;
        }
        reduce_all(lid, nt);
        if (lid < TB) {
            stat[2u * lid] = red[lid * WG] / n;
        }
        workgroupBarrier();
    } else if (lid < TB) {
        stat[2u * lid] = 0.0;
    }
    workgroupBarrier();
    for (var t = 0u; t < TB; t++) {
        var s = 0.0;
        if (t < nt) {
            let mean = stat[2u * t];
            for (var i = lid; i < P.cols; i += WG) {
                let d = x_at(t, i, staged, stride) - mean;
                s += d * d;
            }
        }
        red[t * WG + lid] = s;
    }
    reduce_all(lid, nt);
    if (lid < TB) {
        stat[2u * lid + 1u] = 1.0 / sqrt(red[lid * WG] / n + P.eps);
    }
    workgroupBarrier();
}

// Where a q|k|v row goes: 0 q, 1 k, 2 v, and the row's first element of its section.
fn section(row: u32) -> vec2<u32> {
    if (row < P.q_dim) {
        return vec2<u32>(0u, 0u);
    }
    if (row < P.q_dim + P.kv_dim) {
        return vec2<u32>(1u, P.q_dim);
    }
    return vec2<u32>(2u, P.q_dim + P.kv_dim);
}

// Whether the element at index j of a head in section `sec` is rotated.
fn rotated(sec: u32, j: u32) -> bool {
    return P.rope_mode != 0u && sec < 2u && j < P.rope_dims;
}

// The q|k|v row computed in logical slot `l` (pairs of a rotation in adjacent slots).
fn qkv_row(l: u32) -> u32 {
    let sec = section(l);
    let j = (l - sec.y) % P.head_dim;
    if (P.rope_mode == 2u && rotated(sec.x, j)) {
        return l - j + j / 2u + (j % 2u) * (P.rope_dims / 2u);
    }
    return l;
}

fn gelu(x: f32) -> f32 {
    let u = clamp(0.7978846 * (x + 0.044715 * x * x * x), -15.0, 15.0);
    return 0.5 * x * (1.0 + tanh(u));
}

fn bias_at(r: u32) -> f32 {
    if (P.bias == NONE) {
        return 0.0;
    }
    return VEC[P.bias + r];
}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let nt = min(TB, P.n_tok);
    let g = wg.x + wg.y * nwg.x;
    let team = lid / TEAM;
    let lane = lid % TEAM;

    // The weight row this team multiplies.
    var w_row = g * RPW + team;
    var live = w_row < P.rows;
    if (P.epilogue == GATED) {
        let j = g * (RPW / 2u) + team % (RPW / 2u);
        live = j < P.rows;
        w_row = select(j, P.up_row + j, team >= RPW / 2u);
    } else if (P.epilogue == QKV && live) {
        w_row = qkv_row(P.row0 + w_row) - P.row0;
    }

    // Tokens' elements per slab: whole chunks, nt slabs in XS.
    let slab = XS / nt / CH * CH;
    let whole = P.cols <= slab;
    if (P.norm != 0u && !whole) {
        norm_stats(lid, nt, false, 0u);
    }
    let rb = P.w_byte0 + w_row * P.row_bytes;
    var acc: array<f32, 8>;
    for (var s0 = 0u; s0 < P.cols; s0 += slab) {
        let len = min(slab, P.cols - s0);
        let stride = (len + CH - 1u) / CH * CH;
        for (var t = 0u; t < TB; t++) {
            if (t < nt) {
                let xb = (P.x_row0 + t) * P.cols + s0;
                for (var i = lid; i < stride; i += WG) {
                    var x = 0.0;
                    if (i < len) {
                        x = X[xb + i];
                    }
                    xs_set(t * stride + i, x);
                }
            }
        }
        workgroupBarrier();
        // Each thread norms the elements it staged.
        if (P.norm != 0u) {
            if (whole) {
                norm_stats(lid, nt, true, stride);
            }
            for (var t = 0u; t < TB; t++) {
                if (t < nt) {
                    let mean = stat[2u * t];
                    let rstd = stat[2u * t + 1u];
                    for (var i = lid; i < len; i += WG) {
                        var x = (xs_get(t * stride + i) - mean) * rstd * VEC[P.norm_w + s0 + i];
                        if (P.norm == NORM_LAYER) {
                            x += VEC[P.norm_b + s0 + i];
                        }
                        xs_set(t * stride + i, x);
                    }
                }
            }
            workgroupBarrier();
        }
        if (live) {
            let c_end = (s0 + len + CH - 1u) / CH;
            for (var c = s0 / CH + lane; c < c_end; c += TEAM) {
                let n = min(CH, P.cols - c * CH);
                let x0 = c * CH - s0;
                // Zeros past n (a var starts zeroed), as in the slab's padding.
                var v: array<f32, 32>;
                decode(rb, c, n, &v);
                for (var t = 0u; t < TB; t++) {
                    if (t < nt) {
                        let q = (t * stride + x0) / 4u;
                        var s = 0.0;
                        for (var k = 0u; k < CH / 4u; k++) {
                            let x = xs[q + k];
                            s += v[4u * k] * x.x + v[4u * k + 1u] * x.y + v[4u * k + 2u] * x.z
                                + v[4u * k + 3u] * x.w;
                        }
                        acc[t] += s;
                    }
                }
            }
        }
        workgroupBarrier();
    }

    for (var t = 0u; t < TB; t++) {
        red[t * WG + lid] = acc[t];
    }
    workgroupBarrier();
    for (var s = TEAM / 2u; s > 0u; s >>= 1u) {
        if (lane < s) {
            for (var t = 0u; t < nt; t++) {
                red[t * WG + lid] += red[t * WG + lid + s];
            }
        }
        workgroupBarrier();
    }
    if (lid < TB * RPW) {
        sums[lid] = red[(lid / RPW) * WG + (lid % RPW) * TEAM];
    }
    workgroupBarrier();

    if (lid >= TB * RPW) {
        return;
    }
    let t = lid / RPW;
    let slot = lid % RPW;
    if (t >= nt) {
        return;
    }
    let out = t * P.y_stride + P.y_col0;
    switch P.epilogue {
        case GATED: {
            let j = g * (RPW / 2u) + slot;
            if (slot < RPW / 2u && j < P.rows) {
                let gate = sums[t * RPW + slot];
                let up = sums[t * RPW + slot + RPW / 2u];
                Y[out + j] = up * (gate / (1.0 + exp(-gate)));
            }
        }
        case QKV: {
            let l = g * RPW + slot;
            if (l >= P.rows) {
                return;
            }
            let abs_row = P.row0 + l;
            let sec = section(abs_row);
            let j = (abs_row - sec.y) % P.head_dim;
            let row = qkv_row(abs_row);
            var y = sums[t * RPW + slot] + bias_at(row - P.row0);
            let pos = STEP[0] + P.start + t;
            if (rotated(sec.x, j)) {
                // Members 0 and 1 of the pair sit in slots s0 and s0 + 1.
                let s0 = slot & ~1u;
                let a = sums[t * RPW + s0] + bias_at(qkv_row(abs_row & ~1u) - P.row0);
                let b = sums[t * RPW + s0 + 1u] + bias_at(qkv_row(abs_row | 1u) - P.row0);
                let cs = CS[pos * (P.rope_dims / 2u) + j / 2u];
                y = select(a * cs.y + b * cs.x, a * cs.x - b * cs.y, (j & 1u) == 0u);
            }
            switch sec.x {
                case 0u: {
                    Y[t * P.y_stride + row] = y;
                }
                case 1u: {
                    KV[pos * P.kv_dim + row - sec.y] = kvt(y);
                }
                default: {
                    KV[P.v_base + pos * P.kv_dim + row - sec.y] = kvt(y);
                }
            }
        }
        default: {
            let r = g * RPW + slot;
            if (r >= P.rows) {
                return;
            }
            let y = sums[t * RPW + slot] + bias_at(r);
            if (P.epilogue == ADD) {
                Y[out + r] += y;
            } else if (P.epilogue == GELU) {
                Y[out + r] = gelu(y);
            } else {
                Y[out + r] = y;
            }
        }
    }
}
