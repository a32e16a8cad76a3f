// Model downloads with progress, resume and integrity, stored in the Cache API: used by the
// worker (downloads) and by the page (the "cached models" list). Works in windows and workers.
//
// A file is stored as chunks (each its own cache entry, `chunkKey`) plus a manifest under the
// file's URL: its size, ETag / Last-Modified, each chunk's length and sha256, the whole file's
// sha256 when known, and whether it is complete.
// - A download streams: each chunk goes to the caller (the worker pushes it into wasm memory, or
//   on WebGPU on to GPU buffers) and is stored as soon as it is whole, with its hash. An
//   interrupted download keeps what arrived;
//   the next attempt asks only for the rest (`Range`, with `If-Range` so a changed file restarts
//   cleanly; a server that ignores `Range` also restarts).
// - Reading back from the cache checks every chunk's sha256 (WebCrypto, fast): a damaged entry is
//   reported, removed, and the caller can retry. So a flipped byte never loads silently.
// - A whole-file sha256 is checked when one is known: given by the caller (the catalog), or
//   published by the host (an `X-Linked-Etag` or `ETag` that is a sha256, as Hugging Face's are).
// - A manifest that is not complete is a partial download: never loaded as a model.
// - The cache name carries a version: a format change bumps it and old entries are dropped.

export const MODEL_CACHE = "nexttoken-models-v2";
const FORMAT = 2;
/** Bytes per stored chunk: what an interrupted download can lose, and one cache entry. */
export const CHUNK_BYTES = 8 << 20;
/** A download that sends nothing for this long is treated as broken (and can resume). */
const STALL_MS = 30_000;
/** Wait before the one retry of a request that got no answer (see `request`). */
const RETRY_MS = 500;

const hasCaches = () => typeof caches !== "undefined";

export class DownloadError extends Error {
  constructor(message, { retryable = true, status = 0 } = {}) {
    super(message);
    this.name = "DownloadError";
    this.retryable = retryable;
    this.status = status;
  }
}

/**
 * An error the caller's `onChunk` threw (the model is unusable, the GPU failed): not the
 * download's or the cache's fault, so it is passed on as it is and what is stored stays.
 */
class ConsumerError extends Error {
  constructor(cause) {
    super(String(cause?.message ?? cause));
    this.cause = cause;
  }
}

/** `onChunk(bytes)`, its errors marked as the consumer's. */
function consume(onChunk, bytes) {
  try {
    onChunk?.(bytes);
  } catch (e) {
    throw new ConsumerError(e);
  }
}

const mb = (n) => `${(n / 1e6).toFixed(n < 1e7 ? 2 : 1)} MB`;
export const formatBytes = mb;
/** Whole megabytes past 10 MB, one decimal below: a preflight's round figures. */
export const roundMegabytes = (n) => `${(n / 1e6).toFixed(n < 1e7 ? 1 : 0)} MB`;

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

/** The model URLs the browser can fetch: http(s) (and relative ones); anything else is refused by name. */
export function checkModelUrl(url) {
  let u;
  try {
    u = new URL(url, self.location.href);
  } catch {
    throw new DownloadError(`${JSON.stringify(url)} is not a URL`, { retryable: false });
  }
  if (u.protocol !== "http:" && u.protocol !== "https:") {
    throw new DownloadError(
      `unsupported URL ${JSON.stringify(String(url).slice(0, 80))}: models are fetched over http(s) only (not ${u.protocol})`,
      { retryable: false },
    );
  }
  return u.href;
}

// ---------------------------------------------------------------------------------------------
// The stored form

/** The cache key of chunk `i` of `url` (a key of its own, so chunks are stored one by one). */
const chunkKey = (url, i) => `https://nexttoken-chunks.invalid/${i}/${encodeURIComponent(url)}`;

async function openCache() {
  if (!hasCaches()) return null;
  try {
    return await caches.open(MODEL_CACHE);
  } catch {
    return null; // no Cache API here (opaque origin, private mode): just download
  }
}

async function readManifest(cache, url) {
  const res = await cache.match(url);
  if (!res) return null;
  try {
    const m = await res.json();
    return m && m.format === FORMAT && Array.isArray(m.chunks) ? m : null;
  } catch {
    return null;
  }
}

function writeManifest(cache, url, m) {
  return cache.put(
    url,
    new Response(JSON.stringify(m), {
      headers: { "content-type": "application/json", "x-nexttoken-manifest": String(FORMAT) },
    }),
  );
}

