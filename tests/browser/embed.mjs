// Browser tests for embedding: <next-token> and nexttoken.js on a documentation site of another
// origin (a CDN), under a sub-path, under a strict Content-Security-Policy, many elements on one
// page, and the npm package. Each test starts the servers it needs (one per origin).

import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { serve } from "./serve.mjs";

const here = path.dirname(fileURLToPath(import.meta.url));

/** The CSP the README recommends, for a page whose scripts come from `scripts` and models from
 * `models`. A worker from another origin starts as a blob: worker, and its module imports are
 * checked against worker-src, not script-src. */
export function strictCsp({ scripts = "'self'", models = "'self'" } = {}) {
  const connect = [...new Set(["'self'", scripts, models])].join(" ");
  return [
    `default-src 'self'`,
    `script-src ${scripts} 'wasm-unsafe-eval'`,
    `worker-src ${scripts === "'self'" ? "'self'" : `'self' blob: ${scripts}`}`,
    `connect-src ${connect}`,
    `style-src 'self'`,
    `img-src 'self' data:`,
  ].join("; ");
}

const ISOLATE = { "cross-origin-opener-policy": "same-origin", "cross-origin-embedder-policy": "require-corp" };

/** The outputs and errors of a page's <next-token> elements, once `n` have finished (or more of
 * them show an error than the others could account for). */
async function waitElements(page, n, timeout = 60_000) {
  const check = (n) => {
    const all = [...document.querySelectorAll("next-token")];
    const errors = all.filter((e) => e.shadowRoot.querySelector(".error")?.hidden === false).length;
    return (window.__done || 0) >= n || errors > all.length - n;
  };
  await page.waitForFunction(check, n, { timeout });
  return page.evaluate(() =>
    [...document.querySelectorAll("next-token")].map((e) => ({
      text: e.shadowRoot.querySelector(".gen").textContent.trim(),
      error: e.shadowRoot.querySelector(".error").hidden ? "" : e.shadowRoot.querySelector(".error").textContent,
    })),
  );
}

/** Count finished elements, CSP violations and page-made workers from the first script on. */
async function instrument(page) {
  await page.addInitScript(() => {
    window.__done = 0;
    window.__csp = [];
    window.__workers = [];
    window.__threadsNotes = [];
    document.addEventListener(
      "nt-load",
      (e) => window.__threadsNotes.push({ note: e.detail.threadsNote, threads: e.detail.threads }),
      true,
    );
    document.addEventListener("nexttoken-done", () => window.__done++, true);
    document.addEventListener("securitypolicyviolation", (e) =>
      window.__csp.push(`${e.violatedDirective} ${e.blockedURI}`),
    );
    const Native = window.Worker;
    window.Worker = class extends Native {
      constructor(url, opts) {
        window.__workers.push(String(url));
        super(url, opts);
      }
    };
    // A page that is not cross-origin isolated runs the shared engine.
    const Shared = window.SharedWorker;
    if (Shared)
      window.SharedWorker = class extends Shared {
        constructor(url, opts) {
          window.__workers.push(`shared ${url}`);
          super(url, opts);
        }
      };
  });
}

const page = (dir, name, body, head = "") =>
  fs.writeFileSync(
    path.join(dir, name),
    `<!doctype html><html><head><meta charset="utf-8">${head}</head><body>${body}</body></html>`,
  );

