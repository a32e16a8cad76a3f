// The page's side of the wasm threads build: it starts the thread pool's Web Workers when the
// inference worker asks, because Firefox sometimes blocks a worker for good inside `new Worker()`
// when that worker starts workers of its own (src/web/pool.rs has the steps).
//
// Messages from the inference worker: {type:"start-pool", threads, script, init} | {type:"stop-pool"}
// Messages to it: {type:"pool-host"} (first: this page starts pools) | {type:"pool-started"}
//                 | {type:"pool-failed", message}

/**
 * Why the wasm threads build cannot run in this page or worker with `threads` threads (a
 * sentence), or "" when it may: it needs more than one core, cross-origin isolation and
 * SharedArrayBuffer.
 */
export function threadsUnavailable(threads = globalThis.navigator?.hardwareConcurrency || 1) {
  if (threads <= 1) return "one thread: one was asked for, or the device reports one core";
  if (!globalThis.crossOriginIsolated)
    return "one thread: the page is not cross-origin isolated (the threads build needs the headers Cross-Origin-Opener-Policy: same-origin and Cross-Origin-Embedder-Policy: require-corp)";
  // WebKitGTK, for one, keeps it off on an isolated page unless told otherwise.
  if (typeof SharedArrayBuffer === "undefined")
    return "one thread: this browser keeps SharedArrayBuffer off although the page is cross-origin isolated";
  return "";
}

/**
 * A module worker for `url`. The Worker constructor refuses a script of another origin (a page
 * that loads nexttoken from a CDN): then a same-origin blob: module worker imports it instead, so
 * the host needs only CORS. (The blob URL stays alive: the worker fetches it after this returns.)
 * The engine's worker and the thread pool's workers both start this way.
 */
export function moduleWorker(url) {
  const here = globalThis.document?.baseURI ?? self.location.href;
  url = new URL(url, here);
  if (url.origin === new URL(here).origin) return new Worker(url, { type: "module" });
  const trampoline = new Blob([`import ${JSON.stringify(url.href)};`], { type: "text/javascript" });
  return new Worker(URL.createObjectURL(trampoline), { type: "module" });
}

/**
 * Start pools for `worker` (an inference worker running worker.js) when it asks. Returns a
 * function that ends the pool's workers (call it when terminating `worker`).
 */
export function hostPool(worker) {
  // Held here, which also keeps the workers from being garbage collected while they run.
  let threads = [];
  const stop = () => {
    for (const t of threads) t.terminate();
    threads = [];
  };
  worker.addEventListener("message", async ({ data }) => {
    if (data?.type === "stop-pool") return stop();
    if (data?.type !== "start-pool") return;
    try {
      const started = Array.from({ length: data.threads }, () => moduleWorker(data.script));
      threads.push(...started);
      await Promise.all(started.map((t) => ready(t, data.init)));
      worker.postMessage({ type: "pool-started" });
    } catch (e) {
      stop();
      worker.postMessage({ type: "pool-failed", message: e?.message || String(e) });
    }
  });
  worker.postMessage({ type: "pool-host" });
  return stop;
}

/** Send a pool worker the module and memory; resolves once it has instantiated them. */
function ready(thread, init) {
  return new Promise((resolve, reject) => {
    thread.onmessage = ({ data }) => {
      thread.onmessage = null;
      if (data?.type === "pool-thread-ready") resolve();
      else reject(new Error(`a pool thread failed: ${data?.message}`));
    };
    thread.onerror = (e) => reject(new Error(`a pool thread failed to start: ${e.message || "no script?"}`));
    thread.postMessage(init);
  });
}