/** Remove `url`'s manifest and every chunk it may have. */
async function removeEntry(cache, url, manifest) {
  const n = manifest?.chunks?.length ?? 0;
  await Promise.all([
    cache.delete(url),
    ...Array.from({ length: n + 1 }, (_, i) => cache.delete(chunkKey(url, i))),
  ]).catch(() => {});
}

const hex = (buf) => Array.from(new Uint8Array(buf), (b) => b.toString(16).padStart(2, "0")).join("");

/** sha256 of one chunk: WebCrypto where the page is a secure context, else the JS one below. */
async function chunkSha256(bytes) {
  if (globalThis.crypto?.subtle) return hex(await crypto.subtle.digest("SHA-256", bytes));
  return new Sha256().update(bytes).hex();
}

/**
 * The sha256 a host publishes for a file: Hugging Face answers with it in `X-Linked-Etag` (LFS
 * files), and its download servers in a strong `ETag`. Other hosts' ETags are opaque, so an ETag
 * counts only from Hugging Face's hosts.
 */
function publishedSha256(response) {
  const sha = (name) =>
    /^"?([0-9a-f]{64})"?$/i.exec((response.headers.get(name) || "").trim())?.[1].toLowerCase() ?? null;
  let host = "";
  try {
    host = new URL(response.url).hostname;
  } catch {
    /* no URL: not a Hugging Face host */
  }
  return sha("x-linked-etag") ?? (/(^|\.)(huggingface\.co|hf\.co)$/.test(host) ? sha("etag") : null);
}

function isQuotaError(e) {
  return e && (e.name === "QuotaExceededError" || /quota/i.test(String(e.message)));
}

// ---------------------------------------------------------------------------------------------

/**
 * Fetch `url`, from the model cache when it holds it whole, else from the network, resuming a
 * download an earlier attempt left unfinished. Calls `onStart({total, fromCache, resumed})` once
 * the size is known (0 if not; `resumed`: bytes already stored that are not downloaded again),
 * `onChunk(Uint8Array)` for every piece in order (the whole file from byte 0, also when a
 * download resumes: the stored chunks come first; an error it throws ends the fetch and is
 * passed on as it is, and what is stored stays), and `onProgress({loaded, total, fromCache,
 * resumed})`. Resolves to `{bytes, total, fromCache, resumed, cacheWarning, sha256}`; rejects with
 * a DownloadError naming the problem (`retryable`: whether trying again may help; what arrived is
 * kept for that retry). Options: `sha256` (hex) to check, `signal` (AbortSignal), `cache` (false:
 * no caching), `chunkBytes` and `stallMs` (tests make them small).
 */
export async function fetchModelFile(
  url,
  {
    onStart,
    onChunk,
    onProgress = () => {},
    sha256,
    signal,
    cache: useCache = true,
    chunkBytes = CHUNK_BYTES,
    stallMs = STALL_MS,
  } = {},
) {
  const absolute = checkModelUrl(url);
  const name = nameOf(absolute);
  const cache = useCache ? await openCache() : null;
  const manifest = cache ? await readManifest(cache, absolute).catch(() => null) : null;
  const expected = sha256?.toLowerCase() || null;
  if (manifest?.complete && (!expected || !manifest.sha256 || manifest.sha256 === expected)) {
    return readStored({ cache, url: absolute, name, manifest, onStart, onChunk, onProgress, signal });
  }
  return download({
    cache,
    url: absolute,
    name,
    partial: manifest && !manifest.complete ? manifest : null,
    stale: manifest?.complete ? manifest : null,
    expected,
    onStart,
    onChunk,
    onProgress,
    signal,
    chunkBytes,
    stallMs,
  });
}

/** A complete entry, chunk by chunk, each checked against its recorded sha256. */
async function readStored({ cache, url, name, manifest, onStart, onChunk, onProgress, signal }) {
  const total = manifest.size;
  await onStart?.({ total, fromCache: true, resumed: 0 });
  let loaded = 0;
  try {
    for (let i = 0; i < manifest.chunks.length; i++) {
      if (signal?.aborted) throw new DOMException("aborted", "AbortError");
      const res = await cache.match(chunkKey(url, i));
      if (!res) throw new Error(`chunk ${i + 1} of ${manifest.chunks.length} is missing`);
      const bytes = new Uint8Array(await res.arrayBuffer());
      if (bytes.length !== manifest.chunks[i].bytes || (await chunkSha256(bytes)) !== manifest.chunks[i].sha256) {
        throw new Error(
          `chunk ${i + 1} of ${manifest.chunks.length} (bytes ${loaded}-${loaded + bytes.length}) does not match the sha256 recorded when it was stored`,
        );
      }
      consume(onChunk, bytes);
      loaded += bytes.length;
      onProgress({ loaded, total, fromCache: true, resumed: 0 });
    }
    if (loaded !== total) throw new Error(`${loaded} bytes are stored, the file had ${total}`);
  } catch (e) {
    if (signal?.aborted) throw e;
    if (e instanceof ConsumerError) throw e.cause;
    // The caller has received part of it: it must start over. The entry goes, so a retry downloads.
    await removeEntry(cache, url, manifest);
    throw new DownloadError(
      `the cached copy of ${name} is damaged (${e.message}); it was removed — retry to download it again`,
    );
  }
  return { bytes: loaded, total, fromCache: true, resumed: 0, cacheWarning: null, sha256: manifest.sha256 || null };
}

