// The OpenAI API's shape over a NextToken instance, so code written for OpenAI's client (or for
// WebLLM, which copies it) runs on the model in the page:
//
//   const reply = await nt.chat.completions.create({ messages: [{ role: "user", content: "Hi" }] });
//   reply.choices[0].message.content;
//   for await (const chunk of await nt.chat.completions.create({ messages, stream: true })) {
//     chunk.choices[0]?.delta.content;
//   }
//
// Requests run one after another (a second waits for the first). Unknown fields are ignored, as
// OpenAI's clients expect; a known field with a bad value is a BadRequestError naming it
// (`error.param`). Aborting with `{ signal }` (second argument, as OpenAI's client takes it, or a
// `signal` field) stops generation within a token and rejects with an AbortError.

const FINISH = {
  Eos: "stop",
  StopString: "stop",
  MaxTokens: "length",
  ContextFull: "length",
  ConstraintComplete: "stop",
  Incomplete: "length",
};
const MAX_STOP = 4;
const MAX_TOP_LOGPROBS = 20;

class BadRequestError extends Error {
  constructor(param, message) {
    super(`${param}: ${message}`);
    this.name = "BadRequestError";
    this.status = 400;
    this.param = param;
  }
}

function abortError() {
  const e = new Error("the request was aborted");
  e.name = "AbortError";
  return e;
}

// ---------------------------------------------------------------------------------------------
// Requests: OpenAI's fields checked and turned into the engine's options

const isNumber = (v) => typeof v === "number" && Number.isFinite(v);

/** `params[name]` when given (null and undefined mean "default"), checked by `check`. */
function field(params, name, check) {
  const v = params[name];
  if (v === undefined || v === null) return undefined;
  const why = check(v);
  if (why) throw new BadRequestError(name, `${why} (got ${JSON.stringify(v)})`);
  return v;
}
const numberIn = (lo, hi) => (v) => (isNumber(v) && v >= lo && v <= hi ? null : `must be a number from ${lo} to ${hi}`);
const integerIn = (lo, hi) => (v) =>
  Number.isInteger(v) && v >= lo && v <= hi ? null : `must be an integer from ${lo} to ${hi}`;
const boolean = (v) => (typeof v === "boolean" ? null : "must be true or false");

/** The message content as text: a string, or OpenAI's array of `{type: "text", text}` parts. */
function contentText(content, where) {
  if (typeof content === "string") return content;
  if (Array.isArray(content)) {
    return content
      .map((part, j) => {
        if (part?.type !== "text" || typeof part.text !== "string")
          throw new BadRequestError(`${where}[${j}]`, 'only text parts ({type: "text", text}) are supported');
        return part.text;
      })
      .join("");
  }
  if (content === null || content === undefined) return "";
  throw new BadRequestError(where, "must be a string or an array of text parts");
}

function checkMessages(messages) {
  if (!Array.isArray(messages) || messages.length === 0)
    throw new BadRequestError("messages", "must be a non-empty array of {role, content}");
  return messages.map((m, i) => {
    if (typeof m !== "object" || m === null)
      throw new BadRequestError(`messages[${i}]`, "must be an object {role, content}");
    if (typeof m.role !== "string" || !m.role)
      throw new BadRequestError(`messages[${i}].role`, 'must be a string such as "user"');
    // OpenAI's "developer" role is its newer name for "system"; chat templates know "system".
    const role = m.role === "developer" ? "system" : m.role;
    const out = { role, content: contentText(m.content, `messages[${i}].content`) };
    if (m.tool_calls !== undefined && m.tool_calls !== null) out.tool_calls = checkToolCalls(m.tool_calls, i);
    if (role === "tool") {
      if (typeof m.tool_call_id !== "string")
        throw new BadRequestError(`messages[${i}].tool_call_id`, "a tool message names the call it answers");
      out.tool_call_id = m.tool_call_id;
      if (typeof m.name === "string") out.name = m.name;
    }
    return out;
  });
}

/** An assistant message's `tool_calls`, as OpenAI gives them back (arguments a string of JSON). */
function checkToolCalls(calls, i) {
  if (!Array.isArray(calls)) throw new BadRequestError(`messages[${i}].tool_calls`, "must be an array");
  return calls.map((c, j) => {
    const where = `messages[${i}].tool_calls[${j}]`;
    if (typeof c?.function?.name !== "string")
      throw new BadRequestError(where, 'must be {id, type: "function", function: {name, arguments}}');
    const args = c.function.arguments ?? "{}";
    if (typeof args !== "string" && (typeof args !== "object" || args === null))
      throw new BadRequestError(`${where}.function.arguments`, "must be a string of JSON");
    return { id: String(c.id ?? ""), type: "function", function: { name: c.function.name, arguments: args } };
  });
}

