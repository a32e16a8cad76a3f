// nexttoken's JavaScript API: the model runs in a Web Worker (worker.js), this module talks to it.
//
//   import { NextToken } from "./nexttoken.js";
//   const nt = new NextToken();
//   const info = await nt.load("models/lesson-toy.json", { onProgress: (p) => ... });
//   for await (const t of nt.generate("the", { temperature: 0, maxTokens: 8 })) {
//     t.text, t.prob, t.top, t.logprobSum, t.perplexity
//   }
//   nt.lastSummary;  // TTFT, prefill / decode tok/s, stop reason
//   nt.abort();      // stops at once: no token after this reaches the caller
//   await nt.score("the cat sat");  // {tokens: [{token, prob, logprob}], probability, perplexity}
//
// Chat models (a GGUF with a chat template), turn after turn on one KV cache:
//   for await (const t of nt.reply([{ role: "user", content: "Hi!" }])) t.text;
// or through OpenAI's API shape (openai.js):
//   const r = await nt.chat.completions.create({ messages, max_tokens: 64 });
//
// The module-level functions `load`, `generate`, `reply`, `abort`, `score`, `chat` and
// `completions` use one shared instance.

import { openAI } from "./openai.js";
import { hostPool, moduleWorker, threadsUnavailable } from "./pool.js";
import { RemoteEngine, remoteSpec } from "./remote.js";

/** Models the page offers (`url`: a URL or a Hugging Face reference, see `resolveModelUrl`). */
export const CATALOG = [
  // Shipped with the site (`shipped`: no download, so a pick loads it at once): a chat model, the
  // default model, and the lessons' tables.
  {
    id: "chat",
    name: "Chat: the default model taught to take turns (2.1 MB)",
    kind: "gguf",
    url: "models/chat.gguf",
    tokenizer: "models/default-tokenizer.json",
    shipped: true,
    prompt: "In the beginning God created the heaven and the earth.",
    note: "a responsive reading of the King James Bible: say a verse and it answers with (its idea of) the next one. Not an assistant: 2M parameters, no instructions or facts (models/chat.md)",
  },
  {
    id: "default",
    name: "Default: 2M-parameter llama trained on the King James Bible (2.1 MB)",
    kind: "gguf",
    url: "models/default.gguf",
    tokenizer: "models/default-tokenizer.json",
    shipped: true,
    prompt: "In the beginning",
    note: "trained from scratch for this site (see models/README.md): fluent-looking KJV phrasing with little sense",
  },
  {
    id: "lesson-toy",
    name: "Lesson: the cat and the dog (table model)",
    kind: "table",
    url: "models/lesson-toy.json",
    note: "a bigram table you can check by hand: P(the cat sat) = 0.6 × 0.7 = 0.42",
  },
  {
    id: "lesson-perplexity",
    name: "Lesson: log P and perplexity (table model)",
    kind: "table",
    url: "models/lesson-perplexity.json",
    prompt: "",
    note: "score “the sun is warm </s>” (perplexity 1.28) against “the moon ate seven </s>” (3.79); after “digits”, 400 digits at P = 0.1 give log P = -921.0",
  },
  {
    id: "lesson-beam",
    name: "Lesson: greedy vs beam search (table model)",
    kind: "table",
    url: "models/lesson-beam.json",
    // Beam search from the very start: with a prompt the lesson's two sentences never compete.
    prompt: "",
    note: "greedy finds “the cat” (0.33); 2 beams find “a bird” (0.36)",
  },
  // Instruct models from the Hugging Face Hub: each GGUF carries its tokenizer and chat template.
  {
    id: "smollm2-135m",
    name: "SmolLM2-135M-Instruct (Q8_0, 145 MB)",
    kind: "gguf",
    url: "hf:bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q8_0.gguf",
    size: 144_811_712,
  },
  {
    id: "smollm2-360m",
    name: "SmolLM2-360M-Instruct (Q8_0, ≈386 MB)",
    kind: "gguf",
    url: "hf:bartowski/SmolLM2-360M-Instruct-GGUF/SmolLM2-360M-Instruct-Q8_0.gguf",
  },
  {
    id: "qwen2.5-0.5b",
    name: "Qwen2.5-0.5B-Instruct (Q8_0, ≈676 MB)",
    kind: "gguf",
    url: "hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q8_0.gguf",
  },
  {
    id: "llama-3.2-1b",
    name: "Llama-3.2-1B-Instruct (Q4_K_M, ≈808 MB)",
    kind: "gguf",
    url: "hf:bartowski/Llama-3.2-1B-Instruct-GGUF/Llama-3.2-1B-Instruct-Q4_K_M.gguf",
    note: "Meta's Llama 3.2 Community License applies",
  },
];