/** `bytes=START-END/TOTAL` of a 206 answer. */
function contentRange(headers) {
  const m = /^bytes (\d+)-(\d+)\/(\d+|\*)$/.exec((headers.get("content-range") || "").trim());
  return m ? { start: Number(m[1]), end: Number(m[2]), total: m[3] === "*" ? 0 : Number(m[3]) } : null;
}

async function request(url, name, signal, headers = {}) {
  let response;
  // A request that got no answer at all is tried once more, half a second later: a connection
  // can fail for a moment (Firefox failed a first visit's tokenizer request about once in 40 test
  // runs, the server up); offline or refused, the second try fails as fast.
  for (let tries = 1; !response; tries++) {
    try {
      response = await fetch(url, { signal, cache: "no-store", headers });
    } catch (e) {
      if (signal?.aborted) throw e;
      if (tries === 2)
        throw new DownloadError(
          `cannot download ${name}: ${e.message || e} (offline, blocked, or the server refused the connection)`,
        );
      await new Promise((resolve) => setTimeout(resolve, RETRY_MS));
    }
  }
  if (!response.ok) {
    const error = new DownloadError(
      `cannot download ${name}: the server answered ${response.status} ${response.statusText || ""}`.trim() +
        (response.status === 404 ? " (no such file — check the URL)" : ""),
      { retryable: response.status >= 500 || response.status === 429, status: response.status },
    );
    error.contentRange = response.headers.get("content-range");
    throw error;
  }
  if (!response.body) throw new DownloadError(`cannot download ${name}: the server sent an empty response (no body)`);
  return response;
}

/**
 * Download `url` (the rest of it, after `partial`'s chunks, when the server can resume),
 * storing chunks as they complete.
 */
