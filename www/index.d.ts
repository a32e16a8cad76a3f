// Types of nexttoken's JavaScript API (nexttoken.js, openai.js). The model runs in a Web Worker.

/** A model: a catalog id ("default", "lesson-toy", ...), a URL (".json" = table model, else a
 * GGUF; relative to the page), a Hugging Face reference ("hf:owner/repo/file.gguf") or a spec. */
export type ModelRef = string | ModelSpec | RemoteSpec;

/**
 * A model on a server (remote.js): llama.cpp's server, llama-cpp-python, vLLM or any
 * OpenAI-compatible endpoint, for a model too big for this device. As a string:
 * "openai+https://host/v1#model" (without "#model": the server's first model).
 */
export interface RemoteSpec {
  kind: "remote";
  /** The API's base URL, e.g. "https://host/v1". */
  url: string;
  /** The model's id as the server's /models lists it. */
  model?: string;
  /** Sent as a bearer token (or give `apiKey` to NextToken). */
  apiKey?: string;
  id?: string;
  name?: string;
}

export interface ModelSpec {
  url: string;
  kind?: "gguf" | "table";
  /** A tokenizer.json URL; without it, the tokenizer the GGUF's metadata describes. */
  tokenizer?: string;
  /** The host's published sha256 (a list, one per part, for a split model). */
  sha256?: string | string[];
  size?: number;
  id?: string;
  name?: string;
  prompt?: string;
  note?: string;
}

export interface Progress {
  file: "model" | "tokenizer";
  loaded: number;
  total: number;
  fromCache?: boolean;
  /** Bytes an earlier, interrupted download had stored (not downloaded again). */
  resumed?: number;
  /** A model split by gguf-split: this part of `parts`; `doneBytes` the parts before. */
  part?: number;
  parts?: number;
  doneBytes?: number;
}

export interface LoadOptions {
  onProgress?: (p: Progress) => void;
  onWarning?: (message: string) => void;
  backend?: "auto" | "gpu" | "cpu";
  maxSeq?: number;
  /** CPU path: the exact reference kernels instead of the fast int8 ones. */
  exact?: boolean;
  threads?: number;
  tokenizer?: string;
  signal?: AbortSignal;
  /** Tests: "auto" treats a software adapter (SwiftShader) as a real GPU and measures it. */
  allowSoftwareGpu?: boolean;
  /**
   * Speculative decoding with a draft model: a smaller GGUF with this model's tokenizer (a
   * catalog id or URL), loaded on the CPU path beside it. Sampling runs then verify its guesses
   * several per forward pass (the output is the model's); `draft: false` in a run turns it off.
   */
  draft?: string | ModelSpec;
}

export interface ModelInfo {
  kind: "table" | "gguf" | "remote";
  backend: "table" | "cpu" | "webgpu" | "remote";
  backendDetail: string;
  /**
   * Why `backend: "auto"` runs this backend, when it measured (or remembered a measurement for
   * this model and adapter): the GPU's check against the CPU path, and both decode speeds.
   */
  backendReason?: string;
  name: string;
  description: string;
  arch: string;
  nVocab: number;
  nCtx: number;
  nLayer: number;
  nEmbd: number;
  parameters: number;
  bytes: number;
  weightBytesPerToken: number;
  words: string[];
  chatTemplate?: string | null;
  /** How the model writes tool calls, when its chat template takes tools ("server": a remote
   * engine's server reads them out of the reply). */
  toolFormat?: "hermes" | "llama_json" | "server" | null;
  /** Bytes of the model file held in wasm memory: the file on the CPU path, 0 on WebGPU. */
  weightsInWasmBytes: number;
  /** "streamed": WebGPU, from the download straight into GPU buffers; "wasm": through wasm memory. */
  loadPath: "streamed" | "wasm" | "";
  /** The worker's wasm memory after the load (it only grows). */
  wasmMemoryBytes: number;
  version: string;
  threads: number;
  /** Why the wasm CPU path runs one thread ("" when it runs the threads build). */
  threadsNote: string;
  /** Which worker runs the model: "shared" (one engine for every tab of the site, a
   * SharedWorker) or "dedicated" (this page's own); `engineNote` says why. "remote": a server. */
  engine: "shared" | "dedicated" | "remote";
  /** A remote engine's server and model, and what it cannot do that a local engine does. */
  remote?: { url: string; model: string; unavailable: string[] };
  engineNote: string;
  /** Pages the engine served at this load (1 for a dedicated one). */
  enginePages: number;
  /** Loads (pages, elements, instances) sharing this model's one copy at this load. */
  modelUsers: number;
  spec: ModelSpec;
  /** `reused`: the engine held this model already (another tab, element or instance loaded it):
   * nothing was downloaded, and `waitMs` is all this load took. */
  timings: {
    downloadMs?: number;
    initMs?: number;
    backendMs?: number;
    fromCache?: boolean;
    reused?: boolean;
    waitMs?: number;
  };
  [more: string]: unknown;
}

