// A remote engine: the model runs on a server people already run for models too big for the
// reader's device (llama.cpp's server, llama-cpp-python, vLLM, any OpenAI-compatible endpoint),
// and NextToken talks to it instead of to its worker, in the worker's own messages, so
// `generate`, `reply`, `score`, `abort`, the OpenAI API (openai.js) and `<next-token>` work on it
// unchanged:
//
//   await nt.load("openai+https://host/v1#model");   // or {kind: "remote", url, model, apiKey}
//
// What the server computes arrives as it is: the text, each token's logprob and alternatives
// where it returns `logprobs` (OpenAI's `logprobs`/`top_logprobs`), usage. What only a local
// engine has (token ids, raw logits for the sampler view, branching by ids, beam search, regex
// and Lark constraints) is refused with a message saying so; `info.remote.unavailable` lists it.
// Stop strings are applied here, on the streamed text, as the local engine applies them, so the
// stop reason says which stop it was (a server's "stop" cannot tell a stop string from the end of
// the text).

/** The local engine's defaults, so a run means the same on either engine. */
const DEFAULT_TEMPERATURE = 0.8;
const DEFAULT_MAX_TOKENS = 256;
const DEFAULT_TOP_LOGPROBS = 5;
const MAX_TOP_LOGPROBS = 20;

/** What a remote engine cannot do, as `info.remote.unavailable` lists it. */
export const REMOTE_UNAVAILABLE = [
  "token ids (servers send token text)",
  "the sampler view (needs the step's logits)",
  "branching at a token (needs token ids)",
  "beam search",
  "regex and Lark constraints (JSON schemas and JSON objects go to the server)",
  "the first token's probability in a score (servers give none for it)",
  "the end-of-text token's event and probability (servers stream none for it)",
];

/**
 * The spec of a remote model reference, `openai+http(s)://host/v1#model` (the model's id as the
 * server's /models lists it; without one, the server's first model), or null when `ref` is not
 * one.
 */
export function remoteSpec(ref) {
  const m = /^openai\+(https?:\/\/[^#]+)(?:#(.*))?$/i.exec(ref);
  if (!m) return null;
  const url = m[1].replace(/\/+$/, "");
  const model = m[2] ? decodeURIComponent(m[2]) : "";
  return { kind: "remote", id: ref, url, model, name: model || new URL(url).host };
}

class RemoteError extends Error {
  constructor(message, retryable = false) {
    super(message);
    this.retryable = retryable;
  }
}

/** An HTTP error answer's message (OpenAI's `{error: {message}}`, FastAPI's `{detail}`, or text). */
async function errorOf(response) {
  const text = await response.text().catch(() => "");
  let message = text.slice(0, 500);
  try {
    const body = JSON.parse(text);
    const detail = body.error?.message ?? body.error ?? body.detail ?? body.message;
    if (detail !== undefined) message = typeof detail === "string" ? detail : JSON.stringify(detail).slice(0, 500);
  } catch {}
  return `HTTP ${response.status}${message ? `: ${message}` : ""}`;
}

/** The `data:` payloads of a server-sent event stream, parsed; ends at `[DONE]`. */
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    buffer += decoder.decode(value, { stream: !done });
    const blocks = buffer.split(/\r?\n\r?\n/);
    buffer = done ? "" : blocks.pop();
    for (const block of blocks) {
      const data = block
        .split(/\r?\n/)
        .filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart())
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
    if (done) return;
  }
}

const alternative = (token, logprob) => ({ id: null, token, piece: token, prob: Math.exp(logprob), logprob });

/**
 * The tokens of one streamed chunk as the local engine's token events (without the running
 * totals NextToken adds): from the chat API's `logprobs.content` or the completions API's
 * `logprobs` lists, or one event carrying the chunk's text where the server sent no logprobs.
 * The pieces of a chunk whose text is not their concatenation (a server that cleans up bytes)
 * give the chunk's text to its last token.
 */
function chunkTokens(text, logprobs) {
  let entries = [];
  if (Array.isArray(logprobs?.content)) {
    entries = logprobs.content.map((e) => ({
      token: e.token,
      logprob: e.logprob,
      top: (e.top_logprobs ?? []).map((a) => alternative(a.token, a.logprob)),
    }));
  } else if (Array.isArray(logprobs?.tokens)) {
    entries = logprobs.tokens.map((token, i) => ({
      token,
      logprob: logprobs.token_logprobs?.[i],
      top: Object.entries(logprobs.top_logprobs?.[i] ?? {}).map(([t, lp]) => alternative(t, lp)),
    }));
  }
  if (!entries.length)
    return text ? [{ id: null, text, token: text, piece: text, prob: null, logprob: null, top: [] }] : [];
  const joined = entries.map((e) => e.token).join("") === text;
  return entries.map((e, i) => ({
    id: null,
    text: joined ? e.token : i === entries.length - 1 ? text : "",
    token: e.token,
    piece: e.token,
    prob: typeof e.logprob === "number" ? Math.exp(e.logprob) : null,
    logprob: typeof e.logprob === "number" ? e.logprob : null,
    top: e.top.sort((a, b) => b.logprob - a.logprob),
  }));
}

