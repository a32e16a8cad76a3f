// Browser tests for www/: Playwright (playwright-core) driving the system Chromium, twice: with
// WebGPU exposed (--enable-unsafe-webgpu, SwiftShader when there is no GPU) and without it (the
// CPU fallback). Starts its own static server on 127.0.0.1 (a free port) and stops it.
//
//   node tests/browser/run.mjs          (after ./build.sh; or ./build.sh test)
//
// Environment: CHROMIUM=/path/to/chromium (default /usr/bin/chromium), NEXTTOKEN_BIN=path to the
// native CLI (default target/release/nexttoken, else target/debug/nexttoken),
// NEXTTOKEN_REQUIRE_SHARED=1 (missing ../shared is a failure, not a skip),
// NEXTTOKEN_REQUIRE_WEBGPU=1 (the WebGPU run must really use WebGPU), ONLY=cpu|webgpu,
// FILTER=regex (only the tests whose names match).
// Closing line: "N passed, N failed" (and skipped); the exit status is 1 if anything failed.

import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const repo = path.resolve(here, "../..");
const www = path.join(repo, "www");
const shared = path.resolve(repo, "../shared/models/stories260K");
const tokenizerTests = path.resolve(repo, "../shared/tokenizer-tests");
const TOKENIZER_FOLDERS = ["gpt-2", "llama-spm", "qwen2", "llama-bpe"];
const outDir = path.join(repo, "target", "browser-tests");
fs.mkdirSync(outDir, { recursive: true });

if (!fs.existsSync(path.join(here, "node_modules", "playwright-core"))) {
  console.log("installing npm packages in tests/browser …");
  const r = spawnSync("npm", ["install", "--no-audit", "--no-fund", "--loglevel=error"], {
    cwd: here,
    stdio: "inherit",
  });
  if (r.status !== 0) {
    console.log("npm install failed\n0 passed, 1 failed");
    process.exit(1);
  }
}
const { chromium } = await import("playwright-core");
const { serve } = await import("./serve.mjs");
const { ggufWithout } = await import("./gguf.mjs");
const { makeChatFixture, makeToolsFixture, chatTests, shippedChatTests, toolTests } = await import("./chat.mjs");
const { faultyServer, downloadTests } = await import("./downloads.mjs");
const { pageTests } = await import("./page.mjs");
const { exploreTests, samplerViewTests, scoreViewTests, beamViewTests } = await import("./explore.mjs");
const { embedTests } = await import("./embed.mjs");
const { elementTests } = await import("./element.mjs");
const { replayTests } = await import("./replay.mjs");
const { preflightTests } = await import("./preflight.mjs");
const { engineTests } = await import("./engine.mjs");
const { makeBigModel, streamTests } = await import("./stream.mjs");
const { structuredTests } = await import("./structured.mjs");
const faulty = faultyServer();

let passed = 0;
let failed = 0;
let skipped = 0;
const failures = [];

async function test(name, fn) {
  // FILTER=regex runs only the tests whose names match (while working on one feature).
  if (process.env.FILTER && !new RegExp(process.env.FILTER).test(name)) return;
  const t0 = Date.now();
  try {
    const r = await fn();
    if (r === "skip") {
      skipped++;
      console.log(`SKIP  ${name}`);
    } else {
      passed++;
      console.log(`ok    ${name} (${Date.now() - t0} ms)`);
    }
  } catch (e) {
    failed++;
    failures.push(name);
    console.log(
      `FAIL  ${name}\n      ${String(e?.stack ? e.stack : e)
        .split("\n")
        .slice(0, 6)
        .join("\n      ")}`,
    );
  }
}

function assert(cond, message) {
  if (!cond) throw new Error(message);
}
function assertEq(got, want, what) {
  if (got !== want)
    throw new Error(`${what}:\n        got:  ${JSON.stringify(got)}\n        want: ${JSON.stringify(want)}`);
}

// ---------------------------------------------------------------------------------------------
// Fixtures

if (!fs.existsSync(path.join(www, "pkg", "nexttoken_bg.wasm"))) {
  console.log("www/pkg is missing: run ./build.sh first\n0 passed, 1 failed");
  process.exit(1);
}
const chromiumPath = process.env.CHROMIUM || "/usr/bin/chromium";
if (!fs.existsSync(chromiumPath)) {
  console.log(`no Chromium at ${chromiumPath} (apt-get install chromium, or set CHROMIUM)\n0 passed, 1 failed`);
  process.exit(1);
}

const fixtures = fs.mkdtempSync(path.join(os.tmpdir(), "nexttoken-browser-"));
const haveShared =
  fs.existsSync(path.join(shared, "stories260K-f32.gguf")) && fs.existsSync(path.join(shared, "tokenizer.json"));
if (!haveShared) {
  const msg = `!!! SKIPPED: ${shared} is absent: the stories260K tests cannot run !!!`;
  if (process.env.NEXTTOKEN_REQUIRE_SHARED) {
    console.log(`${msg} (NEXTTOKEN_REQUIRE_SHARED is set)\n0 passed, 1 failed`);
    process.exit(1);
  }
  console.log(`\n${"!".repeat(msg.length)}\n${msg}\n${"!".repeat(msg.length)}\n`);
} else {
  fs.copyFileSync(path.join(shared, "stories260K-f32.gguf"), path.join(fixtures, "stories260K-f32.gguf"));
  fs.copyFileSync(path.join(shared, "tokenizer.json"), path.join(fixtures, "tokenizer.json"));
  // The first 60% of the model: a GGUF whose tensors run past the end of the file.
  const whole = fs.readFileSync(path.join(shared, "stories260K-f32.gguf"));
  fs.writeFileSync(path.join(fixtures, "truncated.gguf"), whole.subarray(0, Math.floor(whole.length * 0.6)));
}
// llama.cpp's tokenizer vectors: a vocabulary-only GGUF, tests.inp and tests.out per folder.
const haveTokenizerTests = TOKENIZER_FOLDERS.every((name) =>
  ["tests.inp", "tests.out", `ggml-vocab-${name}.gguf`].every((f) => fs.existsSync(path.join(tokenizerTests, name, f))),
);
if (!haveTokenizerTests) {
  const msg = `!!! SKIPPED: ${tokenizerTests}/{${TOKENIZER_FOLDERS.join(",")}} incomplete: the tokenizer-vector tests cannot run !!!`;
  if (process.env.NEXTTOKEN_REQUIRE_SHARED) {
    console.log(`${msg} (NEXTTOKEN_REQUIRE_SHARED is set)\n0 passed, 1 failed`);
    process.exit(1);
  }
  console.log(`\n${"!".repeat(msg.length)}\n${msg}\n${"!".repeat(msg.length)}\n`);
} else {
  for (const name of TOKENIZER_FOLDERS) {
    fs.mkdirSync(path.join(fixtures, "tokenizer-tests", name), { recursive: true });
    fs.copyFileSync(
      path.join(tokenizerTests, name, `ggml-vocab-${name}.gguf`),
      path.join(fixtures, "tokenizer-tests", name, "vocab.gguf"),
    );
  }
}
/** A folder's vectors as tests/tokenizer_parity.rs reads them: [text, expected ids]. */
function tokenizerVectors(name) {
  const inp = fs.readFileSync(path.join(tokenizerTests, name, "tests.inp"), "utf8");
  const out = fs.readFileSync(path.join(tokenizerTests, name, "tests.out"), "utf8");
  // Rust's str::lines(): no empty last line for the final newline.
  const expected = out.replace(/\r?\n$/, "").split(/\r?\n/);
  // The .inp file ends with a separator, so the split leaves one empty string at the end.
  const texts = inp.split("\n__ggml_vocab_test__\n").slice(0, expected.length);
  assert(
    texts.length === expected.length && texts.length >= 40,
    `${name}: ${texts.length} texts for ${expected.length} expected lines`,
  );
  return texts.map((t, i) => [t, expected[i].split(/\s+/).filter(Boolean).map(Number)]);
}

