//! The fast CPU path's dot products: weights are never expanded to f32.
//!
//! For the quantised weight types (`GgmlType::QUANTISED`) the activation vector is first
//! quantised to [`BlockQ8`] blocks of 32 (as llama.cpp quantises activations to Q8_0, except that
//! the scale stays f32), and each weight block is multiplied with its activation block in integer
//! arithmetic: int8 x int8 (Q8_0), int4 x int8 (Q4_0, Q4_K), int5 x int8 (Q5_0, Q5_1, Q5_K),
//! int6 x int8 (Q6_K), one float
//! multiply-add per block or sub-block. F32, F16 and BF16 rows are converted in registers and
//! multiplied with the f32 activations directly (fused; no row buffer).
//!
//! Every kernel has a portable scalar version, the oracle the SIMD versions are tested against
//! (`tests/cpu_kernels.rs`), and SIMD versions: x86-64 AVX2+FMA+F16C (picked at run time with
//! `is_x86_feature_detected!`), aarch64 NEON (picked at run time) and wasm32 simd128 (picked at
//! compile time, when the crate is built with `-C target-feature=+simd128`; with `+relaxed-simd`
//! too, the int8 tiles use its byte dot product). The same comparison
//! is also in the library ([`check_isa_against_scalar`]), so builds that `cargo test` cannot run
//! (wasm in a browser) check themselves.

use half::{bf16, f16};

use crate::quant::{q4_k_scale_min, GgmlType, QK_K};

/// Elements per activation block.
pub const QK8: usize = 32;

/// 32 activations quantised to int8: `x[i] ~= d * qs[i]`, with `sum = sum(qs)` precomputed for the
/// weight types whose blocks carry an offset (Q4_0's -8, Q4_K's min).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(C)]
pub struct BlockQ8 {
    pub d: f32,
    pub sum: i32,
    pub qs: [i8; QK8],
    /// The relaxed-simd build: `qs` split into x⁺ = max(q, 0) and x⁻ = max(−q, 0), what its
    /// byte products multiply signed weights with (see `relaxed_simd.rs`), made once by the
    /// quantiser instead of once per 4 rows in every tile.
    #[cfg(all(target_arch = "wasm32", target_feature = "relaxed-simd"))]
    pub split: [[i8; QK8]; 2],
}

/// Which instruction set a kernel uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust: the oracle.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX2 plus AVX-512 VNNI (with BW and VL): int8 tiles with `vpdpbusd`; the rest is AVX2.
    Avx512Vnni,
    /// aarch64 NEON.
    Neon,
    /// wasm32 simd128.
    Simd128,
    /// wasm32 simd128 plus relaxed-simd (its own build): the int8 tiles with
    /// `i16x8.relaxed_dot_i8x16_i7x16_s`; the rest is simd128.
    RelaxedSimd,
}

impl Isa {
    /// The best instruction set this machine (or this wasm build) supports.
    pub fn detect() -> Isa {
        Isa::available().last().copied().unwrap_or(Isa::Scalar)
    }

    /// Every instruction set usable here, scalar first.
    pub fn available() -> Vec<Isa> {
        #[allow(unused_mut)]
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            v.push(Isa::Avx2);
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
            {
                v.push(Isa::Avx512Vnni);
            }
        }
        #[cfg(target_arch = "aarch64")]
        if std::arch::is_aarch64_feature_detected!("neon") {
            v.push(Isa::Neon);
        }
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        v.push(Isa::Simd128);
        #[cfg(all(target_arch = "wasm32", target_feature = "relaxed-simd"))]
        v.push(Isa::RelaxedSimd);
        v
    }

    /// The instruction set called `name` ([`Isa::name`]), if this machine has it: for `--isa`.
    pub fn by_name(name: &str) -> crate::Result<Isa> {
        let available = Isa::available();
        available.iter().copied().find(|i| i.name() == name).ok_or_else(|| {
            let names: Vec<_> = available.iter().map(|i| i.name()).collect();
            crate::Error::Input(format!("--isa {name}: this machine has {}", names.join(", ")))
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512Vnni => "avx512vnni",
            Isa::Neon => "neon",
            Isa::Simd128 => "simd128",
            Isa::RelaxedSimd => "relaxed-simd",
        }
    }
}

/// The host CPU as the benchmark reports it: vendor and model (from `/proc/cpuinfo` where there
/// is one) and the instruction-set extensions detected at run time that matter to the kernels,
/// so a number can be read next to the machine it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostCpu {
    pub vendor: String,
    pub model: String,
    pub features: Vec<&'static str>,
}

impl HostCpu {
    pub fn detect() -> HostCpu {
        let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let field = |name: &str| {
            info.lines()
                .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        };
        HostCpu {
            vendor: field("vendor_id").or_else(|| field("CPU implementer")).unwrap_or_default(),
            model: field("model name").or_else(|| field("Model")).unwrap_or_default(),
            features: host_features(),
        }
    }
}

