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
      // The threads build falls back to one thread where it is missing (NO_THREADS): that warning is expected.
      const unexpected = noise.filter((n) => !/threads build unavailable|pkg-threads/.test(n));
      assertEq(JSON.stringify(unexpected), "[]", "console warnings and errors");
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
