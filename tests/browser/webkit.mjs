// The CPU-path browser tests again in WebKit, Safari's engine: Debian's WebKitGTK MiniBrowser under
// Xvfb, driven by WebKitWebDriver over plain WebDriver (HTTP and JSON: no npm package). WebKit has
// no WebGPU here, so the page must pick the wasm CPU path by itself. Run twice: as shipped, where
// this WebKitGTK keeps SharedArrayBuffer off on a cross-origin isolated page (one thread, and the
// stats must say why), and with JSC_useSharedArrayBuffer=true (the threads build, one thread a
// core). Checked: the app's greedy text equals the native CLI's, the <next-token> lesson and its
// recording, the JS API, the Cache API and a second visit with the server gone.
//
//   node tests/browser/webkit.mjs        (after ./build.sh; apt-get install webkit2gtk-driver xvfb xauth)
//
// Closing line: "N passed, N failed"; exit status 1 if anything failed.

import { spawn, spawnSync } from "node:child_process";
import fs from "node:fs";
import net from "node:net";
import path from "node:path";
import { appOutcome, assert, assertEq, nativeGreedy, outDir, runner, setGreedy, www } from "./harness.mjs";
import { serve } from "./serve.mjs";

/** The MiniBrowser that libwebkit2gtk installs (its path depends on the architecture). */
function miniBrowser() {
  const r = spawnSync("sh", ["-c", "dpkg -L libwebkit2gtk-4.1-0 2>/dev/null | grep '/MiniBrowser$'"], {
    encoding: "utf8",
  });
  return process.env.MINIBROWSER || r.stdout.trim().split("\n")[0];
}
const browserPath = miniBrowser();
for (const [what, ok] of [
  ["WebKitWebDriver (apt-get install webkit2gtk-driver)", spawnSync("which", ["WebKitWebDriver"]).status === 0],
  ["xvfb-run (apt-get install xvfb xauth)", spawnSync("which", ["xvfb-run"]).status === 0],
  ["the MiniBrowser of libwebkit2gtk-4.1-0", browserPath && fs.existsSync(browserPath)],
]) {
  if (!ok) {
    console.log(`no ${what}\n0 passed, 1 failed`);
    process.exit(1);
  }
}

const { test, finish, failed } = runner("webkit");
const PROMPT = "In the beginning";
const N = 24;
const expected = nativeGreedy(PROMPT, N);
const haveThreadsBuild = fs.existsSync(path.join(www, "pkg-threads", "nexttoken_bg.wasm"));

const freePort = () =>
  new Promise((resolve) => {
    const s = net.createServer().listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });

