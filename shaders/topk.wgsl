// Shared by topk_partial.wgsl and topk_merge.wgsl: selection of the best (value, index) pair in
// a workgroup. The order is "larger value first, then smaller index" (a stable descending sort),
// so ties come out as the CPU's stable sort has them. Round r of a top-k picks the best pair
// strictly after round r - 1's pick in that order: k rounds, no per-thread lists. NaN is never
// picked (every comparison with it is false).

const WG: u32 = 256u;
const NONE: u32 = 0xffffffffu;
var<workgroup> rv: array<f32, 256>;
var<workgroup> ri: array<u32, 256>;

// Whether (v, i) (i != NONE) comes before the current best (bv, bi) (bi == NONE: no best yet).
fn before(v: f32, i: u32, bv: f32, bi: u32) -> bool {
    return i != NONE && (bi == NONE || v > bv || (v == bv && i < bi));
}

// Whether (v, i) comes strictly after the previous pick (pv, pi) (first: there is none yet;
// pi == NONE otherwise: the previous round found nothing, so neither can this one).
fn after(v: f32, i: u32, pv: f32, pi: u32, first: bool) -> bool {
    return first || (pi != NONE && (v < pv || (v == pv && i > pi)));
}

// The workgroup's best of every thread's (v, i), as (bits of v, i); every thread gets it.
fn reduce_best(lid: u32, v: f32, i: u32) -> vec2<u32> {
    rv[lid] = v;
    ri[lid] = i;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s && before(rv[lid + s], ri[lid + s], rv[lid], ri[lid])) {
            rv[lid] = rv[lid + s];
            ri[lid] = ri[lid + s];
        }
        workgroupBarrier();
    }
    let r = vec2<u32>(bitcast<u32>(rv[0]), ri[0]);
    workgroupBarrier();
    return r;
}

// Workgroup sum (max when `is_max`) of every thread's v.
fn reduce_f32(lid: u32, v: f32, is_max: bool) -> f32 {
    rv[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            rv[lid] = select(rv[lid] + rv[lid + s], max(rv[lid], rv[lid + s]), is_max);
        }
        workgroupBarrier();
    }
    let r = rv[0];
    workgroupBarrier();
    return r;
}
