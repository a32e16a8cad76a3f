// The inference worker: chooses the backend, downloads (with the Cache API) and loads the model
// (on WebGPU streamed straight into GPU buffers, on the CPU path into wasm memory), and runs the
// generation loop, one token per step, posting each token as soon as it is known. The page
// stays responsive, and between tokens the worker yields so that an "abort" message gets in.
//
// Messages in:  {type:"load", id, spec, options} | {type:"generate", id, prompt | ids, options}
//               {type:"chat", id, messages, options} | {type:"render-chat", id, messages}
//               {type:"sampler-view", id, ids, logits, options, history}
//               {type:"abort", id} | {type:"score", id, text, after} | {type:"cancel-load", id}
//               {type:"preflight", id, spec, options} (what a load would cost, before it)
//               {type:"unload"} | {type:"simulate-gpu-loss"} (tests: WebGPU lost as in a reset)
//               Each message names its `slot`: one page may share this worker among several
//               NextToken instances (several <next-token> elements), each with its own model.
// Messages out: {type:"progress", id, file, loaded, total, fromCache, part, parts, doneBytes}
//               {type:"loaded", id, info, timings} | {type:"token", id, token}
//               {type:"backend", id, info} (a lost GPU's model moved to the CPU path)
//               {type:"done", id, summary, messages, promptIds, beamTree} | {type:"result", id, value}
//               {type:"warning", id, message} | {type:"error", id, message, retryable}

import { loadWasm } from "./wasm.js";
import {
  fetchModelFile,
  dropOldCaches,
  deleteCached,
  splitPartUrls,
  listCached,
  roundMegabytes as mb,
} from "./model-cache.js";

let ready = null;
const engines = new Map(); // slot -> the model's engine
const loads = new Map(); // slot -> how its GGUF model was loaded (to move it to the CPU path)
let sessionId = null;
let sessionSlot = null;
const aborted = new Set();
const loadAborts = new Map();

// The wasm module's exports (BackendChoice, ByteSink, GgufStream, Engine, version, threads), once loaded.
let wasm = null;

function wasmReady() {
  ready ??= loadWasm().then((m) => {
    wasm = m;
    dropOldCaches().catch(() => {});
  });
  return ready;
}

const post = (msg) => self.postMessage(msg);
const errorMessage = (e) => e?.message || String(e);

/** Let queued messages (an abort) run before the next token. */
const yieldToEvents = () =>
  new Promise((resolve) => {
    const ch = new MessageChannel();
    ch.port1.onmessage = () => resolve();
    ch.port2.postMessage(0);
  });

async function fetchText(url, id, file, signal, cache = true) {
  const parts = [];
  const got = await fetchModelFile(url, {
    signal,
    cache,
    onChunk: (c) => parts.push(c.slice()),
    onProgress: (p) => post({ type: "progress", id, file, ...p }),
  });
  if (got.cacheWarning) post({ type: "warning", id, message: got.cacheWarning });
  const all = new Uint8Array(got.bytes);
  let o = 0;
  for (const p of parts) {
    all.set(p, o);
    o += p.length;
  }
  return all;
}