impl std::fmt::Display for HostCpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let model = if self.model.is_empty() { std::env::consts::ARCH } else { &self.model };
        write!(f, "{model}")?;
        if !self.vendor.is_empty() {
            write!(f, " ({})", self.vendor)?;
        }
        write!(f, "; {}", self.features.join(" "))
    }
}

/// The run-time-detected extensions the kernels care about (AVX-512 VNNI vs AVX-VNNI is what
/// separates Intel's AMX-era parts from AMD Zen 4, which runs 512-bit ops in two halves).
// Which pushes exist depends on the target: on wasm32 there is one right after `new`.
#[allow(clippy::vec_init_then_push)]
fn host_features() -> Vec<&'static str> {
    #[allow(unused_mut)]
    let mut found = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! check {
            ($($name:tt),*) => {
                $(if is_x86_feature_detected!($name) { found.push($name); })*
            };
        }
        check!(
            "sse4.2",
            "avx",
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512vnni",
            "avx512vbmi",
            "avxvnni"
        );
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            found.push("neon");
        }
        if std::arch::is_aarch64_feature_detected!("dotprod") {
            found.push("dotprod");
        }
    }
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    found.push("simd128");
    #[cfg(all(target_arch = "wasm32", target_feature = "relaxed-simd"))]
    found.push("relaxed-simd");
    found
}

/// Whether the fast path multiplies rows of `ty` with Q8-quantised activations (else f32).
pub fn uses_q8_activations(ty: GgmlType) -> bool {
    GgmlType::QUANTISED.contains(&ty)
}

/// How a matmul quantises its activations for rows of a weight type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActScales {
    /// One scale per block of 32 (Q8_0, Q4_0, Q5_0, Q5_1 rows).
    PerBlock,
    /// One scale per super-block of 256, written into each of its 8 blocks (K-quant rows, as
    /// llama.cpp's Q8_K): the K-quant kernels then add the sub-blocks' integer sums, each times
    /// its sub-block scale in integers, and multiply by floats once per super-block, not per
    /// block of 32. The K-quant tiles read only the first block's scale of each super-block.
    PerSuperBlock,
}

impl ActScales {
    /// The activation scales rows of `ty` are multiplied with.
    pub fn of(ty: GgmlType) -> ActScales {
        match ty {
            GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => ActScales::PerSuperBlock,
            _ => ActScales::PerBlock,
        }
    }

    /// Values that share one scale.
    fn group(self) -> usize {
        match self {
            ActScales::PerBlock => QK8,
            ActScales::PerSuperBlock => QK_K,
        }
    }

    /// [`ActScales::quantize`] with `isa`'s instructions (the same bytes).
    pub fn quantize_with(self, isa: Isa, x: &[f32], out: &mut [BlockQ8]) {
        assert_eq!(x.len(), out.len() * QK8, "quantize: output blocks");
        assert!(x.len().is_multiple_of(self.group()), "quantize: a whole number of groups");
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as in `dot_q8`.
            Isa::Avx2 | Isa::Avx512Vnni => unsafe { avx2::quantize(self.group(), x, out) },
            _ => self.quantize(x, out),
        }
    }

    /// Quantise `x` (a multiple of 32 long; of 256 for `PerSuperBlock`) to blocks:
    /// d = max|x| / 127 over the block or the super-block, q = round(x / d), halves away from 0.
    pub fn quantize(self, x: &[f32], out: &mut [BlockQ8]) {
        debug_assert_eq!(x.len(), out.len() * QK8);
        let group = self.group();
        debug_assert!(x.len().is_multiple_of(group));
        for (xs, os) in x.chunks(group).zip(out.chunks_mut(group / QK8)) {
            // max |x| on the bit patterns (ordered as the magnitudes): an integer maximum,
            // which vectorises where a float one (strict order of operations) does not.
            let amax =
                f32::from_bits(xs.iter().map(|v| v.to_bits() & 0x7fff_ffff).max().unwrap_or(0));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            for (xb, o) in xs.chunks_exact(QK8).zip(os.iter_mut()) {
                let mut sum = 0i32;
                for (q, &v) in o.qs.iter_mut().zip(xb) {
                    // Rounds half away from zero as `f32::round`, which is a libm call on
                    // baseline x86-64 and wasm32 (a tenth of a prefill); this vectorises.
                    let r = v * id;
                    *q = (r + 0.5f32.copysign(r)) as i32 as i8;
                    sum += *q as i32;
                }
                o.d = d;
                o.sum = sum;
                // q is −127..=127, so −q is an i8.
                #[cfg(all(target_arch = "wasm32", target_feature = "relaxed-simd"))]
                {
                    o.split = [o.qs.map(|q| q.max(0)), o.qs.map(|q| (-q).max(0))];
                }
            }
        }
    }
}

/// Quantise `x` as rows of `ty` want it (see [`ActScales`]).
pub fn quantize_activations_for(ty: GgmlType, x: &[f32], out: &mut [BlockQ8]) {
    ActScales::of(ty).quantize(x, out)
}

