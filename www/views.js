// Rendering shared by the full page (app.js) and <next-token> (next-token.js): a token's
// alternatives, the sampler view, the beam search tree, scored texts as surprisal heat maps.
// Everything returns DOM nodes; model output only enters them as text, never as HTML.

import { RunningLogP } from "./nexttoken.js";
import { roundMegabytes as megabytes } from "./model-cache.js";

export const el = (tag, props = {}, ...children) => {
  const node = Object.assign(document.createElement(tag), props);
  for (const c of children) node.append(c);
  return node;
};

/**
 * What speculative decoding did at token `t` (a sentence), or "" when no verification pass made
 * it: the pass, its guesses, and whether the guess at this token's row was kept.
 */
export function speculationText(t) {
  const s = t.speculated;
  if (!s) return "";
  const guesses = s.drafted.map((g) => JSON.stringify(g.piece)).join(" ");
  const head = `pass ${s.pass + 1} checked ${s.drafted.length} guessed tokens (${guesses}) in one forward pass; row ${s.row}:`;
  if (s.outcome === "accepted") return `${head} the model's token is the guess, kept`;
  if (s.outcome === "bonus")
    return `${head} every guess was kept, and this token came free from the row after the last`;
  const guess = JSON.stringify(s.drafted[s.row]?.piece ?? "");
  return `${head} the guess ${guess} was rejected; the model's own token is this one, and the guesses after it were thrown away (the KV cache cut back)`;
}

/** The CSS class marking a token by its speculative outcome ("spec-accepted", ...), or "". */
export function speculationClass(t) {
  return t.speculated ? `spec-${t.speculated.outcome}` : "";
}

/** 0 → red-ish, 1 → green: a light background that keeps dark text readable. */
export function probColor(p) {
  const hue = Math.round(120 * Math.sqrt(p));
  return `hsl(${hue} 80% 85%)`;
}

/** Heat colour for a surprisal in bits: 0 bits green, 10 bits and more red. */
export function surprisalColor(bits) {
  const hue = Math.round(120 * Math.max(0, 1 - Math.min(bits, 10) / 10));
  return `hsl(${hue} 80% 85%)`;
}

/** `list` (tokens) with the running log P and perplexity recomputed from the first. */
export function withRunningSums(list) {
  const running = new RunningLogP();
  return list.map((t) => running.add(t));
}

/** The step's most likely tokens as bars; `onBranch(alt)`, when given, adds "continue with this". */
export function alternativesList(t, onBranch) {
  const list = el("ol", { className: "alternatives" });
  // Under structured output: the model's likely tokens that the constraint did not allow.
  const removed = new Set((t.removed ?? []).map((r) => r.id));
  for (const alt of t.top) {
    const bar = el("span", { className: "bar" });
    bar.style.width = `${(100 * alt.prob).toFixed(1)}%`;
    const li = el(
      "li",
      {},
      el("code", { textContent: JSON.stringify(alt.token) }),
      el("span", { className: "p", textContent: alt.prob.toFixed(4) }),
    );
    if (alt.id === t.id) li.classList.add("chosen");
    else if (removed.has(alt.id)) {
      li.classList.add("removed");
      li.title = "the constraint removed this token: the output could not continue with it";
    } else if (onBranch && alt.prob > 0) {
      // A token the model gives probability 0 cannot be a branch.
      const go = el("button", { type: "button", className: "branch", textContent: "continue with this" });
      go.setAttribute(
        "aria-label",
        `continue the text from here with ${JSON.stringify(alt.piece ?? alt.token)} instead (P = ${alt.prob.toFixed(2)})`,
      );
      go.addEventListener("click", () => onBranch(alt));
      li.append(go);
    }
    li.append(bar);
    list.append(li);
  }
  return list;
}

// The sampler view: for one step, what each setting keeps, from the step's stored logits (its 64
// most likely tokens) and the library's own sampler in the worker; nothing runs the model again.

export const SAMPLER_SLIDERS = [
  ["temperature", "temperature", 0, 2, 0.05],
  ["topK", "top-k", 0, 64, 1],
  ["topP", "top-p", 0, 1, 0.01],
  ["minP", "min-p", 0, 1, 0.01],
  ["repeatPenalty", "repeat penalty", 1, 2, 0.05],
];

