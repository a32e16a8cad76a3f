// Benchmark of the wasm engine, run directly on the page (no worker): load time, prefill tok/s
// for 16- and 128-token prompts, decode tok/s over 32 greedy tokens after a 16-token prompt and
// after a long one (1024 tokens, or what the model's context leaves room for), the effective
// bandwidth of decode (weight bytes per token x tok/s) against a memcpy in wasm memory, and the
// wasm memory used; on WebGPU, the kernels' times per family in one decode step where the browser
// has timestamp queries; speculative decoding against plain decoding (greedy, 64 tokens, replays
// of known acceptance). The engine runs in a module Worker (this same file), as the app's does: a
// page's main thread may not block, so the threads build would spin there. Result: a JSON object
// in <pre id="result"> and window.benchResult (window.benchError on failure).
//   bench.html?model=models/default.gguf&tokenizer=models/default-tokenizer.json&backend=cpu&reps=5&threads=1
// (&simd=simd128: the simd128 build even where the browser runs relaxed-simd; &speculative=0
// skips the speculative runs, as tests/browser/ab-pages.mjs does)
// threads > 1 needs a cross-origin isolated page (the threads build, see wasm.js).
import { loadWasm } from "./wasm.js";
import { hostPool } from "./pool.js";

const q = new URLSearchParams(location.search);
const modelUrl = q.get("model") || "models/default.gguf";
const tokUrl = q.get("tokenizer") || "models/default-tokenizer.json";
const backend = q.get("backend") || "auto";
const reps = Math.max(1, Number(q.get("reps") || 5));
const DECODE = 32;
const TEXT =
  "Once upon a time there was a little girl named Lily. She loved to play outside in the park with her friends. " +
  "One day she saw a big red ball under a tree and ran to get it. ";

const inWorker = typeof document === "undefined";
const status = (s) => self.postMessage({ status: s });
const median = (xs) => {
  const s = [...xs].sort((a, b) => a - b);
  return s.length % 2 ? s[(s.length - 1) / 2] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2;
};

async function fetchBytes(url) {
  const r = await fetch(url, { cache: "no-store" });
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return new Uint8Array(await r.arrayBuffer());
}

/** A prompt of exactly `n` tokens (BOS included, when the model adds one): the longest prefix
 * of a repeated text, cut at a character, whose token count is `n`. */
function promptOf(engine, n, bos) {
  const long = TEXT.repeat(Math.ceil((n * 8) / TEXT.length) + 2);
  const count = (s) => engine.encode(s).length + bos;
  // Binary search on the character length for the largest prefix with count <= n.
  let lo = 1,
    hi = long.length;
  while (lo < hi) {
    const mid = Math.ceil((lo + hi) / 2);
    if (count(long.slice(0, mid)) <= n) lo = mid;
    else hi = mid - 1;
  }
  // Trim trailing spaces, which tokenizers may merge unpredictably; then re-check.
  let p = long.slice(0, lo);
  while (p.length > 1 && count(p) > n) p = p.slice(0, -1);
  return p;
}

/** Run one greedy generation to the end; its summary. */
async function run(engine, prompt, maxTokens) {
  const s = engine.start(prompt, { temperature: 0, maxTokens });
  try {
    while ((await s.next()) !== null) {}
    return s.summary();
  } finally {
    s.free();
  }
}

/** One greedy generation with `options`: its token ids and summary. */
async function runIds(engine, prompt, maxTokens, options) {
  const s = engine.start(prompt, { temperature: 0, maxTokens, ...options });
  try {
    const ids = [];
    for (let t = await s.next(); t !== null; t = await s.next()) ids.push(t.id);
    return { ids, summary: s.summary() };
  } finally {
    s.free();
  }
}

/** Speculative decoding against plain decoding, greedy from a 16-token prompt, as
 * `nexttoken bench --speculative`: guesses of known acceptance (a replay of the plain run's
 * tokens: all right, every other one wrong, all wrong), k = 4. */
