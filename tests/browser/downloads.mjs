// Browser tests for model delivery: a fault-injecting server (cuts at random offsets, dropped
// connections, stalls, lying lengths, a file that changes between attempts, a server that ignores
// Range) against www/model-cache.js: downloads resume, end with the original bytes, keep no
// partial or stale entry, and never download a stored byte twice; a damaged cache entry is
// reported and removed.

import crypto from "node:crypto";

const SIZE = 3 * 1024 * 1024 + 12345;
const CHUNK = 64 * 1024;

/** Deterministic file contents for `version`. */
function contents(version) {
  const out = Buffer.alloc(SIZE);
  let x = 0x9e3779b9 ^ (version * 0x85ebca6b);
  for (let i = 0; i < SIZE; i += 4) {
    x ^= x << 13;
    x ^= x >>> 17;
    x ^= x << 5;
    out.writeUInt32LE(x >>> 0, Math.min(i, SIZE - 4));
  }
  return out;
}

/**
 * The faulty server's state and its request handler (for serve.mjs's `handler`): `/faulty/model.bin`
 * answers with a fault drawn from a seeded sequence; `/faulty/plain.bin` behaves.
 */
export function faultyServer() {
  const state = { version: 1, data: contents(1), log: [], faults: true, served: 0, rng: 12345 };
  const random = () => {
    state.rng = (state.rng * 1103515245 + 12345) & 0x7fffffff;
    return state.rng / 0x7fffffff;
  };
  const etag = () => `"v${state.version}-${SIZE}"`;
  const handler = (req, res) => {
    if (!req.url.startsWith("/faulty/")) return false;
    if (req.url.startsWith("/faulty/huge.gguf")) {
      // Announces 5 GB, sends a little.
      res.writeHead(200, { "content-type": "application/octet-stream", "content-length": String(5e9) });
      res.write(Buffer.alloc(1000));
      setTimeout(() => res.destroy(), 200);
      return true;
    }
    if (req.url.startsWith("/faulty/empty.gguf")) {
      res.writeHead(200, { "content-type": "application/octet-stream", "content-length": "0" });
      res.end();
      return true;
    }
    const cors = {
      "access-control-allow-origin": "*",
      "access-control-expose-headers": "content-range, etag, content-length",
    };
    // The first 100 requests all break (a few of them after changing the file, or ignoring
    // Range); after that the server behaves.
    let fault = "ok";
    if (req.url.startsWith("/faulty/model.bin") && state.faults && state.served < 100) {
      const r = random();
      const late = state.served >= 60; // no restarts near the end, so the 100 can finish the file
      fault =
        r < 0.45
          ? "cut"
          : r < 0.6
            ? "drop"
            : r < 0.75
              ? "stall"
              : r < 0.9
                ? "lie"
                : late
                  ? "cut"
                  : r < 0.94
                    ? "change"
                    : "ignore-range";
    }
    if (req.url.startsWith("/faulty/model.bin")) state.served += 1;
    if (fault === "change") {
      state.version += 1;
      state.data = contents(state.version);
    }
    const data = state.data;
    let start = 0;
    const range = /^bytes=(\d+)-$/.exec(req.headers.range || "");
    const ifRange = req.headers["if-range"];
    const honour = range && fault !== "ignore-range" && (!ifRange || ifRange === etag());
    if (honour) start = Number(range[1]);
    if (start >= data.length) {
      res.writeHead(416, { ...cors, "content-range": `bytes */${data.length}` });
      res.end();
      return true;
    }
    const body = data.subarray(start);
    const entry = {
      fault,
      version: state.version,
      rangeStart: honour ? start : 0,
      asked: range ? Number(range[1]) : 0,
      sent: 0,
    };
    state.log.push(entry);
    const headers = {
      ...cors,
      "content-type": "application/octet-stream",
      etag: etag(),
      "content-length": String(fault === "lie" ? body.length + 1_000_000 : body.length),
    };
    if (honour) headers["content-range"] = `bytes ${start}-${data.length - 1}/${data.length}`;
    res.writeHead(honour ? 206 : 200, headers);
    if (fault === "drop") {
      res.destroy();
      return true;
    }
    // Cuts land anywhere in the first half of what is left, so the file takes many attempts. A
    // lie is cut too: with the whole rest sent before the reset, whether the last bytes reach the
    // page raced the reset (a loaded CI host finished the file at request 54 of 100).
    const broken = ["cut", "stall", "ignore-range", "change", "lie"].includes(fault);
    const cut = broken ? Math.floor((random() * body.length) / 2) : body.length;
    res.write(body.subarray(0, cut), () => {
      entry.sent = cut;
      if (fault === "cut" || fault === "ignore-range" || fault === "change") res.destroy();
      else if (fault === "stall")
        setTimeout(() => res.destroy(), 5_000); // the client gives up first
      else if (fault === "lie")
        res.destroy(); // fewer bytes than announced
      else res.end();
    });
    return true;
  };
  return { state, handler, sha256: () => crypto.createHash("sha256").update(state.data).digest("hex") };
}

