// Loads the wasm engine. On a cross-origin isolated page (SharedArrayBuffer available) with more
// than one core, the threads build (pkg-threads/, built by ./build.sh) with a pool of Web Workers
// that share its memory, so the CPU path runs on several cores; otherwise, or if that fails, the
// one-thread build (pkg/), also when this script comes from another origin than the page.
// Resolves to the module's exports plus `threads` (the pool's size).
export async function loadWasm({ threads = navigator.hardwareConcurrency || 1 } = {}) {
  // The pool's workers start from a URL beside this script: impossible when the script comes from
  // another origin (a CDN; this worker then runs from a blob: trampoline).
  const sameOrigin = new URL(import.meta.url).origin === self.location.origin;
  if (globalThis.crossOriginIsolated && threads > 1 && sameOrigin) {
    try {
      const m = await import("./pkg-threads/nexttoken.js");
      await m.default({ module_or_path: new URL("./pkg-threads/nexttoken_bg.wasm", import.meta.url) });
      return { ...m, threads: await m.initThreads(threads) };
    } catch (e) {
      console.warn(`wasm threads build unavailable (${(e && e.message) || e}); running one thread`);
    }
  }
  const m = await import("./pkg/nexttoken.js");
  await m.default({ module_or_path: new URL("./pkg/nexttoken_bg.wasm", import.meta.url) });
  return { ...m, threads: 1 };
}