async function speculativeRuns(engine, bos) {
  const SPEC = 64;
  const sprompt = promptOf(engine, 16, bos);
  const plainRuns = [];
  let ids = [];
  for (let i = 0; i < reps; i++) {
    const r = await runIds(engine, sprompt, SPEC + 1, {});
    plainRuns.push(r.summary);
    ids = r.ids;
  }
  // Where a pass rounds differently from one-token steps, the replay is the speculative run's
  // own tokens (see nexttoken bench), so that "all right" is.
  let guesses = ids;
  for (let i = 0; i < 4; i++) {
    const r = await runIds(engine, sprompt, SPEC + 1, { replayDraft: { ids: guesses } });
    if (JSON.stringify(r.ids) === JSON.stringify(guesses)) break;
    guesses = r.ids;
  }
  const plainTokS = median(plainRuns.map((s) => s.decodeTokS));
  const speculative = { tokens: SPEC, k: 4, plainTokS, guessesArePlainTokens: guesses === ids, runs: {} };
  for (const [name, wrongEvery] of [
    ["allRight", 0],
    ["everyOtherWrong", 2],
    ["allWrong", 1],
  ]) {
    const runs = [];
    for (let i = 0; i < reps; i++)
      runs.push((await runIds(engine, sprompt, SPEC + 1, { replayDraft: { ids: guesses, wrongEvery } })).summary);
    const tokS = median(runs.map((s) => s.decodeTokS));
    const sp = runs[0].speculation;
    speculative.runs[name] = {
      tokS,
      speedup: tokS / plainTokS,
      tokensPerPass: sp.tokensPerPass,
      acceptance: sp.acceptance,
    };
  }
  return speculative;
}