/// Quantise `x` (a multiple of 32 long) to blocks of 32, each with its own scale.
pub fn quantize_activations(x: &[f32], out: &mut [BlockQ8]) {
    ActScales::PerBlock.quantize(x, out)
}

/// Q4_K's 8 six-bit scales and 8 six-bit mins from its 12 packed bytes, each as 8 bytes in a
/// u64 (the bit shuffle of `quant::q4_k_scale_min`, done on all 8 at once in 32-bit words).
#[inline]
// NEON reads the scales one at a time (`quant::q4_k_scale_min`); wasm without simd128 has only
// the scalar kernels.
#[cfg_attr(
    any(target_arch = "aarch64", all(target_arch = "wasm32", not(target_feature = "simd128"))),
    allow(dead_code)
)]
pub(super) fn q4_k_scales_mins(packed: &[u8]) -> (u64, u64) {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const HIGH2: u32 = 0x0303_0303;
    let word = |i: usize| {
        u32::from_le_bytes([packed[4 * i], packed[4 * i + 1], packed[4 * i + 2], packed[4 * i + 3]])
    };
    let (w0, w1, w2) = (word(0), word(1), word(2));
    // Scales 0-3: low 6 bits of bytes 0-3; mins 0-3: of bytes 4-7. Scales 4-7: low nibbles of
    // bytes 8-11 plus the top 2 bits of bytes 0-3; mins 4-7: high nibbles plus bytes 4-7's top bits.
    let scales = [w0 & LOW6, (w2 & LOW4) | (((w0 >> 6) & HIGH2) << 4)];
    let mins = [w1 & LOW6, ((w2 >> 4) & LOW4) | (((w1 >> 6) & HIGH2) << 4)];
    let join = |v: [u32; 2]| (v[1] as u64) << 32 | v[0] as u64;
    (join(scales), join(mins))
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// How far ahead [`touch_ahead`] reaches, at least, in bytes.
#[cfg(target_arch = "wasm32")]
const TOUCH_AHEAD: usize = 4096;

/// wasm has no prefetch instruction, and the hardware prefetcher alone leaves a core far from
/// memory bandwidth on short rows: so before each tile of `span` bytes the tile loop loads one
/// byte per cache line of the next tile (or 4 KiB on, for tiles shorter than that): plain loads,
/// which the out-of-order core issues early, as a prefetch. `rest` starts at the tile. Elsewhere the
/// kernels prefetch for themselves and this does nothing.
#[inline]
pub fn touch_ahead(rest: &[u8], span: usize) {
    #[cfg(target_arch = "wasm32")]
    {
        let mut x = 0u8;
        let ahead = span.max(TOUCH_AHEAD);
        for b in rest.iter().skip(ahead).step_by(64).take(span.div_ceil(64)) {
            x ^= *b;
        }
        std::hint::black_box(x);
    }
    #[cfg(not(target_arch = "wasm32"))]
    let _ = (rest, span);
}

/// Dot product of one weight row of a quantised `ty` (`GgmlType::QUANTISED`; `row` is its bytes) with the
/// quantised activations `act` (`cols / 32` blocks).
pub fn dot_q8(isa: Isa, ty: GgmlType, row: &[u8], act: &[BlockQ8]) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Isa::Avx2 (and Avx512Vnni, which implies it) is only produced by `available()`
        // after detecting avx2, fma and f16c (and the AVX-512 features).
        Isa::Avx2 | Isa::Avx512Vnni => unsafe { avx2::dot_q8(ty, row, act) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: Isa::Neon is only produced by `available()` after detecting neon.
        Isa::Neon => unsafe { neon::dot_q8(ty, row, act) },
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        Isa::Simd128 | Isa::RelaxedSimd => simd128::dot_q8(ty, row, act),
        _ => scalar::dot_q8(ty, row, act),
    }
}

/// Weight rows one tile multiplies at once (see [`dot_q8_tile`]).
pub const TILE_ROWS: usize = 4;

/// Whether `isa`'s tile for `ty` has the registers for 4 rows x 4 tokens (the AVX-512 VNNI tiles:
/// 32 vector registers; with AVX2's 16 the 16 sums would spill, so those take 2 tokens).
pub fn wide_tiles(isa: Isa, ty: GgmlType) -> bool {
    #[cfg(target_arch = "x86_64")]
    return isa == Isa::Avx512Vnni && avx512vnni::has_tile(ty);
    #[cfg(all(target_arch = "wasm32", target_feature = "relaxed-simd"))]
    return isa == Isa::RelaxedSimd && relaxed_simd::has_tile(ty);
    #[cfg(not(any(
        target_arch = "x86_64",
        all(target_arch = "wasm32", target_feature = "relaxed-simd")
    )))]
    {
        let _ = (isa, ty);
        false
    }
}

/// How a decode step (one token) walks a quantised matrix's rows (each thread its share).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeWalk {
    /// Tiles of [`TILE_ROWS`] adjacent rows: each activation block loaded once per 4 rows.
    Tiles,
    /// One row after another through the one-row tile: the share read as one sequential stream.
    RowByRow,
    /// Tiles of 4 rows a quarter of the share apart: 4 long streams, the activations still
    /// loaded once per 4 rows.
    SpreadTiles,
}

