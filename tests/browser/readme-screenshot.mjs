// The README's picture of the page (not part of the suite): the default model's continuation of
// "In the beginning" with one token inspected. After `./build.sh`:
//   cd tests/browser && node readme-screenshot.mjs ../../docs/img/page.png
import { chromium } from "playwright-core";
import { serve } from "./serve.mjs";

const out = process.argv[2] ?? "page.png";
const server = await serve("../../www", 0);
const browser = await chromium.launch({ executablePath: "/usr/bin/chromium", headless: true });
try {
  const page = await browser.newPage({ viewport: { width: 1200, height: 1000 } });
  await page.goto(`http://127.0.0.1:${server.address().port}/?nosw`);
  await page.waitForFunction(() => /Loaded/.test(document.querySelector("#status").innerText), null, {
    timeout: 60000,
  });
  await page.fill("#prompt", "In the beginning");
  await page.fill("#max-tokens", "40");
  await page.fill("#seed", "7");
  await page.click("#generate");
  await page.waitForFunction(
    () =>
      !document.querySelector("#generate").disabled && document.querySelectorAll("#output-tokens .tok").length >= 40,
    null,
    { timeout: 60000 },
  );
  await page.evaluate(() => {
    document.querySelector("#settings").open = false;
  });
  await page.click('#output-tokens .tok[data-i="5"]');
  await page.evaluate(() => window.scrollTo(0, 0));
  const bottom = await page.evaluate(
    () => document.querySelector("#out-panel").getBoundingClientRect().bottom + window.scrollY,
  );
  await page.screenshot({
    path: out,
    fullPage: true,
    clip: { x: 0, y: 0, width: 1200, height: Math.ceil(bottom + 16) },
  });
  console.log(`wrote ${out}`);
} finally {
  await browser.close();
  server.close();
}