/**
 * The engine's tool options from OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`:
 * `{tools, toolChoice, parallelToolCalls}`, or `{}` when no tools are offered.
 */
function toolOptions(params) {
  const tools = field(params, "tools", (v) =>
    Array.isArray(v) && v.every((t) => t?.type === "function" && typeof t.function?.name === "string")
      ? null
      : 'must be an array of {type: "function", function: {name, description, parameters}}',
  );
  const choice = field(params, "tool_choice", (v) =>
    ["none", "auto", "required"].includes(v) || (v?.type === "function" && typeof v.function?.name === "string")
      ? null
      : 'must be "none", "auto", "required" or {type: "function", function: {name}}',
  );
  const parallel = field(params, "parallel_tool_calls", boolean);
  if (choice !== undefined && choice !== "none" && !tools?.length)
    throw new BadRequestError("tool_choice", "needs tools");
  if (!tools?.length || choice === "none") return {};
  return { tools, toolChoice: choice ?? "auto", parallelToolCalls: parallel ?? true };
}

/** Whether the request's tools force a call (`tool_choice` "required" or a named function). */
const forcesCall = (engine) => engine.tools && engine.toolChoice !== "auto";

/** The engine's generation options (`engine`) and how to answer, from an OpenAI request. */
function engineOptions(params, { contextLength, legacyLogprobs }) {
  if (typeof params !== "object" || params === null) throw new BadRequestError("body", "must be an object");
  field(params, "n", integerIn(1, 1));
  for (const name of ["frequency_penalty", "presence_penalty"]) {
    field(params, name, (v) => (v === 0 ? null : "is not supported (use repetition_penalty)"));
  }
  const maxTokens =
    field(params, "max_completion_tokens", integerIn(1, 1e9)) ?? field(params, "max_tokens", integerIn(1, 1e9));
  let stop = field(params, "stop", (v) =>
    typeof v === "string" || (Array.isArray(v) && v.length <= MAX_STOP && v.every((s) => typeof s === "string"))
      ? null
      : `must be a string or an array of at most ${MAX_STOP} strings`,
  );
  stop = (typeof stop === "string" ? [stop] : (stop ?? [])).filter((s) => s !== "");
  let alternatives = 0;
  if (legacyLogprobs) {
    alternatives = field(params, "logprobs", integerIn(0, 5)) ?? 0;
  } else if (field(params, "logprobs", boolean)) {
    alternatives = field(params, "top_logprobs", integerIn(0, MAX_TOP_LOGPROBS)) ?? 0;
  } else if (field(params, "top_logprobs", integerIn(0, MAX_TOP_LOGPROBS))) {
    throw new BadRequestError("top_logprobs", "needs logprobs: true");
  }
  const engine = {
    // Up to the context, as OpenAI's default is: generation stops when the context is full.
    // Without max_tokens: up to the context (a remote engine that does not say its context: its default).
    maxTokens: maxTokens ?? (contextLength || undefined),
    temperature: field(params, "temperature", numberIn(0, 2)),
    topP: field(params, "top_p", numberIn(0, 1)),
    topK: field(params, "top_k", integerIn(0, 1e9)),
    minP: field(params, "min_p", numberIn(0, 1)),
    repeatPenalty: field(params, "repetition_penalty", (v) =>
      isNumber(v) && v > 0 && v <= 10 ? null : "must be a number above 0 and at most 10",
    ),
    // Without a seed every request draws anew, as OpenAI's do.
    seed:
      field(params, "seed", (v) => (Number.isSafeInteger(v) && v >= 0 ? null : "must be a non-negative integer")) ??
      crypto.getRandomValues(new Uint32Array(1))[0],
    stop,
    topLogprobs: alternatives,
    dropOldest: field(params, "drop_oldest", boolean) ?? false,
    constraint: constraintOf(params),
    // An extension (as top_k and min_p are): speculative decoding by prompt lookup. The output
    // is unchanged; only the number of forward passes is.
    lookup: field(params, "prompt_lookup", boolean) ?? false,
    ...(legacyLogprobs ? {} : toolOptions(params)),
  };
  if (forcesCall(engine) && engine.constraint)
    throw new BadRequestError(
      "tool_choice",
      "a forced call is its own constraint: drop response_format, regex or grammar",
    );
  return {
    engine,
    wantLogprobs: legacyLogprobs ? params.logprobs !== undefined && params.logprobs !== null : !!params.logprobs,
    alternatives,
    stream: field(params, "stream", boolean) ?? false,
    // The request field a constraint came from, for the engine's errors about it.
    constraintParam: engine.constraint
      ? engine.constraint.type === "regex"
        ? "regex"
        : engine.constraint.type === "grammar"
          ? "grammar"
          : "response_format"
      : null,
    includeUsage: !!params.stream_options?.include_usage,
  };
}