/// The walk for rows of `ty` when decode reads long streams (`streams`) or adjacent tiles.
/// Adjacent tiles are four short streams interleaved, which AMD Zen 4's prefetchers follow badly,
/// whatever the software prefetch distance: there a core read Q8_0 weights at 8-10 GB/s in
/// adjacent tiles and 14-16 one row at a time (a kernel loop over 256 MiB of rows; none, 1, 3, 8
/// and 16 KiB of prefetch distance alike). Natively Q8_0 and the K-quants then go row by row; the
/// blocks of 32 with nibbles (Q4_0, Q5_0, Q5_1), whose unpacking the 4 rows' shared activations
/// pay for, in spread tiles (Llama-3.2-1B Q4_0 on 2 cores: 22-26 tok/s in adjacent tiles, 32 in
/// spread ones; row by row lost on Q4_0; Q8_0 in spread tiles with AVX2's folded tile was faster
/// on one thread, Qwen2.5-0.5B 36.9 against 31.5 tok/s, but not on two, 57.4 against 57.8 and
/// Llama-3.2-1B 21.6 against 23.4). simd128's tiles take rows 4 at a time, so there every
/// type goes in spread tiles. Which hosts read in streams: [`decode_in_streams`].
pub fn decode_walk(isa: Isa, ty: GgmlType, streams: bool) -> DecodeWalk {
    if !streams {
        return DecodeWalk::Tiles;
    }
    match ty {
        _ if matches!(isa, Isa::Simd128 | Isa::RelaxedSimd) => DecodeWalk::SpreadTiles,
        // AVX2's Q8_0 tile folds 4 rows' sums (`avx2::folded_tile`); one row in that order
        // (`avx2::folded_row`, for the rows past the last tile) costs more than the stream gains.
        GgmlType::Q8_0 if isa == Isa::Avx2 => DecodeWalk::SpreadTiles,
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q5_1 => DecodeWalk::SpreadTiles,
        GgmlType::Q8_0 | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => DecodeWalk::RowByRow,
        _ => DecodeWalk::Tiles,
    }
}

/// Whether decode with `isa` reads long streams ([`decode_walk`]) on this host, where that is
/// known without timing: natively the x86 kernels do on AMD with AVX-512 (Zen 4 and later); the
/// Intel host the tiles were tuned on, and Zen 3, keep adjacent tiles (they led llama.cpp there).
/// `None` where the first decode steps time both walks (`cpu::walk`): the wasm build, which
/// cannot tell what it runs on (in Node on Zen 4, spread tiles decoded 25-50 % faster; on Zen 3
/// the adjacent tiles with [`touch_ahead`] were what closed the gap). Natively
/// `NEXTTOKEN_DECODE_WALK=streams`, `=tiles` or `=timed` overrides the host's choice, to measure
/// it elsewhere (`nexttoken bench` prints it).
pub fn decode_in_streams(isa: Isa) -> Option<bool> {
    match isa {
        Isa::Simd128 | Isa::RelaxedSimd => None,
        Isa::Avx2 | Isa::Avx512Vnni => host_decodes_in_streams(),
        _ => Some(false),
    }
}

fn host_decodes_in_streams() -> Option<bool> {
    static CHOICE: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(|| match std::env::var("NEXTTOKEN_DECODE_WALK").as_deref() {
        Ok("streams") => Some(true),
        Ok("tiles") => Some(false),
        Ok("timed") => None,
        _ => {
            let host = HostCpu::detect();
            Some(host.vendor == "AuthenticAMD" && host.features.contains(&"avx512f"))
        }
    })
}

/// Whether a pass of several tokens over rows of `ty` takes its whole tiles through
/// [`dot_q8_pass_tiles`] (AVX-512 VNNI: Q8_0, and Q4_0 and Q5_0 with VBMI), not tile by tile through
/// [`dot_q8_tile`].
pub fn has_pass_tiles(isa: Isa, ty: GgmlType) -> bool {
    #[cfg(target_arch = "x86_64")]
    return isa == Isa::Avx512Vnni && avx512vnni::has_pair_tile(ty, TILE_ROWS);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, ty);
        false
    }
}

