// Browser tests for one engine per browser: pages of one origin that cannot run the threads build
// (not cross-origin isolated) share one SharedWorker, so a model is loaded once for all of them.
// Against the browser's own list of workers (the DevTools protocol: one shared worker, no
// dedicated ones), the server's log (one download), solo runs on a page's own engine (each
// concurrent generation equals its solo run, token by token and probability by probability), the
// native CLI's greedy text, and the KV cache each page keeps (a page's prompt prefix is reused
// after another page generated in between).

import { nativeGreedy } from "./harness.mjs";
import { serve } from "./serve.mjs";

const PAGE = `<!doctype html><html lang="en"><head><meta charset="utf-8"><title>engine test</title>
<script type="module">
import { NextToken } from "/nexttoken.js";
window.NextToken = NextToken;
// One generation: each token's id, probability and arrival time (one clock for every page).
window.run = async (nt, prompt, options, stopAfter = Infinity) => {
  const tokens = [];
  for await (const t of nt.generate(prompt, options)) {
    tokens.push({ id: t.id, prob: t.prob, text: t.text, at: performance.timeOrigin + performance.now() });
    if (tokens.length === stopAfter) nt.abort();
  }
  return { tokens, summary: nt.lastSummary };
};
window.ready = true;
</script></head><body></body></html>`;

const A = { prompt: "In the beginning", options: { temperature: 0, maxTokens: 40 } };
const B = { prompt: "And God said", options: { temperature: 0.9, topK: 40, seed: 7, maxTokens: 40 } };

