// The remote engine (www/remote.js) against a real llama.cpp server: llama-cpp-python's
// OpenAI-compatible server (llama.cpp underneath), started here on the loopback address, serving
// stories260K. Never a mock: the page's NextToken talks to the server across origins (CORS) and
// its tokens are compared with the local engine's (the wasm CPU path, exact kernels) on the same
// file and greedy settings: the same text, each token's logprob and its best alternative within
// 2e-3 (f32 weights on both sides; a greedy pick may differ only where the local engine's two best
// tokens are that close), and the same stop reasons (max tokens, end of text, a stop string).
// Also: chat through the model's own template (a stories260K copy with one), scoring by the
// server's echoed logprobs, abort, structured output passed through, the OpenAI API, the
// <next-token> element, and a preflight that refuses a model offering the remote route.
//
//   node tests/browser/remote.mjs     (after ./build.sh and tools/llama_server.sh)
//
// Environment: LLAMA_SERVER_PYTHON (default target/llama-cpp-python/bin/python, which
// tools/llama_server.sh makes), CHROMIUM. Closing line: "N passed, N failed".

import { spawn, spawnSync } from "node:child_process";
import fs from "node:fs";
import net from "node:net";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { appOutcome, assert, assertEq, outDir, repo, runner, setGreedy, www } from "./harness.mjs";

const here = path.dirname(fileURLToPath(import.meta.url));
const { test, finish } = runner("remote");
const python = process.env.LLAMA_SERVER_PYTHON || path.join(repo, "target/llama-cpp-python/bin/python");
const stories = path.resolve(repo, "../shared/models/stories260K/stories260K-f32.gguf");
for (const [what, file, fix] of [
  ["llama-cpp-python", python, "run tools/llama_server.sh"],
  ["stories260K", stories, "../shared is missing"],
]) {
  if (!fs.existsSync(file)) {
    console.log(`no ${what} at ${file} (${fix})\n0 passed, 1 failed`);
    process.exit(1);
  }
}
if (!fs.existsSync(path.join(here, "node_modules", "playwright-core"))) {
  const r = spawnSync("npm", ["install", "--no-audit", "--no-fund", "--loglevel=error"], {
    cwd: here,
    stdio: "inherit",
  });
  if (r.status !== 0) process.exit(1);
}
const { chromium } = await import("playwright-core");
const { serve } = await import("./serve.mjs");
const { ggufWithout } = await import("./gguf.mjs");

// The chat model: stories260K with a chat template (BOS in the template, so both engines read the
// same tokens: llama-cpp-python adds none of its own to a rendered chat), and BOS as its end of
// text too: greedy stories260K never writes EOS but starts its next story with BOS, so there both
// engines meet an end of text within a few hundred tokens.
const TEMPLATE =
  "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
const fixtures = path.join(outDir, "remote");
fs.mkdirSync(fixtures, { recursive: true });
fs.copyFileSync(stories, path.join(fixtures, "stories.gguf"));
fs.writeFileSync(
  path.join(fixtures, "storychat.gguf"),
  ggufWithout(fs.readFileSync(stories), () => false, {
    "tokenizer.chat_template": TEMPLATE,
    "tokenizer.ggml.eos_token_id": 1,
  }),
);

// A page served from the loopback address: Chromium lets only such a page (not one Playwright
// fulfils, which has no address) fetch from the loopback server (Local Network Access).
fs.writeFileSync(
  path.join(fixtures, "remote.html"),
  `<!doctype html><html lang="en"><head><meta charset="utf-8"><title>remote test</title>
  <script type="module" src="/next-token.js"></script></head><body></body></html>`,
);

const freePort = () =>
  new Promise((resolve) => {
    const s = net.createServer().listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });

