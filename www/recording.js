// Recordings: a generation (or a score) written by the engine itself, played back by
// <next-token replay> where the model cannot run or the page wants no download at all.
//
// The format is what `nexttoken generate --json` writes: one JSON object per line, a line per
// token ({id, token, text, prob, logprob, top: [{id, token, prob}], speculated?}) and then the
// summary ({text, prompt, model, options, stop_reason, generated_tokens, ...}); `nexttoken score
// --json` lines ({text, model, tokens: [{token, piece, prob, logprob}], logprob, avg_nll,
// perplexity}) may be added for the score view. The JS API's own objects (its tokens, then
// `lastSummary`; camelCase) are read too, and so is one JSON array of such objects. A file may
// hold several runs (each its tokens and then its summary): the element plays the one for its
// prompt. Everything is checked, and a recording that is not one is an error that says where.

/** Larger than any lesson's recording, small enough to read at once. */
export const MAX_RECORDING_BYTES = 8 << 20;

/** A recording from its text; throws an Error naming the first line that is not right. */
export function parseRecording(text) {
  if (typeof text !== "string") throw new Error("a recording is text (JSON lines)");
  if (text.length > MAX_RECORDING_BYTES)
    throw new Error(`the recording is larger than ${MAX_RECORDING_BYTES >> 20} MB: not a lesson's recording`);
  const objects = recordObjects(text);
  const runs = [];
  const scores = [];
  let tokens = [];
  objects.forEach(({ value, where }) => {
    const fail = (why) => {
      throw new Error(`not a nexttoken recording: ${where}: ${why}`);
    };
    if (value === null || typeof value !== "object" || Array.isArray(value)) fail("not a JSON object");
    if (Array.isArray(value.beams)) fail("beam search output cannot be played back (record a generation)");
    if (Array.isArray(value.tokens)) scores.push(scoreRecord(value, fail));
    else if ("prob" in value && "id" in value) tokens.push(tokenRecord(value, fail));
    else if ("text" in value && ("prompt" in value || "stop_reason" in value || "stopReason" in value)) {
      runs.push(run(value, tokens, fail));
      tokens = [];
    } else fail("neither a token, a summary nor a score");
  });
  if (tokens.length) runs.push(run({}, tokens, () => {})); // a recording cut before its summary
  if (!runs.length && !scores.length) throw new Error("not a nexttoken recording: it holds no tokens");
  return { runs, scores };
}

/** The JSON values of `text`: one array, or one object per line. */
function recordObjects(text) {
  const trimmed = text.trim();
  if (trimmed.startsWith("[")) {
    let list;
    try {
      list = JSON.parse(trimmed);
    } catch (e) {
      throw new Error(`not a nexttoken recording: not JSON (${e.message})`);
    }
    if (!Array.isArray(list)) throw new Error("not a nexttoken recording: not a JSON array");
    return list.map((value, i) => ({ value, where: `item ${i + 1}` }));
  }
  const out = [];
  trimmed.split("\n").forEach((line, i) => {
    if (!line.trim()) return;
    try {
      out.push({ value: JSON.parse(line), where: `line ${i + 1}` });
    } catch {
      throw new Error(`not a nexttoken recording: line ${i + 1} is not JSON: ${JSON.stringify(line.slice(0, 60))}`);
    }
  });
  return out;
}

const isId = (v) => Number.isInteger(v) && v >= 0;
const isProb = (v) => typeof v === "number" && v >= 0 && v <= 1;
const str = (v) => (typeof v === "string" ? v : undefined);

/** ln p where the record gives none (the CLI's alternatives carry p alone). */
const logOf = (p) => (p > 0 ? Math.log(p) : -9999);

