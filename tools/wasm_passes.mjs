// The cost of a forward pass of n tokens in several one-thread wasm builds (wasm-bindgen `--target
// web` folders, e.g. www/pkg-relaxed/ and a copy of it from another commit), loaded into one Node
// process and run in turn: a pass of n tokens after a cached 16-token prefix (`engine.startIds`,
// the passes speculative decoding verifies with), and a prefill of n tokens from nothing for
// n >= 64. Prints each build's fastest of ROUNDS per size, and its first (the engine compiles a
// tile's optimised code during its first calls, which speculative decoding's first passes pay).
//
//   node --experimental-wasm-relaxed-simd tools/wasm_passes.mjs MODEL.gguf ROUNDS PKG_DIR...
//
// (Node 20 wants the flag for relaxed-simd builds; Node 22 and later run them without it.)
//
// SIZES (default 1,4,5,128) picks the sizes; TOKENIZER_FILE (default the llama-spm tokenizer.json
// in ../shared/tokenizer-tests) only when the GGUF has no tokenizer of its own.
import { loadEngines } from "./wasm_engines.mjs";
const [model, roundsArg, ...pkgs] = process.argv.slice(2);
if (!model || !pkgs.length) {
  console.error("usage: node --experimental-wasm-relaxed-simd tools/wasm_passes.mjs MODEL.gguf ROUNDS PKG_DIR...");
  process.exit(2);
}
const rounds = Number(roundsArg);
const engines = await loadEngines(model, pkgs);
const ids = (n, first) => Array.from({ length: n }, (_, i) => (i === 0 ? first : 100 + ((i * 37) % 900)));
const sizes = (process.env.SIZES || "1,4,5,128").split(",").map(Number);
const best = pkgs.map(() => Object.fromEntries(sizes.map((n) => [n, Infinity])));
const first = pkgs.map(() => ({}));
for (let r = 0; r < rounds; r++) {
  for (const n of sizes) {
    engines.forEach((e, k) => {
      let t;
      if (n >= 64) {
        e.startIds(ids(2, 7 + (r % 2)), { maxTokens: 1, temperature: 0 }).nextSync();
        const t0 = performance.now();
        e.startIds(ids(n, 1), { maxTokens: 1, temperature: 0 }).nextSync();
        t = performance.now() - t0;
      } else {
        e.startIds(ids(16, 1), { maxTokens: 1, temperature: 0 }).nextSync();
        const all = ids(16 + n, 1);
        const t0 = performance.now();
        e.startIds(all, { maxTokens: 1, temperature: 0 }).nextSync();
        t = performance.now() - t0;
      }
      best[k][n] = Math.min(best[k][n], t);
      first[k][n] ??= t;
    });
  }
}
pkgs.forEach((p, k) =>
  console.log(p, sizes.map((n) => `${n}: ${best[k][n].toFixed(1)} ms (first ${first[k][n].toFixed(1)})`).join("  ")),
);
