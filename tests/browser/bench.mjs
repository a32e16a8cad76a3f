// Benchmark in headless Chromium: www/bench.html (the nexttoken wasm engine, run on the page),
// once without WebGPU (CPU wasm) and once with --enable-unsafe-webgpu (backend=gpu); and, when
// @wllama/wllama is installed here, a page served from a temp folder at /wllama/ (llama.cpp in wasm, 1 thread) on the
// same GGUF, with a nexttoken/wllama ratio table. "init+load" is wasm compile + model load (wllama:
// its worker start + load); wllama prompts are the same text, its tokenizer counts them (prompt_n).
//
//   node tests/browser/bench.mjs      (after ./build.sh)
//
// Each engine runs with 1 thread on a page that is not cross-origin isolated, and with THREADS
// (default 2) on an isolated one (nexttoken's wasm threads build; wllama's pthreads). At the end
// the native CLI's `bench --backend cpu` runs on the same file, threads and contexts, and each
// wasm figure is printed as a share of native (what the wasm work aims at). Where the relaxed-simd
// builds exist (www/pkg-relaxed/) and this Chromium runs them, each CPU run is repeated with the
// simd128 build (bench.html's simd=simd128), and the two are compared.
//
// Environment: CHROMIUM (default /usr/bin/chromium), MODEL / TOKENIZER (URLs under www/, default
// models/default.gguf, models/default-tokenizer.json; or MODEL_FILE / TOKENIZER_FILE: paths of
// files anywhere, served from their folders), REPS (default 5), THREADS (default 2; 1 skips the
// threaded runs), NO_WLLAMA=1, NO_WEBGPU=1 (SwiftShader takes minutes per token on real shapes),
// WEBGPU_REPS (default 1: this Chromium's WebGPU is SwiftShader, a software renderer, so its run
// shows that the GPU path completes, not a speed worth repeating), PAGE_TIMEOUT_S (default 300,
// per page; raise it for 135M shapes on a slow host).
// Closing line: "N passed, N failed" (a run passes when it produced numbers).

import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { spawnSync } from "node:child_process";
import { chromium } from "playwright-core";
import { serve } from "./serve.mjs";

const here = path.dirname(fileURLToPath(import.meta.url));
const repo = path.resolve(here, "../..");
const www = path.join(repo, "www");
const chromiumPath = process.env.CHROMIUM || "/usr/bin/chromium";
const REPS = process.env.REPS || "5";
const THREADS = Number(process.env.THREADS || 2);
// Per page: wllama on one thread runs the long prompt at a few tokens per second on 135M shapes.
const PAGE_TIMEOUT_S = Number(process.env.PAGE_TIMEOUT_S || 300);
// Files outside www/ are served from /bench-model/ and /bench-tokenizer/.
const mounts = {};
let MODEL = process.env.MODEL || "models/default.gguf";
let TOKENIZER = process.env.TOKENIZER || "models/default-tokenizer.json";
if (process.env.MODEL_FILE) {
  mounts["/bench-model/"] = path.dirname(path.resolve(process.env.MODEL_FILE));
  MODEL = `bench-model/${path.basename(process.env.MODEL_FILE)}`;
}
if (process.env.TOKENIZER_FILE) {
  mounts["/bench-tokenizer/"] = path.dirname(path.resolve(process.env.TOKENIZER_FILE));
  TOKENIZER = `bench-tokenizer/${path.basename(process.env.TOKENIZER_FILE)}`;
}

let passed = 0;
let failed = 0;
const results = {};