/** llama-cpp-python's server on `file`, as model `alias`; resolves once /v1/models answers. */
async function llamaServer(file, alias) {
  const port = await freePort();
  const log = [];
  const child = spawn(
    python,
    [
      "-m",
      "llama_cpp.server",
      "--model",
      file,
      "--model_alias",
      alias,
      "--host",
      "127.0.0.1",
      "--port",
      String(port),
      "--n_ctx",
      "512",
      // Logits of every position: the prompt's logprobs (echo) that scoring needs.
      "--logits_all",
      "true",
      "--n_threads",
      "1",
      // An f32 KV cache (ggml type 0) as the local engine's exact path keeps; llama.cpp's default
      // f16 moves logprobs by up to 1e-2.
      "--type_k",
      "0",
      "--type_v",
      "0",
    ],
    { stdio: ["ignore", "pipe", "pipe"] },
  );
  child.stdout.on("data", (d) => log.push(String(d)));
  child.stderr.on("data", (d) => log.push(String(d)));
  const url = `http://127.0.0.1:${port}/v1`;
  for (let i = 0; i < 240; i++) {
    if (child.exitCode !== null) throw new Error(`llama-cpp-python exited: ${log.join("").slice(-2000)}`);
    try {
      if ((await fetch(`${url}/models`)).ok) return { url, child, log };
    } catch {}
    await new Promise((r) => setTimeout(r, 250));
  }
  child.kill();
  throw new Error(`llama-cpp-python did not start in 60 s: ${log.join("").slice(-2000)}`);
}

const plain = await llamaServer(path.join(fixtures, "stories.gguf"), "stories260K");
const chat = await llamaServer(path.join(fixtures, "storychat.gguf"), "storychat");
const server = await serve(www, 0, { "/test/": fixtures }, {});
const base = `http://127.0.0.1:${server.address().port}`;
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox"],
});
const context = await browser.newContext();
const page = await context.newPage();
const consoleLines = [];
page.on("console", (m) => consoleLines.push(`${m.type()}: ${m.text()}`));
await page.goto(`${base}/test/remote.html`);

const REMOTE = `openai+${plain.url}#stories260K`;
const REMOTE_CHAT = `openai+${chat.url}#storychat`;
const TOL = 2e-3;

/**
 * In the page: one run on a local engine (`local`: a model URL, exact kernels) and on the remote
 * one, each `{tokens, summary, error}`; `kind` "generate" | "reply" | "score".
 */
async function both(kind, input, options, local, remote) {
  return page.evaluate(
    async ({ kind, input, options, local, remote }) => {
      const { NextToken } = await import("/nexttoken.js");
      const run = async (model, loadOptions) => {
        const nt = new NextToken({ engine: "dedicated" });
        try {
          const info = await nt.load(model, loadOptions);
          if (kind === "score") return { info, score: await nt.score(input, options) };
          const tokens = [];
          for await (const t of kind === "reply" ? nt.reply(input, options) : nt.generate(input, options))
            tokens.push(t);
          return { info, tokens, summary: nt.lastSummary };
        } catch (e) {
          return { error: e.message };
        } finally {
          nt.terminate();
        }
      };
      return {
        local: await run(local, { backend: "cpu", exact: true }),
        remote: await run(remote),
      };
    },
    { kind, input, options, local, remote },
  );
}

/** A SentencePiece token as text, as servers send it: "▁" a space, "<0x0A>" its byte. */
const spelled = (token) =>
  token.replaceAll("▁", " ").replace(/^<0x([0-9A-F]{2})>$/, (_, hex) => String.fromCharCode(Number.parseInt(hex, 16)));

/**
 * The remote tokens agree with the local ones: the same text token by token, logprobs and best
 * alternative within TOL, until a near tie (the local engine's two best within TOL) where the
 * two engines may pick differently; returns how many tokens were compared.
 */