/**
 * `nt`: the NextToken; `t`: a token event with `candidates`; `current`: the decoding options the
 * sliders start from; `history`: the token ids before the step; `keys`: which sliders to show.
 */
export function samplerPanel(nt, t, current, history, keys = SAMPLER_SLIDERS.map((s) => s[0])) {
  const panel = el("div", { className: "sampler-view" }, el("h3", { textContent: "What the sampler keeps here" }));
  const values = { repeatPenalty: current.repeatPenalty ?? 1 };
  const sliders = el("div", { className: "sliders" });
  for (const [key, label, min, max, step] of SAMPLER_SLIDERS) {
    values[key] = Math.min(max, Math.max(min, current[key] ?? (key === "topP" ? 1 : key === "repeatPenalty" ? 1 : 0)));
    if (!keys.includes(key)) continue;
    const out = el("output", { textContent: String(values[key]) });
    const input = el("input", { type: "range", min, max, step, value: values[key] });
    input.dataset.key = key;
    input.setAttribute("aria-label", label);
    input.addEventListener("input", () => {
      values[key] = Number(input.value);
      out.textContent = input.value;
      update();
    });
    sliders.append(el("label", {}, el("span", { textContent: label }), input, out));
  }
  const chart = el("ol", { className: "sampler-bars" });
  panel.append(
    sliders,
    chart,
    el("p", {
      className: "note",
      textContent:
        "Grey: the model's probability. Blue: the probability the draw uses after these settings (0 = removed). Over this step's 64 most likely tokens.",
    }),
  );
  // The model's own probabilities of the candidates: P = exp(logit - logsumexp) over the step's
  // whole row, as the token's `prob` (under a constraint the candidates are the allowed tokens,
  // and the draw renormalises over those: the blue bars).
  const lse = t.candidates.logsumexp;
  let pending = 0;
  async function update() {
    const ticket = ++pending;
    const kept = await nt.samplerView(t.candidates, { ...values, repeatWindow: current.repeatWindow ?? 64 }, history);
    if (ticket !== pending) return; // a newer slider position is on its way
    const keptProb = new Map(kept.map((k) => [k.id, k.prob]));
    chart.replaceChildren();
    t.candidates.ids.slice(0, 20).forEach((id, j) => {
      const p = Math.exp(t.candidates.logits[j] - lse);
      const q = keptProb.get(id) ?? 0;
      const plain = el("span", { className: "bar plain" });
      plain.style.width = `${(100 * p).toFixed(1)}%`;
      const drawn = el("span", { className: "bar drawn" });
      drawn.style.width = `${(100 * q).toFixed(1)}%`;
      const li = el(
        "li",
        { className: q > 0 ? "kept" : "removed" },
        el("code", { textContent: JSON.stringify(t.candidates.pieces[j]) }),
        el("span", { className: "p", textContent: `${p.toFixed(3)} → ${q.toFixed(3)}` }),
        plain,
        drawn,
      );
      li.dataset.id = id;
      li.dataset.prob = p.toFixed(6);
      li.dataset.kept = q.toFixed(6);
      chart.append(li);
    });
    panel.dataset.keptIds = kept.map((k) => k.id).join(",");
  }
  update();
  return panel;
}

// The beam search view: every extension the search considered, as a tree with each hypothesis's
// total probability; pruned ones greyed, the best beam's path marked; greedy's pick beside it.