async function load({ id, slot, spec, options = {} }) {
  const controller = new AbortController();
  loadAborts.set(id, controller);
  const signal = controller.signal;
  const t0 = performance.now();
  try {
    await wasmReady();
    // A generation on the old model stops first (another slot's runs on).
    if (sessionId !== null && sessionSlot === slot) aborted.add(sessionId);
    await running;
    // Free the previous model before allocating the next: wasm memory never shrinks, but freed
    // space is reused.
    unload({ slot });
    let engine;
    let timings = {};
    let backendReason; // why "auto" chose the backend, when it measured or remembered
    if (spec.kind === "table") {
      // Table models are a few hundred bytes: always fetched fresh (the service worker keeps the
      // lesson tables for offline use).
      const bytes = await fetchText(spec.url, id, "model", signal, false);
      const t1 = performance.now();
      engine = wasm.Engine.loadTable(new TextDecoder().decode(bytes));
      timings = { downloadMs: t1 - t0, initMs: performance.now() - t1 };
    } else {
      // The tokenizer first (small). Without a tokenizer URL, null: the tokenizer is built from
      // the GGUF's own metadata (and the error says so when the file has none).
      const tokenizer = spec.tokenizer ? await fetchText(spec.tokenizer, id, "tokenizer", signal) : null;
      const loadOptions = {
        backend: options.backend || "auto",
        maxSeq: options.maxSeq || 2048,
        exact: !!options.exact,
        threads: options.threads,
        allowSoftwareGpu: !!options.allowSoftwareGpu,
      };
      // Then the backend, before the download: on WebGPU the weights stream from the download
      // straight into GPU buffers; the CPU path needs them in wasm memory. "auto" never takes a
      // software adapter (BackendChoice.choose), and takes the CPU path at once where an earlier
      // load of this model on this adapter measured it faster.
      let choice = await wasm.BackendChoice.choose(loadOptions);
      const auto = choice.cpuFallback;
      const key = auto ? verdictKey(spec, choice.adapter, loadOptions) : null;
      let verdict = key && (await recallVerdict(key));
      const remembered =
        verdict && `${verdict.reason} (measured ${verdict.date}, remembered for this model and adapter)`;
      if (verdict && !verdict.gpu) {
        choice.free();
        choice = wasm.BackendChoice.cpu(remembered);
        backendReason = remembered;
      }
      const onCpu = async (why) => {
        const cpu = wasm.BackendChoice.cpu(why);
        try {
          return await loadGguf(spec, id, signal, cpu, tokenizer, loadOptions);
        } finally {
          cpu.free();
        }
      };
      let got;
      try {
        got = await loadGguf(spec, id, signal, choice, tokenizer, loadOptions);
      } catch (e) {
        // WebGPU could not take the model (out of GPU memory, a lost device, a shape its kernels
        // do not handle): with backend "auto", the CPU path, from what the first attempt cached
        // (or resuming it).
        if (!(e?.gpuFailure && choice.cpuFallback) || signal.aborted) throw e;
        got = await onCpu(`WebGPU failed (${errorMessage(e)}); running on the CPU`);
      } finally {
        choice.free();
      }
      engine = got.engine;
      const t1 = performance.now();
      if (engine.info().backend === "webgpu") {
        // The GPU checked against the CPU oracle on a tiny model like this one; with "auto" and
        // no remembered verdict, also both backends timed. A GPU that fails the check, or is
        // slower here, leaves the model to the CPU path (read again from the cache).
        let why = null;
        let wrong = false; // the GPU failed its check: it must not keep the model
        try {
          if (!auto) {
            // backend "gpu": WebGPU whatever the check says, with a warning when it fails.
            await engine
              .checkGpu()
              .catch((e) => post({ type: "warning", id, message: `backend "gpu": ${errorMessage(e)}` }));
          } else if (verdict) {
            await engine.checkGpu();
            backendReason = remembered;
          } else {
            verdict = {
              ...(await engine.autoVerdict(loadOptions.exact, loadOptions.threads ?? wasm.threads)),
              date: new Date().toISOString().slice(0, 10),
            };
            await rememberVerdict(key, verdict);
            backendReason = verdict.reason;
            if (!verdict.gpu) why = verdict.reason;
          }
        } catch (e) {
          if (signal.aborted) throw e;
          why = `auto: ${errorMessage(e)}; running on the CPU`;
          wrong = true;
          // A GPU that computed wrongly is remembered; one lost on the way is tried again.
          if (!/GPU device lost/.test(why))
            await rememberVerdict(key, { gpu: false, reason: why, date: new Date().toISOString().slice(0, 10) });
        }
        if (why) {
          // The GPU's engine goes only once the CPU path has the model: a model the CPU path
          // cannot hold (wasm memory) stays on a GPU that was only slower.
          try {
            const cpu = (await onCpu(why)).engine;
            engine.free();
            engine = cpu;
            backendReason = why;
          } catch (e) {
            if (wrong || signal.aborted) {
              engine.free();
              throw e;
            }
            post({
              type: "warning",
              id,
              message: `${why}, but the CPU path could not load it (${errorMessage(e)}): WebGPU keeps it`,
            });
          }
        }
      }
      if (options.draft) await addDraft(engine, options.draft, id, signal, loadOptions);
      loads.set(slot, { spec, tokenizer, loadOptions, auto });
      timings = {
        downloadMs: got.downloadMs - t0,
        initMs: t1 - got.downloadMs,
        backendMs: performance.now() - t1,
        fromCache: got.fromCache,
      };
    }
    engines.set(slot, engine);
    post({ type: "loaded", id, info: infoOf(engine, backendReason), timings });
  } catch (e) {
    const cancelled = signal.aborted;
    const retryable = cancelled || (e?.name === "DownloadError" ? e.retryable : false);
    post({ type: "error", id, message: cancelled ? "loading was cancelled" : errorMessage(e), retryable });
  } finally {
    loadAborts.delete(id);
  }
}