const HUB = "https://huggingface.co";
const REPO_PART = /^[A-Za-z0-9][A-Za-z0-9._-]*$/;

/**
 * The download URL of a Hugging Face reference, or `ref` itself when it is not one:
 * `hf:owner/repo/path/file.gguf`, `hf:owner/repo@revision/file.gguf` and
 * `owner/repo:file.gguf` (the file in the repository's main branch). A reference that names no
 * `.gguf` file (e.g. llama.cpp's `owner/repo:Q4_K_M`) is an error: the page cannot list a
 * repository's files offline, so it asks for the file name.
 */
export function resolveModelUrl(ref) {
  let owner, repo, revision, file;
  const bad = (why) => new Error(`${JSON.stringify(ref)}: ${why}`);
  if (ref.startsWith("hf:")) {
    const parts = ref.slice(3).replace(/^\/+/, "").split("/");
    if (parts.length < 3) throw bad("expected hf:owner/repo/file.gguf");
    [owner, repo] = parts;
    [repo, revision = "main"] = repo.split("@");
    file = parts.slice(2).join("/");
  } else {
    const short = /^([^/:]+)\/([^/:]+):(.+)$/.exec(ref);
    if (!short) return ref;
    [, owner, repo, file] = short;
    revision = "main";
  }
  if (!REPO_PART.test(owner) || !REPO_PART.test(repo))
    throw bad("owner and repository names are letters, digits, '.', '_' and '-'");
  if (!/\.gguf$/i.test(file))
    throw bad(`name the .gguf file in the repository (e.g. ${owner}/${repo}:model-Q8_0.gguf)`);
  if (file.split("/").some((p) => p === "" || p === "." || p === ".."))
    throw bad("the file path has an empty, '.' or '..' part");
  const path = file.split("/").map(encodeURIComponent).join("/");
  return `${HUB}/${owner}/${repo}/resolve/${encodeURIComponent(revision)}/${path}`;
}

/** Relative model URLs of a page (or an attribute) are relative to the page. */
const pageBase = () => globalThis.document?.baseURI ?? self.location.href;
const absolute = (url, base) => (url ? new URL(url, base).href : url);

/**
 * A model spec from a catalog entry, a URL or Hugging Face reference (".json" = table model) or a
 * spec object. Its URLs come out absolute: a catalog entry's relative to this script (its files
 * ship beside it, wherever it is hosted), others relative to the page; the worker may run from
 * another origin's script, where a relative URL would mean something else.
 */
