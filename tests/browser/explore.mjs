import path from "node:path";

/** Screenshots of the page as it is now, at desktop and phone width (in outDir). */
async function screenshots(page, outDir, name) {
  if (!outDir) return;
  const size = page.viewportSize();
  await page.screenshot({ path: path.join(outDir, `${name}-desktop.png`), fullPage: true });
  await page.setViewportSize({ width: 390, height: 844 });
  const width = await page.evaluate(() => document.documentElement.scrollWidth);
  await page.screenshot({ path: path.join(outDir, `${name}-phone.png`), fullPage: true });
  await page.setViewportSize(size);
  if (width > 390) throw new Error(`${name}: ${width} px wide at phone width`);
}

// Browser tests for the explorer: branch from any token (the KV cache of the shared prefix is
// reused; the branch equals a fresh generation from the branched prefix), the branch tree and the
// side-by-side comparison.

export async function exploreTests(t) {
  const { test, assert, assertEq, page, base, mode, waitLoaded, waitState, errorText, statsOf, haveDefaultModel } = t;
  if (!haveDefaultModel) return;

  await test(`[${mode}] branch from a token: only the suffix runs, the branch equals a fresh generation from the branched prefix; branches form a tree and compare side by side`, async () => {
    const N = 16;
    const at = 5; // branch at the 6th generated token
    await page.goto(`${base}/?nosw&model=default&prompt=${encodeURIComponent("In the beginning")}`);
    await waitLoaded(page);
    await page.fill("#temperature", "0");
    await page.fill("#max-tokens", String(N));
    await page.fill("#beams", "1");
    await page.click("#generate");
    await waitState(page, "ready", 120_000);
    const main = await page.evaluate(() =>
      window.nexttokenApp.tokens.map((t) => ({ id: t.id, top: t.top.map((a) => a.id), logprob: t.logprob })),
    );
    const promptIds = await page.evaluate(() => window.nexttokenApp.branches[0].promptIds);
    // The inspector of token `at`: continue with its second most likely token.
    await page.click(`#output-tokens .tok[data-i="${at}"]`);
    const alt = main[at].top.find((id) => id !== main[at].id);
    const buttons = page.locator("#inspect .alternatives li:not(.chosen) button.branch");
    assert((await buttons.count()) >= 1, "no branch buttons in the inspector");
    const altIndex = main[at].top.filter((id) => id !== main[at].id).indexOf(alt);
    await buttons.nth(altIndex).click();
    await waitState(page, "ready", 120_000);
    const err = await errorText(page);
    assert(!err, `branch failed: ${err}`);
    const branch = await page.evaluate(() =>
      window.nexttokenApp.tokens.map((t) => ({ id: t.id, logprob: t.logprob, logprobSum: t.logprobSum })),
    );
    assertEq(
      JSON.stringify(branch.slice(0, at).map((x) => x.id)),
      JSON.stringify(main.slice(0, at).map((x) => x.id)),
      "the shared prefix",
    );
    assertEq(branch[at].id, alt, "the chosen token");
    // The inspector follows the text: it now describes the token the branch put there, numbered
    // as the branch label numbers it.
    const inspected = await page.evaluate(() =>
      Object.fromEntries(
        [...document.querySelectorAll("#inspect dl.stats dt")].map((dt) => [
          dt.textContent,
          dt.nextSibling.textContent,
        ]),
      ),
    );
    assertEq(inspected.id, String(alt), "the inspector after the branch");
    assert(inspected["output token"]?.startsWith(`${at + 1} of`), `inspector numbering: ${JSON.stringify(inspected)}`);
    // KV reuse: all of the branched prompt but its last position came from the cache.
    const stats = await statsOf(page);
    const reused = /reused (\d+) of (\d+)/.exec(stats["KV cache"]).slice(1).map(Number);
    assertEq(reused[1], promptIds.length + at, "the branch's prompt (prompt + shared tokens)");
    assertEq(reused[0], promptIds.length + at - 1, "positions reused from the KV cache");
    // A fresh engine, from the branched prefix with the chosen token in it.
    const fresh = await page.evaluate(
      async ({ ids, n }) => {
        const { NextToken } = await import("/nexttoken.js");
        const nt = new NextToken();
        try {
          await nt.load("default");
          const out = [];
          for await (const t of nt.generate({ ids }, { temperature: 0, maxTokens: n })) out.push(t.id);
          return out;
        } finally {
          nt.terminate();
        }
      },
      { ids: [...promptIds, ...main.slice(0, at).map((x) => x.id), alt], n: N - 1 },
    );
    assertEq(
      JSON.stringify(branch.slice(at + 1).map((x) => x.id)),
      JSON.stringify(fresh),
      "the branch after the chosen token vs a fresh generation",
    );
    // The chain rule over the branch: log P is the sum of its tokens' log-probabilities.
    const sum = branch.reduce((a, x) => a + x.logprob, 0);
    assert(Math.abs(branch.at(-1).logprobSum - sum) < 1e-6, `log P ${branch.at(-1).logprobSum} vs ${sum}`);
    // The tree: two entries; back to the generation and forth; compare both.
    assertEq(await page.locator("#branches button.show").count(), 2, "branches listed");
    await page.locator("#branches button.show").nth(0).click();
    assertEq(await page.evaluate(() => window.nexttokenApp.tokens.length), main.length, "the generation shown again");
    await page.locator("#branches input.compare-pick").nth(0).check();
    await page.locator("#branches input.compare-pick").nth(1).check();
    const columns = await page.locator("#branches .compare > div").count();
    assertEq(columns, 2, "compared side by side");
    const notes = await page.locator("#branches .compare .note").allTextContents();
    assert(
      notes.every((n) => /log P -?\d+\.\d{3}, perplexity \d/.test(n)),
      `comparison: ${notes}`,
    );
    await screenshots(page, t.outDir, `view-branches-${mode}`);
  });
}

