// The inference worker: downloads (with the Cache API), loads the model into wasm and runs the
// generation loop, one token per step, posting each token as soon as it is known. The page
// stays responsive, and between tokens the worker yields so that an "abort" message gets in.
//
// Messages in:  {type:"load", id, spec, options} | {type:"generate", id, prompt | ids, options}
//               {type:"chat", id, messages, options} | {type:"render-chat", id, messages}
//               {type:"sampler-view", id, ids, logits, options, history}
//               {type:"abort", id} | {type:"score", id, text, after} | {type:"cancel-load", id}
//               {type:"unload"}
//               Each message names its `slot`: one page may share this worker among several
//               NextToken instances (several <next-token> elements), each with its own model.
// Messages out: {type:"progress", id, file, loaded, total, fromCache, part, parts, doneBytes}
//               {type:"loaded", id, info, timings} | {type:"token", id, token}
//               {type:"done", id, summary, messages, promptIds, beamTree} | {type:"result", id, value}
//               {type:"warning", id, message} | {type:"error", id, message, retryable}

import { loadWasm } from "./wasm.js";
import { fetchModelFile, dropOldCaches, deleteCached, splitPartUrls } from "./model-cache.js";

let ready = null;
const engines = new Map(); // slot -> the model's engine
let sessionId = null;
let sessionSlot = null;
const aborted = new Set();
const loadAborts = new Map();

// The wasm module's exports (ByteSink, Engine, version, threads), once loaded.
let wasm = null;

function wasmReady() {
  ready ??= loadWasm().then((m) => {
    wasm = m;
    dropOldCaches().catch(() => {});
  });
  return ready;
}

const post = (msg) => self.postMessage(msg);
const errorMessage = (e) => (e && e.message) || String(e);

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
    if (spec.kind === "table") {
      // Table models are a few hundred bytes: always fetched fresh (the service worker keeps the
      // lesson tables for offline use).
      const bytes = await fetchText(spec.url, id, "model", signal, false);
      const t1 = performance.now();
      engine = wasm.Engine.loadTable(new TextDecoder().decode(bytes));
      timings = { downloadMs: t1 - t0, initMs: performance.now() - t1 };
    } else {
      // The tokenizer first (small), then the model straight into wasm memory. Without a
      // tokenizer URL, null: loadGguf builds the tokenizer from the GGUF's own metadata (and says
      // so when the file has none).
      const tokenizer = spec.tokenizer ? await fetchText(spec.tokenizer, id, "tokenizer", signal) : null;
      const { sink, fromCache, urls } = await fetchGguf(spec, id, signal);
      const t1 = performance.now();
      try {
        engine = await wasm.Engine.loadGguf(sink, tokenizer, { backend: options.backend || "auto", maxSeq: options.maxSeq || 2048, exact: !!options.exact, threads: options.threads });
      } catch (e) {
        // The file (every part of it) downloaded completely but is not a usable model: do not
        // keep it. Unless only the GGUF's own tokenizer failed ("tokenizer: ...": no tokenizer
        // metadata, or a kind we do not build; a file that does not parse is a "GGUF: ..."
        // error): the tokenizer is built first, so the model was not looked at, and a retry with
        // a tokenizer.json URL should not download it again.
        const ownTokenizerFailed = !spec.tokenizer && /^tokenizer: /.test(errorMessage(e));
        if (!ownTokenizerFailed) await deleteAll(urls);
        if (spec.tokenizer) await deleteCached(new URL(spec.tokenizer, self.location.href).href).catch(() => {});
        throw e;
      }
      timings = { downloadMs: t1 - t0, initMs: performance.now() - t1, fromCache };
    }
    engines.set(slot, engine);
    post({ type: "loaded", id, info: { ...engine.info(), version: wasm.version(), threads: wasm.threads }, timings });
  } catch (e) {
    const cancelled = signal.aborted;
    const retryable = cancelled || (e?.name === "DownloadError" ? e.retryable : false);
    post({ type: "error", id, message: cancelled ? "loading was cancelled" : errorMessage(e), retryable });
  } finally {
    loadAborts.delete(id);
  }
}

/**
 * Download the GGUF of `spec` straight into a wasm ByteSink: one file, or every part of a model
 * split by gguf-split (a URL naming its first part), appended in order. Each part is cached on
 * its own; progress messages say which part. Resolves to {sink, fromCache (every part), urls}.
 */
