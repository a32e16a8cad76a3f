// The page: model picker, prompt and settings, the streamed output (every token clickable), the
// token inspector, live stats and the cached-models list. All inference is in the worker, through
// nexttoken.js. Model output only ever enters the DOM as text (textContent), never as HTML.
//
// URL parameters (handy for links and tests): ?model=URL|catalog-id &tokenizer=URL &backend=cpu|gpu|auto
// &prompt=TEXT &mode=text (stay in text mode for a chat model). The body's data-state is idle | loading |
// ready | generating | error.

import { NextToken, CATALOG, RunningLogP, resolveSpec } from "./nexttoken.js";
import { listCached, deleteCached, isCached, formatBytes } from "./model-cache.js";
import {
  el,
  probColor,
  withRunningSums,
  alternativesList,
  samplerPanel as samplerView,
  beamTreeNodes,
  greedyLine,
  scoreNodes,
  speculationText,
  speculationClass,
  preflightText,
  engineText,
} from "./views.js";

const $ = (id) => document.getElementById(id);

const params = new URLSearchParams(location.search);
// ?remote=openai+https://host/v1#model: a server that runs the models too big for this device.
const nt = new NextToken({ remote: params.get("remote") || undefined });
// WebGPU lost mid-generation: the model went on on the CPU path; say so where the backend shows.
nt.onBackendChange = (info) => {
  stats.backend = backendLabel(info);
  stats["backend choice"] = info.backendReason ?? "";
  renderStats();
  showError(info.backendReason, false, "warning");
};
let loadedSpec = null;
let lastLoad = null; // () => load again (Retry)
let loadController = null;
let tokens = []; // generated tokens of the current output, with running sums
let stats = {};

function setState(state) {
  document.body.dataset.state = state;
}

// ---------------------------------------------------------------------------------------------
// Model picker

async function initPicker() {
  const select = $("model-select");
  for (const m of CATALOG) select.append(el("option", { value: m.id, textContent: m.name }));
  select.append(el("option", { value: "custom", textContent: "Custom URL…" }));
  // The default model is built by a separate step; offer it only when it is there.
  let defaultThere = false;
  try {
    const r = await fetch("models/default.gguf", { method: "HEAD", cache: "no-store" });
    defaultThere = r.ok;
  } catch {
    // Offline: the default model is there if an earlier visit stored it.
    defaultThere = await isCached("models/default.gguf").catch(() => false);
  }
  if (!defaultThere) {
    const opt = select.querySelector('option[value="default"]');
    opt.textContent += " — not built yet";
    opt.disabled = true;
  }
  const fromUrl = params.get("model");
  if (fromUrl && CATALOG.some((m) => m.id === fromUrl)) select.value = fromUrl;
  else if (fromUrl) {
    select.value = "custom";
    $("model-url").value = fromUrl;
    $("tokenizer-url").value = params.get("tokenizer") || "";
  } else select.value = defaultThere ? "default" : "lesson-toy";
  if (params.get("backend")) $("backend").value = params.get("backend");
  if (params.get("prompt") !== null) $("prompt").value = params.get("prompt");
  onPickerChange(params.get("prompt") === null);
  select.addEventListener("change", () => {
    onPickerChange(true);
    loadPicked();
  });
  $("load").addEventListener("click", () => loadSelected());
  // Small models load by themselves; the big catalog downloads wait for the button.
  const spec = selectedSpec();
  if (spec && !spec.error && (fromUrl || spec.kind === "table" || spec.shipped)) loadSelected();
}

function selectedSpec() {
  const id = $("model-select").value;
  if (id === "custom") {
    const url = $("model-url").value.trim();
    if (!url) return null;
    try {
      return resolveSpec(url, $("tokenizer-url").value.trim() || undefined);
    } catch (e) {
      return { error: e.message };
    }
  }
  return resolveSpec(id);
}

function onPickerChange(setPrompt) {
  const id = $("model-select").value;
  $("custom-row").hidden = id !== "custom";
  const entry = CATALOG.find((m) => m.id === id);
  $("model-note").textContent =
    entry?.note ||
    (id === "custom"
      ? "Any GGUF (llama, qwen2, gpt2) by URL or as a Hugging Face reference (hf:owner/repo/file.gguf or owner/repo:file.gguf; split files by their first part): its own tokenizer and chat template are used, or a tokenizer.json if you give its URL. Or a table model (.json). The server must allow CORS. Or a remote engine, for a model too big for this device: openai+https://host/v1#model (llama.cpp's server, vLLM, any OpenAI-compatible one)."
      : "");
  if (setPrompt && entry) $("prompt").value = entry.prompt ?? (entry.kind === "table" ? "the" : "Once upon a time");
}

/**
 * After the reader picks a model: what is picked is what runs. A lesson table, the default model
 * or a model already in the cache loads at once; a download waits for the Load button, and until
 * then Generate and Score are off, with the status saying why (the loaded model's numbers must
 * never be read as the picked one's).
 */