/**
 * The engine's `constraint` (structured output) from OpenAI's `response_format`
 * (`{type: "json_schema", json_schema: {name, schema, strict}}` or `{type: "json_object"}`), or
 * from the extensions `regex` (a regular expression the whole output matches) and `grammar` (a
 * Lark grammar); at most one of them. Undefined for free text.
 */
function constraintOf(params) {
  const format = field(params, "response_format", (v) =>
    typeof v === "object" && ["text", "json_object", "json_schema"].includes(v.type)
      ? null
      : 'must be {type: "text" | "json_object" | "json_schema"}',
  );
  const regex = field(params, "regex", (v) =>
    typeof v === "string" && v !== "" ? null : "must be a non-empty string (a regular expression)",
  );
  const grammar = field(params, "grammar", (v) =>
    typeof v === "string" && v !== "" ? null : "must be a non-empty string (a Lark grammar)",
  );
  const given = [
    format && format.type !== "text" && "response_format",
    regex !== undefined && "regex",
    grammar !== undefined && "grammar",
  ].filter(Boolean);
  if (given.length > 1) throw new BadRequestError(given[1], `cannot be combined with ${given[0]}: give one constraint`);
  if (format?.type === "json_schema") {
    const schema = format.json_schema?.schema;
    if (typeof schema !== "object" || schema === null || Array.isArray(schema)) {
      throw new BadRequestError("response_format.json_schema.schema", "must be a JSON Schema object");
    }
    return { type: "json_schema", schema };
  }
  if (format?.type === "json_object") return { type: "json_object" };
  if (regex !== undefined) return { type: "regex", pattern: regex };
  if (grammar !== undefined) return { type: "grammar", lark: grammar };
  return undefined;
}

// ---------------------------------------------------------------------------------------------
// Responses

const CALL_OPENING = "<tool_call>";

/**
 * How much of a reply's `text` so far can stream as content when tools are offered: all of it
 * but what may be the start of a call in the model's `format` ("hermes": from a `<tool_call>`,
 * or a tail that could begin one; "llama_json": a reply that starts as JSON or with
 * `<|python_tag|>` is held whole; "server": a remote engine's, all of it); nothing when a call
 * is forced.
 */
export function releasable(text, format, forced) {
  if (forced) return 0;
  // A remote engine's server reads the calls out itself: its content is never a call.
  if (format === "server") return text.length;
  if (format === "llama_json") {
    const lead = text.trimStart();
    // Empty so far, JSON, or (the start of) <|python_tag|>: perhaps a call.
    if (!lead || lead.startsWith("{") || "<|python_tag|>".startsWith(lead.slice(0, 14))) return 0;
    return text.length;
  }
  const at = text.indexOf(CALL_OPENING);
  if (at >= 0) return at;
  for (let k = Math.min(CALL_OPENING.length - 1, text.length); k > 0; k--)
    if (CALL_OPENING.startsWith(text.slice(-k))) return text.length - k;
  return text.length;
}

const utf8 = new TextEncoder();
const bytes = (s) => Array.from(utf8.encode(s));

/** One token's entry of `logprobs.content`. */
function chatLogprob(t, alternatives) {
  return {
    token: t.piece,
    logprob: t.logprob,
    bytes: bytes(t.piece),
    top_logprobs: t.top
      .slice(0, alternatives)
      .map((a) => ({ token: a.piece, logprob: a.logprob, bytes: bytes(a.piece) })),
  };
}

function usageOf(summary) {
  return {
    prompt_tokens: summary.promptTokens,
    completion_tokens: summary.generatedTokens,
    total_tokens: summary.promptTokens + summary.generatedTokens,
    // OpenAI's name for prompt tokens served from a cache: the KV cache kept from the last turn.
    prompt_tokens_details: { cached_tokens: summary.reusedTokens },
  };
}

const randomId = (prefix) =>
  `${prefix}-${Array.from(crypto.getRandomValues(new Uint8Array(12)), (b) => b.toString(16).padStart(2, "0")).join("")}`;

// ---------------------------------------------------------------------------------------------