export interface GenerateOptions {
  maxTokens?: number;
  temperature?: number;
  topK?: number;
  topP?: number;
  minP?: number;
  repeatPenalty?: number;
  repeatWindow?: number;
  /** Fixes the draws: the same seed and options give the same text. Without one each run draws a fresh seed (the summary's `seed`). */
  seed?: number;
  stop?: string[];
  /** Alternatives per token (default 5, at most 20). */
  topLogprobs?: number;
  beams?: number;
  lengthNormalise?: boolean;
  /** chat(): drop the oldest turns when the context is full instead of failing. */
  dropOldest?: boolean;
  /** Token ids emitted first whatever the sampler would pick (a branch's chosen token). */
  forceTokens?: number[];
  /** Each token event carries the step's this-many most likely tokens with their logits (at most 64), for samplerView. */
  keepCandidates?: number;
  /** Structured output: only tokens that keep the output valid are sampled (see `Constraint`). */
  constraint?: Constraint;
  /** Speculative decoding by prompt lookup: the same tokens in fewer forward passes (tokens carry `speculated`). */
  lookup?: boolean;
  /** Speculative decoding: the most guesses one pass verifies (default 4, at most 16). */
  draftMax?: number;
  /** With a draft model loaded: guess with it (default true). `lookup` takes precedence. */
  draft?: boolean;
}

/**
 * Structured output: the whole output is one JSON value valid against `schema`, any JSON object,
 * a match of `pattern` (Rust regex syntax, anchored at both ends) or a sentence of a Lark grammar
 * (llguidance's dialect, starting at `start`). Tokens then carry `removed`, and
 * `lastSummary.stopReason` is "ConstraintComplete" or, when the tokens or the context ran out
 * first, "Incomplete".
 */
export type Constraint =
  | { type: "json_schema"; schema: object | boolean }
  | { type: "json_object" }
  | { type: "regex"; pattern: string }
  | { type: "grammar"; lark: string };

/** A step's most likely tokens with their raw logits, best first (under a constraint: of the tokens it allowed). */
export interface Candidates {
  ids: number[];
  logits: number[];
  /** The first 20 candidates alone as text. */
  pieces: string[];
  /** The log-sum-exp of the step's whole row of logits: a candidate's probability as the model gives it (a token's `prob`) is `Math.exp(logit - logsumexp)`. */
  logsumexp: number;
}

/** A beam search's tree: every extension it considered, with the total log P of the hypothesis. */
export interface BeamTree {
  nodes: {
    parent: number | null;
    step: number;
    id: number;
    piece: string;
    logprob: number;
    kept: boolean;
    finished: boolean;
  }[];
  /** The best beam's last node. */
  best: number | null;
}

export interface Alternative {
  /** null on a remote engine (servers send token text). */
  id: number | null;
  token: string;
  piece: string;
  /** null on a remote engine whose server sends no logprobs (and for the first token of a remote score). */
  prob: number | null;
  logprob: number | null;
}

/** One generated token ("token" events of the element carry the same). */
export interface Token extends Alternative {
  text: string;
  top: Alternative[];
  position: number;
  /** With `keepCandidates`. */
  candidates?: Candidates;
  /** Over the generated tokens so far. */
  logprobSum: number;
  perplexity: number;
  /** Under a constraint: the model's most likely tokens it removed at this step (absent when none). */
  removed?: { id: number; token: string; piece?: string; prob: number; logprob: number }[];
  /** Made by a verification pass of speculative decoding: its number, this token's row, its guesses, and whether the guess at this row was kept. */
  speculated?: {
    pass: number;
    row: number;
    drafted: { id: number; piece: string }[];
    outcome: "accepted" | "rejected" | "bonus";
  };
}