async function loadPicked() {
  const spec = selectedSpec();
  if (!spec || spec.error) return; // a custom URL not typed yet: the Load button reports it
  if (pickedIsLoaded()) {
    $("generate").disabled = $("score-btn").disabled = false;
    $("status").textContent = `${spec.name || spec.url} is loaded.`;
    return;
  }
  const local = spec.kind === "table" || spec.shipped || spec.kind === "remote"; // nothing to download
  if (local || (await isCached(spec.url).catch(() => false))) return loadSelected();
  $("generate").disabled = $("score-btn").disabled = true;
  const loaded = loadedSpec ? ` (${loadedSpec.name || loadedSpec.url} is still loaded)` : "";
  const wait = `Press Load to download ${spec.name || spec.url}: Generate and Score wait for it${loaded}.`;
  $("status").textContent = wait;
  // Before the download: its size, the memory it needs and the speed to expect (or why it cannot
  // run here). Unreachable now (offline): the line above stays.
  const picked = selectedSpec();
  nt.preflight(spec).then(
    (p) => {
      if (JSON.stringify(selectedSpec()) !== JSON.stringify(picked) || pickedIsLoaded()) return;
      $("status").textContent = p.refusal ? `${p.refusal}.` : `${wait} ${preflightText(p)}.`;
    },
    () => {},
  );
}

async function loadSelected() {
  const spec = selectedSpec();
  if (!spec || spec.error) {
    showError(spec?.error || "enter a model URL first", false);
    return;
  }
  // With a remote engine offered (?remote=), a model the preflight refuses here runs there.
  if (nt.remoteOffer && spec.kind === "gguf") {
    const p = await nt.preflight(spec).catch(() => null);
    if (p?.refusal && p.remote) {
      const remote = resolveSpec(p.remote);
      lastLoad = () => loadModel(remote);
      await loadModel(remote);
      if (loadedSpec === remote) {
        loadedSpec = spec; // the picked model, run on the server
        $("status").textContent = `${p.refusal}: running it there.`;
      }
      return;
    }
  }
  lastLoad = () => loadModel(spec);
  return loadModel(spec);
}

async function loadModel(spec) {
  hideError();
  setState("loading");
  nt.abort();
  $("generate").disabled = $("score-btn").disabled = true;
  $("load").disabled = true;
  $("cancel-load").hidden = false;
  loadController = new AbortController();
  const progress = $("progress");
  progress.hidden = false;
  progress.value = 0;
  stats = { model: spec.name || spec.url };
  renderStats();
  const t0 = performance.now();
  const status = $("status");
  status.textContent = `Loading ${spec.name || spec.url}…`;
  try {
    const info = await nt.load(spec, {
      backend: $("backend").value,
      signal: loadController.signal,
      onProgress: ({ file, loaded, total, fromCache, resumed = 0, part = 1, parts = 1, doneBytes = 0 }) => {
        const from = resumed ? `, resumed at ${formatBytes(resumed)}` : "";
        const what = `${fromCache ? "Reading cached" : "Downloading"} ${file}${parts > 1 ? ` (part ${part} of ${parts})` : ""}${from}`;
        if (total) {
          // A split model's bar counts parts as equal shares (gguf-split makes them about equal).
          progress.max = parts;
          progress.value = part - 1 + loaded / total;
          status.textContent = `${what}: ${formatBytes(loaded)} of ${formatBytes(total)} (${Math.floor((100 * loaded) / total)}%)`;
        } else {
          progress.removeAttribute("value");
          status.textContent = `${what}: ${formatBytes(loaded)}`;
        }
        stats.download =
          parts > 1
            ? `${formatBytes(doneBytes + loaded)} (part ${part} of ${parts})${fromCache ? " (cache)" : ""}`
            : `${formatBytes(loaded)}${total ? ` / ${formatBytes(total)}` : ""}${fromCache ? " (cache)" : ""}`;
        renderStats();
      },
      onWarning: (message) => showError(message, false, "warning"),
    });
    loadedSpec = spec;
    // Beam search settings belong to the model they were tried on: a new model starts sampling.
    $("beams").value = "1";
    const ms = performance.now() - t0;
    status.textContent = `Loaded ${spec.name || spec.url} in ${(ms / 1000).toFixed(2)} s.`;
    stats = {
      model: spec.name || spec.url,
      backend: backendLabel(info),
      "backend choice": info.backendReason ?? "",
      engine: engineText(info),
      architecture: info.kind === "table" ? "bigram table" : `${info.arch}, ${info.nLayer} layers, ${info.nEmbd} wide`,
      parameters: info.parameters.toLocaleString(),
      "model size":
        info.kind === "table"
          ? `${info.nVocab} words (a ${info.nVocab} × ${info.nVocab} table)`
          : formatBytes(info.bytes),
      download:
        info.kind === "table"
          ? ""
          : info.timings?.reused
            ? "none: the engine holds this model already (another tab or element loaded it)"
            : info.timings?.fromCache
              ? "from cache"
              : stats.download || "",
      weights: info.kind === "table" ? "" : weightsLabel(info),
      "load time": `${(ms / 1000).toFixed(2)} s (init ${(info.timings?.initMs ?? 0).toFixed(0)} ms${info.timings?.backendMs ? `, backend check ${info.timings.backendMs.toFixed(0)} ms` : ""})`,
    };
    renderStats();
    $("version").textContent = `nexttoken ${info.version}`;
    if (info.kind === "table") $("model-note").textContent = `${info.description} Words: ${info.words.join(" ")}`;
    $("generate").disabled = $("score-btn").disabled = false;
    // A model with a chat template opens in chat mode; the conversation starts afresh.
    // A remote engine's server renders chats with its own template.
    const chats = !!info.chatTemplate || info.backend === "remote";
    $("mode-chat").disabled = !chats;
    $("mode-chat").parentElement.title = chats ? "" : "this model has no chat template (tokenizer.chat_template)";
    conversation = [];
    tokens = [];
    branches = [];
    compared = [];
    renderBranches();
    renderConversation();
    $("output-tokens").replaceChildren();
    $("output-prompt").textContent = "";
    $("inspect").replaceChildren(el("p", { className: "note", textContent: "Click a generated token." }));
    setState("ready");
    setMode(chats && params.get("mode") !== "text" ? "chat" : "text");
    refreshCacheList();
  } catch (e) {
    status.textContent = "";
    showError(e.message, e.retryable);
    // The old model is gone with the failed load: nothing on the page may act on it.
    loadedSpec = null;
    tokens = [];
    branches = [];
    compared = [];
    renderBranches();
    $("inspect").replaceChildren(el("p", { className: "note", textContent: "No model is loaded." }));
    $("beam-view").hidden = true;
    setState("error");
  } finally {
    progress.hidden = true;
    $("load").disabled = false;
    $("cancel-load").hidden = true;
    loadController = null;
  }
}