/**
 * Speculative decoding's draft model for `engine`: `spec` loaded on the CPU path (a small model's
 * one-token passes cost little there, whatever runs the main model), its tokenizer the main
 * model's. Its engine is freed once the main one holds the model.
 */
async function addDraft(engine, spec, id, signal, loadOptions) {
  if (spec.kind !== "gguf") throw new Error("draft: a draft model is a GGUF model");
  const cpu = wasm.BackendChoice.cpu("a draft model runs on the CPU path");
  try {
    const draft = await loadGguf(spec, id, signal, cpu, null, { ...loadOptions, backend: "cpu" });
    try {
      engine.setDraft(draft.engine);
    } finally {
      draft.engine.free();
    }
  } catch (e) {
    engine.free();
    throw new Error(`draft model ${spec.url}: ${errorMessage(e)}`);
  } finally {
    cpu.free();
  }
}

/**
 * What a loaded engine reports: wasmMemoryBytes, the module's memory now (it only grows): with
 * weightsInWasmBytes, what the model costs there (on WebGPU a streamed load adds about its
 * header, not its weights); backendReason, why "auto" chose the backend it did, when it measured.
 */
function infoOf(engine, backendReason) {
  return {
    ...engine.info(),
    backendReason,
    version: wasm.version(),
    threads: wasm.threads,
    threadsNote: wasm.threadsNote ?? "",
    wasmMemoryBytes: wasm.wasmMemoryBytes(),
  };
}

// "auto"'s verdicts (engine.autoVerdict: the GPU's check, and which backend decodes this model
// faster on this device), kept in the Cache API per model, adapter, CPU options and build, so a
// later load goes straight to the faster backend. Storage failures only cost a new measurement.
const VERDICTS = "nexttoken-backend-v1";

function verdictKey(spec, adapter, { exact, threads }) {
  const url = new URL(spec.url, self.location.href).href;
  const cpu = `${exact ? "exact" : "fast"}, ${Math.min(threads ?? wasm.threads, wasm.threads)} threads`;
  return `https://nexttoken.invalid/verdict?${new URLSearchParams({ url, adapter, cpu, version: wasm.version() })}`;
}

async function recallVerdict(key) {
  try {
    const r = await (await caches.open(VERDICTS)).match(key);
    return r ? await r.json() : null;
  } catch {
    return null;
  }
}

async function rememberVerdict(key, verdict) {
  try {
    await (await caches.open(VERDICTS)).put(
      key,
      new Response(JSON.stringify(verdict), { headers: { "content-type": "application/json" } }),
    );
  } catch {
    // No Cache API (an opaque origin), or no quota: measured again next time.
  }
}

/**
 * Download the GGUF of `spec` and load it on the backend of `choice`: on WebGPU, a whole model in
 * one file of known size streams from the download straight into GPU buffers (a GgufStream: the
 * weights never enter wasm memory); otherwise (the CPU path, a split model, a download of unknown
 * length) the bytes go into a wasm ByteSink and Engine.loadGguf takes them (on WebGPU uploads
 * them, then releases them). Resolves to {engine, fromCache, downloadMs (when the download ended)}.
 * A file that is not a usable model is removed from the cache, unless only its own tokenizer
 * failed (a retry with a tokenizer.json should not download it again); an error the GPU caused
 * has `gpuFailure` set (the caller may go on on the CPU path) and keeps what was cached.
 */