export function resolveSpec(model, tokenizer) {
  if (typeof model === "string" && remoteSpec(model)) return remoteSpec(model);
  if (model?.kind === "remote") return { ...model, url: String(model.url).replace(/\/+$/, "") };
  if (typeof model === "string") {
    const entry = CATALOG.find((m) => m.id === model);
    if (entry)
      return {
        ...entry,
        url: absolute(resolveModelUrl(entry.url), import.meta.url),
        tokenizer: absolute(entry.tokenizer, import.meta.url),
      };
    const url = absolute(resolveModelUrl(model), pageBase());
    const isTable = /\.json(\?|#|$)/i.test(url);
    const spec = { id: model, name: model.split("/").pop(), kind: isTable ? "table" : "gguf", url };
    // A GGUF without a tokenizer URL uses the tokenizer its own metadata describes.
    if (!isTable && tokenizer) spec.tokenizer = absolute(tokenizer, pageBase());
    return spec;
  }
  const url = absolute(resolveModelUrl(model.url), pageBase());
  return {
    kind: /\.json(\?|#|$)/i.test(url) ? "table" : "gguf",
    ...model,
    url,
    tokenizer: absolute(model.tokenizer, pageBase()),
  };
}

let persistAsked = false;
/** Ask the browser to keep our storage (cached models) under storage pressure. */
export async function requestPersistentStorage() {
  if (persistAsked || !navigator.storage?.persist) return null;
  persistAsked = true;
  try {
    return (await navigator.storage.persisted()) || (await navigator.storage.persist());
  } catch {
    return false;
  }
}

/**
 * Which worker runs the engine for `requested` ("auto", "shared" or "dedicated") and the worker
 * script `url`: `{kind: "shared" | "dedicated", note}`, the note saying why. A shared worker is one
 * engine for every page of the site (one download, one copy of a model in memory), but it runs one
 * thread: today's browsers start no threads that share its memory. So "auto" shares where this
 * page would run one thread anyway (not cross-origin isolated, one core), and keeps the page's own
 * worker where the threads build runs. A shared worker's script must be on the page's origin.
 */
export function engineChoice(requested = "auto", url = new URL("./worker.js", import.meta.url)) {
  const own = (why) => ({ kind: "dedicated", note: `this page's own engine: ${why}` });
  if (requested === "dedicated") return own('engine: "dedicated" was asked for');
  if (typeof SharedWorker === "undefined") return own("this browser (or context) has no SharedWorker");
  if (new URL(url, pageBase()).origin !== new URL(pageBase()).origin)
    return own(
      "its script is on another origin (a CDN): a shared engine needs a worker script on the page's own origin (workerUrl)",
    );
  if (requested === "shared")
    return { kind: "shared", note: 'one engine for every tab of this site (engine: "shared")' };
  const oneThread = threadsUnavailable();
  if (!oneThread)
    return own(`it runs the threads build here (${navigator.hardwareConcurrency} cores), which a shared engine cannot`);
  return {
    kind: "shared",
    note: "one engine for every tab of this site (this page would run one thread anyway)",
    oneThread,
  };
}

/**
 * One worker and its message routing; several NextToken instances may share one. A shared
 * worker that fails to start (before it says hello) is replaced by a dedicated one, and the
 * requests sent so far go to that.
 */
class WorkerLink {
  constructor(workerUrl, requested) {
    this.url = workerUrl || new URL("./worker.js", import.meta.url);
    this.nextId = 1;
    this.pending = new Map(); // id -> handler(message)
    this.choice = engineChoice(requested, this.url);
    if (this.choice.kind === "shared") this.#startShared();
    else this.#startDedicated();
  }

  get kind() {
    return this.choice.kind;
  }

  post(message) {
    this.early?.push(message);
    this.worker.postMessage(message);
  }

  #fail(why) {
    const message = `the inference worker failed: ${why}`;
    for (const handler of this.pending.values()) handler({ type: "error", message });
  }

  #startDedicated() {
    try {
      this.worker = moduleWorker(this.url);
    } catch (e) {
      // Reported to every request, as a worker that fails later would be.
      this.worker = { postMessage: () => queueMicrotask(() => this.#fail(e.message)), terminate() {} };
      return;
    }
    this.stopPool = hostPool(this.worker);
    this.worker.onmessage = (e) => this.pending.get(e.data.id)?.(e.data);
    this.worker.onerror = (e) =>
      this.#fail(
        e.message ||
          `could not start ${this.url} (is www/pkg built? from another origin its host must send CORS headers, and a CSP must allow it in worker-src)`,
      );
  }

  #startShared() {
    const fallBack = (why) => {
      this.choice = { kind: "dedicated", note: `this page's own engine: the shared one did not start (${why})` };
      const early = this.early ?? [];
      this.early = null;
      this.#startDedicated();
      for (const m of early) this.worker.postMessage(m);
    };
    let shared;
    try {
      shared = new SharedWorker(new URL(this.url, pageBase()), { type: "module", name: "nexttoken" });
    } catch (e) {
      return fallBack(e.message);
    }
    this.early = []; // sent before the worker said hello: sent again if it never does
    this.worker = shared.port;
    this.worker.onmessage = ({ data }) => {
      if (data?.type === "hello") this.early = null;
      else this.pending.get(data?.id)?.(data);
    };
    shared.onerror = (e) => {
      if (this.early) fallBack(e.message || `could not start ${this.url} as a shared worker`);
      else this.#fail(e.message || "the shared engine stopped");
    };
    // The page is going for good (not into the back/forward cache): its models are let go. Not
    // every browser delivers a message posted as the page goes, and a crashed page sends none:
    // the page also holds a Web Lock for its life, which the worker asks for too (granted once
    // the page is gone).
    addEventListener("pagehide", (e) => e.persisted || this.worker.postMessage({ type: "bye" }));
    const lock = `nexttoken-page-${crypto.randomUUID?.() ?? Math.random()}`;
    navigator.locks
      ?.request(lock, () => {
        this.worker.postMessage({ type: "alive-while", lock });
        return new Promise(() => {});
      })
      .catch(() => {});
  }
}