/** Where the first of `stops` occurs in `text` at or after `from` (-1: nowhere). */
function stopAt(text, stops, from) {
  let at = -1;
  for (const s of stops) {
    const i = text.indexOf(s, Math.max(0, from - s.length + 1));
    if (i >= 0 && (at < 0 || i < at)) at = i;
  }
  return at;
}

/**
 * The server's answer to the engine's `constraint`: OpenAI's response_format for a JSON schema
 * (llama.cpp, vLLM, OpenAI), or `{type: "json_object", schema}` (llama-cpp-python, llama.cpp)
 * when the server refuses the first.
 */
function responseFormats(constraint) {
  if (!constraint) return [undefined];
  if (constraint.type === "json_object") return [{ type: "json_object" }];
  if (constraint.type === "json_schema")
    return [
      { type: "json_schema", json_schema: { name: "output", schema: constraint.schema, strict: true } },
      { type: "json_object", schema: constraint.schema },
    ];
  throw new RemoteError(
    `a remote engine takes JSON schemas and JSON objects as constraints, not ${constraint.type === "regex" ? "a regex" : "a Lark grammar"}: servers share no grammar dialect`,
  );
}

/**
 * One server and model, speaking the worker's messages (see worker.js): `receive(message,
 * reply)` answers "load", "generate", "chat", "score", "abort" and the rest as the worker would.
 */
export class RemoteEngine {
  constructor(spec, { apiKey } = {}) {
    this.spec = spec;
    this.apiKey = apiKey ?? spec.apiKey;
    this.model = spec.model;
    this.running = new Map(); // id -> AbortController
  }