export interface Summary {
  /** null on a remote engine whose server does not report usage while streaming. */
  promptTokens: number | null;
  reusedTokens: number;
  generatedTokens: number;
  text: string;
  stopReason: "Eos" | "MaxTokens" | "StopString" | "ContextFull" | "Aborted" | "ConstraintComplete" | "Incomplete";
  prefillMs: number;
  decodeMs: number;
  ttftMs: number;
  prefillTokS: number;
  decodeTokS: number;
  backend: "table" | "cpu" | "webgpu" | "remote";
  /** Under a constraint: ms compiling it, then ms over its steps. */
  constraint?: { buildMs: number; stepsMs: number; steps: number };
  /** The seed the sampler drew with (given, or drawn for this run): pass it as `seed` to reproduce the run. Absent for beam search. */
  seed?: number;
  /** What speculative decoding did, when it was on. */
  speculation?: {
    drafter: "prompt lookup" | "draft model";
    passes: number;
    drafted: number;
    accepted: number;
    acceptance: number;
    tokensPerPass: number;
  };
  wallMs: number;
  promptIds: number[];
  messages?: ChatMessage[];
  /** A beam search's tree. */
  beamTree?: BeamTree;
  /** A chat with `tools`: the reply read for calls (`arguments` the JSON object). */
  reply?: { content: string; toolCalls: ToolCall[] };
}

/** A tool the model may call (OpenAI's shape). */
export interface Tool {
  type: "function";
  function: { name: string; description?: string; parameters?: object; strict?: boolean };
}
/** A call the model made; in the OpenAI API's answers `arguments` is a string of JSON. */
export interface ToolCall {
  id: string;
  type: "function";
  function: { name: string; arguments: object | string };
}
export type ToolChoice = "auto" | "none" | "required" | { type: "function"; function: { name: string } };
/** `reply`'s options beyond the generation options. */
export interface ChatOptions extends GenerateOptions {
  tools?: Tool[];
  /** "auto", "none", "required" or a tool's name (or OpenAI's object). */
  toolChoice?: ToolChoice | string;
  parallelToolCalls?: boolean;
}

export interface Score {
  /** `piece`: the text the token adds to the scored text (the pieces, joined, are the text; "" for a byte that completes a character only with a later token). */
  tokens: { id: number; token: string; piece: string; prob: number; logprob: number }[];
  logprob: number;
  probability: number;
  avgNll: number;
  perplexity: number;
  backend: "table" | "cpu" | "webgpu" | "remote";
}

export interface ChatMessage {
  role: "system" | "user" | "assistant" | "tool";
  content: string | null;
  /** An assistant's calls. */
  tool_calls?: ToolCall[];
  /** A tool's answer: the call it answers. */
  tool_call_id?: string;
  name?: string;
}

// OpenAI's shapes (openai.js): the fields it reads and the objects it returns.

