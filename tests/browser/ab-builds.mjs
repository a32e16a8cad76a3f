// Two wasm builds against each other on one page of headless Chromium: each loads the same GGUF
// (one thread), then a ~128-token prefill runs 7 times on each, the builds alternated so that
// whatever else the machine does slows both alike. Prints each build's prefill tok/s (median and
// runs) and new/old. For kernel changes on a noisy host, where two bench.mjs runs differ by more
// than the change.
//
//   node tests/browser/ab-builds.mjs OLD_PKG_DIR NEW_PKG_DIR MODEL.gguf
//
// The package folders are wasm-bindgen outputs (copies of www/pkg-relaxed/ before and after);
// the tokenizer is the default model's (synthetic models share its vocabulary size).

import path from "node:path";
import { chromium } from "playwright-core";
import { serve } from "./serve.mjs";

const [oldDir, newDir, model] = process.argv.slice(2);
if (!model) throw new Error("usage: node tests/browser/ab-builds.mjs OLD_PKG_DIR NEW_PKG_DIR MODEL.gguf");
const www = path.resolve(path.dirname(new URL(import.meta.url).pathname), "../../www");
const server = await serve(www, 0, {
  "/ab-old/": path.resolve(oldDir),
  "/ab-new/": path.resolve(newDir),
  "/ab-model/": path.dirname(path.resolve(model)),
});
const base = `http://127.0.0.1:${server.address().port}`;
const browser = await chromium.launch({ executablePath: process.env.CHROMIUM || "/usr/bin/chromium" });
try {
  const page = await browser.newPage();
  await page.goto(`${base}/index.html?isolate=0`);
  const runs = await page.evaluate(async (file) => {
    const get = async (url) => new Uint8Array(await (await fetch(url)).arrayBuffer());
    const bytes = await get(`/ab-model/${file}`);
    const tokenizer = await get("/models/default-tokenizer.json");
    const engines = {};
    for (const dir of ["ab-old", "ab-new"]) {
      const m = await import(`/${dir}/nexttoken.js`);
      await m.default({ module_or_path: `/${dir}/nexttoken_bg.wasm` });
      const sink = new m.ByteSink(bytes.length);
      sink.push(bytes);
      engines[dir] = await m.Engine.loadGguf(sink, tokenizer, { backend: "cpu", maxSeq: 512, threads: 1 });
    }
    const text =
      "Once upon a time there was a little girl named Lily. She loved to play outside in the park with her friends. " +
      "One day she saw a big red ball under a tree and ran to get it. ";
    const prompt = text.repeat(4).slice(0, 560);
    const run = async (engine, p) => {
      const s = engine.start(p, { temperature: 0, maxTokens: 1 });
      while ((await s.next()) !== null) {}
      const summary = s.summary();
      s.free();
      return summary;
    };
    const out = { "ab-old": [], "ab-new": [] };
    for (let i = 0; i < 7; i++)
      for (const dir of ["ab-old", "ab-new"]) {
        // Other text first, so that the prompt is computed whole (no KV cache reuse).
        await run(engines[dir], "Zebras");
        const s = await run(engines[dir], prompt);
        out[dir].push(((s.promptTokens - s.reusedTokens) * 1000) / s.prefillMs);
      }
    return out;
  }, path.basename(model));
  const median = (xs) => [...xs].sort((a, b) => a - b)[xs.length >> 1];
  for (const [dir, v] of Object.entries(runs))
    console.log(`${dir}: prefill ${median(v).toFixed(1)} tok/s (runs ${v.map((x) => x.toFixed(0)).join(" ")})`);
  console.log(`new/old ${(median(runs["ab-new"]) / median(runs["ab-old"])).toFixed(2)}`);
} finally {
  await browser.close();
  server.close();
}