function assertAgree(local, remote, what) {
  assert(!local.error && !remote.error, `${what}: ${local.error || remote.error}`);
  let i = 0;
  for (; i < Math.min(local.tokens.length, remote.tokens.length); i++) {
    const [l, r] = [local.tokens[i], remote.tokens[i]];
    if (l.text !== r.text) {
      const gap = l.top[0].logprob - (l.top[1]?.logprob ?? -Infinity);
      assert(gap < TOL, `${what}: token ${i}: local ${JSON.stringify(l.text)}, remote ${JSON.stringify(r.text)}`);
      return i;
    }
    assert(Math.abs(l.logprob - r.logprob) < TOL, `${what}: token ${i} logprob ${l.logprob} vs ${r.logprob}`);
    assertEq(r.top[0].piece, spelled(l.top[0].token), `${what}: token ${i}'s best alternative`);
    assert(
      Math.abs(l.top[1].logprob - r.top[1].logprob) < TOL,
      `${what}: token ${i}: second alternative: ${JSON.stringify([l.top.slice(0, 3), r.top.slice(0, 3)])}`,
    );
    assert(Math.abs(l.perplexity - r.perplexity) < 1e-2, `${what}: token ${i}'s running perplexity`);
  }
  // The local engine's last event at an end of text is the end token (its probability is part of
  // P(x)); servers stream none for it.
  const end = local.summary.stopReason === "Eos" ? 1 : 0;
  if (end) assertEq(local.tokens.at(-1).text, "", `${what}: the local end token's text`);
  assertEq(remote.tokens.length, local.tokens.length - end, `${what}: tokens`);
  assertEq(remote.summary.text, local.summary.text, `${what}: text`);
  return i;
}

/** Both runs agree to the end of the text, where both stop. */
function assertBothEnd(local, remote, what) {
  assertEq(assertAgree(local, remote, what), local.tokens.length - 1, `${what}: tokens compared`);
  assertEq(local.summary.stopReason, "Eos", `${what}: local stop`);
  assertEq(remote.summary.stopReason, "Eos", `${what}: remote stop`);
}