async function main() {
  const t0 = performance.now();
  const threadsWanted = Number(q.get("threads") || 1);
  // simd=simd128: the simd128 build where relaxed-simd would run (bench.mjs compares the two).
  const { ByteSink, Engine, version, threads, memcpyBandwidth, wasmMemoryBytes } = await loadWasm({
    threads: threadsWanted,
    relaxed: q.get("simd") === "simd128" ? false : undefined,
  });
  const tInit = performance.now();
  const [modelBytes, tokBytes] = await Promise.all([fetchBytes(modelUrl), fetchBytes(tokUrl)]);
  const tFetch = performance.now();
  const sink = new ByteSink(modelBytes.length);
  sink.push(modelBytes);
  const engine = await Engine.loadGguf(sink, tokBytes, { backend, maxSeq: 2048, threads });
  const tLoad = performance.now();
  const info = engine.info();

  // Does the prompt get a BOS? Compare start()'s count with encode()'s.
  const probe = engine.start("Once", { temperature: 0, maxTokens: 1 });
  const bos = probe.promptTokens - engine.encode("Once").length;
  probe.free();

  status("warming up…");
  // Enough decode steps for the CPU path to settle its decode walk (src/cpu/walk.rs: one warm-up
  // step and 3 timed with each walk), so that no timed run below includes that trial's slower walk.
  await run(engine, TEXT, 12);

  const prefill = {};
  for (const n of [16, 128]) {
    status(`prefill ${n}…`);
    const prompt = promptOf(engine, n, bos);
    const runs = [];
    for (let i = 0; i < reps; i++) {
      // The engine keeps the KV cache of the prefix a prompt shares with the previous one: a
      // generation on other text first, so that each run computes the whole prompt again.
      await run(engine, "Zebras", 1);
      runs.push(await run(engine, prompt, 1));
    }
    const ms = median(runs.map((r) => r.prefillMs));
    const computedTokens = runs[0].promptTokens - runs[0].reusedTokens;
    prefill[n] = { promptTokens: runs[0].promptTokens, computedTokens, ms, tokS: (computedTokens * 1000) / ms };
  }

  // Decode after a short prompt and after a long one: the second also streams the KV cache.
  const maxCtx = Math.min(2048, info.nCtx);
  const longCtx = Math.min(1024, maxCtx - DECODE - 2);
  const decode = {};
  for (const n of [16, longCtx]) {
    status(`decode after ${n} tokens…`);
    const dprompt = promptOf(engine, n, bos);
    const druns = [];
    for (let i = 0; i < reps; i++) druns.push(await run(engine, dprompt, DECODE + 1));
    // decodeMs covers the tokens after the first (the first comes from prefill).
    const perTok = median(druns.map((r) => r.decodeMs / Math.max(1, r.generatedTokens - 1)));
    const tokS = 1000 / perTok;
    decode[n] = {
      promptTokens: druns[0].promptTokens,
      generatedTokens: druns[0].generatedTokens,
      stopReason: druns[0].stopReason,
      msPerToken: perTok,
      tokS,
      weightGBs: (info.weightBytesPerToken * tokS) / 1e9,
      sampleText: druns[0].text,
    };
  }
  // Speculative decoding against plain decoding (&speculative=0 skips it: tools/ab comparisons).
  status("speculative decoding…");
  const speculative = q.get("speculative") === "0" ? null : await speculativeRuns(engine, bos);

  // On WebGPU, each kernel family's time in one decode step at both contexts (null where the
  // browser exposes no timestamp-query, e.g. Chrome without it enabled), as `bench --profile`.
  const profile = {};
  for (const n of [16, longCtx]) {
    status(`profile after ${n} tokens…`);
    profile[n] = await engine.gpuProfile(n);
  }
  const memoryBytes = wasmMemoryBytes(); // before the memcpy test grows it
  status("memcpy…");
  const memcpyGBs = memcpyBandwidth(64) / 1e9;

  const result = {
    engine: "nexttoken",
    version: version(),
    userAgent: navigator.userAgent,
    model: modelUrl,
    backendRequested: backend,
    backend: info.backend,
    backendDetail: info.backendDetail,
    arch: info.arch,
    parameters: info.parameters,
    modelBytes: modelBytes.length,
    threads,
    threadsRequested: threadsWanted,
    // The CPU path's decode walk once the decode steps above have settled it (src/cpu/walk.rs).
    decodeWalk: engine.decodeWalk(),
    reps,
    wasmInitMs: tInit - t0,
    fetchMs: tFetch - tInit,
    loadMs: tLoad - tFetch,
    prefill16: prefill[16],
    prefill128: prefill[128],
    weightBytesPerToken: info.weightBytesPerToken,
    memcpyGBs,
    wasmMemoryBytes: memoryBytes,
    decode16: decode[16],
    decodeLong: decode[longCtx],
    // The short decode again under its old name (bench.mjs's tables).
    decode: decode[16],
    speculative,
    gpuProfile16: profile[16],
    gpuProfileLong: profile[longCtx],
  };
  engine.free();
  self.postMessage({ result });
  status("done");
}

if (inWorker) {
  // Start on the page's word, which comes after its "pool-host" (one port keeps the order):
  // started at once, loadWasm would not know yet that the page hosts the threads build's pool
  // and would run one thread whatever `threads` asked.
  const start = ({ data }) => {
    if (data?.type !== "start") return;
    self.removeEventListener("message", start);
    main().catch((e) => self.postMessage({ error: String(e?.stack || e) }));
  };
  self.addEventListener("message", start);
} else {
  const show = (id, text) => (document.getElementById(id).textContent = text);
  const fail = (e) => {
    window.benchError = e;
    show("status", `error: ${e.split("\n")[0]}`);
    show("result", e);
  };
  const worker = new Worker(new URL(`bench.js${location.search}`, import.meta.url), { type: "module" });
  hostPool(worker);
  worker.postMessage({ type: "start" });
  worker.onmessage = ({ data }) => {
    if (data.status) show("status", data.status);
    if (data.error) fail(data.error);
    if (data.result) {
      window.benchResult = data.result;
      show("result", JSON.stringify(data.result, null, 2));
    }
  };
  worker.onerror = (e) => fail(`worker: ${e.message || e}`);
}
