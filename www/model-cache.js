// Model downloads with progress and the Cache API: used by the worker (downloads) and by the
// page (the "cached models" list). Works in windows and workers alike.
//
// - A download streams: each chunk goes to the caller (the worker pushes it into wasm memory)
//   while a tee of the same stream is written to a staging cache.
// - Only a complete download (all Content-Length bytes, and the sha256 when one is given) is moved
//   into the model cache, under the URL; an interrupted or corrupt one is deleted. So the model
//   cache never holds a partial entry.
// - The cache name carries a version: a format change bumps it and old entries are dropped.

export const MODEL_CACHE = "nexttoken-models-v1";
const STAGING_CACHE = "nexttoken-staging-v1";

const hasCaches = () => typeof caches !== "undefined";

export class DownloadError extends Error {
  constructor(message, { retryable = true, status = 0 } = {}) {
    super(message);
    this.name = "DownloadError";
    this.retryable = retryable;
    this.status = status;
  }
}

const mb = (n) => (n / 1e6).toFixed(n < 1e7 ? 2 : 1) + " MB";
export const formatBytes = mb;

function nameOf(url) {
  try {
    return decodeURIComponent(new URL(url, self.location.href).pathname.split("/").pop()) || url;
  } catch {
    return url;
  }
}

/**
 * The URLs of every part of a model split by llama.cpp's gguf-split when `url` names its first
 * part (`NAME-00001-of-00003.gguf`: parts 2 and 3 are beside it, same query); else just `url`.
 * Absolute URLs.
 */
export function splitPartUrls(url) {
  const first = new URL(url, self.location.href);
  const m = /^(.+)-00001-of-(\d{5})\.gguf$/.exec(first.pathname);
  const n = m ? Number(m[2]) : 1;
  if (n < 2) return [first.href];
  return Array.from({ length: n }, (_, i) => {
    const part = new URL(first.href);
    part.pathname = `${m[1]}-${String(i + 1).padStart(5, "0")}-of-${m[2]}.gguf`;
    return part.href;
  });
}

/**
 * Fetch `url`, from the model cache when it is there. Calls `onStart({total, fromCache})` once
 * the size is known (0 if not), `onChunk(Uint8Array)` for every chunk and `onProgress({loaded, total, fromCache})`. Resolves to
 * `{bytes, total, fromCache, cacheWarning}`; rejects with a DownloadError naming the problem.
 * Options: `sha256` (hex) to check, `signal` (AbortSignal), `cache` (false: no caching).
 */
