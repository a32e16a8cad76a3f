// Service worker: keeps the app shell (pages, scripts, the wasm engine, the lesson tables) so the
// site works offline after the first visit. Network first (so a new build shows up at once),
// the cache when the network fails. Model files are not handled here: the worker caches them
// itself (model-cache.js), only once complete.
importScripts("pkg/build-id.js"); // sets self.NEXTTOKEN_BUILD (written by build.sh)

const SHELL_CACHE = `nexttoken-shell-${self.NEXTTOKEN_BUILD || "dev"}`;
const SHELL = [
  "./",
  "index.html",
  "embed.html",
  "style.css",
  "favicon.svg",
  "app.js",
  "nexttoken.js",
  "openai.js",
  "remote.js",
  "next-token.js",
  "views.js",
  "recording.js",
  "model-cache.js",
  "worker.js",
  "wasm.js",
  "pool.js",
  "pool-worker.js",
  "pkg/nexttoken.js",
  "pkg/nexttoken_bg.wasm",
  "pkg/build-id.js",
  "models/lesson-toy.json",
  "models/lesson-beam.json",
  "models/lesson-perplexity.json",
  "models/default-recording.jsonl",
];

// The other wasm builds this browser would run (wasm.js picks): the threads build (cross-origin
// isolated pages; absent with NO_THREADS=1), each as its relaxed-simd twin where this browser
// validates relaxed-simd (absent with NO_RELAXED=1); cached when present, and anything else
// under pkg-*/ as it is fetched. pkg/ (in SHELL) is every build's fallback.
const OPTIONAL = (relaxedSimd() ? ["pkg-relaxed", "pkg-threads-relaxed"] : ["pkg-threads"]).flatMap((dir) => [
  `${dir}/nexttoken.js`,
  `${dir}/nexttoken_bg.wasm`,
]);

/** wasm.js's relaxedSimd() (this script is not a module): i16x8.relaxed_dot_i8x16_i7x16_s validates. */
function relaxedSimd() {
  const v128 = [0xfd, 0x0c, ...new Array(16).fill(0)];
  const body = [0x00, ...v128, ...v128, 0xfd, 0x92, 0x02, 0x0b];
  const head = [0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00, 0x01, 0x05, 0x01, 0x60, 0x00, 0x01, 0x7b];
  const bytes = [...head, 0x03, 0x02, 0x01, 0x00, 0x0a, body.length + 2, 0x01, body.length, ...body];
  try {
    return WebAssembly.validate(new Uint8Array(bytes));
  } catch {
    return false;
  }
}

self.addEventListener("install", (event) => {
  event.waitUntil(
    caches
      .open(SHELL_CACHE)
      .then(async (cache) => {
        await cache.addAll(SHELL.map((p) => new Request(p, { cache: "no-cache" })));
        await Promise.all(OPTIONAL.map((p) => cache.add(new Request(p, { cache: "no-cache" })).catch(() => {})));
      })
      .then(() => self.skipWaiting()),
  );
});

self.addEventListener("activate", (event) => {
  event.waitUntil(
    caches
      .keys()
      .then((names) =>
        Promise.all(
          names.filter((n) => n.startsWith("nexttoken-shell-") && n !== SHELL_CACHE).map((n) => caches.delete(n)),
        ),
      )
      .then(() => self.clients.claim()),
  );
});

function isShell(url) {
  if (url.origin !== self.location.origin) return false;
  const scope = new URL(self.registration.scope);
  if (!url.pathname.startsWith(scope.pathname)) return false;
  const rel = url.pathname.slice(scope.pathname.length);
  return rel === "" || SHELL.includes(rel) || /^pkg-(threads|relaxed|threads-relaxed)\//.test(rel);
}

self.addEventListener("fetch", (event) => {
  const req = event.request;
  if (req.method !== "GET") return;
  const url = new URL(req.url);
  if (!isShell(url)) return; // models and everything else: straight to the network
  event.respondWith(
    (async () => {
      const cache = await caches.open(SHELL_CACHE);
      try {
        const res = await fetch(req, { cache: "no-cache" });
        if (res.ok) {
          cache.put(req, res.clone()).catch(() => {});
          return res;
        }
        const cached = await cache.match(req, { ignoreSearch: true });
        return cached || res;
      } catch (e) {
        const cached = await cache.match(req, { ignoreSearch: true });
        if (cached) return cached;
        throw e;
      }
    })(),
  );
});