export async function embedTests(t) {
  const { test, assert, assertEq, browser, mode, www } = t;
  if (mode !== "cpu") return; // nothing here depends on the backend
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "nexttoken-embed-"));
  const servers = [];
  const start = async (root, opts = {}, mounts = {}) => {
    const s = await serve(root, 0, mounts, { isolate: false, ...opts });
    servers.push(s);
    return `http://127.0.0.1:${s.address().port}`;
  };
  const newPage = async () => {
    const context = await browser.newContext({ serviceWorkers: "allow" });
    const p = await context.newPage();
    p.consoleLines = [];
    p.on("console", (m) => p.consoleLines.push(`${m.type()}: ${m.text()}`));
    p.on("pageerror", (e) => p.consoleLines.push(`pageerror: ${e.message}`));
    await instrument(p);
    return p;
  };

  try {
    await test(`[${mode}] a docs page of another origin loads next-token.js from a "CDN" (CORS only; strict CSP; isolated or not): the worker starts through a blob: trampoline, the default files come from beside the script, a model from a third origin; a model host without CORS is an error shown in the element`, async () => {
      const modelsDir = path.join(tmp, "models");
      fs.mkdirSync(modelsDir);
      fs.copyFileSync(path.join(www, "models", "lesson-beam.json"), path.join(modelsDir, "beam.json"));
      const modelHits = [];
      const models = await start(modelsDir, { handler: (req) => void modelHits.push(req.url) });
      const noCors = await start(modelsDir, { cors: false });
      const cdn = await start(www);
      for (const isolated of [false, true]) {
        const docsDir = path.join(tmp, `docs-${isolated}`);
        fs.mkdirSync(docsDir);
        page(
          docsDir,
          "index.html",
          `<next-token id="a" model="lesson-toy" temperature="0" autorun></next-token>
           <next-token id="b" model="${models}/beam.json" temperature="0" beams="2" autorun></next-token>
           <next-token id="c" model="${noCors}/beam.json" autorun></next-token>`,
          `<script type="module" src="${cdn}/next-token.js"></script>`,
        );
        const csp = strictCsp({ scripts: cdn, models: `${models} ${noCors}` });
        const docs = await start(docsDir, {
          headers: { "content-security-policy": csp, ...(isolated ? ISOLATE : {}) },
        });
        const p = await newPage();
        try {
          await p.goto(`${docs}/`);
          const els = await waitElements(p, 2);
          const label = isolated ? "isolated docs page" : "docs page";
          assertEq(els[0].text, "the cat sat", `${label}: the catalog's lesson table (beside the script) greedy`);
          assertEq(els[1].text, "a bird", `${label}: the third origin's table, 2 beams`);
          await p.waitForFunction(() => !document.querySelector("#c").shadowRoot.querySelector(".error").hidden, null, {
            timeout: 30_000,
          });
          const err = await p.evaluate(
            () => document.querySelector("#c").shadowRoot.querySelector(".error").textContent,
          );
          assert(/fetch|network|CORS/i.test(err), `${label}: the no-CORS model host's error: ${JSON.stringify(err)}`);
          const r = await p.evaluate(() => ({
            workers: window.__workers,
            csp: window.__csp,
            isolated: crossOriginIsolated,
            load: window.__threadsNotes[0],
            cores: navigator.hardwareConcurrency,
          }));
          assertEq(r.isolated, isolated, "crossOriginIsolated");
          // From a CDN too, an isolated page runs the threads build: its pool's workers start as
          // blob: workers of the page's origin, as the engine's does. One that is not isolated
          // runs one thread and says why.
          const pool = isolated && r.cores > 1 && fs.existsSync(path.join(www, "pkg-threads"));
          if (pool) {
            assertEq(r.load.note, "", `${label}: a one-thread reason`);
            assertEq(r.load.threads, r.cores, `${label}: the pool's threads`);
          } else assert(/one thread: /.test(r.load.note), `${label}: the one-thread reason: ${r.load.note}`);
          const workers = pool ? 1 + r.cores : 1; // the engine's, and the pool's
          assertEq(r.workers.length, workers, `${label}: workers the page created (${r.workers})`);
          for (const w of r.workers)
            assert(w.startsWith("blob:"), `${label}: a worker is not a blob: trampoline: ${w}`);
          assertEq(JSON.stringify(r.csp), "[]", `${label}: CSP violations`);
          const cspLines = p.consoleLines.filter((l) => /Content Security Policy/i.test(l));
          assertEq(JSON.stringify(cspLines), "[]", `${label}: CSP messages in the console`);
          console.log(`      ${label}: the element without CORS says: ${err}`);
        } finally {
          await p.context().close();
        }
      }
      assert(
        modelHits.some((u) => u === "/beam.json"),
        `the model host saw no request: ${modelHits}`,
      );
    });

    await test(`[${mode}] a script that cannot load at all (CDN down): the fallback text written inside the element shows; with the script, the element replaces it`, async () => {
      const cdn = await start(www);
      const docsDir = path.join(tmp, "docs-fallback");
      fs.mkdirSync(docsDir);
      const fallback = "The live model needs next-token.js from the CDN.";
      for (const [name, src] of [
        ["down.html", `${cdn}/no-such-folder/next-token.js`],
        ["up.html", `${cdn}/next-token.js`],
      ]) {
        page(
          docsDir,
          name,
          `<next-token id="a" model="lesson-toy" temperature="0" autorun>${fallback}</next-token>`,
          `<script type="module" src="${src}"></script>`,
        );
      }
      const docs = await start(docsDir);
      const p = await newPage();
      try {
        await p.goto(`${docs}/down.html`);
        await p.waitForTimeout(500);
        const down = await p.evaluate(() => ({
          text: document.querySelector("#a").innerText,
          height: document.querySelector("#a").getBoundingClientRect().height,
        }));
        assert(
          down.text.includes("needs next-token.js") && down.height > 0,
          `without the script: ${JSON.stringify(down)}`,
        );
        await p.goto(`${docs}/up.html`);
        const els = await waitElements(p, 1);
        assertEq(els[0].text, "the cat sat", "with the script");
        // Unslotted light DOM is not rendered: the fallback has no box once the element runs.
        const shown = await p.evaluate(() => {
          const range = document.createRange();
          range.selectNodeContents(document.querySelector("#a"));
          return (
            range.getClientRects().length > 0 && document.querySelector("#a").innerText.includes("needs next-token.js")
          );
        });
        assertEq(shown, false, "the fallback shows inside the running element");
      } finally {
        await p.context().close();
      }
    });

    await test(`[${mode}] served under a sub-path (/docs/lessons/), with and without COOP/COEP: the app and the lesson work, the service worker is scoped to the sub-path, and a second visit works offline`, async () => {
      const empty = path.join(tmp, "root");
      fs.mkdirSync(empty);
      for (const isolate of [false, true]) {
        let server;
        const up = async (port = 0) => (server = await serve(empty, port, { "/docs/lessons/": www }, { isolate }));
        await up();
        const port = server.address().port;
        const base = `http://127.0.0.1:${port}/docs/lessons/`;
        const p = await newPage();
        const label = isolate ? "with COOP/COEP" : "without COOP/COEP";
        try {
          const visit = async (what) => {
            await p.goto(`${base}index.html?model=lesson-toy&prompt=`);
            await p.waitForFunction(() => ["ready", "error"].includes(document.body.dataset.state), null, {
              timeout: 60_000,
            });
            const err = await p.evaluate(() =>
              document.getElementById("error").hidden ? "" : document.getElementById("error-text").textContent,
            );
            assertEq(err, "", `${label}, ${what}: the app's error`);
            await p.fill("#temperature", "0");
            await p.click("#generate");
            await p.waitForFunction(
              () => document.body.dataset.state === "ready" && document.getElementById("output-tokens").textContent,
              null,
              { timeout: 60_000 },
            );
            assertEq(
              (await p.textContent("#output-tokens")).trim(),
              "the cat sat",
              `${label}, ${what}: the app's greedy text`,
            );
            await p.goto(`${base}embed.html`);
            await p.locator("#cat .product").waitFor({ state: "visible", timeout: 30_000 });
            assertEq(
              (await p.locator("#cat .gen").textContent()).trim(),
              "the cat sat",
              `${label}, ${what}: the lesson's element`,
            );
          };
          await visit("first visit");
          const sw = await p.evaluate(async () => {
            const r = await navigator.serviceWorker.ready;
            return { scope: r.scope, script: r.active.scriptURL, isolated: crossOriginIsolated };
          });
          assertEq(sw.scope, base, `${label}: service worker scope`);
          assertEq(sw.script, `${base}sw.js`, `${label}: service worker script`);
          assertEq(sw.isolated, isolate, `${label}: crossOriginIsolated`);
          server.closeAllConnections();
          await new Promise((r) => server.close(r));
          server = null;
          await visit("second visit, server down");
          console.log(`      ${label}: service worker ${sw.scope}; offline visit ok`);
        } finally {
          await p.context().close();
          if (server) {
            server.closeAllConnections();
            await new Promise((r) => server.close(r));
          }
        }
      }
    });

    await test(`[${mode}] strict CSP (${strictCsp()}): index.html, embed.html and bench.html without violations; the app and the lesson generate`, async () => {
      const base = await start(www, { headers: { "content-security-policy": strictCsp() } });
      const p = await newPage();
      try {
        await p.goto(`${base}/?model=lesson-toy&prompt=`);
        await p.waitForFunction(() => document.body.dataset.state === "ready", null, { timeout: 60_000 });
        await p.fill("#temperature", "0");
        await p.click("#generate");
        await p.waitForFunction(
          () => document.body.dataset.state === "ready" && document.getElementById("output-tokens").textContent,
          null,
          { timeout: 60_000 },
        );
        assertEq((await p.textContent("#output-tokens")).trim(), "the cat sat", "the app's greedy text");
        const violations = [...(await p.evaluate(() => window.__csp))];
        await p.goto(`${base}/embed.html`);
        await p.locator("#cat .product").waitFor({ state: "visible", timeout: 30_000 });
        // The shadow root's styles apply (a blocked sheet would leave the bar unstyled).
        const display = await p.evaluate(
          () => getComputedStyle(document.querySelector("#cat").shadowRoot.querySelector(".bar")).display,
        );
        assertEq(display, "flex", "the element's styles under the CSP");
        violations.push(...(await p.evaluate(() => window.__csp)));
        await p.goto(`${base}/bench.html?model=models/lesson-toy.json&reps=1`);
        await p.waitForTimeout(500);
        assertEq(await p.evaluate(() => getComputedStyle(document.body).marginTop), "28px", "bench.html's stylesheet");
        violations.push(...(await p.evaluate(() => window.__csp)));
        assertEq(JSON.stringify(violations), "[]", "CSP violations");
        const lines = p.consoleLines.filter((l) => /Content Security Policy|Refused/i.test(l));
        assertEq(JSON.stringify(lines), "[]", "CSP messages in the console");
      } finally {
        await p.context().close();
      }
    });

    await test(`[${mode}] a lesson page with 5 <next-token> elements on 2 models: one worker, each model requested once, all generate together without mixing their streams`, async () => {
      const dir = path.join(tmp, "many");
      fs.mkdirSync(dir);
      const hits = [];
      const base = await start(
        www,
        { handler: (req) => void (/lesson-(toy|beam)\.json/.test(req.url) && hits.push(req.url)) },
        { "/many/": dir },
      );
      page(
        dir,
        "index.html",
        [0, 1, 2]
          .map(
            () => `<next-token model="../models/lesson-toy.json" temperature="0" max-tokens="8" autorun></next-token>`,
          )
          .join("") +
          `<next-token model="../models/lesson-beam.json" temperature="0" autorun></next-token><next-token model="../models/lesson-beam.json" beams="2" temperature="0" autorun></next-token>`,
        `<script type="module" src="../next-token.js"></script>`,
      );
      const p = await newPage();
      try {
        await p.goto(`${base}/many/`);
        const els = await waitElements(p, 5);
        assertEq(
          JSON.stringify(els.map((e) => e.text)),
          JSON.stringify(["the cat sat", "the cat sat", "the cat sat", "the cat", "a bird"]),
          "each element's text",
        );
        // Again, all at once, sampling: each stream is a path through its own table.
        await p.evaluate(() => {
          window.__done = 0;
          for (const e of document.querySelectorAll("next-token")) {
            e.setAttribute("temperature", "1");
            e.shadowRoot.querySelector(".run").click();
          }
        });
        const again = await waitElements(p, 5);
        const toy = /^the (cat|dog) (sat|ran)$/;
        const beam = /^(the (cat|dog)|a (bird|fish))$/;
        again.forEach((e, i) =>
          assert((i < 3 ? toy : beam).test(e.text) && !e.error, `element ${i}: ${JSON.stringify(e)}`),
        );
        const workers = await p.evaluate(() => window.__workers);
        assertEq(workers.length, 1, `workers created (${workers})`);
        assertEq(
          JSON.stringify(hits.sort()),
          JSON.stringify(["/models/lesson-beam.json", "/models/lesson-toy.json"]),
          "model requests",
        );
      } finally {
        await p.context().close();
      }
    });

    await npmTest(t, { start, newPage, tmp });
  } finally {
    for (const s of servers) {
      s.closeAllConnections?.();
      s.close();
    }
    fs.rmSync(tmp, { recursive: true, force: true });
  }
}

