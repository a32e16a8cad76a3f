// The inference worker: downloads (with the Cache API), loads the model into wasm and runs the
// generation loop, one token per step, posting each token as soon as it is known. The page
// stays responsive, and between tokens the worker yields so that an "abort" message gets in.
//
// Messages in:  {type:"load", id, spec, options} | {type:"generate", id, prompt, options}
//               {type:"chat", id, messages, options} | {type:"render-chat", id, messages}
//               {type:"abort", id} | {type:"score", id, text} | {type:"cancel-load", id}
// Messages out: {type:"progress", id, file, loaded, total, fromCache}
//               {type:"loaded", id, info, timings} | {type:"token", id, token}
//               {type:"done", id, summary, messages} | {type:"result", id, value}
//               {type:"warning", id, message} | {type:"error", id, message, retryable}

import { loadWasm } from "./wasm.js";
import { fetchModelFile, dropOldCaches, deleteCached } from "./model-cache.js";

let ready = null;
let engine = null;
let sessionId = null;
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

async function load({ id, spec, options = {} }) {
  const controller = new AbortController();
  loadAborts.set(id, controller);
  const signal = controller.signal;
  const t0 = performance.now();
  try {
    await wasmReady();
    // A generation on the old model stops first.
    if (sessionId !== null) aborted.add(sessionId);
    await running;
    // Free the previous model before allocating the next: wasm memory never shrinks, but freed
    // space is reused.
    engine?.free?.();
    engine = null;
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
      let sink = null;
      const got = await fetchModelFile(spec.url, {
        signal,
        sha256: spec.sha256,
        // One allocation of the announced size; the chunks are copied straight into it.
        onStart: ({ total }) => {
          sink?.free();
          sink = new wasm.ByteSink(total || spec.size || 0);
        },
        onChunk: (chunk) => sink.push(chunk),
        onProgress: (p) => post({ type: "progress", id, file: "model", ...p }),
      }).catch((e) => {
        sink?.free();
        throw e;
      });
      if (got.cacheWarning) post({ type: "warning", id, message: got.cacheWarning });
      if (!sink) throw new Error("the model file is empty");
      const t1 = performance.now();
      try {
        engine = await wasm.Engine.loadGguf(sink, tokenizer, { backend: options.backend || "auto", maxSeq: options.maxSeq || 2048, exact: !!options.exact, threads: options.threads });
      } catch (e) {
        // The file downloaded completely but is not a usable model: do not keep it. Unless only
        // the GGUF's own tokenizer failed ("tokenizer: ...": no tokenizer metadata, or a kind we
        // do not build; a file that does not parse is a "GGUF: ..." error): the tokenizer is
        // built first, so the model was not looked at, and a retry with a tokenizer.json URL
        // should not download it again.
        const ownTokenizerFailed = !spec.tokenizer && /^tokenizer: /.test(errorMessage(e));
        if (!ownTokenizerFailed) await deleteCached(new URL(spec.url, self.location.href).href).catch(() => {});
        if (spec.tokenizer) await deleteCached(new URL(spec.tokenizer, self.location.href).href).catch(() => {});
        throw e;
      }
      timings = { downloadMs: t1 - t0, initMs: performance.now() - t1, fromCache: got.fromCache };
    }
    post({ type: "loaded", id, info: { ...engine.info(), version: wasm.version(), threads: wasm.threads }, timings });
  } catch (e) {
    engine = null;
    const cancelled = signal.aborted;
    const retryable = cancelled || (e?.name === "DownloadError" ? e.retryable : false);
    post({ type: "error", id, message: cancelled ? "loading was cancelled" : errorMessage(e), retryable });
  } finally {
    loadAborts.delete(id);
  }
}

// One generation at a time: a new one first stops the one running and waits for its loop to
// end, so an old loop can never touch the new session (and the new one can take over the KV
// cache the old one leaves).
let running = Promise.resolve();

function generate(msg) {
  if (sessionId !== null) aborted.add(sessionId);
  const previous = running;
  running = previous.then(() => run(msg));
}

async function run({ id, type, prompt, messages, options = {} }) {
  if (aborted.has(id)) {
    // Aborted while it waited for the previous one.
    aborted.delete(id);
    post({ type: "done", id, summary: null });
    return;
  }
  if (!engine) {
    post({ type: "error", id, message: "no model is loaded" });
    return;
  }
  let session = null;
  sessionId = id;
  try {
    session = type === "chat" ? engine.startChat(messages, options) : engine.start(prompt, options);
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
    post({ type: "done", id, summary: session.summary(), messages: session.messages });
  } catch (e) {
    post({ type: "error", id, message: errorMessage(e) });
  } finally {
    // The engine keeps what the session computed (its KV cache) for the next one.
    session?.free();
    aborted.delete(id);
    sessionId = null;
  }
}

async function score({ id, text }) {
  try {
    if (!engine) throw new Error("no model is loaded");
    post({ type: "result", id, value: await engine.score(text) });
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
    case "render-chat":
      try {
        if (!engine) throw new Error("no model is loaded");
        post({ type: "result", id: msg.id, value: engine.renderChat(msg.messages, msg.addGenerationPrompt !== false) });
      } catch (e) {
        post({ type: "error", id: msg.id, message: errorMessage(e) });
      }
      break;
    case "info":
      post({ type: "result", id: msg.id, value: engine ? engine.info() : null });
      break;
  }
};