async function loadGguf(spec, id, signal, choice, tokenizer, loadOptions) {
  const urls = splitPartUrls(spec.url);
  let sink = null;
  let stream = null;
  let tokenizerError = null; // the GGUF's own tokenizer failed: the rest downloads, unused
  const onPart = (i, parts) => ({
    // For a split model `spec.size` is the whole's, when known.
    onStart: async ({ total }) => {
      if (i > 0) return sink.reserve(total);
      const size = (parts > 1 && spec.size) || total || spec.size || 0;
      const streaming = choice.backend === "webgpu" && parts === 1 && total > 0;
      // WebAssembly's memory bounds the model unless it streams to the GPU with no CPU fallback.
      await preflight(urls[0], size, id, !streaming || choice.cpuFallback);
      sink?.free();
      stream?.free();
      sink = stream = null;
      tokenizerError = null;
      // One allocation of the announced size, the chunks copied straight into it; each later
      // part grows it by exactly its own size.
      if (streaming) stream = new wasm.GgufStream(choice, total, tokenizer, loadOptions);
      else sink = new wasm.ByteSink(size);
    },
    onChunk: (chunk) => {
      if (sink) return sink.push(chunk);
      if (tokenizerError) return;
      try {
        stream.push(chunk);
      } catch (e) {
        if (spec.tokenizer || !/^tokenizer: /.test(errorMessage(e))) throw e;
        tokenizerError = e;
      }
    },
  });
  let fromCache;
  let engine;
  try {
    fromCache = await fetchParts(spec, urls, id, signal, onPart);
    if (tokenizerError) throw tokenizerError;
    if ((!sink && !stream) || (sink && !sink.length))
      throw new Error(`the server sent an empty file for ${spec.url.split("/").pop()}: it is not a model`);
    const downloadMs = performance.now();
    if (stream) {
      const s = stream;
      stream = null;
      engine = await s.finish();
    } else {
      const s = sink;
      sink = null;
      // On WebGPU the engine uploads the bytes, then releases them.
      engine = await wasm.Engine.loadGguf(s, tokenizer, loadOptions, choice.share());
    }
    return { engine, fromCache, downloadMs };
  } catch (e) {
    sink?.free();
    stream?.free();
    if (signal.aborted || e?.name === "DownloadError") throw e;
    const message = errorMessage(e);
    if (/^model: GPU/.test(message)) {
      e.gpuFailure = true;
      throw e;
    }
    // The file (every part of it) is not a usable model: do not keep it. Unless only the GGUF's
    // own tokenizer failed ("tokenizer: ...": no tokenizer metadata, or a kind we do not build; a
    // file that does not parse is a "GGUF: ..." error): the tokenizer is built from the header
    // before the model is looked at, and a retry with a tokenizer.json URL should not download
    // it again. Other failures (out of wasm memory) keep what arrived, to resume.
    const ownTokenizerFailed = !spec.tokenizer && /^tokenizer: /.test(message);
    if (/^(GGUF|model|tokenizer|chat template): /.test(message) && !ownTokenizerFailed) await deleteAll(urls);
    if (spec.tokenizer) await deleteCached(new URL(spec.tokenizer, self.location.href).href).catch(() => {});
    throw e;
  }
}

/**
 * Fetch every part of the GGUF of `spec` (one file, or the parts of a model split by gguf-split,
 * from the URL of its first part), in order, each cached on its own, each piece to
 * `onPart(i, parts).onChunk`; progress messages say which part. Resolves to whether every part
 * came from the cache.
 */
async function fetchParts(spec, urls, id, signal, onPart) {
  const parts = urls.length;
  if (parts > 1 && spec.sha256 && !(Array.isArray(spec.sha256) && spec.sha256.length === parts)) {
    throw new Error(
      `${spec.url} is part 1 of ${parts} of a split model: give its sha256 as a list of ${parts}, one per part`,
    );
  }
  let fromCache = true;
  let doneBytes = 0; // of the parts before this one
  try {
    for (let i = 0; i < parts; i++) {
      const got = await fetchModelFile(urls[i], {
        signal,
        sha256: parts > 1 ? spec.sha256?.[i] : spec.sha256,
        ...onPart(i, parts),
        onProgress: (p) => post({ type: "progress", id, file: "model", part: i + 1, parts, doneBytes, ...p }),
      });
      if (got.cacheWarning) post({ type: "warning", id, message: got.cacheWarning });
      fromCache &&= got.fromCache;
      doneBytes += got.bytes;
    }
  } catch (e) {
    // A part that cannot be had at all (404) makes the others useless; a network error may pass.
    if (parts > 1 && e?.name === "DownloadError" && !e.retryable) await deleteAll(urls);
    throw e;
  }
  return fromCache;
}

/** WebAssembly memory is 32-bit: the model's bytes and everything else share 4 GiB. */
const WASM_MEMORY_LIMIT = 4 * 2 ** 30;

/** A file of `size` bytes leaves no room for a KV cache in wasm memory. */
const tooLargeForWasm = (size) => size > WASM_MEMORY_LIMIT * 0.9;