/** The heading, the tree and the best beam's line (`bestText`: the best beam's text). */
export function beamTreeNodes({ nodes, best }, bestText) {
  const onBest = new Set();
  for (let at = best; at !== null && at !== undefined; at = nodes[at].parent) onBest.add(at);
  const lists = new Map([[null, el("ul", { className: "beam-tree" })]]);
  // A search of many steps nests as deep as it ran: past INDENTED_LEVELS the levels stop moving
  // right (each still starts a new list), and the tree scrolls inside its box (style.css).
  const INDENTED_LEVELS = 8;
  const depth = new Map([[null, 0]]);
  nodes.forEach((n, k) => {
    depth.set(k, depth.get(n.parent ?? null) + 1);
    const label = `${JSON.stringify(n.piece)}  P = ${Math.exp(n.logprob).toFixed(2)}${n.finished ? " (ended)" : ""}`;
    const li = el("li", {
      className: [n.kept ? "kept" : "pruned", onBest.has(k) ? "best" : ""].join(" ").trim(),
      textContent: label,
    });
    li.title = n.kept
      ? `kept at step ${n.step + 1}: log P = ${n.logprob.toFixed(3)}`
      : `pruned at step ${n.step + 1}: not among the best beams`;
    const children = el("ul", { className: depth.get(k) >= INDENTED_LEVELS ? "unindented" : "" });
    li.append(children);
    lists.set(k, children);
    lists.get(n.parent ?? null).append(li);
  });
  const bestP = best !== null && best !== undefined ? Math.exp(nodes[best].logprob) : 0;
  const line = el("p", {
    className: "beam-best",
    textContent: `Best beam: ${JSON.stringify(bestText.trim())}, P = ${bestP.toFixed(2)}.`,
  });
  return [el("h3", { textContent: "Beam search, step by step (grey: pruned)" }), lists.get(null), line];
}

/** Greedy's path from `prompt` (the most likely token at every step), as a line for the beam view. */
export async function greedyLine(nt, prompt, options) {
  try {
    let logprob = 0;
    const out = [];
    for await (const t of nt.generate(prompt, { ...options, beams: 1, temperature: 0 })) {
      logprob += t.logprob;
      out.push(t.text);
    }
    return el("p", {
      className: "beam-greedy",
      textContent: `Greedy (always the most likely token): ${JSON.stringify(out.join("").trim())}, P = ${Math.exp(logprob).toFixed(2)}.`,
    });
  } catch (e) {
    return el("p", { className: "note", textContent: `greedy could not run: ${e.message}` });
  }
}

// Scoring: the chain rule on a text, or on candidate continuations of a prompt, token by token: a
// heat map of surprisal (-log2 P, in bits), log P, average NLL and perplexity, and which candidate
// is more likely, with and without length normalisation.

/** One scored text: its tokens as a surprisal heat map and its totals. */
export function scoredText(label, r) {
  const heat = el("p", { className: "output heat" });
  for (const t of r.tokens) {
    // null: a remote engine's server gives no probability for a text's first token.
    const bits = t.logprob === null ? Number.NaN : -t.logprob / Math.LN2;
    // The token's text as it stands in the scored text; one that makes none (an end token, a
    // byte completed by a later token) shows its spelling, set apart.
    const span = t.piece
      ? el("span", { className: "tok", textContent: t.piece })
      : el("span", { className: "tok silent", textContent: `${heat.textContent ? " " : ""}${t.token}` });
    if (t.logprob === null) span.title = `${JSON.stringify(t.token)}: P not given by the server (a text's first token)`;
    else {
      span.style.backgroundColor = surprisalColor(bits);
      span.title = `${JSON.stringify(t.token)}: P = ${t.prob.toPrecision(4)}, surprisal ${bits.toFixed(2)} bits`;
    }
    heat.append(span);
  }
  const totals = el("p", {
    className: "note",
    textContent: `log P = ${r.logprob.toFixed(2)}, P = ${r.probability.toPrecision(4)}, average NLL = ${r.avgNll.toFixed(4)} nats, perplexity = ${r.perplexity.toFixed(3)}, ${r.tokens.length} tokens${r.unscored ? ` (the first unscored: the server gives no probability for it)` : ""}`,
  });
  const item = el("div", { className: "scored" }, el("h3", { textContent: label }), heat, totals);
  Object.assign(item.dataset, { logprob: r.logprob, perplexity: r.perplexity, avgNll: r.avgNll });
  return item;
}

