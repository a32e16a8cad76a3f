// The CPU-path browser tests again in Firefox: Debian's firefox-esr, headless, driven over
// WebDriver BiDi by puppeteer-core (Playwright cannot drive a stock Firefox). Firefox has no
// WebGPU here, so the page must pick the wasm CPU path by itself and say why. Checked: the app
// with the default model (greedy text equals the native CLI's), the <next-token> lesson, the
// Cache API and a second visit with the server gone (service worker + cached model).
//
//   node tests/browser/firefox.mjs        (after ./build.sh; FIREFOX=/path/to/firefox)
//
// Closing line: "N passed, N failed"; exit status 1 if anything failed.

import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { appOutcome, assert, assertEq, nativeGreedy, outDir, runner, setGreedy, www } from "./harness.mjs";

const here = path.dirname(fileURLToPath(import.meta.url));
const firefoxPath = process.env.FIREFOX || "/usr/bin/firefox-esr";
if (!fs.existsSync(firefoxPath)) {
  console.log(`no Firefox at ${firefoxPath} (apt-get install firefox-esr, or set FIREFOX)\n0 passed, 1 failed`);
  process.exit(1);
}
if (!fs.existsSync(path.join(here, "node_modules", "puppeteer-core"))) {
  const r = spawnSync("npm", ["install", "--no-audit", "--no-fund", "--loglevel=error"], {
    cwd: here,
    stdio: "inherit",
  });
  if (r.status !== 0) process.exit(1);
}
const { default: puppeteer } = await import("puppeteer-core");
const { serve } = await import("./serve.mjs");
const { test, finish, failed } = runner("firefox");

const PROMPT = "In the beginning";
const N = 24;
const expected = nativeGreedy(PROMPT, N);

let server = await serve(www, 0, {}, {});
const port = server.address().port;
const base = `http://127.0.0.1:${port}`;
const stopServer = async () => {
  server.closeAllConnections?.();
  await new Promise((r) => server.close(r));
};

const profile = fs.mkdtempSync(path.join(os.tmpdir(), "nexttoken-firefox-"));
const browser = await puppeteer.launch({
  browser: "firefox",
  executablePath: firefoxPath,
  headless: true,
  userDataDir: profile,
});
const page = await browser.newPage();
// Firefox on a loaded 2-core CI machine sometimes takes over a minute to start the first page
// (a 62 s first test was seen): puppeteer's 30 s navigation default then fails a working page.
page.setDefaultNavigationTimeout(120_000);
const consoleLines = [];
page.on("console", (m) => consoleLines.push(`${m.type()}: ${m.text()}`));
/** Wait for the page's state; on a timeout, say where the page was (state, error, stats, output). */
async function waitState(want, timeout = 120_000) {
  try {
    await page.waitForFunction((w) => [].concat(w).includes(document.body.dataset.state), { timeout }, want);
  } catch (e) {
    const where = await page
      .evaluate(() =>
        JSON.stringify({
          state: document.body.dataset.state,
          error: document.getElementById("error-text")?.textContent,
          status: document.getElementById("status")?.textContent,
          stats: window.nexttokenApp?.stats,
          output: document.getElementById("output-tokens")?.textContent,
        }),
      )
      .catch((e2) => `(page unreadable: ${e2})`);
    await page.screenshot({ path: path.join(outDir, "firefox-timeout.png") }).catch(() => {});
    throw new Error(`waiting for state ${JSON.stringify(want)}: ${e.message}; the page: ${where}`);
  }
}
const errorText = () =>
  page.evaluate(() =>
    document.getElementById("error").hidden ? "" : document.getElementById("error-text").textContent,
  );

async function generateDefault(label) {
  await waitState(["ready", "error"]);
  assertEq(await errorText(), "", `${label}: error shown`);
  await page.evaluate(setGreedy, N);
  await page.click("#generate");
  await waitState("ready");
  assertEq(await errorText(), "", `${label}: generation error`);
  return page.evaluate(() => document.getElementById("output-tokens").textContent);
}

/** Cross-origin isolated (serve.mjs): the threads build, its pool started by the page, one thread a core. */
async function assertThreads(label) {
  const { backend, cores } = await page.evaluate(() => ({
    backend: window.nexttokenApp.stats.backend,
    cores: navigator.hardwareConcurrency,
  }));
  const threads = Number((/(\d+) threads?/.exec(backend) || [])[1] || 1);
  if (cores > 1 && fs.existsSync(path.join(www, "pkg-threads", "nexttoken_bg.wasm")))
    assertEq(threads, cores, `${label}: CPU threads (${backend})`);
}

