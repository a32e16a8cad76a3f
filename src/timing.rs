//! Clocks and rates, shared by the generation loop, the CLI bench, the browser bench and the CPU
//! model's choice of decode walk.

/// Milliseconds since some fixed origin. A plain `fn`, so a caller may time with another clock.
pub type Clock = fn() -> f64;

/// `Instant`-based natively; in wasm, `performance.now()` (wasm has no `Instant`; window and
/// worker globals, and Node, all have `performance`).
pub fn default_clock() -> f64 {
    #[cfg(not(target_arch = "wasm32"))]
    {
        use std::sync::OnceLock;
        use std::time::Instant;
        static ORIGIN: OnceLock<Instant> = OnceLock::new();
        ORIGIN.get_or_init(Instant::now).elapsed().as_secs_f64() * 1000.0
    }
    #[cfg(target_arch = "wasm32")]
    {
        performance_now()
    }
}

#[cfg(target_arch = "wasm32")]
#[wasm_bindgen::prelude::wasm_bindgen]
extern "C" {
    #[wasm_bindgen(js_namespace = performance, js_name = now)]
    fn performance_now() -> f64;
}

/// `count` things in `ms` milliseconds, per second; 0 when no time was measured (a clock that
/// reads 0, or a step too short for its resolution) rather than infinity.
pub fn per_second(count: usize, ms: f64) -> f64 {
    if ms > 0.0 {
        count as f64 * 1000.0 / ms
    } else {
        0.0
    }
}

/// Bytes per second of copying `bytes` bytes within memory (bytes read plus bytes written), best
/// of 5: the reference for the bandwidth a decode step reaches.
pub fn memcpy_bandwidth(bytes: usize, clock: Clock) -> f64 {
    let n = bytes.max(1);
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    let mut best_ms = f64::MAX;
    for _ in 0..5 {
        let start = clock();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        best_ms = best_ms.min(clock() - start);
    }
    // A clock coarser than one copy reads 0: count it as its resolution, not as infinitely fast.
    per_second(2 * n, best_ms.max(1e-6))
}

/// Token `i` of the benchmark sequence (`nexttoken bench`, the browser bench page's GPU profile,
/// `tools/bench_llamacpp.py`): ids spread over the vocabulary, avoiding the first 3.
pub fn bench_token(i: usize, n_vocab: usize) -> u32 {
    let x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 17;
    (3 + x % (n_vocab as u64 - 3)) as u32
}
