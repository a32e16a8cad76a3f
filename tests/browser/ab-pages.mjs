// Two page setups against each other in headless Chromium: www/bench.html served from two
// folders (copies of www/ with different wasm builds), or one folder at two thread counts, the
// pages alternated ROUNDS times in one browser so that whatever else the machine does slows both
// alike. Prints each side's prefill and decode tok/s (medians and runs) and B/A. For changes to
// the threads build, which ab-builds.mjs (two one-thread builds on one page) cannot load.
//
//   node tests/browser/ab-pages.mjs WWW_A[:THREADS] WWW_B[:THREADS]
//
// e.g. `cp -r www /tmp/ab-old` before a change, then `node tests/browser/ab-pages.mjs
// /tmp/ab-old:2 www:2` after it; or `www:1 www:2` for what a second thread adds.
// Environment: MODEL_FILE (default: the default model), ROUNDS (default 3), SIMD=simd128 (that
// build where relaxed-simd would run), PAGE_TIMEOUT_S (default 600).

import path from "node:path";
import { chromium } from "playwright-core";
import { serve } from "./serve.mjs";

const sides = process.argv.slice(2, 4).map((arg) => {
  const [dir, threads = "1"] = arg.split(":");
  return { dir: path.resolve(dir), threads: Number(threads) };
});
if (sides.length !== 2) throw new Error("usage: node tests/browser/ab-pages.mjs WWW_A[:THREADS] WWW_B[:THREADS]");
const ROUNDS = Number(process.env.ROUNDS || 3);
const PAGE_TIMEOUT_S = Number(process.env.PAGE_TIMEOUT_S || 600);
const mounts = { "/a/": sides[0].dir, "/b/": sides[1].dir };
let model = "models/default.gguf";
if (process.env.MODEL_FILE) {
  mounts["/ab-model/"] = path.dirname(path.resolve(process.env.MODEL_FILE));
  model = `/ab-model/${path.basename(process.env.MODEL_FILE)}`;
}
const server = await serve(sides[0].dir, 0, mounts);
const base = `http://127.0.0.1:${server.address().port}`;
const browser = await chromium.launch({ executablePath: process.env.CHROMIUM || "/usr/bin/chromium" });
const median = (xs) => [...xs].sort((a, b) => a - b)[(xs.length - 1) >> 1];
const figures = {
  "prefill 16": (r) => r.prefill16.tokS,
  "prefill 128": (r) => r.prefill128.tokS,
  "decode @16": (r) => r.decode16.tokS,
  "decode @long": (r) => r.decodeLong.tokS,
};
const runs = sides.map(() => Object.fromEntries(Object.keys(figures).map((k) => [k, []])));
try {
  for (let round = 0; round < ROUNDS; round++)
    for (const [i, side] of sides.entries()) {
      const page = await browser.newPage();
      const errors = [];
      page.on("pageerror", (e) => errors.push(e.message));
      const params = new URLSearchParams({ model, backend: "cpu", reps: "1", threads: side.threads, speculative: "0" });
      if (process.env.SIMD) params.set("simd", process.env.SIMD);
      if (side.threads === 1) params.set("isolate", "0");
      await page.goto(`${base}/${"ab"[i]}/bench.html?${params}`);
      await page.waitForFunction(() => window.benchResult || window.benchError, null, {
        timeout: PAGE_TIMEOUT_S * 1000,
      });
      const r = await page.evaluate(() => window.benchResult || { error: window.benchError });
      await page.close();
      if (r.error) throw new Error(`${side.dir}: ${r.error} ${errors.join("; ")}`);
      if (r.threads !== side.threads)
        throw new Error(`${side.dir}: asked for ${side.threads} threads, ran ${r.threads}`);
      for (const [name, get] of Object.entries(figures)) runs[i][name].push(get(r));
      console.log(`round ${round + 1} ${"AB"[i]}: ${r.backendDetail}, walk ${r.decodeWalk}`);
    }
  const label = (s) => `${path.relative(process.cwd(), s.dir) || "."}, ${s.threads} thread${s.threads > 1 ? "s" : ""}`;
  console.log(`\n| tok/s | A: ${label(sides[0])} | B: ${label(sides[1])} | B/A |\n| --- | ---: | ---: | ---: |`);
  for (const name of Object.keys(figures)) {
    const [a, b] = runs.map((r) => median(r[name]));
    const all = (r) => r[name].map((v) => v.toFixed(1)).join(", ");
    console.log(
      `| ${name} | ${a.toFixed(1)} (${all(runs[0])}) | ${b.toFixed(1)} (${all(runs[1])}) | ${(b / a).toFixed(2)} |`,
    );
  }
} finally {
  await browser.close();
  server.close();
}