async function fetchGguf(spec, id, signal) {
  const urls = splitPartUrls(spec.url);
  const parts = urls.length;
  if (parts > 1 && spec.sha256 && !(Array.isArray(spec.sha256) && spec.sha256.length === parts)) {
    throw new Error(`${spec.url} is part 1 of ${parts} of a split model: give its sha256 as a list of ${parts}, one per part`);
  }
  let sink = null;
  let fromCache = true;
  let doneBytes = 0; // of the parts before this one
  try {
    for (let i = 0; i < parts; i++) {
      const got = await fetchModelFile(urls[i], {
        signal,
        sha256: parts > 1 ? spec.sha256?.[i] : spec.sha256,
        // One allocation of the announced size (for a split model `spec.size` is the whole's,
        // when known), the chunks copied straight into it; each later part grows it by exactly
        // its own size.
        onStart: async ({ total }) => {
          if (i > 0) return sink.reserve(total);
          const size = (parts > 1 && spec.size) || total || spec.size || 0;
          await preflight(urls[0], size, id);
          sink?.free();
          sink = new wasm.ByteSink(size);
        },
        onChunk: (chunk) => sink.push(chunk),
        onProgress: (p) => post({ type: "progress", id, file: "model", part: i + 1, parts, doneBytes, ...p }),
      });
      if (got.cacheWarning) post({ type: "warning", id, message: got.cacheWarning });
      fromCache &&= got.fromCache;
      doneBytes += got.bytes;
    }
  } catch (e) {
    sink?.free();
    // A part that cannot be had at all (404) makes the others useless; a network error may pass.
    if (parts > 1 && e?.name === "DownloadError" && !e.retryable) await deleteAll(urls);
    throw e;
  }
  if (!sink || !sink.length) throw new Error(`the server sent an empty file for ${spec.url.split("/").pop()}: it is not a model`);
  return { sink, fromCache, urls };
}

/** WebAssembly memory is 32-bit: the model's bytes and everything else share 4 GiB. */
const WASM_MEMORY_LIMIT = 4 * 2 ** 30;

/**
 * Before a download: refuse a model that cannot fit in WebAssembly memory, and warn when the
 * browser's storage cannot keep it (it then runs but is downloaded again next time).
 */
async function preflight(url, size, id) {
  if (!size) return;
  const name = decodeURIComponent(new URL(url).pathname.split("/").pop());
  const gb = (n) => (n / 1e9).toFixed(2) + " GB";
  if (size > WASM_MEMORY_LIMIT * 0.9) {
    throw new Error(`${name} is ${gb(size)} (as the server announced it): more than the ${gb(WASM_MEMORY_LIMIT)} WebAssembly memory can hold with room for the KV cache; pick a smaller model or a stronger quantisation`);
  }
  const estimate = await navigator.storage?.estimate?.().catch(() => null);
  if (estimate?.quota && size > estimate.quota - (estimate.usage || 0)) {
    post({ type: "warning", id, message: `${name} (${gb(size)}) is more than the ${gb(estimate.quota - (estimate.usage || 0))} of storage this browser offers: it runs now but cannot be kept for offline use` });
  }
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
  const engine = engines.get(slot);
  if (!engine) {
    post({ type: "error", id, message: "no model is loaded" });
    return;
  }
  let session = null;
  sessionId = id;
  sessionSlot = slot;
  try {
    if (type === "chat") session = engine.startChat(messages, options);
    else if (ids) session = engine.startIds(Uint32Array.from(ids), options);
    else session = engine.start(prompt, options);
    for (;;) {
      if (aborted.has(id)) {
        session.abort();
        break;
      }
      const token = await session.next();
      if (token === null) break;
      post({ type: "token", id, token });
      await yieldToEvents();
    }
    post({ type: "done", id, summary: session.summary(), messages: session.messages, promptIds: Array.from(session.promptIds), beamTree: session.beamTree });
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
    case "sampler-view":
      try {
        if (!wasm) throw new Error("the engine is not loaded yet");
        const { ids, logits, options, history } = msg;
        post({ type: "result", id: msg.id, value: wasm.samplerView(Uint32Array.from(ids), Float32Array.from(logits), options, Uint32Array.from(history)) });
      } catch (e) {
        post({ type: "error", id: msg.id, message: errorMessage(e) });
      }
      break;
    case "unload":
      unload(msg);
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
