// <next-token>: a language model in a page, for lessons and posts.
//
//   <script type="module" src="next-token.js"></script>
//   <next-token model="models/lesson-toy.json" prompt="" temperature="0" show-probabilities autorun></next-token>
//
// Attributes: model (catalog id, .gguf URL or table .json URL), tokenizer (tokenizer.json URL for a
// GGUF; optional: without it, the tokenizer the GGUF's own metadata describes), view (generate |
// explore | beam | score; default generate), prompt, candidates (score view: continuations of the
// prompt, separated by "|" or newlines), max-tokens (default 64), temperature (default 0.8; 0 =
// greedy; the beam view is always greedy), seed (only for reproducible runs: without it each run
// draws anew), top-k, top-p, min-p, beams (beam view default 2), show-probabilities (each token's P,
// and the product), lookup (speculative decoding by prompt lookup: the same text in fewer
// forward passes; tokens whose guess was kept or rejected are underlined), draft (a draft
// model's catalog id or URL: speculative decoding with a smaller model of the same tokenizer), autorun (generate once loaded), eager (load at once: by default nothing is
// downloaded until the element is on screen or clicked), preflight (before any byte of the weights:
// the download size, the memory it needs, whether it fits and the speed to expect here, shown in
// the element; a model that cannot fit is refused, and nothing is downloaded until Generate is
// clicked unless eager or autorun), backend (auto | gpu | cpu), engine (auto | shared | dedicated:
// see below), worker (a worker script on the page's origin, e.g. one line importing the CDN's
// worker.js: what a shared engine needs when this script comes from a CDN), remote (a remote
// engine, "openai+https://host/v1#model", that runs the model where the preflight refuses it
// here; `model` may also name one directly: www/remote.js), editable (let
// the reader edit the prompt, and the candidates), replay (a recording to play instead of running
// the model: a URL of the JSON lines `nexttoken generate --json` writes, "#id" of a
// <script type="application/json"> on the page, or empty for such a script inside the element;
// without `model` nothing else is downloaded, with it the recording plays where the model cannot
// load; either way it is marked as a recording, and the explorer and score views read it).
// Events (bubbling, composed): "nt-load" (detail: the model info), "nt-token" (detail: the token
// event), "nt-done" (detail: the summary + probability + view; the score view: {view, scores}),
// "nt-error" (detail: {message}); the older "nexttoken-token" and "nexttoken-done" still fire.
// Theme: the CSS custom properties --nt-bg, --nt-fg, --nt-muted, --nt-accent, --nt-accent-fg,
// --nt-border, --nt-error and --nt-radius; light and dark defaults follow prefers-color-scheme.
//
// All the elements of a page share one worker (one wasm instance), and elements naming the same
// model share one loaded copy of it: each model is downloaded once, and its elements generate in
// turn. Relative model URLs are relative to the page; the default files (pkg/, the catalog's
// models) are found beside this script, which may come from another origin (a CDN with CORS).
// Where the browser has SharedWorker and the page would run one thread anyway (not cross-origin
// isolated), that worker is one engine for every tab of the site: a model open in three tabs is
// downloaded and held once (engine="auto"; the status line says so, its tooltip why).

import { NextToken, resolveSpec } from "./nexttoken.js";
import {
  el,
  probColor,
  withRunningSums,
  alternativesList,
  samplerPanel,
  beamTreeNodes,
  greedyLine,
  scoreNodes,
  scoredText,
  scoreTable,
  speculationText,
  speculationClass,
  preflightText,
  engineText,
} from "./views.js";
import { MAX_RECORDING_BYTES, parseRecording, runFor, describeRun, totals } from "./recording.js";

