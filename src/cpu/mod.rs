//! The CPU forward pass, in two precisions:
//!
//! - [`Precision::Exact`] (the reference, what `CpuModel::new` gives): plain Rust, f32 activations,
//!   each weight row decoded by `quant::dequantize_row` and multiplied in f32. It is the oracle
//!   every GPU and SIMD kernel is checked against, and matches transformers' logits to 1e-4.
//!   Its results do not depend on the thread count.
//! - [`Precision::Fast`] (`CpuModel::fast`, the CLI's and the browser's default): the kernels of
//!   [`kernels`], which never expand weights to f32 (activations quantised to Q8 blocks for
//!   quantised weights, as llama.cpp does), in tiles of 4 rows, SIMD where the machine has it, an
//!   f16 KV cache where it converts f16 in hardware (quantised models), threads over output rows
//!   and heads (natively, and in the browser's threads build), and no allocation per token besides
//!   the logits the `LanguageModel` API returns (the KV cache is reserved up to the context
//!   length; the scratch buffers live in the state).
//!
//! One pass handles a batch of tokens (the whole prompt at prefill, one token per decode step):
//! each weight row is read once and multiplied with every token of the batch.

pub mod kernels;
#[cfg(any(not(target_arch = "wasm32"), target_feature = "atomics"))]
mod team;
mod walk;

use std::ops::Range;

use crate::error::Result;
use crate::lm::{check_truncate, LanguageModel};
use crate::model::{Ffn, Linear, Model, Norm, NormWeights, Qkv, Tensor};
use crate::quant::{dequantize_row, GgmlType};
use half::{f16, slice::HalfFloatSliceExt};
use kernels::{ActScales, BlockQ8, DecodeWalk, Isa, KvRows, QK8};

/// How the CPU path computes: bit-for-bit reference, or fast (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    Exact,
    Fast,
}

/// A model ready to run on the CPU.
pub struct CpuModel {
    pub model: Model,
    /// Sequence length the KV cache may grow to (the model's context unless capped).
    max_seq: usize,
    precision: Precision,
    isa: Isa,
    threads: usize,
    /// Natively, the model's own pool of the helpers its passes recruit (`threads - 1`: the
    /// caller leads); `None` with one thread. (The browser's threads build recruits from the
    /// global pool the page started, `web::pool::build_pool`.)
    #[cfg(not(target_arch = "wasm32"))]
    pool: Option<std::sync::Arc<rayon::ThreadPool>>,
    /// Whether decode steps read the rows in long streams or adjacent tiles (see [`walk`]).
    walk: walk::WalkChoice,
    /// Weight bytes a token's pass reads: its work, to decide whether it is worth a team.
    #[cfg(all(target_arch = "wasm32", target_feature = "atomics"))]
    pass_bytes: usize,
}

/// Per-sequence buffers the forward pass reuses from token to token (not part of a clone).
#[derive(Debug, Default)]
struct Scratch {
    /// Tokens the buffers have room for.
    n: usize,
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    up: Vec<f32>,
    gate: Vec<f32>,
    /// The current matmul input quantised to Q8 blocks (fast path).
    act: Vec<BlockQ8>,
    /// Attention scores: one row as long as the context per head.
    scores: Vec<f32>,
    /// (cos, sin) of each rotated pair at each token's position.
    rope: Vec<f32>,
}

/// What a sequence has seen so far: the keys and values of every layer at every position, and
/// the scratch buffers its forward passes reuse.
#[derive(Debug, Default)]
pub struct KvCache {
    pub pos: usize,
    /// Per layer: `pos` rows of `kv_dim` values.
    k: Vec<KvStore>,
    v: Vec<KvStore>,
    scratch: Scratch,
}

impl Clone for KvCache {
    /// Copies the filled rows only (beam search forks states); scratch is made afresh on use.
    fn clone(&self) -> KvCache {
        KvCache { pos: self.pos, k: self.k.clone(), v: self.v.clone(), scratch: Scratch::default() }
    }
}

/// Threads of the browser's worker pool: set by `web::pool::build_pool` once the page started it
/// (wasm threads build); 1 otherwise.
#[cfg(target_arch = "wasm32")]
pub static BROWSER_THREADS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);

#[cfg(target_arch = "wasm32")]
pub fn browser_threads() -> usize {
    BROWSER_THREADS.load(std::sync::atomic::Ordering::Relaxed)
}

/// One layer's cached keys or values. f16 on the fast path for quantised weights where the
/// machine converts f16 in hardware (as llama.cpp's default cache): at long contexts the cache is
/// as many bytes per token as the weights, and the activations are already rounded to 8 bits.
/// Head-major: each KV head's rows (`head_dim` values a position) are one vector of their own, so
/// attention streams one head's keys sequentially instead of a slice of every row (1.6x faster
/// attention at 1k positions on the AMD Zen 3 host, where the interleaved rows defeated prefetch).
#[derive(Clone, Debug)]
enum KvStore {
    F32(Vec<Vec<f32>>),
    F16(Vec<Vec<f16>>),
}

impl KvStore {
    fn new(f16: bool, heads: usize, reserve: usize) -> KvStore {
        if f16 {
            KvStore::F16((0..heads).map(|_| Vec::with_capacity(reserve)).collect())
        } else {
            KvStore::F32((0..heads).map(|_| Vec::with_capacity(reserve)).collect())
        }
    }