export function scoreTable(r) {
  const table = el("table", { className: "score" });
  table.append(
    el(
      "tr",
      {},
      el("th", { textContent: "token" }),
      el("th", { textContent: "P(token | before)" }),
      el("th", { textContent: "log P" }),
      el("th", { textContent: "surprisal (bits)" }),
    ),
  );
  for (const t of r.tokens) {
    table.append(
      el(
        "tr",
        {},
        el("td", {}, el("code", { textContent: JSON.stringify(t.token) })),
        el("td", { textContent: t.prob === null ? "not given" : t.prob.toPrecision(4) }),
        el("td", { textContent: t.logprob === null ? "" : t.logprob.toFixed(4) }),
        el("td", { textContent: t.logprob === null ? "" : (-t.logprob / Math.LN2).toFixed(2) }),
      ),
    );
  }
  return table;
}

/**
 * The text a typed candidate continues `prompt` with. Candidates are typed (or given to the
 * element trimmed) without the space that separates them from the prompt, while the model scores
 * text exactly as it would have generated it: "Paris" after "The capital of France is" is
 * " Paris". So a space goes between two words (letters or digits on both sides, outside scripts
 * written without spaces); punctuation, a candidate that starts with a space and a prompt that
 * ends with one are left as they are.
 */
export function continuationText(prompt, candidate) {
  const wordEnd =
    /[\p{L}\p{N}]$/u.test(prompt) &&
    !/[\p{Script=Han}\p{Script=Hiragana}\p{Script=Katakana}\p{Script=Thai}]$/u.test(prompt);
  return wordEnd && /^[\p{L}\p{N}]/u.test(candidate) ? ` ${candidate}` : candidate;
}

/** Score `prompt` alone (no candidates), or each candidate after it: the nodes to show. */
export async function scoreNodes(nt, prompt, candidates) {
  if (!candidates.length) {
    const r = await nt.score(prompt);
    return [scoredText("the prompt", r), scoreTable(r)];
  }
  const scored = [];
  for (const text of candidates)
    scored.push({ text, r: await nt.score(continuationText(prompt, text), { after: prompt }) });
  const best = (key) => scored.reduce((a, b) => (key(b.r) > key(a.r) ? b : a));
  const byTotal = best((r) => r.logprob);
  const byAverage = best((r) => -r.avgNll);
  const verdict = el("p", { className: "verdict" });
  verdict.append(
    `Most likely: ${JSON.stringify(byTotal.text)} (log P ${byTotal.r.logprob.toFixed(2)}). Length-normalised (average log P per token): ${JSON.stringify(byAverage.text)} (${(-byAverage.r.avgNll).toFixed(3)}).`,
  );
  return [
    el("p", {
      className: "note",
      textContent: `P(continuation | ${JSON.stringify(prompt)}), each token given everything before it.`,
    }),
    ...scored.map(({ text, r }) => scoredText(text, r)),
    verdict,
  ];
}

/** A preflight (`NextToken.preflight`) in one line: what a load downloads and needs, and how fast it should run here. */
export function preflightText(p) {
  const parts = [
    p.cached ? `${p.name}: stored here, no download` : `${p.name}: ${megabytes(p.downloadBytes)} to download`,
  ];
  if (p.memoryBytes) parts.push(`needs about ${megabytes(p.memoryBytes)} of memory`);
  if (p.gpu && p.cpu)
    parts.push(
      `about ${Math.round(p.gpu.tokensPerSecond)} tokens/s on this device's GPU, ${Math.round(p.cpu.tokensPerSecond)} on its CPU (estimated)`,
    );
  else if (p.cpu) parts.push(`about ${Math.round(p.cpu.tokensPerSecond)} tokens/s on this device's CPU (estimated)`);
  return [...parts, ...p.warnings].join(" · ");
}

/**
 * Which engine runs a loaded model (`info` from `NextToken.load`), for the stats: why this one,
 * and on a shared engine how many pages it serves and how many loads share the model's one copy.
 */
export function engineText(info) {
  if (!info.engineNote) return "";
  if (info.engine !== "shared") return info.engineNote;
  const count = (n, what) => `${n} ${what}${n === 1 ? "" : "s"}`;
  return `${info.engineNote}: ${count(info.enginePages, "page")} connected, this model's one copy used by ${count(info.modelUsers, "load")}`;
}