export async function fetchModelFile(url, { onStart, onChunk, onProgress = () => {}, sha256, signal, cache = true } = {}) {
  const absolute = new URL(url, self.location.href).href;
  const name = nameOf(absolute);
  let cached = null;
  if (cache && hasCaches()) {
    try {
      cached = await (await caches.open(MODEL_CACHE)).match(absolute);
    } catch {
      cached = null; // no Cache API here (opaque origin, private mode): just download
    }
  }
  if (cached) {
    try {
      const total = Number(cached.headers.get("content-length")) || 0;
      onStart?.({ total, fromCache: true });
      const { bytes } = await pump(cached.body, total, onChunk, (loaded) => onProgress({ loaded, total, fromCache: true }), signal);
      return { bytes, total: bytes, fromCache: true, cacheWarning: null };
    } catch (e) {
      if (signal?.aborted) throw e;
      // A cache entry that cannot be read back is dropped and the file downloaded again. The
      // caller has already received part of it, so make it start over.
      await caches.open(MODEL_CACHE).then((c) => c.delete(absolute)).catch(() => {});
      throw new DownloadError(`the cached copy of ${name} could not be read (${e.message}); it was removed — retry to download it again`);
    }
  }

  let response;
  try {
    response = await fetch(absolute, { signal, cache: "no-store" });
  } catch (e) {
    if (signal?.aborted) throw e;
    throw new DownloadError(`cannot download ${name}: ${e.message || e} (offline, blocked, or the server refused the connection)`);
  }
  if (!response.ok) {
    throw new DownloadError(
      `cannot download ${name}: the server answered ${response.status} ${response.statusText || ""}`.trim() +
        (response.status === 404 ? " (no such file — check the URL)" : ""),
      { retryable: response.status >= 500 || response.status === 429, status: response.status },
    );
  }
  if (!response.body) throw new DownloadError(`cannot download ${name}: the response has no body`);
  const total = Number(response.headers.get("content-length")) || 0;
  const encoded = response.headers.get("content-encoding");
  // With compression, Content-Length counts compressed bytes: it cannot check completeness.
  const expected = encoded && encoded !== "identity" ? 0 : total;

  let body = response.body;
  let staged = null;
  let stagingKey = null;
  if (cache && hasCaches()) {
    const [forUs, forCache] = body.tee();
    body = forUs;
    stagingKey = absolute;
    const headers = new Headers({ "content-type": response.headers.get("content-type") || "application/octet-stream" });
    if (expected) headers.set("content-length", String(expected));
    headers.set("x-nexttoken-stored", new Date().toISOString());
    staged = caches
      .open(STAGING_CACHE)
      .then((c) => c.put(stagingKey, new Response(forCache, { headers })))
      .then(() => null, (e) => e);
  }

  onStart?.({ total, fromCache: false });
  const hasher = sha256 ? new Sha256() : null;
  let got;
  try {
    got = await pump(
      body,
      total,
      (chunk) => {
        hasher?.update(chunk);
        onChunk?.(chunk);
      },
      (loaded) => onProgress({ loaded, total, fromCache: false }),
      signal,
    );
  } catch (e) {
    await discardStaged(staged, stagingKey);
    if (signal?.aborted) throw e;
    throw new DownloadError(`the download of ${name} was interrupted (${e.message || e}) — retry to start it again`);
  }
  if (expected && got.bytes !== expected) {
    await discardStaged(staged, stagingKey);
    throw new DownloadError(`the download of ${name} was cut short: ${mb(got.bytes)} of ${mb(expected)} arrived — retry`);
  }
  if (hasher) {
    const digest = hasher.hex();
    if (digest !== sha256.toLowerCase()) {
      await discardStaged(staged, stagingKey);
      throw new DownloadError(`${name} is corrupt: its sha256 is ${digest}, the catalog expects ${sha256}`, { retryable: true });
    }
  }

  let cacheWarning = null;
  if (staged) {
    const err = await staged;
    try {
      if (err) throw err;
      const staging = await caches.open(STAGING_CACHE);
      const entry = await staging.match(stagingKey);
      if (!entry) throw new Error("the staged copy vanished");
      await (await caches.open(MODEL_CACHE)).put(absolute, entry);
      await staging.delete(stagingKey);
    } catch (e) {
      await discardStaged(null, stagingKey);
      await caches.open(MODEL_CACHE).then((c) => c.delete(absolute)).catch(() => {});
      cacheWarning = isQuotaError(e)
        ? `not enough browser storage to keep ${name} (${mb(got.bytes)}): it runs now but will be downloaded again next time. Delete cached models below or free disk space.`
        : `could not keep ${name} in the browser cache (${e.message || e}): it will be downloaded again next time.`;
    }
  }
  return { bytes: got.bytes, total: got.bytes, fromCache: false, cacheWarning };
}

function isQuotaError(e) {
  return e && (e.name === "QuotaExceededError" || /quota/i.test(String(e.message)));
}

async function discardStaged(staged, key) {
  if (!key || !hasCaches()) return;
  try {
    if (staged) await staged;
    await (await caches.open(STAGING_CACHE)).delete(key);
  } catch {
    /* nothing to clean */
  }
}

/** Read a stream to the end, chunk by chunk; progress at most every 50 ms (and at the end). */
async function pump(stream, total, onChunk, onProgress, signal) {
  const reader = stream.getReader();
  let bytes = 0;
  let last = 0;
  const onAbort = () => reader.cancel(new DOMException("aborted", "AbortError")).catch(() => {});
  signal?.addEventListener("abort", onAbort, { once: true });
  try {
    for (;;) {
      if (signal?.aborted) throw new DOMException("aborted", "AbortError");
      const { done, value } = await reader.read();
      if (done) break;
      bytes += value.byteLength;
      onChunk?.(value);
      const now = Date.now();
      if (now - last > 50) {
        last = now;
        onProgress(bytes);
      }
    }
  } finally {
    signal?.removeEventListener("abort", onAbort);
  }
  onProgress(bytes);
  return { bytes };
}