/// A pass's products over the whole tiles of 4 rows in `matrix` (`row_bytes` each) with `acts`
/// (a token each), where [`has_pass_tiles`]: the activations arranged once for every tile.
/// `store(t, r, sum)` gets row r's sum with token t: [`dot_q8_tile`]'s bits. `spread`: tiles of
/// one row from each quarter of the rows, as [`dot_q8_decode_tiles`]'s.
pub fn dot_q8_pass_tiles(
    isa: Isa,
    ty: GgmlType,
    matrix: &[u8],
    row_bytes: usize,
    spread: bool,
    acts: &[&[BlockQ8]],
    store: &mut dyn FnMut(usize, usize, f32),
) {
    assert!(has_pass_tiles(isa, ty), "no pass tiles for {} with {}", ty.name(), isa.name());
    assert!(acts.iter().all(|a| row_bytes >= ty.row_bytes(a.len() * QK8)));
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `has_pass_tiles` checked the CPU's features and the type.
    unsafe {
        avx512vnni::pair_pass_tiles(ty, matrix, row_bytes, spread, acts, store)
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (matrix, spread, store);
}

/// `out[r][t] = dot_q8(rows[r], acts[t])` for `R` weight rows and `T` activation vectors at once:
/// each weight block is loaded (and unpacked) once for all `T` vectors, each activation block
/// once for all `R` rows, and the `R * T` sums stay in registers. Decode uses `T = 1` (one token,
/// several rows: more independent work per loaded activation), prefill `T > 1`.
pub fn dot_q8_tile<const R: usize, const T: usize>(
    isa: Isa,
    ty: GgmlType,
    rows: [&[u8]; R],
    acts: [&[BlockQ8]; T],
) -> [[f32; T]; R] {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `dot_q8`; `has_pair_tile` checked VBMI where the type needs it.
        Isa::Avx512Vnni if avx512vnni::has_pair_tile(ty, R) => unsafe {
            avx512vnni::pair_tile_of(ty, rows, acts)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `dot_q8`.
        Isa::Avx512Vnni if avx512vnni::has_tile(ty) => unsafe {
            avx512vnni::dot_q8_tile(ty, rows, acts)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 | Isa::Avx512Vnni if avx2::has_tile(ty) => unsafe {
            avx2::dot_q8_tile(ty, rows, acts)
        },
        #[cfg(all(target_arch = "wasm32", target_feature = "relaxed-simd"))]
        Isa::RelaxedSimd if relaxed_simd::has_tile(ty) && R.is_multiple_of(4) => {
            relaxed_simd::dot_q8_tile(ty, rows, acts)
        }
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        // Its tiles fold 4 rows into one vector: a one-row tile goes through `dot_q8`.
        Isa::Simd128 | Isa::RelaxedSimd if simd128::has_tile(ty) && R.is_multiple_of(4) => {
            simd128::dot_q8_tile(ty, rows, acts)
        }
        _ => std::array::from_fn(|r| std::array::from_fn(|t| dot_q8(isa, ty, rows[r], acts[t]))),
    }
}

/// `out[r] = dot_q8(row r, act)` for the first `out.len()` rows of `matrix` (`row_bytes` each),
/// one row at a time: decode's walk where a host reads the rows as one stream
/// ([`DecodeWalk::RowByRow`]). One call for the whole range, so the instruction set and the type
/// are matched once, not once per row: on a 1B model's 2048-column Q4_K rows (72 ns each at
/// 16 GB/s) the per-row dispatch through [`dot_q8_tile`] and the caller's closure was 7 % of
/// decode's time (`perf`, one core of AMD Zen 4). The sums are the one-row tile's, bit for bit.
pub fn dot_q8_rows(
    isa: Isa,
    ty: GgmlType,
    matrix: &[u8],
    row_bytes: usize,
    act: &[BlockQ8],
    out: &mut [f32],
) {
    assert!(matrix.len() >= out.len() * row_bytes && row_bytes >= ty.row_bytes(act.len() * QK8));
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `dot_q8`.
        Isa::Avx512Vnni if avx512vnni::has_tile(ty) => unsafe {
            avx512vnni::dot_q8_rows(ty, matrix, row_bytes, act, out)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `dot_q8`.
        Isa::Avx2 | Isa::Avx512Vnni if avx2::has_tile(ty) => unsafe {
            avx2::dot_q8_rows(ty, matrix, row_bytes, act, out)
        },
        _ => {
            for (r, o) in out.iter_mut().enumerate() {
                let row = &matrix[r * row_bytes..(r + 1) * row_bytes];
                *o = dot_q8_tile::<1, 1>(isa, ty, [row], [act])[0][0];
            }
        }
    }
}

/// Decode's 4-row tiles over the first `out.len()` rows of `matrix` (a multiple of
/// [`TILE_ROWS`], `row_bytes` each), in one call as [`dot_q8_rows`]: adjacent tiles
/// ([`DecodeWalk::Tiles`]) or, with `spread`, tiles of rows a quarter of the range apart
/// ([`DecodeWalk::SpreadTiles`]; see [`tile_rows`]). `out[r]` gets row r's sum, the same
/// bits whichever the walk: the 4-row, one-token tile's ([`dot_q8_tile`]), which passes of
/// several tokens give too.
pub fn dot_q8_decode_tiles(
    isa: Isa,
    ty: GgmlType,
    matrix: &[u8],
    row_bytes: usize,
    spread: bool,
    act: &[BlockQ8],
    out: &mut [f32],
) {
    const R: usize = TILE_ROWS;
    assert!(out.len().is_multiple_of(R) && matrix.len() >= out.len() * row_bytes);
    assert!(row_bytes >= ty.row_bytes(act.len() * QK8));
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `dot_q8_tile`.
        Isa::Avx512Vnni if avx512vnni::has_pair_tile(ty, R) => unsafe {
            avx512vnni::pair_decode_tiles(ty, matrix, row_bytes, spread, act, out)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `dot_q8`.
        Isa::Avx2 => unsafe { avx2::dot_q8_decode_tiles(ty, matrix, row_bytes, spread, act, out) },
        _ => {
            let q = out.len() / R;
            for k in 0..q {
                let rows = tile_rows(k, q, spread);
                if !spread {
                    // The browser's prefetch (a no-op natively): the next tile's lines.
                    touch_ahead(&matrix[rows[0] * row_bytes..], R * row_bytes);
                }
                let tile = rows.map(|r| &matrix[r * row_bytes..(r + 1) * row_bytes]);
                let o = dot_q8_tile::<R, 1>(isa, ty, tile, [act]);
                for (r, o) in rows.into_iter().zip(o) {
                    out[r] = o[0];
                }
            }
        }
    }
}

/// The rows of tile `k` of `q` over rows 0..4q, in decode's walks (see [`dot_q8_decode_tiles`])
/// and a pass's: 4 adjacent rows, or with `spread` row k of each quarter of the range.
#[inline]
pub fn tile_rows(k: usize, q: usize, spread: bool) -> [usize; TILE_ROWS] {
    std::array::from_fn(|j| if spread { j * q + k } else { TILE_ROWS * k + j })
}

/// The loop of [`dot_q8_rows`] for an instruction set's kernel: `row_sum` gets each row and
/// returns its sum (inlined as [`each_decode_tile`]).
///
/// # Safety
/// `matrix` holds `out.len()` rows of `row_bytes` (checked by `dot_q8_rows`).
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) unsafe fn each_decode_row(
    matrix: &[u8],
    row_bytes: usize,
    out: &mut [f32],
    mut row_sum: impl FnMut(&[u8]) -> f32,
) {
    for (r, o) in out.iter_mut().enumerate() {
        *o = row_sum(matrix.get_unchecked(r * row_bytes..(r + 1) * row_bytes));
    }
}

/// The loop of [`dot_q8_decode_tiles`] for an instruction set's kernel: `tile` gets each tile's
/// 4 rows and returns their sums. Inlined into the caller, whose closure `tile` then compiles
/// with the caller's target features (closures inherit them; this function has none).
///
/// # Safety
/// `matrix` holds `out.len()` rows of `row_bytes` (checked by `dot_q8_decode_tiles`).
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) unsafe fn each_decode_tile(
    matrix: &[u8],
    row_bytes: usize,
    spread: bool,
    out: &mut [f32],
    mut tile: impl FnMut([&[u8]; TILE_ROWS]) -> [f32; TILE_ROWS],
) {
    let q = out.len() / TILE_ROWS;
    for k in 0..q {
        let rows = tile_rows(k, q, spread);
        let sums = tile(rows.map(|r| matrix.get_unchecked(r * row_bytes..(r + 1) * row_bytes)));
        for (r, sum) in rows.into_iter().zip(sums) {
            *out.get_unchecked_mut(r) = sum;
        }
    }
}

