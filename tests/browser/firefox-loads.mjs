// A stress check, not part of the suite (it takes minutes): load the app in Firefox many times and
// count the loads that never reach "ready". It caught Firefox blocking the inference worker inside
// `new Worker()` while that worker started the thread pool's workers itself (about one load in
// thirty on a 2-core host, ARCHITECTURE.md); the page starts them now (www/pool.js).
//
//   node tests/browser/firefox-loads.mjs [LOADS]     (after ./build.sh; default 100 loads)
//
// Closing line: "N of M loads stuck"; exit status 1 if any was.

import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const www = path.resolve(here, "../../www");
const firefoxPath = process.env.FIREFOX || "/usr/bin/firefox-esr";
const loads = Number(process.argv[2] || 100);
const { default: puppeteer } = await import("puppeteer-core");
const { serve } = await import("./serve.mjs");

const server = await serve(www, 0, {}, {});
const base = `http://127.0.0.1:${server.address().port}`;
const profile = fs.mkdtempSync(path.join(os.tmpdir(), "nexttoken-firefox-"));
const browser = await puppeteer.launch({
  browser: "firefox",
  executablePath: firefoxPath,
  headless: true,
  userDataDir: profile,
});
let stuck = 0;
try {
  const page = await browser.newPage();
  for (let i = 0; i < loads; i++) {
    await page.goto(`${base}/?prompt=In`);
    // Polled from here (a load takes about a second; 15 s is a stuck one).
    const t0 = Date.now();
    let state;
    do {
      await new Promise((r) => setTimeout(r, 100));
      state = await page.evaluate(() => document.body.dataset.state);
    } while (state !== "ready" && state !== "error" && Date.now() - t0 < 15_000);
    const threads = await page.evaluate(() => window.nexttokenApp?.stats?.backend || "");
    if (state !== "ready") {
      stuck++;
      console.log(`load ${i + 1}: ${state} after 15 s`);
    } else if (i === 0) console.log(`backend: ${threads}`);
  }
} finally {
  await browser.close().catch(() => {});
  server.close();
  fs.rmSync(profile, { recursive: true, force: true });
}
console.log(`${stuck} of ${loads} loads stuck`);
process.exit(stuck ? 1 : 0);
