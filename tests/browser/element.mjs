// Browser tests for <next-token>'s views and host-page contract: lazy loading (no model request
// before the element is on screen), keyboard-only use of the explorer (tokens, branch buttons,
// sliders) with ARIA labels, the beam and score views on the lesson tables, the nt-* events, and
// screenshots of every view at desktop and phone (390 px) width, light and dark.

import path from "node:path";
import { serve } from "./serve.mjs";

/** A new page showing `body` (served at base/t/element.html, scripts and models from base). */
async function pageWith(browser, base, body, { width = 1280, height = 900, colorScheme = "light" } = {}) {
  const page = await browser.newPage({ viewport: { width, height }, colorScheme });
  const html = `<!doctype html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1"><title>element test</title>
    <script type="module" src="/next-token.js"></script></head><body style="margin: 8px">${body}</body></html>`;
  await page.route(`${base}/t/element.html`, (r) => r.fulfill({ contentType: "text/html", body: html }));
  // Every nt-* event that reaches the document (they bubble, composed), with what tests check.
  await page.addInitScript(() => {
    window.__events = [];
    for (const type of ["nt-load", "nt-token", "nt-done", "nt-error"]) {
      document.addEventListener(type, (e) => {
        const d = e.detail || {};
        window.__events.push({
          type,
          id: e.target.id,
          bubbles: e.bubbles,
          composed: e.composed,
          kind: d.kind,
          text: d.text,
          prob: d.prob,
          probability: d.probability,
          view: d.view,
          message: d.message,
          reusedTokens: d.reusedTokens,
          branch: !!d.branch,
          scores: d.scores,
        });
      });
    }
  });
  await page.goto(`${base}/t/element.html`);
  return { page };
}

const events = (page, filter = {}) =>
  page.evaluate((f) => window.__events.filter((e) => Object.entries(f).every(([k, v]) => e[k] === v)), filter);
const waitEvent = (page, type, id, n = 1, timeout = 30_000) =>
  page.waitForFunction(
    ([type, id, n]) => window.__events.filter((e) => e.type === type && e.id === id).length >= n,
    [type, id, n],
    { timeout },
  );

/** A description of the focused control inside an element's shadow root. */
const focused = (page) =>
  page.evaluate(() => {
    const a = document.activeElement?.shadowRoot?.activeElement;
    if (!a) return null;
    if (a.dataset.key) return `slider:${a.dataset.key}`;
    if (a.dataset.i !== undefined) return `tok${a.dataset.i}`;
    return a.className.split(" ")[0] || a.tagName.toLowerCase();
  });