/**
 * Before a download: refuse a model that cannot fit in WebAssembly memory (`inWasm`: unless it
 * streams to WebGPU with no CPU fallback, `backend: "gpu"`: then the GPU's memory is the limit),
 * and warn when the browser's storage cannot keep it (it then runs but is downloaded again next
 * time).
 */
async function preflight(url, size, id, inWasm = true) {
  if (!size) return;
  const name = decodeURIComponent(new URL(url).pathname.split("/").pop());
  const gb = (n) => `${(n / 1e9).toFixed(2)} GB`;
  if (inWasm && tooLargeForWasm(size)) {
    throw new Error(
      `${name} is ${gb(size)} (as the server announced it): more than the ${gb(WASM_MEMORY_LIMIT)} WebAssembly memory can hold with room for the KV cache; pick a smaller model or a stronger quantisation`,
    );
  }
  const estimate = await navigator.storage?.estimate?.().catch(() => null);
  if (estimate?.quota && size > estimate.quota - (estimate.usage || 0)) {
    post({
      type: "warning",
      id,
      message: `${name} (${gb(size)}) is more than the ${gb(estimate.quota - (estimate.usage || 0))} of storage this browser offers: it runs now but cannot be kept for offline use`,
    });
  }
}

/** A GGUF header larger than this is not read by a preflight (the largest vocabularies' are ~10 MB). */
const MAX_HEADER_BYTES = 64 << 20;

/**
 * What loading `spec` would cost, known before a byte of its weights: its size (the catalog's,
 * else the server's answer to HEAD or to a one-byte range), its header (the file's first bytes,
 * by a Range request or a download cut short), the memory a load needs against what this tab can
 * hold, the storage to keep it, and the CPU path's decode speed to expect here (preflightGguf:
 * a short calibration on random models). `refusal` says why it cannot run here ("" when it can).
 */
async function preflightModel({ spec, options = {} }) {
  await wasmReady();
  const url = spec.url;
  const name = decodeURIComponent(new URL(url).pathname.split("/").pop());
  const stored = (await listCached().catch(() => [])).find((e) => e.url === url && e.complete);
  const size = spec.size || stored?.size || (await remoteSize(url, name));
  const out = { url, name, kind: spec.kind, sizeBytes: size, cached: !!stored, downloadBytes: stored ? 0 : size };
  out.warnings = [];
  out.refusal = "";
  if (spec.kind === "table") return out;
  if (splitPartUrls(url).length > 1) {
    out.warnings.push("a split model: its size is its first part's, and its header is not read");
    return out;
  }
  // The CPU path holds the weights in wasm memory; a GPU-only load streams them past it.
  const gpuOnly = options.backend === "gpu";
  if (!gpuOnly && tooLargeForWasm(size)) {
    out.refusal = `${name} is ${mb(size)}: more than the ${mb(WASM_MEMORY_LIMIT)} WebAssembly memory can hold with room for the KV cache; pick a smaller model or a stronger quantisation`;
    return out; // its header is not worth reading
  }
  const maxSeq = options.maxSeq || 2048;
  const threads = Math.min(options.threads ?? wasm.threads, wasm.threads);
  let n = Math.min(size, 256 << 10);
  let r;
  for (;;) {
    r = wasm.preflightGguf(await firstBytes(url, n, name), size, maxSeq, !!options.exact, threads);
    if (!r.needMore) break;
    if (r.needMore > MAX_HEADER_BYTES) throw new Error(`${name}: its header is over ${mb(MAX_HEADER_BYTES)}`);
    n = Math.min(size, Math.max(r.needMore, 2 * n));
  }
  Object.assign(out, { plan: r.plan, memoryBytes: r.memoryBytes, cpu: r.cpu, headerBytes: n });
  const deviceBytes = navigator.deviceMemory ? navigator.deviceMemory * 2 ** 30 : null;
  out.memoryLimitBytes = gpuOnly ? deviceBytes : Math.min(WASM_MEMORY_LIMIT, deviceBytes ?? Infinity);
  out.deviceMemoryBytes = deviceBytes;
  if (!gpuOnly && r.memoryBytes > WASM_MEMORY_LIMIT)
    out.refusal = `${name} needs about ${mb(r.memoryBytes)} of memory (the file, its KV cache for ${maxSeq} positions and the engine): more than the ${mb(WASM_MEMORY_LIMIT)} WebAssembly memory can hold; pick a smaller model or a stronger quantisation`;
  else if (deviceBytes && r.memoryBytes > deviceBytes)
    out.refusal = `${name} needs about ${mb(r.memoryBytes)} of memory: more than this device's ${mb(deviceBytes)}`;
  else if (deviceBytes && r.memoryBytes > deviceBytes / 2)
    out.warnings.push(
      `${name} needs about ${mb(r.memoryBytes)}, over half this device's memory: the tab may be closed`,
    );
  const estimate = await navigator.storage?.estimate?.().catch(() => null);
  out.storageAvailableBytes = estimate?.quota ? estimate.quota - (estimate.usage || 0) : null;
  if (!stored && out.storageAvailableBytes !== null && size > out.storageAvailableBytes)
    out.warnings.push(
      `${name} is more than the ${mb(out.storageAvailableBytes)} of storage this browser offers: it can run but not be kept for offline use`,
    );
  return out;
}