    /// Append positions: `rows` holds one row of all heads (`heads x head_dim`) per position.
    fn push(&mut self, rows: &[f32], head_dim: usize) {
        /// Each head's slice of every row onto that head's vector, by `put`.
        fn split<T>(
            heads: &mut [Vec<T>],
            rows: &[f32],
            d: usize,
            put: impl Fn(&mut Vec<T>, &[f32]),
        ) {
            let row_len = heads.len() * d;
            for (h, store) in heads.iter_mut().enumerate() {
                rows.chunks_exact(row_len).for_each(|row| put(store, &row[h * d..][..d]));
            }
        }
        match self {
            KvStore::F32(heads) => split(heads, rows, head_dim, |v, x| v.extend_from_slice(x)),
            KvStore::F16(heads) => split(heads, rows, head_dim, |v, x| {
                let start = v.len();
                v.resize(start + x.len(), f16::ZERO);
                v[start..].convert_from_f32_slice(x);
            }),
        }
    }

    /// Keep the first `len` values of each head (`positions x head_dim`).
    fn truncate(&mut self, len: usize) {
        match self {
            KvStore::F32(heads) => heads.iter_mut().for_each(|v| v.truncate(len)),
            KvStore::F16(heads) => heads.iter_mut().for_each(|v| v.truncate(len)),
        }
    }

    /// KV head `h`'s rows, `head_dim` apart.
    fn head(&self, h: usize) -> KvRows<'_> {
        match self {
            KvStore::F32(heads) => KvRows::F32(&heads[h]),
            KvStore::F16(heads) => KvRows::F16(&heads[h]),
        }
    }
}

/// Tokens from which a matrix product packs its weight rows into panels (`kernels::Panel`):
/// packing costs about as much as multiplying a panel with a few tokens.
const PANEL_MIN_TOKENS: usize = 8;

/// Tokens up to which a pass (speculative decoding's verification: the guesses and the token
/// before them) reads the weight rows in decode's order where decode reads long streams
/// (`kernels::decode_walk`): such a pass is memory-bound as a step is. On AMD Zen 4 a pass of 2
/// to 5 tokens in adjacent tiles took 2.4-2.6 one-token steps (the prefetchers follow 4 short
/// streams badly), and speculative decoding never paid there.
const STREAMED_PASS_TOKENS: usize = 9;

/// log2 of the least work (multiply-adds) worth a chunk of its own in a parallel loop. Outside a
/// forward pass's team a loop wakes threads: a few microseconds natively, tens in a browser (a
/// Web Worker waiting on `Atomics.wait`). The browser's value dates from before the team (with
/// it, 14 measured no different there).
#[cfg(any(not(target_arch = "wasm32"), target_feature = "atomics"))]
const MIN_TASK_LOG2: usize = if cfg!(target_arch = "wasm32") { 17 } else { 14 };

/// Least work of a forward pass (weight bytes per token x tokens) that recruits a team of the
/// pool's threads in the browser; a smaller pass runs every loop on the calling thread. There
/// recruiting wakes a Web Worker (`Atomics.notify`) and then shares 2 cores with the browser's
/// own threads: the default model (2 MiB of weights) decoded at 0.69x its one-thread speed on a
/// team of two (`tests/browser/ab-pages.mjs`, even with one wake-up a pass). Natively a wake-up
/// costs microseconds and the team always leads (on that model one thread and two decode
/// within noise of each other).
#[cfg(all(target_arch = "wasm32", target_feature = "atomics"))]
const TEAM_MIN_PASS_BYTES: usize = 16 << 20;

/// Reserve the KV cache up to the context when that is at most this many bytes (natively,
/// untouched pages cost no memory); larger contexts grow on demand.
const KV_RESERVE_LIMIT: usize = 1 << 30;

/// One matmul input quantised to Q8 blocks (fast path), made by the first multiply that wants
/// it and reused by the others that read the same input with the same scales (a layer whose
/// q, k and v mix K-quant and other rows quantises twice).
struct QuantisedInput<'a> {
    blocks: &'a mut [BlockQ8],
    filled: Option<ActScales>,
}

impl<'a> QuantisedInput<'a> {
    fn new(blocks: &'a mut [BlockQ8]) -> Self {
        QuantisedInput { blocks, filled: None }
    }
}

/// A raw pointer that tasks writing disjoint elements of one output may share.
#[derive(Clone, Copy)]
struct SyncPtr<T>(*mut T);
// SAFETY: only used by tasks that write disjoint indices while the owner waits for them.
unsafe impl<T> Send for SyncPtr<T> {}
unsafe impl<T> Sync for SyncPtr<T> {}

impl<T> SyncPtr<T> {
    /// Elements `at..at + len` of the output. (A method, so that closures capture the whole
    /// `SyncPtr`, which is Sync, not its raw-pointer field.)
    ///
    /// # Safety
    /// They lie inside the output, and no other task touches them while the slice lives.
    unsafe fn slice<'a>(&self, at: usize, len: usize) -> &'a mut [T] {
        // SAFETY: as the caller promises.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(at), len) }
    }
}

/// A matrix product's work, not yet done: `units` pieces (rows, or tiles or panels of rows) of
/// about `cost` multiply-adds each, and what computes a range of them.
struct Product<'a> {
    units: usize,
    cost: usize,
    work: Box<dyn Fn(Range<usize>) + Sync + 'a>,
}