// The default model alone in a folder (no tokenizer.json beside it): its GGUF carries the
// tokenizer (llama.cpp's converter wrote tokenizer.ggml.*); and a copy without those keys.
const ggufOnly = path.join(fixtures, "gguf-only");
fs.mkdirSync(ggufOnly);
const haveDefaultModel = fs.existsSync(path.join(www, "models", "default.gguf"));
if (haveDefaultModel) {
  const bytes = fs.readFileSync(path.join(www, "models", "default.gguf"));
  fs.writeFileSync(path.join(ggufOnly, "default.gguf"), bytes);
  fs.writeFileSync(
    path.join(ggufOnly, "no-tokenizer.gguf"),
    ggufWithout(bytes, (key) => key.startsWith("tokenizer.")),
  );
}

// A table model whose words, joined, are an HTML injection.
fs.writeFileSync(
  path.join(fixtures, "xss.json"),
  JSON.stringify({
    name: "xss",
    vocab: ["<s>", "<img", "src=x", "onerror=window.__xss=1>", "<script>window.__xss=2</script>", "</s>"],
    bos: "<s>",
    eos: "</s>",
    next: {
      "<s>": { "<img": 1.0 },
      "<img": { "src=x": 1.0 },
      "src=x": { "onerror=window.__xss=1>": 1.0 },
      "onerror=window.__xss=1>": { "<script>window.__xss=2</script>": 1.0 },
      "<script>window.__xss=2</script>": { "</s>": 1.0 },
    },
  }),
);

// The wasm threads build (./build.sh; NO_THREADS=1 skips it): required unless skipped on purpose.
const haveThreadsBuild = fs.existsSync(path.join(www, "pkg-threads", "nexttoken_bg.wasm"));
if (!haveThreadsBuild && !process.env.NO_THREADS) {
  console.log(
    "www/pkg-threads/ is missing: run ./build.sh (or set NO_THREADS=1 to test without the threads build)\n0 passed, 1 failed",
  );
  process.exit(1);
}

// The relaxed-simd builds (./build.sh; NO_RELAXED=1 skips them): required likewise. This
// Chromium validates relaxed-simd, so the CPU path runs them (www/wasm.js picks).
const haveRelaxedBuild =
  fs.existsSync(path.join(www, "pkg-relaxed", "nexttoken_bg.wasm")) &&
  (!haveThreadsBuild || fs.existsSync(path.join(www, "pkg-threads-relaxed", "nexttoken_bg.wasm")));
if (!haveRelaxedBuild && !process.env.NO_RELAXED) {
  console.log(
    "www/pkg-relaxed/ or www/pkg-threads-relaxed/ is missing: run ./build.sh (or set NO_RELAXED=1 to test without the relaxed-simd builds)\n0 passed, 1 failed",
  );
  process.exit(1);
}
/** The CPU kernels' instruction set the page runs. */
const wasmIsa = haveRelaxedBuild ? "relaxed-simd" : "simd128";

const PROMPT = "Once upon a time";
const N_TOKENS = 32;
let expected = null;
if (haveShared) {
  const bin = nativeBin();
  const r = spawnSync(
    bin,
    [
      "generate",
      "--model",
      path.join(fixtures, "stories260K-f32.gguf"),
      "--prompt",
      PROMPT,
      "--temperature",
      "0",
      "--max-tokens",
      String(N_TOKENS),
      "--backend",
      "cpu",
      "--exact",
    ],
    { encoding: "utf8" },
  );
  assert(r.status === 0, `the CLI failed: ${r.stderr}`);
  assert(r.stdout.startsWith(PROMPT), `the CLI's output does not start with the prompt: ${r.stdout}`);
  expected = r.stdout.slice(PROMPT.length).replace(/\n$/, "");
  console.log(
    `native CLI (${path.relative(repo, bin)}), greedy ${N_TOKENS} tokens: ${JSON.stringify(PROMPT + expected)}`,
  );
}

// A chat model: a synthetic Qwen2 shape whose GGUF carries llama.cpp's Qwen2 vocabulary and
// chat template (tests/browser/chat.mjs).
if (haveTokenizerTests) {
  makeChatFixture({
    dir: path.join(fixtures, "chat"),
    bin: nativeBin(),
    vocabGguf: path.join(tokenizerTests, "qwen2", "ggml-vocab-qwen2.gguf"),
  });
  makeToolsFixture({
    dir: path.join(fixtures, "tools"),
    bin: nativeBin(),
    vocabGguf: path.join(tokenizerTests, "qwen2", "ggml-vocab-qwen2.gguf"),
    templateFile: path.resolve(repo, "../shared/chat-templates/Qwen2.5-Instruct.jinja"),
    renderedFixture: path.join(repo, "tests/fixtures/tools/rendered.json"),
  });
}

// A synthetic model of about 36 MB (tests/browser/stream.mjs): the weights' place in memory shows.
const bigModel =
  !process.env.FILTER || /MB model/.test(process.env.FILTER)
    ? makeBigModel({ dir: path.join(fixtures, "big"), bin: nativeBin() })
    : null;

// The server: www/, the fixtures under /test/, and a download that breaks off half way. Requests
// for anything but the GGUF files in /test/gguf-only/ (a tokenizer.json beside them) are counted.
let interruptedHits = 0;
const ggufOnlyOthers = [];
const handler = (req, res) => {
  if (faulty.handler(req, res)) return true;
  if (req.url.startsWith("/test/gguf-only/") && !/^\/test\/gguf-only\/[\w-]+\.gguf$/.test(req.url))
    ggufOnlyOthers.push(req.url);
  if (req.url.startsWith("/test/interrupted.gguf")) {
    // A real model's first megabyte (on WebGPU its header is read and its first tensors go to
    // the GPU before the connection drops), of the whole file's length.
    interruptedHits++;
    const whole = fs.readFileSync(path.join(www, "models", "default.gguf"));
    res.writeHead(200, { "content-type": "application/octet-stream", "content-length": whole.length });
    res.write(whole.subarray(0, 1_000_000));
    setTimeout(() => res.destroy(), 100);
    return true;
  }
  return false;
};
let server = await serve(www, 0, { "/test/": fixtures }, { handler });
const port = server.address().port;
const base = `http://127.0.0.1:${port}`;
console.log(`serving www/ on ${base}`);

async function stopServer() {
  server.closeAllConnections?.();
  await new Promise((r) => server.close(r));
}
async function startServer() {
  server = await serve(www, port, { "/test/": fixtures }, { handler });
}

// ---------------------------------------------------------------------------------------------
// Page helpers

const state = (page) => page.evaluate(() => document.body.dataset.state);
async function waitState(page, want, timeout = 60_000) {
  await page.waitForFunction((w) => [].concat(w).includes(document.body.dataset.state), want, { timeout });
}
async function errorText(page) {
  return page.evaluate(() =>
    document.getElementById("error").hidden ? "" : document.getElementById("error-text").textContent,
  );
}
async function waitLoaded(page, timeout = 60_000) {
  await waitState(page, ["ready", "error"], timeout);
  const err = await errorText(page);
  if ((await state(page)) === "error") throw new Error(`the model did not load: ${err}`);
}
async function setSettings(page, { temperature = 0, maxTokens = N_TOKENS } = {}) {
  await page.fill("#temperature", String(temperature));
  await page.fill("#max-tokens", String(maxTokens));
  await page.fill("#beams", "1");
}
const outputText = (page) => page.evaluate(() => document.getElementById("output-tokens").textContent);
const statsOf = (page) => page.evaluate(() => ({ ...window.nexttokenApp.stats }));

/** Record how many tokens were in the DOM each time it changed during generation. */
async function watchTokens(page) {
  await page.evaluate(() => {
    window.__counts = [];
    const out = document.getElementById("output-tokens");
    window.__obs?.disconnect();
    window.__obs = new MutationObserver(() =>
      window.__counts.push([out.childElementCount, out.textContent.length, document.body.dataset.state]),
    );
    window.__obs.observe(out, { childList: true });
  });
}

async function generateAndCheck(page, label, { screenshot } = {}) {
  await setSettings(page);
  await page.fill("#prompt", PROMPT);
  await watchTokens(page);
  await page.click("#generate");
  if (screenshot) {
    // Mid-generation: as soon as a few tokens are out.
    await page.waitForFunction(() => document.getElementById("output-tokens").childElementCount >= 3, null, {
      timeout: 60_000,
    });
    await page.screenshot({ path: screenshot, fullPage: true });
  }
  await waitState(page, "ready", 120_000);
  const err = await errorText(page);
  assert(!err, `generation failed: ${err}`);
  const text = await outputText(page);
  assertEq(text, expected, `${label}: greedy text differs from the native CLI's`);
  const counts = await page.evaluate(() => window.__counts);
  const partial = counts.filter(([n, len, st]) => n > 0 && len < expected.length && st === "generating");
  assert(
    partial.length >= 5,
    `${label}: tokens did not arrive incrementally (DOM updates while generating: ${JSON.stringify(counts.slice(0, 10))})`,
  );
  return text;
}