/** A file's size from the server: HEAD, else a one-byte range (Content-Range says the whole). */
async function remoteSize(url, name) {
  const head = await fetch(url, { method: "HEAD" }).catch(() => null);
  const length = Number(head?.ok && head.headers.get("content-length"));
  if (length > 0) return length;
  const res = await fetch(url, { headers: { range: "bytes=0-0" } }).catch((e) => {
    throw new Error(`cannot reach ${name}: ${errorMessage(e)}`);
  });
  await res.body?.cancel().catch(() => {});
  const total = Number(/\/(\d+)$/.exec(res.headers.get("content-range") || "")?.[1]);
  if (total > 0) return total;
  if (!res.ok) throw new Error(`${name}: HTTP ${res.status}`);
  throw new Error(`${name}: the server does not say how large it is`);
}

/** The first `n` bytes of `url`: a Range request, or a download cut short where ranges are ignored. */
async function firstBytes(url, n, name) {
  const res = await fetch(url, { headers: { range: `bytes=0-${n - 1}` } }).catch((e) => {
    throw new Error(`cannot reach ${name}: ${errorMessage(e)}`);
  });
  if (!res.ok) throw new Error(`${name}: HTTP ${res.status}`);
  const out = new Uint8Array(n);
  let got = 0;
  const reader = res.body.getReader();
  while (got < n) {
    const { done, value } = await reader.read();
    if (done) break;
    const take = Math.min(value.length, n - got);
    out.set(value.subarray(0, take), got);
    got += take;
  }
  await reader.cancel().catch(() => {});
  return out.subarray(0, got);
}

const deleteAll = (urls) => Promise.all(urls.map((u) => deleteCached(u).catch(() => {})));

function unload({ slot }) {
  engines.get(slot)?.free?.();
  engines.delete(slot);
}

// One generation at a time: a new one first stops the one running on its slot and waits for its
// loop to end, so an old loop can never touch the new session (and the new one can take over the
// KV cache the old one leaves). Another slot's generation waits its turn instead.
let running = Promise.resolve();

function generate(msg) {
  if (sessionId !== null && sessionSlot === msg.slot) aborted.add(sessionId);
  const previous = running;
  running = previous.then(() => run(msg));
}