/**
 * `{chat: {completions: {create}}, completions: {create}}` over `nt` (a NextToken with a model
 * loaded). Extensions beyond OpenAI's fields: `top_k`, `min_p`, `repetition_penalty`,
 * `drop_oldest` (chat: drop the oldest turns when the conversation outgrows the context), `regex`
 * and `grammar` (structured output, like `response_format`).
 */
export function openAI(nt) {
  // Requests run in turn: each waits for the one before it to finish (a stream: until it has
  // been read to its end, or its loop left early).
  let queue = Promise.resolve();
  /** Resolves, when it is this request's turn, to the function that ends the turn. */
  const takeTurn = () => {
    let release;
    const mine = new Promise((r) => (release = r));
    const ready = queue.then(() => release);
    queue = queue.then(() => mine);
    return ready;
  };

  /** The request's tokens from `iterator`; aborting `signal` stops them with an AbortError. */
  async function* tokens(iterator, signal, constraintParam) {
    let aborted = false;
    const onAbort = () => {
      aborted = true;
      iterator.return();
    };
    signal?.addEventListener("abort", onAbort, { once: true });
    try {
      for await (const t of iterator) {
        if (aborted) break;
        yield t;
      }
      if (aborted || signal?.aborted) throw abortError();
    } catch (e) {
      // The engine checks a schema, regex or grammar when generation starts ("constraint: invalid
      // JSON schema: ..."): a bad request, named by the field it came from. So are the tools
      // (a bad name, a template that takes none, a forced name not among them).
      const message = e?.message ?? "";
      const where = /^constraint: invalid (JSON schema|regex|grammar)/.exec(message);
      if (where && constraintParam) throw new BadRequestError(constraintParam, message.slice("constraint: ".length));
      if (/takes no tools|^(constraint: )?tools: /.test(message)) throw new BadRequestError("tools", message);
      if (/^(constraint: )?tool_choice/.test(message)) throw new BadRequestError("tool_choice", message);
      throw e;
    } finally {
      signal?.removeEventListener("abort", onAbort);
    }
  }

  /**
   * The flow both endpoints share: check the request, wait for its turn, stream the tokens;
   * `shape` makes OpenAI's objects from them (`chunk`, `finalChunks`, `whole`).
   */
  async function create(params, requestOptions, { legacyLogprobs, start, shape }) {
    const signal = requestOptions?.signal ?? params?.signal;
    if (!nt.info) throw new BadRequestError("model", "no model is loaded: call load() first");
    const opts = engineOptions(params, { contextLength: nt.info.nCtx, legacyLogprobs });
    const meta = {
      id: randomId(legacyLogprobs ? "cmpl" : "chatcmpl"),
      created: Math.floor(Date.now() / 1000),
      model: nt.info.spec?.id || nt.info.spec?.url || nt.info.arch,
    };
    const { engine, stream } = opts;
    const endTurn = await takeTurn();
    if (signal?.aborted) {
      endTurn();
      throw abortError();
    }
    if (!stream) {
      try {
        const got = [];
        for await (const t of tokens(start(engine), signal, opts.constraintParam)) got.push(t);
        return shape.whole(meta, got, nt.lastSummary, opts);
      } finally {
        endTurn();
      }
    }
    return {
      async *[Symbol.asyncIterator]() {
        try {
          for await (const t of tokens(start(engine), signal, opts.constraintParam)) yield shape.chunk(meta, t, opts);
          yield* shape.finalChunks(meta, nt.lastSummary, opts);
        } finally {
          endTurn();
        }
      },
    };
  }

  /** The reply's calls in OpenAI's shape (arguments a string of JSON), [] when it made none. */
  const toolCallsOf = (summary) =>
    (summary.reply?.toolCalls ?? []).map((c) => ({
      id: randomId("call"),
      type: "function",
      function: { name: c.function.name, arguments: JSON.stringify(c.function.arguments) },
    }));
  const finishOf = (summary, calls) => {
    const finish = FINISH[summary.stopReason] ?? "stop";
    return calls.length && finish === "stop" ? "tool_calls" : finish;
  };
  const chunkOf = (meta, delta, extra = {}) => ({
    ...meta,
    object: "chat.completion.chunk",
    choices: [{ index: 0, delta, logprobs: null, finish_reason: null, ...extra }],
  });

  const chatShape = {
    // With tools the text streams as content only where it cannot be the start of a call (the
    // model's format: `<tool_call>` blocks, or Llama 3's bare JSON); what was held back comes at
    // the end, as `delta.tool_calls` when it was calls, as content when it was not.
    chunk(meta, t, opts) {
      let content = t.text;
      if (opts.engine.tools) {
        const held = (opts.held ??= { text: "", sent: 0 });
        held.text += t.text;
        const upTo = releasable(held.text, nt.info.toolFormat, forcesCall(opts.engine));
        content = held.text.slice(held.sent, Math.max(upTo, held.sent));
        held.sent = Math.max(upTo, held.sent);
      }
      return chunkOf(
        meta,
        { role: "assistant", content },
        { logprobs: opts.wantLogprobs ? { content: [chatLogprob(t, opts.alternatives)], refusal: null } : null },
      );
    },
    *finalChunks(meta, summary, opts) {
      const calls = toolCallsOf(summary);
      const held = opts.held;
      if (held) {
        // The rest of the content: what was held back, less the calls.
        const rest = calls.length
          ? (summary.reply?.content ?? "").slice(held.text.slice(0, held.sent).trim().length)
          : held.text.slice(held.sent);
        if (rest) yield chunkOf(meta, { content: rest });
        if (calls.length) yield chunkOf(meta, { tool_calls: calls.map((c, index) => ({ index, ...c })) });
      }
      yield chunkOf(meta, {}, { finish_reason: finishOf(summary, calls) });
      if (opts.includeUsage) yield { ...meta, object: "chat.completion.chunk", choices: [], usage: usageOf(summary) };
    },
    whole(meta, got, summary, opts) {
      const calls = toolCallsOf(summary);
      const message = calls.length
        ? { role: "assistant", content: summary.reply.content || null, tool_calls: calls, refusal: null }
        : { role: "assistant", content: summary.text, refusal: null };
      return {
        ...meta,
        object: "chat.completion",
        choices: [
          {
            index: 0,
            message,
            logprobs: opts.wantLogprobs
              ? { content: got.map((t) => chatLogprob(t, opts.alternatives)), refusal: null }
              : null,
            finish_reason: finishOf(summary, calls),
          },
        ],
        usage: usageOf(summary),
      };
    },
  };

  /** The legacy completions endpoint's logprobs: parallel arrays. */
  function legacyLogprobs(got, alternatives, textOffset = 0) {
    let offset = textOffset;
    const out = { tokens: [], token_logprobs: [], top_logprobs: [], text_offset: [] };
    for (const t of got) {
      out.tokens.push(t.piece);
      out.token_logprobs.push(t.logprob);
      out.top_logprobs.push(Object.fromEntries(t.top.slice(0, alternatives).map((a) => [a.piece, a.logprob])));
      out.text_offset.push(offset);
      offset += t.text.length;
    }
    return out;
  }

  const completionShape = {
    chunk(meta, t, opts) {
      return {
        ...meta,
        object: "text_completion",
        choices: [
          {
            index: 0,
            text: t.text,
            logprobs: opts.wantLogprobs ? legacyLogprobs([t], opts.alternatives) : null,
            finish_reason: null,
          },
        ],
      };
    },
    *finalChunks(meta, summary, opts) {
      yield {
        ...meta,
        object: "text_completion",
        choices: [{ index: 0, text: "", logprobs: null, finish_reason: FINISH[summary.stopReason] ?? "stop" }],
      };
      if (opts.includeUsage) yield { ...meta, object: "text_completion", choices: [], usage: usageOf(summary) };
    },
    whole(meta, got, summary, opts) {
      return {
        ...meta,
        object: "text_completion",
        choices: [
          {
            index: 0,
            text: summary.text,
            logprobs: opts.wantLogprobs ? legacyLogprobs(got, opts.alternatives) : null,
            finish_reason: FINISH[summary.stopReason] ?? "stop",
          },
        ],
        usage: usageOf(summary),
      };
    },
  };

  return {
    chat: {
      completions: {
        /** OpenAI's chat.completions.create: `{messages, stream, max_tokens, temperature, ...}`. */
        async create(params, requestOptions) {
          const messages = checkMessages(params?.messages);
          return create(params, requestOptions, {
            legacyLogprobs: false,
            start: (o) => nt.reply(messages, o),
            shape: chatShape,
          });
        },
      },
    },
    completions: {
      /** OpenAI's completions.create for a raw prompt: `{prompt, stream, max_tokens, ...}`. */
      async create(params, requestOptions) {
        if (typeof params?.prompt !== "string") throw new BadRequestError("prompt", "must be a string");
        return create(params, requestOptions, {
          legacyLogprobs: true,
          start: (o) => nt.generate(params.prompt, o),
          shape: completionShape,
        });
      },
    },
  };
}