function tokenRecord(v, fail) {
  if (!isId(v.id)) fail("a token's id is not a whole number");
  if (!isProb(v.prob)) fail(`token ${v.id}: prob is not a probability`);
  if (typeof v.text !== "string") fail(`token ${v.id}: text is not a string`);
  const logprob = typeof v.logprob === "number" && Number.isFinite(v.logprob) ? v.logprob : logOf(v.prob);
  const alternatives = (list, what) => {
    if (list === undefined) return [];
    if (!Array.isArray(list)) fail(`token ${v.id}: ${what} is not a list`);
    return list.map((a) => {
      if (!a || !isId(a.id) || !isProb(a.prob)) fail(`token ${v.id}: one of its ${what} has no id or prob`);
      const token = str(a.token) ?? `#${a.id}`;
      return { id: a.id, token, piece: str(a.piece), prob: a.prob, logprob: logOf(a.prob) };
    });
  };
  const t = {
    id: v.id,
    token: str(v.token) ?? `#${v.id}`,
    piece: str(v.piece),
    text: v.text,
    prob: v.prob,
    logprob,
    top: alternatives(v.top, "alternatives"),
    removed: alternatives(v.removed, "removed tokens"),
  };
  const s = v.speculated;
  if (s && Array.isArray(s.drafted) && Number.isInteger(s.row) && typeof s.outcome === "string") {
    // Guesses as the JS API gives them ({id, piece}); older lines wrote the ids alone.
    const drafted = s.drafted.map((g) => (typeof g === "object" && g ? g : { id: g, piece: `#${g}` }));
    t.speculated = { pass: Number(s.pass) || 0, row: s.row, drafted, outcome: s.outcome };
  }
  return t;
}

function run(summary, tokens, fail) {
  const text = tokens.map((t) => t.text).join("");
  if (typeof summary.text === "string" && summary.text !== text)
    fail("the summary's text is not its tokens' text (lines missing or out of order)");
  const options = summary.options && typeof summary.options === "object" ? summary.options : {};
  return {
    prompt: str(summary.prompt) ?? "",
    model: str(summary.model) ?? "",
    options,
    tokens,
    text,
    seed: Number.isInteger(summary.seed) ? summary.seed : null,
    stopReason: str(summary.stop_reason ?? summary.stopReason) ?? "",
    tokensPerSecond: Number(summary.decode_tok_s ?? summary.decodeTokensPerSecond) || 0,
  };
}

function scoreRecord(v, fail) {
  const tokens = v.tokens.map((t, i) => {
    if (!t || !isProb(t.prob)) fail(`scored token ${i + 1} has no prob`);
    const logprob = typeof t.logprob === "number" && Number.isFinite(t.logprob) ? t.logprob : logOf(t.prob);
    return { token: str(t.token) ?? "", piece: str(t.piece) ?? str(t.token) ?? "", prob: t.prob, logprob };
  });
  return { text: str(v.text) ?? tokens.map((t) => t.piece).join(""), model: str(v.model) ?? "", ...totals(tokens) };
}

/** A scored text's totals from its tokens (the chain rule): what the score view shows. */
export function totals(tokens) {
  const logprob = tokens.reduce((s, t) => s + t.logprob, 0);
  const avgNll = tokens.length ? -logprob / tokens.length : 0;
  return { tokens, logprob, probability: Math.exp(logprob), avgNll, perplexity: Math.exp(avgNll) };
}

/** The run to play for `prompt` (its own when the recording has one; else the first). */
export function runFor(recording, prompt) {
  return recording.runs.find((r) => r.prompt === prompt) ?? recording.runs[0];
}

/** What a run is, in a few words: "stories260K-f32.gguf, greedy" or "…, temperature 0.8, seed 5". */
export function describeRun(r) {
  const o = r.options;
  const how = o.temperature === 0 ? "greedy" : o.temperature !== undefined ? `temperature ${o.temperature}` : "";
  const seed = r.seed !== null && how !== "greedy" ? `seed ${r.seed}` : "";
  return [r.model, how, seed].filter(Boolean).join(", ");
}