/** A typical use of the package's API, for the type check. */
const TYPED_USE = `import { NextToken, type Token, type ChatCompletion } from "nexttoken";
import "nexttoken/element";
async function main(): Promise<void> {
  const nt = new NextToken({ shareWorker: true });
  await nt.load("hf:bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q8_0.gguf", { onProgress: (p) => console.log(p.loaded, p.resumed) });
  for await (const t of nt.generate("Hi", { temperature: 0, keepCandidates: 64 })) {
    const tok: Token = t;
    if (tok.candidates) console.log(await nt.samplerView(tok.candidates, { topP: 0.9 }, nt.lastSummary?.promptIds ?? []));
  }
  const r: ChatCompletion = await nt.chat.completions.create({ messages: [{ role: "user", content: "Hi" }], logprobs: true, top_logprobs: 3 });
  console.log(r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens);
  for await (const c of await nt.chat.completions.create({ messages: [{ role: "user", content: "Hi" }], stream: true })) console.log(c.choices[0]?.delta.content);
  console.log((await nt.score(" sat", { after: "the cat" })).perplexity, nt.lastSummary?.beamTree?.best);
  // Structured output, as the JS API and the OpenAI API take it.
  const schema = { type: "object", properties: { name: { type: "string" } }, required: ["name"] };
  for await (const t of nt.generate("Hi", { constraint: { type: "json_schema", schema } })) console.log(t.removed?.[0]?.prob);
  for await (const t of nt.generate("Hi", { constraint: { type: "regex", pattern: "[0-9]+" }, maxTokens: 4 })) console.log(t.text);
  if (nt.lastSummary?.stopReason === "Incomplete") console.log(nt.lastSummary.constraint?.buildMs);
  await nt.chat.completions.create({ messages: [{ role: "user", content: "Hi" }], response_format: { type: "json_schema", json_schema: { name: "p", schema } } });
  await nt.chat.completions.create({ messages: [{ role: "user", content: "Hi" }], response_format: { type: "json_object" } });
  await nt.completions.create({ prompt: "Hi", grammar: 'start: "a" | "b"' });
  await nt.completions.create({ prompt: "Hi", regex: "[ab]" });
  // A remote engine, offered where the preflight refuses a model, or loaded by spec.
  const big = new NextToken({ remote: "openai+https://example.org/v1#m", apiKey: "k" });
  const p = await big.preflight("hf:o/r/big.gguf");
  const info = await big.load(p.remote ?? { kind: "remote", url: "https://example.org/v1", model: "m" });
  console.log(info.remote?.unavailable[0], info.backend === "remote");
}
main();
`;

