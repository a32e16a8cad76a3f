// Browser tests for loading a GGUF onto WebGPU straight from its download (www/worker.js ->
// GgufStream, src/gpu/stream.rs): the weights never enter wasm memory, and the model is the same
// as one uploaded from wasm memory (the same logprobs, bit for bit) and agrees with the native
// CLI's exact CPU path; on the CPU path the weights are in wasm memory. A large synthetic model
// makes the difference in wasm memory unambiguous.

import { spawnSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";

/** A synthetic llama of about 36 MB (Q8_0, random weights, the placeholder byte vocabulary). */
export function makeBigModel({ dir, bin }) {
  fs.mkdirSync(dir, { recursive: true });
  const config = path.join(dir, "config.json");
  fs.writeFileSync(
    config,
    JSON.stringify({
      model_type: "llama",
      vocab_size: 8192,
      hidden_size: 512,
      num_hidden_layers: 8,
      num_attention_heads: 8,
      num_key_value_heads: 4,
      intermediate_size: 1536,
      max_position_embeddings: 256,
    }),
  );
  const out = path.join(dir, "big.gguf");
  const r = spawnSync(bin, ["synth", "--config", config, "--type", "q8_0", "--seed", "11", "--out", out], {
    encoding: "utf8",
  });
  if (r.status !== 0) throw new Error(`synth failed: ${r.stderr}`);
  return out;
}

/** A tiny llama whose heads (288 wide) are more than the WebGPU kernels take (256): only the CPU runs it. */
export function makeWideHeadModel({ dir, bin }) {
  fs.mkdirSync(dir, { recursive: true });
  const config = path.join(dir, "wide-config.json");
  fs.writeFileSync(
    config,
    JSON.stringify({
      model_type: "llama",
      vocab_size: 300,
      hidden_size: 576,
      num_hidden_layers: 1,
      num_attention_heads: 2,
      num_key_value_heads: 1,
      intermediate_size: 64,
      max_position_embeddings: 64,
    }),
  );
  const out = path.join(dir, "wide-heads.gguf");
  const r = spawnSync(bin, ["synth", "--config", config, "--type", "q8_0", "--seed", "3", "--out", out], {
    encoding: "utf8",
  });
  if (r.status !== 0) throw new Error(`synth failed: ${r.stderr}`);
  return out;
}

/** Per-token logprobs of `text` by the native CLI (CPU backend; `how`: --exact or the scalar kernels). */
function cliScore(bin, model, text, how) {
  const r = spawnSync(bin, ["score", "--model", model, "--text", text, "--json", "--backend", "cpu", ...how], {
    encoding: "utf8",
  });
  if (r.status !== 0) throw new Error(`the CLI failed: ${r.stderr}`);
  return JSON.parse(r.stdout);
}

export async function streamTests({ test, assert, assertEq, browser, base, mode, bin, fixtures, bigModel }) {
  const webgpu = mode === "webgpu";

  if (webgpu) {
    await test(`[${mode}] a model streamed to WebGPU in odd pieces is the model uploaded from wasm memory: the same logprobs bit for bit, close to the exact CPU path; no weights stay in wasm memory`, async () => {
      const p = await browser.newPage();
      try {
        await p.goto(`${base}/?nosw&model=lesson-toy`);
        const r = await p.evaluate(async () => {
          const wasm = await import("/pkg/nexttoken.js");
          await wasm.default();
          const gguf = new Uint8Array(await (await fetch("/models/default.gguf")).arrayBuffer());
          const tokenizer = new Uint8Array(await (await fetch("/models/default-tokenizer.json")).arrayBuffer());
          const text = "In the beginning God created the heaven and the earth.";
          const run = async (engine) => {
            const score = await engine.score(text);
            const session = engine.start("In the beginning", { temperature: 0, maxTokens: 8, topLogprobs: 3 });
            const tokens = [];
            for (let t; (t = await session.next()) !== null; )
              tokens.push({ id: t.id, logprob: t.logprob, top: t.top.map((a) => [a.id, a.logprob]) });
            session.free();
            const info = engine.info();
            engine.free();
            return {
              score: score.tokens.map((t) => t.logprob),
              tokens,
              info: {
                backend: info.backend,
                loadPath: info.loadPath,
                held: info.weightsInWasmBytes,
                bytes: info.bytes,
              },
            };
          };
          try {
            // Streamed: the first 2000 bytes one at a time (the header arrives in pieces), then
            // pieces of 4093 bytes, so pieces end inside tensors and inside GPU words.
            const choice = await wasm.BackendChoice.choose({ backend: "gpu" });
            const stream = new wasm.GgufStream(choice, gguf.length, tokenizer, { maxSeq: 256 });
            let at = 0;
            for (; at < 2000; at++) stream.push(gguf.subarray(at, at + 1));
            for (; at < gguf.length; at += 4093) stream.push(gguf.subarray(at, Math.min(at + 4093, gguf.length)));
            const streamed = await run(await stream.finish());
            const sink = new wasm.ByteSink(gguf.length);
            sink.push(gguf);
            const uploaded = await run(await wasm.Engine.loadGguf(sink, tokenizer, { backend: "gpu", maxSeq: 256 }));
            const sink2 = new wasm.ByteSink(gguf.length);
            sink2.push(gguf);
            const cpu = await run(
              await wasm.Engine.loadGguf(sink2, tokenizer, { backend: "cpu", exact: true, maxSeq: 256 }),
            );
            // A stream that ends early is an error, not a hang or a half-loaded model.
            const cut = new wasm.GgufStream(choice, gguf.length, tokenizer, {});
            cut.push(gguf.subarray(0, gguf.length - 5000));
            let truncated = null;
            try {
              await cut.finish();
            } catch (e) {
              truncated = e.message;
            }
            choice.free();
            return { streamed, uploaded, cpu, truncated, size: gguf.length };
          } catch (e) {
            return { error: String(e?.message ? e.message : e) };
          }
        });
        assert(!r.error, r.error);
        assertEq(
          JSON.stringify(r.streamed.info),
          JSON.stringify({ backend: "webgpu", loadPath: "streamed", held: 0, bytes: r.size }),
          "streamed engine's info",
        );
        assertEq(
          JSON.stringify(r.uploaded.info),
          JSON.stringify({ backend: "webgpu", loadPath: "wasm", held: 0, bytes: r.size }),
          "uploaded engine's info (its bytes released)",
        );
        assertEq(
          JSON.stringify(r.cpu.info),
          JSON.stringify({ backend: "cpu", loadPath: "wasm", held: r.size, bytes: r.size }),
          "CPU engine's info",
        );
        assertEq(
          JSON.stringify(r.streamed.score),
          JSON.stringify(r.uploaded.score),
          "score logprobs, streamed vs uploaded",
        );
        assertEq(
          JSON.stringify(r.streamed.tokens),
          JSON.stringify(r.uploaded.tokens),
          "greedy tokens, logprobs and alternatives, streamed vs uploaded",
        );
        // The f16 KV cache where the device has shader-f16: about 4e-4 nats per token natively.
        r.streamed.score.forEach((l, i) =>
          assert(Math.abs(l - r.cpu.score[i]) < 5e-3, `score token ${i}: webgpu ${l} vs cpu ${r.cpu.score[i]}`),
        );
        assertEq(
          JSON.stringify(r.streamed.tokens.map((t) => t.id)),
          JSON.stringify(r.cpu.tokens.map((t) => t.id)),
          "greedy ids, streamed vs exact CPU",
        );
        assert(
          /ended after .* truncated|inside or before tensor/.test(r.truncated || ""),
          `a stream cut short: ${r.truncated}`,
        );
        console.log(
          `      ${r.streamed.score.length} scored and ${r.streamed.tokens.length} generated tokens equal; cut short: ${r.truncated}`,
        );
      } finally {
        await p.close();
      }
    });
  }

  await test(`[${mode}] a ${bigModel ? (fs.statSync(bigModel).size / 1e6).toFixed(0) : "?"} MB model through the worker, from the network then from the cache: ${webgpu ? "streamed to WebGPU, the weights never in wasm memory (it grows by a few MB)" : "on the CPU path the weights in wasm memory"}; logprobs match the native CLI`, async () => {
    if (!bigModel) return "skip";
    const size = fs.statSync(bigModel).size;
    const text = "Hi";
    // The exact path on both sides (WebGPU computes in f32 like it; the CPU path loads with
    // `exact`): the int8 fast path's rounding of activations, on random weights whose logits
    // reach ±10 and more, moves logprobs by 1e-2 between summation orders.
    const want = cliScore(bin, bigModel, text, ["--exact"]).tokens.map((t) => t.logprob);
    const p = await browser.newPage();
    try {
      await p.goto(`${base}/?nosw&model=lesson-toy`);
      const r = await p.evaluate(
        async ({ text, webgpu }) => {
          const { NextToken } = await import("/nexttoken.js");
          const { deleteCached } = await import("/model-cache.js");
          await deleteCached("/test/big/big.gguf");
          // A fresh worker: its wasm memory, after a small model, is the baseline.
          const nt = new NextToken();
          const pick = (i) => ({
            backend: i.backend,
            loadPath: i.loadPath,
            held: i.weightsInWasmBytes,
            memory: i.wasmMemoryBytes,
            bytes: i.bytes,
            fromCache: !!i.timings.fromCache,
            ms: Math.round(i.timings.downloadMs + i.timings.initMs),
          });
          try {
            const base = pick(await nt.load("/models/lesson-toy.json"));
            const loads = [];
            for (let k = 0; k < 2; k++) {
              // WebGPU by name: "auto" takes the CPU path where the only adapter is SwiftShader.
              const info = pick(
                await nt.load("/test/big/big.gguf", { maxSeq: 64, exact: true, backend: webgpu ? "gpu" : "auto" }),
              );
              const t0 = performance.now();
              const score = await nt.score(text);
              loads.push({
                ...info,
                score: score.tokens.map((t) => t.logprob),
                scoreMs: Math.round(performance.now() - t0),
              });
            }
            return { base, loads };
          } catch (e) {
            return { error: e.message };
          } finally {
            nt.terminate();
            await deleteCached("/test/big/big.gguf");
          }
        },
        { text, webgpu },
      );
      assert(!r.error, r.error);
      const mb = (n) => `${(n / 2 ** 20).toFixed(1)} MiB`;
      const lines = [];
      for (const [k, load] of r.loads.entries()) {
        const grew = load.memory - r.base.memory;
        lines.push(
          `load ${k + 1} (${load.fromCache ? "cache" : "network"}, ${load.ms} ms, score ${load.scoreMs} ms): ${load.loadPath}, weightsInWasmBytes ${load.held}, wasm memory ${mb(r.base.memory)} -> ${mb(load.memory)} (+${mb(grew)}) for a ${mb(size)} file`,
        );
        assertEq(load.fromCache, k === 1, `load ${k + 1} from the cache`);
        assertEq(load.bytes, size, "model size");
        if (webgpu) {
          assertEq(
            `${load.backend} ${load.loadPath} ${load.held}`,
            "webgpu streamed 0",
            `load ${k + 1}: backend, load path, weights in wasm memory`,
          );
          assert(
            grew < size / 4,
            `load ${k + 1}: wasm memory grew by ${mb(grew)}, a quarter of the ${mb(size)} file or more`,
          );
        } else {
          assertEq(
            `${load.backend} ${load.loadPath} ${load.held}`,
            `cpu wasm ${size}`,
            `load ${k + 1}: backend, load path, weights in wasm memory`,
          );
          assert(
            load.memory - r.base.memory >= size,
            `the CPU path's wasm memory grew by ${mb(grew)}, less than the ${mb(size)} file`,
          );
        }
        assertEq(load.score.length, want.length, "scored tokens");
        load.score.forEach((l, i) =>
          assert(Math.abs(l - want[i]) < 5e-3, `load ${k + 1}, token ${i}: ${l} vs the CLI's ${want[i]}`),
        );
      }
      console.log(`      ${lines.join("\n      ")}`);
    } finally {
      await p.close();
    }
  });

  if (webgpu) {
    await test(`[${mode}] a streamed model the WebGPU kernels cannot run (288-wide heads) falls back to the CPU path with backend "auto", saying why, and is an error with backend "gpu"`, async () => {
      const model = makeWideHeadModel({ dir: path.join(fixtures, "wide"), bin });
      const url = "/test/wide/wide-heads.gguf";
      const want = cliScore(bin, model, "Hi there", ["--exact"]).tokens.map((t) => t.logprob);
      const p = await browser.newPage();
      try {
        await p.goto(`${base}/?nosw&model=lesson-toy`);
        const r = await p.evaluate(
          async ({ url }) => {
            const { NextToken } = await import("/nexttoken.js");
            const { listCached } = await import("/model-cache.js");
            const nt = new NextToken();
            try {
              let gpuError = null;
              try {
                await nt.load(url, { backend: "gpu" });
              } catch (e) {
                gpuError = e.message;
              }
              // allowSoftwareGpu: "auto" tries SwiftShader as it would a real GPU.
              const info = await nt.load(url, { exact: true, allowSoftwareGpu: true });
              const score = await nt.score("Hi there");
              const cached = (await listCached()).filter((c) => c.url.endsWith(url)).map((c) => c.complete);
              return {
                gpuError,
                backend: info.backend,
                detail: info.backendDetail,
                fromCache: info.timings.fromCache,
                score: score.tokens.map((t) => t.logprob),
                cached,
              };
            } catch (e) {
              return { error: e.message };
            } finally {
              nt.terminate();
            }
          },
          { url },
        );
        assert(!r.error, r.error);
        assert(/GPU: head size 288 exceeds/.test(r.gpuError || ""), `backend "gpu": ${r.gpuError}`);
        assertEq(r.backend, "cpu", 'backend with "auto"');
        assert(/^WebGPU failed \(.*head size 288.*\); running on the CPU/.test(r.detail), `backendDetail: ${r.detail}`);
        assertEq(JSON.stringify(r.cached), "[true]", "the file stays cached (whole) after the GPU refused it");
        r.score.forEach((l, i) => assert(Math.abs(l - want[i]) < 1e-3, `token ${i}: ${l} vs the CLI's ${want[i]}`));
        console.log(`      "gpu": ${r.gpuError}\n      "auto": ${r.detail}`);
      } finally {
        await p.close();
      }
    });
  }

  await test(`[${mode}] a download whose sha256 is not the one expected is refused after the stream, and nothing is loaded or kept`, async () => {
    const p = await browser.newPage();
    try {
      await p.goto(`${base}/?nosw&model=lesson-toy`);
      const r = await p.evaluate(async () => {
        const { NextToken } = await import("/nexttoken.js");
        const { listCached } = await import("/model-cache.js");
        const nt = new NextToken();
        try {
          let error = null;
          try {
            await nt.load({
              url: "/models/default.gguf",
              tokenizer: "/models/default-tokenizer.json",
              kind: "gguf",
              sha256: "0".repeat(64),
            });
          } catch (e) {
            error = e.message;
          }
          const kept = (await listCached()).filter((c) => c.url.endsWith("/models/default.gguf")).length;
          let generated = null;
          try {
            const ids = [];
            for await (const t of nt.generate("In the beginning", { maxTokens: 2 })) ids.push(t.id);
            generated = ids;
          } catch (e) {
            generated = e.message;
          }
          return { error, kept, generated };
        } finally {
          nt.terminate();
        }
      });
      assert(/corrupt/.test(r.error || "") && /sha256/.test(r.error), `error: ${r.error}`);
      assertEq(r.kept, 0, "entries kept (partial or whole)");
      assert(/no model is loaded/.test(String(r.generated)), `after the refused load: ${JSON.stringify(r.generated)}`);
    } finally {
      await p.close();
    }
  });
}