const STYLE = `
[hidden] { display: none !important; }
:host {
  --_bg: var(--nt-bg, #fff); --_fg: var(--nt-fg, #1d1f23); --_muted: var(--nt-muted, #5b6270);
  --_accent: var(--nt-accent, #2f5fd0); --_accent-fg: var(--nt-accent-fg, #fff);
  --_border: var(--nt-border, #dedcd5); --_error: var(--nt-error, #8a1010); --_radius: var(--nt-radius, 8px);
  display: block; box-sizing: border-box; max-width: 100%; font-family: system-ui, sans-serif;
  color: var(--_fg); background: var(--_bg); border: 1px solid var(--_border); border-radius: var(--_radius); padding: .6rem .8rem;
}
@media (prefers-color-scheme: dark) {
  :host {
    --_bg: var(--nt-bg, #1b1d22); --_fg: var(--nt-fg, #e6e7ea); --_muted: var(--nt-muted, #a3a9b5);
    --_accent: var(--nt-accent, #7ea2ff); --_accent-fg: var(--nt-accent-fg, #0e1117);
    --_border: var(--nt-border, #3a3e47); --_error: var(--nt-error, #ff8a8a);
  }
}
*, *::before, *::after { box-sizing: border-box; }
:focus-visible { outline: 2px solid var(--_accent); outline-offset: 2px; }
.bar { display: flex; gap: .5rem; align-items: center; flex-wrap: wrap; }
input:not([type=range]), textarea { flex: 1 1 12rem; min-width: 0; font: inherit; color: var(--_fg); background: var(--_bg); border: 1px solid var(--_border); border-radius: 5px; padding: .2rem .4rem; }
textarea { width: 100%; margin-top: .4rem; font-family: ui-monospace, monospace; font-size: .9rem; }
button { font: inherit; padding: .2rem .7rem; border-radius: 5px; border: 1px solid var(--_accent); background: var(--_accent); color: var(--_accent-fg); cursor: pointer; }
button.secondary, button.branch { background: transparent; color: var(--_accent); }
button:disabled { opacity: .45; cursor: default; }
.out { white-space: pre-wrap; overflow-wrap: anywhere; font-family: ui-monospace, monospace; margin: .5rem 0 .2rem; min-height: 1.5em; line-height: 1.6; }
.prompt { color: var(--_muted); }
.tok { border-radius: 2px; padding: 0 1px; }
.tok[data-p] { display: inline-block; vertical-align: top; text-align: center; }
.tok[data-p]::after { content: attr(data-p); display: block; font-size: .65em; color: var(--_accent); line-height: 1.1; white-space: nowrap; }
.tok.empty::before { content: "end"; color: var(--_muted); font-size: .7em; border: 1px solid var(--_border); border-radius: 3px; padding: 0 2px; }
.explore .gen .tok { cursor: pointer; color: #1d1f23; }
.tok.spec-accepted { text-decoration: underline 2px #2e8b57; }
.tok.spec-rejected { text-decoration: underline wavy #c0392b; }
.tok.spec-bonus { text-decoration: underline double #2e8b57; }
.explore .gen .tok[data-p]::after { color: #1d1f23; }
.explore .gen .tok.shared { outline: 1px dashed var(--_muted); }
.explore .gen .tok.selected { box-shadow: 0 0 0 2px var(--_accent); }
.status, .product, .note { color: var(--_muted); font-size: .85rem; margin: .2rem 0; }
.product { color: var(--_fg); font-variant-numeric: tabular-nums; }
.error { color: var(--_error); font-size: .85rem; }
.recording { font-size: .85rem; margin: .3rem 0 0; padding: .15rem .5rem; border-left: 3px solid var(--_accent); color: var(--_muted); }
.detail { font-size: .9rem; border-top: 1px solid var(--_border); margin-top: .4rem; padding-top: .2rem; }
h3 { font-size: .9rem; margin: .5rem 0 .2rem; }
.alternatives, .sampler-bars { padding-left: 1.4rem; margin: .2rem 0; }
.alternatives li, .sampler-bars li { margin: .2rem 0; overflow-wrap: anywhere; }
.alternatives li.chosen { font-weight: 600; }
.alternatives .p, .sampler-bars .p { margin-left: .6rem; font-variant-numeric: tabular-nums; }
.alternatives button.branch { margin-left: .6rem; padding: 0 .4rem; font-size: .8rem; }
.alternatives .bar, .sampler-bars .bar { display: block; height: 4px; border-radius: 2px; background: var(--_accent); }
.sampler-bars .bar.plain { background: var(--_border); }
.sampler-bars .bar.drawn { margin-top: 1px; }
.sampler-bars li.removed { color: var(--_muted); }
.sliders { display: grid; gap: .2rem; font-size: .85rem; }
.sliders label { display: grid; grid-template-columns: 6.5rem minmax(0, 1fr) 3rem; gap: .4rem; align-items: center; color: var(--_muted); }
.beam-tree, .beam-tree ul { list-style: none; padding-left: 1.1rem; margin: .1rem 0; font-family: ui-monospace, monospace; font-size: .85rem; }
.beam-tree { max-height: 32rem; overflow: auto; overscroll-behavior: contain; }
.beam-tree ul.unindented { padding-left: .35rem; border-left: 1px dotted var(--_muted); }
.beam-tree { padding-left: 0; }
.beam-tree li.pruned { color: var(--_muted); text-decoration: line-through; }
.beam-tree li.best { font-weight: 600; color: var(--_accent); }
.beam-tree li li:not(.best) { font-weight: 400; color: inherit; }
.beam-tree li.pruned, .beam-tree li li.pruned { color: var(--_muted); }
.beam-best, .verdict { font-weight: 600; }
.heat { white-space: pre-wrap; overflow-wrap: anywhere; font-family: ui-monospace, monospace; margin: .2rem 0; }
.heat .tok { color: #1d1f23; }
.scored h3 { margin-bottom: 0; }
table.score { border-collapse: collapse; font-size: .8rem; max-width: 100%; }
table.score td, table.score th { border-bottom: 1px solid var(--_border); padding: .1rem .4rem; text-align: left; }
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

function sharedModel(model, tokenizer, backend, draft, engine, workerUrl) {
  const spec = resolveSpec(model, tokenizer);
  const key = JSON.stringify([spec.url, spec.tokenizer, backend, draft, engine, workerUrl]);
  let m = models.get(key);
  if (!m) {
    const nt = new NextToken({ shareWorker: true, engine, workerUrl });
    m = { nt, listeners: new Set(), turn: Promise.resolve() };
    const onProgress = (p) => m.listeners.forEach((f) => f(p));
    m.loading = m.nt.load(spec, { backend, draft, onProgress });
    // A failed load is not kept: the next element (or a retry) tries again.
    m.loading.catch(() => models.get(key) === m && models.delete(key));
    models.set(key, m);
  }
  return m;
}

const VIEWS = ["generate", "explore", "beam", "score"];
const RUN_LABEL = { generate: "Generate", explore: "Generate", beam: "Run beam search", score: "Score" };
const RUN_ARIA = {
  generate: "generate a continuation of the prompt",
  explore: "generate a continuation of the prompt, then explore its tokens",
  beam: "run beam search from the prompt",
  score: "score the texts",
};

class NextTokenElement extends HTMLElement {
  static get observedAttributes() {
    return [
      "model",
      "tokenizer",
      "backend",
      "engine",
      "worker",
      "draft",
      "remote",
      "view",
      "prompt",
      "candidates",
      "replay",
    ];
  }

  constructor() {
    super();
    this.attachShadow({ mode: "open" });
    this.model = null; // the shared model (see sharedModel)
    this.loading = null;
    this.generating = false;
    this.tokens = [];
  }

  /** The view this element shows: generate (default), explore, beam or score. */
  get view() {
    const v = (this.getAttribute("view") || "").trim().toLowerCase();
    return VIEWS.includes(v) ? v : "generate";
  }

  connectedCallback() {
    if (!this.shadowRoot.childElementCount) this.build();
    // Lazy: nothing is downloaded until the element is on screen or clicked (or `eager`).
    if (this.hasAttribute("eager") || typeof IntersectionObserver === "undefined") this.start();
    else if (!this.loading) {
      this.observer = new IntersectionObserver((entries) => {
        if (entries.some((e) => e.isIntersecting)) this.start();
      });
      this.observer.observe(this);
    }
  }

  build() {
    const root = this.shadowRoot;
    root.adoptedStyleSheets = [styleSheet()];
    root.innerHTML = `<div class="bar"><input part="prompt" aria-label="prompt" spellcheck="false"><button part="run" class="run" type="button">Generate</button><button class="stop secondary" type="button" aria-label="stop generating" disabled>Stop</button></div>
      <p class="recording" part="recording" role="note" hidden></p>
      <textarea part="candidates" class="candidates" rows="3" aria-label="candidate continuations, one per line" spellcheck="false" hidden></textarea>
      <div class="out" part="output"><span class="prompt"></span><span class="gen" role="group"></span></div>
      <p class="product" part="product" hidden></p>
      <div class="detail" part="detail" hidden></div>
      <p class="status" part="status" role="status"></p>
      <p class="error" part="error" role="alert" hidden></p>`;
    this.$ = (sel) => root.querySelector(sel);
    const input = this.$("input");
    input.placeholder = "(empty prompt: start of text)";
    this.$(".run").addEventListener("click", () => this.run().catch(() => {}));
    this.$(".stop").addEventListener("click", () => this.stop());
    input.addEventListener("keydown", (e) => e.key === "Enter" && this.run().catch(() => {}));
    // A click anywhere loads the model (lazy elements the observer has not seen yet).
    this.addEventListener("click", () => this.start());
    const gen = this.$(".gen");
    gen.addEventListener("click", (e) => {
      const span = e.target.closest(".tok[data-i]");
      if (span) this.inspect(Number(span.dataset.i));
    });
    gen.addEventListener("keydown", (e) => {
      const span = e.target.closest(".tok[data-i]");
      if (span && (e.key === "Enter" || e.key === " ")) {
        e.preventDefault();
        this.inspect(Number(span.dataset.i));
      }
    });
    this.$(".status").textContent = "the model loads when this is on screen (or click)";
    this.render();
  }

  /** Labels and fields for the current view and attributes. */
  render() {
    const view = this.view;
    const editable = this.hasAttribute("editable");
    const input = this.$("input");
    // A recording plays its own prompt: the reader can read it, not change it.
    input.value = this.played ? this.played.prompt : (this.getAttribute("prompt") ?? "");
    input.hidden = !editable;
    input.readOnly = !!this.recording;
    const cands = this.$(".candidates");
    cands.value = this.candidateList().join("\n");
    cands.hidden = !(editable && view === "score");
    this.$(".run").textContent = this.recording ? (view === "score" ? "Show" : "Play") : RUN_LABEL[view];
    this.$(".run").setAttribute(
      "aria-label",
      this.recording ? `play the recording (${view === "score" ? "its scores" : "its tokens"})` : RUN_ARIA[view],
    );
    this.$(".out").hidden = view === "score";
    this.$(".gen").setAttribute(
      "aria-label",
      view === "explore" ? "generated tokens: press Enter on one to see its alternatives" : "generated tokens",
    );
    this.shadowRoot.host.dataset.view = view;
    this.$(".out").classList.toggle("explore", view === "explore");
  }

  candidateList() {
    const field = this.$?.(".candidates");
    const text = field && !field.hidden ? field.value : this.getAttribute("candidates") || "";
    return text
      .split(/[|\n]/)
      .map((c) => c.trim())
      .filter(Boolean);
  }

  /** Load, then run once if `autorun` (with `preflight` and neither: only the preflight). */
  start() {
    this.observer?.disconnect();
    this.observer = null;
    if (this.loading || this.recording) return;
    const wait = this.hasAttribute("preflight") && !this.hasAttribute("autorun") && !this.hasAttribute("eager");
    if (wait && this.getAttribute("model")) {
      this.preflighted().catch((e) => this.hasAttribute("replay") && this.useRecording(e.message).catch(() => {}));
      return;
    }
    this.ready().then(
      () => {
        if (this.hasAttribute("autorun") && !this.autoran) {
          this.autoran = true;
          this.run().catch(() => {});
        }
      },
      () => {},
    );
  }

  disconnectedCallback() {
    // The model stays loaded for the page's other elements.
    this.observer?.disconnect();
    this.observer = null;
    this.stop();
    this.loading = null;
  }

  stop() {
    this.stopped = true; // a recording playing
    if (this.generating && !this.recording) this.model?.nt.abort();
  }

  attributeChangedCallback(name, oldValue, newValue) {
    if (oldValue === newValue || !this.$) return;
    if (name === "model" || name === "remote") this.remoteModel = null;
    if (name === "replay") {
      // Read again at the next run; until then what is shown stays.
      this.recording = null;
      this.played = null;
    } else if (["view", "prompt", "candidates"].includes(name)) this.render();
    else if (oldValue !== null && this.model) {
      this.loading = null;
      this.checked = null;
      this.load().catch(() => {});
    }
  }

  emit(name, detail) {
    this.dispatchEvent(new CustomEvent(name, { detail, bubbles: true, composed: true }));
  }

  /**
   * "live" once the model is loaded; "recording" where the element plays its recording instead
   * (`replay` without `model`, or a model that could not load here).
   */
  async ready() {
    if (this.recording) {
      await this.recording;
      return "recording";
    }
    const replay = this.hasAttribute("replay");
    if (replay && !this.getAttribute("model")) {
      await this.useRecording("");
      return "recording";
    }
    try {
      if (this.hasAttribute("preflight")) await this.preflighted();
      await this.load();
      return "live";
    } catch (e) {
      if (!replay) throw e;
      await this.useRecording(e.message);
      return "recording";
    }
  }

  load() {
    if (this.loading) return this.loading;
    this.observer?.disconnect();
    // With a recording to fall back on, a failed load is not shown as an error (ready() plays
    // the recording and says why).
    const failed = (message) => (this.hasAttribute("replay") ? new Error(message) : this.fail(message));
    const model = this.remoteModel ?? this.getAttribute("model");
    if (!model) return Promise.reject(failed("set the model attribute (a table .json or a .gguf URL)"));
    // Run stays enabled while loading: a click then runs once the model is there (a click that
    // scrolls a lazy element into view must not land on a button the load just disabled).
    this.$(".status").textContent = "loading the model…";
    const onProgress = ({ file, loaded, total }) => {
      this.$(".status").textContent =
        `loading ${file}: ${(loaded / 1e6).toFixed(1)}${total ? ` / ${(total / 1e6).toFixed(1)}` : ""} MB`;
    };
    let m;
    try {
      m = sharedModel(
        model,
        this.getAttribute("tokenizer") || undefined,
        this.getAttribute("backend") || "auto",
        this.getAttribute("draft") || undefined,
        this.getAttribute("engine") || "auto",
        this.getAttribute("worker") || undefined,
      );
    } catch (e) {
      return Promise.reject(failed(e.message)); // e.g. a malformed Hugging Face reference
    }
    this.model = m;
    m.listeners.add(onProgress);
    this.loading = m.loading
      .finally(() => m.listeners.delete(onProgress))
      .then(
        (info) => {
          this.info = info;
          const status = this.$(".status");
          status.textContent =
            info.backend === "remote"
              ? `${this.remoteModel ? "too big for this device · " : ""}remote · ${info.backendDetail}`
              : `${info.kind === "table" ? info.name || "table model" : info.arch} · ${info.backend === "webgpu" ? "WebGPU" : info.backend === "cpu" ? "CPU" : "table lookup"}${info.engine === "shared" ? " · shared with this site's other tabs" : ""}`;
          status.title = engineText(info);
          this.emit("nt-load", info);
          return info;
        },
        (e) => {
          this.loading = null;
          throw failed(e.message);
        },
      );
    return this.loading;
  }

  /**
   * The model's preflight (once): its numbers in the status line and an "nt-preflight" event;
   * rejects with the reason where the model cannot run here (shown as the error unless a
   * recording takes over).
   */
  preflighted() {
    this.checked ??= (async () => {
      const model = this.getAttribute("model");
      this.$(".status").textContent = "checking what the model needs…";
      const nt = new NextToken({
        shareWorker: true,
        engine: this.getAttribute("engine") || "auto",
        workerUrl: this.getAttribute("worker") || undefined,
        remote: this.getAttribute("remote") || undefined,
      });
      let p;
      try {
        p = await nt.preflight(resolveSpec(model, this.getAttribute("tokenizer") || undefined), {
          backend: this.getAttribute("backend") || "auto",
        });
      } finally {
        nt.terminate();
      }
      this.preflightResult = p;
      this.emit("nt-preflight", p);
      if (p.refusal && p.remote) {
        // Too big for this device: the element's remote engine runs it.
        this.remoteModel = p.remote;
        const host = new URL(resolveSpec(p.remote).url).host;
        this.$(".status").textContent = `too big for this device · runs on ${host}`;
        this.$(".status").title = p.refusal;
        return p;
      }
      if (p.refusal) throw new Error(p.refusal);
      this.$(".status").textContent = preflightText(p);
      return p;
    })().catch((e) => {
      this.checked = null;
      throw this.hasAttribute("replay") ? e : this.fail(e.message);
    });
    return this.checked;
  }

  /** Switch to the recording (`reason`: why the model does not run, or ""); once. */
  useRecording(reason) {
    this.recording ??= this.readRecording().then(
      (recording) => {
        this.played = runFor(recording, this.getAttribute("prompt") ?? "") ?? null;
        const what = this.played ? ` (${describeRun(this.played)})` : "";
        const why = reason ? ` The model could not run here: ${reason}` : "";
        const note = this.$(".recording");
        note.textContent = `▶ A recording${what}: computed earlier, not on this device.${why}`;
        note.hidden = false;
        this.dataset.source = "recording";
        this.$(".status").textContent = "";
        this.render();
        this.emit("nt-load", { kind: "recording", name: this.played?.model ?? "", reason });
        return recording;
      },
      (e) => {
        this.recording = null;
        throw this.fail(reason ? `${reason} (and the recording: ${e.message})` : e.message);
      },
    );
    return this.recording;
  }

  /** The recording `replay` names, parsed (an Error that says what is wrong with it). */
  async readRecording() {
    const src = (this.getAttribute("replay") || "").trim();
    if (!src || src.startsWith("#")) {
      const node = src
        ? document.getElementById(src.slice(1))
        : this.querySelector('script[type="application/json"], script[type="application/x-ndjson"]');
      if (!node)
        throw new Error(
          src
            ? `replay="${src}": no element with that id on the page`
            : 'replay: give a URL, "#id", or a <script type="application/json"> inside the element',
        );
      return parseRecording(node.textContent);
    }
    let res;
    try {
      res = await fetch(new URL(src, document.baseURI));
    } catch (e) {
      throw new Error(`replay: ${src}: ${e.message}`);
    }
    if (!res.ok) throw new Error(`replay: ${src}: HTTP ${res.status}`);
    if (Number(res.headers.get("content-length")) > MAX_RECORDING_BYTES)
      throw new Error(`replay: ${src} is larger than ${MAX_RECORDING_BYTES >> 20} MB: not a lesson's recording`);
    return parseRecording(await res.text());
  }

  fail(message) {
    const box = this.$(".error");
    box.hidden = false;
    box.textContent = message;
    this.$(".status").textContent = "";
    this.emit("nt-error", { message });
    return new Error(message);
  }

  num(name, fallback) {
    const v = this.getAttribute(name);
    return v === null || v === "" || Number.isNaN(Number(v)) ? fallback : Number(v);
  }

  /** The decoding options from the attributes. */
  options() {
    const beam = this.view === "beam";
    return {
      maxTokens: this.num("max-tokens", 64),
      temperature: beam ? 0 : this.num("temperature", 0.8),
      // A seed only when the page sets one (reproducible runs); else each run draws anew.
      seed: this.hasAttribute("seed") ? this.num("seed", 0) : crypto.getRandomValues(new Uint32Array(1))[0],
      topK: this.num("top-k", 0),
      topP: this.num("top-p", 1),
      minP: this.num("min-p", 0),
      beams: beam ? Math.max(2, this.num("beams", 2)) : this.num("beams", 1),
      // The explorer's sampler view reads each step's 64 most likely tokens.
      keepCandidates: this.view === "explore" ? 64 : 0,
      // Speculative decoding by prompt lookup: the same text in fewer forward passes.
      lookup: this.hasAttribute("lookup"),
    };
  }

  /** Run the element's view once; the elements sharing this model take turns. */
  async run() {
    if (this.generating || this.queued) return;
    this.queued = true; // one run at a time per element, from the click until it ends
    try {
      const view = this.view;
      if ((await this.ready()) === "recording") await (view === "score" ? this.playScores() : this.play(view));
      else await this.turn(() => (view === "score" ? this.score() : this.generate(view)));
    } finally {
      this.queued = false;
    }
  }

  /** `fn` in this model's queue (one generation at a time on a model). */
  turn(fn) {
    const m = this.model;
    this.$(".run").disabled = true;
    const mine = m.turn.then(fn);
    m.turn = mine.catch(() => {});
    return mine;
  }

  begin() {
    this.$(".error").hidden = true;
    this.$(".run").disabled = true;
    this.$(".stop").disabled = false;
    this.generating = true;
  }

  end() {
    this.generating = false;
    this.$(".run").disabled = false;
    this.$(".stop").disabled = true;
  }

  /** A generated token's span (`i`: its index); clickable in the explore view. */
  tokenSpan(t, i) {
    const span = el("span", { className: "tok", textContent: t.text }); // text, never HTML
    if (!t.text) span.classList.add("empty");
    // A remote engine whose server sends no logprobs gives tokens without a probability.
    const p = t.prob ?? Number.NaN;
    span.title = `${t.token}: P = ${t.prob === null ? "not given by the server" : p.toFixed(4)}`;
    if (t.speculated) {
      span.classList.add(speculationClass(t));
      span.title += `\n${speculationText(t)}`;
    }
    if (this.hasAttribute("show-probabilities")) span.dataset.p = p.toFixed(2);
    if (this.view === "explore") {
      span.dataset.i = i;
      span.tabIndex = 0;
      span.setAttribute("role", "button");
      span.setAttribute(
        "aria-label",
        `token ${JSON.stringify(t.text || t.token)}, probability ${p.toFixed(2)}: show the alternatives`,
      );
      span.style.backgroundColor = probColor(p);
    }
    return span;
  }

  /** Clear the output for a run from `prompt`; the element of the generated tokens. */
  clearOutput(prompt) {
    const gen = this.$(".gen");
    gen.replaceChildren();
    this.$(".prompt").textContent = prompt;
    this.$(".product").hidden = true;
    this.$(".detail").hidden = true;
    this.tokens = [];
    this.prompt = prompt;
    return gen;
  }

  async generate(view) {
    const m = this.model;
    const prompt = this.$("input").value;
    const gen = this.clearOutput(prompt);
    this.begin();
    try {
      const opts = this.options();
      for await (const t of m.nt.generate(prompt, opts)) {
        this.tokens.push(t);
        gen.append(this.tokenSpan(t, this.tokens.length - 1));
        this.emit("nt-token", t);
        this.dispatchEvent(new CustomEvent("nexttoken-token", { detail: t }));
      }
      const summary = m.nt.lastSummary;
      this.promptIds = summary?.promptIds;
      const probability = this.showProduct();
      if (view === "beam" && summary?.beamTree) {
        const detail = this.$(".detail");
        detail.replaceChildren(...beamTreeNodes(summary.beamTree, summary.text));
        detail.hidden = false;
        detail.append(await greedyLine(m.nt, prompt, opts));
      }
      if (view === "explore")
        this.$(".status").textContent = "Click a token (or Tab to it and press Enter) to see the alternatives.";
      const detail = { ...summary, probability, view };
      this.emit("nt-done", detail);
      this.dispatchEvent(new CustomEvent("nexttoken-done", { detail }));
    } catch (e) {
      this.fail(e.message);
    } finally {
      this.end();
    }
  }

  /** The recording's tokens, streamed as they were generated (at most 60 a second). */
  async play(view) {
    const r = this.played;
    if (!r) throw this.fail('this recording holds scores only: show it with view="score"');
    const gen = this.clearOutput(r.prompt);
    this.begin();
    this.stopped = false;
    const still = globalThis.matchMedia?.("(prefers-reduced-motion: reduce)").matches;
    const delay = still ? 0 : 1000 / Math.min(60, Math.max(10, r.tokensPerSecond || 30));
    try {
      for (const t of r.tokens) {
        await new Promise((go) => setTimeout(go, delay));
        if (this.stopped) break;
        this.tokens.push(t);
        gen.append(this.tokenSpan(t, this.tokens.length - 1));
        this.emit("nt-token", t);
        this.dispatchEvent(new CustomEvent("nexttoken-token", { detail: t }));
      }
      const probability = this.showProduct();
      if (view === "beam") this.note("Beam search needs the live model: this is the recorded generation.");
      if (view === "explore")
        this.$(".status").textContent = "Click a token (or Tab to it and press Enter) to see the alternatives.";
      const text = this.tokens.map((t) => t.text).join("");
      const detail = { text, generatedTokens: this.tokens.length, recording: true, model: r.model, probability, view };
      this.emit("nt-done", detail);
      this.dispatchEvent(new CustomEvent("nexttoken-done", { detail }));
    } finally {
      this.end();
    }
  }

  /** The score view from a recording: its scored texts (score lines), else its continuation. */
  async playScores() {
    const recording = await this.recording;
    const r = this.played;
    const scored = recording.scores.map((s) => ({ label: s.text, s }));
    if (!scored.length && r) {
      const tokens = r.tokens.map((t) => ({ token: t.token, piece: t.text, prob: t.prob, logprob: t.logprob }));
      scored.push({ label: `the recorded continuation of ${JSON.stringify(r.prompt)}`, s: totals(tokens) });
    }
    const detail = this.$(".detail");
    detail.replaceChildren(
      el("p", { className: "note", textContent: "P of each token given everything before it, as recorded." }),
      ...scored.map(({ label, s }) => scoredText(label, s)),
    );
    if (scored.length === 1) detail.append(scoreTable(scored[0].s));
    detail.hidden = false;
    const scores = scored.map(({ label, s }) => ({
      text: label,
      logprob: s.logprob,
      perplexity: s.perplexity,
      avgNll: s.avgNll,
    }));
    this.emit("nt-done", { view: "score", prompt: r?.prompt ?? "", scores, recording: true });
  }

  note(text) {
    const detail = this.$(".detail");
    detail.replaceChildren(el("p", { className: "note", textContent: text }));
    detail.hidden = false;
  }

  /** The product line (show-probabilities); the text's probability. */
  showProduct() {
    const probability = Math.exp(this.tokens.reduce((s, t) => s + t.logprob, 0));
    if (this.hasAttribute("show-probabilities") && this.tokens.length) {
      const text = (this.prompt + this.tokens.map((t) => t.text).join("")).trim();
      const factors = this.tokens.map((t) => t.prob?.toFixed(2) ?? "?").join(" × ");
      const product = this.$(".product");
      product.textContent = `P(“${text}”) = ${factors} = ${probability.toFixed(2)}`;
      product.dataset.probability = String(probability);
      product.hidden = false;
    }
    return probability;
  }

  /** The explorer: token `i`'s alternatives ("continue with this") and the sampler view. */
  inspect(i) {
    const t = this.tokens[i];
    if (!t) return;
    for (const s of this.$(".gen").querySelectorAll(".tok")) s.classList.toggle("selected", Number(s.dataset.i) === i);
    const before = (
      this.prompt +
      this.tokens
        .slice(0, i)
        .map((x) => x.text)
        .join("")
    ).trim();
    const detail = this.$(".detail");
    const heading = el("h3", {
      textContent: `Step ${i + 1}: after “${before}”, the model chose “${t.text || t.token}” (P = ${t.prob?.toFixed(2) ?? "not sent by the server"})`,
    });
    const live = !this.recording;
    const list = alternativesList(t, live && this.promptIds && !this.generating ? (alt) => this.branch(i, alt) : null);
    detail.replaceChildren(heading, list);
    if (!live)
      detail.append(
        el("p", {
          className: "note",
          textContent: "As recorded: continuing with another token, and the sampler view, need the live model.",
        }),
      );
    if (t.speculated) detail.append(el("p", { className: "speculated", textContent: speculationText(t) }));
    if (t.candidates && live) {
      const history = [...(this.promptIds ?? []), ...this.tokens.slice(0, i).map((x) => x.id)];
      detail.append(samplerPanel(this.model.nt, t, this.options(), history, ["temperature", "topK", "topP", "minP"]));
    }
    detail.hidden = false;
    this.selected = i;
  }

  /** Continue from token `i` with `alt` instead: the prefix stays in the KV cache, only the suffix runs. */
  branch(i, alt) {
    if (this.generating) return;
    return this.turn(async () => {
      const m = this.model;
      const ids = [...this.promptIds, ...this.tokens.slice(0, i).map((t) => t.id)];
      const gen = this.$(".gen");
      this.tokens = this.tokens.slice(0, i);
      gen.replaceChildren(...this.tokens.map((t, j) => this.tokenSpan(t, j)));
      for (const s of gen.children) s.classList.add("shared");
      this.$(".product").hidden = true;
      this.begin();
      try {
        for await (const t of m.nt.generate({ ids }, { ...this.options(), forceTokens: [alt.id] })) {
          this.tokens.push(t);
          gen.append(this.tokenSpan(t, this.tokens.length - 1));
          this.emit("nt-token", t);
        }
        this.tokens = withRunningSums(this.tokens);
        const s = m.nt.lastSummary;
        const probability = this.showProduct();
        if (s)
          this.$(".status").textContent =
            `Branch at token ${i + 1}: ${s.reusedTokens} positions reused from the KV cache, ${s.promptTokens - s.reusedTokens} computed, then ${s.generatedTokens} new tokens.`;
        this.emit("nt-done", { ...s, probability, view: "explore", branch: { at: i, token: alt } });
      } catch (e) {
        this.fail(e.message);
      } finally {
        this.end();
      }
      this.inspect(i);
      gen.children[i]?.focus();
    });
  }

  async score() {
    const m = this.model;
    const prompt = this.$("input").value;
    const candidates = this.candidateList();
    const detail = this.$(".detail");
    this.begin();
    try {
      const nodes = await scoreNodes(m.nt, prompt, candidates);
      detail.replaceChildren(...nodes);
      detail.hidden = false;
      const scores = [...detail.querySelectorAll(".scored")].map((d) => ({
        text: d.querySelector("h3").textContent,
        logprob: Number(d.dataset.logprob),
        perplexity: Number(d.dataset.perplexity),
        avgNll: Number(d.dataset.avgNll),
      }));
      this.emit("nt-done", { view: "score", prompt, scores });
    } catch (e) {
      this.fail(e.message);
    } finally {
      this.end();
    }
  }
}

if (!customElements.get("next-token")) customElements.define("next-token", NextTokenElement);
export { NextTokenElement };