function backendLabel(info) {
  if (info.backend === "webgpu") return info.backendDetail || "WebGPU";
  if (info.backend === "remote")
    return `remote: ${info.backendDetail} (not available there: ${info.remote.unavailable.join("; ")})`;
  if (info.backend === "table") return "table lookup (no matrix math)";
  // src/web/engine.rs says "CPU backend chosen ([WebAssembly, ]KERNELS, N threads)" when the CPU was asked
  // for (show the kernels only), or why WebGPU was not used, with the kernels in brackets at the end.
  const detail = info.backendDetail || "";
  const chosen = /^CPU backend chosen \((?:WebAssembly, )?(.*)\)$/.exec(detail);
  const oneThread = info.threadsNote ? ` (${info.threadsNote})` : "";
  return `CPU (WebAssembly SIMD)${detail ? ` — ${chosen ? chosen[1] : detail}` : ""}${oneThread}`;
}

/** Where the weights are: on WebGPU they never stay in wasm memory (streamed: never enter it). */
function weightsLabel(info) {
  if (info.backend === "remote") return "on the server (none in this browser)";
  const wasm = `wasm memory ${formatBytes(info.wasmMemoryBytes ?? 0)}`;
  if (info.loadPath === "streamed")
    return `on the GPU, streamed from the download (${formatBytes(info.weightsInWasmBytes)} in wasm memory; ${wasm})`;
  if (info.backend === "webgpu") return `on the GPU, uploaded from wasm memory and released (${wasm})`;
  return `in wasm memory, ${formatBytes(info.weightsInWasmBytes)} (${wasm})`;
}

function showError(message, retryable, kind = "error") {
  $("error").hidden = false;
  $("error").className = kind;
  $("error-text").textContent = message;
  $("retry").hidden = !(retryable && lastLoad);
}
function hideError() {
  $("error").hidden = true;
}

// ---------------------------------------------------------------------------------------------
// Generation

/** The decoding settings; a field outside its range is an error naming it (not silently used). */
function options() {
  for (const input of document.querySelectorAll("#settings input[type=number]")) {
    // An empty seed is a fresh draw each run (the stats show the seed drawn).
    if (input.id === "seed" && input.value === "" && input.checkValidity()) continue;
    if (input.value === "" || !input.checkValidity()) {
      const name = input.closest("label")?.firstChild.textContent.trim() || input.id;
      $("settings").open = true;
      input.focus();
      throw new Error(`${name}: ${input.validationMessage || "enter a number"}`);
    }
  }
  const num = (id) => Number($(id).value);
  return {
    temperature: num("temperature"),
    topK: num("top-k"),
    topP: num("top-p"),
    minP: num("min-p"),
    repeatPenalty: num("repeat-penalty"),
    repeatWindow: num("repeat-window"),
    maxTokens: num("max-tokens"),
    seed: $("seed").value === "" ? undefined : num("seed"),
    beams: num("beams"),
    lengthNormalise: $("length-normalise").checked,
    stop: $("stop")
      .value.split(",")
      .map((s) => s.trim())
      .filter(Boolean),
    // Each step's 64 most likely tokens, for the inspector's sampler view.
    keepCandidates: 64,
    constraint: constraint(),
    lookup: $("lookup").checked,
  };
}

// ---------------------------------------------------------------------------------------------
// Structured output: the constraint panel. The engine checks the schema, regex or grammar and
// names what is wrong; the page only checks that a schema is JSON.