export interface CompletionParams {
  max_tokens?: number;
  max_completion_tokens?: number;
  temperature?: number;
  top_p?: number;
  top_k?: number;
  min_p?: number;
  repetition_penalty?: number;
  seed?: number;
  stop?: string | string[];
  stream?: boolean;
  stream_options?: { include_usage?: boolean };
  n?: 1;
  /** Structured output as OpenAI takes it; or the extensions `regex` and `grammar` (one of the three). */
  response_format?:
    | { type: "text" }
    | { type: "json_object" }
    | { type: "json_schema"; json_schema: { name?: string; schema: object; strict?: boolean } };
  /** Extension: the whole output matches this regular expression (Rust regex syntax). */
  regex?: string;
  /** Extension: the output is a sentence of this Lark grammar (llguidance's dialect). */
  grammar?: string;
  signal?: AbortSignal;
}
export interface ChatCompletionParams extends CompletionParams {
  messages: {
    role: string;
    content: string | { type: "text"; text: string }[] | null;
    tool_calls?: ToolCall[];
    tool_call_id?: string;
    name?: string;
  }[];
  logprobs?: boolean;
  top_logprobs?: number;
  drop_oldest?: boolean;
  /** For a model whose chat template takes tools (`ModelInfo.toolFormat`). */
  tools?: Tool[];
  tool_choice?: ToolChoice;
  parallel_tool_calls?: boolean;
}
export interface LegacyCompletionParams extends CompletionParams {
  prompt: string;
  logprobs?: number;
}
export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
  prompt_tokens_details: { cached_tokens: number };
}
export type FinishReason = "stop" | "length" | "tool_calls";
export interface TokenLogprob {
  token: string;
  logprob: number;
  bytes: number[];
  top_logprobs: { token: string; logprob: number; bytes: number[] }[];
}
interface Meta {
  id: string;
  created: number;
  model: string;
}
export interface ChatCompletion extends Meta {
  object: "chat.completion";
  choices: {
    index: 0;
    message: { role: "assistant"; content: string | null; tool_calls?: ToolCall[]; refusal: null };
    logprobs: { content: TokenLogprob[]; refusal: null } | null;
    finish_reason: FinishReason;
  }[];
  usage: Usage;
}
export interface ChatCompletionChunk extends Meta {
  object: "chat.completion.chunk";
  choices: {
    index: 0;
    delta: {
      role?: "assistant";
      content?: string;
      tool_calls?: (ToolCall & { index: number; function: { name: string; arguments: string } })[];
    };
    logprobs: { content: TokenLogprob[]; refusal: null } | null;
    finish_reason: FinishReason | null;
  }[];
  usage?: Usage;
}
export interface LegacyLogprobs {
  tokens: string[];
  token_logprobs: number[];
  top_logprobs: Record<string, number>[];
  text_offset: number[];
}
export interface Completion extends Meta {
  object: "text_completion";
  choices: { index: 0; text: string; logprobs: LegacyLogprobs | null; finish_reason: FinishReason | null }[];
  usage?: Usage;
}
export interface RequestOptions {
  signal?: AbortSignal;
}
export interface Chat {
  completions: {
    create(
      params: ChatCompletionParams & { stream: true },
      options?: RequestOptions,
    ): Promise<AsyncIterable<ChatCompletionChunk>>;
    create(params: ChatCompletionParams & { stream?: false }, options?: RequestOptions): Promise<ChatCompletion>;
  };
}
export interface Completions {
  create(
    params: LegacyCompletionParams & { stream: true },
    options?: RequestOptions,
  ): Promise<AsyncIterable<Completion>>;
  create(params: LegacyCompletionParams & { stream?: false }, options?: RequestOptions): Promise<Completion>;
}

export interface NextTokenOptions {
  /** The worker script (default: worker.js beside nexttoken.js; from another origin it starts
   * through a blob: trampoline, so its host needs CORS). */
  workerUrl?: string | URL;
  /** Use the page's one shared worker (one wasm instance); each instance loads its own model
   * there (the same model loaded twice is held once). */
  shareWorker?: boolean;
  /** "auto" (default): one engine for every tab of the site (a SharedWorker) where the browser
   * has one and this page would run one thread anyway; else the page's own worker (the threads
   * build). "shared" and "dedicated" force one. */
  engine?: "auto" | "shared" | "dedicated";
  /** A remote engine ("openai+https://host/v1#model") that `preflight` offers where it refuses a
   * model as too big for this device (`Preflight.remote`). */
  remote?: string | RemoteSpec;
  /** Sent to remote engines as a bearer token. */
  apiKey?: string;
}

/** Which worker `engine` ("auto" by default) gets on this page, and why. */
export function engineChoice(
  requested?: "auto" | "shared" | "dedicated",
  workerUrl?: string | URL,
): { kind: "shared" | "dedicated"; note: string; oneThread?: string };