/// Weight rows in a prefill panel (see [`Panel`]).
pub const PANEL_ROWS: usize = 8;

/// Prefill's weight panel: `PANEL_ROWS` rows of a quantised matrix unpacked to one byte per
/// weight and interleaved, so that one 256-bit vector holds 4 consecutive weights of each row
/// (quants[8 b + j] = weights 4j..4j+4 of rows 0..8 in block b), with each row's scale and offset
/// per block of 32 as floats (w = d q - m: Q4_0's m is 8 d, Q4_K's the sub-block's min, Q8_0's
/// and Q6_K's 0) and, for Q6_K, each row's integer scale per 16 weights. Prefill packs a panel
/// once per matrix product and then multiplies it with every token, so the unpacking is paid
/// once, not once per token; the buffer is per thread and reused (the weights keep their file
/// layout: no second copy of the model).
#[derive(Clone, Debug, Default)]
// Only x86-64 and the relaxed-simd build have panel kernels so far; elsewhere the type exists for
// the callers' sake.
#[cfg_attr(not(any(target_arch = "x86_64", target_feature = "relaxed-simd")), allow(dead_code))]
pub struct Panel {
    quants: Vec<[u8; 32]>,
    scales: Vec<[f32; PANEL_ROWS]>,
    offsets: Vec<[f32; PANEL_ROWS]>,
    /// Q6_K: per half block (16 weights), row r's 8-bit scale in 16-bit lanes 2r and 2r + 1.
    int_scales: Vec<[i16; 2 * PANEL_ROWS]>,
    kind: PanelQuants,
}

/// What a panel's quants are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(not(any(target_arch = "x86_64", target_feature = "relaxed-simd")), allow(dead_code))]
enum PanelQuants {
    /// 0..=15 (Q4_0, Q4_K), with an offset.
    #[default]
    Nibbles,
    /// -128..=127 (Q8_0).
    // The wasm panels leave Q8_0 to its tile (see `wasm_panel::has_panel`).
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))]
    Bytes,
    /// -32..=31 (Q6_K), with an integer scale per 16.
    SixBits,
    /// 0..=31 (Q5_0, Q5_1, Q5_K), with an offset.
    FiveBits,
}