const CONSTRAINT_EXAMPLES = {
  character: {
    kind: "json_schema",
    prompt: "Once upon a time there was a girl called",
    text: {
      type: "object",
      properties: {
        name: { type: "string", maxLength: 20 },
        age: { type: "integer", minimum: 1, maximum: 12 },
        likes: { type: "array", items: { type: "string", maxLength: 20 }, minItems: 1, maxItems: 3 },
      },
      required: ["name", "age", "likes"],
      additionalProperties: false,
    },
  },
  story: {
    kind: "json_schema",
    prompt: "Once upon a time",
    text: {
      type: "object",
      properties: {
        title: { type: "string", maxLength: 40 },
        mood: { enum: ["happy", "sad", "scared", "funny"] },
        ending: { type: "string", maxLength: 60 },
      },
      required: ["title", "mood"],
      additionalProperties: false,
    },
  },
};

const CONSTRAINT_PLACEHOLDER = {
  json_schema: '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}',
  regex: "(yes|no), because [a-z ]{1,40}\\.",
  grammar: 'start: "The " animal " is " colour "."\nanimal: "cat" | "dog"\ncolour: "red" | "blue"',
};

/** The engine's `constraint` option from the panel (undefined for free text). */
function constraint() {
  const kind = $("constraint-kind").value;
  const text = $("constraint-text").value;
  if (!kind) return undefined;
  if (kind === "json_object") return { type: "json_object" };
  if (!text.trim())
    throw new Error(
      `Structured output: enter the ${kind === "json_schema" ? "JSON Schema" : kind === "regex" ? "regular expression" : "grammar"}`,
    );
  if (kind === "regex") return { type: "regex", pattern: text };
  if (kind === "grammar") return { type: "grammar", lark: text };
  let schema;
  try {
    schema = JSON.parse(text);
  } catch (e) {
    $("structured").open = true;
    throw new Error(`Structured output: the schema is not JSON (${e.message})`);
  }
  return { type: "json_schema", schema };
}

function onConstraintKind() {
  const kind = $("constraint-kind").value;
  $("constraint-text").hidden = !kind || kind === "json_object";
  $("constraint-text").placeholder = CONSTRAINT_PLACEHOLDER[kind] ?? "";
}

function useConstraintExample(name) {
  const ex = CONSTRAINT_EXAMPLES[name];
  $("constraint-kind").value = ex.kind;
  $("constraint-text").value = JSON.stringify(ex.text, null, 2);
  if (!chatMode()) $("prompt").value = ex.prompt;
  onConstraintKind();
}

/** What the finished text is, under a constraint: parsed JSON, or why it is unfinished. */
function constraintStat(s) {
  const c = s && constraintUsed;
  if (!c) return undefined;
  if (s.stopReason === "Incomplete") return "incomplete: the text ended before it matched (raise max tokens)";
  if (c.type !== "json_schema" && c.type !== "json_object") return "complete: the text matches";
  try {
    JSON.parse(s.text);
    return c.type === "json_schema" ? "complete: valid JSON of the schema" : "complete: a valid JSON object";
  } catch (e) {
    return `not JSON: ${e.message}`;
  }
}
let constraintUsed = null;

/**
 * Bring the output into view when it starts low on the screen (on a laptop it is below the
 * settings): it is what changes when Generate or Score is pressed.
 */
function showOutput() {
  if ($("out-panel").getBoundingClientRect().top > window.innerHeight * 0.6)
    $("out-panel").scrollIntoView({ block: "start", behavior: "smooth" });
}

/** Whether the model in the picker is the one loaded (Generate and Score run only then). */
function pickedIsLoaded() {
  const spec = selectedSpec();
  return !!loadedSpec && !!spec && loadedSpec.url === spec.url && loadedSpec.tokenizer === spec.tokenizer;
}

async function runGenerate() {
  if (!pickedIsLoaded()) return;
  hideError();
  const prompt = $("prompt").value;
  const out = $("output-tokens");
  out.replaceChildren();
  $("output-prompt").textContent = prompt;
  $("score-out").hidden = true;
  $("beam-view").hidden = true;
  tokens = [];
  branches = [];
  compared = [];
  renderBranches();
  $("inspect").replaceChildren(el("p", { className: "note", textContent: "Click a generated token." }));
  showOutput();
  setState("generating");
  $("generate").disabled = true;
  $("stop-btn").disabled = false;
  const t0 = performance.now();
  let first = null;
  try {
    const opts = options();
    constraintUsed = opts.constraint;
    for await (const t of nt.generate(prompt, opts)) {
      first ??= performance.now() - t0;
      out.append(tokenSpan(t));
      liveStats(t, tokens.length, t0, first);
    }
    summaryStats(nt.lastSummary);
    // The generation is the root of a new branch tree.
    const done = nt.lastSummary;
    branches = done
      ? [{ parent: null, at: 0, prompt, promptIds: done.promptIds, tokens, label: "the generation" }]
      : [];
    shownBranch = 0;
    renderBranches();
    if (done?.beamTree) await showBeamTree(prompt, done.beamTree, done.text);
    setState("ready");
  } catch (e) {
    showError(e.message, false);
    setState("ready");
  } finally {
    $("generate").disabled = false;
    $("stop-btn").disabled = true;
  }
}

/** A generated token as a clickable span coloured by its probability (its text as text). */
function tokenSpan(t) {
  tokens.push(t);
  return tokenSpanAt(t, tokens.length - 1);
}