export async function engineTests(t) {
  const { test, assert, assertEq, browser, mode, www } = t;
  if (mode !== "cpu") return; // the CPU path (the shared engine on WebGPU is the same code)

  const downloads = [];
  let shim = ""; // /nt-worker.js: a page's one-line worker script importing a CDN's worker.js
  const handler = (req, res) => {
    const file = new URL(req.url, "http://x").pathname;
    if (file === "/nt-worker.js") {
      res.writeHead(200, { "content-type": "text/javascript" }).end(shim);
      return true;
    }
    // Served, not routed: a routed page is of no address space, and Chromium then refuses it
    // the (loopback) CDN.
    if (file === "/t/cdn.html") {
      res.writeHead(200, { "content-type": "text/html" }).end("<!doctype html><title>cdn</title>");
      return true;
    }
    if (file === "/models/default.gguf" && req.method === "GET") downloads.push(req.url);
    return false;
  };
  const server = await serve(www, 0, {}, { handler });
  const base = `http://127.0.0.1:${server.address().port}`;
  // Routed pages carry no isolation headers: the threads build cannot run, so "auto" shares.
  const open = async (context) => {
    const page = await context.newPage();
    await page.route(`${base}/t/engine.html`, (r) => r.fulfill({ contentType: "text/html", body: PAGE }));
    await page.goto(`${base}/t/engine.html`);
    await page.waitForFunction(() => window.ready);
    return page;
  };
  const loadDefault = (page, engine = "auto") =>
    page.evaluate(async (engine) => {
      window.nt = new window.NextToken({ engine });
      const info = await window.nt.load("/models/default.gguf", { backend: "cpu" });
      return { ...info, spec: undefined };
    }, engine);
  const generate = (page, run, stopAfter) =>
    page.evaluate(({ prompt, options, stopAfter }) => window.run(window.nt, prompt, options, stopAfter), {
      ...run,
      stopAfter: stopAfter ?? Number.MAX_SAFE_INTEGER,
    });
  const workers = async () => {
    const cdp = await browser.newBrowserCDPSession();
    try {
      const { targetInfos } = await cdp.send("Target.getTargets");
      // A worker from a CDN starts as a blob: of the page's origin.
      const ours = (i) => i.url.startsWith(base) || i.url.startsWith(`blob:${base}`);
      return {
        shared: targetInfos.filter((i) => i.type === "shared_worker" && ours(i)).length,
        dedicated: targetInfos.filter((i) => i.type === "worker" && ours(i)).length,
      };
    } finally {
      await cdp.detach();
    }
  };
  const same = (got, want, what) => {
    assertEq(got.tokens.map((x) => x.id).join(" "), want.tokens.map((x) => x.id).join(" "), `${what}: token ids`);
    for (let i = 0; i < want.tokens.length; i++)
      assert(
        Math.abs(got.tokens[i].prob - want.tokens[i].prob) < 1e-6,
        `${what}: token ${i}'s probability ${got.tokens[i].prob} is not the solo run's ${want.tokens[i].prob}`,
      );
  };

  try {
    // The references: each run alone, on a page's own (dedicated) engine in a context of its own.
    const solo = {};
    {
      const context = await browser.newContext();
      const page = await open(context);
      const info = await loadDefault(page, "dedicated");
      assertEq(info.engine, "dedicated", "engine: dedicated");
      solo.a = await generate(page, A);
      solo.b = await generate(page, B);
      await context.close();
    }
    assertEq(
      solo.a.tokens.map((x) => x.text).join(""),
      nativeGreedy(A.prompt, A.options.maxTokens),
      "the solo greedy run against the native CLI",
    );

    const context = await browser.newContext();
    try {
      await test(`[${mode}] two pages of one origin share one engine: one shared worker and no other, one download, one copy of the model (the second load reuses it)`, async () => {
        downloads.length = 0;
        const a = await open(context);
        const b = await open(context);
        const infoA = await loadDefault(a);
        const infoB = await loadDefault(b);
        assertEq(infoA.engine, "shared", "page A's engine");
        assertEq(infoB.engine, "shared", "page B's engine");
        assert(/every tab of this site/.test(infoA.engineNote), `the note says why: ${infoA.engineNote}`);
        assert(/not cross-origin isolated/.test(infoA.threadsNote), `the one-thread reason: ${infoA.threadsNote}`);
        assert(!infoA.timings.reused && infoB.timings.reused, "the second page's load reuses the first's model");
        assertEq(infoB.enginePages, 2, "pages the engine serves");
        assertEq(infoB.modelUsers, 2, "loads that share the model's one copy");
        assertEq(downloads.length, 1, "downloads of the model (server log)");
        assertEq(JSON.stringify(await workers()), JSON.stringify({ shared: 1, dedicated: 0 }), "workers of the origin");
        const shown = await b.evaluate(async () => (await import("/views.js")).engineText(window.nt.info));
        assert(
          /2 pages connected, this model's one copy used by 2 loads/.test(shown),
          `the stats' engine line: ${shown}`,
        );
      });

      await test(`[${mode}] concurrent generations on the shared engine (greedy on one page, seeded sampling on the other) each equal their solo run and take turns token by token`, async () => {
        const [a, b] = context.pages();
        const [ra, rb] = await Promise.all([generate(a, A), generate(b, B)]);
        same(ra, solo.a, "page A (greedy)");
        same(rb, solo.b, "page B (sampled)");
        // Neither waited for the other's end: each one's first token came before the other's last.
        assert(rb.tokens[0].at < ra.tokens.at(-1).at && ra.tokens[0].at < rb.tokens.at(-1).at, "the runs interleave");
      });

      await test(`[${mode}] each page keeps its own KV cache on the shared model: after the other page's run, a page's next prompt reuses its own prefix`, async () => {
        const [a, b] = context.pages();
        await generate(a, A);
        await generate(b, B);
        const again = await generate(a, { ...A, prompt: `${A.prompt} God` });
        assert(
          again.summary.reusedTokens >= 3,
          `page A reused ${again.summary.reusedTokens} positions of its own earlier prompt`,
        );
      });

      await test(`[${mode}] one page's abort does not stop the other's generation, which still equals its solo run`, async () => {
        const [a, b] = context.pages();
        const [ra, rb] = await Promise.all([
          generate(a, { ...A, options: { ...A.options, maxTokens: 200 } }, 5),
          generate(b, B),
        ]);
        assertEq(ra.tokens.length, 5, "page A's tokens after its abort");
        same(rb, solo.b, "page B");
        same(await generate(a, A), solo.a, "page A's next run");
      });

      await test(`[${mode}] a page that goes lets go of its share, whether its "bye" arrives or only its Web Lock is let go: a new page then finds 2 pages and 2 loads, and no new download`, async () => {
        downloads.length = 0;
        // The engine as the next page finds it, once the page that went is let go (asynchronous).
        const next = async () => {
          const page = await open(context);
          for (let i = 0; ; i++) {
            const info = await loadDefault(page);
            if (info.enginePages === 2 || i === 50) return { page, info };
            await page.evaluate(() => window.nt.terminate());
            await page.waitForTimeout(100);
          }
        };
        for (const how of ["bye", "lock"]) {
          const gone = context.pages()[1];
          if (how === "lock")
            await gone.evaluate(() => {
              // A page that goes without a word (as a crash would, or a browser that drops it).
              const post = MessagePort.prototype.postMessage;
              MessagePort.prototype.postMessage = function (m, ...rest) {
                if (m?.type !== "bye") post.call(this, m, ...rest);
              };
            });
          await gone.close();
          const { page, info } = await next();
          assert(info.timings.reused, `${how}: the model is still loaded for page A`);
          assertEq(info.enginePages, 2, `${how}: pages the engine serves`);
          assertEq(info.modelUsers, 2, `${how}: loads that share the model`);
          same(await generate(page, B), solo.b, `${how}: the new page's run`);
        }
        assertEq(downloads.length, 0, "downloads of the model");
      });
    } finally {
      await context.close();
    }

    await test(`[${mode}] from a CDN, a one-line worker script on the page's origin gives the pages one shared engine; without it each page runs its own, and says why`, async () => {
      const cdn = await serve(www, 0);
      const cdnBase = `http://127.0.0.1:${cdn.address().port}`;
      shim = `import "${cdnBase}/worker.js";\n`;
      const context = await browser.newContext();
      try {
        const pages = [await context.newPage(), await context.newPage()];
        const infos = [];
        for (const page of pages) {
          await page.goto(`${base}/t/cdn.html`);
          infos.push(
            await page.evaluate(async (cdnBase) => {
              const { NextToken, engineChoice } = await import(`${cdnBase}/nexttoken.js`);
              const nt = new NextToken({ workerUrl: "/nt-worker.js" });
              const info = await nt.load("default", { backend: "cpu" });
              let text = "";
              for await (const t of nt.generate("In the beginning", { temperature: 0, maxTokens: 12 })) text += t.text;
              const own = engineChoice();
              return { engine: info.engine, reused: !!info.timings.reused, pages: info.enginePages, text, own };
            }, cdnBase),
          );
        }
        assertEq(infos.map((i) => i.engine).join(" "), "shared shared", "engines");
        assert(!infos[0].reused && infos[1].reused, "the second page reuses the first's model");
        assertEq(infos[1].pages, 2, "pages the engine serves");
        assertEq(infos[1].text, nativeGreedy("In the beginning", 12), "the text against the native CLI");
        assertEq(
          JSON.stringify(await workers()),
          JSON.stringify({ shared: 1, dedicated: 0 }),
          "workers of the page's origin",
        );
        assertEq(infos[0].own.kind, "dedicated", "without the worker script");
        assert(/another origin/.test(infos[0].own.note), `the note: ${infos[0].own.note}`);
      } finally {
        await context.close();
        cdn.closeAllConnections?.();
        await new Promise((r) => cdn.close(r));
      }
    });

    await test(`[${mode}] a cross-origin isolated page with more than one core keeps its own engine (the threads build), and says why`, async () => {
      const context = await browser.newContext();
      try {
        const page = await context.newPage();
        await page.goto(`${base}/index.html?nosw`);
        const choice = await page.evaluate(async () => {
          const { engineChoice } = await import("/nexttoken.js");
          return { auto: engineChoice(), cores: navigator.hardwareConcurrency, isolated: crossOriginIsolated };
        });
        assert(choice.isolated, "the page is cross-origin isolated");
        if (choice.cores > 1) {
          assertEq(choice.auto.kind, "dedicated", "auto's engine");
          assert(/threads build/.test(choice.auto.note), `the note: ${choice.auto.note}`);
        } else assertEq(choice.auto.kind, "shared", "auto's engine on one core");
      } finally {
        await context.close();
      }
    });
  } finally {
    server.closeAllConnections?.();
    await new Promise((r) => server.close(r));
  }
}
