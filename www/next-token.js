// <next-token>: a language model in a page, for lessons and posts.
//
//   <script type="module" src="next-token.js"></script>
//   <next-token model="models/lesson-toy.json" prompt="" temperature="0" show-probabilities autorun></next-token>
//
// Attributes: model (catalog id, .gguf URL or table .json URL), tokenizer (tokenizer.json URL for a
// GGUF; optional: without it, the tokenizer the GGUF's own metadata describes), prompt, max-tokens (default 64), temperature (default 0.8;
// 0 = greedy), seed (only for reproducible runs: without it each run draws anew), top-k, top-p, beams, show-probabilities (each token's P, and the product),
// autorun (generate once loaded), backend (auto | gpu | cpu), editable (let the reader edit the prompt).
// Events: "nexttoken-token" (detail: the token), "nexttoken-done" (detail: summary + probability).
//
// All the elements of a page share one worker (one wasm instance), and elements naming the same
// model share one loaded copy of it: each model is downloaded once, and its elements generate in
// turn. Relative model URLs are relative to the page; the default files (pkg/, the catalog's
// models) are found beside this script, which may come from another origin (a CDN with CORS).

import { NextToken, resolveSpec } from "./nexttoken.js";

const STYLE = `
[hidden] { display: none !important; }
:host { display: block; font-family: system-ui, sans-serif; border: 1px solid #dedcd5; border-radius: 8px; padding: .6rem .8rem; background: #fff; }
.bar { display: flex; gap: .5rem; align-items: center; flex-wrap: wrap; }
input { flex: 1 1 12rem; font: inherit; }
button { font: inherit; padding: .2rem .7rem; border-radius: 5px; border: 1px solid #2f5fd0; background: #2f5fd0; color: #fff; cursor: pointer; }
button.secondary { background: #fff; color: #2f5fd0; }
button:disabled { opacity: .45; cursor: default; }
.out { white-space: pre-wrap; font-family: ui-monospace, monospace; margin: .5rem 0 .2rem; min-height: 1.5em; line-height: 1.6; }
.prompt { color: #5b6270; }
.tok { border-radius: 2px; padding: 0 1px; }
.tok[data-p] { display: inline-block; vertical-align: top; text-align: center; }
.tok[data-p]::after { content: attr(data-p); display: block; font-size: .65em; color: #2f5fd0; line-height: 1.1; white-space: nowrap; }
.tok.empty::before { content: "end"; color: #5b6270; font-size: .7em; border: 1px solid #dedcd5; border-radius: 3px; padding: 0 2px; }
.status, .product { color: #5b6270; font-size: .85rem; margin: .2rem 0; }
.product { color: #1d1f23; font-variant-numeric: tabular-nums; }
.error { color: #8a1010; font-size: .85rem; }
`;

// Constructed, not a <style> element: a page whose CSP has no 'unsafe-inline' in style-src
// blocks <style> elements, in a shadow root too.
let sheet = null;
function styleSheet() {
  if (!sheet) {
    sheet = new CSSStyleSheet();
    sheet.replaceSync(STYLE);
  }
  return sheet;
}

/** Loaded models, shared by the elements that name them: key -> {nt, loading, listeners, turn}. */
const models = new Map();

function sharedModel(model, tokenizer, backend) {
  const spec = resolveSpec(model, tokenizer);
  const key = JSON.stringify([spec.url, spec.tokenizer, backend]);
  let m = models.get(key);
  if (!m) {
    m = { nt: new NextToken({ shareWorker: true }), listeners: new Set(), turn: Promise.resolve() };
    m.loading = m.nt.load(spec, { backend, onProgress: (p) => m.listeners.forEach((f) => f(p)) });
    // A failed load is not kept: the next element (or a retry) tries again.
    m.loading.catch(() => models.get(key) === m && models.delete(key));
    models.set(key, m);
  }
  return m;
}

class NextTokenElement extends HTMLElement {
  static get observedAttributes() {
    return ["model", "tokenizer", "backend"];
  }

  constructor() {
    super();
    this.attachShadow({ mode: "open" });
    this.model = null; // the shared model (see sharedModel)
    this.loading = null;
    this.generating = false;
    this.tokens = [];
  }

  connectedCallback() {
    if (this.shadowRoot.childElementCount) return;
    const root = this.shadowRoot;
    root.adoptedStyleSheets = [styleSheet()];
    root.innerHTML = `<div class="bar"><input part="prompt" aria-label="prompt" spellcheck="false"><button part="run" class="run">Generate</button><button class="stop secondary" disabled>Stop</button></div>
      <div class="out" part="output"><span class="prompt"></span><span class="gen"></span></div>
      <p class="product" part="product" hidden></p>
      <p class="status" part="status" role="status"></p>
      <p class="error" part="error" role="alert" hidden></p>`;
    this.$ = (sel) => root.querySelector(sel);
    const input = this.$("input");
    input.value = this.getAttribute("prompt") ?? "";
    input.hidden = !this.hasAttribute("editable");
    input.placeholder = "(empty prompt: start of text)";
    this.$(".run").addEventListener("click", () => this.run());
    this.$(".stop").addEventListener("click", () => this.stop());
    input.addEventListener("keydown", (e) => e.key === "Enter" && this.run());
    this.load().then(() => this.hasAttribute("autorun") && this.run(), () => {});
  }

