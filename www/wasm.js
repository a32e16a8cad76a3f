// Loads the wasm engine. On a cross-origin isolated page (SharedArrayBuffer available) with more
// than one core, the threads build (pkg-threads/, built by ./build.sh) with a pool of Web Workers
// that share its memory, so the CPU path runs on several cores; otherwise, or if that fails, the
// one-thread build (pkg/). The pool's workers are started by the page that started this worker
// (pool.js: hostPool; from a CDN, as blob: workers of the page's origin that import the CDN's
// script), which says so with a "pool-host" message; without it, one thread.
// A shared worker (one engine for every tab, worker.js) runs one thread.
// Each comes in two builds: with relaxed-simd (pkg-relaxed/, pkg-threads-relaxed/: the int8
// products through its byte dot product) where the browser validates it, else simd128 only;
// if a relaxed build fails to start, its simd128 twin runs.
// Resolves to the module's exports plus `threads` (the pool's size) and, when that is one,
// `threadsNote`: why (the page's stats show it).

import { threadsUnavailable } from "./pool.js";

/** Most pool threads (src/web/pool.rs: MAX_POOL_THREADS). */
const MAX_POOL_THREADS = 64;
/** How long the page may take to start the pool's workers before this goes on with one thread. */
const POOL_START_MS = 30_000;

let poolHost = false;
const inSharedWorker = typeof SharedWorkerGlobalScope !== "undefined" && self instanceof SharedWorkerGlobalScope;
self.addEventListener("message", ({ data }) => {
  if (data?.type === "pool-host") poolHost = true;
});

/**
 * `threads`: at most this many; `relaxed`: false runs the simd128 build where relaxed-simd would
 * run (the bench page compares the two).
 */
export async function loadWasm({ threads = navigator.hardwareConcurrency || 1, relaxed = relaxedSimd() } = {}) {
  threads = Math.min(threads, MAX_POOL_THREADS);
  const flavours = relaxed ? ["-relaxed", ""] : [""];
  let threadsNote = oneThreadReason(threads);
  if (!threadsNote) {
    for (const flavour of flavours) {
      try {
        const mainJS = new URL(`./pkg-threads${flavour}/nexttoken.js`, import.meta.url).href;
        const m = await import(mainJS);
        await m.default({ module_or_path: new URL(`./pkg-threads${flavour}/nexttoken_bg.wasm`, import.meta.url) });
        if (flavour) selfCheck(m);
        await startPool(threads, { mainJS, module: m.poolModule(), memory: m.poolMemory() });
        return { ...m, threads: m.buildPool(threads) };
      } catch (e) {
        threadsNote = `one thread: the threads build did not start (${e?.message || e})`;
        console.warn(`wasm threads build unavailable (pkg-threads${flavour}/: ${e?.message || e})`);
      }
    }
  }
  for (const flavour of flavours) {
    try {
      const m = await import(`./pkg${flavour}/nexttoken.js`);
      await m.default({ module_or_path: new URL(`./pkg${flavour}/nexttoken_bg.wasm`, import.meta.url) });
      if (flavour) selfCheck(m);
      return { ...m, threads: 1, threadsNote };
    } catch (e) {
      if (!flavour) throw e;
      console.warn(`wasm relaxed-simd build unavailable (pkg${flavour}/: ${e?.message || e}); running simd128`);
    }
  }
}

/**
 * relaxed-simd leaves some results to the CPU (a byte with its top bit set in the dot product's
 * second operand; saturation): the kernels avoid both, and this checks it on the machine at hand,
 * each kernel against the scalar oracle on random data (~30 ms), before the build is used.
 */
function selfCheck(m) {
  try {
    m.kernelSelfTest();
  } catch (e) {
    throw new Error(`its kernels disagree with the scalar oracle here: ${e?.message || e}`);
  }
}

/**
 * Whether this browser validates relaxed-simd: a module whose one function is
 * `i16x8.relaxed_dot_i8x16_i7x16_s` of two zero vectors (the instruction the relaxed builds use).
 */
export function relaxedSimd() {
  const zeros = new Array(16).fill(0);
  const body = [0x00, 0xfd, 0x0c, ...zeros, 0xfd, 0x0c, ...zeros, 0xfd, 0x92, 0x02, 0x0b];
  const bytes = [
    ...[0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00], // "\0asm", version 1
    ...[0x01, 0x05, 0x01, 0x60, 0x00, 0x01, 0x7b], // types: () -> v128
    ...[0x03, 0x02, 0x01, 0x00], // one function of type 0
    ...[0x0a, body.length + 2, 0x01, body.length, ...body], // its code
  ];
  try {
    return WebAssembly.validate(new Uint8Array(bytes));
  } catch {
    return false;
  }
}

/** Why the threads build cannot run here (a sentence), or "" when it may. */
function oneThreadReason(threads) {
  // Today's browsers start no workers from a shared worker that could share its memory.
  if (inSharedWorker)
    return "one thread: the shared engine (one for every tab of this site) runs without the threads build's workers";
  return (
    threadsUnavailable(threads) ||
    (poolHost ? "" : "one thread: the page that started the engine does not host its thread pool")
  );
}

/** Ask the page for `threads` pool workers running the module of `init`; resolves once they wait. */
function startPool(threads, init) {
  return new Promise((resolve, reject) => {
    const done = (error) => {
      clearTimeout(timer);
      self.removeEventListener("message", onMessage);
      if (error) {
        self.postMessage({ type: "stop-pool" });
        reject(new Error(error));
      } else resolve();
    };
    const onMessage = ({ data }) => {
      if (data?.type === "pool-started") done();
      else if (data?.type === "pool-failed") done(data.message);
    };
    const timer = setTimeout(
      () => done(`the page did not start the thread pool within ${POOL_START_MS / 1000} s`),
      POOL_START_MS,
    );
    self.addEventListener("message", onMessage);
    self.postMessage({ type: "start-pool", threads, init, script: new URL("./pool-worker.js", import.meta.url).href });
  });
}
