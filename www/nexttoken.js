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
// The module-level functions `load`, `generate`, `abort` and `score` use one shared instance.

/** Models the page offers. `chat`: how to wrap a prompt as one user turn (optional). */
export const CATALOG = [
  {
    id: "default",
    name: "Default: 2M-parameter llama trained on the King James Bible (2.1 MB)",
    kind: "gguf",
    url: "models/default.gguf",
    tokenizer: "models/default-tokenizer.json",
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
    id: "lesson-beam",
    name: "Lesson: greedy vs beam search (table model)",
    kind: "table",
    url: "models/lesson-beam.json",
    note: "greedy finds “the cat” (0.33); 2 beams find “a bird” (0.36)",
  },
  {
    id: "smollm2-135m",
    name: "SmolLM2-135M-Instruct (Q8_0, 145 MB)",
    kind: "gguf",
    url: "https://huggingface.co/bartowski/SmolLM2-135M-Instruct-GGUF/resolve/main/SmolLM2-135M-Instruct-Q8_0.gguf",
    tokenizer: "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/resolve/main/tokenizer.json",
    size: 144_811_712,
    chat: "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n",
    stop: ["<|im_end|>"],
  },
  {
    id: "qwen2.5-0.5b",
    name: "Qwen2.5-0.5B-Instruct (Q8_0, 676 MB)",
    kind: "gguf",
    url: "https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct-GGUF/resolve/main/qwen2.5-0.5b-instruct-q8_0.gguf",
    tokenizer: "https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct/resolve/main/tokenizer.json",
    chat: "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n",
    stop: ["<|im_end|>"],
  },
  {
    id: "tinyllama-1.1b",
    name: "TinyLlama-1.1B-Chat (Q4_K_M, 669 MB)",
    kind: "gguf",
    url: "https://huggingface.co/TheBloke/TinyLlama-1.1B-Chat-v1.0-GGUF/resolve/main/tinyllama-1.1b-chat-v1.0.Q4_K_M.gguf",
    tokenizer: "https://huggingface.co/TinyLlama/TinyLlama-1.1B-Chat-v1.0/resolve/main/tokenizer.json",
    chat: "<|user|>\n{prompt}</s>\n<|assistant|>\n",
  },
];

/** A model spec from a catalog entry, a URL string (".json" = table model) or a spec object. */
export function resolveSpec(model, tokenizer) {
  if (typeof model === "string") {
    const entry = CATALOG.find((m) => m.id === model);
    if (entry) return { ...entry };
    const isTable = /\.json(\?|#|$)/i.test(model);
    const spec = { id: model, name: model.split("/").pop(), kind: isTable ? "table" : "gguf", url: model };
    // A GGUF without a tokenizer URL uses the tokenizer its own metadata describes.
    if (!isTable && tokenizer) spec.tokenizer = tokenizer;
    return spec;
  }
  return { kind: /\.json(\?|#|$)/i.test(model.url) ? "table" : "gguf", ...model };
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

export class NextToken {
  constructor({ workerUrl } = {}) {
    this.worker = new Worker(workerUrl || new URL("./worker.js", import.meta.url), { type: "module" });
    this.nextId = 1;
    this.pending = new Map(); // id -> handler(message)
    this.current = null; // id of the generation in progress
    this.stopped = new Set(); // ids of generations aborted by the caller
    this.info = null;
    this.lastSummary = null;
    this.worker.onmessage = (e) => this.pending.get(e.data.id)?.(e.data);
    this.worker.onerror = (e) => {
      const message = `the inference worker failed: ${e.message || "could not start (is www/pkg built? run ./build.sh)"}`;
      for (const handler of this.pending.values()) handler({ type: "error", message });
    };
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
   * {downloadMs, initMs}; rejects with an Error whose `retryable` says if retrying may help.
   */
  load(model, { onProgress, onWarning, backend = "auto", maxSeq = 2048, exact = false, threads, tokenizer, signal } = {}) {
    const spec = resolveSpec(model, tokenizer);
    if (spec.kind === "gguf") requestPersistentStorage();
    const id = this.nextId++;
    this.info = null;
    return new Promise((resolve, reject) => {
      const onAbort = () => this.worker.postMessage({ type: "cancel-load", id });
      signal?.addEventListener("abort", onAbort, { once: true });
      this.pending.set(id, (msg) => {
        if (msg.type === "progress") onProgress?.(msg);
        else if (msg.type === "warning") onWarning ? onWarning(msg.message) : console.warn(msg.message);
        else {
          this.pending.delete(id);
          signal?.removeEventListener("abort", onAbort);
          if (msg.type === "loaded") {
            this.info = { ...msg.info, spec, timings: msg.timings };
            resolve(this.info);
          } else {
            const err = new Error(msg.message);
            err.retryable = !!msg.retryable;
            reject(err);
          }
        }
      });
      this.worker.postMessage({ type: "load", id, spec, options: { backend, maxSeq, exact, threads } });
    });
  }

  /**
   * Generate a continuation of `prompt`, token by token: an async iterator of
   * `{id, text, token, prob, logprob, top: [{id, token, prob}], position, logprobSum, perplexity}`
   * (`logprobSum` and `perplexity` run over the generated tokens so far). Options: maxTokens,
   * temperature, topK, topP, minP, repeatPenalty, repeatWindow, seed, stop, beams,
   * lengthNormalise. When it ends, `lastSummary` holds the totals.
   */
  generate(prompt, options = {}) {
    if (this.current !== null) this.abort();
    const id = this.nextId++;
    this.current = id;
    this.lastSummary = null;
    const queue = [];
    let wake = null;
    let finished = false;
    let failure = null;
    let logprobSum = 0;
    let count = 0;
    const t0 = performance.now();
    this.pending.set(id, (msg) => {
      if (msg.type === "token") {
        count += 1;
        logprobSum += msg.token.logprob;
        queue.push({ ...msg.token, logprobSum, perplexity: Math.exp(-logprobSum / count) });
      } else if (msg.type === "done" || msg.type === "error") {
        this.pending.delete(id);
        if (this.current === id) this.current = null;
        finished = true;
        if (msg.type === "done") this.lastSummary = { ...msg.summary, wallMs: performance.now() - t0 };
        else failure = new Error(msg.message);
      }
      wake?.();
    });
    this.worker.postMessage({ type: "generate", id, prompt, options });
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

  /** Stop the generation in progress: the iterator ends now; the worker stops after its current token. */
  abort() {
    if (this.current === null) return;
    const id = this.current;
    this.current = null;
    this.stopped.add(id);
    this.worker.postMessage({ type: "abort", id });
  }

  /** Score `text` with the chain rule: per-token probabilities, probability, avgNll, perplexity. */
  score(text) {
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      this.pending.set(id, (msg) => {
        this.pending.delete(id);
        msg.type === "result" ? resolve(msg.value) : reject(new Error(msg.message));
      });
      this.worker.postMessage({ type: "score", id, text });
    });
  }

  terminate() {
    this.worker.terminate();
  }
}

let shared = null;
const instance = () => (shared ??= new NextToken());
export const load = (model, opts) => instance().load(model, opts);
export const generate = (prompt, opts) => instance().generate(prompt, opts);
export const abort = () => instance().abort();
export const score = (text) => instance().score(text);
