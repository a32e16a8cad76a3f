// What the suites that drive one browser without Playwright share (firefox.mjs, webkit.mjs): the
// test runner and its closing line, assertions, the native CLI and its greedy text on the
// default model (the reference each browser's text must equal).

import { spawnSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

export const repo = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
export const www = path.join(repo, "www");
export const outDir = path.join(repo, "target", "browser-tests");
fs.mkdirSync(outDir, { recursive: true });

export const assert = (cond, message) => {
  if (!cond) throw new Error(message);
};
export const assertEq = (got, want, what) =>
  assert(got === want, `${what}:\n        got:  ${JSON.stringify(got)}\n        want: ${JSON.stringify(want)}`);

/** `test(name, fn)` printing "ok"/"FAIL" lines tagged `label`; `finish()` prints the closing line and exits. */
export function runner(label) {
  let passed = 0;
  let failed = 0;
  async function test(name, fn) {
    const t0 = Date.now();
    try {
      await fn();
      passed++;
      console.log(`ok    [${label}] ${name} (${Date.now() - t0} ms)`);
    } catch (e) {
      failed++;
      const lines = String(e?.stack ? e.stack : e).split("\n");
      console.log(`FAIL  [${label}] ${name}\n      ${lines.slice(0, 6).join("\n      ")}`);
    }
  }
  const finish = () => {
    console.log(`${passed} passed, ${failed} failed`);
    process.exit(failed ? 1 : 0);
  };
  return { test, finish, failed: () => failed };
}

/** The native CLI: NEXTTOKEN_BIN, else the newer of the release and debug builds. */
export function nativeBin() {
  const built = [path.join(repo, "target/release/nexttoken"), path.join(repo, "target/debug/nexttoken")].filter((p) =>
    fs.existsSync(p),
  );
  built.sort((a, b) => fs.statSync(b).mtimeMs - fs.statSync(a).mtimeMs);
  const bin = process.env.NEXTTOKEN_BIN || built[0];
  assert(bin, "no native CLI: run cargo build");
  return bin;
}

/** In the page (passed to a driver's evaluate): the app's settings for a greedy run of `n` tokens. */
export function setGreedy(n) {
  for (const [id, v] of [
    ["temperature", "0"],
    ["max-tokens", String(n)],
    ["beams", "1"],
  ])
    document.getElementById(id).value = v;
}

/** In the page: what the app shows after a run (text, error, backend line, cores, download line). */
export function appOutcome() {
  return {
    text: document.getElementById("output-tokens").textContent,
    error: document.getElementById("error").hidden ? "" : document.getElementById("error-text").textContent,
    backend: window.nexttokenApp.stats.backend,
    cores: navigator.hardwareConcurrency,
    download: window.nexttokenApp.stats.download || "",
  };
}

/** The native CLI's greedy continuation of `prompt` on the default model, computed as the wasm
 * CPU path computes it (scalar kernels, one thread); exits with a failure if the CLI does. */
export function nativeGreedy(prompt, n) {
  const args = ["generate", "--model", path.join(www, "models/default.gguf"), "--prompt", prompt];
  args.push("--temperature", "0", "--max-tokens", String(n), "--backend", "cpu", "--isa", "scalar", "--threads", "1");
  const cli = spawnSync(nativeBin(), args, { encoding: "utf8" });
  if (cli.status !== 0) {
    console.log(`the CLI failed: ${cli.stderr}\n0 passed, 1 failed`);
    process.exit(1);
  }
  return cli.stdout.slice(prompt.length).replace(/\n$/, "");
}
