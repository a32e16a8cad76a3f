// The inference worker: chooses the backend, downloads (with the Cache API) and loads the model
// (on WebGPU streamed straight into GPU buffers, on the CPU path into wasm memory), and runs the
// generation loop, one token per step, posting each token as soon as it is known. The page
// stays responsive, and between tokens the worker yields so that an "abort" message gets in.
//
// It runs as a page's own (dedicated) worker, or as a shared worker: one engine for every page
// of the site that connects (nexttoken.js chooses). Either way each connected page is a client;
// each NextToken instance of a page names its `slot`. Slots that load the same model (the same
// URL and options) share one loaded copy of its weights, each with its own KV cache (an
// Engine's `share()`), so one page's chat never cuts back another's. Generations of different
// slots run side by side, one forward step at a time each (`exclusive`); a new generation on a
// slot first ends that slot's previous one.
//
// Messages in:  {type:"load", id, spec, options} | {type:"generate", id, prompt | ids, options}
//               {type:"chat", id, messages, options} | {type:"render-chat", id, messages}
//               {type:"sampler-view", id, ids, logits, options, history}
//               {type:"abort", id} | {type:"score", id, text, after} | {type:"cancel-load", id}
//               {type:"preflight", id, spec, options} (what a load would cost, before it)
//               {type:"unload"} | {type:"simulate-gpu-loss"} (tests: WebGPU lost as in a reset)
//               {type:"bye"} (the page is going: its slots are unloaded)
//               {type:"alive-while", lock} (the page holds the Web Lock `lock` while it lives)
//               Ids and slots are the client's own; this worker keeps them apart.
// Messages out: {type:"progress", id, file, loaded, total, fromCache, part, parts, doneBytes}
//               {type:"loaded", id, info, timings} | {type:"token", id, token}
//               {type:"backend", id, info} (a lost GPU's model moved to the CPU path)
//               {type:"done", id, summary, messages, promptIds, beamTree, reply} | {type:"result", id, value}
//               {type:"warning", id, message} | {type:"error", id, message, retryable}
//               {type:"hello"} (a shared worker, to each page as it connects)

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
const slots = new Map(); // slot -> {entry (its model), engine (its share of it), client}
const models = new Map(); // model key -> entry: one loaded model and the slots that use it
const sessions = new Map(); // slot -> id of the generation running (or waiting) on it
const slotRuns = new Map(); // slot -> the end of its latest generation
const aborted = new Set();
const loadCancels = new Map(); // load id -> cancels that request

// The wasm module's exports (BackendChoice, ByteSink, GgufStream, Engine, version, threads), once loaded.
let wasm = null;

function wasmReady() {
  ready ??= loadWasm().then((m) => {
    wasm = m;
    dropOldCaches().catch(() => {});
  });
  return ready;
}

const errorMessage = (e) => e?.message || String(e);

// Clients (pages) and their messages. Each request gets an id of this worker's own, routed back
// to its client under the client's id; a model's download reports to every request waiting for
// it (a route that fans out).
const inSharedWorker = typeof SharedWorkerGlobalScope !== "undefined" && self instanceof SharedWorkerGlobalScope;
const clients = new Set();
const routes = new Map(); // our id -> {client, id} | {fanout: Set of our ids}
const FINAL = new Set(["done", "error", "loaded", "result"]);
let nextId = 1;
let nextClient = 1;

function post(msg) {
  const route = routes.get(msg.id);
  if (!route) return; // its client has gone
  if (route.fanout) {
    if (!FINAL.has(msg.type)) for (const id of route.fanout) post({ ...msg, id });
    return;
  }
  route.client.port.postMessage({ ...msg, id: route.id });
  if (FINAL.has(msg.type)) {
    routes.delete(msg.id);
    route.client.ids.delete(route.id);
  }
}

function connect(port) {
  const client = { n: nextClient++, port, ids: new Map(), slots: new Set() };
  clients.add(client);
  port.onmessage = ({ data }) => receive(client, data);
  return client;
}

/** A client's message, its ids and slot made this worker's. */
function receive(client, msg) {
  if (!msg || typeof msg !== "object" || typeof msg.type !== "string") return;
  if (msg.type === "bye") return disconnect(client);
  if (msg.type === "alive-while") {
    // The page holds this lock while it lives: granted to us once it has gone.
    navigator.locks?.request(String(msg.lock), () => disconnect(client)).catch(() => {});
    return;
  }
  const m = { ...msg, client };
  if ("slot" in msg) m.slot = `${client.n}:${msg.slot}`;
  if ("id" in msg) {
    if (msg.type === "abort" || msg.type === "cancel-load") m.id = client.ids.get(msg.id);
    else {
      m.id = nextId++;
      client.ids.set(msg.id, m.id);
      routes.set(m.id, { client, id: msg.id });
    }
  }
  handle(m);
}