/// Whether `isa` has a panel kernel ([`panel_gemm`]) for rows of `ty`.
pub fn has_panel(isa: Isa, ty: GgmlType) -> bool {
    #[cfg(target_arch = "x86_64")]
    return matches!(isa, Isa::Avx2 | Isa::Avx512Vnni) && avx2_panel::has_panel(ty);
    #[cfg(all(target_arch = "wasm32", target_feature = "relaxed-simd"))]
    return isa == Isa::RelaxedSimd && wasm_panel::has_panel(ty);
    #[cfg(not(any(
        target_arch = "x86_64",
        all(target_arch = "wasm32", target_feature = "relaxed-simd")
    )))]
    {
        let _ = (isa, ty);
        false
    }
}

/// `out[t * PANEL_ROWS + r] = dot_q8(rows[r], acts[t])` for every activation vector `t` in
/// `acts` (`n` vectors of `rows[r].len() / block_bytes * block_size / 32` blocks each): `rows`
/// are packed into `panel`, then multiplied with the vectors a few at a time. Only where
/// [`has_panel`] says so.
pub fn panel_gemm(
    isa: Isa,
    ty: GgmlType,
    rows: [&[u8]; PANEL_ROWS],
    acts: &[BlockQ8],
    panel: &mut Panel,
    out: &mut [f32],
) {
    assert!(has_panel(isa, ty), "panel_gemm: no panel kernel for {} on {}", ty.name(), isa.name());
    #[cfg(target_arch = "x86_64")]
    // SAFETY: has_panel checked that isa is AVX2 or AVX-512 VNNI (detected at run time, see
    // `dot_q8`).
    unsafe {
        if isa == Isa::Avx512Vnni {
            avx2_panel::panel_gemm_vnni(ty, rows, acts, panel, out)
        } else {
            avx2_panel::panel_gemm(ty, rows, acts, panel, out)
        }
    }
    #[cfg(all(target_arch = "wasm32", target_feature = "relaxed-simd"))]
    wasm_panel::panel_gemm(ty, rows, acts, panel, out);
    #[cfg(not(any(
        target_arch = "x86_64",
        all(target_arch = "wasm32", target_feature = "relaxed-simd")
    )))]
    {
        let _ = (rows, acts, panel, out);
        unreachable!()
    }
}

/// The body of each ISA's `panel_gemm` after packing: the activation vectors counted and checked
/// against the panel and `out`, then taken in tiles of 4, 2 and 1 tokens. For each tile, `$body`
/// sees its first token `$t`, its vectors `$tile` and its width as the const `$width`.
// Only x86-64 and the relaxed-simd build have panel kernels.
#[allow(unused_macros)]
macro_rules! panel_tiles {
    ($panel:expr, $acts:ident, $out:ident, |$t:ident, $tile:ident: $width:ident| $body:block) => {{
        let nb = $panel.scales.len();
        assert!(nb > 0 && $acts.len().is_multiple_of(nb), "panel_gemm: activations");
        let n = $acts.len() / nb;
        assert_eq!($out.len(), n * PANEL_ROWS, "panel_gemm: output");
        let mut $t = 0;
        panel_tiles!(@width 4, n, nb, $acts, $t, $tile, $width, $body);
        panel_tiles!(@width 2, n, nb, $acts, $t, $tile, $width, $body);
        panel_tiles!(@width 1, n, nb, $acts, $t, $tile, $width, $body);
    }};
    (@width $w:literal, $n:ident, $nb:ident, $acts:ident, $t:ident, $tile:ident, $width:ident, $body:block) => {
        #[allow(clippy::int_plus_one)] // `t + 1 <= n` reads as the others
        while $t + $w <= $n {
            let $tile: [&[BlockQ8]; $w] =
                std::array::from_fn(|k| &$acts[($t + k) * $nb..($t + k + 1) * $nb]);
            {
                const $width: usize = $w;
                $body
            }
            $t += $w;
        }
    };
}

/// Dot product of one F32, F16 or BF16 weight row (`row` is its bytes) with f32 activations.
pub fn dot_float_row(isa: Isa, ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 | Isa::Avx512Vnni => unsafe { avx2::dot_float_row(ty, row, x) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above.
        Isa::Neon => unsafe { neon::dot_float_row(ty, row, x) },
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        Isa::Simd128 | Isa::RelaxedSimd => simd128::dot_float_row(ty, row, x),
        _ => scalar::dot_float_row(ty, row, x),
    }
}

/// `sum(a[i] * b[i])`.
pub fn dot_f32(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 | Isa::Avx512Vnni => unsafe { avx2::dot_f32(a, b) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above.
        Isa::Neon => unsafe { neon::dot_f32(a, b) },
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        Isa::Simd128 | Isa::RelaxedSimd => simd128::dot_f32(a, b),
        _ => scalar::dot_f32(a, b),
    }
}