/** `npm pack` of www/, installed offline into an empty folder; a page imports it from node_modules. */
async function npmTest({ test, assert, assertEq, mode, www }, { start, newPage, tmp }) {
  await test(`[${mode}] npm package: npm pack, npm install --offline of the tarball into an empty folder; "nexttoken" and "nexttoken/element" resolve, the types are there, and a page generates with the lesson table from node_modules`, async () => {
    const packDir = path.join(tmp, "pack");
    const app = path.join(tmp, "app");
    fs.mkdirSync(packDir);
    fs.mkdirSync(app);
    const npm = (args, cwd) => {
      const r = spawnSync("npm", [...args, "--no-audit", "--no-fund", "--loglevel=error"], { cwd, encoding: "utf8" });
      assert(r.status === 0, `npm ${args.join(" ")}: ${r.stderr}`);
      return r.stdout;
    };
    const tarball = npm(["pack", "--pack-destination", packDir], www).trim().split("\n").pop();
    fs.writeFileSync(path.join(app, "package.json"), JSON.stringify({ name: "docs", private: true, type: "module" }));
    npm(["install", "--offline", path.join(packDir, tarball)], app);
    const pkg = path.join(app, "node_modules", "nexttoken");
    for (const f of [
      "nexttoken.js",
      "next-token.js",
      "remote.js",
      "worker.js",
      "pool.js",
      "pool-worker.js",
      "pkg/nexttoken_bg.wasm",
      "index.d.ts",
      "element.d.ts",
      "models/lesson-toy.json",
      "models/default.gguf",
    ]) {
      assert(fs.existsSync(path.join(pkg, f)), `the package lacks ${f}`);
    }
    assert(
      !fs.existsSync(path.join(pkg, "index.html")) && !fs.existsSync(path.join(pkg, "app.js")),
      "the package carries the app's own pages",
    );
    // The declarations type-check a typical use (strict TypeScript), and they do constrain: a
    // misuse is an error.
    const tsc = (file) =>
      spawnSync(
        process.execPath,
        [
          path.join(here, "node_modules", "typescript", "bin", "tsc"),
          "--noEmit",
          "--strict",
          "--module",
          "nodenext",
          "--moduleResolution",
          "nodenext",
          "--target",
          "es2022",
          "--lib",
          "es2022,dom",
          file,
        ],
        { cwd: app, encoding: "utf8" },
      );
    fs.writeFileSync(path.join(app, "use.ts"), TYPED_USE);
    const typed = tsc("use.ts");
    assert(typed.status === 0, `the declarations do not type-check a typical use:\n${typed.stdout}${typed.stderr}`);
    fs.writeFileSync(
      path.join(app, "misuse.ts"),
      `import { NextToken } from "nexttoken";\nnew NextToken().generate("x", { temperature: "hot" });\n`,
    );
    assert(tsc("misuse.ts").status !== 0, "a misuse (temperature: string) type-checks");
    fs.writeFileSync(
      path.join(app, "misuse2.ts"),
      `import { NextToken } from "nexttoken";\nnew NextToken().generate("x", { constraint: { type: "regex", schema: {} } });\n`,
    );
    assert(tsc("misuse2.ts").status !== 0, "a misuse (a regex constraint without its pattern) type-checks");
    const resolved = spawnSync(
      process.execPath,
      [
        "--input-type=module",
        "-e",
        `console.log(import.meta.resolve("nexttoken")); console.log(import.meta.resolve("nexttoken/element"))`,
      ],
      { cwd: app, encoding: "utf8" },
    );
    assertEq(
      resolved.stdout
        .trim()
        .split("\n")
        .map((u) => path.relative(pkg, new URL(u).pathname))
        .join(" "),
      "nexttoken.js next-token.js",
      "what the exports resolve to",
    );
    page(
      app,
      "index.html",
      `<next-token id="e" model="lesson-toy" temperature="0" autorun></next-token>`,
      `<script type="module" src="node_modules/nexttoken/next-token.js"></script>`,
    );
    const base = await start(app);
    const p = await newPage();
    try {
      await p.goto(`${base}/`);
      const els = await waitElements(p, 1);
      assertEq(els[0].text, "the cat sat", "the element from node_modules");
      const text = await p.evaluate(async () => {
        const nt = await import("/node_modules/nexttoken/nexttoken.js");
        await nt.load("lesson-toy");
        let s = "";
        for await (const t of nt.generate("", { temperature: 0 })) s += t.text;
        return s;
      });
      assertEq(text.trim(), "the cat sat", "the JS API from node_modules");
      console.log(`      ${tarball}: ${(fs.statSync(path.join(packDir, tarball)).size / 1e6).toFixed(1)} MB`);
    } finally {
      await p.context().close();
    }
  });
}