/** A page that has gone: its generations end, its slots let go of their models. */
function disconnect(client) {
  if (!clients.delete(client)) return;
  for (const id of client.ids.values()) {
    aborted.add(id);
    loadCancels.get(id)?.();
    routes.delete(id);
  }
  for (const slot of client.slots) unload({ slot });
}

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

/** The key of a loaded model: requests with the same one share it. */
const modelKey = (spec, options = {}) =>
  JSON.stringify([
    spec.kind,
    spec.url,
    spec.tokenizer ?? null,
    spec.sha256 ?? null,
    options.backend || "auto",
    options.maxSeq || 2048,
    !!options.exact,
    options.threads ?? null,
    !!options.allowSoftwareGpu,
    options.draft?.url ?? null,
  ]);

/**
 * Load a model for a slot (replacing its current one). A model that this worker holds already,
 * or is loading for another request (another page, another element), is shared: no download, no
 * second copy; the slot gets its own share (its own KV cache).
 */
async function load({ id, slot, spec, options = {}, client }) {
  const t0 = performance.now();
  let entry = null;
  let cancelled = false;
  try {
    await wasmReady();
    // A generation on the old model stops first (another slot's runs on).
    await stopSlot(slot);
    unload({ slot });
    const key = modelKey(spec, options);
    entry = models.get(key);
    const reused = !!entry;
    if (!entry) entry = startLoading(key, spec, options);
    entry.waiters.add(id);
    await Promise.race([
      entry.ready,
      new Promise((_, reject) =>
        loadCancels.set(id, () => {
          cancelled = true;
          reject(new Error("loading was cancelled"));
        }),
      ),
    ]);
    if (!clients.has(client)) return;
    const share = { entry, engine: entry.base.share(), client };
    slots.set(slot, share);
    entry.slots.add(slot);
    client.slots.add(slot);
    const timings = reused ? { reused: true, waitMs: performance.now() - t0 } : entry.timings;
    post({ type: "loaded", id, info: infoOf(share, entry.backendReason), timings });
  } catch (e) {
    cancelled ||= !!entry?.controller.signal.aborted;
    const retryable = cancelled || (e?.name === "DownloadError" ? e.retryable : false);
    post({ type: "error", id, message: cancelled ? "loading was cancelled" : errorMessage(e), retryable });
  } finally {
    loadCancels.delete(id);
    if (entry) {
      entry.waiters.delete(id);
      if (entry.base) release(entry);
      else if (!entry.waiters.size) {
        // The last request waiting for a download cancelled it: it stops.
        entry.controller.abort();
        if (models.get(entry.key) === entry) models.delete(entry.key);
      }
    }
  }
}

/**
 * Start loading a model for every request that will wait for it: an entry of `models` whose
 * `ready` resolves once `base` (the loaded engine) is there. Its progress and warnings go to each
 * waiting request (`task`: a route that fans out to `waiters`).
 */
function startLoading(key, spec, options) {
  const entry = { key, waiters: new Set(), slots: new Set(), controller: new AbortController(), base: null };
  entry.task = nextId++;
  routes.set(entry.task, { fanout: entry.waiters });
  entry.ready = loadModel(entry.task, entry.controller.signal, spec, options).then(
    (loaded) => {
      routes.delete(entry.task);
      Object.assign(entry, loaded);
      // Every request for it was cancelled as it finished.
      if (!entry.waiters.size) release(entry);
    },
    (e) => {
      routes.delete(entry.task);
      if (models.get(key) === entry) models.delete(key);
      throw e;
    },
  );
  entry.ready.catch(() => {}); // each waiter sees the failure
  models.set(key, entry);
  return entry;
}

/** A model's engine is freed when no slot uses it. */
function release(entry) {
  if (entry.slots.size || entry.waiters.size) return;
  if (models.get(entry.key) === entry) models.delete(entry.key);
  entry.base?.free();
  entry.base = null;
}

/**
 * Download and load `spec` on the backend its options ask for ("auto": measured, or what an
 * earlier measurement chose). Resolves to {base (the engine), backendReason, timings, gguf (how
 * a GGUF model was loaded, to move it to the CPU path)}. Reports to `id`.
 */
