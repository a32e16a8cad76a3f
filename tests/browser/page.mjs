// Browser tests for the page's polish: what a new reader meets first (phone width, warnings in
// the console, field values out of range, the lessons saying what they show).

import path from "node:path";

export async function pageTests(t) {
  const { test, assert, assertEq, browser, base, mode, waitLoaded, waitState, errorText, statsOf, outDir } = t;
  if (mode !== "cpu") return; // nothing here depends on the backend

  await test(`[${mode}] phone width (390 px): no sideways scrolling on the app or the lesson; no console warnings or errors on load`, async () => {
    const page = await browser.newPage({ viewport: { width: 390, height: 844 } });
    const noise = [];
    page.on("console", (m) => ["warning", "error"].includes(m.type()) && noise.push(`${m.type()}: ${m.text()}`));
    try {
      for (const url of ["/?nosw&model=lesson-toy", "/embed.html"]) {
        await page.goto(base + url);
        if (url.startsWith("/?")) await waitLoaded(page);
        else await page.locator("#cat .product").waitFor({ state: "visible", timeout: 30_000 });
        const width = await page.evaluate(() => document.documentElement.scrollWidth);
        assert(width <= 390, `${url}: the page is ${width} px wide at 390 px`);
        await page.screenshot({
          path: path.join(outDir, `phone${url.startsWith("/?") ? "-app" : "-embed"}.png`),
          fullPage: true,
        });
      }
      // The threads build falls back to one thread where it is missing (NO_THREADS), a relaxed-simd
      // build to simd128 (NO_RELAXED): those warnings are expected.
      const unexpected = noise.filter(
        (n) => !/(threads|relaxed-simd) build unavailable|pkg-threads|pkg-relaxed/.test(n),
      );
      assertEq(JSON.stringify(unexpected), "[]", "console warnings and errors");
    } finally {
      await page.close();
    }
  });

  await test(`[${mode}] speculative decoding (prompt lookup): the same greedy and seeded text as without; tokens marked kept or rejected; the inspector and the stats say what the passes did`, async () => {
    const page = await browser.newPage();
    try {
      await page.goto(`${base}/?nosw`);
      await waitLoaded(page);
      // A prompt the default model (the KJV) continues by quoting: lookup has text to copy.
      await page.fill(
        "#prompt",
        "And God said, Let there be light: and there was light. And God saw the light, that it was good. And God said, Let there be",
      );
      await page.fill("#max-tokens", "40");
      const run = async (temperature, seed, lookup) => {
        await page.fill("#temperature", temperature);
        await page.fill("#seed", seed);
        await page.setChecked("#lookup", lookup);
        await page.click("#generate");
        await waitState(page, "ready");
        return {
          text: await page.textContent("#output-tokens"),
          kept: await page.locator("#output-tokens .tok.spec-accepted").count(),
          rejected: await page.locator("#output-tokens .tok.spec-rejected").count(),
          stats: await statsOf(page),
        };
      };
      // Sampled first, greedy last (its kept guesses are clicked below).
      for (const [temperature, seed] of [
        ["0.8", "7"],
        ["0", ""],
      ]) {
        const plain = await run(temperature, seed, false);
        const fast = await run(temperature, seed, true);
        assertEq(fast.text, plain.text, `temperature ${temperature}: the text with lookup`);
        assertEq(plain.kept + plain.rejected, 0, "no marks without lookup");
        assert(!plain.stats["speculative decoding"], "no speculation stat without lookup");
        // Greedy copies the verse, so guesses are kept. Sampled text leaves it, and lookup's
        // guesses are checked at plain steps: passes come only where one was right, so at
        // least one pass verified guesses (the same text is then no accident of passing none).
        if (temperature === "0")
          assert(fast.kept > 0, `temperature ${temperature}: no guess was kept (${JSON.stringify(fast.stats)})`);
        else
          assert(
            fast.kept + fast.rejected > 0,
            `temperature ${temperature}: no pass verified a guess (${JSON.stringify(fast.stats)})`,
          );
        assert(
          /prompt lookup: [\d.]+ tokens per forward pass; \d+ of \d+ guesses kept/.test(
            fast.stats["speculative decoding"],
          ),
          `stats: ${fast.stats["speculative decoding"]}`,
        );
      }
      await page.locator("#output-tokens .tok.spec-accepted").first().click();
      const inspector = await page.textContent("#inspect");
      assert(/speculative decoding\s*pass \d+ checked \d+ guessed tokens/.test(inspector), inspector);
      // The lesson's element with `lookup`: kept guesses underlined, the explorer says why.
      await page.goto(`${base}/embed.html`);
      await page.locator("#spec .run").click();
      await page.locator("#spec .gen .tok.spec-accepted").first().waitFor({ timeout: 60_000 });
      await page.locator("#spec .gen .tok.spec-accepted").first().click();
      const detail = await page.locator("#spec .detail .speculated").textContent();
      assert(/guessed tokens .* kept/.test(detail), detail);
    } finally {
      await page.close();
    }
  });

  await test(`[${mode}] a draft model (load(url, {draft})): the chat model with the default model guessing gives the chat model's greedy reply; a sampled run is judged by the rejection rule; draft: false turns it off; a table as draft is refused`, async () => {
    const page = await browser.newPage();
    try {
      await page.goto(`${base}/?nosw`);
      const r = await page.evaluate(async () => {
        const { NextToken } = await import("/nexttoken.js");
        const run = async (nt, opts) => {
          const ids = [];
          const outcomes = [];
          // The chat model answers a verse with (its idea of) the next one.
          const messages = [{ role: "user", content: "In the beginning God created the heaven and the earth." }];
          for await (const t of nt.reply(messages, { maxTokens: 48, ...opts })) {
            ids.push(t.id);
            if (t.speculated) outcomes.push(t.speculated.outcome);
          }
          return { ids, outcomes, speculation: nt.lastSummary.speculation ?? null };
        };
        const plain = new NextToken();
        const spec = new NextToken();
        try {
          await plain.load("chat");
          const info = await spec.load("chat", { draft: "default" });
          const greedy = [await run(plain, { temperature: 0 }), await run(spec, { temperature: 0 })];
          const sampled = await run(spec, { temperature: 0.8, seed: 11 });
          const off = await run(spec, { temperature: 0, draft: false });
          let refused = null;
          try {
            await spec.load("chat", { draft: "lesson-toy" });
          } catch (e) {
            refused = e.message;
          }
          return { greedy, sampled, off, draftParameters: info.draftParameters, refused };
        } finally {
          plain.terminate();
          spec.terminate();
        }
      });
      const [plain, fast] = r.greedy;
      assertEq(JSON.stringify(fast.ids), JSON.stringify(plain.ids), "greedy with the draft model");
      assert(
        fast.speculation?.drafter === "draft model" && fast.speculation.passes > 0,
        JSON.stringify(fast.speculation),
      );
      assert(fast.outcomes.includes("accepted"), `no guess kept: ${JSON.stringify(fast.outcomes)}`);
      assert(r.sampled.speculation?.passes > 0 && r.sampled.ids.length > 0, JSON.stringify(r.sampled.speculation));
      assertEq(r.off.speculation, null, "draft: false");
      assert(r.draftParameters > 0, `info.draftParameters: ${r.draftParameters}`);
      assert(/draft/.test(r.refused ?? ""), `a table as draft: ${r.refused}`);
    } finally {
      await page.close();
    }
  });

  await test(`[${mode}] settings out of range are refused by name; table models show words, not MB or tokens/s; the beam lesson starts empty and finds "a bird"`, async () => {
    const page = await browser.newPage();
    try {
      await page.goto(`${base}/?nosw&model=lesson-toy`);
      await waitLoaded(page);
      const stats = await statsOf(page);
      assert(
        /words/.test(stats["model size"]) && !/MB/.test(stats["model size"]),
        `model size: ${stats["model size"]}`,
      );
      for (const [id, value, name] of [
        ["#temperature", "-1", "temperature"],
        ["#top-p", "2", "top-p"],
        ["#beams", "0", "beams"],
      ]) {
        const before = await page.inputValue(id);
        await page.fill(id, value);
        await page.click("#generate");
        await waitState(page, ["ready", "error"]);
        const err = await errorText(page);
        assert(err.startsWith(`${name}:`), `${name} = ${value}: ${JSON.stringify(err)}`);
        await page.fill(id, before);
      }
      await page.click("#generate");
      await waitState(page, "ready");
      const after = await statsOf(page);
      assert(
        !after.decode && /table lookup/.test(after.speed || ""),
        `speed stats for a table: ${JSON.stringify(after)}`,
      );
      assert(/end token/.test(after.stopped || ""), `stop reason in words: ${after.stopped}`);
      // The beam lesson: the picker leaves the prompt empty; 2 beams find "a bird".
      await page.selectOption("#model-select", "lesson-beam");
      await page.click("#load");
      await waitLoaded(page);
      assertEq(await page.inputValue("#prompt"), "", "the beam lesson's prompt");
      await page.fill("#beams", "2");
      await page.fill("#temperature", "0");
      await page.click("#generate");
      await waitState(page, "ready");
      assertEq((await page.textContent("#output-tokens")).trim(), "a bird", "2 beams on the beam lesson");
    } finally {
      await page.close();
    }
  });

  await test(`[${mode}] what is picked is what runs: the perplexity lesson picked after the default loads and scores 1.28 / 3.79; beams reset to 1; a download waits for Load with Generate and Score off`, async () => {
    const page = await browser.newPage();
    try {
      await page.goto(`${base}/?nosw&model=default`);
      await waitLoaded(page);
      await page.fill("#beams", "3");
      await page.selectOption("#model-select", "lesson-perplexity");
      await page.waitForFunction(
        () => document.body.dataset.state === "ready" && /^Lesson: log P/.test(window.nexttokenApp.stats.model ?? ""),
        null,
        { timeout: 60_000 },
      );
      assertEq(await page.inputValue("#beams"), "1", "beams after a model change");
      assert(/^Loaded Lesson: log P/.test(await page.textContent("#status")), "the status names the lesson");
      await page.fill("#prompt", "");
      await page.locator("#candidates-box summary").click();
      await page.fill("#candidates", "the sun is warm </s>\nthe moon ate seven </s>");
      await page.click("#score-btn");
      await page.locator("#score-out .verdict").waitFor({ state: "visible" });
      const perplexities = await page.evaluate(() =>
        [...document.querySelectorAll("#score-out .scored")].map((d) => Number(d.dataset.perplexity).toFixed(2)),
      );
      assertEq(JSON.stringify(perplexities), JSON.stringify(["1.28", "3.79"]), "the lesson's perplexities");
      // A model that must be downloaded (none is, offline here): nothing runs on the old one meanwhile.
      await page.selectOption("#model-select", "smollm2-135m");
      await page.waitForFunction(() => document.getElementById("generate").disabled, null, { timeout: 10_000 });
      assert(await page.locator("#score-btn").isDisabled(), "Score stays on for a model that is not loaded");
      assert(/Press Load/.test(await page.textContent("#status")), `status: ${await page.textContent("#status")}`);
      // Back to the loaded lesson: on again, without loading it again.
      await page.selectOption("#model-select", "lesson-perplexity");
      await page.waitForFunction(() => !document.getElementById("generate").disabled, null, { timeout: 10_000 });
    } finally {
      await page.close();
    }
  });

  await test(`[${mode}] a long beam search on the default model stays in its box: the tree scrolls, the page neither grows by its length nor scrolls sideways`, async () => {
    const page = await browser.newPage({ viewport: { width: 1280, height: 900 } });
    try {
      await page.goto(`${base}/?nosw&model=default`);
      await waitLoaded(page);
      await page.fill("#prompt", "And the");
      await page.fill("#temperature", "0");
      await page.fill("#beams", "2");
      await page.fill("#max-tokens", "80");
      await page.click("#generate");
      await waitState(page, "ready", 120_000);
      const err = await errorText(page);
      assert(!err, `beam search failed: ${err}`);
      await page.locator("#beam-view .beam-tree").waitFor({ state: "visible" });
      const box = await page.evaluate(() => {
        const tree = document.querySelector("#beam-view .beam-tree");
        return {
          rows: tree.querySelectorAll("li").length,
          height: tree.getBoundingClientRect().height,
          scrollHeight: tree.scrollHeight,
          pageWidth: document.documentElement.scrollWidth,
          rem: parseFloat(getComputedStyle(document.documentElement).fontSize),
        };
      });
      assert(box.rows > 60 && box.scrollHeight > box.height, `a tree this long should scroll: ${JSON.stringify(box)}`);
      assert(box.height <= 32 * box.rem + 1, `the tree is ${box.height} px tall: ${JSON.stringify(box)}`);
      assert(box.pageWidth <= 1280, `the page scrolls sideways: ${JSON.stringify(box)}`);
    } finally {
      await page.close();
    }
  });

  await test(`[${mode}] layout at 1280×900 and 390×844: the output is in view after Generate, no sideways scrolling, the token/stats column beside the panels at the top (below the output on a phone)`, async () => {
    for (const [width, height] of [
      [1280, 900],
      [390, 844],
    ]) {
      const page = await browser.newPage({ viewport: { width, height } });
      try {
        await page.goto(`${base}/?nosw&model=default`);
        await waitLoaded(page);
        await page.fill("#temperature", "0");
        await page.fill("#max-tokens", "24");
        await page.click("#generate");
        await waitState(page, "ready");
        await page.waitForTimeout(600); // the smooth scroll to the output
        await page.screenshot({ path: path.join(outDir, `layout-${width}x${height}.png`) });
        const at = await page.evaluate(() => {
          const box = (id) => document.getElementById(id).getBoundingClientRect();
          const out = box("out-panel");
          const seenOut = { top: out.top, bottom: out.bottom };
          // The columns measured from the top of the page (the inspector is sticky when scrolled).
          window.scrollTo(0, 0);
          const [model, inspect, cache] = ["model-panel", "inspect-panel", "cache-panel"].map(box);
          return {
            out: seenOut,
            pageWidth: document.documentElement.scrollWidth,
            scrollY: window.scrollY,
            model: { top: model.top + window.scrollY, right: model.right },
            inspect: { top: inspect.top + window.scrollY, left: inspect.left },
            outTop: box("out-panel").top + window.scrollY,
            cacheTop: cache.top + window.scrollY,
          };
        });
        const seen = Math.min(at.out.bottom, height) - Math.max(at.out.top, 0);
        assert(seen > 80, `${width}×${height}: the output is out of view after Generate: ${JSON.stringify(at)}`);
        assert(at.pageWidth <= width, `${width}×${height}: the page is ${at.pageWidth} px wide`);
        if (width > 800) {
          assert(
            Math.abs(at.inspect.top - at.model.top) < 2,
            `the token/stats column starts at the top: ${JSON.stringify(at)}`,
          );
          assert(
            at.inspect.left > at.model.right,
            `the token/stats column is beside the panels: ${JSON.stringify(at)}`,
          );
        } else {
          assert(at.outTop < at.inspect.top && at.inspect.top < at.cacheTop, `phone order: ${JSON.stringify(at)}`);
        }
        // The lesson page's code sample shows its whole lines (it wraps; nothing hides past the edge).
        await page.goto(`${base}/embed.html`);
        const code = await page.evaluate(() => {
          const pre = document.querySelector("article pre");
          return { scroll: pre.scrollWidth, client: pre.clientWidth, right: pre.getBoundingClientRect().right };
        });
        assert(
          code.scroll <= code.client && code.right <= width,
          `${width}: embed.html's code sample: ${JSON.stringify(code)}`,
        );
      } finally {
        await page.close();
      }
    }
  });

  await test(`[${mode}] an empty seed draws anew each Generate (the stats show the seed drawn); a seed, or the seed shown, reproduces the text`, async () => {
    const page = await browser.newPage();
    try {
      await page.goto(`${base}/?nosw&model=default`);
      await waitLoaded(page);
      assertEq(await page.inputValue("#seed"), "", "the seed field starts empty");
      await page.fill("#temperature", "1");
      await page.fill("#max-tokens", "24");
      await page.fill("#prompt", "And the");
      const run = async () => {
        await page.click("#generate");
        await waitState(page, "ready");
        const err = await errorText(page);
        assert(!err, `generation failed: ${err}`);
        return { text: await page.textContent("#output-tokens"), seed: (await statsOf(page)).seed };
      };
      const a = await run();
      const b = await run();
      assert(/^\d+$/.test(a.seed ?? "") && /^\d+$/.test(b.seed ?? ""), `seeds in the stats: ${a.seed}, ${b.seed}`);
      assert(
        a.seed !== b.seed && a.text !== b.text,
        `two runs without a seed gave the same: ${JSON.stringify([a, b])}`,
      );
      await page.fill("#seed", a.seed);
      const again = await run();
      assertEq(again.text, a.text, "the seed a run drew, typed in, gives its text again");
      await page.fill("#seed", "7");
      const [c, d] = [await run(), await run()];
      assertEq(c.text, d.text, "seed 7 twice");
      assertEq(c.seed, "7", "the stats' seed");
    } finally {
      await page.close();
    }
  });

  await test(`[${mode}] the sampling lesson draws anew each run (no fixed seed)`, async () => {
    const page = await browser.newPage();
    try {
      await page.goto(`${base}/embed.html`);
      const el = page.locator('next-token[temperature="1"]').first();
      const seen = new Set();
      for (let i = 0; i < 10 && seen.size < 2; i++) {
        await el.locator(".run").click();
        await el.locator(".product").waitFor({ state: "visible", timeout: 30_000 });
        seen.add((await el.locator(".gen").textContent()).trim());
        await el.locator(".run").waitFor({ state: "visible" });
        await page.waitForFunction((e) => !e.shadowRoot.querySelector(".run").disabled, await el.elementHandle());
      }
      assert(seen.size >= 2, `10 runs at temperature 1 all gave ${JSON.stringify([...seen])}`);
    } finally {
      await page.close();
    }
  });
}