export async function elementTests(t) {
  const { test, assert, assertEq, browser, base, mode, outDir, www } = t;
  if (mode !== "cpu") return; // table models: nothing here depends on the backend

  await test(`[${mode}] <next-token> is lazy: no model request before it is scrolled into view (eager loads at once); nt-load, nt-token, nt-done and nt-error bubble out with their details`, async () => {
    // The server's own log: the page's shared engine (it is not cross-origin isolated) fetches
    // from a SharedWorker, whose requests the page's events do not show.
    const requests = [];
    const server = await serve(
      www,
      0,
      {},
      { handler: (req) => void requests.push(new URL(req.url, "http://x").pathname) },
    );
    const { page } = await pageWith(
      browser,
      `http://127.0.0.1:${server.address().port}`,
      `<next-token id="bad" model="/models/no-such-model.json" eager></next-token>
       <next-token id="eager" model="/models/lesson-beam.json" eager></next-token>
       <div style="height: 3000px"></div>
       <next-token id="lazy" model="/models/lesson-toy.json" prompt="" temperature="0" max-tokens="8" show-probabilities autorun></next-token>`,
    );
    try {
      await waitEvent(page, "nt-load", "eager");
      await waitEvent(page, "nt-error", "bad");
      await page.waitForTimeout(800);
      assert(requests.includes("/models/lesson-beam.json"), "the eager element's model was not requested at once");
      assert(
        !requests.includes("/models/lesson-toy.json"),
        `the lazy element's model was requested before it was on screen: ${requests.join(" ")}`,
      );
      assertEq((await events(page, { id: "lazy" })).length, 0, "events from the lazy element before it loaded");
      const status = await page.locator("#lazy .status").textContent();
      assert(/on screen/.test(status), `the lazy element's status: ${status}`);
      await page.locator("#lazy").scrollIntoViewIfNeeded();
      await waitEvent(page, "nt-done", "lazy");
      assertEq(
        requests.filter((r) => r === "/models/lesson-toy.json").length,
        1,
        "the lazy model requested once, after scrolling",
      );
      const [load] = await events(page, { type: "nt-load", id: "lazy" });
      assertEq(load.kind, "table", "nt-load detail: the model info");
      const tokens = await events(page, { type: "nt-token", id: "lazy" });
      assertEq(tokens.map((e) => e.text).join(""), "the cat sat", "nt-token details: the tokens");
      assertEq(
        tokens.map((e) => e.prob.toFixed(2)).join(" "),
        "1.00 0.60 0.70 1.00",
        "nt-token details: their probabilities",
      );
      const [done] = await events(page, { type: "nt-done", id: "lazy" });
      assert(
        Math.abs(done.probability - 0.42) < 1e-6 && done.view === "generate" && done.text.trim() === "the cat sat",
        `nt-done detail: ${JSON.stringify(done)}`,
      );
      const [err] = await events(page, { type: "nt-error", id: "bad" });
      assert(/no-such-model/.test(err.message), `nt-error detail: ${JSON.stringify(err)}`);
      const all = await events(page);
      assert(
        all.every((e) => e.bubbles && e.composed),
        "every nt-* event bubbles and is composed",
      );
    } finally {
      await page.close();
      server.closeAllConnections?.();
      await new Promise((r) => server.close(r));
    }
  });

  await test(`[${mode}] <next-token view="explore"> by keyboard only: Tab reaches every control (run, tokens, branch buttons, sliders), Enter inspects a token, arrow keys move the sliders, Space runs a branch that reuses the KV cache`, async () => {
    const { page } = await pageWith(
      browser,
      base,
      `<next-token id="x" view="explore" model="/models/lesson-toy.json" prompt="" temperature="0" max-tokens="8" show-probabilities eager></next-token>`,
    );
    try {
      await waitEvent(page, "nt-load", "x");
      const reached = new Set();
      const tab = async (shift = false) => {
        await page.keyboard.press(shift ? "Shift+Tab" : "Tab");
        const f = await focused(page);
        if (f) reached.add(f);
        return f;
      };
      const tabTo = async (want, max = 20) => {
        for (let k = 0; k < max; k++) if ((await tab()) === want) return;
        throw new Error(`Tab never reached ${want}; reached ${[...reached].join(", ")}`);
      };
      await tabTo("run");
      await page.keyboard.press("Enter");
      await waitEvent(page, "nt-done", "x");
      assertEq((await page.locator("#x .gen").textContent()).trim(), "the cat sat", "greedy output");
      // The tokens: role=button with the probability in their label.
      const labels = await page
        .locator("#x .gen .tok")
        .evaluateAll((s) => s.map((x) => `${x.getAttribute("role")} ${x.getAttribute("aria-label")}`));
      assert(
        labels.length === 4 && labels.every((l) => l.startsWith("button token")),
        `token labels: ${JSON.stringify(labels)}`,
      );
      assert(/" cat", probability 0\.60/.test(labels[1]), `label of "cat": ${labels[1]}`);
      await tabTo("tok1");
      await page.keyboard.press("Enter");
      await page.locator("#x .sampler-view li").first().waitFor();
      // Onwards from the token: the rest of the tokens, the branch button, the four sliders.
      await tabTo("slider:minP");
      const controls = await page.evaluate(() =>
        [...document.querySelector("#x").shadowRoot.querySelectorAll("button, input, [tabindex='0']")]
          .filter((c) => !c.disabled && c.offsetParent !== null)
          .map((a) =>
            a.dataset.key
              ? `slider:${a.dataset.key}`
              : a.dataset.i !== undefined
                ? `tok${a.dataset.i}`
                : a.className.split(" ")[0],
          ),
      );
      assertEq(
        JSON.stringify(controls.filter((c) => !reached.has(c))),
        "[]",
        `controls Tab did not reach (reached ${[...reached].join(", ")})`,
      );
      for (const c of [
        "run",
        "tok0",
        "tok1",
        "tok2",
        "tok3",
        "branch",
        "slider:temperature",
        "slider:topK",
        "slider:topP",
        "slider:minP",
      ])
        assert(reached.has(c), `Tab did not reach ${c}`);
      const unlabelled = await page.evaluate(
        () =>
          [...document.querySelector("#x").shadowRoot.querySelectorAll("button, input")].filter(
            (c) => !c.getAttribute("aria-label") && !c.textContent.trim(),
          ).length,
      );
      assertEq(unlabelled, 0, "controls without a label");
      // Arrow keys on the sliders: temperature 0 → 1 keeps "cat" 0.6 and "dog" 0.4.
      const kept = () =>
        page
          .locator("#x .sampler-bars li")
          .evaluateAll((l) =>
            l.map((li) => `${li.querySelector("code").textContent}=${Number(li.dataset.kept).toFixed(2)}`).join(" "),
          );
      while ((await focused(page)) !== "slider:temperature") await tab(true);
      for (let k = 0; k < 20; k++) await page.keyboard.press("ArrowRight");
      await page.waitForTimeout(200);
      assertEq(
        await page.locator('#x input[data-key="temperature"]').inputValue(),
        "1",
        "temperature slider after 20 × ArrowRight",
      );
      assertEq(await kept(), '"cat"=0.60 "dog"=0.40', "kept at temperature 1");
      await tab();
      await page.keyboard.press("ArrowRight");
      await page.waitForTimeout(200);
      assertEq(await page.locator('#x input[data-key="topK"]').inputValue(), "1", "top-k slider after ArrowRight");
      assertEq(await kept(), '"cat"=1.00 "dog"=0.00', "kept at top-k 1");
      // Back to "continue with this" (on "dog") and Space: the branch.
      const focusedLabel = () =>
        page.evaluate(() => document.activeElement?.shadowRoot?.activeElement?.getAttribute("aria-label") || "");
      for (let k = 0; k < 20 && !((await focused(page)) === "branch" && /"dog"/.test(await focusedLabel())); k++)
        await tab(true);
      assert(/"dog" instead/.test(await focusedLabel()), `not on the branch button for "dog": ${await focusedLabel()}`);
      await page.keyboard.press("Space");
      await page.waitForFunction(() => window.__events.some((e) => e.type === "nt-done" && e.branch));
      const branched = await page.evaluate(() =>
        document.querySelector("#x").tokens.map((t) => [t.text, t.token, t.id, t.prob.toFixed(2)]),
      );
      assertEq(
        (await page.locator("#x .gen").textContent()).trim(),
        "the dog ran",
        `the branch's text (${JSON.stringify(branched)})`,
      );
      const done = (await events(page, { type: "nt-done", id: "x" })).at(-1);
      assert(done.reusedTokens >= 1, `the branch reused no KV cache: ${JSON.stringify(done)}`);
      const status = await page.locator("#x .status").textContent();
      assert(/positions reused from the KV cache/.test(status), `status after the branch: ${status}`);
      assertEq(await focused(page), "tok1", "focus after the branch (the branched token)");
    } finally {
      await page.close();
    }
  });

  const VIEWS = `<next-token id="generate" model="/models/lesson-toy.json" prompt="" temperature="0" max-tokens="8" show-probabilities eager autorun></next-token>
    <next-token id="explore" view="explore" model="/models/lesson-toy.json" prompt="" temperature="0" max-tokens="8" show-probabilities eager autorun></next-token>
    <next-token id="beam" view="beam" model="/models/lesson-beam.json" prompt="" beams="2" max-tokens="8" show-probabilities eager autorun></next-token>
    <next-token id="score" view="score" model="/models/lesson-perplexity.json" prompt="" candidates="the sun is warm </s> | the moon ate seven </s>" editable eager autorun></next-token>`;

  for (const [label, opts] of [
    ["desktop", { width: 1280, height: 900 }],
    ["phone", { width: 390, height: 844 }],
    ["phone-dark", { width: 390, height: 844, colorScheme: "dark" }],
  ]) {
    await test(`[${mode}] <next-token> views at ${label} width: beam "a bird" 0.36 beside greedy "the cat" 0.33; score perplexities 1.28 and 3.79 and the verdict; no sideways scrolling; screenshots`, async () => {
      const { page } = await pageWith(browser, base, VIEWS, opts);
      try {
        for (const id of ["generate", "explore", "beam", "score"]) await waitEvent(page, "nt-done", id);
        await page.locator("#beam .beam-greedy").waitFor();
        const best = await page.locator("#beam .beam-best").textContent();
        const greedy = await page.locator("#beam .beam-greedy").textContent();
        assert(/"a bird", P = 0\.36/.test(best), `best beam: ${best}`);
        assert(/"the cat", P = 0\.33/.test(greedy), `greedy: ${greedy}`);
        assertEq(await page.locator("#beam li.pruned").count(), 2, "pruned hypotheses");
        const ppl = await page
          .locator("#score .scored")
          .evaluateAll((d) => d.map((x) => Number(x.dataset.perplexity).toFixed(2)));
        assertEq(ppl.join(" "), "1.28 3.79", "perplexities");
        const verdict = await page.locator("#score .verdict").textContent();
        assert(
          /Most likely: "the sun is warm <\/s>"/.test(verdict) && /Length-normalised/.test(verdict),
          `verdict: ${verdict}`,
        );
        const [scoreDone] = await events(page, { type: "nt-done", id: "score" });
        assertEq(
          scoreDone.scores.map((s) => s.perplexity.toFixed(2)).join(" "),
          "1.28 3.79",
          "nt-done of the score view",
        );
        await page.locator("#explore .gen .tok").nth(1).click();
        await page.locator("#explore .sampler-view li").first().waitFor();
        await page.waitForTimeout(150);
        const width = await page.evaluate(() => document.documentElement.scrollWidth);
        assert(width <= opts.width, `the page is ${width} px wide at ${opts.width} px`);
        for (const id of ["generate", "explore", "beam", "score"])
          await page.locator(`#${id}`).screenshot({ path: path.join(outDir, `element-${id}-${label}.png`) });
      } finally {
        await page.close();
      }
    });
  }
}
