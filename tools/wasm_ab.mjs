// Decode speed of several one-thread wasm builds (wasm-bindgen `--target web` folders, e.g.
// www/pkg/ and a copy of it from another commit), loaded into one Node process and run in
// turn, so that a noisy host's drift falls on all of them alike:
//
//   node tools/wasm_ab.mjs MODEL.gguf STEPS ROUNDS PKG_DIR...
//
// Each round greedy-decodes STEPS tokens after the same short prompt with each build; prints
// each build's median tok/s and every round's. TOKENIZER_FILE (default the llama-spm
// tokenizer.json in ../shared/tokenizer-tests) only when the GGUF has no tokenizer of its own.
// PROMPT_REPEAT=N repeats the prompt N times, to decode at a long context (attention's share).
import { loadEngines } from "./wasm_engines.mjs";

const [model, stepsArg, roundsArg, ...pkgs] = process.argv.slice(2);
if (!model || !pkgs.length) {
  console.error("usage: node tools/wasm_ab.mjs MODEL.gguf STEPS ROUNDS PKG_DIR...");
  process.exit(2);
}
const steps = Number(stepsArg), rounds = Number(roundsArg);
const PROMPT = "Once upon a time there was a little girl who lived in a village near the forest. "
  .repeat(Number(process.env.PROMPT_REPEAT || 1)).trim();
const engines = await loadEngines(model, pkgs);
const results = pkgs.map(() => []);
for (let r = 0; r < rounds; r++) {
  engines.forEach((engine, k) => {
    const s = engine.start(PROMPT, { maxTokens: steps + 1, temperature: 0 });
    s.nextSync(); // the first token comes from the prefill
    const t0 = performance.now();
    let n = 0;
    while (n < steps && s.nextSync() !== null) n++;
    results[k].push((n * 1000) / (performance.now() - t0));
    s.free();
  });
}
pkgs.forEach((p, k) => {
  const sorted = results[k].slice().sort((a, b) => a - b);
  console.log(`${p}: median ${sorted[sorted.length >> 1].toFixed(1)} tok/s  [${results[k].map((x) => x.toFixed(1)).join(" ")}]`);
});
