// Causal grouped-query attention for a prefill batch, in one pass (flash attention): queries at
// positions pos0 + t (pos0 = STEP[0] + start, read on the GPU from the step buffer) over the KV
// cache of one layer (keys in rows of kv_dim elements of type `kvt`, f32 or f16, the values from
// element v_base on), which already holds every position up to the batch's last (earlier ones
// too: a prefill after a reused prefix, or the second batch of a long prompt).
//
// One workgroup (64 threads) per (tile of QR = 16 query rows, key/value head). The rows are the
// batch's (token, query head) pairs of that key/value head's group, token-major, so the n_head /
// n_head_kv heads that share a key/value head share its tiles, whatever the ratio. The workgroup
// walks the keys in tiles of KT positions, staged in workgroup memory (one buffer: the keys,
// then the values of the same positions), and keeps each row's softmax online: the running max
// m and sum l, rescaling the output by exp(m_old - m_new) when the max grows. Key tiles past the
// last row's position are never loaded (the causal mask by tiles); inside a tile each row masks
// its own positions. The output row is written once, normalised: no merge pass.
//
// Each row belongs to 4 threads (lanes); lane j holds dims [4c, 4c + 4) for c = j, j + 4, ...
// of the row's query (pre-scaled) and output in registers: HV vec4s each, from the head size HD
// (HD4 vec4s; constants Rust puts before this source, HD <= 256), so the registers are sized to
// the model's heads (sized for 256, a 64-wide head's rows spilt out of registers) and the loops
// over them unroll. A score is the sum of the 4 lanes' partial dot
// products (exchanged through `part`). KT = min(32, 384 / ceil(head_dim / 4)): the tile is at
// most 6 KiB, so the kernel needs under 16 KiB of workgroup memory (WebGPU's default limit).

struct Params {
    n_head: u32,
    n_head_kv: u32,
    head_dim: u32,
    start: u32,
    scale: f32,
    v_base: u32,
    n_tok: u32,
}

@group(0) @binding(0) var<storage, read> Q: array<f32>;
@group(0) @binding(1) var<storage, read> KV: array<kvt>;
@group(0) @binding(2) var<storage, read> STEP: array<u32>;
@group(0) @binding(3) var<storage, read_write> O: array<f32>;
@group(0) @binding(4) var<uniform> P: Params;

const QR: u32 = 16u; // query rows per workgroup
const LANES: u32 = 4u; // threads per row
const KT_MAX: u32 = 32u; // most keys per tile
const TILE_VEC4: u32 = 384u; // the key/value tile: KT * ceil(head_dim / 4) vec4s at most

var<workgroup> kvs: array<vec4<f32>, 384>;
// Partial dot products: row r, lane j, key k at (r * LANES + j) * KT_MAX + k. After the sum, the
// row's score (then its probability) of key k sits in lane 0's slot.
var<workgroup> part: array<f32, 2048>; // QR * LANES * KT_MAX
var<workgroup> row_max: array<f32, 64>; // QR * LANES