export async function downloadTests(t) {
  const { test, assert, assertEq, page, base, mode, server } = t;
  if (mode !== "cpu") return; // delivery does not depend on the backend

  await test(`[${mode}] 100 downloads broken at random (cut, dropped, stalled, lying length, changed file, Range ignored) end with the original bytes, one complete entry, no byte downloaded twice`, async () => {
    server.state.faults = true;
    server.state.served = 0;
    server.state.log.length = 0;
    await page.goto(`${base}/?nosw&model=lesson-toy`);
    const r = await page.evaluate(
      async ({ CHUNK }) => {
        const mc = await import("/model-cache.js");
        for (const key of await caches.keys()) await caches.delete(key);
        const url = "/faulty/model.bin";
        const attempts = [];
        let result = null;
        for (let i = 0; i < 120 && !result; i++) {
          const parts = [];
          let start = null;
          let last = null;
          try {
            const got = await mc.fetchModelFile(url, {
              chunkBytes: CHUNK,
              stallMs: 300,
              onStart: (s) => (start = s),
              onChunk: (c) => parts.push(c.slice()),
              onProgress: (p) => (last = p),
            });
            const all = new Uint8Array(got.bytes);
            let o = 0;
            for (const p of parts) {
              all.set(p, o);
              o += p.length;
            }
            const digest = Array.from(new Uint8Array(await crypto.subtle.digest("SHA-256", all)), (b) =>
              b.toString(16).padStart(2, "0"),
            ).join("");
            result = { digest, bytes: got.bytes, fromCache: got.fromCache };
            attempts.push({ ok: true, started: true, resumed: start.resumed, loaded: last.loaded });
          } catch (e) {
            // An attempt that failed before its answer came (a dropped connection) started nothing.
            attempts.push({
              ok: false,
              started: !!start,
              resumed: start?.resumed ?? 0,
              loaded: last?.loaded ?? start?.resumed ?? 0,
              error: `${e.name}: ${e.message}`,
            });
          }
        }
        const listed = await mc.listCached();
        // Read back: from the cache, the same bytes.
        let again = null;
        if (result) {
          const parts = [];
          const got = await mc.fetchModelFile(url, { onChunk: (c) => parts.push(c.slice()) });
          const all = new Blob(parts);
          const digest = Array.from(
            new Uint8Array(await crypto.subtle.digest("SHA-256", await all.arrayBuffer())),
            (b) => b.toString(16).padStart(2, "0"),
          ).join("");
          again = { digest, fromCache: got.fromCache };
        }
        const cache = await caches.open(mc.MODEL_CACHE);
        const keys = (await cache.keys()).map((k) => k.url);
        const manifest = await (await cache.match(new URL(url, location.href).href)).json();
        return { result, attempts, listed, again, keys, manifestChunks: manifest.chunks.length };
      },
      { CHUNK },
    );
    const log = server.state.log;
    const faults = {};
    for (const e of log) faults[e.fault] = (faults[e.fault] || 0) + 1;
    console.log(
      `      ${r.attempts.length} attempts, faults: ${JSON.stringify(faults)}, file versions ${server.state.version}`,
    );
    assert(r.result, `no attempt succeeded: ${JSON.stringify(r.attempts.slice(-3))}`);
    assertEq(r.result.digest, server.sha256(), "sha256 of the downloaded bytes vs the file's");
    assertEq(r.again.fromCache, true, "second read from the cache");
    assertEq(r.again.digest, server.sha256(), "sha256 of the cached bytes");
    assertEq(r.listed.length, 1, `cached entries: ${JSON.stringify(r.listed)}`);
    assert(r.listed[0].complete && r.listed[0].bytes === SIZE, `the entry: ${JSON.stringify(r.listed[0])}`);
    const chunkKeys = r.keys.filter((k) => k.startsWith("https://nexttoken-chunks.invalid/"));
    // No stale chunk of an earlier version or attempt: exactly the manifest's chunks are stored.
    assertEq(chunkKeys.length, r.manifestChunks, "chunk entries vs the manifest's chunks");
    assert(r.attempts.filter((a) => a.ok).length === 1, "more than one success");
    assertEq(log.length, 101, "requests: 100 broken, then the one that finished");
    // An attempt is one request, or two when the first got no answer (a dropped connection is
    // tried once more, model-cache.js `request`).
    let attempts = 0;
    for (let i = 0; i < log.length; i++, attempts++) if (log[i].fault === "drop") i++;
    assertEq(r.attempts.length, attempts, "attempts, the retries of dropped connections inside theirs");
    assert(
      r.attempts.some((a) => a.resumed > 0),
      "no attempt resumed",
    );
    // Since the last restart from byte 0 (a changed file or an ignored Range), every byte came once.
    const lastRestart = r.attempts.findLastIndex((a, i) => i > 0 && a.started && a.resumed === 0);
    const since = r.attempts.slice(Math.max(lastRestart, 0));
    const downloaded = since.reduce((n, a) => n + (a.loaded - a.resumed), 0);
    assertEq(downloaded, SIZE, `bytes downloaded since the last restart (${since.length} attempts)`);
    for (const a of r.attempts.filter((a) => !a.ok))
      assert(/DownloadError: .*(interrupted|cut short|cannot download)/.test(a.error), `unclear error: ${a.error}`);
  });

  await test(`[${mode}] storage refused (a quota too small for the model): the model runs with a clear warning, nothing partial is kept, and the app shell is still cached`, async () => {
    if (!t.bigModelUrl) return "skip";
    server.state.faults = false;
    const context = await t.browser.newContext({ serviceWorkers: "allow" });
    const p = await context.newPage();
    try {
      // Chromium's DevTools protocol sets the origin's quota: room for the app shell, not the model.
      const cdp = await context.newCDPSession(p);
      await cdp.send("Storage.overrideQuotaForOrigin", { origin: base, quotaSize: 12 * 1024 * 1024 });
      await p.goto(`${base}/?model=${encodeURIComponent(t.bigModelUrl)}&mode=text`);
      await p.evaluate(() => navigator.serviceWorker.ready);
      await t.waitState(p, ["ready", "error"], 120_000);
      const warning = await t.errorText(p);
      assert(
        /not enough browser storage/.test(warning) && (await p.getAttribute("#error", "class")) === "warning",
        `warning: ${JSON.stringify(warning)}`,
      );
      assertEq(await p.evaluate(() => document.body.dataset.state), "ready", "the model still loaded");
      const r = await p.evaluate(async () => {
        const mc = await import("/model-cache.js");
        const shell = (await caches.keys()).filter((k) => k.startsWith("nexttoken-shell-"));
        const shellFiles = shell.length
          ? (await (await caches.open(shell[0])).keys()).map((q) => new URL(q.url).pathname)
          : [];
        return { models: await mc.listCached(), shellFiles };
      });
      assertEq(JSON.stringify(r.models), "[]", "model entries kept (partial or whole)");
      for (const f of ["/index.html", "/app.js", "/pkg/nexttoken_bg.wasm"])
        assert(r.shellFiles.includes(f), `the app shell lacks ${f}: ${JSON.stringify(r.shellFiles)}`);
    } finally {
      await context.close();
    }
  });

  await test(`[${mode}] a cached file with flipped bytes is reported, removed and downloads again`, async () => {
    server.state.faults = false;
    await page.goto(`${base}/?nosw&model=lesson-toy`);
    const r = await page.evaluate(async () => {
      const mc = await import("/model-cache.js");
      for (const key of await caches.keys()) await caches.delete(key);
      const url = "/faulty/model.bin";
      await mc.fetchModelFile(url, { chunkBytes: 1 << 20 });
      // Flip one byte in the middle of chunk 2.
      const cache = await caches.open(mc.MODEL_CACHE);
      const key = (await cache.keys())
        .map((k) => k.url)
        .find((k) => k.startsWith("https://nexttoken-chunks.invalid/1/"));
      const bytes = new Uint8Array(await (await cache.match(key)).arrayBuffer());
      bytes[1000] ^= 0x55;
      await cache.put(key, new Response(bytes));
      let error = null;
      try {
        await mc.fetchModelFile(url);
      } catch (e) {
        error = `${e.name}: ${e.message} (retryable ${e.retryable})`;
      }
      const afterError = await mc.listCached();
      const again = await mc.fetchModelFile(url);
      return { error, afterError: afterError.length, again: again.fromCache };
    });
    assert(
      r.error && /damaged/.test(r.error) && /removed/.test(r.error) && /retryable true/.test(r.error),
      `error: ${r.error}`,
    );
    assertEq(r.afterError, 0, "entries left after the damaged one was found");
    assertEq(r.again, false, "the retry downloads again");
  });

  await test(`[${mode}] unsupported model URLs (javascript:, data:) and an empty response say so`, async () => {
    server.state.faults = false;
    await page.goto(`${base}/?nosw&model=lesson-toy`);
    const r = await page.evaluate(async () => {
      const mc = await import("/model-cache.js");
      const out = {};
      for (const url of ["javascript:alert(1)", "data:application/octet-stream;base64,R0dVRg=="]) {
        try {
          await mc.fetchModelFile(url);
          out[url] = "accepted";
        } catch (e) {
          out[url] = e.message;
        }
      }
      return out;
    });
    for (const [url, message] of Object.entries(r)) assert(/unsupported URL/.test(message), `${url}: ${message}`);
    // The page shows each problem as it is.
    const shown = {};
    for (const [url, want] of [
      ["javascript:alert(1)", /unsupported URL/],
      ["/faulty/huge.gguf", /5\.00 GB .*announced.*WebAssembly memory/],
      ["/faulty/empty.gguf", /empty file/],
    ]) {
      await page.goto(`${base}/?nosw&model=${encodeURIComponent(url)}`);
      await t.waitState(page, ["error", "ready"]);
      shown[url] = await t.errorText(page);
      assert(want.test(shown[url]) && (await page.isVisible("#error")), `${url}: shown ${JSON.stringify(shown[url])}`);
    }
    console.log(`      ${JSON.stringify(shown)}`);
  });
}