/** Stats while `n` tokens of this generation are out (`t`: the latest). */
function liveStats(t, n, t0, first) {
  stats.tokens = String(n);
  stats["log P"] = t.logprobSum.toFixed(3);
  stats.perplexity = t.perplexity.toFixed(3);
  stats["tokens/s (live)"] = n > 1 ? ((1000 * (n - 1)) / (performance.now() - t0 - first)).toFixed(1) : "";
  renderStats();
}

function summaryStats(s) {
  if (s) {
    stats["prompt tokens"] = String(s.promptTokens);
    // Prefilled again: only what the previous generation's KV cache did not already hold.
    stats["KV cache"] = `reused ${s.reusedTokens} of ${s.promptTokens} prompt tokens`;
    if (s.backend === "table") {
      // A lookup takes microseconds: a tokens-per-second figure would say nothing.
      stats.speed = "a table lookup per token (no model to run)";
    } else {
      stats["time to first token"] = `${s.ttftMs.toFixed(1)} ms`;
      stats.prefill = `${s.prefillTokS.toFixed(1)} tok/s`;
      stats.decode = `${s.decodeTokS.toFixed(1)} tok/s`;
    }
    stats.stopped = STOP_REASONS[s.stopReason] || s.stopReason;
    stats["structured output"] = constraintStat(s);
    // The seed the sampler drew with: typed into the seed field, it reproduces the run.
    stats.seed = s.seed !== undefined ? String(s.seed) : "";
    stats["speculative decoding"] = speculationStat(s.speculation);
  } else {
    stats.stopped = STOP_REASONS.Aborted;
  }
  delete stats["tokens/s (live)"];
  renderStats();
}

/** The summary's speculative decoding in a line ("" when it was off). */
function speculationStat(sp) {
  if (!sp) return "";
  const kept = sp.drafted ? ` (${Math.round((100 * sp.accepted) / sp.drafted)}%)` : "";
  return `${sp.drafter}: ${sp.tokensPerPass.toFixed(2)} tokens per forward pass; ${sp.accepted} of ${sp.drafted} guesses kept${kept} in ${sp.passes} verification passes`;
}

const STOP_REASONS = {
  Eos: "the model ended its text (end token)",
  StopString: "a stop string",
  MaxTokens: "max tokens reached",
  ContextFull: "the context is full",
  Aborted: "Stop pressed",
  ConstraintComplete: "the structured output is complete",
  Incomplete: "the structured output was not finished (max tokens or context)",
};

function stopGenerate() {
  nt.abort();
  $("stop-btn").disabled = true;
}

function inspect(i) {
  const t = tokens[i];
  if (!t) return;
  for (const s of document.querySelectorAll(".tok.selected")) s.classList.remove("selected");
  document.querySelector(`.tok[data-i="${i}"]`)?.classList.add("selected");
  const box = $("inspect");
  // One numbering: "token N" counts the output from 1 (as the branch labels do); the position
  // counts the whole sequence from 0, prompt included (what the model's KV cache indexes).
  // A remote engine's server sends token text, and logprobs only where it gives them.
  const unsent = "not sent by the server";
  const rows = [
    ["output token", `${i + 1} of ${tokens.length}`],
    ["token", JSON.stringify(t.token)],
    ["id", t.id === null ? unsent : String(t.id)],
    ["text", JSON.stringify(t.text)],
    ["P(token | before)", t.prob === null ? unsent : t.prob.toPrecision(4)],
    ["log P", t.logprob === null ? unsent : t.logprob.toFixed(4)],
    ["log P so far", t.logprobSum.toFixed(4)],
    ["P so far", Math.exp(t.logprobSum).toPrecision(4)],
    ["perplexity so far", t.perplexity.toFixed(3)],
    [
      "position",
      t.id === null
        ? `${t.position} after the prompt (a remote engine)`
        : `${t.position} in the sequence (the prompt is 0–${t.position - i - 1})`,
    ],
  ];
  if (t.speculated) rows.push(["speculative decoding", speculationText(t)]);
  const dl = el("dl", { className: "stats" });
  for (const [k, v] of rows) dl.append(el("dt", { textContent: k }), el("dd", { textContent: v }));
  const list = alternativesList(t, canBranch() ? (alt) => branchFrom(i, alt) : null);
  box.replaceChildren(dl, el("h3", { textContent: "Most likely at this step" }), list);
  if (t.candidates) box.append(samplerPanel(i, t));
}

// ---------------------------------------------------------------------------------------------
// The sampler view: for the selected step, what each setting keeps, from the step's stored
// logits (its 64 most likely tokens) and the library's own sampler in the worker; nothing runs
// the model again.

function samplerPanel(i, t) {
  const branch = branches[shownBranch];
  const history = [...(branch?.promptIds ?? []), ...tokens.slice(0, i).map((x) => x.id)];
  return samplerView(nt, t, options(), history);
}

// ---------------------------------------------------------------------------------------------
// The beam search view: every extension the search considered, as a tree with each
// hypothesis's total probability; pruned ones greyed, the best beam's path marked; and greedy's
// pick beside it.