impl<'a> Product<'a> {
    fn new(units: usize, cost: usize, work: impl Fn(Range<usize>) + Sync + 'a) -> Product<'a> {
        Product { units, cost, work: Box::new(work) }
    }
}

impl CpuModel {
    /// The reference model: exact precision, one thread.
    pub fn new(model: Model) -> CpuModel {
        let max_seq = model.config.n_ctx;
        let isa = Isa::detect();
        CpuModel {
            // Before `model` moves in.
            #[cfg(all(target_arch = "wasm32", target_feature = "atomics"))]
            pass_bytes: model.weight_bytes_per_token(),
            model,
            max_seq,
            precision: Precision::Exact,
            isa,
            threads: 1,
            #[cfg(not(target_arch = "wasm32"))]
            pool: None,
            walk: walk::WalkChoice::new(kernels::decode_in_streams(isa)),
        }
    }

    /// The fast path on every core: what the CLI generates with.
    pub fn fast(model: Model) -> CpuModel {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        CpuModel::new(model).with_precision(Precision::Fast).with_threads(threads)
    }

    /// Limit the sequence length (models advertise contexts far larger than a demo needs).
    pub fn with_max_seq(mut self, max_seq: usize) -> CpuModel {
        self.max_seq = max_seq.clamp(1, self.model.config.n_ctx);
        self
    }

    /// The fast path also moves a mapped file's weights into huge pages (Linux; see
    /// [`Model::into_huge_pages`]); the exact one reads them where they are.
    pub fn with_precision(mut self, precision: Precision) -> CpuModel {
        self.precision = precision;
        #[cfg(target_os = "linux")]
        if precision == Precision::Fast {
            self.model = self.model.into_huge_pages();
        }
        self
    }

    /// Use this instruction set for the fast path's kernels (tests compare them); one not in
    /// `Isa::available()` falls back to the scalar kernels.
    pub fn with_isa(mut self, isa: Isa) -> CpuModel {
        self.isa = if Isa::available().contains(&isa) { isa } else { Isa::Scalar };
        self.walk = walk::WalkChoice::new(kernels::decode_in_streams(self.isa));
        self
    }

    /// Decode in long streams (`Some(true)`), in adjacent tiles (`Some(false)`), or as the first
    /// decode steps measure (`None`), instead of the host's choice (`kernels::decode_in_streams`;
    /// `with_isa` goes back to it, so call this after).
    pub fn with_decode_walk(mut self, streams: Option<bool>) -> CpuModel {
        self.walk = walk::WalkChoice::new(streams);
        self
    }

    /// Split matmuls and attention over `threads` threads: natively on a pool of the model's own;
    /// in the browser on the pool of Web Workers the page started (the wasm threads build, on a
    /// cross-origin isolated page), at most as many as it has; else serially.
    /// Results do not depend on the thread count: each output element is computed by one thread.
    pub fn with_threads(mut self, threads: usize) -> CpuModel {
        self.threads = threads.max(1);
        #[cfg(not(target_arch = "wasm32"))]
        {
            self.pool = if self.threads > 1 {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(self.threads - 1)
                    .build()
                    .ok()
                    .map(std::sync::Arc::new)
            } else {
                None
            };
            if self.pool.is_none() {
                self.threads = 1;
            }
        }
        #[cfg(target_arch = "wasm32")]
        {
            self.threads = self.threads.min(browser_threads());
        }
        self
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }
    pub fn isa(&self) -> Isa {
        self.isa
    }
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Whether decode reads the weight rows in long streams (`kernels::decode_walk`): `None`
    /// while the first decode steps still time both walks; never on the exact path (it decodes
    /// each row to f32 on its own).
    pub fn decode_in_streams(&self) -> Option<bool> {
        match self.precision {
            Precision::Exact => Some(false),
            Precision::Fast => self.walk.settled(),
        }
    }

    /// Whether the KV cache holds f16 (see `KvStore`): fast path, quantised weights, F16C.
    fn kv_f16(&self) -> bool {
        let quantised = kernels::uses_q8_activations(
            self.model.weights.layers.first().map_or(GgmlType::F32, |l| l.attn_output.weight.ty),
        );
        self.precision == Precision::Fast
            && matches!(self.isa, Isa::Avx2 | Isa::Avx512Vnni)
            && quantised
    }

    /// The kernels' instruction set: scalar (the reference expressions) in exact mode.
    fn kernel_isa(&self) -> Isa {
        match self.precision {
            Precision::Exact => Isa::Scalar,
            Precision::Fast => self.isa,
        }
    }

    /// Run `f` over `0..n` split into ranges on the team this thread leads during a forward pass
    /// (see [`team`]; every caller runs inside one, see [`CpuModel::in_pool`]), serially when
    /// small, single threaded or outside a team. `cost` is the work per item, to keep tiny loops
    /// on one thread.
    fn par_ranges(&self, n: usize, cost: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        #[cfg(any(not(target_arch = "wasm32"), target_feature = "atomics"))]
        if self.threads > 1 {
            let total = n.saturating_mul(cost);
            let chunks = (self.threads * 4).min(n).min(total >> MIN_TASK_LOG2);
            if chunks > 1 && team::run(chunks, &|c| f(c * n / chunks..(c + 1) * n / chunks)) {
                return;
            }
        }
        #[cfg(all(target_arch = "wasm32", not(target_feature = "atomics")))]
        let _ = cost;
        f(0..n)
    }