// ---------------------------------------------------------------------------------------------

let webgpuAdapter = false; // this Chromium exposes a WebGPU adapter (the first test of a config says)

async function runConfig(mode) {
  const webgpu = mode === "webgpu";
  console.log(`\n== Chromium ${webgpu ? "with WebGPU (--enable-unsafe-webgpu)" : "without WebGPU (CPU fallback)"} ==`);
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
  const context = await browser.newContext({ serviceWorkers: "allow", viewport: { width: 1200, height: 900 } });
  const page = await context.newPage();
  const consoleLines = [];
  page.on("console", (m) => consoleLines.push(`${m.type()}: ${m.text()}`));
  page.on("pageerror", (e) => consoleLines.push(`pageerror: ${e.message}`));
  const modelUrl = `/?model=${encodeURIComponent("/test/stories260K-f32.gguf")}&tokenizer=${encodeURIComponent("/test/tokenizer.json")}&prompt=${encodeURIComponent(PROMPT)}`;

  try {
    await test(`[${mode}] navigator.gpu adapter ${webgpu ? "present" : "absent"}`, async () => {
      await page.goto(`${base}/?nosw&model=lesson-toy`);
      const has = await page.evaluate(async () => !!(navigator.gpu && (await navigator.gpu.requestAdapter())));
      webgpuAdapter = has;
      if (webgpu && !has) {
        console.log("      (this Chromium exposes no WebGPU adapter even with --enable-unsafe-webgpu)");
        return "skip";
      }
      assertEq(has, webgpu, "WebGPU adapter available");
    });

    if (!webgpu) {
      await test(`[${mode}] llama.cpp's tokenizer vectors through the wasm build: the tokenizers of the vocabulary-only GGUF files`, async () => {
        // Tokenization does not depend on the backend: run once, in the CPU configuration. All of
        // a folder's vectors go through tokenizeEachWithGguf (the tokenizer is built once: up to
        // a second each); tokenizeWithGguf (one text) must agree on the longest vector.
        if (!haveTokenizerTests) return "skip";
        await page.goto(`${base}/?nosw&model=lesson-toy`);
        const lines = [];
        const failures = [];
        for (const name of TOKENIZER_FOLDERS) {
          const vectors = tokenizerVectors(name);
          const r = await page.evaluate(
            async ({ name, vectors }) => {
              const wasm = await import("/pkg/nexttoken.js");
              await wasm.default();
              const gguf = new Uint8Array(
                await (await fetch(`/test/tokenizer-tests/${name}/vocab.gguf`)).arrayBuffer(),
              );
              const t0 = performance.now();
              let all;
              try {
                all = wasm
                  .tokenizeEachWithGguf(
                    gguf,
                    vectors.map(([text]) => text),
                  )
                  .map((ids) => Array.from(ids));
              } catch (e) {
                return { error: String(e?.message ? e.message : e) };
              }
              const ms = performance.now() - t0;
              const mismatches = [];
              vectors.forEach(([text, want], i) => {
                if (JSON.stringify(all[i]) !== JSON.stringify(want)) mismatches.push({ text, got: all[i], want });
              });
              const longest = vectors.reduce((a, b) => (b[0].length > a[0].length ? b : a));
              const one = Array.from(wasm.tokenizeWithGguf(gguf, longest[0]));
              if (JSON.stringify(one) !== JSON.stringify(longest[1]))
                mismatches.push({ text: longest[0], got: one, want: longest[1], single: true });
              return { mismatches, ms, n: all.length };
            },
            { name, vectors },
          );
          if (r.error) {
            failures.push(`${name}: ${r.error}`);
            continue;
          }
          assertEq(r.n, vectors.length, `${name}: results`);
          const wrong = r.mismatches.filter((m) => !m.single).length;
          lines.push(`${name}: ${vectors.length - wrong} of ${vectors.length} match (${r.ms.toFixed(0)} ms)`);
          for (const m of r.mismatches.slice(0, 3))
            failures.push(
              `${name}${m.single ? " (tokenizeWithGguf)" : ""} ${JSON.stringify(m.text)}: got ${JSON.stringify(m.got)}, want ${JSON.stringify(m.want)}`,
            );
        }
        console.log(`      ${lines.join("\n      ")}`);
        assert(failures.length === 0, `vectors differ:\n${failures.join("\n")}`);
      });
    }

    for (const [dir, isa] of [["pkg", "simd128"], ...(haveRelaxedBuild ? [["pkg-relaxed", "relaxed-simd"]] : [])]) {
      await test(`[${mode}] wasm kernel self-test: the ${isa} kernels (${dir}/) match the scalar ones`, async () => {
        // cargo test cannot run wasm kernels: the library checks them against scalar in the page.
        await page.goto(`${base}/?nosw&model=lesson-toy`);
        const r = await page.evaluate(async (dir) => {
          const wasm = await import(`/${dir}/nexttoken.js`);
          await wasm.default();
          try {
            const t0 = performance.now();
            const summary = wasm.kernelSelfTest();
            return { summary, ms: performance.now() - t0 };
          } catch (e) {
            return { error: String(e?.message ? e.message : e) };
          }
        }, dir);
        assert(!r.error, `kernel self-test failed: ${r.error}`);
        console.log(`      ${r.summary} (${r.ms.toFixed(0)} ms)`);
        assert(
          new RegExp(`^${isa}: \\d+ results match scalar`).test(r.summary),
          `expected the ${isa} kernels: ${r.summary}`,
        );
      });
    }

    if (!webgpu) {
      await test(`[${mode}] elements with the hidden attribute have no layout box, in every state the page goes through`, async () => {
        // CSS display rules (.row, label.inline: flex) used to override the attribute.
        const p = await browser.newPage();
        try {
          // Checked at every DOM change (so the short-lived loading and generating states count too)
          // and on demand; open shadow roots (<next-token>) included.
          await p.addInitScript(() => {
            const seen = (window.__hiddenShown = new Set());
            let checks = 0;
            const check = () => {
              checks++;
              const roots = [document];
              for (let i = 0; i < roots.length; i++) {
                for (const e of roots[i].querySelectorAll("*")) {
                  if (e.shadowRoot) roots.push(e.shadowRoot);
                  if (!e.hidden) continue;
                  const display = getComputedStyle(e).display;
                  if (display !== "none" || e.getClientRects().length)
                    seen.add(
                      `${e.id ? `#${e.id}` : `${e.tagName.toLowerCase()}.${e.className}`} (display: ${display}, state ${document.body?.dataset.state})`,
                    );
                }
              }
            };
            window.__checkHidden = () => {
              check();
              return { shown: [...seen], checks };
            };
            new MutationObserver(check).observe(document, {
              subtree: true,
              childList: true,
              attributes: true,
              attributeFilter: ["hidden", "class", "data-state"],
            });
          });
          const verify = async (when, atLeast) => {
            const r = await p.evaluate(() => window.__checkHidden());
            assert(r.shown.length === 0, `${when}: hidden elements still shown: ${r.shown.join("; ")}`);
            assert(r.checks >= atLeast, `${when}: only ${r.checks} checks ran`);
            return r.checks;
          };
          // Idle, loading, ready (the lesson table), generating, scoring.
          await p.goto(`${base}/?nosw&model=lesson-toy&prompt=${encodeURIComponent("the cat sat")}`);
          await waitLoaded(p);
          for (const id of [
            "custom-row",
            "chat-input",
            "send",
            "regenerate",
            "edit-last",
            "clear-chat",
            "conversation",
            "rendered",
            "progress",
            "cancel-load",
            "error",
            "retry",
            "score-out",
          ]) {
            assertEq(
              await p.evaluate((id) => document.getElementById(id).hidden, id),
              true,
              `#${id} hidden when the lesson table is loaded`,
            );
          }
          let n = await verify("lesson table loaded", 2);
          await setSettings(p, { maxTokens: 8 });
          await p.click("#generate");
          await waitState(p, "ready");
          await p.click("#score-btn");
          await p.locator("#score-out").waitFor({ state: "visible" });
          n = await verify("after Generate and Score", n + 1);
          // Picker changes: the custom URL row appears and goes again.
          await p.selectOption("#model-select", "custom");
          assert(await p.isVisible("#model-url"), "the custom URL row does not appear");
          await p.selectOption("#model-select", "smollm2-135m");
          await p.selectOption("#model-select", "lesson-beam");
          n = await verify("after picker changes", n + 1);
          assert(!(await p.isVisible("#model-url")), "the custom row stayed visible");
          // The error state (404): the message shows, Retry does not (not retryable).
          await p.goto(
            `${base}/?nosw&model=${encodeURIComponent("/test/no-such-model.gguf")}&tokenizer=${encodeURIComponent("/test/tokenizer.json")}`,
          );
          await waitState(p, ["error", "ready"]);
          assert(await p.isVisible("#error"), "no error shown for a 404 model");
          await verify("error state", 2);
          // The embed page's <next-token> elements (shadow DOM).
          await p.goto(`${base}/embed.html`);
          await p.locator("#cat .product").waitFor({ state: "visible", timeout: 30_000 });
          await verify("embed page", 2);
        } finally {
          await p.close();
        }
      });

      await test(`[${mode}] nexttoken.js load(url, {exact: true, threads: 1}) runs the exact path on 1 thread; the default the fast path`, async () => {
        await page.goto(`${base}/?nosw&model=lesson-toy`);
        const r = await page.evaluate(async () => {
          const { NextToken } = await import("/nexttoken.js");
          const nt = new NextToken();
          const opts = { tokenizer: "/models/default-tokenizer.json" };
          try {
            const fast = await nt.load("/models/default.gguf", opts);
            const exact = await nt.load("/models/default.gguf", { ...opts, exact: true, threads: 1 });
            const cpuExact = await nt.load("/models/default.gguf", {
              ...opts,
              backend: "cpu",
              exact: true,
              threads: 1,
            });
            let text = "";
            for await (const t of nt.generate("In the beginning", { temperature: 0, maxTokens: 8 })) text += t.text;
            const pick = (i) => ({
              backend: i.backend,
              detail: i.backendDetail,
              threads: i.threads,
              threadsNote: i.threadsNote,
            });
            return {
              fast: pick(fast),
              exact: pick(exact),
              cpuExact: pick(cpuExact),
              text,
              isolated: crossOriginIsolated,
            };
          } finally {
            nt.terminate();
          }
        });
        console.log(
          `      default: ${r.fast.detail}\n      exact, 1 thread: ${r.exact.detail}\n      backend cpu, exact, 1 thread: ${r.cpuExact.detail}`,
        );
        for (const k of ["fast", "exact", "cpuExact"]) assertEq(r[k].backend, "cpu", `${k}: backend`);
        const pool = r.fast.threads;
        assert(
          new RegExp(`${wasmIsa} int8 kernels, ${pool} threads?\\)$`).test(r.fast.detail),
          `the default is not the fast path on the pool's ${pool} thread(s): ${r.fast.detail}`,
        );
        if (haveThreadsBuild && r.isolated && os.cpus().length > 1) {
          assert(pool > 1, `expected the threads build's pool, got ${pool} thread(s)`);
          assertEq(r.fast.threadsNote, "", "no one-thread reason where the pool runs");
        }
        assert(
          /exact reference kernels, 1 thread\)$/.test(r.exact.detail),
          `exact, 1 thread not reported: ${r.exact.detail}`,
        );
        assert(
          /^CPU backend chosen \((WebAssembly, )?exact reference kernels, 1 thread\)$/.test(r.cpuExact.detail),
          `backend cpu, exact, 1 thread: ${r.cpuExact.detail}`,
        );
        assert(r.text.length > 0, "the exact path generated nothing");
      });
    }

    if (haveShared) {
      await test(`[${mode}] stories260K greedy ${N_TOKENS} tokens equals the native CLI, streamed token by token${webgpu ? " (backend gpu: auto would take the CPU path here)" : ""}`, async () => {
        await page.goto(base + modelUrl + (webgpu ? "&backend=gpu" : ""));
        await waitLoaded(page);
        const stats = await statsOf(page);
        console.log(`      backend: ${stats.backend}`);
        if (webgpu) {
          if (webgpuAdapter || process.env.NEXTTOKEN_REQUIRE_WEBGPU)
            assert(/WebGPU/.test(stats.backend), `expected WebGPU, got ${stats.backend}`);
        } else {
          assert(/CPU/.test(stats.backend), `expected the CPU fallback, got ${stats.backend}`);
          // The page is cross-origin isolated (serve.mjs): the threads build, one thread a core.
          const env = await page.evaluate(() => ({
            isolated: crossOriginIsolated,
            cores: navigator.hardwareConcurrency,
          }));
          assert(env.isolated, "the page is not cross-origin isolated");
          const threads = Number((/(\d+) threads?/.exec(stats.backend) || [])[1]);
          if (haveThreadsBuild && env.cores > 1) assertEq(threads, env.cores, `CPU threads (${stats.backend})`);
          else
            console.log(`      (one thread: ${haveThreadsBuild ? `${env.cores} core` : "no www/pkg-threads build"})`);
        }
        await generateAndCheck(page, mode, { screenshot: path.join(outDir, `mid-generation-${mode}.png`) });
        const s = await statsOf(page);
        for (const key of ["time to first token", "prefill", "decode", "backend", "load time"])
          assert(s[key], `stat ${key} missing: ${JSON.stringify(s)}`);
        console.log(`      TTFT ${s["time to first token"]}, prefill ${s.prefill}, decode ${s.decode}`);
      });

      if (webgpu) {
        await test(`[${mode}] auto never takes the software adapter: the page's default backend runs stories260K on the CPU path and says why`, async () => {
          if (!webgpuAdapter) return "skip";
          await page.goto(base + modelUrl);
          await waitLoaded(page);
          const stats = await statsOf(page);
          console.log(`      backend: ${stats.backend}`);
          assert(
            /^CPU/.test(stats.backend) && /CPU emulating a GPU/.test(stats.backend),
            `auto on SwiftShader: ${stats.backend}`,
          );
          await generateAndCheck(page, `${mode} auto`);
        });

        await test(`[${mode}] auto on a GPU it may use (allowSoftwareGpu stands in for a real one): checked, both backends timed, the faster kept and remembered; same greedy text`, async () => {
          if (!webgpuAdapter) return "skip";
          const p = await browser.newPage();
          await p.goto(`${base}/?nosw&model=lesson-toy`);
          const r = await p.evaluate(
            async ({ prompt, n }) => {
              const { NextToken } = await import("/nexttoken.js");
              const nt = new NextToken();
              const opts = { tokenizer: "/test/tokenizer.json", exact: true, allowSoftwareGpu: true };
              try {
                const first = await nt.load("/test/stories260K-f32.gguf", opts);
                let text = "";
                for await (const t of nt.generate(prompt, { temperature: 0, maxTokens: n })) text += t.text;
                const second = await nt.load("/test/stories260K-f32.gguf", opts);
                const pick = (i) => ({ backend: i.backend, reason: i.backendReason, backendMs: i.timings.backendMs });
                return { first: pick(first), second: pick(second), text };
              } catch (e) {
                return { error: String(e?.message ? e.message : e) };
              } finally {
                nt.terminate();
              }
            },
            { prompt: PROMPT, n: N_TOKENS },
          );
          await p.close();
          assert(!r.error, r.error);
          console.log(
            `      first load: ${r.first.backend}, ${r.first.reason} (${r.first.backendMs?.toFixed(0)} ms)\n      second: ${r.second.backend}, ${r.second.reason}`,
          );
          const verdict =
            /^auto: .* decodes at \d+ tok\/s, the CPU path at \d+ tok\/s \(estimated from its measured rate\): the (GPU|CPU path) runs it$/;
          assert(verdict.test(r.first.reason), `first load's reason: ${r.first.reason}`);
          const gpuKept = / the GPU runs it$/.test(r.first.reason);
          assertEq(r.first.backend, gpuKept ? "webgpu" : "cpu", "the backend the verdict names");
          assert(
            r.second.reason.startsWith(r.first.reason) &&
              /remembered for this model and adapter\)$/.test(r.second.reason),
            `second load's reason: ${r.second.reason}`,
          );
          assertEq(r.second.backend, r.first.backend, "the remembered backend");
          assertEq(r.text, expected, "greedy text after auto's choice");
        });

        await test(`[${mode}] a GPU lost mid-generation: the model moves to the CPU path and the text goes on to the native CLI's`, async () => {
          if (!webgpuAdapter) return "skip";
          const p = await browser.newPage();
          await p.goto(`${base}/?nosw&model=lesson-toy`);
          const r = await p.evaluate(
            async ({ prompt, n }) => {
              const { NextToken } = await import("/nexttoken.js");
              const nt = new NextToken();
              const changes = [];
              nt.onBackendChange = (info) => changes.push(info.backend);
              try {
                const info = await nt.load("/test/stories260K-f32.gguf", {
                  tokenizer: "/test/tokenizer.json",
                  backend: "gpu",
                  exact: true,
                });
                let text = "";
                let count = 0;
                for await (const t of nt.generate(prompt, { temperature: 0, maxTokens: n })) {
                  text += t.text;
                  if (++count === 5) nt.worker.postMessage({ type: "simulate-gpu-loss", slot: nt.slot });
                }
                return {
                  before: info.backend,
                  after: nt.info.backend,
                  reason: nt.info.backendReason,
                  changes,
                  text,
                  count,
                };
              } catch (e) {
                return { error: String(e?.message ? e.message : e) };
              } finally {
                nt.terminate();
              }
            },
            { prompt: PROMPT, n: N_TOKENS },
          );
          await p.close();
          assert(!r.error, r.error);
          console.log(`      ${r.before} -> ${r.after}: ${r.reason}`);
          assertEq(r.before, "webgpu", "loaded on");
          assertEq(r.after, "cpu", "after the loss");
          assertEq(JSON.stringify(r.changes), JSON.stringify(["cpu"]), "onBackendChange calls");
          assert(
            /^WebGPU was lost \(.*GPU device lost.*\) after \d+ tokens: the model moved to the CPU path$/.test(
              r.reason,
            ),
            `reason: ${r.reason}`,
          );
          assertEq(r.count, N_TOKENS, "tokens streamed in all");
          assertEq(r.text, expected, "the text across the loss vs the native CLI");
        });
      }

      if (!webgpu) {
        await test(`[${mode}] a page that is not cross-origin isolated runs one thread (pkg/), same greedy text`, async () => {
          const plain = await browser.newPage();
          try {
            await plain.goto(`${base + modelUrl}&isolate=0`);
            await waitLoaded(plain);
            assertEq(await plain.evaluate(() => crossOriginIsolated), false, "crossOriginIsolated");
            const stats = await statsOf(plain);
            assert(/, 1 thread\b/.test(stats.backend), `expected one thread: ${stats.backend}`);
            assert(
              /one thread: the page is not cross-origin isolated/.test(stats.backend),
              `the stats say why one thread: ${stats.backend}`,
            );
            await generateAndCheck(plain, `${mode} not isolated`);
          } finally {
            await plain.close();
          }
        });
      }

      await test(`[${mode}] per-token inspection shows probability, alternatives, log P and perplexity`, async () => {
        await page.click('#output-tokens .tok[data-i="3"]');
        const txt = await page.textContent("#inspect");
        for (const w of ["P(token | before)", "log P so far", "perplexity so far", "Most likely at this step"])
          assert(txt.includes(w), `inspector lacks ${w}: ${txt}`);
        const alts = await page.locator("#inspect .alternatives li").count();
        assertEq(alts, 5, "alternatives shown");
      });

      await test(`[${mode}] Stop ends generation within a token`, async () => {
        await page.fill("#max-tokens", "400");
        await page.fill("#temperature", "1");
        await page.click("#generate");
        await page.waitForFunction(() => document.getElementById("output-tokens").childElementCount >= 2);
        const at = await page.evaluate(() => {
          document.getElementById("stop-btn").click();
          return document.getElementById("output-tokens").childElementCount;
        });
        await waitState(page, "ready");
        await page.waitForTimeout(200);
        const after = await page.evaluate(() => document.getElementById("output-tokens").childElementCount);
        assert(after <= at + 1, `tokens kept arriving after Stop: ${at} at Stop, ${after} later`);
        assert(after < 400, "generation ran to the end");
      });

      await test(`[${mode}] second visit with the network blocked loads from the cache (service worker + Cache API)`, async () => {
        // The service worker must control the page and the model must be in the cache.
        await page.evaluate(() => navigator.serviceWorker.ready);
        const cached = await page.evaluate(async () =>
          (await (await import("/model-cache.js")).listCached()).map((r) => r.url),
        );
        assert(
          cached.some((u) => u.endsWith("/test/stories260K-f32.gguf")),
          `model not cached: ${JSON.stringify(cached)}`,
        );
        await stopServer();
        const blocked = [];
        await context.route("**/*", (route) => {
          blocked.push(route.request().url());
          return route.abort("internetdisconnected");
        });
        await context.setOffline(true);
        try {
          await page.goto(base + modelUrl);
          await waitLoaded(page);
          const s = await statsOf(page);
          assert(/cache/.test(s.download || ""), `expected a load from the cache, stats: ${JSON.stringify(s)}`);
          await generateAndCheck(page, `${mode} offline`);
        } finally {
          await context.setOffline(false);
          await context.unroute("**/*");
          await startServer();
        }
        const modelHits = blocked.filter((u) => /\/test\//.test(u));
        assert(modelHits.length === 0, `model requests went to the network: ${modelHits}`);
      });

      await test(`[${mode}] a truncated model gives a clear error and the page keeps working`, async () => {
        await page.goto(
          `${base}/?model=${encodeURIComponent("/test/truncated.gguf")}&tokenizer=${encodeURIComponent("/test/tokenizer.json")}`,
        );
        await waitState(page, ["error", "ready"]);
        const err = await errorText(page);
        console.log(`      error shown: ${err}`);
        assert(
          /truncat|past the end|end of (the )?file|too short|bytes/i.test(err),
          `unclear error: ${JSON.stringify(err)}`,
        );
        const cached = await page.evaluate(async () =>
          (await (await import("/model-cache.js")).listCached()).map((r) => r.url),
        );
        assert(!cached.some((u) => u.endsWith("truncated.gguf")), "the unusable file was kept in the cache");
        await useLessonToy(page);
      });

      await test(`[${mode}] a 404 model URL gives a clear error and the page keeps working`, async () => {
        await page.goto(
          `${base}/?model=${encodeURIComponent("/test/no-such-model.gguf")}&tokenizer=${encodeURIComponent("/test/tokenizer.json")}`,
        );
        await waitState(page, ["error", "ready"]);
        const err = await errorText(page);
        console.log(`      error shown: ${err}`);
        assert(/404/.test(err) && /no-such-model\.gguf/.test(err), `unclear error: ${JSON.stringify(err)}`);
        await useLessonToy(page);
      });

      await test(`[${mode}] an interrupted download says so, offers Retry, and keeps only a partial entry (never loaded as a model)`, async () => {
        await page.goto(
          `${base}/?model=${encodeURIComponent("/test/interrupted.gguf")}&tokenizer=${encodeURIComponent("/test/tokenizer.json")}`,
        );
        await waitState(page, ["error", "ready"]);
        const err = await errorText(page);
        console.log(`      error shown: ${err}`);
        assert(/interrupted|cut short/i.test(err), `unclear error: ${JSON.stringify(err)}`);
        assert(await page.isVisible("#retry"), "no Retry button");
        const before = interruptedHits;
        await page.click("#retry");
        await waitState(page, ["error", "ready"]);
        assert(interruptedHits > before, "Retry did not download again");
        const cached = await page.evaluate(async () =>
          (await (await import("/model-cache.js")).listCached()).filter((r) => r.url.includes("interrupted")),
        );
        assert(
          cached.every((r) => !r.complete),
          `a partial download was stored as complete: ${JSON.stringify(cached)}`,
        );
        await useLessonToy(page);
      });

      await test(`[${mode}] cached-models list shows the model with its size, and Delete removes it`, async () => {
        await page.goto(`${base}/?model=lesson-toy`);
        await waitLoaded(page);
        await page.waitForFunction(() =>
          document.querySelector("#cache-list")?.textContent.includes("stories260K-f32.gguf"),
        );
        const row = page.locator("#cache-list li", { hasText: "stories260K-f32.gguf" });
        const txt = await row.textContent();
        assert(/1\.05 MB/.test(txt), `size not shown: ${txt}`);
        await row.locator("button").click();
        await page.waitForFunction(
          () => !document.querySelector("#cache-list").textContent.includes("stories260K-f32.gguf"),
        );
      });
    }

    await test(`[${mode}] the default model (www/models/default.gguf) is picked, loads and matches the native CLI, and again offline from the cache`, async () => {
      if (!fs.existsSync(path.join(www, "models", "default.gguf"))) {
        console.log("      (www/models/default.gguf is not built yet)");
        return "skip";
      }
      const bin = nativeBin();
      // The reference: WebGPU computes in f32 like the exact CPU path; the wasm CPU path is the
      // fast one (Q8 activations), which natively with the scalar kernels differs from simd128
      // only in summation order.
      await page.goto(`${base}/`);
      await waitLoaded(page);
      const gpu = !/^CPU/.test((await statsOf(page)).backend);
      const how = gpu ? ["--exact"] : ["--isa", "scalar", "--threads", "1"];
      const r = spawnSync(
        bin,
        [
          "generate",
          "--model",
          path.join(www, "models/default.gguf"),
          "--tokenizer",
          path.join(www, "models/default-tokenizer.json"),
          "--prompt",
          "In the beginning",
          "--temperature",
          "0",
          "--max-tokens",
          "24",
          "--backend",
          "cpu",
          ...how,
        ],
        { encoding: "utf8" },
      );
      assert(r.status === 0, `the CLI failed on the default model: ${r.stderr}`);
      const want = r.stdout.slice("In the beginning".length).replace(/\n$/, "");
      assertEq(await page.inputValue("#model-select"), "default", "model picked on a first visit");
      assertEq(await page.inputValue("#prompt"), "In the beginning", "prompt");
      await setSettings(page, { maxTokens: 24 });
      await page.click("#generate");
      await waitState(page, "ready", 120_000);
      assertEq(await outputText(page), want, "default model greedy text vs the native CLI");

      // A second visit without network: the page still picks the default model (its probe of the
      // server fails; the cache has it), loads it from the cache and generates the same text.
      await page.evaluate(() => navigator.serviceWorker.ready);
      await context.route("**/*", (route) => route.abort("internetdisconnected"));
      await context.setOffline(true);
      try {
        await page.goto(`${base}/`);
        await waitLoaded(page);
        assertEq(await page.inputValue("#model-select"), "default", "model picked offline");
        assert(/cache/.test((await statsOf(page)).download || ""), "offline: not loaded from the cache");
        await setSettings(page, { maxTokens: 24 });
        await page.click("#generate");
        await waitState(page, "ready", 120_000);
        assertEq(await outputText(page), want, "offline: default model greedy text");
      } finally {
        await context.setOffline(false);
        await context.unroute("**/*");
      }
    });

    await test(`[${mode}] a GGUF with no tokenizer URL loads with its own tokenizer; greedy ids and text match the native CLI (no tokenizer.json beside the model)`, async () => {
      if (!haveDefaultModel) return "skip";
      const prompt = "In the beginning";
      const n = 24;
      ggufOnlyOthers.length = 0;
      await page.goto(
        `${base}/?model=${encodeURIComponent("/test/gguf-only/default.gguf")}&prompt=${encodeURIComponent(prompt)}`,
      );
      await waitLoaded(page);
      const gpu = !/^CPU/.test((await statsOf(page)).backend);
      assertEq(await page.inputValue("#tokenizer-url"), "", "tokenizer URL field");
      // The reference: the CLI on the GGUF alone in a folder, so it too uses the GGUF's tokenizer.
      const dir = fs.mkdtempSync(path.join(os.tmpdir(), "nexttoken-gguf-only-"));
      let want;
      try {
        fs.copyFileSync(path.join(ggufOnly, "default.gguf"), path.join(dir, "x.gguf"));
        const how = gpu ? ["--exact"] : ["--isa", "scalar", "--threads", "1"];
        const r = spawnSync(
          nativeBin(),
          [
            "generate",
            "--model",
            path.join(dir, "x.gguf"),
            "--prompt",
            prompt,
            "--temperature",
            "0",
            "--max-tokens",
            String(n),
            "--backend",
            "cpu",
            "--json",
            ...how,
          ],
          { encoding: "utf8" },
        );
        assert(r.status === 0, `the CLI failed: ${r.stderr}`);
        const lines = r.stdout
          .trim()
          .split("\n")
          .map((l) => JSON.parse(l));
        want = { ids: lines.filter((l) => "id" in l).map((l) => l.id), summary: lines.at(-1) };
      } finally {
        fs.rmSync(dir, { recursive: true, force: true });
      }
      await setSettings(page, { maxTokens: n });
      await page.click("#generate");
      await waitState(page, "ready", 120_000);
      const err = await errorText(page);
      assert(!err, `generation failed: ${err}`);
      const got = await page.evaluate(() => window.nexttokenApp.tokens.map((t) => t.id));
      assertEq(JSON.stringify(got), JSON.stringify(want.ids), "greedy ids vs the native CLI's");
      assertEq(await outputText(page), want.summary.text, "greedy text vs the native CLI's");
      assertEq(
        (await statsOf(page))["prompt tokens"],
        String(want.summary.prompt_tokens),
        "prompt tokens (BOS included) vs the native CLI's",
      );
      assertEq(JSON.stringify(ggufOnlyOthers), "[]", "requests beside the GGUF (a tokenizer.json looked for)");
      console.log(`      ${JSON.stringify(prompt + want.summary.text)} (${want.summary.prompt_tokens} prompt tokens)`);
    });

    await test(`[${mode}] a GGUF without tokenizer metadata and no tokenizer URL says so; the page keeps working; with a tokenizer URL it loads from the cache`, async () => {
      if (!haveDefaultModel) return "skip";
      const url = "/test/gguf-only/no-tokenizer.gguf";
      await page.goto(`${base}/?model=${encodeURIComponent(url)}`);
      await waitState(page, ["error", "ready"]);
      assertEq(await state(page), "error", "page state");
      const err = await errorText(page);
      console.log(`      error shown: ${err}`);
      assert(/no tokenizer metadata/.test(err) && /tokenizer\.json/.test(err), `unclear error: ${JSON.stringify(err)}`);
      assert(await page.isVisible("#error"), "the error is not visible");
      await useLessonToy(page);
      // The model was never looked at: it stays cached, and with a tokenizer.json it loads.
      const cached = await page.evaluate(async () =>
        (await (await import("/model-cache.js")).listCached()).map((r) => r.url),
      );
      assert(
        cached.some((u) => u.endsWith(url)),
        `the GGUF was dropped from the cache: ${JSON.stringify(cached)}`,
      );
      await page.goto(
        `${base}/?model=${encodeURIComponent(url)}&tokenizer=${encodeURIComponent("/models/default-tokenizer.json")}&prompt=${encodeURIComponent("In the beginning")}`,
      );
      await waitLoaded(page);
      assertEq((await statsOf(page)).download, "from cache", "download");
      await setSettings(page, { maxTokens: 8 });
      await page.click("#generate");
      await waitState(page, "ready", 120_000);
      assert((await outputText(page)).length > 0, "nothing generated");
    });

    if (!webgpu) {
      await test(`[${mode}] a model split by gguf-split loads from its first part's URL: the parts in order, each cached, progress by part; greedy ids equal the unsplit file's and the native CLI's; a missing or misordered part is a clear error and leaves no part cached`, async () => {
        // The CLI writes a synthetic model (random weights, its placeholder vocabulary) whole and
        // in 3 parts (gguf-split's layout); then two broken sets: part 2 missing, parts 2 and 3
        // swapped.
        const dir = path.join(fixtures, "split");
        fs.mkdirSync(dir);
        const config = path.join(dir, "config.json");
        fs.writeFileSync(
          config,
          JSON.stringify({
            model_type: "llama",
            vocab_size: 512,
            hidden_size: 64,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            intermediate_size: 96,
            max_position_embeddings: 64,
          }),
        );
        for (const args of [
          ["--out", path.join(dir, "whole.gguf")],
          ["--out", path.join(dir, "m.gguf"), "--split", "3"],
        ]) {
          const r = spawnSync(nativeBin(), ["synth", "--config", config, "--type", "q8_0", "--seed", "5", ...args], {
            encoding: "utf8",
          });
          assert(r.status === 0, `synth failed: ${r.stderr}`);
        }
        const part = (k) => path.join(dir, `m-0000${k}-of-00003.gguf`);
        for (const [name, k] of [
          ["missing", 1],
          ["missing", 3],
          ["swapped", 1],
          ["swapped", 3],
          ["swapped", 2],
        ]) {
          fs.mkdirSync(path.join(dir, name), { recursive: true });
          fs.copyFileSync(
            part(k),
            path.join(dir, name, `m-0000${name === "swapped" && k > 1 ? 5 - k : k}-of-00003.gguf`),
          );
        }
        const prompt = "Hello";
        const n = 12;
        const cli = spawnSync(
          nativeBin(),
          [
            "generate",
            "--model",
            path.join(dir, "whole.gguf"),
            "--prompt",
            prompt,
            "--temperature",
            "0",
            "--max-tokens",
            String(n),
            "--backend",
            "cpu",
            "--json",
            "--isa",
            "scalar",
            "--threads",
            "1",
          ],
          { encoding: "utf8" },
        );
        assert(cli.status === 0, `the CLI failed: ${cli.stderr}`);
        const want = cli.stdout
          .trim()
          .split("\n")
          .map((l) => JSON.parse(l))
          .filter((l) => "id" in l)
          .map((l) => l.id);

        await page.goto(`${base}/?nosw&model=lesson-toy`);
        const r = await page.evaluate(
          async ({ prompt, n }) => {
            const { NextToken } = await import("/nexttoken.js");
            const nt = new NextToken();
            const run = async (url) => {
              const parts = new Set();
              try {
                const info = await nt.load(url, {
                  backend: "cpu",
                  onProgress: (p) => parts.add(`${p.part} of ${p.parts}`),
                });
                const ids = [];
                for await (const t of nt.generate(prompt, { temperature: 0, maxTokens: n })) ids.push(t.id);
                return { ids, parts: [...parts], fromCache: info.timings.fromCache, parameters: info.parameters };
              } catch (e) {
                return { error: e.message, parts: [...parts] };
              }
            };
            const cached = async () =>
              (await (await import("/model-cache.js")).listCached())
                .map((q) => new URL(q.url).pathname)
                .filter((u) => u.startsWith("/test/split/"));
            try {
              const whole = await run("/test/split/whole.gguf");
              const split = await run("/test/split/m-00001-of-00003.gguf");
              const cachedParts = await cached();
              const again = await run("/test/split/m-00001-of-00003.gguf");
              const missing = await run("/test/split/missing/m-00001-of-00003.gguf");
              const swapped = await run("/test/split/swapped/m-00001-of-00003.gguf");
              return { whole, split, cachedParts, again, missing, swapped, cachedAfter: await cached() };
            } finally {
              nt.terminate();
            }
          },
          { prompt, n },
        );
        for (const k of ["whole", "split", "again"]) assert(!r[k].error, `${k}: ${r[k].error}`);
        assertEq(
          JSON.stringify(r.whole.ids),
          JSON.stringify(want),
          "greedy ids of the unsplit file vs the native CLI's",
        );
        assertEq(
          JSON.stringify(r.split.ids),
          JSON.stringify(want),
          "greedy ids of the split model vs the unsplit file's",
        );
        assertEq(r.split.parameters, r.whole.parameters, "parameters");
        assertEq(JSON.stringify(r.split.parts), JSON.stringify(["1 of 3", "2 of 3", "3 of 3"]), "progress by part");
        assertEq(
          JSON.stringify(r.cachedParts.filter((u) => /m-0000\d-of-00003/.test(u)).sort()),
          JSON.stringify([1, 2, 3].map((k) => `/test/split/m-0000${k}-of-00003.gguf`)),
          "the parts cached, each on its own",
        );
        assertEq(r.again.fromCache, true, "a second load reads every part from the cache");
        assertEq(JSON.stringify(r.again.ids), JSON.stringify(want), "greedy ids from the cached parts");
        console.log(
          `      ${want.length} greedy ids equal; errors shown:\n        ${r.missing.error}\n        ${r.swapped.error}`,
        );
        assert(
          /404/.test(r.missing.error) && /m-00002-of-00003\.gguf/.test(r.missing.error),
          `missing part: unclear error ${JSON.stringify(r.missing.error)}`,
        );
        assert(
          /part 2 of 3/.test(r.swapped.error) && /out of order/.test(r.swapped.error),
          `swapped parts: unclear error ${JSON.stringify(r.swapped.error)}`,
        );
        const broken = r.cachedAfter.filter((u) => /\/(missing|swapped)\//.test(u));
        assertEq(JSON.stringify(broken), "[]", "parts of the broken sets left in the cache");
        // The page, from part 1's URL (the parts now cached).
        await page.goto(
          `${base}/?nosw&model=${encodeURIComponent("/test/split/m-00001-of-00003.gguf")}&prompt=${encodeURIComponent(prompt)}`,
        );
        await waitLoaded(page);
        await setSettings(page, { maxTokens: n });
        await page.click("#generate");
        await waitState(page, "ready", 120_000);
        const ids = await page.evaluate(() => window.nexttokenApp.tokens.map((t) => t.id));
        assertEq(JSON.stringify(ids), JSON.stringify(want), "the page's greedy ids");
      });
    }

    if (webgpu) {
      await test(`[${mode}] score and beam search run on WebGPU and agree with the exact CPU path`, async () => {
        if (!fs.existsSync(path.join(www, "models", "default.gguf"))) return "skip";
        await page.goto(`${base}/?nosw&model=lesson-toy`);
        const r = await page.evaluate(async () => {
          const wasm = await import("/pkg/nexttoken.js");
          await wasm.default();
          const gguf = new Uint8Array(await (await fetch("/models/default.gguf")).arrayBuffer());
          const tokenizer = new Uint8Array(await (await fetch("/models/default-tokenizer.json")).arrayBuffer());
          const run = async (options) => {
            const sink = new wasm.ByteSink(gguf.length);
            sink.push(gguf);
            const engine = await wasm.Engine.loadGguf(sink, tokenizer, options);
            const score = await engine.score("In the beginning God created the heaven");
            const session = engine.start("In the beginning", { beams: 3, maxTokens: 12 });
            const tokens = [];
            for (let t; (t = await session.next()) !== null; ) tokens.push({ id: t.id, logprob: t.logprob });
            return { info: engine.info().backend, score, tokens, summary: session.summary() };
          };
          try {
            return { gpu: await run({ backend: "gpu" }), cpu: await run({ backend: "cpu", exact: true }) };
          } catch (e) {
            return { error: String(e?.message ? e.message : e) };
          }
        });
        assert(!r.error, r.error);
        assertEq(r.gpu.info, "webgpu", "GPU engine backend");
        assertEq(r.gpu.score.backend, "webgpu", "score computed by");
        assertEq(r.gpu.summary.backend, "webgpu", "beam search computed by");
        assertEq(r.cpu.score.backend, "cpu", "CPU score computed by");
        // Natively (lavapipe, f16 KV cache) the two differ by about 4e-4 nats per token.
        const close = (a, b, what, tolerance = 5e-3) =>
          assert(Math.abs(a - b) < tolerance, `${what}: webgpu ${a} vs cpu ${b}`);
        assertEq(r.gpu.score.tokens.length, r.cpu.score.tokens.length, "scored tokens");
        r.gpu.score.tokens.forEach((t, i) => close(t.logprob, r.cpu.score.tokens[i].logprob, `score token ${i}`));
        close(r.gpu.score.logprob, r.cpu.score.logprob, "total log P", 2e-2);
        assertEq(
          JSON.stringify(r.gpu.tokens.map((t) => t.id)),
          JSON.stringify(r.cpu.tokens.map((t) => t.id)),
          "best beam",
        );
        r.gpu.tokens.forEach((t, i) => close(t.logprob, r.cpu.tokens[i].logprob, `beam token ${i}`));
        assertEq(r.gpu.summary.text, r.cpu.summary.text, "beam text");
      });
    }

    await beamViewTests({ test, assert, assertEq, page, base, mode, waitLoaded, waitState, outDir });
    await scoreViewTests({ test, assert, assertEq, page, base, mode, waitLoaded, outDir });
    await samplerViewTests({ test, assert, assertEq, page, base, mode, waitLoaded, waitState, outDir });
    await exploreTests({
      test,
      assert,
      assertEq,
      page,
      base,
      mode,
      waitLoaded,
      waitState,
      errorText,
      statsOf,
      haveDefaultModel,
      outDir,
    });

    await pageTests({ test, assert, assertEq, browser, base, mode, waitLoaded, waitState, errorText, statsOf, outDir });

    await embedTests({ test, assert, assertEq, browser, mode, www });

    await elementTests({ test, assert, assertEq, browser, base, mode, outDir, www });

    await engineTests({ test, assert, assertEq, browser, mode, www });

    if (haveShared) {
      await replayTests({ test, assert, assertEq, browser, base, mode, bin: nativeBin(), fixtures, www });
      await preflightTests({ test, assert, assertEq, browser, mode, bin: nativeBin(), fixtures, www });
    }

    // A model bigger than the quota the storage test leaves after the app shell: the chat fixture (16 MB).
    const bigModelUrl = fs.existsSync(path.join(fixtures, "chat", "chat.gguf")) ? "/test/chat/chat.gguf" : null;
    await downloadTests({
      test,
      assert,
      assertEq,
      page,
      base,
      mode,
      server: faulty,
      waitState,
      errorText,
      browser,
      bigModelUrl,
    });

    await streamTests({ test, assert, assertEq, browser, base, mode, bin: nativeBin(), www, fixtures, bigModel });

    await chatTests({
      test,
      assert,
      assertEq,
      page,
      base,
      mode,
      bin: nativeBin(),
      fixtures,
      outDir,
      tmp: fixtures,
      waitLoaded,
      waitState,
      errorText,
      statsOf,
    });

    await toolTests({ test, assert, assertEq, page, base, mode, bin: nativeBin(), fixtures });

    if (mode === "cpu")
      await shippedChatTests({
        test,
        assert,
        assertEq,
        browser,
        base,
        mode,
        bin: nativeBin(),
        www,
        tmp: fixtures,
        waitLoaded,
        waitState,
        errorText,
      });

    await structuredTests({
      test,
      assert,
      assertEq,
      page,
      base,
      mode,
      bin: nativeBin(),
      tmp: fixtures,
      waitLoaded,
      waitState,
      errorText,
      www,
    });

    await test(`[${mode}] model output with HTML is shown as text; no script runs`, async () => {
      await page.goto(`${base}/?model=${encodeURIComponent("/test/xss.json")}&prompt=`);
      await waitLoaded(page);
      await setSettings(page, { maxTokens: 10 });
      await page.click("#generate");
      await waitState(page, "ready");
      await page.click('#output-tokens .tok[data-i="2"]');
      await page.waitForTimeout(300);
      const text = await outputText(page);
      assert(text.includes("<img src=x onerror=window.__xss=1>"), `output text: ${text}`);
      const r = await page.evaluate(() => ({
        xss: window.__xss,
        imgs: document.querySelectorAll("main img").length,
        scripts: document.querySelectorAll("main script").length,
      }));
      assertEq(JSON.stringify(r), JSON.stringify({ imgs: 0, scripts: 0 }), "injected elements or script effects");
    });

    await test(`[${mode}] Score: P("the cat sat") = 0.42 by the chain rule, perplexity shown`, async () => {
      await page.goto(`${base}/?model=lesson-toy&prompt=${encodeURIComponent("the cat sat")}`);
      await waitLoaded(page);
      await page.click("#score-btn");
      await page.locator("#score-out").waitFor({ state: "visible" });
      const txt = await page.textContent("#score-out");
      assert(/\bP = 0\.4200/.test(txt) && /perplexity = 1\.335/.test(txt), `score output: ${txt}`);
    });

    await test(`[${mode}] embed page: <next-token> shows P(the cat sat) = 0.42; greedy vs beam lesson`, async () => {
      await page.goto(`${base}/embed.html`);
      const product = page.locator("#cat .product");
      await product.waitFor({ state: "visible", timeout: 30_000 });
      const txt = await product.textContent();
      const p = Number(await product.getAttribute("data-probability"));
      assert(/“the cat sat”/.test(txt) && /= 0\.42$/.test(txt), `product line: ${txt}`);
      assert(Math.abs(p - 0.42) < 1e-6, `probability ${p}`);
      const out = await page.locator("#cat .gen").textContent();
      assertEq(out.trim(), "the cat sat", "generated text");
      // The beam lesson: greedy finds "the cat" (0.33), two beams find "a bird" (0.36).
      const beamEls = page.locator('next-token[model="models/lesson-beam.json"]');
      await beamEls.nth(0).locator(".run").click();
      await beamEls.nth(1).locator(".run").click();
      for (const [i, text, p] of [
        [0, "the cat", 0.33],
        [1, "a bird", 0.36],
      ]) {
        const prod = beamEls.nth(i).locator(".product");
        await prod.waitFor({ state: "visible", timeout: 30_000 });
        const line = await prod.textContent();
        assert(line.includes(`“${text}”`) && line.endsWith(`= ${p.toFixed(2)}`), `beam lesson ${i}: ${line}`);
      }
      // The beam element (view="beam") draws the tree; the scoring lesson scores once on screen.
      await beamEls.nth(1).locator(".beam-greedy").waitFor({ timeout: 30_000 });
      assert(
        /"a bird", P = 0\.36/.test(await beamEls.nth(1).locator(".beam-best").textContent()),
        "the lesson's beam tree",
      );
      await page.locator("#score").scrollIntoViewIfNeeded();
      await page.locator("#score .verdict").waitFor({ timeout: 30_000 });
      const ppl = await page
        .locator("#score .scored")
        .evaluateAll((d) => d.map((x) => Number(x.dataset.perplexity).toFixed(2)));
      assertEq(ppl.join(" "), "1.28 3.79", "the scoring lesson's perplexities");
      await page.screenshot({ path: path.join(outDir, `embed-${mode}.png`), fullPage: true });
    });
  } finally {
    if (failed && consoleLines.length)
      fs.writeFileSync(path.join(outDir, `console-${mode}.log`), consoleLines.join("\n"));
    await browser.close();
  }
}

