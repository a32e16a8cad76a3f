// Decode-step products with their neighbours fused in. For up to TB tokens (a constant Rust puts
// before this source: 1 for a decode step, so no register or loop is spent on tokens that are not
// there, or 8):
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
// weights and biases, projection biases) at the offsets in Params. A workgroup of WG = 256
// threads computes R = WG / team rows: a team of `team` threads per row (a power of two, 8 to
// 128, Rust's choice: `dispatch::matvec_team`) splits the row's chunks of 32, and the team's sums are
// reduced in workgroup memory. Rows per workgroup trade the work each workgroup repeats
// (staging and norming the activations) against the chain of loads each thread waits on; on a
// real GPU both, not the weight bytes, are what these products cost. Loops over chunk elements
// and tokens have constant bounds, so the private arrays stay in registers (the loops unroll:
// kernels.rs turns off naga's loop bounding, which stopped NVIDIA's compiler from unrolling
// them). Grid: (x, y) cover the groups of rows (x + y * nx).
//
// The activations are staged in workgroup memory, normed, in slabs of up to XS floats (all of a
// row at once for one token up to 2048 wide): each is read from memory once per workgroup, the
// norm's weight and bias applied once, and the products' inner loop reads only workgroup memory
// besides the weights, 4 floats per load. Where a token's whole row fits, the norm's statistics
// come from the staged copy too; otherwise from X before the first slab. After the products the
// slab's memory holds the threads' sums for the teams' reduction.
//
// QKV: a workgroup's rows are taken in an order that puts both members of each RoPE pair in
// adjacent slots (for the half-split layout, pair i of a head is rows i and i + rope_dims / 2), so
// the rotation happens in the epilogue (R is even, so no pair straddles two workgroups).
// Positions come from the step buffer: token t is at STEP[0] + start + t.

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
    team: u32,
}

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read> VEC: array<f32>;
@group(0) @binding(3) var<storage, read> CS: array<vec2<f32>>;
@group(0) @binding(4) var<storage, read> STEP: array<u32>;
@group(0) @binding(5) var<storage, read_write> Y: array<f32>;
@group(0) @binding(6) var<storage, read_write> KV: array<kvt>;
@group(0) @binding(7) var<uniform> P: Params;

const WG: u32 = 256u;
const NONE: u32 = 0xffffffffu;

const NORM_RMS: u32 = 1u;
const NORM_LAYER: u32 = 2u;

const STORE: u32 = 0u;
const ADD: u32 = 1u;
const GATED: u32 = 2u;
const GELU: u32 = 3u;
const QKV: u32 = 4u;

const XS: u32 = 2048u; // >= TB * WG: the slab, then every thread's sum for every token

// A slab of the normed activations, token-major, each token's part padded with zeros to whole
// chunks (so a chunk reads 8 vec4s, none past its token's part); after the products, the threads'
// sums (token t, thread i at t * WG + i).
var<workgroup> xs: array<vec4<f32>, 512>; // XS / 4
var<workgroup> red: array<f32, TB * WG / 2u>;
var<workgroup> stat: array<f32, 2u * TB>; // per token: mean, 1 / standard deviation

