// Embedding lookup from a weight matrix of any type: Y[t] = (accumulate ? Y[t] : 0) + W[row],
// where row is the token id IDS[id0 + t] or, for learned positions, IDS[0] + pos_off + t (IDS is
// the step buffer [pos, n, _, _, ids...], so the position comes from the GPU). W may be one
// row-range [row0, row0 + rows) of a tensor split across buffers; other rows are skipped.
// One workgroup per token; its threads split the row's chunks.

struct Params {
    n_tok: u32,
    cols: u32,
    row_bytes: u32,
    row0: u32,
    rows: u32,
    use_pos: u32,
    pos_off: u32,
    id0: u32,
    accumulate: u32,
}

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> IDS: array<u32>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;

const WG: u32 = 64u;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wg.x;
    if (t >= P.n_tok) {
        return;
    }
    let id = IDS[P.id0 + t];
    let r = select(id, IDS[0] + P.pos_off + t, P.use_pos != 0u);
    if (r < P.row0 || r >= P.row0 + P.rows) {
        return;
    }
    let rb = (r - P.row0) * P.row_bytes;
    var v: array<f32, 32>;
    let n_chunks = (P.cols + CH - 1u) / CH;
    for (var c = lid; c < n_chunks; c += WG) {
        let n = min(CH, P.cols - c * CH);
        decode(rb, c, n, &v);
        for (var i = 0u; i < n; i++) {
            let idx = t * P.cols + c * CH + i;
            var y = v[i];
            if (P.accumulate != 0u) {
                y = Y[idx] + v[i];
            }
            Y[idx] = y;
        }
    }
}
