// Types of <next-token> (next-token.js): importing the module defines the element.
import type { Alternative, ModelInfo, Summary, Token } from "./index.js";

export class NextTokenElement extends HTMLElement {
  /** The tokens of the last run (or branch). */
  tokens: Token[];
  /** The `view` attribute: generate (default), explore, beam or score. */
  readonly view: "generate" | "explore" | "beam" | "score";
  /** Run the element's view once (the page's elements on the same model take turns). */
  run(): Promise<void>;
  stop(): void;
}

/** nt-done's detail: the summary of a generation, or the score view's scores; `recording` when
 * a recording (the `replay` attribute) played instead of the model. */
export type NextTokenDone =
  | (Summary & {
      probability: number;
      view: "generate" | "explore" | "beam";
      branch?: { at: number; token: Alternative };
    })
  | {
      recording: true;
      text: string;
      generatedTokens: number;
      model: string;
      probability: number;
      view: "generate" | "explore" | "beam";
    }
  | {
      view: "score";
      prompt: string;
      scores: { text: string; logprob: number; perplexity: number; avgNll: number }[];
      recording?: true;
    };

/** nt-load's detail when the element plays a recording: the recorded model's file name, and
 * why the live model does not run ("" when the element has no `model`). */
export interface RecordingLoad {
  kind: "recording";
  name: string;
  reason: string;
}

declare global {
  interface HTMLElementTagNameMap {
    "next-token": NextTokenElement;
  }
  interface HTMLElementEventMap {
    "nt-load": CustomEvent<ModelInfo | RecordingLoad>;
    "nt-token": CustomEvent<Token>;
    "nt-done": CustomEvent<NextTokenDone>;
    "nt-error": CustomEvent<{ message: string }>;
    "nexttoken-token": CustomEvent<Token>;
    "nexttoken-done": CustomEvent<Summary & { probability: number }>;
  }
}
