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

// The wasm threads build (only used by cross-origin isolated pages; absent with NO_THREADS=1):
// cached when present, and anything else under pkg-threads/ as it is fetched.
const OPTIONAL = ["pkg-threads/nexttoken.js", "pkg-threads/nexttoken_bg.wasm"];

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
  return rel === "" || SHELL.includes(rel) || rel.startsWith("pkg-threads/");
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