/** `bestText`: the best beam's text (what the output shows). */
async function showBeamTree(prompt, tree, bestText) {
  const view = $("beam-view");
  view.replaceChildren(...beamTreeNodes(tree, bestText));
  view.hidden = false;
  view.append(await greedyLine(nt, prompt, options()));
}

// ---------------------------------------------------------------------------------------------
// Branches: continue the text from any position with another token. The prefix stays in the
// KV cache (the engine keeps the longest prefix the new prompt shares with the last one), so
// only the new suffix is computed. Branches form a tree; any two can be compared.

let branches = []; // [{parent, at, prompt, promptIds, tokens, label, summary}]
let shownBranch = 0;

const canBranch = () => !chatMode() && branches.length > 0 && document.body.dataset.state === "ready";

async function branchFrom(i, alt) {
  if (document.body.dataset.state !== "ready") return;
  const base = branches[shownBranch];
  const ids = [...base.promptIds, ...base.tokens.slice(0, i).map((t) => t.id)];
  const branch = {
    parent: shownBranch,
    at: i,
    prompt: base.prompt,
    promptIds: base.promptIds,
    tokens: base.tokens.slice(0, i),
    label: `${JSON.stringify(alt.piece ?? alt.token)} at token ${i + 1}`,
  };
  branches.push(branch);
  shownBranch = branches.length - 1;
  showBranch(shownBranch);
  hideError();
  setState("generating");
  $("generate").disabled = true;
  $("stop-btn").disabled = false;
  const out = $("output-tokens");
  const t0 = performance.now();
  let first = null;
  try {
    const running = new RunningLogP(branch.tokens.at(-1)?.logprobSum ?? 0, branch.tokens.length);
    for await (const t of nt.generate({ ids }, { ...options(), forceTokens: [alt.id] })) {
      first ??= performance.now() - t0;
      const token = running.add(t);
      branch.tokens.push(token);
      const n = branch.tokens.length;
      out.append(tokenSpanAt(token, n - 1));
      liveStats(token, n, t0, first);
    }
    branch.summary = nt.lastSummary;
    summaryStats(nt.lastSummary);
    if (nt.lastSummary) {
      const s = nt.lastSummary;
      stats.branch = `from token ${i + 1}: ${s.reusedTokens} positions reused from the KV cache, ${s.promptTokens - s.reusedTokens} recomputed, then ${s.generatedTokens} new tokens`;
      renderStats();
    }
  } catch (e) {
    showError(e.message, false);
  } finally {
    setState("ready");
    $("generate").disabled = false;
    $("stop-btn").disabled = true;
    renderBranches();
    // The inspector follows the text: it shows the token the branch put in place of the old one.
    if (shownBranch === branches.indexOf(branch)) inspect(i);
  }
}

/** Show branch `k` in the output (its tokens become the ones the inspector reads). */
function showBranch(k) {
  shownBranch = k;
  const b = branches[k];
  tokens = b.tokens = withRunningSums(b.tokens);
  $("output-prompt").textContent = b.prompt;
  $("output-tokens").replaceChildren(...tokens.map((t, j) => tokenSpanAt(t, j)));
  for (const [j, span] of [...$("output-tokens").children].entries())
    if (j < b.at && b.parent !== null) span.classList.add("shared");
  renderBranches();
  // The inspector described a token of the branch shown before.
  $("inspect").replaceChildren(el("p", { className: "note", textContent: "Click a generated token." }));
}

function branchSummary(b) {
  const last = b.tokens.at(-1);
  return last
    ? `log P ${last.logprobSum.toFixed(3)}, perplexity ${last.perplexity.toFixed(3)}, ${b.tokens.length} tokens`
    : "no tokens";
}

function renderBranches() {
  const box = $("branches");
  box.hidden = branches.length < 2;
  if (box.hidden) return;
  const list = el("ul", { className: "branch-tree" });
  const items = branches.map((b, k) => {
    const show = el("button", {
      type: "button",
      className: "show",
      textContent: k === 0 ? "the generation" : `branch ${k}: ${b.label}`,
    });
    show.setAttribute("aria-pressed", String(k === shownBranch));
    show.addEventListener("click", () => showBranch(k));
    const pick = el("input", { type: "checkbox", className: "compare-pick", checked: compared.includes(k) });
    pick.setAttribute("aria-label", `compare ${k === 0 ? "the generation" : `branch ${k}`}`);
    pick.addEventListener("change", () => {
      compared = pick.checked ? [...compared, k].slice(-2) : compared.filter((x) => x !== k);
      renderBranches();
    });
    return el(
      "li",
      { className: k === shownBranch ? "current" : "" },
      pick,
      show,
      el("span", { className: "note", textContent: ` ${branchSummary(b)}` }),
      el("ul"),
    );
  });
  // A tree: each branch under the one it left.
  branches.forEach((b, k) => (b.parent === null ? list : items[b.parent].lastElementChild).append(items[k]));
  const compare = el("div", { className: "compare" });
  if (compared.length === 2) {
    for (const k of compared) {
      const b = branches[k];
      const text = b.prompt + b.tokens.map((t) => t.text).join("");
      compare.append(
        el(
          "div",
          {},
          el("h3", { textContent: k === 0 ? "the generation" : `branch ${k}` }),
          el("p", { className: "output", textContent: text }),
          el("p", { className: "note", textContent: branchSummary(b) }),
        ),
      );
    }
  }
  box.replaceChildren(el("h3", { textContent: "Branches (tick two to compare)" }), list, compare);
}