/** Links shared by the instances of this page that ask for one (shareWorker, or a shared engine). */
const links = new Map();
let nextSlot = 1;

/**
 * The running log P (natural log) and perplexity of a sequence of tokens: `add(token)` returns
 * the token with `logprobSum` and `perplexity` over it and every token before. Start from
 * `(sum, count)` to continue a sequence (a branch continues its prefix's totals).
 */
export class RunningLogP {
  constructor(sum = 0, count = 0) {
    this.sum = sum;
    this.count = count;
  }

  add(token) {
    this.sum += token.logprob;
    this.count += 1;
    return { ...token, logprobSum: this.sum, perplexity: Math.exp(-this.sum / this.count) };
  }
}

export class NextToken {
  /**
   * `workerUrl`: the worker script (default: worker.js beside this module). `shareWorker`: use the
   * page's one shared worker (and its one wasm instance) instead of a worker of its own; each
   * instance still loads its own model there (a model loaded twice is held once).
   * `engine`: "auto" (default), "shared" (one engine for every page of this site: a
   * SharedWorker; one thread) or "dedicated" (a worker of this page); see `engineChoice`. After a
   * load, `info.engine` says which one runs and `info.engineNote` why.
   * `remote`: a remote engine to offer where a model is too big for this device (a reference
   * `load` takes, "openai+https://host/v1#model"): `preflight` then names it beside its refusal.
   * `apiKey`: sent to remote engines as a bearer token.
   */
  constructor({ workerUrl, shareWorker = false, engine = "auto", remote, apiKey } = {}) {
    this.remoteOffer = remote ? resolveSpec(remote) : null;
    if (this.remoteOffer && this.remoteOffer.kind !== "remote")
      throw new Error(`remote: ${JSON.stringify(remote)} is not a remote engine (openai+https://host/v1#model)`);
    this.apiKey = apiKey;
    this.remote = null; // the RemoteEngine a remote model was loaded on
    // OpenAI's API shape: nt.chat.completions.create(...), nt.completions.create(...).
    const api = openAI(this);
    this.chat = api.chat;
    this.completions = api.completions;
    const choice = engineChoice(engine, workerUrl || new URL("./worker.js", import.meta.url));
    const key = `${choice.kind} ${workerUrl || ""}`;
    // A shared engine is one connection per page, whatever asks for it.
    if (shareWorker || choice.kind === "shared") {
      if (!links.has(key)) links.set(key, new WorkerLink(workerUrl, engine));
      this.link = links.get(key);
    } else this.link = new WorkerLink(workerUrl, engine);
    this.shared = shareWorker || choice.kind === "shared";
    this.slot = nextSlot++; // this instance's model in the worker
    this.pending = this.link.pending;
    this.current = null; // id of the generation in progress
    this.stopped = new Set(); // ids of generations aborted by the caller
    this.info = null;
    this.lastSummary = null;
    /** Called with the new info when the model moves to another backend mid-generation. */
    this.onBackendChange = null;
  }

  get worker() {
    return this.link.worker;
  }