// The wllama page: the same prompt text cut so that wllama's own tokenizer (the GGUF's vocabulary)
// counts n tokens with BOS, greedy, cache_prompt off, no WebGPU; llama.cpp's own timings
// (prompt_ms, predicted_ms, prompt_n) are the numbers. (Random-weight files from nexttoken synth
// carry a placeholder vocabulary, so the same text is not the same tokens there: the counts are.)
const WLLAMA_PAGE = `<!doctype html><meta charset="utf-8"><title>wllama bench</title><pre id="result">running…</pre>
<script type="module">
import { Wllama } from "./esm/index.js";
const q = new URLSearchParams(location.search);
const reps = Number(q.get("reps") || 5);
const TEXT = "Once upon a time there was a little girl named Lily. She loved to play outside in the park with her friends. " +
  "One day she saw a big red ball under a tree and ran to get it. ";
const median = (xs) => { const s = [...xs].sort((a, b) => a - b); return s.length % 2 ? s[(s.length - 1) / 2] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2; };
try {
  const t0 = performance.now();
  const blob = await (await fetch(q.get("model"), { cache: "no-store" })).blob();
  const tFetch = performance.now();
  const w = new Wllama({ default: new URL("./esm/wasm/wllama.wasm", location.href).href }, { suppressNativeLog: true });
  const nThreads = Number(q.get("threads") || 1);
  await w.loadModel([blob], { n_threads: nThreads, n_gpu_layers: 0, n_ctx: 2048 });
  const tLoad = performance.now();
  // A prefix of a repeated text that wllama counts as about n tokens (prompt_n of a 1-token run):
  // start at n characters (ASCII: at most one token each), then scale by the count seen.
  const promptText = async (n) => {
    const text = (chars) => TEXT.repeat(Math.ceil(chars / TEXT.length) + 1).slice(0, chars);
    let chars = n;
    for (let i = 0; i < 4; i++) {
      const got = (await run(text(chars), 1)).prompt_n;
      if (Math.abs(got - n) <= Math.max(1, n * 0.02)) break;
      chars = Math.max(1, Math.floor((chars * n) / got));
    }
    return text(chars);
  };
  const run = async (prompt, max_tokens) => (await w.createCompletion({ prompt, max_tokens, temperature: 0, cache_prompt: false, ignore_eos: true })).timings;
  await run(await promptText(16), 4);
  const prefill = {};
  for (const n of [16, 128]) {
    const p = await promptText(n);
    const ts = []; for (let i = 0; i < reps; i++) ts.push(await run(p, 1));
    const ms = median(ts.map((t) => t.prompt_ms));
    prefill[n] = { promptTokens: ts[0].prompt_n, ms, tokS: ts[0].prompt_n * 1000 / ms };
  }
  const decode = {};
  const longCtx = Math.min(1024, Math.min(2048, w.getModelMetadata().hparams.nCtxTrain) - 34);
  for (const n of [16, longCtx]) {
    const p = await promptText(n);
    const ds = []; for (let i = 0; i < reps; i++) ds.push(await run(p, 33));
    const per = median(ds.map((t) => t.predicted_ms / t.predicted_n));
    decode[n] = { promptTokens: ds[0].prompt_n, generatedTokens: ds[0].predicted_n, msPerToken: per, tokS: 1000 / per };
  }
  const r = { engine: "wllama", backend: "wasm cpu", threads: w.getNumThreads(), multithread: w.isMultithread(), reps,
    fetchMs: tFetch - t0, loadMs: tLoad - tFetch, prefill16: prefill[16], prefill128: prefill[128],
    decode16: decode[16], decodeLong: decode[longCtx], decode: decode[16] };
  window.benchResult = r;
  document.getElementById("result").textContent = JSON.stringify(r, null, 2);
} catch (e) {
  window.benchError = String((e && e.stack) || e);
  document.getElementById("result").textContent = window.benchError;
}
</script>`;

// wllama's files, served from a temporary folder (never copied into www/).
const wllamaDir = path.join(here, "node_modules", "@wllama", "wllama");
const haveWllama = !process.env.NO_WLLAMA && fs.existsSync(wllamaDir);
let tmp = null;
if (haveWllama) {
  tmp = fs.mkdtempSync(path.join(os.tmpdir(), "nexttoken-bench-"));
  fs.cpSync(path.join(wllamaDir, "esm"), path.join(tmp, "esm"), { recursive: true });
  fs.writeFileSync(path.join(tmp, "index.html"), WLLAMA_PAGE);
  mounts["/wllama/"] = tmp;
}

const haveRelaxed = fs.existsSync(path.join(www, "pkg-relaxed", "nexttoken_bg.wasm"));

const server = await serve(www, 0, mounts);
const base = `http://127.0.0.1:${server.address().port}`;
console.log(`serving www/ on ${base}`);