// Sum every thread's v[t] over the workgroup for the nt tokens: the totals in red[t * WG / 2].
// Workgroup memory may be indexed by a loop bound that is not constant; private arrays may not,
// or they spill.
fn sum_tokens(lid: u32, nt: u32, v: ptr<function, array<f32, TB>>) {
    let half = WG / 2u;
    if (lid < half) {
        for (var t = 0u; t < TB; t++) {
            if (t < nt) {
                red[t * half + lid] = (*v)[t];
            }
        }
    }
    workgroupBarrier();
    if (lid >= half) {
        for (var t = 0u; t < TB; t++) {
            if (t < nt) {
                red[t * half + lid - half] += (*v)[t];
            }
        }
    }
    workgroupBarrier();
    for (var k = half / 2u; k > 0u; k >>= 1u) {
        if (lid < k) {
            for (var t = 0u; t < nt; t++) {
                red[t * half + lid] += red[t * half + lid + k];
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
    let half = WG / 2u;
    if (P.norm == NORM_LAYER) {
        var s: array<f32, TB>;
        for (var t = 0u; t < TB; t++) {
            if (t < nt) {
                for (var i = lid; i < P.cols; i += WG) {
                    s[t] += x_at(t, i, staged, stride);
                }
            }
        }
        sum_tokens(lid, nt, &s);
        if (lid < TB) {
            stat[2u * lid] = red[lid * half] / n;
        }
        workgroupBarrier();
    } else if (lid < TB) {
        stat[2u * lid] = 0.0;
    }
    workgroupBarrier();
    var s: array<f32, TB>;
    for (var t = 0u; t < TB; t++) {
        if (t < nt) {
            let mean = stat[2u * t];
            for (var i = lid; i < P.cols; i += WG) {
                let d = x_at(t, i, staged, stride) - mean;
                s[t] += d * d;
            }
        }
    }
    sum_tokens(lid, nt, &s);
    if (lid < TB) {
        stat[2u * lid + 1u] = 1.0 / sqrt(red[lid * half] / n + P.eps);
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

// Token t's product with the row in slot `slot`: its team's reduced sum.
fn row_sum(t: u32, slot: u32) -> f32 {
    return xs_get(t * WG + slot * P.team);
}

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let nt = min(TB, P.n_tok);
    let g = wg.x + wg.y * nwg.x;
    // Rust's choice (a power of two, 8..128), clamped so no loop below can step by zero.
    let team_size = clamp(P.team, 8u, 128u);
    let rpw = WG / team_size;
    let team = lid / team_size;
    let lane = lid % team_size;

    // The weight row this team multiplies.
    var w_row = g * rpw + team;
    var live = w_row < P.rows;
    if (P.epilogue == GATED) {
        let j = g * (rpw / 2u) + team % (rpw / 2u);
        live = j < P.rows;
        w_row = select(j, P.up_row + j, team >= rpw / 2u);
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
    var acc: array<f32, TB>;
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
            for (var c = s0 / CH + lane; c < c_end; c += team_size) {
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

    // The teams' sums, in the slab's memory (the last barrier above ended its reads).
    for (var t = 0u; t < TB; t++) {
        if (t < nt) {
            xs_set(t * WG + lid, acc[t]);
        }
    }
    workgroupBarrier();
    for (var s = team_size / 2u; s > 0u; s >>= 1u) {
        if (lane < s) {
            for (var t = 0u; t < nt; t++) {
                xs_set(t * WG + lid, xs_get(t * WG + lid) + xs_get(t * WG + lid + s));
            }
        }
        workgroupBarrier();
    }

    // One thread per (token, row): rpw * nt <= WG since team_size >= 8.
    if (lid >= rpw * nt) {
        return;
    }
    let t = lid / rpw;
    let slot = lid % rpw;
    let out = t * P.y_stride + P.y_col0;
    switch P.epilogue {
        case GATED: {
            let j = g * (rpw / 2u) + slot;
            if (slot < rpw / 2u && j < P.rows) {
                let gate = row_sum(t, slot);
                let up = row_sum(t, slot + rpw / 2u);
                Y[out + j] = up * (gate / (1.0 + exp(-gate)));
            }
        }
        case QKV: {
            let l = g * rpw + slot;
            if (l >= P.rows) {
                return;
            }
            let abs_row = P.row0 + l;
            let sec = section(abs_row);
            let j = (abs_row - sec.y) % P.head_dim;
            let row = qkv_row(abs_row);
            var y = row_sum(t, slot) + bias_at(row - P.row0);
            let pos = STEP[0] + P.start + t;
            if (rotated(sec.x, j)) {
                // Members 0 and 1 of the pair sit in slots s0 and s0 + 1.
                let s0 = slot & ~1u;
                let a = row_sum(t, s0) + bias_at(qkv_row(abs_row & ~1u) - P.row0);
                let b = row_sum(t, s0 + 1u) + bias_at(qkv_row(abs_row | 1u) - P.row0);
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
            let r = g * rpw + slot;
            if (r >= P.rows) {
                return;
            }
            let y = row_sum(t, slot) + bias_at(r);
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