  /** To the engine this instance's model runs on (`local`: the worker, whatever is loaded). */
  #post(message, local = false) {
    if (this.remote && !local) this.remote.receive(message, (reply) => this.pending.get(reply.id)?.(reply));
    else this.link.post({ ...message, slot: this.slot });
  }

  /** The info of a loaded model as the worker gave it, with why this engine runs it. */
  #withEngine(info) {
    if (info.engine === "remote") return info;
    const { choice } = this.link;
    // On a shared engine the page's own reason for one thread (when it has one) is the one
    // that tells the reader something.
    const threadsNote = (info.engine === "shared" && choice.oneThread) || info.threadsNote;
    return { ...info, engine: info.engine ?? choice.kind, engineNote: choice.note, threadsNote };
  }

  /**
   * Load a model (replacing the current one). `model`: catalog id, URL or {url, tokenizer, kind,
   * sha256}; a GGUF's `tokenizer` (a tokenizer.json URL, also an option here) is optional: without
   * it the tokenizer the GGUF's own metadata describes is used. Options: `onProgress({file, loaded,
   * total, fromCache, part, parts, doneBytes})` (a model split by gguf-split, loaded from the URL
   * of its first part `NAME-00001-of-0000N.gguf`, comes in `parts` files: `loaded`/`total` count
   * the current one, `doneBytes` the ones before; `sha256` is then a list, one per part, and
   * `size` the whole model's), `onWarning(message)`, `backend` ("auto" | "gpu" | "cpu"), `maxSeq`,
   * `exact` (CPU path: the reference kernels, f32 activations, instead of the fast int8 ones),
   * `threads` (CPU path: at most this many threads; default: the pool's size), `signal`. Resolves to the model's info plus `timings`
   * {downloadMs, initMs, backendMs} ({reused, waitMs} when the engine held the model already: another
   * tab, element or instance loaded it; `info.engine` and `info.engineNote` say which engine); rejects with an Error whose `retryable` says if retrying may help.
   * `backend: "auto"` never takes a software adapter (SwiftShader) and, on a real GPU, checks it
   * against the CPU path and keeps the faster of the two for this model (remembered per model and
   * adapter): `info.backendReason` says what it measured. A GPU lost mid-generation moves the
   * model to the CPU path and the text goes on (`onBackendChange(info)`). `allowSoftwareGpu`
   * (tests): "auto" treats a software adapter as a real GPU.
   */
  load(
    model,
    {
      onProgress,
      onWarning,
      backend = "auto",
      maxSeq = 2048,
      exact = false,
      threads,
      tokenizer,
      signal,
      allowSoftwareGpu = false,
      draft,
    } = {},
  ) {
    const spec = resolveSpec(model, tokenizer);
    const draftSpec = draft ? resolveSpec(draft) : undefined;
    if (spec.kind === "gguf") requestPersistentStorage();
    const id = this.link.nextId++;
    this.info = null;
    // A remote model answers this instance's messages from now on; a local one, the worker again.
    this.remote?.receive({ type: "unload" }, () => {});
    this.remote = null;
    if (spec.kind === "remote") {
      this.link.post({ type: "unload", slot: this.slot });
      this.remote = new RemoteEngine(spec, { apiKey: this.apiKey });
    }
    return new Promise((resolve, reject) => {
      const onAbort = () => this.#post({ type: "cancel-load", id });
      signal?.addEventListener("abort", onAbort, { once: true });
      this.pending.set(id, (msg) => {
        if (msg.type === "progress") onProgress?.(msg);
        else if (msg.type === "warning") onWarning ? onWarning(msg.message) : console.warn(msg.message);
        else {
          this.pending.delete(id);
          signal?.removeEventListener("abort", onAbort);
          if (msg.type === "loaded") {
            this.info = { ...this.#withEngine(msg.info), spec, timings: msg.timings };
            resolve(this.info);
          } else {
            const err = new Error(msg.message);
            err.retryable = !!msg.retryable;
            reject(err);
          }
        }
      });
      this.#post({
        type: "load",
        id,
        spec,
        options: { backend, maxSeq, exact, threads, allowSoftwareGpu, draft: draftSpec },
      });
    });
  }

  /**
   * Generate a continuation of `prompt`, token by token: an async iterator of
   * `{id, text, token, piece, prob, logprob, top: [{id, token, piece, prob, logprob}], position,
   * logprobSum, perplexity}` (`logprobSum` and `perplexity` run over the generated tokens so
   * far). Options: maxTokens, temperature, topK, topP, minP, repeatPenalty, repeatWindow, seed,
   * stop, topLogprobs (alternatives per token, default 5, at most 20), beams, lengthNormalise,
   * constraint (structured output: `{type: "json_schema", schema}`, `{type: "json_object"}`,
   * `{type: "regex", pattern}` or `{type: "grammar", lark}`; tokens then carry `removed`, the
   * likely tokens the constraint refused, and `lastSummary.stopReason` is "ConstraintComplete",
   * or "Incomplete" when max tokens or the context ran out first).
   * The prefix this prompt shares with the previous generation's is not computed again
   * (`lastSummary.reusedTokens`). `prompt` may also be `{ids: [...]}`: token ids as they are
   * (no BOS added), e.g. `lastSummary.promptIds` plus the ids of the tokens before a position
   * plus another token: a branch. When it ends, `lastSummary` holds the totals and `promptIds`
   * (and, for a beam search, `beamTree`: every extension it considered, `{nodes: [{parent, step,
   * id, piece, logprob, kept, finished}], best}`).
   */
  generate(prompt, options = {}) {
    if (typeof prompt === "object" && prompt !== null && "ids" in prompt)
      return this.#stream({ type: "generate", ids: Array.from(prompt.ids), options });
    return this.#stream({ type: "generate", prompt, options });
  }

  /**
   * The assistant's reply to `messages` (`[{role: "system" | "user" | "assistant", content}]`),
   * through the model's own chat template, as `generate`'s token iterator. It ends at the
   * template's end-of-turn token. The turns the previous reply's KV cache already holds are
   * reused: `lastSummary.reusedTokens` of `lastSummary.promptTokens` were not prefilled again.
   * Options: as `generate`, and `dropOldest` (a conversation longer than the context loses its
   * oldest turns, and `lastSummary.messages` says what was kept, instead of an error); `tools`
   * (OpenAI's `[{type: "function", function: {name, description, parameters}}]`, given to the
   * model's chat template), `toolChoice` ("auto", "none", "required" or a tool's name: a forced
   * call is generated under a grammar, its arguments valid against the tool's schema) and
   * `parallelToolCalls` (default true). With tools, `lastSummary.reply` is the reply read for
   * calls: `{content, toolCalls: [{id, type, function: {name, arguments}}]}`. Messages may carry
   * `tool_calls` (an assistant's) and be `{role: "tool", tool_call_id, name, content}`.
   */
  reply(messages, options = {}) {
    return this.#stream({ type: "chat", messages, options });
  }

  /**
   * What the sampler keeps at one step, from that step's stored `candidates` (generate with
   * `keepCandidates: K`): `[{id, prob}]` for `options` (temperature, topK, topP, minP,
   * repeatPenalty, repeatWindow), most probable first, with the probabilities the draw would use.
   * `history`: the token ids before that step. Computed by the library's sampler, not re-done in JS.
   */
  samplerView(candidates, options, history = []) {
    return this.#request({
      type: "sampler-view",
      ids: Array.from(candidates.ids),
      logits: Array.from(candidates.logits),
      options,
      history: Array.from(history),
    });
  }

  /**
   * What loading `model` (as `load` takes it) with `options` would cost, known before a byte of
   * its weights is downloaded: `{name, sizeBytes, downloadBytes, cached, plan: {arch, parameters,
   * weightType, weightBytesPerToken, layers, vocab, contextLength, kvBytesPerPosition},
   * memoryBytes, memoryLimitBytes, deviceMemoryBytes, storageAvailableBytes, cpu:
   * {tokensPerSecond, shapeMs, bytesPerSecond}, gpu: {tokensPerSecond, shapeMs, bytesPerSecond,
   * adapter} (where the load would run it on WebGPU: a real adapter, or backend "gpu"), refusal,
   * warnings}`. `refusal` ("" when none) says why the model cannot run here. Reads the file's
   * size and its header only; the speeds come from short runs of random models made here.
   */
  async preflight(model, { tokenizer, backend, maxSeq, exact, threads, allowSoftwareGpu } = {}) {
    const spec = resolveSpec(model, tokenizer);
    // A remote model costs this device nothing but the text.
    if (spec.kind === "remote") return { name: spec.name, remote: spec.id ?? spec.url, refusal: "", warnings: [] };
    const options = { backend, maxSeq, exact, threads, allowSoftwareGpu };
    const p = await this.#request({ type: "preflight", spec, options }, true);
    if (!p.refusal || !this.remoteOffer) return p;
    const offer = this.remoteOffer;
    return {
      ...p,
      remote: offer.id ?? `openai+${offer.url}#${offer.model ?? ""}`,
      refusal: `${p.refusal}; it can run on the remote engine at ${new URL(offer.url).host} instead`,
    };
  }

  /** The prompt text the chat template makes of `messages`: what the model reads. */
  renderChat(messages, { addGenerationPrompt = true } = {}) {
    return this.#request({ type: "render-chat", messages, addGenerationPrompt });
  }

  #stream(message) {
    if (this.current !== null) this.abort();
    const id = this.link.nextId++;
    this.current = id;
    this.lastSummary = null;
    const queue = [];
    let wake = null;
    let finished = false;
    let failure = null;
    const running = new RunningLogP();
    const t0 = performance.now();
    this.pending.set(id, (msg) => {
      if (msg.type === "warning") {
        console.warn(msg.message);
        return;
      }
      if (msg.type === "backend") {
        // WebGPU was lost mid-generation: the model now runs on the CPU path (the text goes on).
        this.info = { ...this.info, ...this.#withEngine(msg.info) };
        this.onBackendChange?.(this.info);
        return;
      }
      if (msg.type === "token") {
        queue.push(running.add(msg.token));
      } else if (msg.type === "done" || msg.type === "error") {
        this.pending.delete(id);
        if (this.current === id) this.current = null;
        finished = true;
        if (msg.type === "done" && msg.summary)
          this.lastSummary = {
            ...msg.summary,
            messages: msg.messages,
            promptIds: msg.promptIds,
            beamTree: msg.beamTree,
            reply: msg.reply,
            wallMs: performance.now() - t0,
          };
        else if (msg.type === "error") failure = new Error(msg.message);
      }
      wake?.();
    });
    this.#post({ ...message, id });
    const self = this;
    return {
      [Symbol.asyncIterator]() {
        return this;
      },
      async next() {
        for (;;) {
          // abort() stops delivery at once, even with tokens already queued.
          if (self.stopped.has(id)) return { done: true, value: undefined };
          if (queue.length) return { done: false, value: queue.shift() };
          if (failure) throw failure;
          if (finished) return { done: true, value: undefined };
          await new Promise((r) => (wake = r));
          wake = null;
        }
      },
      async return() {
        if (self.current === id) self.abort();
        return { done: true, value: undefined };
      },
    };
  }

  /** One request to the worker, answered by one "result" (or "error") message. */
  #request(message, local = false) {
    const id = this.link.nextId++;
    return new Promise((resolve, reject) => {
      this.pending.set(id, (msg) => {
        this.pending.delete(id);
        msg.type === "result" ? resolve(msg.value) : reject(new Error(msg.message));
      });
      this.#post({ ...message, id }, local);
    });
  }

  /** Stop the generation in progress: the iterator ends now; the worker stops after its current token. */
  abort() {
    if (this.current === null) return;
    const id = this.current;
    this.current = null;
    this.stopped.add(id);
    this.#post({ type: "abort", id });
  }

  /**
   * Score `text` with the chain rule: per-token probabilities, logprob, probability, avgNll,
   * perplexity. With `{after: prefix}`, `text` is scored as the continuation of `prefix`
   * (P(text | prefix), only its tokens): candidates after one prefix compare directly.
   */
  score(text, { after } = {}) {
    return this.#request({ type: "score", text, after: after ?? null });
  }

  /** Stop the worker; on the shared worker, stop this instance's generation and free its model. */
  terminate() {
    this.remote?.receive({ type: "unload" }, () => {});
    if (!this.shared) {
      this.link.worker.terminate();
      return this.link.stopPool?.();
    }
    this.abort();
    this.#post({ type: "unload" });
  }
}

let shared = null;
const instance = () => (shared ??= new NextToken());
export const load = (model, opts) => instance().load(model, opts);
export const generate = (prompt, opts) => instance().generate(prompt, opts);
export const abort = () => instance().abort();
export const score = (text, opts) => instance().score(text, opts);
export const reply = (messages, opts) => instance().reply(messages, opts);
/** OpenAI's `chat.completions.create` and `completions.create` on the shared instance. */
export const chat = { completions: { create: (params, opts) => instance().chat.completions.create(params, opts) } };
export const completions = { create: (params, opts) => instance().completions.create(params, opts) };