async function run({ id, slot, type, prompt, ids, messages, options = {} }) {
  if (aborted.has(id)) {
    // Aborted while it waited for the previous one.
    aborted.delete(id);
    post({ type: "done", id, summary: null });
    return;
  }
  let engine = engines.get(slot);
  if (!engine) {
    post({ type: "error", id, message: "no model is loaded" });
    return;
  }
  let session = null;
  sessionId = id;
  sessionSlot = slot;
  const generated = []; // the ids streamed so far (a lost GPU's text continues from them)
  try {
    if (type === "chat") session = engine.startChat(messages, options);
    else if (ids) session = engine.startIds(Uint32Array.from(ids), options);
    else session = engine.start(prompt, options);
    for (;;) {
      if (aborted.has(id)) {
        session.abort();
        break;
      }
      let token;
      try {
        token = await session.next();
      } catch (e) {
        // WebGPU lost mid-generation (a driver reset, the tab's GPU process gone): the model
        // moves to the CPU path and the text goes on from what was streamed (a beam search
        // cannot resume: it ends with the error, the model on the CPU path for the next one).
        const load = loads.get(slot);
        if (!load || !/GPU device lost/.test(errorMessage(e))) throw e;
        if ((options.beams ?? 1) > 1) {
          session.free();
          session = null;
          await moveToCpu(
            id,
            slot,
            load,
            `WebGPU was lost (${errorMessage(e)}): the model moved to the CPU path; run the beam search again`,
          );
          throw e;
        }
        const promptIds = Array.from(session.promptIds);
        session.free();
        session = null;
        engine = await moveToCpu(
          id,
          slot,
          load,
          `WebGPU was lost (${errorMessage(e)}) after ${generated.length} tokens: the model moved to the CPU path`,
        );
        const rest = { ...options, maxTokens: (options.maxTokens ?? options.max_tokens ?? 256) - generated.length };
        if (options.constraint) rest.constraintPrefix = (options.constraintPrefix ?? 0) + generated.length;
        if (options.forceTokens) rest.forceTokens = options.forceTokens.slice(generated.length);
        if (rest.maxTokens <= 0) break;
        session = engine.startIds(Uint32Array.from([...promptIds, ...generated]), rest);
        continue;
      }
      if (token === null) break;
      generated.push(token.id);
      post({ type: "token", id, token });
      await yieldToEvents();
    }
    post({
      type: "done",
      id,
      summary: session?.summary() ?? null,
      messages: session?.messages,
      promptIds: session && Array.from(session.promptIds),
      beamTree: session?.beamTree,
    });
  } catch (e) {
    post({ type: "error", id, message: errorMessage(e) });
  } finally {
    // The engine keeps what the session computed (its KV cache) for the next one.
    session?.free();
    aborted.delete(id);
    sessionId = null;
    sessionSlot = null;
  }
}

/** The slot's model loaded again on the CPU path (from the cache), replacing its GPU engine. */
async function moveToCpu(id, slot, load, why) {
  post({ type: "warning", id, message: why });
  const cpu = wasm.BackendChoice.cpu(why);
  try {
    const { engine } = await loadGguf(
      load.spec,
      id,
      new AbortController().signal,
      cpu,
      load.tokenizer,
      load.loadOptions,
    );
    engines.get(slot)?.free();
    engines.set(slot, engine);
    post({ type: "backend", id, info: infoOf(engine, why) });
    return engine;
  } finally {
    cpu.free();
  }
}

async function score({ id, slot, text, after }) {
  const engine = engines.get(slot);
  try {
    if (!engine) throw new Error("no model is loaded");
    post({ type: "result", id, value: await engine.score(text, after ?? undefined) });
  } catch (e) {
    post({ type: "error", id, message: errorMessage(e) });
  }
}

self.onmessage = (event) => {
  const msg = event.data;
  switch (msg.type) {
    case "load":
      load(msg);
      break;
    case "generate":
    case "chat":
      generate(msg);
      break;
    case "abort":
      aborted.add(msg.id);
      break;
    case "cancel-load":
      loadAborts.get(msg.id)?.abort();
      break;
    case "score":
      score(msg);
      break;
    case "preflight":
      preflightModel(msg).then(
        (value) => post({ type: "result", id: msg.id, value }),
        (e) => post({ type: "error", id: msg.id, message: errorMessage(e) }),
      );
      break;
    case "sampler-view":
      try {
        if (!wasm) throw new Error("the engine is not loaded yet");
        const { ids, logits, options, history } = msg;
        post({
          type: "result",
          id: msg.id,
          value: wasm.samplerView(Uint32Array.from(ids), Float32Array.from(logits), options, Uint32Array.from(history)),
        });
      } catch (e) {
        post({ type: "error", id: msg.id, message: errorMessage(e) });
      }
      break;
    case "unload":
      unload(msg);
      break;
    case "simulate-gpu-loss":
      // Tests of the fallback path: the slot's WebGPU device is destroyed as a driver reset would.
      engines.get(msg.slot)?.simulateGpuLoss();
      break;
    case "render-chat": {
      const engine = engines.get(msg.slot);
      try {
        if (!engine) throw new Error("no model is loaded");
        post({ type: "result", id: msg.id, value: engine.renderChat(msg.messages, msg.addGenerationPrompt !== false) });
      } catch (e) {
        post({ type: "error", id: msg.id, message: errorMessage(e) });
      }
      break;
    }
    case "info":
      post({ type: "result", id: msg.id, value: engines.get(msg.slot)?.info() ?? null });
      break;
  }
};