async function download({
  cache,
  url,
  name,
  partial,
  stale,
  expected,
  onStart,
  onChunk,
  onProgress,
  signal,
  chunkBytes,
  stallMs,
}) {
  if (stale) await removeEntry(cache, url, stale); // a complete entry whose hash is not the one wanted
  let stored = partial;
  let response = null;
  if (stored && stored.storedBytes > 0) {
    const headers = { Range: `bytes=${stored.storedBytes}-` };
    const validator = stored.etag || stored.lastModified;
    if (validator) headers["If-Range"] = validator;
    let range = null;
    try {
      response = await request(url, name, signal, headers);
      range = response.status === 206 ? contentRange(response.headers) : null;
    } catch (e) {
      if (e.status !== 416) throw e;
      // 416: nothing is left after what is stored. If the file is exactly that long, it is all
      // here (an earlier answer announced more than it sent); else it changed: restart.
      const length = Number(/\*\/(\d+)$/.exec(e.contentRange || "")?.[1]);
      if (length === stored.storedBytes) {
        response = new Response(new Uint8Array(0), { status: 206, headers: { "content-range": `bytes */${length}` } });
        range = { start: length, total: length };
      }
    }
    // With a validator (If-Range) the server vouches that the file is the one stored; without,
    // its length must be the one recorded.
    const vouched = !!validator || !stored.size || !range?.total || range.total === stored.size;
    const sameFile = range && range.start === stored.storedBytes && vouched;
    if (sameFile && range.total) stored.size = range.total;
    if (!sameFile) {
      // The server sent the whole file (it ignores Range, or the file changed), or a range we did
      // not ask for: start over from byte 0, with this response when it is the whole file.
      if (response && response.status !== 200) {
        await response.body.cancel().catch(() => {});
        response = null;
      }
      await removeEntry(cache, url, stored);
      stored = null;
    }
  } else if (stored) {
    await removeEntry(cache, url, stored);
    stored = null;
  }
  response ??= await request(url, name, signal);

  const resumed = stored ? stored.storedBytes : 0;
  const encoded = response.headers.get("content-encoding");
  const identity = !encoded || encoded === "identity";
  // With compression, Content-Length counts compressed bytes: it cannot check completeness.
  const length = identity ? Number(response.headers.get("content-length")) || 0 : 0;
  const total = stored ? stored.size : length;
  const wantSha = expected || publishedSha256(response) || stored?.wantSha256 || null;
  const manifest = stored ?? {
    format: FORMAT,
    url,
    size: total,
    etag: response.headers.get("etag") || "",
    lastModified: response.headers.get("last-modified") || "",
    chunks: [],
    storedBytes: 0,
    complete: false,
    wantSha256: wantSha,
    stored: new Date().toISOString(),
  };
  let cacheWarning = null;
  let caching = !!cache;
  const hasher = wantSha ? new Sha256() : null;
  try {
    await onStart?.({ total, fromCache: false, resumed });
  } catch (e) {
    await response.body.cancel().catch(() => {}); // e.g. too big: do not download it
    throw e;
  }
  let loaded = 0;
  const progress = () => onProgress({ loaded, total, fromCache: false, resumed });

  // What the earlier attempt stored: to the caller first (checked like a cache read).
  if (stored) {
    try {
      for (let i = 0; i < stored.chunks.length; i++) {
        const res = await cache.match(chunkKey(url, i));
        const bytes = res ? new Uint8Array(await res.arrayBuffer()) : null;
        if (!bytes || bytes.length !== stored.chunks[i].bytes || (await chunkSha256(bytes)) !== stored.chunks[i].sha256)
          throw new Error(`stored chunk ${i + 1} is damaged`);
        hasher?.update(bytes);
        consume(onChunk, bytes);
        loaded += bytes.length;
      }
      progress();
    } catch (e) {
      await response.body.cancel().catch(() => {});
      if (e instanceof ConsumerError) throw e.cause;
      await removeEntry(cache, url, stored);
      throw new DownloadError(
        `the partial download of ${name} kept from an earlier attempt is damaged (${e.message}); it was removed — retry to download it again`,
      );
    }
  }

  /** Store one whole chunk and the manifest that lists it (stops caching on a quota error). */
  const store = async (bytes) => {
    if (!caching) return;
    try {
      const i = manifest.chunks.length;
      const sha = await chunkSha256(bytes);
      await cache.put(
        chunkKey(url, i),
        new Response(bytes, { headers: { "content-type": "application/octet-stream" } }),
      );
      manifest.chunks.push({ bytes: bytes.length, sha256: sha });
      manifest.storedBytes += bytes.length;
      await writeManifest(cache, url, manifest);
    } catch (e) {
      caching = false;
      await removeEntry(cache, url, manifest);
      cacheWarning = isQuotaError(e)
        ? `not enough browser storage to keep ${name} (${mb(total || loaded)}): it runs now but will be downloaded again next time. Delete cached models below or free disk space.`
        : `could not keep ${name} in the browser cache (${e.message || e}): it will be downloaded again next time.`;
    }
  };

  let pending = new Uint8Array(chunkBytes);
  let fill = 0;
  try {
    await pump(
      response.body,
      async (piece) => {
        hasher?.update(piece);
        consume(onChunk, piece);
        loaded += piece.length;
        // Into whole chunks for the cache.
        let at = 0;
        while (caching && at < piece.length) {
          const n = Math.min(chunkBytes - fill, piece.length - at);
          pending.set(piece.subarray(at, at + n), fill);
          fill += n;
          at += n;
          if (fill === chunkBytes) {
            await store(pending);
            pending = new Uint8Array(chunkBytes);
            fill = 0;
          }
        }
      },
      progress,
      signal,
      stallMs,
    );
  } catch (e) {
    // Keep what arrived for the next attempt (a short last chunk is fine: chunks record their length).
    if (fill) await store(pending.slice(0, fill));
    if (signal?.aborted) throw e;
    if (e instanceof ConsumerError) throw e.cause;
    throw new DownloadError(
      `the download of ${name} was interrupted after ${mb(loaded)}${total ? ` of ${mb(total)}` : ""} (${e.message || e}) — retry to continue it`,
    );
  }
  if (total && loaded !== total) {
    if (fill) await store(pending.slice(0, fill));
    throw new DownloadError(
      `the download of ${name} was cut short: ${mb(loaded)} of ${mb(total)} arrived — retry to continue it`,
    );
  }
  if (fill) await store(pending.slice(0, fill));
  let digest = null;
  if (hasher) {
    digest = hasher.hex();
    if (digest !== wantSha) {
      if (cache) await removeEntry(cache, url, manifest);
      const whose = expected ? "the catalog expects" : "the server published";
      throw new DownloadError(
        `${name} is corrupt: its sha256 is ${digest}, ${whose} ${wantSha}; the download was removed — retry`,
      );
    }
  }
  if (caching) {
    manifest.size = loaded;
    manifest.complete = true;
    manifest.sha256 = digest;
    await writeManifest(cache, url, manifest).catch(async (e) => {
      await removeEntry(cache, url, manifest);
      cacheWarning = `could not keep ${name} in the browser cache (${e.message || e}): it will be downloaded again next time.`;
    });
  }
  return { bytes: loaded, total: loaded, fromCache: false, resumed, cacheWarning, sha256: digest };
}

