// One thread of the wasm engine's pool (the threads build), started by the page (pool.js): it
// instantiates the module on the inference worker's shared memory, says so, then runs the rayon
// thread that the inference worker hands over (for good: rayon's threads never return).
self.onmessage = async ({ data: { mainJS, module, memory } }) => {
  self.onmessage = null;
  let pkg;
  try {
    pkg = await import(mainJS);
    await pkg.default({ module_or_path: module, memory });
  } catch (e) {
    self.postMessage({ type: "pool-thread-failed", message: e?.message || String(e) });
    return;
  }
  self.postMessage({ type: "pool-thread-ready" });
  pkg.poolThread();
};