async function loadModel(id, signal, spec, options) {
  const t0 = performance.now();
  let engine;
  let gguf = null; // how a GGUF model was loaded (to move it to the CPU path)
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
    const remembered = verdict && `${verdict.reason} (measured ${verdict.date}, remembered for this model and adapter)`;
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
    gguf = { spec, tokenizer, loadOptions };
    timings = {
      downloadMs: got.downloadMs - t0,
      initMs: t1 - got.downloadMs,
      backendMs: performance.now() - t1,
      fromCache: got.fromCache,
    };
  }
  return { base: engine, backendReason, timings, gguf };
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
 * What a slot's loaded model reports: wasmMemoryBytes, the module's memory now (it only grows):
 * with weightsInWasmBytes, what the model costs there (on WebGPU a streamed load adds about its
 * header, not its weights); backendReason, why "auto" chose the backend it did, when it measured;
 * engine, "shared" (one worker for every page of the site) or "dedicated" (this page's own), with
 * how many pages it serves and how many loads share this model's one copy.
 */
function infoOf({ engine, entry }, backendReason) {
  return {
    ...engine.info(),
    backendReason,
    version: wasm.version(),
    threads: wasm.threads,
    threadsNote: wasm.threadsNote ?? "",
    wasmMemoryBytes: wasm.wasmMemoryBytes(),
    engine: inSharedWorker ? "shared" : "dedicated",
    enginePages: clients.size,
    modelUsers: entry.slots.size,
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
  let header;
  for (;;) {
    header = await firstBytes(url, n, name);
    r = wasm.preflightGguf(header, size, maxSeq, !!options.exact, threads);
    if (!r.needMore) break;
    if (r.needMore > MAX_HEADER_BYTES) throw new Error(`${name}: its header is over ${mb(MAX_HEADER_BYTES)}`);
    n = Math.min(size, Math.max(r.needMore, 2 * n));
  }
  Object.assign(out, { plan: r.plan, memoryBytes: r.memoryBytes, cpu: r.cpu, headerBytes: n });
  // Where a load would run it on WebGPU, the GPU's speed too (a load on "auto" then keeps the
  // faster of the two, measured on the model itself).
  if (options.backend !== "cpu") {
    const choice = await wasm.BackendChoice.choose({
      backend: options.backend || "auto",
      allowSoftwareGpu: !!options.allowSoftwareGpu,
    }).catch((e) => {
      out.warnings.push(`no GPU estimate: ${errorMessage(e)}`);
      return null;
    });
    try {
      if (choice?.backend === "webgpu") out.gpu = await choice.gpuEstimate(header, size);
    } catch (e) {
      out.warnings.push(`no GPU estimate: ${errorMessage(e)}`);
    } finally {
      choice?.free();
    }
  }
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

/** The slot lets go of its model (freed when no other slot uses it). */
function unload({ slot }) {
  const share = slots.get(slot);
  if (!share) return;
  slots.delete(slot);
  share.client.slots.delete(slot);
  const { entry } = share;
  entry.slots.delete(slot);
  // A model no one uses is not found by a later load (loading it again means a fresh load).
  if (!entry.slots.size && !entry.waiters.size && models.get(entry.key) === entry) models.delete(entry.key);
  // Its generation ends first: a session must not outlive its engine.
  stopSlot(slot).then(() => {
    share.engine.free();
    release(entry);
  });
}

/** End the slot's generation (if any); resolves when its loop has ended. */
function stopSlot(slot) {
  const id = sessions.get(slot);
  if (id !== undefined) aborted.add(id);
  return slotRuns.get(slot) ?? Promise.resolve();
}

// One forward step at a time in this worker: generations of different slots (pages, elements)
// take turns token by token, and no two steps ever use a model (or the GPU's queue) at once.
let steps = Promise.resolve();
function exclusive(step) {
  const result = steps.then(step);
  steps = result.catch(() => {});
  return result;
}

/**
 * A generation on a slot: it first ends the one running there and waits for its loop to end, so
 * an old loop never touches the new session (and the new one can take over the KV cache the old
 * one leaves). Other slots' generations go on, taking turns with it.
 */
function generate(msg) {
  const previous = stopSlot(msg.slot);
  sessions.set(msg.slot, msg.id);
  const end = previous.then(() => run(msg));
  slotRuns.set(msg.slot, end);
  end.then(() => {
    if (slotRuns.get(msg.slot) === end) slotRuns.delete(msg.slot);
    if (sessions.get(msg.slot) === msg.id) sessions.delete(msg.slot);
  });
}

async function run({ id, slot, type, prompt, ids, messages, options = {} }) {
  if (aborted.has(id)) {
    // Aborted while it waited for the previous one.
    aborted.delete(id);
    post({ type: "done", id, summary: null });
    return;
  }
  let engine = slots.get(slot)?.engine;
  if (!engine) {
    post({ type: "error", id, message: "no model is loaded" });
    return;
  }
  let session = null;
  const generated = []; // the ids streamed so far (a lost GPU's text continues from them)
  try {
    session = await exclusive(() => {
      if (type === "chat") return engine.startChat(messages, options);
      if (ids) return engine.startIds(Uint32Array.from(ids), options);
      return engine.start(prompt, options);
    });
    for (;;) {
      if (aborted.has(id)) {
        session.abort();
        break;
      }
      let token;
      try {
        token = await exclusive(() => session.next());
      } catch (e) {
        // WebGPU lost mid-generation (a driver reset, the tab's GPU process gone): the model
        // moves to the CPU path and the text goes on from what was streamed (a beam search
        // cannot resume: it ends with the error, the model on the CPU path for the next one).
        if (!slots.get(slot)?.entry.gguf || !/GPU device lost/.test(errorMessage(e))) throw e;
        if ((options.beams ?? 1) > 1) {
          session.free();
          session = null;
          await moveToCpu(
            id,
            slot,
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
          `WebGPU was lost (${errorMessage(e)}) after ${generated.length} tokens: the model moved to the CPU path`,
        );
        const rest = { ...options, maxTokens: (options.maxTokens ?? options.max_tokens ?? 256) - generated.length };
        if (options.constraint) rest.constraintPrefix = (options.constraintPrefix ?? 0) + generated.length;
        if (options.forceTokens) rest.forceTokens = options.forceTokens.slice(generated.length);
        if (rest.maxTokens <= 0) break;
        session = await exclusive(() => engine.startIds(Uint32Array.from([...promptIds, ...generated]), rest));
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
      reply: session?.reply,
    });
  } catch (e) {
    post({ type: "error", id, message: errorMessage(e) });
  } finally {
    // The engine keeps what the session computed (its KV cache) for the next one.
    session?.free();
    aborted.delete(id);
  }
}

/**
 * The slot's model loaded again on the CPU path (from the cache), replacing its GPU engine: once
 * for the model, whichever of the slots sharing it met the lost GPU first; each slot then takes a
 * share of the CPU copy.
 */
async function moveToCpu(id, slot, why) {
  post({ type: "warning", id, message: why });
  const share = slots.get(slot);
  const { entry } = share;
  entry.moving ??= (async () => {
    const cpu = wasm.BackendChoice.cpu(why);
    try {
      const { spec, tokenizer, loadOptions } = entry.gguf;
      const { engine } = await loadGguf(spec, id, new AbortController().signal, cpu, tokenizer, loadOptions);
      entry.base.free();
      entry.base = engine;
      entry.backendReason = why;
    } finally {
      cpu.free();
    }
  })();
  await entry.moving;
  if (share.engine.info().backend !== entry.base.info().backend) {
    share.engine.free();
    share.engine = entry.base.share();
  }
  post({ type: "backend", id, info: infoOf(share, entry.backendReason) });
  return share.engine;
}

async function score({ id, slot, text, after }) {
  const engine = slots.get(slot)?.engine;
  try {
    if (!engine) throw new Error("no model is loaded");
    post({ type: "result", id, value: await exclusive(() => engine.score(text, after ?? undefined)) });
  } catch (e) {
    post({ type: "error", id, message: errorMessage(e) });
  }
}

/** Answer request `id` with what `compute()` returns (or the error it throws). */
async function answer(id, compute) {
  try {
    post({ type: "result", id, value: await compute() });
  } catch (e) {
    post({ type: "error", id, message: errorMessage(e) });
  }
}

function handle(msg) {
  const engine = () => {
    const share = slots.get(msg.slot);
    if (!share) throw new Error("no model is loaded");
    return share.engine;
  };
  switch (msg.type) {
    case "load":
      load(msg);
      break;
    case "generate":
    case "chat":
      generate(msg);
      break;
    case "abort":
      if (msg.id !== undefined) aborted.add(msg.id);
      break;
    case "cancel-load":
      loadCancels.get(msg.id)?.();
      break;
    case "score":
      score(msg);
      break;
    case "preflight":
      answer(msg.id, () => preflightModel(msg));
      break;
    case "sampler-view":
      answer(msg.id, () => {
        if (!wasm) throw new Error("the engine is not loaded yet");
        const { ids, logits, options, history } = msg;
        return wasm.samplerView(Uint32Array.from(ids), Float32Array.from(logits), options, Uint32Array.from(history));
      });
      break;
    case "unload":
      unload(msg);
      break;
    case "simulate-gpu-loss":
      // Tests of the fallback path: the slot's WebGPU device is destroyed as a driver reset would.
      slots.get(msg.slot)?.engine.simulateGpuLoss();
      break;
    case "render-chat":
      answer(msg.id, () => engine().renderChat(msg.messages, msg.addGenerationPrompt !== false));
      break;
    case "info":
      answer(msg.id, () => slots.get(msg.slot)?.engine.info() ?? null);
      break;
  }
}

if (inSharedWorker) {
  self.onconnect = ({ ports: [port] }) => {
    connect(port);
    port.postMessage({ type: "hello" });
    // Where the browser says so, a page that went without a "bye" (a crash) lets go too.
    port.addEventListener?.("close", () => {
      for (const c of clients) if (c.port === port) disconnect(c);
    });
  };
} else {
  connect(self);
}
