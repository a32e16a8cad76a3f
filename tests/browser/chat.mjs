// Browser tests for chat (issue: any GGUF chat-ready): the page's conversation view with KV reuse,
// the OpenAI-style API (shapes, streaming, abort, errors, logprobs), Hugging Face references.
//
// The model: a synthetic Qwen2-shaped GGUF (random weights, tiny dimensions) made by the native
// CLI's `synth --vocab-from` with llama.cpp's Qwen2 vocabulary GGUF, which carries Qwen2's
// tokenizer and chat template: a chat model with nothing but its GGUF. The references are the
// native CLI's (`chat --messages`, `generate --json`): an independent process that renders and
// prefills the whole conversation from scratch.

import { spawnSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";

const CONFIG = {
  model_type: "qwen2",
  vocab_size: 1000,
  hidden_size: 64,
  num_hidden_layers: 2,
  num_attention_heads: 4,
  num_key_value_heads: 2,
  intermediate_size: 96,
  max_position_embeddings: 512,
  tie_word_embeddings: true,
};

/** Write the chat model into `dir` (chat.gguf); false when the Qwen2 vocabulary is missing. */
export function makeChatFixture({ dir, bin, vocabGguf }) {
  if (!fs.existsSync(vocabGguf)) return false;
  fs.mkdirSync(dir, { recursive: true });
  const config = path.join(dir, "config.json");
  fs.writeFileSync(config, JSON.stringify(CONFIG));
  const r = spawnSync(
    bin,
    [
      "synth",
      "--config",
      config,
      "--vocab-from",
      vocabGguf,
      "--type",
      "q8_0",
      "--seed",
      "7",
      "--out",
      path.join(dir, "chat.gguf"),
    ],
    { encoding: "utf8" },
  );
  if (r.status !== 0) throw new Error(`synth failed: ${r.stderr}`);
  return true;
}

/** The native CLI's reply to `messages` (greedy, `n` tokens), computed the way `mode` computes. */
function nativeReply({ bin, model, messages, n, mode, tmp }) {
  const conv = path.join(tmp, `conv-${Date.now()}.json`);
  fs.writeFileSync(conv, JSON.stringify(messages));
  const how = mode === "webgpu" ? ["--exact"] : ["--isa", "scalar", "--threads", "1"];
  const r = spawnSync(
    bin,
    [
      "chat",
      "--model",
      model,
      "--messages",
      conv,
      "--temperature",
      "0",
      "--max-tokens",
      String(n),
      "--backend",
      "cpu",
      "--json",
      ...how,
    ],
    { encoding: "utf8" },
  );
  if (r.status !== 0) throw new Error(`the CLI's chat failed: ${r.stderr}`);
  return JSON.parse(r.stdout.trim().split("\n").at(-1));
}

function nativeGenerate({ bin, model, prompt, n, mode }) {
  const how = mode === "webgpu" ? ["--exact"] : ["--isa", "scalar", "--threads", "1"];
  const r = spawnSync(
    bin,
    [
      "generate",
      "--model",
      model,
      "--prompt",
      prompt,
      "--temperature",
      "0",
      "--max-tokens",
      String(n),
      "--backend",
      "cpu",
      "--json",
      ...how,
    ],
    { encoding: "utf8" },
  );
  if (r.status !== 0) throw new Error(`the CLI's generate failed: ${r.stderr}`);
  const lines = r.stdout
    .trim()
    .split("\n")
    .map((l) => JSON.parse(l));
  return { tokens: lines.filter((l) => "id" in l), summary: lines.at(-1) };
}

/** Send each of `messages` in the page's chat mode; the page's conversation after each reply. */
async function sendTurns(page, messages, { assert, waitState, errorText }) {
  const turns = [];
  for (const message of messages) {
    await page.fill("#message", message);
    await page.click("#send");
    await waitState(page, "ready", 120_000);
    const err = await errorText(page);
    assert(!err, `reply failed: ${err}`);
    turns.push(await pageTurn(page));
  }
  return turns;
}

/** The page's conversation after a reply: its turns, the stats, the reply's ids, what the model read. */
function pageTurn(page) {
  return page.evaluate(() => {
    const app = window.nexttokenApp;
    const last = app.conversation.at(-1);
    return {
      conversation: app.conversation.map((m) => ({ role: m.role, content: m.content })),
      stats: { ...app.stats },
      ids: app.tokens.slice(last.first, last.first + last.count).map((t) => t.id),
      rendered: document.getElementById("rendered-text").textContent,
    };
  });
}

/** Checks an object against OpenAI's chat.completion shape; returns it. */
function checkCompletion(r, assert) {
  assert(typeof r.id === "string" && r.id.startsWith("chatcmpl-"), `id: ${r.id}`);
  assert(r.object === "chat.completion", `object: ${r.object}`);
  assert(Number.isInteger(r.created) && Math.abs(r.created - Date.now() / 1000) < 600, `created: ${r.created}`);
  assert(typeof r.model === "string" && r.model, `model: ${r.model}`);
  assert(Array.isArray(r.choices) && r.choices.length === 1, "choices");
  const c = r.choices[0];
  assert(
    c.index === 0 && c.message?.role === "assistant" && typeof c.message.content === "string",
    `choice: ${JSON.stringify(c).slice(0, 200)}`,
  );
  assert(["stop", "length"].includes(c.finish_reason), `finish_reason: ${c.finish_reason}`);
  const u = r.usage;
  assert(
    Number.isInteger(u.prompt_tokens) &&
      Number.isInteger(u.completion_tokens) &&
      u.total_tokens === u.prompt_tokens + u.completion_tokens,
    `usage: ${JSON.stringify(u)}`,
  );
  assert(
    Number.isInteger(u.prompt_tokens_details?.cached_tokens) && u.prompt_tokens_details.cached_tokens < u.prompt_tokens,
    `cached_tokens: ${JSON.stringify(u)}`,
  );
  return r;
}

function checkLogprobs(content, { n, top }, assert) {
  assert(
    Array.isArray(content) && content.length === n,
    `logprobs.content has ${content?.length} entries for ${n} tokens`,
  );
  for (const e of content) {
    assert(
      typeof e.token === "string" && Number.isFinite(e.logprob) && e.logprob <= 0,
      `entry ${JSON.stringify(e).slice(0, 120)}`,
    );
    assert(Array.isArray(e.bytes) && e.bytes.every((b) => Number.isInteger(b) && b >= 0 && b < 256), "bytes");
    assert(e.top_logprobs.length === top, `top_logprobs: ${e.top_logprobs.length}, want ${top}`);
    for (let i = 1; i < e.top_logprobs.length; i++)
      assert(e.top_logprobs[i - 1].logprob >= e.top_logprobs[i].logprob, "top_logprobs not sorted");
  }
}

export async function chatTests(t) {
  const { test, assert, assertEq, page, base, mode, bin, fixtures, waitLoaded, waitState, statsOf, tmp } = t;
  if (!fs.existsSync(path.join(fixtures, "chat", "chat.gguf"))) return;
  const model = path.join(fixtures, "chat", "chat.gguf");
  const url = "/test/chat/chat.gguf";
  // SwiftShader's WebGPU takes ~10 s per token over Qwen2's 152k-token vocabulary: there, only
  // the page's two turns run, 2 tokens each (the API's and the page's logic do not depend on the
  // backend, and tests/chat_kv_reuse.rs checks GPU reuse natively on every step).
  const webgpu = mode === "webgpu";
  const N = webgpu ? 2 : 10;

  await test(`[${mode}] chat in the page: a GGUF with a template opens in chat mode; turn 2 reuses turn 1's KV cache and equals the CLI's full recompute`, async () => {
    await page.goto(`${base}/?nosw&model=${encodeURIComponent(url)}`);
    await waitLoaded(page);
    assert(await page.isVisible("#chat-input"), "chat mode was not selected for a model with a chat template");
    await page.fill("#temperature", "0");
    await page.fill("#max-tokens", String(N));
    await page.fill("#system", "You are terse.");
    const [one, two] = await sendTurns(page, ["Hello! Who are you?", "Tell me about the sea."], t);
    assertEq(two.conversation.length, 4, "turns in the conversation");
    const reused = /reused (\d+) of (\d+) prompt tokens/.exec(two.stats["KV cache"]);
    assert(reused, `no KV reuse in the stats: ${JSON.stringify(two.stats)}`);
    const [, kept, total] = reused.map(Number);
    const firstPrompt = Number(one.stats["prompt tokens"]);
    assert(
      kept >= firstPrompt && kept < total,
      `turn 2 reused ${kept} of ${total}; turn 1's prompt alone was ${firstPrompt} tokens`,
    );
    // The CLI renders the whole conversation and prefills it from an empty state.
    const messages = [{ role: "system", content: "You are terse." }, ...two.conversation.slice(0, 3)];
    const want = nativeReply({ bin, model, messages, n: N, mode, tmp });
    assertEq(JSON.stringify(two.ids), JSON.stringify(want.ids), "turn 2's reply ids vs the CLI's full recompute");
    assertEq(total, want.prompt_tokens, "turn 2's prompt tokens vs the CLI's");
    // The inspector works on the assistant's tokens.
    await page.click("#conversation li.assistant .tok >> nth=0");
    const inspected = await page.textContent("#inspect");
    assert(/P\(token \| before\)/.test(inspected), `inspector: ${inspected.slice(0, 100)}`);
    // What the model reads is shown: the template's rendering with its markers.
    assert(
      (await page.textContent("#rendered-text")).includes("<|im_start|>assistant"),
      "the rendered prompt is not shown",
    );
    if (webgpu) return;
    // Regenerate replaces the last reply (same greedy reply, the prompt fully reused but its last token).
    await page.click("#regenerate");
    await waitState(page, "ready", 120_000);
    const again = await page.evaluate(() => window.nexttokenApp.conversation);
    assertEq(again.length, 4, "turns after Regenerate");
    assertEq(again[3].content, two.conversation[3].content, "regenerated greedy reply");
    const regen = /reused (\d+) of (\d+)/
      .exec((await statsOf(page))["KV cache"])
      .slice(1)
      .map(Number);
    assertEq(regen[0], regen[1] - 1, "Regenerate prefills only the prompt's last token");
    // Edit last takes the user's message back; Clear empties the conversation.
    await page.click("#edit-last");
    assertEq(await page.inputValue("#message"), "Tell me about the sea.", "message put back by Edit last");
    assertEq(await page.evaluate(() => window.nexttokenApp.conversation.length), 2, "turns after Edit last");
    await page.click("#clear-chat");
    assertEq(await page.evaluate(() => window.nexttokenApp.conversation.length), 0, "turns after Clear");
    await page.screenshot({ path: path.join(t.outDir, `chat-${mode}.png`), fullPage: true });
  });

  if (webgpu) return;

  await test(`[${mode}] chat: a conversation longer than the context is a clear error, or loses its oldest turns with dropOldest`, async () => {
    await page.goto(`${base}/?nosw`);
    const r = await page.evaluate(async (url) => {
      const { NextToken } = await import("/nexttoken.js");
      const nt = new NextToken();
      try {
        await nt.load(url, { maxSeq: 96 });
        const long = "words ".repeat(20);
        const messages = [];
        for (let i = 0; i < 4; i++)
          messages.push({ role: "user", content: `${i}: ${long}` }, { role: "assistant", content: "ok" });
        messages.push({ role: "user", content: "last" });
        let error = null;
        try {
          for await (const _ of nt.reply(messages, { maxTokens: 4, temperature: 0 }));
        } catch (e) {
          error = e.message;
        }
        const got = [];
        for await (const t of nt.reply(messages, { maxTokens: 4, temperature: 0, dropOldest: true })) got.push(t.id);
        return { error, kept: nt.lastSummary.messages, messages, sent: messages.length, got: got.length };
      } finally {
        nt.terminate();
      }
    }, url);
    assert(r.error && /context is 96 tokens/.test(r.error), `error: ${r.error}`);
    // The oldest turns went; what is left is the end of the conversation, starting with a user turn.
    assert(
      r.kept.length < r.sent && r.kept.at(-1).content === "last" && r.kept[0].role === "user",
      `kept: ${JSON.stringify(r.kept).slice(0, 200)}`,
    );
    assert(
      r.kept.every((m, i) => JSON.stringify(m) === JSON.stringify(r.messages[r.sent - r.kept.length + i])),
      "the kept turns are not the conversation's last ones",
    );
    assert(r.got > 0, "no tokens after dropping the oldest turns");
  });

  await test(`[${mode}] OpenAI API: chat.completions.create shapes (plain, streamed, usage), logprobs agree with the CLI, abort, errors, queued requests`, async () => {
    const messages = [{ role: "user", content: "Hello there" }];
    await page.goto(`${base}/?nosw`);
    const r = await page.evaluate(
      async ({ url, messages, N }) => {
        const { NextToken } = await import("/nexttoken.js");
        const nt = new NextToken();
        const out = {};
        try {
          await nt.load(url);
          const params = {
            messages,
            temperature: 0,
            max_tokens: N,
            logprobs: true,
            top_logprobs: 3,
            unknown_field: { ignored: true },
          };
          out.plain = await nt.chat.completions.create(params);
          out.again = await nt.chat.completions.create(params);
          const stream = await nt.chat.completions.create({
            ...params,
            stream: true,
            stream_options: { include_usage: true },
          });
          out.chunks = [];
          for await (const c of stream) out.chunks.push(c);
          // Abort mid-stream: the loop throws an AbortError; the next request runs normally.
          const controller = new AbortController();
          let n = 0;
          try {
            for await (const c of await nt.chat.completions.create(
              { messages, temperature: 0.8, max_tokens: 200, stream: true },
              { signal: controller.signal },
            )) {
              if (c.choices[0]?.delta.content !== undefined && ++n === 2) controller.abort();
            }
            out.abort = "not aborted";
          } catch (e) {
            out.abort = e.name;
          }
          out.afterAbort = (await nt.chat.completions.create({ messages, max_tokens: 3 })).choices[0].finish_reason;
          // Two at once: both complete (they run in turn).
          const [a, b] = await Promise.all([
            nt.chat.completions.create({ messages, temperature: 0, max_tokens: N }),
            nt.chat.completions.create({ messages, temperature: 0, max_tokens: N }),
          ]);
          out.concurrent = [a.choices[0].message.content, b.choices[0].message.content];
          out.errors = {};
          for (const [name, bad] of Object.entries({
            temperature: { temperature: -1 },
            top_p: { top_p: 2 },
            max_tokens: { max_tokens: 0 },
            messages: { messages: [] },
            top_logprobs: { top_logprobs: 3 },
            n: { n: 2 },
            stop: { stop: [1] },
          })) {
            try {
              await nt.chat.completions.create({ messages, ...bad });
              out.errors[name] = "accepted";
            } catch (e) {
              out.errors[name] = `${e.name}|${e.param}|${e.message}`;
            }
          }
          out.legacy = await nt.completions.create({
            prompt: "The sea is",
            temperature: 0,
            max_tokens: N,
            logprobs: 2,
          });
          // abort() then generate() at once: the new generation runs whole (the old loop must
          // not stop it), and so does one started while another runs.
          for await (const _ of nt.generate("The sea is", { maxTokens: 50, temperature: 1 })) break;
          nt.abort();
          const after = [];
          for await (const t of nt.generate("The sea is", { maxTokens: N, temperature: 0 })) after.push(t.id);
          out.afterAbortGenerate = { n: after.length, stop: nt.lastSummary.stopReason };
          nt.generate("The sea", { maxTokens: 50 });
          const second = [];
          for await (const t of nt.generate("The sea is", { maxTokens: N, temperature: 0 })) second.push(t.id);
          out.secondGenerate = { n: second.length, stop: nt.lastSummary.stopReason };
          return out;
        } finally {
          nt.terminate();
        }
      },
      { url, messages, N },
    );
    checkCompletion(r.plain, assert);
    checkLogprobs(r.plain.choices[0].logprobs.content, { n: r.plain.usage.completion_tokens, top: 3 }, assert);
    // Greedy: each chosen token is the most likely one.
    for (const e of r.plain.choices[0].logprobs.content)
      assert(Math.abs(e.logprob - e.top_logprobs[0].logprob) < 1e-5, "greedy pick is not the top token");
    // The second identical request reuses the first's KV cache (all of the prompt but its last token).
    assertEq(
      r.again.usage.prompt_tokens_details.cached_tokens,
      r.again.usage.prompt_tokens - 1,
      "cached_tokens of a repeated request",
    );
    assertEq(r.again.choices[0].message.content, r.plain.choices[0].message.content, "repeated greedy request");
    // The CLI, from scratch: same reply, same log-probabilities.
    const want = nativeReply({ bin, model, messages, n: N, mode, tmp });
    assertEq(r.plain.choices[0].message.content, want.content, "content vs the CLI's");
    assertEq(r.plain.usage.prompt_tokens, want.prompt_tokens, "prompt_tokens vs the CLI's");
    // Streamed: role first, content deltas, a finish_reason, then usage alone.
    const chunks = r.chunks;
    assert(
      chunks.every((c) => c.object === "chat.completion.chunk" && c.id === chunks[0].id),
      "chunk object/id",
    );
    const text = chunks.map((c) => c.choices[0]?.delta.content ?? "").join("");
    assertEq(text, r.plain.choices[0].message.content, "streamed text vs the plain response");
    const finish = chunks.filter((c) => c.choices[0]?.finish_reason);
    assert(
      finish.length === 1 && finish[0].choices[0].finish_reason === r.plain.choices[0].finish_reason,
      "one finish chunk",
    );
    assert(
      chunks.at(-1).choices.length === 0 && chunks.at(-1).usage.completion_tokens === r.plain.usage.completion_tokens,
      `usage chunk: ${JSON.stringify(chunks.at(-1))}`,
    );
    const streamedLogprobs = chunks.flatMap((c) => c.choices[0]?.logprobs?.content ?? []);
    assertEq(
      JSON.stringify(streamedLogprobs),
      JSON.stringify(r.plain.choices[0].logprobs.content),
      "streamed logprobs",
    );
    assertEq(r.abort, "AbortError", "aborted stream");
    assert(["stop", "length"].includes(r.afterAbort), `request after the abort: ${r.afterAbort}`);
    assertEq(r.concurrent[0], r.concurrent[1], "two concurrent greedy requests");
    for (const [name, message] of Object.entries(r.errors))
      assert(message.startsWith(`BadRequestError|${name}|${name}:`), `invalid ${name}: ${message}`);
    // completions.create: the legacy shape; its log-probabilities are the CLI's for the same prompt.
    const legacy = r.legacy;
    assert(legacy.object === "text_completion" && legacy.id.startsWith("cmpl-"), `legacy: ${legacy.object}`);
    const ref = nativeGenerate({ bin, model, prompt: "The sea is", n: N, mode });
    assertEq(legacy.choices[0].text, ref.summary.text, "completion text vs the CLI's");
    const lp = legacy.choices[0].logprobs;
    assertEq(lp.token_logprobs.length, ref.tokens.length, "legacy logprobs count");
    lp.token_logprobs.forEach((x, i) =>
      assert(
        Math.abs(x - ref.tokens[i].logprob) < 2e-3,
        `token ${i}: logprob ${x} vs the CLI's ${ref.tokens[i].logprob}`,
      ),
    );
    assert(
      lp.top_logprobs.every((o) => Object.keys(o).length <= 2),
      "legacy top_logprobs size",
    );
    for (const what of ["afterAbortGenerate", "secondGenerate"]) {
      const g = r[what];
      assert(
        g.stop !== "Aborted" && (g.n === N || g.stop === "Eos"),
        `${what}: ${JSON.stringify(g)} (the previous generation's loop stopped it)`,
      );
    }
  });

  await test(`[${mode}] chat with a model that has no chat template: the page offers text mode only, reply() says why`, async () => {
    await page.goto(`${base}/?nosw&model=lesson-toy`);
    await waitLoaded(page);
    assert(await page.isDisabled("#mode-chat"), "chat mode offered for a table model");
    assert(await page.isVisible("#prompt"), "text mode not shown");
    const err = await page.evaluate(async () => {
      const { NextToken } = await import("/nexttoken.js");
      const nt = new NextToken();
      try {
        await nt.load("models/lesson-toy.json");
        for await (const _ of nt.reply([{ role: "user", content: "the" }]));
        return "no error";
      } catch (e) {
        return e.message;
      } finally {
        nt.terminate();
      }
    });
    assert(/no chat template/.test(err), `error: ${err}`);
  });

  if (mode === "cpu") {
    await test(`[${mode}] a chat template that loops without end stops at its budget with an error in the page; the worker goes on`, async () => {
      // The chat model's shapes with the default model's vocabulary and a template of 10^10 steps.
      const dir = path.join(fixtures, "hostile");
      fs.mkdirSync(dir, { recursive: true });
      const config = path.join(dir, "config.json");
      fs.writeFileSync(config, JSON.stringify({ ...CONFIG, model_type: "llama", vocab_size: 2048 }));
      const template = path.join(dir, "loop.jinja");
      fs.writeFileSync(template, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}");
      const r = spawnSync(
        bin,
        [
          "synth",
          "--config",
          config,
          "--vocab-from",
          path.join(path.dirname(new URL(import.meta.url).pathname), "..", "..", "www", "models", "default.gguf"),
          "--chat-template",
          template,
          "--type",
          "q8_0",
          "--out",
          path.join(dir, "hostile.gguf"),
        ],
        { encoding: "utf8" },
      );
      assertEq(r.status, 0, `synth failed: ${r.stderr}`);
      await page.goto(`${base}/?nosw&model=lesson-toy`);
      const out = await page.evaluate(async () => {
        const { NextToken } = await import("/nexttoken.js");
        const nt = new NextToken();
        try {
          await nt.load("/test/hostile/hostile.gguf", { backend: "cpu" });
          const t0 = performance.now();
          let error = "no error";
          try {
            for await (const _ of nt.reply([{ role: "user", content: "hi" }]));
          } catch (e) {
            error = e.message;
          }
          const ms = performance.now() - t0;
          let text = "";
          for await (const t of nt.generate("In the beginning", { temperature: 0, maxTokens: 4 })) text += t.text;
          return { error, ms, tokens: nt.lastSummary.generatedTokens, text };
        } catch (e) {
          return { error: `failed: ${e.message}` };
        } finally {
          nt.terminate();
        }
      });
      console.log(`      ${out.error} (${out.ms?.toFixed(0)} ms)`);
      assert(
        /chat template: rendering stopped: the template used up its budget/.test(out.error),
        `reply(): ${out.error}`,
      );
      assertEq(out.tokens, 4, "tokens generated after the runaway template");
    });
  }

  await test(`[${mode}] Hugging Face references resolve to the Hub's download URL and load (hf:owner/repo/file, owner/repo:file)`, async () => {
    const r = await page.evaluate(async () => {
      const { resolveModelUrl } = await import("/nexttoken.js");
      const out = {};
      for (const ref of [
        "hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q8_0.gguf",
        "bartowski/SmolLM2-135M-Instruct-GGUF:SmolLM2-135M-Instruct-Q8_0.gguf",
        "hf:a/b@v1.0/sub/x.gguf",
        "https://example.com/m.gguf",
        "models/default.gguf",
        "hf:a/b",
        "a/b:Q4_K_M",
        "hf:a/b/../x.gguf",
      ]) {
        try {
          out[ref] = resolveModelUrl(ref);
        } catch (e) {
          out[ref] = `error: ${e.message}`;
        }
      }
      return out;
    });
    const hub = "https://huggingface.co";
    assertEq(
      r["hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q8_0.gguf"],
      `${hub}/Qwen/Qwen2.5-0.5B-Instruct-GGUF/resolve/main/qwen2.5-0.5b-instruct-q8_0.gguf`,
      "hf: reference",
    );
    assertEq(
      r["bartowski/SmolLM2-135M-Instruct-GGUF:SmolLM2-135M-Instruct-Q8_0.gguf"],
      `${hub}/bartowski/SmolLM2-135M-Instruct-GGUF/resolve/main/SmolLM2-135M-Instruct-Q8_0.gguf`,
      "owner/repo:file",
    );
    assertEq(r["hf:a/b@v1.0/sub/x.gguf"], `${hub}/a/b/resolve/v1.0/sub/x.gguf`, "revision and sub-folder");
    assertEq(r["https://example.com/m.gguf"], "https://example.com/m.gguf", "plain URL");
    assertEq(r["models/default.gguf"], "models/default.gguf", "relative URL");
    for (const bad of ["hf:a/b", "a/b:Q4_K_M", "hf:a/b/../x.gguf"])
      assert(r[bad].startsWith("error: "), `${bad} accepted: ${r[bad]}`);
    // Loading one: the Hub is not reachable from tests, so the request is answered with the fixture.
    const requested = [];
    await page.route(`${hub}/**`, (route) => {
      requested.push(route.request().url());
      route.fulfill({
        status: 200,
        body: fs.readFileSync(model),
        headers: { "content-type": "application/octet-stream", "access-control-allow-origin": "*" },
      });
    });
    try {
      await page.goto(`${base}/?nosw&model=${encodeURIComponent("hf:someone/chat-GGUF/chat.gguf")}`);
      await waitLoaded(page);
      assertEq(
        JSON.stringify(requested),
        JSON.stringify([`${hub}/someone/chat-GGUF/resolve/main/chat.gguf`]),
        "requests to the Hub",
      );
      assert(await page.isVisible("#chat-input"), "the Hub model did not open in chat mode");
    } finally {
      await page.unroute(`${hub}/**`);
      await page.evaluate(async () => {
        for (const key of await caches.keys()) await caches.delete(key);
      });
    }
  });
}

/**
 * The chat model shipped with the site (www/models/chat.gguf), with nothing but the page's own
 * origin reachable: chat mode, "what the model reads", turn 2 reusing turn 1's cache with the
 * CLI's reply, the OpenAI-shaped API and a reply under a JSON schema.
 */
export async function shippedChatTests(t) {
  const { test, assert, assertEq, browser, base, mode, bin, www, tmp, waitLoaded } = t;
  const model = path.join(www, "models", "chat.gguf");
  if (!fs.existsSync(model)) throw new Error("www/models/chat.gguf is missing");
  await test(`[${mode}] the shipped chat model with no network: chat mode, what the model reads, turn 2 reuses turn 1's KV cache and equals the CLI; the OpenAI API, with and without a JSON schema`, async () => {
    const context = await browser.newContext();
    const page = await context.newPage();
    const outside = [];
    await context.route("**/*", (route) => {
      const url = route.request().url();
      if (url.startsWith(base) || url.startsWith("data:") || url.startsWith("blob:")) return route.continue();
      outside.push(url);
      return route.abort();
    });
    try {
      await page.goto(`${base}/?nosw&model=chat`);
      await waitLoaded(page);
      assert(await page.isVisible("#chat-input"), "the chat model did not open in chat mode");
      await page.fill("#temperature", "0");
      await page.fill("#max-tokens", "24");
      const verses = ["In the beginning God created the heaven and the earth.", "And God said, Let there be light:"];
      const [one, two] = await sendTurns(page, verses, t);
      assert(one.conversation[1].content.trim().length > 0, "turn 1's reply is empty");
      assert(
        two.rendered.includes(`Reader: ${verses[0]}\nAnswer: `) && two.rendered.includes(`Reader: ${verses[1]}\n`),
        `what the model reads: ${JSON.stringify(two.rendered)}`,
      );
      const [, kept] = /reused (\d+) of (\d+) prompt tokens/.exec(two.stats["KV cache"]).map(Number);
      assert(kept >= Number(one.stats["prompt tokens"]), `turn 2 reused ${kept}: ${JSON.stringify(two.stats)}`);
      const cli = nativeReply({ bin, model, messages: two.conversation.slice(0, 3), n: 24, mode, tmp });
      assertEq(
        JSON.stringify(two.ids.filter((id) => id !== 2)),
        JSON.stringify(cli.ids.filter((id) => id !== 2)),
        "turn 2 (page vs CLI)",
      );

      const api = await page.evaluate(async () => {
        const { NextToken } = await import("/nexttoken.js");
        const nt = new NextToken();
        try {
          await nt.load("chat");
          const messages = [{ role: "user", content: "In the beginning God created the heaven and the earth." }];
          const plain = await nt.chat.completions.create({ messages, max_tokens: 40, temperature: 0 });
          const schema = {
            type: "object",
            properties: { verse: { type: "string", maxLength: 60 } },
            required: ["verse"],
            additionalProperties: false,
          };
          const shaped = await nt.chat.completions.create({
            messages,
            max_tokens: 60,
            temperature: 0,
            response_format: { type: "json_schema", json_schema: { name: "verse", schema } },
          });
          return { plain, shaped };
        } finally {
          nt.terminate();
        }
      });
      const plain = api.plain.choices[0];
      assert(
        plain.message.content.trim().length > 0 && ["stop", "length"].includes(plain.finish_reason),
        JSON.stringify(plain),
      );
      const shaped = JSON.parse(api.shaped.choices[0].message.content);
      assert(typeof shaped.verse === "string" && Object.keys(shaped).length === 1, JSON.stringify(shaped));
      assertEq(JSON.stringify(outside), "[]", "requests that left the page's origin");
    } finally {
      await context.close();
    }
  });
}

/**
 * Write the tool-calling model into `dir` (tools.gguf): the chat model's shape and vocabulary
 * with Qwen2.5-Instruct's real template (it takes tools) and room for its tool prompt; the
 * tools (`tools.json`: the fixture's, strings bounded so a random model's arguments end).
 */
export function makeToolsFixture({ dir, bin, vocabGguf, templateFile, renderedFixture }) {
  if (!fs.existsSync(vocabGguf) || !fs.existsSync(templateFile)) return false;
  fs.mkdirSync(dir, { recursive: true });
  const config = path.join(dir, "config.json");
  fs.writeFileSync(config, JSON.stringify({ ...CONFIG, max_position_embeddings: 1024 }));
  const r = spawnSync(
    bin,
    ["synth", "--config", config, "--vocab-from", vocabGguf, "--chat-template", templateFile].concat([
      "--type",
      "q8_0",
      "--seed",
      "7",
      "--out",
      path.join(dir, "tools.gguf"),
    ]),
    { encoding: "utf8" },
  );
  if (r.status !== 0) throw new Error(`synth failed: ${r.stderr}`);
  const fixture = JSON.parse(fs.readFileSync(renderedFixture, "utf8"));
  const tools = fixture._meta.tools.map((t) => {
    const parameters = structuredClone(t.function.parameters);
    parameters.additionalProperties = false;
    for (const p of Object.values(parameters.properties)) if (!p.enum) p.maxLength = 10;
    return { ...t, function: { ...t.function, parameters } };
  });
  fs.writeFileSync(path.join(dir, "tools.json"), JSON.stringify(tools));
  fs.writeFileSync(path.join(dir, "conversations.json"), JSON.stringify(fixture._meta.conversations));
  return true;
}

/** The native CLI's reply with `--tools` (greedy, exact path), as its --json line. */
function nativeToolReply({ bin, model, dir, conversation, choice, parallel }) {
  const conv = path.join(dir, `conv-${conversation}.json`);
  const all = JSON.parse(fs.readFileSync(path.join(dir, "conversations.json"), "utf8"));
  fs.writeFileSync(conv, JSON.stringify(all[conversation]));
  const args = ["chat", "--model", model, "--messages", conv, "--tools", path.join(dir, "tools.json")]
    .concat(["--tool-choice", choice, "--temperature", "0", "--max-tokens", "200", "--backend", "cpu"])
    .concat(["--json", "--isa", "scalar", "--threads", "1"], parallel ? [] : ["--no-parallel-tool-calls"]);
  const r = spawnSync(bin, args, { encoding: "utf8" });
  if (r.status !== 0) throw new Error(`the CLI's chat --tools failed: ${r.stderr}`);
  return JSON.parse(r.stdout.trim().split("\n").at(-1));
}

/**
 * Tool calling through the OpenAI API (CPU path): a forced call (a named function, and
 * "required") is the native CLI's call, whole and streamed as `delta.tool_calls`; its arguments
 * are a string of JSON in the tool's schema; a conversation that carries calls and their answers
 * prefills what the CLI prefills; the errors name their field.
 */
export async function toolTests(t) {
  const { test, assert, assertEq, page, base, mode, bin, fixtures } = t;
  const dir = path.join(fixtures, "tools");
  if (mode !== "cpu" || !fs.existsSync(path.join(dir, "tools.gguf"))) return;
  const model = path.join(dir, "tools.gguf");
  const tools = JSON.parse(fs.readFileSync(path.join(dir, "tools.json"), "utf8"));
  const conversations = JSON.parse(fs.readFileSync(path.join(dir, "conversations.json"), "utf8"));

  await test(`[${mode}] OpenAI API tool calling: forced calls (a named function, "required") equal the native CLI's, whole and streamed as delta.tool_calls; a conversation with calls and answers prefills as the CLI's; errors name tools and tool_choice`, async () => {
    await page.goto(`${base}/?nosw`);
    const r = await page.evaluate(
      async ({ url, tools, conversations }) => {
        const { NextToken } = await import("/nexttoken.js");
        const nt = new NextToken();
        const out = { errors: {} };
        const error = async (name, params) => {
          try {
            await nt.chat.completions.create(params);
            out.errors[name] = "no error";
          } catch (e) {
            out.errors[name] = { name: e.name, param: e.param, message: e.message };
          }
        };
        try {
          const info = await nt.load(url);
          out.toolFormat = info.toolFormat;
          const base = { messages: conversations.offer, tools, temperature: 0, max_tokens: 200 };
          const named = { type: "function", function: { name: "get_weather" } };
          out.named = await nt.chat.completions.create({ ...base, tool_choice: named, parallel_tool_calls: false });
          out.required = await nt.chat.completions.create({
            ...base,
            tool_choice: "required",
            parallel_tool_calls: false,
          });
          out.chunks = [];
          for await (const c of await nt.chat.completions.create({
            ...base,
            tool_choice: named,
            parallel_tool_calls: false,
            stream: true,
          }))
            out.chunks.push(c);
          out.answered = await nt.chat.completions.create({
            messages: conversations.answered.map((m) =>
              // As OpenAI's clients send them back: arguments as a string of JSON.
              m.tool_calls
                ? {
                    ...m,
                    tool_calls: m.tool_calls.map((c) => ({
                      ...c,
                      function: { ...c.function, arguments: JSON.stringify(c.function.arguments) },
                    })),
                  }
                : m,
            ),
            tools,
            temperature: 0,
            max_tokens: 1,
          });
          // "auto": the streamed content and calls add up to the whole answer's.
          out.auto = await nt.chat.completions.create({ ...base, max_tokens: 40 });
          out.autoChunks = [];
          for await (const c of await nt.chat.completions.create({ ...base, max_tokens: 40, stream: true }))
            out.autoChunks.push(c);
          // What may stream of a reply so far, in each format.
          const { releasable } = await import("/openai.js");
          out.releasable = [
            ["Sure.", "hermes", false],
            ["Sure. <tool", "hermes", false],
            ["Sure. <tool_call>\n{", "hermes", false],
            ["a < b", "hermes", false],
            ["Sure.", "hermes", true],
            ['  {"name"', "llama_json", false],
            ["<|python", "llama_json", false],
            ["The answer", "llama_json", false],
          ].map(([text, format, forced]) => releasable(text, format, forced));
          await error("choiceWithoutTools", { messages: conversations.offer, tool_choice: "required" });
          await error("badTool", {
            messages: conversations.offer,
            tools: [{ type: "function", function: { name: "rm -rf" } }],
          });
          await error("unknownName", { ...base, tool_choice: { type: "function", function: { name: "nope" } } });
          await error("withSchema", { ...base, tool_choice: "required", response_format: { type: "json_object" } });
        } catch (e) {
          out.failure = String(e?.stack ?? e);
        } finally {
          nt.terminate();
        }
        return out;
      },
      { url: "/test/tools/tools.gguf", tools, conversations },
    );
    assert(!r.failure, r.failure);
    assertEq(r.toolFormat, "hermes", "the template's tool format (info.toolFormat)");
    for (const [key, choice] of [
      ["named", "get_weather"],
      ["required", "required"],
    ]) {
      const want = nativeToolReply({ bin, model, dir, conversation: "offer", choice, parallel: false });
      const choice0 = r[key].choices[0];
      assertEq(choice0.finish_reason, "tool_calls", `${key}: finish_reason`);
      assertEq(choice0.message.content, null, `${key}: content beside the call`);
      const got = choice0.message.tool_calls.map((c) => [c.type, c.function.name, c.function.arguments]);
      const cli = want.tool_calls.map((c) => [c.type, c.function.name, c.function.arguments]);
      assertEq(JSON.stringify(got), JSON.stringify(cli), `${key}: the call vs the CLI's`);
      assert(/^call-[0-9a-f]{24}$/.test(choice0.message.tool_calls[0].id), `${key}: the call's id`);
      const args = JSON.parse(choice0.message.tool_calls[0].function.arguments);
      const schema = tools.find((t) => t.function.name === choice0.message.tool_calls[0].function.name).function
        .parameters;
      for (const k of schema.required) assert(typeof args[k] === "string", `${key}: ${k} in ${JSON.stringify(args)}`);
      for (const k of Object.keys(args)) assert(k in schema.properties, `${key}: ${k} is not in the schema`);
    }
    // Streamed: no content, then the call as delta.tool_calls, then finish_reason "tool_calls".
    const content = r.chunks.map((c) => c.choices[0]?.delta.content ?? "").join("");
    assertEq(content, "", "streamed content beside a forced call");
    const deltas = r.chunks.flatMap((c) => c.choices[0]?.delta.tool_calls ?? []);
    assertEq(deltas.length, 1, "tool_calls deltas");
    assertEq(
      JSON.stringify([deltas[0].index, deltas[0].function]),
      JSON.stringify([0, r.named.choices[0].message.tool_calls[0].function]),
      "the streamed call vs the whole one",
    );
    assertEq(r.chunks.at(-1).choices[0].finish_reason, "tool_calls", "the stream's finish_reason");
    const whole = r.auto.choices[0];
    const streamed = r.autoChunks.map((c) => c.choices[0]?.delta.content ?? "").join("");
    const streamedCalls = r.autoChunks.flatMap((c) => c.choices[0]?.delta.tool_calls ?? []);
    assertEq(streamed, whole.message.content ?? "", '"auto": the streamed content vs the whole answer\'s');
    assertEq(
      JSON.stringify(streamedCalls.map((c) => c.function)),
      JSON.stringify((whole.message.tool_calls ?? []).map((c) => c.function)),
      '"auto": the streamed calls vs the whole answer\'s',
    );
    assertEq(JSON.stringify(r.releasable), JSON.stringify([5, 6, 6, 5, 0, 0, 0, 10]), "what may stream (releasable)");
    // A conversation with a call and its answer: the prompt the CLI renders and prefills.
    const answered = nativeToolReply({ bin, model, dir, conversation: "answered", choice: "auto", parallel: true });
    assertEq(
      r.answered.usage.prompt_tokens,
      answered.prompt_tokens,
      "the answered conversation's prompt tokens vs the CLI's",
    );
    const e = r.errors;
    assertEq(
      e.choiceWithoutTools.param,
      "tool_choice",
      `tool_choice without tools: ${JSON.stringify(e.choiceWithoutTools)}`,
    );
    assertEq(e.badTool.param, "tools", `a tool name that is not one: ${JSON.stringify(e.badTool)}`);
    assertEq(e.unknownName.param, "tool_choice", `a forced name not among the tools: ${JSON.stringify(e.unknownName)}`);
    assertEq(e.withSchema.param, "tool_choice", `a forced call with response_format: ${JSON.stringify(e.withSchema)}`);
  });
}
