// Loads the wasm engine. On a cross-origin isolated page (SharedArrayBuffer available) with more
// than one core, the threads build (pkg-threads/, built by ./build.sh) with a pool of Web Workers
// that share its memory, so the CPU path runs on several cores; otherwise, or if that fails, the
// one-thread build (pkg/). The pool's workers are started by the page that started this worker
// (pool.js: hostPool; from a CDN, as blob: workers of the page's origin that import the CDN's
// script), which says so with a "pool-host" message; without it, one thread.
// A shared worker (one engine for every tab, worker.js) runs one thread.
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

export async function loadWasm({ threads = navigator.hardwareConcurrency || 1 } = {}) {
  threads = Math.min(threads, MAX_POOL_THREADS);
  let threadsNote = oneThreadReason(threads);
  if (!threadsNote) {
    try {
      const mainJS = new URL("./pkg-threads/nexttoken.js", import.meta.url).href;
      const m = await import(mainJS);
      await m.default({ module_or_path: new URL("./pkg-threads/nexttoken_bg.wasm", import.meta.url) });
      await startPool(threads, { mainJS, module: m.poolModule(), memory: m.poolMemory() });
      return { ...m, threads: m.buildPool(threads) };
    } catch (e) {
      threadsNote = `one thread: the threads build did not start (${e?.message || e})`;
      console.warn(`wasm threads build unavailable (${e?.message || e}); running one thread`);
    }
  }
  const m = await import("./pkg/nexttoken.js");
  await m.default({ module_or_path: new URL("./pkg/nexttoken_bg.wasm", import.meta.url) });
  return { ...m, threads: 1, threadsNote };
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