async function runPage(name, url, { webgpu = false, threads = 1, simd128 = false } = {}) {
  const args = [
    "--no-sandbox",
    "--headless",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
  ];
  if (webgpu) args.push("--enable-unsafe-webgpu", "--use-angle=swiftshader", "--enable-features=Vulkan");
  const browser = await chromium.launch({ executablePath: chromiumPath, args, headless: true });
  const lines = [];
  try {
    const page = await browser.newPage();
    page.on("console", (m) => lines.push(`${m.type()}: ${m.text()}`));
    page.on("pageerror", (e) => lines.push(`pageerror: ${e.message}`));
    await page.goto(base + url);
    await page.waitForFunction(() => window.benchResult || window.benchError, null, { timeout: PAGE_TIMEOUT_S * 1000 });
    const r = await page.evaluate(() => window.benchResult || { error: window.benchError });
    if (r.error) throw new Error(r.error);
    // A threaded run that fell back to one thread would be labelled wrong (it once did, unseen).
    if (r.threads !== undefined && r.threads !== threads)
      throw new Error(`asked for ${threads} threads, ran ${r.threads}`);
    // The CPU kernels' instruction set, from the backend's own words ("... relaxed-simd int8 kernels, ...").
    r.isa = /(\S+) int8 kernels/.exec(r.backendDetail || "")?.[1];
    if (simd128 && r.isa !== "simd128") throw new Error(`asked for the simd128 build, ran ${r.backendDetail}`);
    // After its decode steps the CPU path has chosen its decode walk (src/cpu/walk.rs).
    if (r.backend === "cpu" && !["tiles", "streams"].includes(r.decodeWalk))
      throw new Error(`decode walk not settled: ${r.decodeWalk}`);
    // On WebGPU with timestamp queries, the kernels' times per family of one decode step.
    for (const p of [r.gpuProfile16, r.gpuProfileLong]) {
      if (r.backend !== "webgpu" || p === null) continue;
      const ok =
        Array.isArray(p) &&
        p.length > 0 &&
        p.every((f) => typeof f.kernel === "string" && f.dispatches >= 1 && f.micros >= 0 && f.bytes >= 0);
      if (!ok) throw new Error(`gpuProfile is not a per-family table: ${JSON.stringify(p)}`);
    }
    if (r.backend === "webgpu") {
      const p = r.gpuProfile16;
      console.log(
        p
          ? p.map((f) => `${f.kernel}: ${f.dispatches} x, ${f.micros.toFixed(0)} us`).join("; ")
          : "gpuProfile: null (this browser exposes no timestamp-query)",
      );
    }
    results[name] = r;
    passed++;
    const { userAgent, ...shown } = r;
    for (const d of [shown.decode16, shown.decodeLong]) if (d) delete d.sampleText;
    delete shown.decode;
    console.log(`ok    ${name}\n${JSON.stringify(shown, null, 2)}`);
  } catch (e) {
    failed++;
    console.log(
      `FAIL  ${name}: ${String(e?.message ? e.message : e)
        .split("\n")
        .slice(0, 6)
        .join("\n      ")}`,
    );
    if (lines.length) console.log(`      console:\n      ${lines.slice(-10).join("\n      ")}`);
  } finally {
    await browser.close();
  }
}

const q = (backend, threads = 1, reps = REPS) =>
  `?model=${encodeURIComponent(MODEL)}&tokenizer=${encodeURIComponent(TOKENIZER)}&backend=${backend}&reps=${reps}&threads=${threads}` +
  (threads > 1 ? "" : "&isolate=0");
const wq = (threads) =>
  `/wllama/index.html?model=${encodeURIComponent(`/${MODEL}`)}&tokenizer=${encodeURIComponent(`/${TOKENIZER}`)}&reps=${REPS}&threads=${threads}` +
  (threads > 1 ? "" : "&isolate=0");
try {
  await runPage("nexttoken cpu 1 thread", `/bench.html${q("cpu")}`);
  const relaxed = haveRelaxed && results["nexttoken cpu 1 thread"]?.isa === "relaxed-simd";
  if (relaxed)
    await runPage("nexttoken cpu 1 thread, simd128", `/bench.html${q("cpu")}&simd=simd128`, { simd128: true });
  if (haveWllama) await runPage("wllama 1 thread", wq(1));
  else console.log("SKIP  wllama (npm install @wllama/wllama in tests/browser to compare)");
  if (THREADS > 1) {
    await runPage(`nexttoken cpu ${THREADS} threads`, `/bench.html${q("cpu", THREADS)}`, { threads: THREADS });
    if (relaxed)
      await runPage(`nexttoken cpu ${THREADS} threads, simd128`, `/bench.html${q("cpu", THREADS)}&simd=simd128`, {
        threads: THREADS,
        simd128: true,
      });
    if (haveWllama) await runPage(`wllama ${THREADS} threads`, wq(THREADS), { threads: THREADS });
  }
  const webgpuReps = process.env.WEBGPU_REPS || "1";
  // WebGPU by name: "auto" takes the CPU path where the only adapter is SwiftShader.
  if (!process.env.NO_WEBGPU)
    await runPage("nexttoken gpu (--enable-unsafe-webgpu)", `/bench.html${q("gpu", 1, webgpuReps)}`, { webgpu: true });
} finally {
  server.closeAllConnections?.();
  await new Promise((r) => server.close(r));
  if (tmp) fs.rmSync(tmp, { recursive: true, force: true });
}

// Summary table.
const fmt = (x) => (typeof x === "number" && Number.isFinite(x) ? x.toFixed(1) : "-");
const row = (r) => [
  (r.wasmInitMs || 0) + r.loadMs,
  r.prefill16?.tokS,
  r.prefill128?.tokS,
  r.decode16?.tokS,
  r.decodeLong?.tokS,
];
const longTokens = Object.values(results).find((r) => r.decodeLong)?.decodeLong.promptTokens;
console.log(
  "\n" +
    [
      "run",
      "backend",
      "kernels",
      "init+load ms",
      "prefill16 tok/s",
      "prefill128 tok/s",
      "decode@16 tok/s",
      `decode@${longTokens} tok/s`,
    ].join(" | "),
);
for (const [name, r] of Object.entries(results))
  console.log([name, r.backend, r.isa || "-", ...row(r).map(fmt)].join(" | "));