/** WebKitWebDriver under Xvfb (`env` reaches the browser it starts) and a WebDriver session on it. */
async function startBrowser(env) {
  const port = await freePort();
  const driver = spawn("xvfb-run", ["-a", "WebKitWebDriver", `--port=${port}`], {
    env: { ...process.env, ...env },
    stdio: "ignore",
    detached: true, // its own process group: xvfb-run, Xvfb, the driver and the browser stop together
  });
  const url = `http://127.0.0.1:${port}`;
  const call = async (method, route, body) => {
    const res = await fetch(url + route, {
      method,
      headers: { "content-type": "application/json" },
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    const json = await res.json();
    if (json.value?.error) throw new Error(`WebDriver ${route}: ${json.value.error}: ${json.value.message}`);
    return json.value;
  };
  let session = null;
  for (let i = 0; i < 100 && !session; i++) {
    try {
      session = await call("POST", "/session", {
        capabilities: {
          alwaysMatch: {
            browserName: "MiniBrowser",
            "webkitgtk:browserOptions": { binary: browserPath, args: ["--automation"] },
            timeouts: { script: 180_000, pageLoad: 120_000 },
          },
        },
      });
    } catch {
      await new Promise((r) => setTimeout(r, 200)); // the driver is not listening yet
    }
  }
  assert(session, "WebKitWebDriver did not start a session");
  const s = `/session/${session.sessionId}`;
  return {
    goto: (to) => call("POST", `${s}/url`, { url: to }),
    reload: () => call("POST", `${s}/refresh`, {}),
    /** `fn(...args)` in the page (async functions are awaited). */
    run: (fn, ...args) =>
      call("POST", `${s}/execute/async`, {
        script: `const done = arguments[arguments.length - 1];
          Promise.resolve((${fn}).apply(null, Array.from(arguments).slice(0, -1)))
            .then((v) => done({ ok: v }), (e) => done({ error: String(e && e.stack || e) }));`,
        args,
      }).then((r) => {
        if (r.error) throw new Error(`in the page: ${r.error}`);
        return r.ok;
      }),
    screenshot: async (file) => fs.writeFileSync(file, Buffer.from(await call("GET", `${s}/screenshot`), "base64")),
    close: async () => {
      await call("DELETE", s).catch(() => {});
      try {
        process.kill(-driver.pid);
      } catch {}
    },
  };
}

/** Poll `fn` in the page until it returns something truthy; a timeout says what the page shows. */
async function waitFor(b, fn, what, timeout = 180_000) {
  const t0 = Date.now();
  for (;;) {
    const v = await b.run(fn);
    if (v) return v;
    if (Date.now() - t0 > timeout) {
      const where = await b
        .run(() =>
          JSON.stringify({
            state: document.body.dataset.state,
            error: document.getElementById("error-text")?.textContent,
            stats: window.nexttokenApp?.stats,
          }),
        )
        .catch((e) => `(page unreadable: ${e})`);
      await b.screenshot(path.join(outDir, "webkit-timeout.png")).catch(() => {});
      throw new Error(`waiting for ${what}: the page: ${where}`);
    }
    await new Promise((r) => setTimeout(r, 250));
  }
}

/** The app's greedy text for PROMPT (the default model), its error and its backend line. */
async function generateDefault(b, label) {
  await waitFor(b, () => ["ready", "error"].includes(document.body.dataset.state), `${label}: the model loaded`);
  await b.run(setGreedy, N);
  await b.run(() => document.getElementById("generate").click());
  await waitFor(
    b,
    () => document.body.dataset.state === "ready" && document.getElementById("output-tokens").textContent,
    `${label}: generation`,
  );
  return b.run(appOutcome);
}

let server = await serve(www, 0, {}, {});
const port = server.address().port;
const base = `http://127.0.0.1:${port}`;
const stopServer = async () => {
  server.closeAllConnections?.();
  await new Promise((r) => server.close(r));
};

for (const sab of [false, true]) {
  const label = sab ? "JSC_useSharedArrayBuffer=true" : "as shipped";
  const b = await startBrowser(sab ? { JSC_useSharedArrayBuffer: "true" } : {});
  try {
    await test(`${label}: the app runs the default model on the wasm CPU path (saying why), with the native CLI's greedy text; ${sab ? "the threads build, a thread a core" : "one thread, and the stats say why"}`, async () => {
      await b.goto(`${base}/?prompt=${encodeURIComponent(PROMPT)}`);
      const r = await generateDefault(b, label);
      assertEq(r.error, "", "error shown");
      assertEq(r.text, expected, "greedy text vs the native CLI");
      assert(/^CPU/.test(r.backend) && /WebGPU/.test(r.backend), `the stats do not say why the CPU runs: ${r.backend}`);
      const threads = Number((/(\d+) threads?\b/.exec(r.backend) || [])[1] || 1);
      if (sab && haveThreadsBuild && r.cores > 1) assertEq(threads, r.cores, `CPU threads (${r.backend})`);
      const engine = await b.run(() => window.nexttokenApp.stats.engine);
      if (!sab) {
        assertEq(threads, 1, `one thread as shipped (${r.backend})`);
        assert(/\(one thread: .+\)$/.test(r.backend), `the stats say why one thread: ${r.backend}`);
        // One thread either way: the tabs of the site share one engine (a SharedWorker).
        assert(/^one engine for every tab of this site/.test(engine), `the stats' engine: ${engine}`);
      } else assert(/^this page's own engine: it runs the threads build/.test(engine), `the stats' engine: ${engine}`);
      console.log(`      backend: ${r.backend}`);
      // The kernels of the build this browser validates (relaxed-simd or simd128), self-checked.
      const isa = await b.run(async () => {
        const { relaxedSimd } = await import("/wasm.js");
        const dir = relaxedSimd() ? "pkg-relaxed" : "pkg";
        const wasm = await import(`/${dir}/nexttoken.js`);
        await wasm.default();
        return wasm.kernelSelfTest().split(":")[0];
      });
      const relaxedBuilt = fs.existsSync(path.join(www, "pkg-relaxed", "nexttoken_bg.wasm"));
      assert(new RegExp(`${relaxedBuilt ? isa : "simd128"} int8 kernels`).test(r.backend), `${isa}: ${r.backend}`);
      console.log(`      kernel self-test: ${isa} kernels match the scalar ones`);
    });
    if (sab) continue; // the rest does not depend on threads

    await test(`${label}: the <next-token> lesson shows P(the cat sat) = 0.42, and its recording plays with the recorded probabilities`, async () => {
      await b.goto(`${base}/embed.html`);
      const line = await waitFor(
        b,
        () => {
          const product = document.getElementById("cat")?.shadowRoot?.querySelector(".product");
          return product && !product.hidden && product.textContent;
        },
        "the lesson's product line",
      );
      assert(/“the cat sat”/.test(line) && /= 0\.42$/.test(line), `product line: ${line}`);
      const recorded = fs
        .readFileSync(path.join(www, "models", "default-recording.jsonl"), "utf8")
        .trim()
        .split("\n");
      await b.run(() => document.getElementById("recorded").run());
      const shown = await waitFor(
        b,
        () => {
          const e = document.getElementById("recorded");
          const p = e.shadowRoot.querySelector(".product");
          return (
            !p.hidden && {
              text: e.shadowRoot.querySelector(".gen").textContent,
              product: Number(p.dataset.probability),
            }
          );
        },
        "the recording",
      );
      const lines = recorded.map((l) => JSON.parse(l));
      assertEq(shown.text, lines.at(-1).text, "the recording's text");
      const product = Math.exp(lines.slice(0, -1).reduce((s, l) => s + l.logprob, 0));
      assert(Math.abs(shown.product - product) <= 1e-12 * product, `the product: ${shown.product} vs ${product}`);
    });

    await test(`${label}: the JS API (nexttoken.js) loads the default model and streams the native CLI's greedy tokens`, async () => {
      const text = await b.run(
        async (prompt, n) => {
          const { NextToken } = await import("/nexttoken.js");
          const nt = new NextToken();
          try {
            await nt.load("default");
            let text = "";
            for await (const t of nt.generate(prompt, { temperature: 0, maxTokens: n })) text += t.text;
            return text;
          } finally {
            nt.terminate();
          }
        },
        PROMPT,
        N,
      );
      assertEq(text, expected, "the JS API's greedy text");
    });

    await test(`${label}: the model is in the Cache API; a second visit with the server gone works from the caches`, async () => {
      await b.goto(`${base}/?prompt=${encodeURIComponent(PROMPT)}`);
      await waitFor(b, () => ["ready", "error"].includes(document.body.dataset.state), "the model loaded");
      await b.run(() => navigator.serviceWorker.ready.then(() => true));
      const cached = await b.run(async () => (await (await import("/model-cache.js")).listCached()).map((r) => r.url));
      assert(
        cached.some((u) => u.endsWith("/models/default.gguf")),
        `model not cached: ${JSON.stringify(cached)}`,
      );
      await stopServer();
      try {
        await b.reload();
        const r = await generateDefault(b, "offline");
        assertEq(r.text, expected, "offline greedy text");
        assert(/cache/.test(r.download), `offline: not loaded from the cache (${r.download})`);
      } finally {
        server = await serve(www, port, {}, {});
      }
    });
  } finally {
    if (failed()) await b.screenshot(path.join(outDir, `webkit-${sab ? "sab" : "shipped"}.png`)).catch(() => {});
    await b.close();
  }
}
await stopServer().catch(() => {});
finish();