let compared = [];

// ---------------------------------------------------------------------------------------------
// Scoring: the chain rule on a text, or on candidate continuations of the prompt, token by token:
// a heat map of surprisal (-log2 P, in bits), log P, average NLL and perplexity, and which
// candidate is more likely, with and without length normalisation.

async function runScore() {
  if (!pickedIsLoaded()) return;
  hideError();
  showOutput();
  const prompt = $("prompt").value;
  const candidates = $("candidates")
    .value.split("\n")
    .filter((line) => line.trim());
  const box = $("score-out");
  try {
    box.replaceChildren(...(await scoreNodes(nt, prompt, candidates)));
    box.hidden = false;
  } catch (e) {
    showError(e.message, false);
  }
}

// ---------------------------------------------------------------------------------------------
// Chat: a conversation through the model's own chat template. Each reply re-renders the whole
// conversation; the worker keeps the KV cache of what the new prompt shares with the last one,
// so only the new turn is prefilled (the stats say how much was reused).

let conversation = []; // [{role, content, first?, count?}]: assistant turns know their token spans

function chatMode() {
  return document.querySelector('input[name="mode"]:checked')?.value === "chat";
}

function setMode(mode) {
  document.querySelector(`input[name="mode"][value="${mode}"]`).checked = true;
  const chat = mode === "chat";
  $("text-input").hidden = $("output").hidden = $("generate").hidden = $("score-btn").hidden = chat;
  $("chat-input").hidden = $("conversation").hidden = $("send").hidden = !chat;
  $("regenerate").hidden = $("edit-last").hidden = $("clear-chat").hidden = !chat;
  $("rendered").hidden = !chat || !conversation.length;
  $("gen-h").textContent = chat ? "Chat" : "Prompt";
  $("out-h").textContent = chat ? "Conversation" : "Output";
  updateChatButtons();
}

function updateChatButtons() {
  const idle = document.body.dataset.state === "ready" && !!loadedSpec;
  const last = conversation.at(-1);
  $("send").disabled = !idle;
  $("regenerate").disabled = !idle || last?.role !== "assistant";
  $("edit-last").disabled = !idle || !conversation.some((m) => m.role === "user");
  $("clear-chat").disabled = !idle || !conversation.length;
}

/** The messages the template renders: the system message (if any) and the turns. */
function chatMessages() {
  const system = $("system").value.trim();
  const turns = conversation.map(({ role, content }) => ({ role, content }));
  return system ? [{ role: "system", content: system }, ...turns] : turns;
}

function renderConversation() {
  const list = $("conversation");
  list.replaceChildren();
  const system = $("system").value.trim();
  if (system)
    list.append(el("li", { className: "system" }, el("span", { className: "role", textContent: "system" }), system));
  for (const m of conversation) {
    const li = el("li", { className: m.role }, el("span", { className: "role", textContent: m.role }));
    if (m.role === "assistant" && m.first !== undefined) {
      // The reply's tokens again, clickable for the inspector.
      const spans = tokens.slice(m.first, m.first + m.count).map((t, k) => tokenSpanAt(t, m.first + k));
      li.append(...spans);
    } else li.append(m.content);
    list.append(li);
  }
  return list;
}

function tokenSpanAt(t, i) {
  const span = el("span", { className: "tok", textContent: t.text, tabIndex: 0 });
  if (t.text === "") span.classList.add("empty");
  span.dataset.i = i;
  if (t.prob !== null) span.style.backgroundColor = probColor(t.prob);
  span.title = `${JSON.stringify(t.token)}  P = ${t.prob === null ? "not sent by the server" : t.prob.toFixed(4)}`;
  if (t.speculated) {
    span.classList.add(speculationClass(t));
    span.title += `\n${speculationText(t)}`;
  }
  return span;
}

async function sendMessage() {
  const text = $("message").value.trim();
  if (!text || !pickedIsLoaded()) return;
  conversation.push({ role: "user", content: text });
  $("message").value = "";
  await runReply();
}

async function runReply() {
  hideError();
  const messages = chatMessages();
  const turn = { role: "assistant", content: "", first: tokens.length, count: 0 };
  conversation.push(turn);
  const list = renderConversation();
  const li = list.lastElementChild;
  setState("generating");
  updateChatButtons();
  $("stop-btn").disabled = false;
  const t0 = performance.now();
  let first = null;
  try {
    const opts = options();
    constraintUsed = opts.constraint;
    for await (const t of nt.reply(messages, { ...opts, dropOldest: $("drop-oldest").checked })) {
      first ??= performance.now() - t0;
      li.append(tokenSpan(t));
      turn.count += 1;
      turn.content += t.text;
      liveStats(t, turn.count, t0, first);
    }
    const s = nt.lastSummary;
    summaryStats(s);
    if (s) {
      turn.content = s.text;
      forgetDropped(s.messages, messages.length);
    }
    $("rendered-text").textContent =
      nt.info.backend === "remote"
        ? "(the server renders the conversation with its own chat template: not shown here)"
        : await nt.renderChat(chatMessages(), { addGenerationPrompt: false });
    $("rendered").hidden = false;
  } catch (e) {
    // The reply did not happen: the user's message goes back to the input box to retry.
    conversation.pop();
    if (conversation.at(-1)?.role === "user") $("message").value = conversation.pop().content;
    renderConversation();
    showError(e.message, false);
  } finally {
    setState("ready");
    $("stop-btn").disabled = true;
    updateChatButtons();
  }
}