// relaxed-simd against simd128 on the same page, file and threads.
for (const t of [1, THREADS]) {
  const label = `nexttoken cpu ${t} thread${t > 1 ? "s" : ""}`;
  const [a, b] = [results[label], results[`${label}, simd128`]];
  if (!a || !b) continue;
  const [ra, rb] = [row(a), row(b)];
  const ratios = ra.map((x, i) => (i && x && rb[i] ? (x / rb[i]).toFixed(2) : "-"));
  console.log([`relaxed-simd/simd128 ${t}`, "", "", ...ratios].join(" | "));
  if (THREADS === 1) break;
}
const cpu1 = results["nexttoken cpu 1 thread"];
if (cpu1) {
  console.log(
    `wasm memory ${(cpu1.wasmMemoryBytes / 2 ** 20).toFixed(1)} MiB; decode bandwidth ${fmt(cpu1.decode16?.weightGBs)} GB/s of weights vs memcpy ${fmt(cpu1.memcpyGBs)} GB/s (1 thread); decode walk ${cpu1.decodeWalk}`,
  );
}
// Speculative decoding in wasm against plain decoding in the same run (bench.js's replays).
for (const [name, r] of Object.entries(results)) {
  const sp = r.speculative;
  if (!sp) continue;
  const runs = Object.entries(sp.runs).map(
    ([k, v]) => `${k} ${fmt(v.tokS)} tok/s (${v.speedup.toFixed(2)}x, ${v.tokensPerPass.toFixed(2)} tokens/pass)`,
  );
  console.log(
    `${name}: speculative, k = ${sp.k}, ${sp.tokens} tokens: plain ${fmt(sp.plainTokS)} tok/s; ${runs.join("; ")}`,
  );
}
console.log("\nratio nexttoken/wllama, same thread count (higher = nexttoken faster; load: lower = nexttoken faster)");
for (const t of [1, THREADS]) {
  const a = results[`nexttoken cpu ${t} thread${t > 1 ? "s" : ""}`],
    b = results[`wllama ${t} thread${t > 1 ? "s" : ""}`];
  if (!a || !b || (t > 1 && t === 1)) continue;
  const ra = row(a),
    rb = row(b);
  console.log(
    [`${t} thread${t > 1 ? "s" : ""}`, ...ra.map((x, i) => (x && rb[i] ? (x / rb[i]).toFixed(2) : "-"))].join(" | "),
  );
  if (THREADS === 1) break;
}
// The native CLI on the same file, threads and contexts, on this machine: each wasm figure as a
// share of native's (the browser CPU path's targets are these ratios).
const file = process.env.MODEL_FILE ? path.resolve(process.env.MODEL_FILE) : path.join(www, MODEL);
// The release build (a debug build's speed says nothing), or NEXTTOKEN_BIN.
const release = path.join(repo, "target/release/nexttoken");
const bin = process.env.NEXTTOKEN_BIN || (fs.existsSync(release) ? release : null);
if (!bin) console.log("\nno release build of the native CLI (cargo build --release): no wasm/native ratios");
if (bin && longTokens) {
  console.log(`\nnative CLI (${path.relative(repo, bin)} bench --backend cpu), same file and threads; wasm/native`);
  console.log(["run", "prefill16", "prefill128", "decode@16", `decode@${longTokens}`].join(" | "));
  for (const t of [1, THREADS]) {
    const wasm = results[`nexttoken cpu ${t} thread${t > 1 ? "s" : ""}`];
    if (!wasm) continue;
    const args = ["bench", "--model", file, "--backend", "cpu", "--threads", String(t), "--json"];
    const r = spawnSync(bin, [...args, "--contexts", `16,${longTokens}`], { encoding: "utf8" });
    if (r.status !== 0) {
      console.log(`native bench failed: ${r.stderr.trim().split("\n").at(-1)}`);
      break;
    }
    const n = JSON.parse(r.stdout).results[0];
    const native = [
      n.prefill_tok_s["16"],
      n.prefill_tok_s["128"],
      n.decode_tok_s["16"],
      n.decode_tok_s[String(longTokens)],
    ];
    const ours = row(wasm).slice(1);
    console.log([`native ${t} thread${t > 1 ? "s" : ""}`, ...native.map(fmt)].join(" | "));
    console.log(
      [
        `wasm/native ${t}`,
        ...ours.map((x, i) => (x && native[i] ? `${((100 * x) / native[i]).toFixed(0)} %` : "-")),
      ].join(" | "),
    );
    if (THREADS === 1) break;
  }
}
console.log(`\n${passed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