// Load KT positions from p0 (keys, or values with base = v_base) into kvs; elements past the head
// or past `end` are zero.
fn load_tile(base: u32, p0: u32, end: u32, kt: u32, hd4: u32, kvh: u32, lid: u32) {
    let hd = HD;
    let kv_dim = P.n_head_kv * hd;
    for (var i = lid; i < kt * hd4; i += 64u) {
        let k = i / hd4;
        let d = (i % hd4) * 4u;
        let p = p0 + k;
        var v = vec4<f32>(0.0);
        if (p < end) {
            let at = base + p * kv_dim + kvh * hd + d;
            for (var j = 0u; j < 4u; j++) {
                if (d + j < hd) {
                    v[j] = f32(KV[at + j]);
                }
            }
        }
        kvs[i] = v;
    }
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let hd = HD;
    let hd4 = HD4;
    let kt = min(KT_MAX, TILE_VEC4 / hd4);
    let group = P.n_head / P.n_head_kv;
    let kvh = wg.y;
    let n_rows = P.n_tok * group;
    let pos0 = STEP[0] + P.start;

    let r = lid / LANES;
    let lane = lid % LANES;
    let row = wg.x * QR + r;
    let valid = row < n_rows;
    let t = row / group;
    let h = kvh * group + row % group;
    // Positions this row sees (0 for a padding row: it masks everything and writes nothing).
    let seen = select(0u, pos0 + t + 1u, valid);
    // Positions the tile's last row sees: the keys the workgroup loads.
    let last = min(wg.x * QR + QR, n_rows) - 1u;
    let end = pos0 + last / group + 1u;

    let qb = (t * P.n_head + h) * hd;
    var q: array<vec4<f32>, HV>;
    var acc: array<vec4<f32>, HV>;
    for (var i = 0u; i < HV; i++) {
        let d = (lane + i * LANES) * 4u;
        var v = vec4<f32>(0.0);
        for (var j = 0u; j < 4u; j++) {
            if (valid && d + j < hd) {
                v[j] = Q[qb + d + j] * P.scale;
            }
        }
        q[i] = v;
        acc[i] = vec4<f32>(0.0);
    }
    var m = -3.0e38;
    var l = 0.0; // this lane's share of the row's sum of exponentials

    let pr = r * LANES * KT_MAX;
    for (var p0 = 0u; p0 < end; p0 += kt) {
        load_tile(0u, p0, end, kt, hd4, kvh, lid);
        workgroupBarrier();
        // This lane's part of every key's score.
        for (var k = 0u; k < kt; k++) {
            var s = 0.0;
            for (var i = 0u; i < HV; i++) {
                let c = lane + i * LANES;
                if (c < hd4) {
                    s += dot(q[i], kvs[k * hd4 + c]);
                }
            }
            part[(r * LANES + lane) * KT_MAX + k] = s;
        }
        workgroupBarrier();
        // The keys are read: the values take their place while the scores are summed.
        load_tile(P.v_base, p0, end, kt, hd4, kvh, lid);
        var mx = -3.0e38;
        for (var k = lane; k < kt; k += LANES) {
            var s = 0.0;
            for (var j = 0u; j < LANES; j++) {
                s += part[pr + j * KT_MAX + k];
            }
            part[pr + k] = s;
            if (p0 + k < seen) {
                mx = max(mx, s);
            }
        }
        row_max[lid] = mx;
        workgroupBarrier();
        let base = r * LANES;
        let m_new = max(max(m, max(row_max[base], row_max[base + 1u])),
                        max(row_max[base + 2u], row_max[base + 3u]));
        let alpha = exp(m - m_new);
        m = m_new;
        l *= alpha;
        for (var k = lane; k < kt; k += LANES) {
            var e = 0.0;
            if (p0 + k < seen) {
                e = exp(part[pr + k] - m_new);
            }
            part[pr + k] = e;
            l += e;
        }
        workgroupBarrier();
        for (var i = 0u; i < HV; i++) {
            acc[i] *= alpha;
        }
        for (var k = 0u; k < kt; k++) {
            let e = part[pr + k];
            for (var i = 0u; i < HV; i++) {
                let c = lane + i * LANES;
                if (c < hd4) {
                    acc[i] += e * kvs[k * hd4 + c];
                }
            }
        }
        workgroupBarrier();
    }

    // The row's sum: the four lanes' shares.
    row_max[lid] = l;
    workgroupBarrier();
    let base = r * LANES;
    let total = row_max[base] + row_max[base + 1u] + row_max[base + 2u] + row_max[base + 3u];
    if (!valid) {
        return;
    }
    for (var i = 0u; i < HV; i++) {
        let d = (lane + i * LANES) * 4u;
        for (var j = 0u; j < 4u; j++) {
            if (d + j < hd) {
                O[qb + d + j] = acc[i][j] / total;
            }
        }
    }
}