try {
  await test("the app picks the default model, runs it on the wasm CPU path (saying why) and matches the native CLI", async () => {
    await page.goto(`${base}/?prompt=${encodeURIComponent(PROMPT)}`);
    const text = await generateDefault("first visit");
    assertEq(text, expected, "greedy text vs the native CLI");
    const backend = await page.evaluate(() => window.nexttokenApp.stats.backend);
    assert(/^CPU/.test(backend) && /WebGPU/.test(backend), `the stats do not say why the CPU runs: ${backend}`);
    await assertThreads("first visit");
    console.log(`      backend: ${backend}`);
  });

  await test("the wasm kernel self-test: simd128, and relaxed-simd where Firefox validates it, match the scalar kernels; the app runs the one it validates", async () => {
    const r = await page.evaluate(async () => {
      const { relaxedSimd } = await import("/wasm.js");
      const out = { relaxed: relaxedSimd(), runs: [] };
      for (const dir of out.relaxed ? ["pkg", "pkg-relaxed"] : ["pkg"]) {
        try {
          const wasm = await import(`/${dir}/nexttoken.js`);
          await wasm.default();
          out.runs.push({ dir, summary: wasm.kernelSelfTest() });
        } catch (e) {
          out.runs.push({ dir, error: String(e?.message || e) });
        }
      }
      return out;
    });
    console.log(`      relaxed-simd validates: ${r.relaxed}`);
    for (const run of r.runs) {
      assert(!run.error, `${run.dir}: ${run.error}`);
      console.log(`      ${run.dir}: ${run.summary.slice(0, 60)}…`);
    }
    const backend = await page.evaluate(() => window.nexttokenApp.stats.backend);
    const relaxedBuilt = fs.existsSync(path.join(www, "pkg-relaxed", "nexttoken_bg.wasm"));
    const isa = r.relaxed && relaxedBuilt ? "relaxed-simd" : "simd128";
    assert(new RegExp(`${isa} int8 kernels`).test(backend), `expected ${isa} kernels: ${backend}`);
  });

  await test("two tabs of a page that is not cross-origin isolated share one engine (a SharedWorker): the second finds the model loaded, and both match the native CLI", async () => {
    const url = `${base}/?isolate=0&nosw&prompt=${encodeURIComponent(PROMPT)}`;
    const second = await browser.newPage();
    try {
      await page.goto(url);
      assertEq(await generateDefault("first tab"), expected, "first tab: greedy text vs the native CLI");
      await second.goto(url);
      await second.waitForFunction(() => ["ready", "error"].includes(document.body.dataset.state), {
        timeout: 120_000,
      });
      await second.evaluate(setGreedy, N);
      await second.click("#generate");
      await second.waitForFunction(
        () => document.body.dataset.state === "ready" && document.getElementById("output-tokens").textContent,
        { timeout: 120_000 },
      );
      const got = await second.evaluate(appOutcome);
      const stats = await second.evaluate(() => window.nexttokenApp.stats);
      assertEq(got.error, "", "second tab: error shown");
      assertEq(got.text, expected, "second tab: greedy text vs the native CLI");
      assert(
        /^none: the engine holds this model already/.test(stats.download),
        `second tab's download: ${stats.download}`,
      );
      assert(
        /2 pages connected, this model's one copy used by 2 loads/.test(stats.engine),
        `second tab's engine: ${stats.engine}`,
      );
    } finally {
      await second.close();
    }
  });

  await test("the <next-token> lesson shows P(the cat sat) = 0.42", async () => {
    await page.goto(`${base}/embed.html`);
    const line = await page.waitForFunction(
      () => {
        const el = document.getElementById("cat");
        const product = el?.shadowRoot?.querySelector(".product");
        return product && !product.hidden && product.textContent;
      },
      { timeout: 60_000 },
    );
    const text = await line.jsonValue();
    assert(/“the cat sat”/.test(text) && /= 0\.42$/.test(text), `product line: ${text}`);
  });

  await test("the model is in the Cache API; a second visit with the server gone works from the caches", async () => {
    await page.goto(`${base}/?prompt=${encodeURIComponent(PROMPT)}`);
    await waitState(["ready", "error"]);
    await page.evaluate(() => navigator.serviceWorker.ready);
    const cached = await page.evaluate(async () =>
      (await (await import("./model-cache.js")).listCached()).map((r) => r.url),
    );
    assert(
      cached.some((u) => u.endsWith("/models/default.gguf")),
      `model not cached: ${JSON.stringify(cached)}`,
    );
    await stopServer();
    try {
      await page.reload();
      const text = await generateDefault("offline");
      assertEq(text, expected, "offline greedy text");
      await assertThreads("offline");
      assert(
        /cache/.test(await page.evaluate(() => window.nexttokenApp.stats.download || "")),
        "offline: not loaded from the cache",
      );
    } finally {
      server = await serve(www, port, {}, {});
    }
  });
} finally {
  if (failed()) fs.writeFileSync(path.join(outDir, "console-firefox.log"), consoleLines.join("\n"));
  await browser.close().catch(() => {});
  await stopServer().catch(() => {});
  fs.rmSync(profile, { recursive: true, force: true });
}
finish();