try {
  await test("load: the server's model, its info says remote and what a remote engine cannot do; a wrong model or server is a clear error", async () => {
    const got = await page.evaluate(
      async ({ good, wrong, gone }) => {
        const { NextToken } = await import("/nexttoken.js");
        const nt = new NextToken();
        const info = await nt.load(good);
        const err = async (m) =>
          nt.load(m).then(
            () => "loaded",
            (e) => ({ message: e.message, retryable: e.retryable }),
          );
        return { info, wrong: await err(wrong), gone: await err(gone) };
      },
      {
        good: REMOTE,
        wrong: `openai+${plain.url}#nope`,
        gone: `openai+http://127.0.0.1:${await freePort()}/v1#x`,
      },
    );
    assertEq(got.info.engine, "remote", "info.engine");
    assertEq(got.info.backend, "remote", "info.backend");
    assertEq(got.info.name, "stories260K", "info.name");
    assert(
      got.info.remote.unavailable.some((u) => /sampler view/.test(u)),
      "info.remote.unavailable",
    );
    assert(
      /serves no model "nope" \(it lists "stories260K"\)/.test(got.wrong.message),
      `wrong model: ${got.wrong.message}`,
    );
    assert(/could not reach the remote engine .*CORS/.test(got.gone.message), `no server: ${got.gone.message}`);
    assertEq(got.gone.retryable, true, "no server: retryable");
  });

  let compared = 0;
  await test("greedy generate: the server's tokens equal the local engine's, logprobs and alternatives within 2e-3, both stopping at max tokens", async () => {
    const { local, remote } = await both(
      "generate",
      "Once upon a time",
      { temperature: 0, maxTokens: 40 },
      "/test/stories.gguf",
      REMOTE,
    );
    compared = assertAgree(local, remote, "generate");
    assert(compared >= 30, `only ${compared} tokens agreed before a near tie`);
    assertEq(remote.summary.stopReason, "MaxTokens", "remote stop");
    assertEq(local.summary.stopReason, "MaxTokens", "local stop");
    assertEq(remote.tokens[0].id, null, "a remote token's id (servers send text)");
  });

  await test("the end of the text: both engines stop at EOS with the same story", async () => {
    const { local, remote } = await both(
      "generate",
      "Once upon a time",
      { temperature: 0, maxTokens: 400 },
      "/test/storychat.gguf",
      REMOTE_CHAT,
    );
    assertBothEnd(local, remote, "to EOS");
  });

  await test("a stop string ends both at the same text, reported as StopString", async () => {
    const { local, remote } = await both(
      "generate",
      "Once upon a time",
      { temperature: 0, maxTokens: 60, stop: [" girl"] },
      "/test/stories.gguf",
      REMOTE,
    );
    assertEq(remote.summary.stopReason, "StopString", "remote stop");
    assertEq(local.summary.stopReason, "StopString", "local stop");
    assertEq(remote.summary.text, local.summary.text, "text");
    assert(!remote.summary.text.includes(" girl"), "the stop string is not in the text");
  });

  await test("chat through the model's own template: the server's reply equals the local engine's, both to the end of the turn", async () => {
    const messages = [{ role: "user", content: "Once upon a time there was a cat." }];
    const { local, remote } = await both(
      "reply",
      messages,
      { temperature: 0, maxTokens: 300 },
      "/test/storychat.gguf",
      REMOTE_CHAT,
    );
    assertBothEnd(local, remote, "chat");
  });

  await test("score: the chain rule from the server's echoed logprobs equals the local score (all but the first token, which servers do not score; every token after a prefix)", async () => {
    const text = "Once upon a time there was a little girl named Lily.";
    const whole = await both("score", text, {}, "/test/stories.gguf", REMOTE);
    const [l, r] = [whole.local.score, whole.remote.score];
    assert(l && r, `score failed: ${whole.local.error || whole.remote.error}`);
    assertEq(r.tokens.length, l.tokens.length, "tokens");
    assertEq(r.tokens[0].logprob, null, "the first token (no server scores it)");
    assertEq(r.unscored, 1, "unscored");
    for (let i = 1; i < l.tokens.length; i++)
      assert(
        Math.abs(l.tokens[i].logprob - r.tokens[i].logprob) < TOL,
        `token ${i}: ${l.tokens[i].logprob} vs ${r.tokens[i].logprob}`,
      );
    const after = await both(
      "score",
      " there was a little girl",
      { after: "Once upon a time" },
      "/test/stories.gguf",
      REMOTE,
    );
    const [la, ra] = [after.local.score, after.remote.score];
    assertEq(
      ra.tokens.map((t) => t.piece.trim()).join("|"),
      la.tokens.map((t) => t.piece.trim()).join("|"),
      "tokens after the prefix",
    );
    assert(Math.abs(la.logprob - ra.logprob) < TOL * la.tokens.length, `log P: ${la.logprob} vs ${ra.logprob}`);
    assertEq(ra.unscored, 0, "unscored after a prefix");
  });

  await test("abort: the iterator ends at once, the server's stream is closed, and the next run works", async () => {
    const got = await page.evaluate(async (remote) => {
      const { NextToken } = await import("/nexttoken.js");
      const nt = new NextToken();
      await nt.load(remote);
      let n = 0;
      for await (const _ of nt.generate("Once upon a time", { temperature: 0, maxTokens: 300 })) {
        if (++n === 3) nt.abort();
      }
      const after = [];
      for await (const t of nt.generate("Once upon a time", { temperature: 0, maxTokens: 5 })) after.push(t.text);
      return { n, after: after.join(""), stop: nt.lastSummary.stopReason };
    }, REMOTE);
    assertEq(got.n, 3, "tokens delivered by the aborted run");
    assertEq(got.after, ", there was a little", "the next run");
    assertEq(got.stop, "MaxTokens", "the next run's stop");
  });

  await test("structured output: a JSON schema goes to the server, whose reply parses and validates; a regex is refused by name", async () => {
    const got = await page.evaluate(async (remote) => {
      const { NextToken } = await import("/nexttoken.js");
      const nt = new NextToken();
      await nt.load(remote);
      const schema = {
        type: "object",
        properties: { color: { enum: ["red", "blue"] } },
        required: ["color"],
        additionalProperties: false,
      };
      let text = "";
      for await (const t of nt.reply([{ role: "user", content: "A color?" }], {
        temperature: 0,
        maxTokens: 40,
        constraint: { type: "json_schema", schema },
      }))
        text += t.text;
      const stop = nt.lastSummary.stopReason;
      const regex = await (async () => {
        try {
          for await (const _ of nt.reply([{ role: "user", content: "x" }], {
            constraint: { type: "regex", pattern: "a+" },
          }));
          return "ran";
        } catch (e) {
          return e.message;
        }
      })();
      return { text, stop, regex };
    }, REMOTE_CHAT);
    const value = JSON.parse(got.text);
    assert(["red", "blue"].includes(value.color) && Object.keys(value).length === 1, `the reply: ${got.text}`);
    assertEq(got.stop, "ConstraintComplete", "stop");
    assert(/JSON schemas and JSON objects .* not a regex/.test(got.regex), `a regex: ${got.regex}`);
  });

  await test("the OpenAI API on a remote engine: whole and streamed answers, with logprobs, equal the server's own answer", async () => {
    const messages = [{ role: "user", content: "Once upon a time there was a dog." }];
    const direct = await (
      await fetch(`${chat.url}/chat/completions`, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify({ messages, max_tokens: 24, temperature: 0, repeat_penalty: 1 }),
      })
    ).json();
    const got = await page.evaluate(
      async ({ remote, messages }) => {
        const { NextToken } = await import("/nexttoken.js");
        const nt = new NextToken();
        await nt.load(remote);
        const whole = await nt.chat.completions.create({
          messages,
          max_tokens: 24,
          temperature: 0,
          logprobs: true,
          top_logprobs: 2,
        });
        let streamed = "";
        let finish = null;
        for await (const c of await nt.chat.completions.create({
          messages,
          max_tokens: 24,
          temperature: 0,
          stream: true,
        })) {
          streamed += c.choices[0]?.delta.content ?? "";
          finish = c.choices[0]?.finish_reason ?? finish;
        }
        return { whole, streamed, finish };
      },
      { remote: REMOTE_CHAT, messages },
    );
    const want = direct.choices[0].message.content;
    assertEq(got.whole.choices[0].message.content, want, "whole");
    assertEq(got.streamed, want, "streamed");
    assertEq(got.whole.choices[0].finish_reason, direct.choices[0].finish_reason, "finish_reason");
    assertEq(got.finish, direct.choices[0].finish_reason, "streamed finish_reason");
    assertEq(got.whole.choices[0].logprobs.content.length, 24, "logprobs");
    assertEq(got.whole.choices[0].logprobs.content[0].top_logprobs.length, 2, "top_logprobs");
  });

  await test("<next-token> on a remote model; and where the preflight refuses a model, its `remote` attribute runs it on the server instead", async () => {
    const huge = `/test/huge-${Date.now()}.gguf`;
    await page.route(`${base}${huge}`, (r) =>
      r.fulfill({
        status: 200,
        headers: { "content-length": String(6e9), "access-control-allow-origin": "*" },
        body: "",
      }),
    );
    const got = await page.evaluate(
      async ({ remote, huge }) => {
        const { NextToken } = await import("/nexttoken.js");
        const p = await new NextToken({ remote }).preflight(huge);
        document.body.innerHTML = `<next-token id="a" model="${remote}" prompt="Once upon a time" temperature="0" max-tokens="8"></next-token>
          <next-token id="b" model="${huge}" remote="${remote}" preflight prompt="Once upon a time" temperature="0" max-tokens="8"></next-token>`;
        const out = {};
        for (const id of ["a", "b"]) {
          const el = document.getElementById(id);
          await el.run();
          out[id] = {
            text: el.tokens.map((t) => t.text).join(""),
            status: el.shadowRoot.querySelector(".status").textContent,
          };
        }
        return { p, out };
      },
      { remote: REMOTE, huge },
    );
    assert(/6000 MB.*can run on the remote engine at 127\.0\.0\.1/.test(got.p.refusal), `refusal: ${got.p.refusal}`);
    assertEq(got.p.remote, REMOTE, "preflight.remote");
    assertEq(got.out.a.text, ", there was a little girl", "the element's text");
    assert(/remote/.test(got.out.a.status), `status: ${got.out.a.status}`);
    assertEq(got.out.b.text, got.out.a.text, "the refused model's element, on the server");
    assert(
      /^too big for this device · remote · stories260K on 127\.0\.0\.1:\d+$/.test(got.out.b.status),
      `status: ${got.out.b.status}`,
    );
  });
  await test("the page with ?remote=: a model the preflight refuses here runs on the server, and the status says so", async () => {
    const app = await context.newPage();
    try {
      const huge = `/test/huge-page-${Date.now()}.gguf`;
      await app.route(`${base}${huge}`, (r) =>
        r.fulfill({
          status: 200,
          headers: { "content-length": String(6e9), "access-control-allow-origin": "*" },
          body: "",
        }),
      );
      const q = new URLSearchParams({ remote: REMOTE, model: huge, mode: "text", prompt: "Once upon a time" });
      await app.goto(`${base}/index.html?${q}`);
      await app.waitForFunction(() => /running it there/.test(document.getElementById("status").textContent), null, {
        timeout: 60_000,
      });
      const status = await app.evaluate(() => document.getElementById("status").textContent);
      assert(
        /6000 MB.*it can run on the remote engine at 127\.0\.0\.1:\d+ instead: running it there\.$/.test(status),
        `status: ${status}`,
      );
      await app.evaluate(setGreedy, 8);
      await app.click("#generate");
      await app.waitForFunction(
        () => document.body.dataset.state === "ready" && document.getElementById("output-tokens").textContent,
        null,
        { timeout: 60_000 },
      );
      const got = await app.evaluate(appOutcome);
      assertEq(got.text, ", there was a little girl", `the text, from the server (${JSON.stringify(got)})`);
      assert(/^remote: stories260K/.test(got.backend), `backend: ${got.backend}`);
    } finally {
      await app.close();
    }
  });

  await test("the page on a remote model (its URL in the model field): the text, the backend line, and chat mode through the server's template", async () => {
    const app = await context.newPage();
    try {
      const q = new URLSearchParams({ model: REMOTE_CHAT, mode: "text", prompt: "Once upon a time" });
      await app.goto(`${base}/index.html?${q}`);
      const state = (want) =>
        app.waitForFunction((w) => [].concat(w).includes(document.body.dataset.state), want, { timeout: 60_000 });
      await state(["ready", "error"]);
      await app.evaluate(setGreedy, 8);
      await app.click("#generate");
      await app.waitForFunction(() => document.getElementById("output-tokens").textContent, null, { timeout: 60_000 });
      await state("ready");
      const got = await app.evaluate(appOutcome);
      assertEq(got.error, "", "error");
      assertEq(got.text, ", there was a little girl", "the page's text");
      assert(
        /^remote: storychat on 127\.0\.0\.1:\d+ \(not available there: token ids/.test(got.backend),
        `backend: ${got.backend}`,
      );
      // The inspector says what the server does not send; the score view scores all but the first token.
      await app.click("#output-tokens .tok");
      const inspector = await app.evaluate(() => document.getElementById("inspect").textContent);
      assert(
        /idnot sent by the server/.test(inspector) && /P\(token \| before\)0\.9/.test(inspector),
        `inspector: ${inspector}`,
      );
      await app.click("#score-btn");
      await app.waitForFunction(
        () =>
          !document.getElementById("score-out").hidden &&
          /perplexity/.test(document.getElementById("score-out").textContent),
        null,
        { timeout: 30_000 },
      );
      const scored = await app.evaluate(() => document.getElementById("score-out").textContent);
      assert(
        /the first unscored: the server gives no probability for it/.test(scored) && /not given/.test(scored),
        `score view: ${scored}`,
      );
      assertEq(await app.evaluate(() => document.getElementById("mode-chat").disabled), false, "chat mode offered");
      await app.click("#mode-chat");
      await app.fill("#message", "Once upon a time there was a cat.");
      await app.click("#send");
      await app.waitForFunction(() => !document.getElementById("rendered").hidden, null, { timeout: 60_000 });
      await state("ready");
      const reply = await app.evaluate(() => ({
        error: document.getElementById("error").hidden ? "" : document.getElementById("error-text").textContent,
        rendered: document.getElementById("rendered-text").textContent,
      }));
      assertEq(reply.error, "", "chat error");
      assert(/the server renders the conversation/.test(reply.rendered), `what the model reads: ${reply.rendered}`);
    } finally {
      await app.close();
    }
  });
} finally {
  await browser.close();
  for (const s of [plain, chat]) s.child.kill();
  server.closeAllConnections?.();
  server.close();
  if (process.exitCode) console.log(consoleLines.slice(-20).join("\n"));
}
finish();
