// Browser tests for recordings: <next-token replay> plays what `nexttoken generate --json` (and
// `score --json`) wrote with the native CLI on stories260K, and must show the probabilities that
// run computed: each token's P and the product, the explorer's alternatives, the score view's
// totals. A recording-only element downloads no model and no wasm; one whose model cannot load
// (a missing file, the network off) plays its recording and says why; a live element on the model gives
// the recorded probabilities; a file that is not a recording is an error that says so.

import { spawnSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";

const PROMPT = "Once upon a time";
const SCORED = ["Once upon a time there was a girl", "Once upon a time there was a dog"];

/** The CLI's JSON lines: the output, and its objects. */
function cli(bin, args) {
  const r = spawnSync(bin, [...args, "--json"], { encoding: "utf8" });
  if (r.status !== 0) throw new Error(`nexttoken ${args.join(" ")} failed: ${r.stderr}`);
  return {
    text: r.stdout,
    lines: r.stdout
      .trim()
      .split("\n")
      .map((l) => JSON.parse(l)),
  };
}

// A script element's text: "</script" inside it would end the element early.
const inline = (jsonl) => jsonl.replaceAll("</", "<\\/");

export async function replayTests(t) {
  const { test, assert, assertEq, browser, base, mode, bin, fixtures, www } = t;
  if (mode !== "cpu") return; // a recording runs no model
  const model = path.join(fixtures, "stories260K-f32.gguf");
  if (!fs.existsSync(model)) return; // run.mjs says loudly that ../shared is missing
  const common = ["--model", model, "--backend", "cpu", "--exact"];
  const story = cli(bin, ["generate", ...common, "--prompt", PROMPT, "--temperature", "0", "--max-tokens", "16"]);
  const tokens = story.lines.filter((l) => "prob" in l);
  const summary = story.lines.at(-1);
  const scores = SCORED.map((text) => cli(bin, ["score", ...common, "--text", text]));
  const dir = path.join(fixtures, "replay");
  fs.mkdirSync(dir, { recursive: true });
  fs.writeFileSync(path.join(dir, "story.jsonl"), story.text);
  fs.writeFileSync(path.join(dir, "scores.jsonl"), scores.map((s) => s.text).join(""));

  /** A page of `body` at base/t/NAME (scripts and fixtures from base); its requests and events. */
  const open = async (name, body) => {
    const context = await browser.newContext();
    const page = await context.newPage();
    const html = `<!doctype html><html lang="en"><head><meta charset="utf-8"><title>replay test</title>
      <script type="module" src="/next-token.js"></script></head><body>${body}</body></html>`;
    await page.route(`${base}/t/${name}`, (r) => r.fulfill({ contentType: "text/html", body: html }));
    await page.addInitScript(() => {
      window.__events = [];
      for (const type of ["nt-load", "nt-token", "nt-done", "nt-error"])
        document.addEventListener(type, (e) => window.__events.push({ type, id: e.target.id, detail: e.detail }));
    });
    const requests = [];
    page.on("request", (r) => requests.push(new URL(r.url()).pathname));
    await page.goto(`${base}/t/${name}`);
    return { context, page, requests };
  };
  const done = (page, ids, timeout = 60_000) =>
    page.waitForFunction(
      (ids) => ids.every((id) => window.__events.some((e) => e.type === "nt-done" && e.id === id)),
      ids,
      { timeout },
    );
  /** What element `id` shows: its text, each token's P label, the product, the recording note. */
  const shown = (page, id) =>
    page.evaluate((id) => {
      const e = document.getElementById(id);
      const $ = (s) => e.shadowRoot.querySelector(s);
      return {
        text: $(".gen").textContent,
        ps: [...$(".gen").querySelectorAll(".tok")].map((s) => s.dataset.p),
        probability: Number($(".product").dataset.probability),
        note: $(".recording").hidden ? null : $(".recording").textContent,
        source: e.dataset.source ?? null,
        error: $(".error").hidden ? "" : $(".error").textContent,
      };
    }, id);
  const close = (a, b, tol, what) => assert(Math.abs(a - b) <= tol, `${what}: ${a} vs ${b}`);
  const recordedProduct = Math.exp(tokens.reduce((s, l) => s + l.logprob, 0));

  await test(`[${mode}] <next-token replay> plays the CLI's own --json recording with no model and nothing downloaded: its text, each token's P, the product, the explorer's alternatives, the score view's log P and perplexity; a file that is not a recording is an error`, async () => {
    const { context, page, requests } = await open(
      "replay.html",
      `<next-token id="rec" replay="/test/replay/story.jsonl" view="explore" show-probabilities autorun eager></next-token>
       <next-token id="scores" replay="/test/replay/scores.jsonl" view="score" autorun eager></next-token>
       <next-token id="cont" replay="/test/replay/story.jsonl" view="score" autorun eager></next-token>
       <next-token id="bad" replay="/test/tokenizer.json" autorun eager></next-token>
       <next-token id="shipped" replay="/models/default-recording.jsonl" autorun eager></next-token>`,
    );
    try {
      await done(page, ["rec", "scores", "cont", "shipped"]);
      const shipped = fs.readFileSync(path.join(www, "models", "default-recording.jsonl"), "utf8");
      assertEq(
        (await shown(page, "shipped")).text,
        JSON.parse(shipped.trim().split("\n").at(-1)).text,
        "the lesson page's recording plays its text",
      );
      const rec = await shown(page, "rec");
      assertEq(rec.text, summary.text, "the recording's text");
      assertEq(
        rec.ps.join(" "),
        tokens.map((l) => l.prob.toFixed(2)).join(" "),
        "each token's P as the CLI computed it",
      );
      close(rec.probability, recordedProduct, 1e-12 * recordedProduct, "the product of the tokens' P");
      assertEq(rec.source, "recording", "the element says it plays a recording (data-source)");
      assert(/recording.*stories260K-f32\.gguf, greedy/.test(rec.note), `the recording note: ${rec.note}`);

      // The explorer: the second token's alternatives are the recorded ones; no branching.
      await page.evaluate(() => document.getElementById("rec").shadowRoot.querySelectorAll(".gen .tok")[1].click());
      const alts = await page.evaluate(() => {
        const d = document.getElementById("rec").shadowRoot.querySelector(".detail");
        return {
          rows: [...d.querySelectorAll(".alternatives li")].map(
            (li) => `${li.querySelector("code").textContent} ${li.querySelector(".p").textContent}`,
          ),
          branches: d.querySelectorAll("button.branch").length,
          text: d.textContent,
        };
      });
      const want = tokens[1].top.map((a) => `${JSON.stringify(a.token)} ${a.prob.toFixed(4)}`);
      assertEq(alts.rows.join(" | "), want.join(" | "), "the explorer's alternatives at step 2");
      assertEq(alts.branches, 0, "no 'continue with this' on a recording");
      assert(/need the live model/.test(alts.text), "the explorer says what needs the live model");

      const scoreView = (id) =>
        page.evaluate(
          (id) =>
            [...document.getElementById(id).shadowRoot.querySelectorAll(".scored")].map((d) => ({
              label: d.querySelector("h3").textContent,
              logprob: Number(d.dataset.logprob),
              perplexity: Number(d.dataset.perplexity),
              heat: d.querySelector(".heat").textContent,
            })),
          id,
        );
      const scored = await scoreView("scores");
      assertEq(scored.length, SCORED.length, "scored texts shown");
      scored.forEach((s, i) => {
        const want = scores[i].lines[0];
        assertEq(s.label, SCORED[i], "scored text's label");
        assertEq(s.heat, SCORED[i], "the heat map's pieces make the scored text");
        close(s.logprob, want.logprob, 1e-9, `log P of ${SCORED[i]}`);
        close(s.perplexity, want.perplexity, 1e-9, `perplexity of ${SCORED[i]}`);
      });
      const [cont] = await scoreView("cont");
      close(cont.logprob, Math.log(recordedProduct), 1e-9, "the recorded continuation's log P");
      assertEq(cont.heat, summary.text, "the recorded continuation's heat map");

      await page.waitForFunction(() => window.__events.some((e) => e.type === "nt-error" && e.id === "bad"));
      const bad = await shown(page, "bad");
      assert(/not a nexttoken recording/.test(bad.error), `the bad recording's error: ${bad.error}`);
      const downloads = requests.filter((p) => /\.(gguf|wasm)$/.test(p));
      assertEq(downloads.join(" "), "", "model or wasm requests of a page of recordings");
    } finally {
      await context.close();
    }
  });

  await test(`[${mode}] with the network off, <next-token replay> plays an inline recording, and an element whose model cannot load plays its recording and says why; a live run on the same model gives the recorded tokens and probabilities`, async () => {
    const jsonl = inline(story.text);
    const { context, page } = await open(
      "offline.html",
      `<next-token id="inline" replay show-probabilities><script type="application/json">${jsonl}</script></next-token>
       <next-token id="fallback" model="/test/no-such-model.gguf" tokenizer="/test/tokenizer.json" replay="#story" show-probabilities></next-token>
       <script type="application/json" id="story">${jsonl}</script>`,
    );
    try {
      await page.evaluate(() => customElements.whenDefined("next-token"));
      await context.setOffline(true);
      await page.evaluate(() => {
        for (const id of ["inline", "fallback"]) document.getElementById(id).run();
      });
      await done(page, ["inline", "fallback"]);
      for (const id of ["inline", "fallback"]) {
        const r = await shown(page, id);
        assertEq(r.text, summary.text, `${id}: the recorded text offline`);
        assertEq(r.ps.join(" "), tokens.map((l) => l.prob.toFixed(2)).join(" "), `${id}: each token's P`);
        assertEq(r.error, "", `${id}: no error shown`);
      }
      const note = (await shown(page, "fallback")).note;
      assert(/could not run here/.test(note), `the fallback says why it plays a recording: ${note}`);
    } finally {
      await context.close();
    }

    const live = await open(
      "live.html",
      `<next-token id="live" model="/test/stories260K-f32.gguf" tokenizer="/test/tokenizer.json" prompt="${PROMPT}" temperature="0" max-tokens="16" eager autorun></next-token>`,
    );
    try {
      await done(live.page, ["live"], 120_000);
      const got = await live.page.evaluate(() =>
        window.__events.filter((e) => e.type === "nt-token").map((e) => ({ id: e.detail.id, prob: e.detail.prob })),
      );
      assertEq(got.map((g) => g.id).join(" "), tokens.map((l) => l.id).join(" "), "the live run's tokens");
      got.forEach((g, i) =>
        close(g.prob, tokens[i].prob, 1e-4, `token ${i + 1}'s P, live (wasm) vs recorded (native)`),
      );
    } finally {
      await live.context.close();
    }
  });
}
