// Types of <next-token> (next-token.js): importing the module defines the element.
import type { Summary, Token } from "./index.js";

export class NextTokenElement extends HTMLElement {
  /** The tokens of the last run. */
  tokens: Token[];
  /** Generate once (the page's elements on the same model take turns). */
  run(): Promise<void>;
  stop(): void;
}

declare global {
  interface HTMLElementTagNameMap {
    "next-token": NextTokenElement;
  }
  interface HTMLElementEventMap {
    "nexttoken-token": CustomEvent<Token>;
    "nexttoken-done": CustomEvent<Summary & { probability: number }>;
  }
}
