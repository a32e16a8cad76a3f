// One engine per wasm build folder (wasm-bindgen `--target web` output), all on the same GGUF, in
// this Node process: what tools/wasm_ab.mjs and tools/wasm_passes.mjs compare. TOKENIZER_FILE
// (default the llama-spm tokenizer.json in ../shared/tokenizer-tests) only when the GGUF has no
// tokenizer of its own.
import fs from "node:fs";
import path from "node:path";

export async function loadEngines(model, pkgs) {
  const bytes = fs.readFileSync(model);
  const tok = fs.readFileSync(process.env.TOKENIZER_FILE || "../shared/tokenizer-tests/llama-spm/tokenizer.json");
  const engines = [];
  for (const pkg of pkgs) {
    const dir = path.resolve(pkg);
    // The query string makes each folder's glue a module of its own.
    const m = await import(`${dir}/nexttoken.js?${dir}`);
    m.initSync({ module: fs.readFileSync(`${dir}/nexttoken_bg.wasm`) });
    const sink = new m.ByteSink(bytes.length);
    sink.push(new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.length));
    engines.push(await m.Engine.loadGguf(sink, new Uint8Array(tok), { backend: "cpu", maxSeq: 4096 }));
  }
  return engines;
}