/** The cached model files: [{url, name, bytes, stored}], largest first. */
export async function listCached() {
  if (!hasCaches()) return [];
  const cache = await caches.open(MODEL_CACHE);
  const out = [];
  for (const req of await cache.keys()) {
    const res = await cache.match(req);
    let bytes = Number(res?.headers.get("content-length")) || 0;
    if (!bytes && res) bytes = (await res.blob()).size;
    out.push({ url: req.url, name: nameOf(req.url), bytes, stored: res?.headers.get("x-nexttoken-stored") || "" });
  }
  return out.sort((a, b) => b.bytes - a.bytes);
}

export async function deleteCached(url) {
  if (!hasCaches()) return false;
  return (await caches.open(MODEL_CACHE)).delete(url);
}

export async function isCached(url) {
  if (!hasCaches()) return false;
  const absolute = new URL(url, self.location.href).href;
  return !!(await (await caches.open(MODEL_CACHE)).match(absolute));
}

/** Drop caches of older versions of this scheme. */
export async function dropOldCaches() {
  if (!hasCaches()) return;
  for (const name of await caches.keys()) {
    if ((name.startsWith("nexttoken-models-") && name !== MODEL_CACHE) || (name.startsWith("nexttoken-staging-") && name !== STAGING_CACHE)) {
      await caches.delete(name);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// SHA-256, incremental (WebCrypto has no streaming digest, and the file is never whole in JS).

const K = new Uint32Array([
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98, 0x12835b01,
  0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc,
  0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147,
  0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
  0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08,
  0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208,
  0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
]);

export class Sha256 {
  constructor() {
    this.h = new Uint32Array([0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19]);
    this.block = new Uint8Array(64);
    this.fill = 0;
    this.length = 0;
    this.w = new Uint32Array(64);
  }
  update(data) {
    let i = 0;
    this.length += data.length;
    if (this.fill) {
      const n = Math.min(64 - this.fill, data.length);
      this.block.set(data.subarray(0, n), this.fill);
      this.fill += n;
      i = n;
      if (this.fill < 64) return this;
      this.compress(this.block, 0);
      this.fill = 0;
    }
    for (; i + 64 <= data.length; i += 64) this.compress(data, i);
    if (i < data.length) {
      this.block.set(data.subarray(i), 0);
      this.fill = data.length - i;
    }
    return this;
  }
  compress(b, o) {
    const w = this.w;
    for (let t = 0; t < 16; t++) w[t] = (b[o + 4 * t] << 24) | (b[o + 4 * t + 1] << 16) | (b[o + 4 * t + 2] << 8) | b[o + 4 * t + 3];
    for (let t = 16; t < 64; t++) {
      const x = w[t - 15], y = w[t - 2];
      const s0 = ((x >>> 7) | (x << 25)) ^ ((x >>> 18) | (x << 14)) ^ (x >>> 3);
      const s1 = ((y >>> 17) | (y << 15)) ^ ((y >>> 19) | (y << 13)) ^ (y >>> 10);
      w[t] = (w[t - 16] + s0 + w[t - 7] + s1) | 0;
    }
    let [a, bb, c, d, e, f, g, h] = this.h;
    for (let t = 0; t < 64; t++) {
      const S1 = ((e >>> 6) | (e << 26)) ^ ((e >>> 11) | (e << 21)) ^ ((e >>> 25) | (e << 7));
      const ch = (e & f) ^ (~e & g);
      const t1 = (h + S1 + ch + K[t] + w[t]) | 0;
      const S0 = ((a >>> 2) | (a << 30)) ^ ((a >>> 13) | (a << 19)) ^ ((a >>> 22) | (a << 10));
      const maj = (a & bb) ^ (a & c) ^ (bb & c);
      const t2 = (S0 + maj) | 0;
      h = g; g = f; f = e; e = (d + t1) | 0; d = c; c = bb; bb = a; a = (t1 + t2) | 0;
    }
    const H = this.h;
    H[0] += a; H[1] += bb; H[2] += c; H[3] += d; H[4] += e; H[5] += f; H[6] += g; H[7] += h;
  }
  hex() {
    const bits = this.length * 8;
    const pad = new Uint8Array(((this.fill < 56 ? 56 : 120) - this.fill) + 8);
    pad[0] = 0x80;
    const dv = new DataView(pad.buffer);
    dv.setUint32(pad.length - 8, Math.floor(bits / 2 ** 32));
    dv.setUint32(pad.length - 4, bits >>> 0);
    const length = this.length;
    this.update(pad);
    this.length = length;
    return Array.from(this.h, (x) => x.toString(16).padStart(8, "0")).join("");
  }
}