/** The sampler view on the lesson table, against hand computations (P(cat | the) = 0.6, P(dog | the) = 0.4). */
export async function samplerViewTests(t) {
  const { test, assert, assertEq, page, base, mode, waitLoaded, waitState } = t;
  await test(`[${mode}] sampler view: sliders re-render what the sampler keeps from the stored logits, as computed by hand`, async () => {
    await page.goto(`${base}/?nosw&model=lesson-toy&prompt=`);
    await waitLoaded(page);
    await page.fill("#temperature", "0");
    await page.fill("#max-tokens", "8");
    await page.fill("#beams", "1");
    await page.click("#generate");
    await waitState(page, "ready");
    await page.click('#output-tokens .tok[data-i="1"]'); // "cat", after "the"
    const view = page.locator(".sampler-view");
    await view.waitFor({ state: "visible" });
    const requests = [];
    page.on("request", (r) => requests.push(r.url()));
    const kept = async () => {
      await page.waitForTimeout(150);
      return page.evaluate(() =>
        Object.fromEntries(
          [...document.querySelectorAll(".sampler-bars li")].map((li) => [
            li.querySelector("code").textContent,
            Number(li.dataset.kept),
          ]),
        ),
      );
    };
    const set = async (values) => {
      for (const [key, value] of Object.entries(values))
        await view.locator(`input[data-key="${key}"]`).fill(String(value));
    };
    const close = (got, want, what) => {
      for (const [k, v] of Object.entries(want))
        assert(Math.abs((got[k] ?? -1) - v) < 1e-4, `${what}: ${JSON.stringify(got)} vs ${JSON.stringify(want)}`);
    };
    await set({ temperature: 1, topK: 0, topP: 1, minP: 0, repeatPenalty: 1 });
    close(await kept(), { '"cat"': 0.6, '"dog"': 0.4 }, "temperature 1");
    await set({ temperature: 0.5 });
    close(await kept(), { '"cat"': 0.36 / 0.52, '"dog"': 0.16 / 0.52 }, "temperature 0.5");
    await set({ temperature: 1, topK: 1 });
    close(await kept(), { '"cat"': 1, '"dog"': 0 }, "top-k 1");
    await set({ topK: 0, topP: 0.5 });
    close(await kept(), { '"cat"': 1, '"dog"': 0 }, "top-p 0.5");
    await set({ topP: 1, minP: 0.7 });
    close(await kept(), { '"cat"': 1, '"dog"': 0 }, "min-p 0.7 (0.4 < 0.42)");
    await set({ minP: 0, temperature: 0 });
    close(await kept(), { '"cat"': 1, '"dog"': 0 }, "temperature 0 (greedy)");
    assertEq(
      JSON.stringify(requests.filter((u) => /\.json|\.gguf/.test(u))),
      "[]",
      "the model was fetched or run again",
    );
    await screenshots(page, t.outDir, `view-sampler-${mode}`);
  });
}