  disconnectedCallback() {
    // The model stays loaded for the page's other elements.
    this.stop();
    this.loading = null;
  }

  stop() {
    if (this.generating) this.model?.nt.abort();
  }

  attributeChangedCallback(name, oldValue, newValue) {
    if (oldValue !== null && oldValue !== newValue && this.model) {
      this.loading = null;
      this.load().catch(() => {});
    }
  }

  load() {
    if (this.loading) return this.loading;
    const model = this.getAttribute("model");
    if (!model) return Promise.reject(this.fail("set the model attribute (a table .json or a .gguf URL)"));
    this.$(".run").disabled = true;
    this.$(".status").textContent = "loading the model…";
    const onProgress = ({ file, loaded, total }) => {
      this.$(".status").textContent = `loading ${file}: ${(loaded / 1e6).toFixed(1)}${total ? " / " + (total / 1e6).toFixed(1) : ""} MB`;
    };
    let m;
    try {
      m = sharedModel(model, this.getAttribute("tokenizer") || undefined, this.getAttribute("backend") || "auto");
    } catch (e) {
      return Promise.reject(this.fail(e.message)); // e.g. a malformed Hugging Face reference
    }
    this.model = m;
    m.listeners.add(onProgress);
    this.loading = m.loading
      .finally(() => m.listeners.delete(onProgress))
      .then(
        (info) => {
          this.info = info;
          this.$(".status").textContent = `${info.kind === "table" ? info.name || "table model" : info.arch} · ${info.backend === "webgpu" ? "WebGPU" : info.backend === "cpu" ? "CPU" : "table lookup"}`;
          this.$(".run").disabled = false;
          return info;
        },
        (e) => {
          this.loading = null;
          throw this.fail(e.message);
        },
      );
    return this.loading;
  }

  fail(message) {
    const box = this.$(".error");
    box.hidden = false;
    box.textContent = message;
    this.$(".status").textContent = "";
    return new Error(message);
  }

  num(name, fallback) {
    const v = this.getAttribute(name);
    return v === null || v === "" || Number.isNaN(Number(v)) ? fallback : Number(v);
  }

  /** Generate once; the elements sharing this model take turns. */
  async run() {
    if (this.generating) return;
    await this.load();
    const m = this.model;
    this.$(".run").disabled = true;
    const mine = m.turn.then(() => this.generate(m));
    m.turn = mine.catch(() => {});
    return mine;
  }

  async generate(m) {
    const prompt = this.$("input").value;
    const show = this.hasAttribute("show-probabilities");
    const gen = this.$(".gen");
    gen.replaceChildren();
    this.$(".prompt").textContent = prompt;
    this.$(".error").hidden = true;
    this.$(".product").hidden = true;
    this.$(".run").disabled = true;
    this.$(".stop").disabled = false;
    this.tokens = [];
    this.generating = true;
    try {
      const opts = {
        maxTokens: this.num("max-tokens", 64),
        temperature: this.num("temperature", 0.8),
        // A seed only when the page sets one (reproducible runs); else each run draws anew.
        seed: this.hasAttribute("seed") ? this.num("seed", 0) : crypto.getRandomValues(new Uint32Array(1))[0],
        topK: this.num("top-k", 0),
        topP: this.num("top-p", 1),
        beams: this.num("beams", 1),
      };
      for await (const t of m.nt.generate(prompt, opts)) {
        this.tokens.push(t);
        const span = document.createElement("span");
        span.className = "tok";
        span.textContent = t.text; // text, never HTML
        if (!t.text) span.classList.add("empty");
        span.title = `${t.token}: P = ${t.prob.toFixed(4)}`;
        if (show) span.dataset.p = t.prob.toFixed(2);
        gen.append(span);
        this.dispatchEvent(new CustomEvent("nexttoken-token", { detail: t }));
      }
      const probability = Math.exp(this.tokens.reduce((s, t) => s + t.logprob, 0));
      if (show && this.tokens.length) {
        const text = (prompt + this.tokens.map((t) => t.text).join("")).trim();
        const factors = this.tokens.map((t) => t.prob.toFixed(2)).join(" × ");
        const product = this.$(".product");
        product.textContent = `P(“${text}”) = ${factors} = ${probability.toFixed(2)}`;
        product.dataset.probability = String(probability);
        product.hidden = false;
      }
      this.dispatchEvent(new CustomEvent("nexttoken-done", { detail: { ...m.nt.lastSummary, probability } }));
    } catch (e) {
      this.fail(e.message);
    } finally {
      this.generating = false;
      this.$(".run").disabled = false;
      this.$(".stop").disabled = true;
    }
  }
}

if (!customElements.get("next-token")) customElements.define("next-token", NextTokenElement);
export { NextTokenElement };