  async #fetch(path, body, signal) {
    const headers = { "content-type": "application/json" };
    if (this.apiKey) headers.authorization = `Bearer ${this.apiKey}`;
    let response;
    try {
      response = await fetch(`${this.spec.url}${path}`, {
        method: body ? "POST" : "GET",
        headers,
        body: body && JSON.stringify(body),
        signal,
      });
    } catch (e) {
      if (e.name === "AbortError") throw e;
      throw new RemoteError(
        `could not reach the remote engine at ${this.spec.url} (${e.message}): is the server running, and does it allow this page's origin (CORS)?`,
        true,
      );
    }
    if (!response.ok)
      throw new RemoteError(
        `the remote engine at ${this.spec.url} answered ${await errorOf(response)}`,
        response.status >= 500,
      );
    return response;
  }

  receive(message, reply) {
    const { id } = message;
    const fail = (e) => reply({ type: "error", id, message: e.message, retryable: !!e.retryable });
    switch (message.type) {
      case "load":
        return this.#load(id).then((m) => reply(m), fail);
      case "generate":
      case "chat":
        return this.#generate(message, reply).catch((e) =>
          e.name === "AbortError" ? reply({ type: "done", id, summary: null }) : fail(e),
        );
      case "abort":
        return this.running.get(id)?.abort();
      case "score":
        return this.#score(message).then((value) => reply({ type: "result", id, value }), fail);
      case "unload":
        for (const c of this.running.values()) c.abort();
        return;
      default:
        return fail(new RemoteError(`${message.type} is not available on a remote engine (${this.spec.url})`));
    }
  }

  async #load(id) {
    const t0 = performance.now();
    const listed = (await (await this.#fetch("/models")).json())?.data ?? [];
    const ids = listed.map((m) => m.id);
    if (!this.model) this.model = ids[0];
    const entry = listed.find((m) => m.id === this.model);
    if (!entry)
      throw new RemoteError(
        this.model
          ? `the remote engine at ${this.spec.url} serves no model ${JSON.stringify(this.model)} (it lists ${ids.map((i) => JSON.stringify(i)).join(", ") || "none"})`
          : `the remote engine at ${this.spec.url} lists no models`,
      );
    // llama.cpp's server describes the model in `meta`; others say nothing of it.
    const meta = entry.meta ?? {};
    const host = new URL(this.spec.url).host;
    const info = {
      kind: "remote",
      backend: "remote",
      backendDetail: `${this.model} on ${host}`,
      name: this.model,
      description: `${this.model}, served by ${this.spec.url}`,
      arch: meta.arch ?? "remote",
      nVocab: meta.n_vocab ?? 0,
      nCtx: meta.n_ctx_train ?? meta.n_ctx ?? entry.max_model_len ?? 0,
      nLayer: 0,
      nEmbd: meta.n_embd ?? 0,
      parameters: meta.n_params ?? 0,
      bytes: meta.size ?? 0,
      weightBytesPerToken: 0,
      words: [],
      chatTemplate: null,
      // The server reads calls out of the reply itself (its `tool_calls`).
      toolFormat: "server",
      weightsInWasmBytes: 0,
      loadPath: "",
      wasmMemoryBytes: 0,
      version: "",
      threads: 0,
      threadsNote: "",
      engine: "remote",
      engineNote: `a server engine (${host}): the model runs there, not in this browser`,
      enginePages: 1,
      modelUsers: 1,
      remote: { url: this.spec.url, model: this.model, unavailable: REMOTE_UNAVAILABLE },
    };
    return { type: "loaded", id, info, timings: { downloadMs: 0, initMs: performance.now() - t0 } };
  }

  /** The request body of a generation: the local engine's options in OpenAI's fields. */
  #body(message) {
    const o = message.options ?? {};
    if (message.ids)
      throw new RemoteError("a remote engine takes text, not token ids (branching at a token is local only)");
    if ((o.beams ?? 1) > 1) throw new RemoteError("beam search is not available on a remote engine");
    if (o.forceTokens?.length) throw new RemoteError("forced tokens need token ids: not available on a remote engine");
    const top = Math.min(Math.max(0, o.topLogprobs ?? DEFAULT_TOP_LOGPROBS), MAX_TOP_LOGPROBS);
    const body = {
      model: this.model,
      stream: true,
      // The prompt's token count at the end of the stream (OpenAI, llama.cpp, vLLM; others ignore it).
      stream_options: { include_usage: true },
      max_tokens: o.maxTokens ?? DEFAULT_MAX_TOKENS,
      temperature: o.temperature ?? DEFAULT_TEMPERATURE,
    };
    if (o.seed !== undefined) body.seed = o.seed;
    body.top_p = o.topP ?? 1;
    // Not OpenAI's fields but llama.cpp's, llama-cpp-python's and vLLM's: sent with the local
    // engine's defaults (all off), since servers' own differ (llama-cpp-python penalises repeats
    // by 1.1 and keeps the top 40 unless told): the same options sample the same way on either
    // engine. OpenAI's own API refuses fields it does not know, so it gets them only when set.
    const strict = new URL(this.spec.url).hostname === "api.openai.com";
    const extension = (name, value, off) => {
      if (value !== off || !strict) body[name] = value;
    };
    extension("top_k", o.topK ?? 0, 0);
    extension("min_p", o.minP ?? 0, 0);
    extension("repeat_penalty", o.repeatPenalty ?? 1, 1);
    if (o.repeatPenalty !== undefined && o.repeatPenalty !== 1) body.repetition_penalty = o.repeatPenalty;
    if (message.type === "chat") {
      body.messages = message.messages;
      body.logprobs = true;
      body.top_logprobs = top;
      if (o.tools?.length) {
        body.tools = o.tools;
        const choice = o.toolChoice;
        if (choice !== undefined)
          body.tool_choice = ["auto", "none", "required"].includes(choice)
            ? choice
            : typeof choice === "string"
              ? { type: "function", function: { name: choice } }
              : choice;
        if (o.parallelToolCalls === false) body.parallel_tool_calls = false;
      }
    } else {
      body.prompt = message.prompt;
      body.logprobs = top;
    }
    return body;
  }

  async #generate(message, reply) {
    const { id } = message;
    const o = message.options ?? {};
    const body = this.#body(message);
    const path = message.type === "chat" ? "/chat/completions" : "/completions";
    const formats = responseFormats(o.constraint);
    if (o.constraint && message.type !== "chat")
      throw new RemoteError("structured output on a remote engine goes through chat (reply, chat.completions)");
    const stops = (o.stop ?? []).filter((s) => typeof s === "string" && s);
    const controller = new AbortController();
    this.running.set(id, controller);
    const t0 = performance.now();
    try {
      let response;
      for (const [i, format] of formats.entries()) {
        try {
          response = await this.#fetch(path, format ? { ...body, response_format: format } : body, controller.signal);
          break;
        } catch (e) {
          // A server that takes the other shape of response_format (a 400, a 422 or, from
          // llama-cpp-python, a 500 naming the field).
          if (i === formats.length - 1 || !/response_format/.test(e.message)) throw e;
        }
      }
      let text = "";
      let generated = 0;
      let finish = null;
      let usage = null;
      let firstAt = null;
      let stopped = false;
      const calls = new Map(); // index -> {id, type, function: {name, arguments}}
      for await (const event of events(response)) {
        if (event.error)
          throw new RemoteError(`the remote engine failed: ${event.error.message ?? JSON.stringify(event.error)}`);
        if (event.usage) usage = event.usage;
        const choice = event.choices?.[0];
        if (!choice) continue;
        for (const call of choice.delta?.tool_calls ?? []) {
          const c = calls.get(call.index ?? 0) ?? {
            id: call.id,
            type: "function",
            function: { name: "", arguments: "" },
          };
          if (call.id) c.id = call.id;
          c.function.name += call.function?.name ?? "";
          c.function.arguments += call.function?.arguments ?? "";
          calls.set(call.index ?? 0, c);
        }
        const chunkText = choice.delta ? (choice.delta.content ?? "") : (choice.text ?? "");
        for (const token of chunkTokens(chunkText, choice.logprobs)) {
          firstAt ??= performance.now();
          const before = text.length;
          text += token.text;
          const at = stops.length ? stopAt(text, stops, before) : -1;
          if (at >= 0) {
            token.text = token.text.slice(0, Math.max(0, at - before));
            text = text.slice(0, at);
          }
          reply({ type: "token", id, token: { ...token, position: generated } });
          generated += 1;
          if (at >= 0) {
            stopped = true;
            break;
          }
        }
        if (choice.finish_reason) finish = choice.finish_reason;
        if (stopped) break;
      }
      if (stopped) controller.abort(); // the server stops at the closed connection
      const end = performance.now();
      const ttft = (firstAt ?? end) - t0;
      const toolCalls = [...calls.values()].map((c) => {
        let args = c.function.arguments;
        try {
          args = JSON.parse(args);
        } catch {}
        return { id: c.id, type: "function", function: { name: c.function.name, arguments: args } };
      });
      const summary = {
        promptTokens: usage?.prompt_tokens ?? null,
        reusedTokens: usage?.prompt_tokens_details?.cached_tokens ?? 0,
        generatedTokens: generated,
        text,
        stopReason: stopped ? "StopString" : stopReason(finish, !!o.constraint),
        prefillMs: ttft,
        decodeMs: end - (firstAt ?? end),
        ttftMs: ttft,
        prefillTokS: usage?.prompt_tokens ? usage.prompt_tokens / (ttft / 1000) : 0,
        decodeTokS: generated > 1 ? (generated - 1) / ((end - firstAt) / 1000) : 0,
        backend: "remote",
        finishReason: finish,
      };
      reply({
        type: "done",
        id,
        summary,
        messages: message.messages,
        promptIds: [],
        reply: o.tools?.length ? { content: text, toolCalls } : undefined,
      });
    } finally {
      this.running.delete(id);
    }
  }

  /**
   * The chain rule from the server's logprobs of its own prompt (the completions API with
   * `echo`, as llama-cpp-python (`--logits_all`) and vLLM give them): the text's tokens are those
   * from the scored text's offset on. A server that cannot echo logprobs cannot score.
   */
  async #score({ text, after }) {
    const prefix = after ?? "";
    const response = await this.#fetch("/completions", {
      model: this.model,
      prompt: prefix + text,
      max_tokens: 1,
      temperature: 0,
      logprobs: 1,
      echo: true,
    });
    const body = await response.json();
    const lp = body.choices?.[0]?.logprobs;
    if (!Array.isArray(lp?.tokens) || !Array.isArray(lp?.text_offset))
      throw new RemoteError(
        `the remote engine at ${this.spec.url} returns no logprobs for the prompt (echo), so it cannot score text${/llama/i.test(JSON.stringify(body).slice(0, 200)) ? " (llama-cpp-python: start it with --logits_all true)" : ""}`,
      );
    // The echoed prompt's tokens, then the generated one(s).
    const promptCount = lp.tokens.length - (body.usage?.completion_tokens ?? 1);
    const tokens = [];
    for (let i = 0; i < promptCount; i++) {
      if (lp.text_offset[i] < prefix.length) continue;
      const logprob = lp.token_logprobs[i];
      tokens.push({
        id: null,
        token: lp.tokens[i],
        piece: lp.tokens[i],
        prob: typeof logprob === "number" ? Math.exp(logprob) : null,
        logprob: typeof logprob === "number" ? logprob : null,
      });
    }
    const scored = tokens.filter((t) => t.logprob !== null);
    const logprob = scored.reduce((s, t) => s + t.logprob, 0);
    const avgNll = scored.length ? -logprob / scored.length : 0;
    return {
      tokens,
      logprob,
      probability: Math.exp(logprob),
      avgNll,
      perplexity: Math.exp(avgNll),
      backend: "remote",
      unscored: tokens.length - scored.length,
    };
  }
}

/** The local engine's stop reason for a server's `finish_reason`. */
function stopReason(finish, constrained) {
  if (finish === "length") return constrained ? "Incomplete" : "MaxTokens";
  if (finish === null) return "Aborted";
  return constrained ? "ConstraintComplete" : "Eos";
}