/** The score view on the perplexity lesson: the seed's numbers, candidates compared. */
export async function scoreViewTests(t) {
  const { test, assert, assertEq, page, base, mode, waitLoaded } = t;
  await test(`[${mode}] score view: candidates after a prompt, surprisal heat map, the seed's perplexities 1.28 / 3.79 and 400 tokens at P = 0.1 → log P -921.0`, async () => {
    await page.goto(`${base}/?nosw&model=lesson-perplexity&prompt=`);
    await waitLoaded(page);
    await page.locator("#candidates-box summary").click();
    await page.fill("#candidates", "the sun is warm </s>\nthe moon ate seven </s>");
    await page.click("#score-btn");
    await page.locator("#score-out .verdict").waitFor({ state: "visible" });
    const scored = await page.evaluate(() =>
      [...document.querySelectorAll("#score-out .scored")].map((d) => ({
        ...d.dataset,
        heat: d.querySelectorAll(".heat .tok").length,
        words: d.querySelector(".heat").textContent,
      })),
    );
    assertEq(scored.length, 2, "candidates scored");
    assertEq(Number(scored[0].perplexity).toFixed(2), "1.28", "perplexity of the confident sentence");
    assertEq(Number(scored[1].perplexity).toFixed(2), "3.79", "perplexity of the confused sentence");
    assertEq(scored[0].heat, 5, "heat map tokens");
    // The heat map reads as the text (the table's words with their spaces, not "thesuniswarm</s>").
    assertEq(scored[0].words.trim(), "the sun is warm </s>", "the heat map's text");
    const verdict = await page.textContent("#score-out .verdict");
    assert(/Most likely: "the sun is warm <\/s>"/.test(verdict), `verdict: ${verdict}`);
    // A typed candidate continues the prompt as generation would have: a word after a word gets its space.
    const joins = await page.evaluate(async () => {
      const { continuationText } = await import("/views.js");
      return [
        ["The capital of France is", "Paris"],
        ["Once upon a time", ", there"],
        ["Hello ", "world"],
        ["", "the"],
        ["日本", "語"],
        ["x", " y"],
      ].map(([p, c]) => continuationText(p, c));
    });
    assertEq(
      JSON.stringify(joins),
      JSON.stringify([" Paris", ", there", "world", "the", "語", " y"]),
      "candidate joins",
    );
    // 400 digits after "digits": log P = 400 ln 0.1, with no underflow (the candidate typed without its space).
    await page.fill("#prompt", "digits");
    await page.fill("#candidates", "7 ".repeat(400).trim());
    await page.click("#score-btn");
    await page.waitForFunction(() => document.querySelectorAll("#score-out .scored").length === 1);
    const long = await page.evaluate(() => ({ ...document.querySelector("#score-out .scored").dataset }));
    assertEq(Number(long.logprob).toFixed(1), "-921.0", "log P of 400 tokens at P = 0.1");
    assertEq(Number(long.perplexity).toFixed(1), "10.0", "their perplexity");
    await screenshots(page, t.outDir, `view-score-${mode}`);
  });
}

/** The beam search view on the beam lesson: the seed's "the cat" (0.33) vs "a bird" (0.36). */
export async function beamViewTests(t) {
  const { test, assert, assertEq, page, base, mode, waitLoaded, waitState } = t;
  await test(`[${mode}] beam view: the search as a tree (pruned greyed), the best beam "a bird" 0.36 beside greedy's "the cat" 0.33`, async () => {
    await page.goto(`${base}/?nosw&model=lesson-beam`);
    await waitLoaded(page);
    await page.fill("#temperature", "0");
    await page.fill("#beams", "2");
    await page.click("#generate");
    await waitState(page, "ready");
    await page.locator("#beam-view .beam-greedy").waitFor({ state: "visible" });
    const view = await page.evaluate(() => ({
      best: document.querySelector("#beam-view .beam-best").textContent,
      greedy: document.querySelector("#beam-view .beam-greedy").textContent,
      pruned: [...document.querySelectorAll("#beam-view li.pruned")].map((li) => li.firstChild.textContent),
      bestPath: [...document.querySelectorAll("#beam-view li.best")].map((li) => li.firstChild.textContent),
    }));
    assert(/"a bird", P = 0\.36/.test(view.best), `best beam: ${view.best}`);
    assert(/"the cat", P = 0\.33/.test(view.greedy), `greedy: ${view.greedy}`);
    assertEq(view.pruned.length, 2, `pruned: ${JSON.stringify(view.pruned)}`);
    assert(
      view.pruned.some((p) => /"dog"\s+P = 0\.27/.test(p)) && view.pruned.some((p) => /"fish"\s+P = 0\.04/.test(p)),
      `pruned: ${JSON.stringify(view.pruned)}`,
    );
    assertEq(view.bestPath.length, 3, `best path: ${JSON.stringify(view.bestPath)}`);
    await screenshots(page, t.outDir, `view-beam-${mode}`);
  });
}