    /// Run a forward pass over `tokens` tokens, `f`, on this thread as the leader of a [`team`]
    /// of the pool's threads, so the pass's many parallel loops cost no wake-ups (natively the
    /// model's pool, in the browser the page's). In the browser a pass too small to share
    /// (`TEAM_MIN_PASS_BYTES`) leads a team of one.
    fn in_pool<R>(&self, tokens: usize, f: impl FnOnce() -> R) -> R {
        #[cfg(all(target_arch = "wasm32", target_feature = "atomics"))]
        if self.threads > 1 {
            let helpers = if tokens.saturating_mul(self.pass_bytes) < TEAM_MIN_PASS_BYTES {
                0
            } else {
                self.threads - 1
            };
            return team::lead(helpers, rayon::spawn, f);
        }
        #[cfg(not(all(target_arch = "wasm32", target_feature = "atomics")))]
        let _ = tokens;
        #[cfg(not(target_arch = "wasm32"))]
        if let Some(pool) = &self.pool {
            return team::lead(self.threads - 1, |helper| pool.spawn(helper), f);
        }
        f()
    }

    /// `out[t][r] = dot(W[r], x[t])` for a batch of token vectors, plus the bias if any. `xq` is
    /// `x` quantised (fast path, quantised weights); otherwise rows multiply f32 activations.
    /// Returned as work to split over threads (see [`Product`]), not done yet.
    fn product<'a>(
        &'a self,
        w: &'a Tensor,
        bias: Option<&'a Tensor>,
        x: &'a [f32],
        xq: Option<&'a [BlockQ8]>,
        out: &'a mut [f32],
    ) -> Product<'a> {
        let n = x.len() / w.cols;
        let rows = w.rows;
        debug_assert_eq!(out.len(), n * rows);
        let bytes = self.model.bytes(w);
        let row_bytes = w.row_bytes();
        // `move` closures throughout: the work outlives this function (it runs in `products`).
        let row = move |r: usize| &bytes[r * row_bytes..(r + 1) * row_bytes];
        let out_ptr = SyncPtr(out.as_mut_ptr());
        let bias_bytes = bias.map(|b| self.model.bytes(b));
        let store = move |t: usize, r: usize, v: f32| {
            // Capture the whole SyncPtr (Sync), not its raw-pointer field (closures capture fields).
            #[allow(clippy::redundant_locals)]
            let out_ptr = out_ptr;
            let v = v + bias_bytes.map_or(0.0, |b| f32_at(b, r));
            // SAFETY: t * rows + r < out.len(), and each r belongs to one task.
            unsafe { *out_ptr.0.add(t * rows + r) = v };
        };
        let isa = self.isa;
        match (self.precision, xq) {
            (Precision::Exact, _) => {
                // The reference decodes each row to f32 first.
                let work = move |range: Range<usize>| {
                    let mut wr = vec![0f32; w.cols];
                    for r in range {
                        dequantize_row(w.ty, row(r), &mut wr);
                        for t in 0..n {
                            store(t, r, dot(&wr, &x[t * w.cols..(t + 1) * w.cols]));
                        }
                    }
                };
                Product::new(rows, w.cols * n, work)
            }
            (Precision::Fast, Some(xq))
                if n >= PANEL_MIN_TOKENS && kernels::has_panel(isa, w.ty) =>
            {
                // Prefill: panels of PANEL_ROWS rows, each unpacked once and multiplied with
                // every token; rows past the last whole panel go one at a time.
                const P: usize = kernels::PANEL_ROWS;
                let xq = &xq[..n * (w.cols / QK8)];
                let work = move |panels: Range<usize>| {
                    let mut panel = kernels::Panel::default();
                    let mut sums = vec![0f32; n * P];
                    let (r0, r1) = (panels.start * P, (panels.end * P).min(rows));
                    let mut r = r0;
                    while r + P <= r1 {
                        let tile = std::array::from_fn(|k| row(r + k));
                        kernels::panel_gemm(isa, w.ty, tile, xq, &mut panel, &mut sums);
                        for (t, s) in sums.chunks_exact(P).enumerate() {
                            // SAFETY: rows r..r + P of every token belong to this task alone.
                            let dst = unsafe { out_ptr.slice(t * rows + r, P) };
                            dst.copy_from_slice(s);
                            if let Some(b) = bias_bytes {
                                dst.iter_mut()
                                    .enumerate()
                                    .for_each(|(k, v)| *v += f32_at(b, r + k));
                            }
                        }
                        r += P;
                    }
                    let blocks = w.cols / QK8;
                    for r in r..r1 {
                        for (t, a) in xq.chunks_exact(blocks).enumerate() {
                            store(
                                t,
                                r,
                                kernels::dot_q8_tile::<1, 1>(isa, w.ty, [row(r)], [a])[0][0],
                            );
                        }
                    }
                };
                Product::new(rows.div_ceil(P), w.cols * n * P, work)
            }
            (Precision::Fast, Some(xq)) => {
                // Tiles of TILE_ROWS rows x 5, 4, 3 or 2 tokens (prefill; 2 where the registers
                // hold no more) or x 1 token (decode, and the odd token); rows past the last whole tile go one at a time.
                // Decode walks the rows as this host streams them best (kernels::decode_walk).
                const R: usize = kernels::TILE_ROWS;
                let blocks = w.cols / QK8;
                let act = move |t: usize| &xq[t * blocks..(t + 1) * blocks];
                let walk = match n {
                    1 => kernels::decode_walk(isa, w.ty, self.walk.streams()),
                    // A verification pass reads every weight for a few tokens, as decode does:
                    // where decode reads long streams, its tiles take one row from each quarter
                    // of the share (the same sums: a tile sums each row on its own).
                    n if n <= STREAMED_PASS_TOKENS && self.walk.streams() => {
                        DecodeWalk::SpreadTiles
                    }
                    _ => DecodeWalk::Tiles,
                };
                let spread = walk == DecodeWalk::SpreadTiles;
                // Decode's walks over rows a..b: the token's sums there, and the rows' bytes.
                let rows_out = move |a: usize, b: usize| {
                    // SAFETY: rows a..b of the one token belong to this task alone.
                    let dst = unsafe { out_ptr.slice(a, b - a) };
                    (dst, &bytes[a * row_bytes..b * row_bytes])
                };
                let add_bias = move |dst: &mut [f32], r0: usize| {
                    if let Some(b) = bias_bytes {
                        dst.iter_mut().zip(r0..).for_each(|(v, r)| *v += f32_at(b, r));
                    }
                };
                let work = move |tiles: Range<usize>| {
                    let (r0, r1) = (tiles.start * R, (tiles.end * R).min(rows));
                    let mut r = r0;
                    match walk {
                        DecodeWalk::RowByRow => {
                            let (dst, matrix) = rows_out(r0, r1);
                            kernels::dot_q8_rows(isa, w.ty, matrix, row_bytes, act(0), dst);
                            add_bias(dst, r0);
                            return;
                        }
                        _ if n == 1 => {
                            // The whole tiles in one call (spread: row k of each quarter of the
                            // share in one tile); the rest alone, below.
                            r = r0 + (r1 - r0) / R * R;
                            let (dst, matrix) = rows_out(r0, r);
                            let act = act(0);
                            kernels::dot_q8_decode_tiles(
                                isa, w.ty, matrix, row_bytes, spread, act, dst,
                            );
                            add_bias(dst, r0);
                        }
                        _ if kernels::has_pass_tiles(isa, w.ty) => {
                            // The whole tiles in one call, the activations arranged once.
                            r = r0 + (r1 - r0) / R * R;
                            let acts: Vec<&[BlockQ8]> = (0..n).map(act).collect();
                            let matrix = &bytes[r0 * row_bytes..r * row_bytes];
                            let mut put = |t: usize, k: usize, v: f32| store(t, r0 + k, v);
                            kernels::dot_q8_pass_tiles(
                                isa, w.ty, matrix, row_bytes, spread, &acts, &mut put,
                            );
                        }
                        _ => {}
                    }
                    // The whole tiles left: q of them, adjacent or spread.
                    let (first, q) = (r, (r1 - r) / R);
                    for k in 0..q {
                        let rows = kernels::tile_rows(k, q, spread).map(|j| first + j);
                        let tile = rows.map(row);
                        if !spread {
                            kernels::touch_ahead(&bytes[rows[0] * row_bytes..], R * row_bytes);
                        }
                        let mut t = 0;
                        // T tokens at a time while T of them are left.
                        macro_rules! tiles {
                            ($t:literal) => {
                                #[allow(clippy::int_plus_one)] // `t + 1 <= n` reads as the others
                                while t + $t <= n {
                                    let o = kernels::dot_q8_tile::<R, $t>(
                                        isa,
                                        w.ty,
                                        tile,
                                        std::array::from_fn(|j| act(t + j)),
                                    );
                                    for (&r, o) in rows.iter().zip(&o) {
                                        for (j, &v) in o.iter().enumerate() {
                                            store(t + j, r, v);
                                        }
                                    }
                                    t += $t;
                                }
                            };
                        }
                        if kernels::wide_tiles(isa, w.ty) {
                            tiles!(5);
                            tiles!(4);
                            // A verification pass of 2 guesses: one sweep, not a tile of 2 and
                            // one of 1 (135M Q8_0 shape, VNNI: 18.1 -> 16.2 ms).
                            tiles!(3);
                        }
                        tiles!(2);
                        tiles!(1);
                    }
                    r = first + q * R;
                    // The one-row tile, which decode row by row takes too: a token's sums are
                    // the same bits in any pass (speculative decoding's verification relies on it).
                    for r in r..r1 {
                        for t in 0..n {
                            let one = kernels::dot_q8_tile::<1, 1>(isa, w.ty, [row(r)], [act(t)]);
                            store(t, r, one[0][0]);
                        }
                    }
                };
                Product::new(rows.div_ceil(R), w.cols * n * R, work)
            }
            (Precision::Fast, None) => {
                let work = move |range: Range<usize>| {
                    for r in range {
                        for t in 0..n {
                            store(
                                t,
                                r,
                                kernels::dot_float_row(
                                    isa,
                                    w.ty,
                                    row(r),
                                    &x[t * w.cols..(t + 1) * w.cols],
                                ),
                            );
                        }
                    }
                };
                Product::new(rows, w.cols * n, work)
            }
        }
    }

    /// Run products over one parallel loop: one fork and join for all of them (q, k and v; gate
    /// and up), which matters where waking the pool's threads is slow (Web Workers).
    fn products(&self, products: &[Product]) {
        let units = products.iter().map(|p| p.units).sum();
        let cost = products.iter().map(|p| p.cost).max().unwrap_or(0);
        self.par_ranges(units, cost, &|range: Range<usize>| {
            let mut first = 0;
            for p in products {
                let (start, end) = (range.start.max(first), range.end.min(first + p.units));
                if start < end {
                    (p.work)(start - first..end - first);
                }
                first += p.units;
            }
        });
    }

    /// One product on its own (see [`CpuModel::product`]).
    fn matmul(
        &self,
        w: &Tensor,
        bias: Option<&Tensor>,
        x: &[f32],
        xq: Option<&[BlockQ8]>,
        out: &mut [f32],
    ) {
        self.products(&[self.product(w, bias, x, xq, out)]);
    }

    /// Run the transformer over `tokens` at positions `cache.pos..`, appending to the cache.
    /// Leaves the final hidden states (after the output norm) in `cache.scratch.h`.
    fn forward_hidden(&self, cache: &mut KvCache, tokens: &[u32]) {
        let m = &self.model;
        let c = &m.config;
        let w = &m.weights;
        let (n, e) = (tokens.len(), c.n_embd);
        let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
        let pos0 = cache.pos;
        let rope_row = 2 * m.rope.pairs();

        if cache.k.len() != c.n_layer {
            let fits = c.n_layer * self.max_seq * kv_dim * 8 <= KV_RESERVE_LIMIT;
            let reserve =
                if fits && !cfg!(target_arch = "wasm32") { self.max_seq * c.head_dim } else { 0 };
            let (f16, heads) = (self.kv_f16(), c.n_head_kv);
            cache.k = (0..c.n_layer).map(|_| KvStore::new(f16, heads, reserve)).collect();
            cache.v = (0..c.n_layer).map(|_| KvStore::new(f16, heads, reserve)).collect();
        }
        let s = &mut cache.scratch;
        if s.n < n || s.scores.len() < c.n_head * self.max_seq {
            let big = n.max(s.n);
            let qkv_rows = match w.layers.first().map(|l| &l.qkv) {
                Some(Qkv::Fused(qkv)) => qkv.weight.rows,
                _ => 0,
            };
            let max_cols = e.max(q_dim).max(c.n_ff);
            s.n = big;
            s.x = vec![0.0; big * e];
            s.h = vec![0.0; big * e];
            s.q = vec![0.0; big * q_dim];
            s.k = vec![0.0; big * kv_dim];
            s.v = vec![0.0; big * kv_dim];
            s.qkv = vec![0.0; big * qkv_rows];
            s.attn = vec![0.0; big * q_dim];
            s.proj = vec![0.0; big * e];
            s.up = vec![0.0; big * c.n_ff];
            s.gate = vec![0.0; big * c.n_ff];
            s.act = vec![BlockQ8::default(); big * max_cols.div_ceil(QK8)];
            s.scores = vec![0.0; c.n_head * self.max_seq];
            s.rope = vec![0.0; big * rope_row];
        }
        let x = &mut s.x[..n * e];
        let h = &mut s.h[..n * e];
        let q = &mut s.q[..n * q_dim];
        let k = &mut s.k[..n * kv_dim];
        let v = &mut s.v[..n * kv_dim];
        let attn = &mut s.attn[..n * q_dim];
        let proj = &mut s.proj[..n * e];
        let up = &mut s.up[..n * c.n_ff];
        let gate = &mut s.gate[..n * c.n_ff];
        let act = &mut s.act[..];
        let rope_cs = &mut s.rope[..n * rope_row];

        // Embedding lookup: decode the token's row (works for quantised embeddings too).
        let embd_bytes = m.bytes(&w.token_embd);
        let rb = w.token_embd.row_bytes();
        for (t, &tok) in tokens.iter().enumerate() {
            let id = tok as usize;
            dequantize_row(
                w.token_embd.ty,
                &embd_bytes[id * rb..(id + 1) * rb],
                &mut x[t * e..(t + 1) * e],
            );
        }
        if let Some(pe) = &w.pos_embd {
            let (bytes, rb) = (m.bytes(pe), pe.row_bytes());
            // `h` is free until the first norm: it holds the position row.
            for t in 0..n {
                let p = pos0 + t;
                dequantize_row(pe.ty, &bytes[p * rb..(p + 1) * rb], &mut h[..e]);
                add_assign(&mut x[t * e..(t + 1) * e], &h[..e]);
            }
        }
        // cos/sin of every rotated pair at each position, shared by all heads and layers.
        m.rope.fill_cos_sin(pos0, rope_cs);

        for (l, lw) in w.layers.iter().enumerate() {
            // Attention block.
            self.norm(x, &lw.attn_norm, h);
            match &lw.qkv {
                Qkv::Fused(wqkv) => {
                    let qkv = &mut s.qkv[..n * wqkv.weight.rows];
                    self.linear(wqkv, h, &mut QuantisedInput::new(act), qkv);
                    for (t, row) in qkv.chunks_exact(wqkv.weight.rows).enumerate() {
                        q[t * q_dim..(t + 1) * q_dim].copy_from_slice(&row[..q_dim]);
                        k[t * kv_dim..(t + 1) * kv_dim]
                            .copy_from_slice(&row[q_dim..q_dim + kv_dim]);
                        v[t * kv_dim..(t + 1) * kv_dim].copy_from_slice(&row[q_dim + kv_dim..]);
                    }
                }
                Qkv::Separate { q: wq, k: wk, v: wv } => {
                    let jobs = [(wq, &mut *q), (wk, &mut *k), (wv, &mut *v)];
                    self.linears(jobs, h, &mut QuantisedInput::new(act));
                }
            }
            for t in 0..n {
                let cs = &rope_cs[t * rope_row..(t + 1) * rope_row];
                m.rope.apply(&mut q[t * q_dim..(t + 1) * q_dim], c.head_dim, cs);
                m.rope.apply(&mut k[t * kv_dim..(t + 1) * kv_dim], c.head_dim, cs);
            }
            cache.k[l].push(k, c.head_dim);
            cache.v[l].push(v, c.head_dim);
            self.attention(pos0, q, &cache.k[l], &cache.v[l], &mut s.scores, attn);
            self.linear(&lw.attn_output, attn, &mut QuantisedInput::new(act), proj);
            add_assign(x, proj);

            // Feed-forward block.
            self.norm(x, &lw.ffn_norm, h);
            let down = match &lw.ffn {
                Ffn::GatedSilu { gate: wg, up: wu, down } => {
                    let jobs = [(wu, &mut *up), (wg, &mut *gate)];
                    self.linears(jobs, h, &mut QuantisedInput::new(act));
                    self.silu_mul(gate, up);
                    down
                }
                Ffn::Gelu { up: wu, down } => {
                    self.linear(wu, h, &mut QuantisedInput::new(act), up);
                    up.iter_mut().for_each(|u| *u = gelu(*u));
                    down
                }
            };
            self.linear(down, up, &mut QuantisedInput::new(act), proj);
            add_assign(x, proj);
        }
        cache.pos += n;

        self.norm(x, &w.output_norm, h);
    }

    /// `out = W x + b` for a batch of token vectors `x` (see [`QuantisedInput`] for `xq`).
    fn linear(&self, w: &Linear, x: &[f32], xq: &mut QuantisedInput, out: &mut [f32]) {
        self.linears([(w, out)], x, xq);
    }

    /// [`CpuModel::linear`] for several weights of one input, over one parallel loop when they
    /// all take the same activations (f32, or Q8 with the same scales), else one after another.
    fn linears<const N: usize>(
        &self,
        jobs: [(&Linear, &mut [f32]); N],
        x: &[f32],
        xq: &mut QuantisedInput,
    ) {
        let Some((first, _)) = jobs.first() else { return };
        let scales = self.q8_scales(&first.weight);
        if jobs.iter().any(|(w, _)| self.q8_scales(&w.weight) != scales) {
            for (w, out) in jobs {
                let quantised = self.quantised(&w.weight, x, xq);
                self.matmul(&w.weight, w.bias.as_ref(), x, quantised, out);
            }
            return;
        }
        let quantised = self.quantised(&first.weight, x, xq);
        let products =
            jobs.map(|(w, out)| self.product(&w.weight, w.bias.as_ref(), x, quantised, out));
        self.products(&products);
    }

    /// The scales of the Q8 activations the fast path multiplies `w` with; `None`: f32 ones.
    fn q8_scales(&self, w: &Tensor) -> Option<ActScales> {
        let wants_q8 = self.precision == Precision::Fast
            && kernels::uses_q8_activations(w.ty)
            && w.cols.is_multiple_of(QK8);
        wants_q8.then(|| ActScales::of(w.ty))
    }

    /// `x` quantised to Q8 blocks when the fast path multiplies `w` in int8 (made on first use).
    fn quantised<'b>(
        &self,
        w: &Tensor,
        x: &[f32],
        xq: &'b mut QuantisedInput,
    ) -> Option<&'b [BlockQ8]> {
        let scales = self.q8_scales(w)?;
        let blocks = x.len() / QK8;
        if xq.filled != Some(scales) {
            // Token by token over the pool: at prefill this is a few per cent of the pass.
            let (per_token, isa) = (w.cols / QK8, self.isa);
            let out = SyncPtr(xq.blocks.as_mut_ptr());
            self.par_ranges(x.len() / w.cols, w.cols, &|tokens: Range<usize>| {
                // SAFETY: each task writes the blocks of its own tokens, within `blocks`.
                let out = unsafe { out.slice(tokens.start * per_token, tokens.len() * per_token) };
                let x = &x[tokens.start * w.cols..tokens.end * w.cols];
                scales.quantize_with(isa, x, out);
            });
            xq.filled = Some(scales);
        }
        Some(&xq.blocks[..blocks])
    }

    /// `up *= silu(gate)` for a batch of tokens, token by token over the pool (at prefill the
    /// exponentials are a few per cent of the pass); one kernel call a token, so that each
    /// element is computed as in a pass of any other size (SIMD lanes and the scalar tail round
    /// apart: a task's tokens in one call gave stories260K's 172-wide rows other bits in a pass).
    fn silu_mul(&self, gate: &[f32], up: &mut [f32]) {
        let (n_ff, isa) = (self.model.config.n_ff, self.kernel_isa());
        let up_ptr = SyncPtr(up.as_mut_ptr());
        self.par_ranges(up.len() / n_ff, 16 * n_ff, &|tokens: Range<usize>| {
            for t in tokens {
                // SAFETY: each task writes the elements of its own tokens, within `up`.
                let up = unsafe { up_ptr.slice(t * n_ff, n_ff) };
                kernels::silu_mul(isa, &gate[t * n_ff..(t + 1) * n_ff], up);
            }
        });
    }

    /// Normalise each row of `x` as the model's [`Norm`] says.
    fn norm(&self, x: &[f32], weights: &NormWeights, out: &mut [f32]) {
        let c = &self.model.config;
        let (e, eps) = (c.n_embd, c.norm_eps);
        let wt = self.model.bytes(&weights.weight);
        let b = weights.bias.as_ref().map(|b| self.model.bytes(b));
        for (xr, o) in x.chunks_exact(e).zip(out.chunks_exact_mut(e)) {
            match c.norm {
                Norm::Layer => {
                    let mean = xr.iter().sum::<f32>() / e as f32;
                    let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / e as f32;
                    let inv = 1.0 / (var + eps).sqrt();
                    for i in 0..e {
                        o[i] =
                            (xr[i] - mean) * inv * f32_at(wt, i) + b.map_or(0.0, |b| f32_at(b, i));
                    }
                }
                Norm::Rms => {
                    let ms = xr.iter().map(|v| v * v).sum::<f32>() / e as f32;
                    let inv = 1.0 / (ms + eps).sqrt();
                    for i in 0..e {
                        o[i] = xr[i] * inv * f32_at(wt, i);
                    }
                }
            }
        }
    }

    /// Causal self-attention for a batch of queries at positions `pos0..pos0+n`, against a cache
    /// holding keys/values for positions `0..pos0+n`. Query head h reads key/value head
    /// `h / (n_head / n_head_kv)` (grouped-query attention). The causal mask is the loop bound:
    /// query t sees positions `0..=pos0+t`. Heads run in parallel; `scores` holds a row per head.
    fn attention(
        &self,
        pos0: usize,
        q: &[f32],
        k_cache: &KvStore,
        v_cache: &KvStore,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        let c = &self.model.config;
        let (n_head, head_dim) = (c.n_head, c.head_dim);
        let q_dim = c.q_dim();
        let group = n_head / c.n_head_kv;
        let scale = 1.0 / (head_dim as f32).sqrt();
        let n = q.len() / q_dim;
        let isa = self.kernel_isa();
        let stride = scores.len() / n_head;
        debug_assert!(stride >= pos0 + n);
        let (out_ptr, scores_ptr) = (SyncPtr(out.as_mut_ptr()), SyncPtr(scores.as_mut_ptr()));
        let work = |heads: Range<usize>| {
            for h in heads {
                // SAFETY: head h alone uses scores[h*stride..][..stride] and, for every t,
                // out[t*q_dim + h*head_dim..][..head_dim]; both lie inside their buffers.
                let scores = unsafe { scores_ptr.slice(h * stride, stride) };
                let kvh = h / group;
                for t in 0..n {
                    let seen = pos0 + t + 1;
                    let qh = &q[t * q_dim + h * head_dim..][..head_dim];
                    let keys = k_cache.head(kvh);
                    kernels::attention_scores(isa, qh, keys, head_dim, scale, &mut scores[..seen]);
                    kernels::softmax(isa, &mut scores[..seen]);
                    // SAFETY: see above.
                    let o = unsafe { out_ptr.slice(t * q_dim + h * head_dim, head_dim) };
                    kernels::attention_values(isa, &scores[..seen], v_cache.head(kvh), head_dim, o);
                }
            }
        };
        self.par_ranges(n_head, n * (pos0 + n) * head_dim * 2, &work);
    }

    fn check_tokens(&self, pos: usize, tokens: &[u32]) -> Result<()> {
        self.model.config.check_tokens(pos, tokens, self.max_seq)
    }

    /// Bytes of weights one decode step reads (`Model::weight_bytes_per_token`).
    pub fn weight_bytes_per_token(&self) -> usize {
        self.model.weight_bytes_per_token()
    }
}