/** After `dropOldest` made room: keep the turns the prompt still holds (`kept`, as rendered). */
function forgetDropped(kept, sent) {
  if (!kept || kept.length === sent) return;
  const dropped = sent - kept.length;
  conversation.splice(0, dropped);
  stats["KV cache"] += ` (${dropped} oldest messages dropped to fit the context)`;
  renderStats();
  renderConversation();
}

function regenerate() {
  if (conversation.at(-1)?.role !== "assistant") return;
  conversation.pop();
  runReply();
}

function editLast() {
  while (conversation.length && conversation.at(-1).role !== "user") conversation.pop();
  const last = conversation.pop();
  if (last) $("message").value = last.content;
  renderConversation();
  updateChatButtons();
  $("message").focus();
}

function clearChat() {
  conversation = [];
  tokens = [];
  renderConversation();
  $("rendered").hidden = true;
  $("inspect").replaceChildren(el("p", { className: "note", textContent: "Click a generated token." }));
  updateChatButtons();
}

// ---------------------------------------------------------------------------------------------
// Stats and cache list

function renderStats() {
  const dl = $("stats");
  dl.replaceChildren();
  for (const [k, v] of Object.entries(stats)) {
    if (v === undefined || v === "") continue;
    dl.append(el("dt", { textContent: k }), el("dd", { textContent: v }));
  }
}

async function refreshCacheList() {
  const list = $("cache-list");
  let items = [];
  try {
    items = await listCached();
  } catch (e) {
    list.replaceChildren(el("li", { textContent: `The cache cannot be read here: ${e.message}` }));
    return;
  }
  list.replaceChildren();
  if (!items.length) list.append(el("li", { className: "note", textContent: "none yet" }));
  for (const item of items) {
    const del = el("button", { type: "button", textContent: "Delete" });
    del.addEventListener("click", async () => {
      await deleteCached(item.url);
      refreshCacheList();
    });
    const size = item.complete
      ? formatBytes(item.bytes)
      : `partial: ${formatBytes(item.bytes)}${item.size ? ` of ${formatBytes(item.size)}` : ""}, resumes on the next load`;
    const li = el(
      "li",
      {},
      el("span", { className: "name", textContent: item.name, title: item.url }),
      el("span", { className: "size", textContent: size }),
      del,
    );
    list.append(li);
  }
  if (navigator.storage?.estimate) {
    const { usage, quota } = await navigator.storage.estimate();
    const persisted = navigator.storage.persisted ? await navigator.storage.persisted() : false;
    $("storage-info").textContent =
      `Storage used ${formatBytes(usage || 0)} of ${formatBytes(quota || 0)} available${persisted ? " (persistent)" : ""}.`;
  }
}

// ---------------------------------------------------------------------------------------------

$("generate").addEventListener("click", runGenerate);
$("constraint-kind").addEventListener("change", onConstraintKind);
for (const b of document.querySelectorAll(".constraint-example"))
  b.addEventListener("click", () => useConstraintExample(b.dataset.example));
$("send").addEventListener("click", sendMessage);
$("regenerate").addEventListener("click", regenerate);
$("edit-last").addEventListener("click", editLast);
$("clear-chat").addEventListener("click", clearChat);
for (const radio of document.querySelectorAll('input[name="mode"]'))
  radio.addEventListener("change", () => setMode(radio.value));
$("message").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey) && !$("send").disabled) sendMessage();
});
$("stop-btn").addEventListener("click", stopGenerate);
$("score-btn").addEventListener("click", runScore);
$("retry").addEventListener("click", () => lastLoad?.());
$("cancel-load").addEventListener("click", () => loadController?.abort());
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey) && !$("generate").disabled) runGenerate();
});
for (const box of [$("output-tokens"), $("conversation")]) {
  box.addEventListener("click", (e) => {
    const span = e.target.closest(".tok");
    if (span) inspect(Number(span.dataset.i));
  });
  box.addEventListener("keydown", (e) => {
    const span = e.target.closest(".tok");
    if (span && (e.key === "Enter" || e.key === " ")) {
      e.preventDefault();
      inspect(Number(span.dataset.i));
    }
  });
}

if ("serviceWorker" in navigator && !params.has("nosw")) {
  // Beside this script, wherever the site lives (a sub-path): its scope is the app's folder.
  navigator.serviceWorker
    .register(new URL("sw.js", import.meta.url))
    .catch((e) => console.warn("service worker not registered:", e));
}
setState("idle");
initPicker();
refreshCacheList();
window.nexttokenApp = {
  nt,
  get tokens() {
    return tokens;
  },
  get stats() {
    return stats;
  },
  get conversation() {
    return conversation;
  },
  get branches() {
    return branches;
  },
};