/**
 * Read a stream to the end, piece by piece (`onPiece` may be async: backpressure); progress at
 * most every 50 ms and at the end. No data for `stallMs` is an error.
 */
async function pump(stream, onPiece, onProgress, signal, stallMs = STALL_MS) {
  const reader = stream.getReader();
  let last = 0;
  const onAbort = () => reader.cancel(new DOMException("aborted", "AbortError")).catch(() => {});
  signal?.addEventListener("abort", onAbort, { once: true });
  let timer = null;
  try {
    for (;;) {
      if (signal?.aborted) throw new DOMException("aborted", "AbortError");
      const stalled = new Promise((_, reject) => {
        timer = setTimeout(() => reject(new Error(`no data for ${Math.round(stallMs / 1000)} s`)), stallMs);
      });
      const { done, value } = await Promise.race([reader.read(), stalled]).finally(() => clearTimeout(timer));
      if (done) break;
      await onPiece(value);
      const now = Date.now();
      if (now - last > 50) {
        last = now;
        onProgress();
      }
    }
  } catch (e) {
    reader.cancel().catch(() => {});
    throw e;
  } finally {
    signal?.removeEventListener("abort", onAbort);
    onProgress(); // the exact count, also when it broke off
  }
}

/** The cached model files: [{url, name, bytes, stored, complete}] (partial downloads too, marked), largest first. */
export async function listCached() {
  const cache = await openCache();
  if (!cache) return [];
  const out = [];
  for (const req of await cache.keys()) {
    if (req.url.startsWith("https://nexttoken-chunks.invalid/")) continue;
    const m = await readManifest(cache, req.url);
    if (!m) continue;
    out.push({
      url: req.url,
      name: nameOf(req.url),
      bytes: m.complete ? m.size : m.storedBytes,
      size: m.size,
      stored: m.stored || "",
      complete: !!m.complete,
    });
  }
  return out.sort((a, b) => b.bytes - a.bytes);
}

export async function deleteCached(url) {
  const cache = await openCache();
  if (!cache) return false;
  const absolute = new URL(url, self.location.href).href;
  const m = await readManifest(cache, absolute);
  await removeEntry(cache, absolute, m);
  return !!m;
}

/** Whether `url` is stored whole. */
export async function isCached(url) {
  const cache = await openCache();
  if (!cache) return false;
  return !!(await readManifest(cache, new URL(url, self.location.href).href))?.complete;
}

/** Drop caches of older versions of this scheme (and the old staging cache). */
export async function dropOldCaches() {
  if (!hasCaches()) return;
  for (const name of await caches.keys()) {
    if ((name.startsWith("nexttoken-models-") && name !== MODEL_CACHE) || name.startsWith("nexttoken-staging-")) {
      await caches.delete(name);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// SHA-256, incremental (WebCrypto has no streaming digest, and the file is never whole in JS).

const K = new Uint32Array([
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98,
  0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
  0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8,
  0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
  0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819,
  0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
  0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
  0xc67178f2,
]);

export class Sha256 {
  constructor() {
    this.h = new Uint32Array([
      0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
    ]);
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
    for (let t = 0; t < 16; t++)
      w[t] = (b[o + 4 * t] << 24) | (b[o + 4 * t + 1] << 16) | (b[o + 4 * t + 2] << 8) | b[o + 4 * t + 3];
    for (let t = 16; t < 64; t++) {
      const x = w[t - 15],
        y = w[t - 2];
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
      h = g;
      g = f;
      f = e;
      e = (d + t1) | 0;
      d = c;
      c = bb;
      bb = a;
      a = (t1 + t2) | 0;
    }
    const H = this.h;
    H[0] += a;
    H[1] += bb;
    H[2] += c;
    H[3] += d;
    H[4] += e;
    H[5] += f;
    H[6] += g;
    H[7] += h;
  }
  hex() {
    const bits = this.length * 8;
    const pad = new Uint8Array((this.fill < 56 ? 56 : 120) - this.fill + 8);
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