export class NextToken {
  constructor(options?: NextTokenOptions);
  readonly info: ModelInfo | null;
  readonly lastSummary: Summary | null;
  /** Called with the new info when a lost GPU's model moves to the CPU path mid-generation. */
  onBackendChange: ((info: ModelInfo) => void) | null;
  readonly chat: Chat;
  readonly completions: Completions;
  load(model: ModelRef, options?: LoadOptions): Promise<ModelInfo>;
  /** `prompt`: text, or `{ids}`: token ids as they are (no BOS added). */
  generate(prompt: string | { ids: ArrayLike<number> }, options?: GenerateOptions): AsyncIterableIterator<Token>;
  reply(messages: ChatMessage[], options?: ChatOptions): AsyncIterableIterator<Token>;
  renderChat(messages: ChatMessage[], options?: { addGenerationPrompt?: boolean }): Promise<string>;
  /** With `after`: `text` scored as the continuation of that prefix, P(text | after); the two are
   * joined exactly (`text` starts with its own space, as generated text does). */
  score(text: string, options?: { after?: string }): Promise<Score>;
  /** What loading `model` would cost, known before a byte of its weights (its size and header). */
  preflight(model: ModelRef, options?: LoadOptions): Promise<Preflight>;
  /** What the sampler keeps from a step's candidates with these settings, with the probabilities it draws with. */
  samplerView(
    candidates: Candidates,
    options: GenerateOptions,
    history?: ArrayLike<number>,
  ): Promise<{ id: number; prob: number }[]>;
  abort(): void;
  terminate(): void;
}

/** The running log P and perplexity of a sequence of tokens (what `generate`'s tokens carry). */
export class RunningLogP {
  /** Continue a sequence whose tokens so far sum to `sum` over `count` tokens. */
  constructor(sum?: number, count?: number);
  readonly sum: number;
  readonly count: number;
  /** `token` with `logprobSum` and `perplexity` over it and every token before. */
  add<T extends { logprob: number }>(token: T): T & { logprobSum: number; perplexity: number };
}

export interface CatalogEntry extends ModelSpec {
  id: string;
  name: string;
  kind: "gguf" | "table";
  /** Served with the site (no download): the page loads it as soon as it is picked. */
  shipped?: boolean;
  /** What the model is and is not, for the picker. */
  note?: string;
  /** A prompt to start from. */
  prompt?: string;
}
export const CATALOG: CatalogEntry[];
export function resolveModelUrl(ref: string): string;
export function resolveSpec(model: ModelRef, tokenizer?: string): ModelSpec & { kind: "gguf" | "table" };
export function requestPersistentStorage(): Promise<boolean | null>;

// One shared instance.
export function load(model: ModelRef, options?: LoadOptions): Promise<ModelInfo>;
export function generate(
  prompt: string | { ids: ArrayLike<number> },
  options?: GenerateOptions,
): AsyncIterableIterator<Token>;
export function reply(messages: ChatMessage[], options?: ChatOptions): AsyncIterableIterator<Token>;
export function score(text: string, options?: { after?: string }): Promise<Score>;
export function abort(): void;
export const chat: Chat;
export const completions: Completions;

/** `NextToken.preflight`'s answer. */
export interface Preflight {
  /** Where the model runs on a remote engine instead: a remote model itself, or the instance's
   * `remote` offered beside a refusal (load it with `load(preflight.remote)`). */
  remote?: string;
  url: string;
  name: string;
  kind: "gguf" | "table";
  sizeBytes: number;
  /** 0 when the file is stored whole in this browser already. */
  downloadBytes: number;
  cached: boolean;
  /** From the GGUF header (absent for tables, split models and refusals by size). */
  plan?: {
    arch: string;
    parameters: number;
    fileBytes: number;
    weightType: string;
    weightBytesPerToken: number;
    layers: number;
    embedding: number;
    feedForward: number;
    vocab: number;
    contextLength: number;
    kvBytesPerPosition: number;
  };
  /** Bytes of the header read to make the plan. */
  headerBytes?: number;
  /** The memory a CPU-path load needs: the file, its KV cache at `maxSeq`, the engine. */
  memoryBytes?: number;
  memoryLimitBytes?: number | null;
  /** `navigator.deviceMemory` in bytes, where the browser tells it. */
  deviceMemoryBytes?: number | null;
  storageAvailableBytes?: number | null;
  /** The CPU path's expected decode speed here, from a short calibration on random models. */
  cpu?: { tokensPerSecond: number; shapeMs: number; bytesPerSecond: number };
  /** The GPU's, where a load would run the model on WebGPU (a real adapter, or backend "gpu"). */
  gpu?: { tokensPerSecond: number; shapeMs: number; bytesPerSecond: number; adapter: string };
  /** Why the model cannot run here; "" when it can. */
  refusal: string;
  warnings: string[];
}