/** The native CLI: NEXTTOKEN_BIN, else the newer of the release and debug builds (a stale one misleads). */
function nativeBin() {
  const built = [path.join(repo, "target/release/nexttoken"), path.join(repo, "target/debug/nexttoken")].filter((p) =>
    fs.existsSync(p),
  );
  built.sort((a, b) => fs.statSync(b).mtimeMs - fs.statSync(a).mtimeMs);
  const bin = [process.env.NEXTTOKEN_BIN, ...built].filter(Boolean).find((p) => fs.existsSync(p));
  assert(bin, "no native CLI (target/release/nexttoken or target/debug/nexttoken): run cargo build --release");
  return bin;
}

async function useLessonToy(page) {
  await page.selectOption("#model-select", "lesson-toy");
  await page.click("#load");
  await waitLoaded(page);
  await page.fill("#prompt", "");
  await setSettings(page, { maxTokens: 8 });
  await page.click("#generate");
  await waitState(page, "ready");
  assertEq((await outputText(page)).trim(), "the cat sat", "after the error, the lesson model's greedy text");
}

try {
  for (const mode of ["webgpu", "cpu"]) {
    if (process.env.ONLY && process.env.ONLY !== mode) continue;
    await runConfig(mode);
  }
} finally {
  await stopServer().catch(() => {});
  fs.rmSync(fixtures, { recursive: true, force: true });
}
console.log(`\nscreenshots and logs: ${path.relative(process.cwd(), outDir)}/`);
if (failures.length) console.log(`failed: ${failures.join("; ")}`);
console.log(`${passed} passed, ${failed} failed${skipped ? `, ${skipped} skipped` : ""}`);
process.exit(failed ? 1 : 0);