/// `y[i] += a * x[i]`.
pub fn axpy(isa: Isa, a: f32, x: &[f32], y: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 | Isa::Avx512Vnni => unsafe { avx2::axpy(a, x, y) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above.
        Isa::Neon => unsafe { neon::axpy(a, x, y) },
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        Isa::Simd128 | Isa::RelaxedSimd => simd128::axpy(a, x, y),
        _ => scalar::axpy(a, x, y),
    }
}

/// Cached keys or values: f32, or f16 (half the bytes to stream per token at long contexts).
#[derive(Clone, Copy, Debug)]
pub enum KvRows<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
}

impl KvRows<'_> {
    pub fn len(&self) -> usize {
        match self {
            KvRows::F32(r) => r.len(),
            KvRows::F16(r) => r.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One query head's attention scores against `out.len()` cached keys:
/// `out[p] = scale * dot(q, keys[p * stride..][..q.len()])` (keys of one head, `stride` apart).
pub fn attention_scores(
    isa: Isa,
    q: &[f32],
    keys: KvRows,
    stride: usize,
    scale: f32,
    out: &mut [f32],
) {
    if let Some(last) = out.len().checked_sub(1) {
        assert!(last * stride + q.len() <= keys.len(), "attention_scores: keys too short");
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above; the bounds were checked.
        Isa::Avx2 | Isa::Avx512Vnni if q.len().is_multiple_of(8) => unsafe {
            avx2::attention_scores(q, keys, stride, scale, out)
        },
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        Isa::Simd128 | Isa::RelaxedSimd if q.len().is_multiple_of(4) => {
            simd128::attention_scores(q, keys, stride, scale, out)
        }
        _ => scalar::attention_scores(q, keys, stride, scale, out),
    }
}

/// One head's attention output: `out = sum_p weights[p] * values[p * stride..][..out.len()]`.
pub fn attention_values(isa: Isa, weights: &[f32], values: KvRows, stride: usize, out: &mut [f32]) {
    if let Some(last) = weights.len().checked_sub(1) {
        assert!(last * stride + out.len() <= values.len(), "attention_values: values too short");
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above; the bounds were checked.
        Isa::Avx2 | Isa::Avx512Vnni if out.len().is_multiple_of(8) => unsafe {
            avx2::attention_values(weights, values, stride, out)
        },
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        Isa::Simd128 | Isa::RelaxedSimd if out.len().is_multiple_of(4) => {
            simd128::attention_values(weights, values, stride, out)
        }
        _ => scalar::attention_values(weights, values, stride, out),
    }
}

/// Cephes' `expf`, which every vectorised exp here follows (AVX2's and simd128's, sampling's
/// `logsumexp`): x = n ln 2 + r with ln 2 in two parts (`LN2_PARTS`, so r is exact enough), then
/// e^r = 1 + r + r^2 p(r) for |r| <= ln 2 / 2, p's coefficients from the highest (`EXP_POLY`).
pub(crate) const LN2_PARTS: [f32; 2] = [0.693_359_4, -2.121_944_4e-4];
pub(crate) const EXP_POLY: [f32; 6] =
    [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5];

/// `x = exp(x - max x) / sum`, in place (one head's attention weights). AVX2 and simd128 take a polynomial
/// exp (within a few units in the last place; below e^-87 it gives ~1e-38 instead of 0), as
/// llama.cpp's vectorised softmax does: libm's scalar expf was a twentieth of a long prefill.
pub fn softmax(isa: Isa, x: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `dot_q8`.
        Isa::Avx2 | Isa::Avx512Vnni => unsafe { avx2::softmax(x) },
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        Isa::Simd128 | Isa::RelaxedSimd => simd128::softmax(x),
        _ => scalar::softmax(x),
    }
}

/// `up[i] *= silu(gate[i])` (the gated feed-forward), with the exp of [`softmax`].
pub fn silu_mul(isa: Isa, gate: &[f32], up: &mut [f32]) {
    assert_eq!(gate.len(), up.len(), "silu_mul: lengths");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `dot_q8`.
        Isa::Avx2 | Isa::Avx512Vnni => unsafe { avx2::silu_mul(gate, up) },
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        Isa::Simd128 | Isa::RelaxedSimd => simd128::silu_mul(gate, up),
        _ => scalar::silu_mul(gate, up),
    }
}

/// The portable kernels: the oracle for the SIMD ones.
pub mod scalar;

#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(target_arch = "x86_64")]
mod avx2_panel;

#[cfg(target_arch = "x86_64")]
mod avx512vnni;

#[cfg(target_arch = "aarch64")]
mod neon;

/// The kernels against scalar inside the library (for builds `cargo test` cannot run).
pub mod check;
pub use check::check_isa_against_scalar;

#[cfg(all(target_arch = "wasm32", target_feature = "relaxed-simd"))]
mod relaxed_simd;
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod simd128;
#[cfg(all(target_arch = "wasm32", target_feature = "relaxed-simd"))]
mod wasm_panel;
