// Two wasm builds against each other on one page of headless Chromium: each loads the same GGUF
// (one thread), then each figure is measured ROUNDS times (default 7) on each, the builds
// alternated so that whatever else the machine does slows both alike: a ~128-token prefill,
// decode after a 16-token prompt, and with LONG=1 decode after a 2400-character one. Prints each
// build's tok/s (median and runs) and new/old. For kernel changes on a noisy host, where two
// bench.mjs runs differ by more than the change.
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
  const runs = await page.evaluate(
    async ({ file, rounds, long }) => {
      const get = async (url) => new Uint8Array(await (await fetch(url)).arrayBuffer());
      const bytes = await get(`/ab-model/${file}`);
      const tokenizer = await get("/models/default-tokenizer.json");
      const engines = {};
      for (const dir of ["ab-old", "ab-new"]) {
        const m = await import(`/${dir}/nexttoken.js`);
        await m.default({ module_or_path: `/${dir}/nexttoken_bg.wasm` });
        const sink = new m.ByteSink(bytes.length);
        sink.push(bytes);
        engines[dir] = await m.Engine.loadGguf(sink, tokenizer, { backend: "cpu", maxSeq: 2048, threads: 1 });
      }
      const text =
        "Once upon a time there was a little girl named Lily. She loved to play outside in the park with her friends. " +
        "One day she saw a big red ball under a tree and ran to get it. ";
      const run = async (engine, p, maxTokens) => {
        const s = engine.start(p, { temperature: 0, maxTokens });
        while ((await s.next()) !== null) {}
        const summary = s.summary();
        s.free();
        return summary;
      };
      const prefill = async (engine, p) => {
        // Other text first, so that the prompt is computed whole (no KV cache reuse).
        await run(engine, "Zebras", 1);
        const s = await run(engine, p, 1);
        return ((s.promptTokens - s.reusedTokens) * 1000) / s.prefillMs;
      };
      const decode = async (engine, p) => {
        await run(engine, "Zebras", 1);
        const s = await run(engine, p, 25);
        return ((s.generatedTokens - 1) * 1000) / s.decodeMs;
      };
      const figures = {
        "prefill ~128": (e) => prefill(e, text.repeat(4).slice(0, 560)),
        "decode @16": (e) => decode(e, text.slice(0, 70)),
      };
      if (long) figures["decode @long"] = (e) => decode(e, text.repeat(20).slice(0, 2400));
      const out = {};
      for (const name of Object.keys(figures)) out[name] = { "ab-old": [], "ab-new": [] };
      for (let i = 0; i < rounds; i++)
        for (const [name, measure] of Object.entries(figures))
          for (const dir of ["ab-old", "ab-new"]) out[name][dir].push(await measure(engines[dir]));
      // Each build times its decode walk in its first steps (src/cpu/walk.rs): one that settled
      // otherwise than the other decodes differently for that reason alone.
      out.walks = Object.fromEntries(Object.entries(engines).map(([dir, e]) => [dir, e.decodeWalk()]));
      return out;
    },
    { file: path.basename(model), rounds: Number(process.env.ROUNDS || 7), long: process.env.LONG === "1" },
  );
  const median = (xs) => [...xs].sort((a, b) => a - b)[xs.length >> 1];
  const { walks, ...figures } = runs;
  console.log(`decode walks: old ${walks["ab-old"]}, new ${walks["ab-new"]}`);
  for (const [name, byDir] of Object.entries(figures)) {
    for (const [dir, v] of Object.entries(byDir))
      console.log(`${name} ${dir}: ${median(v).toFixed(1)} tok/s (runs ${v.map((x) => x.toFixed(0)).join(" ")})`);
    console.log(`${name} new/old ${(median(byDir["ab-new"]) / median(byDir["ab-old"])).toFixed(2)}`);
  }
} finally {
  await browser.close();
  server.close();
}