impl LanguageModel for CpuModel {
    type State = KvCache;

    fn vocab_size(&self) -> usize {
        self.model.config.n_vocab
    }
    fn context_length(&self) -> usize {
        self.max_seq
    }
    fn bos_token(&self) -> Option<u32> {
        self.model.config.prompt_start()
    }
    fn eos_tokens(&self) -> &[u32] {
        &self.model.config.eos_tokens
    }
    fn new_state(&self) -> KvCache {
        KvCache::default()
    }
    fn position(&self, state: &KvCache) -> usize {
        state.pos
    }
    fn truncate(&self, state: &mut KvCache, len: usize) -> Result<()> {
        check_truncate(state.pos, len)?;
        let head_dim = self.model.config.head_dim;
        for store in state.k.iter_mut().chain(&mut state.v) {
            store.truncate(len * head_dim);
        }
        state.pos = len;
        Ok(())
    }

    async fn forward_async(
        &self,
        state: &mut KvCache,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>> {
        self.check_tokens(state.pos, tokens)?;
        let pass = || {
            self.forward_hidden(state, tokens);
            let e = self.model.config.n_embd;
            let n = tokens.len();
            let s = &mut state.scratch;
            let rows = if all_logits { &s.h[..n * e] } else { &s.h[(n - 1) * e..n * e] };
            let out = &self.model.weights.output;
            let mut logits = vec![0f32; rows.len() / e * self.model.config.n_vocab];
            let xq = &mut QuantisedInput::new(&mut s.act);
            let xq = self.quantised(out, rows, xq);
            self.matmul(out, None, rows, xq, &mut logits);
            Ok(logits)
        };
        if tokens.len() == 1 && self.precision == Precision::Fast {
            // A decode step: it may be timed, to choose how decode walks the rows.
            self.walk.step(crate::timing::default_clock, || self.in_pool(1, pass))
        } else {
            self.in_pool(tokens.len(), pass)
        }
    }
}

/// Softmax with the maximum subtracted first, so large scores do not overflow.
pub fn softmax_in_place(x: &mut [f32]) {
    kernels::scalar::softmax(x)
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn add_assign(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

/// GELU, tanh approximation (GPT-2's "gelu_new", and what ggml computes).
fn gelu(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
}

fn f32_at(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}
