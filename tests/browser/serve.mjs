// A small static file server for www/ (used by `./build.sh serve` and the browser tests).
//   node tests/browser/serve.mjs ROOT [PORT]
// or import { serve } and pass extra routes: serve(root, port, { "/prefix/": otherDir }).
// Correct MIME types (application/wasm for streaming compilation), no-cache so edits show up
// (the service worker does the caching), and nothing outside the served folders.
// Pages are cross-origin isolated (COOP same-origin + COEP require-corp), so they may use
// SharedArrayBuffer and load the wasm threads build; a page requested with `?isolate=0` is not
// (how the tests check the one-thread fallback); `isolate: false` turns it off for everything.
// Every answer allows CORS (a CDN's) and Cross-Origin-Resource-Policy: cross-origin (so an
// isolated page of another origin may embed it) unless `cors: false`; `headers` adds more (a CSP).
import http from "node:http";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

const TYPES = {
  ".html": "text/html; charset=utf-8",
  ".js": "text/javascript; charset=utf-8",
  ".mjs": "text/javascript; charset=utf-8",
  ".css": "text/css; charset=utf-8",
  ".json": "application/json; charset=utf-8",
  ".wasm": "application/wasm",
  ".gguf": "application/octet-stream",
  ".svg": "image/svg+xml",
  ".png": "image/png",
  ".ico": "image/x-icon",
  ".txt": "text/plain; charset=utf-8",
  ".md": "text/markdown; charset=utf-8",
  ".webmanifest": "application/manifest+json",
};

/** Start serving. `mounts` maps URL prefixes ("/shared/") to extra folders; `handler(req, res)`
 * may answer a request itself (returning true). Resolves to the server. */
export function serve(
  root,
  port = 0,
  mounts = {},
  { host = "127.0.0.1", quiet = true, handler = null, isolate = true, cors = true, headers: extra = {} } = {},
) {
  root = path.resolve(root);
  const server = http.createServer((req, res) => {
    if (handler?.(req, res)) return;
    let url;
    try {
      url = new URL(req.url, "http://x");
    } catch {
      res.writeHead(400).end();
      return;
    }
    let pathname = decodeURIComponent(url.pathname);
    let base = root;
    for (const [prefix, dir] of Object.entries(mounts)) {
      if (pathname.startsWith(prefix)) {
        base = path.resolve(dir);
        pathname = `/${pathname.slice(prefix.length)}`;
        break;
      }
    }
    let file = path.join(base, pathname);
    if (!file.startsWith(base)) {
      res.writeHead(403).end("forbidden");
      return;
    }
    fs.stat(file, (err, st) => {
      if (!err && st.isDirectory()) {
        file = path.join(file, "index.html");
        try {
          st = fs.statSync(file);
        } catch (e) {
          err = e;
        }
      }
      if (err || !st.isFile()) {
        if (!quiet) console.log(`404 ${req.url}`);
        res.writeHead(404, { "content-type": "text/plain" }).end("not found");
        return;
      }
      const type = TYPES[path.extname(file).toLowerCase()] || "application/octet-stream";
      const headers = {
        "content-type": type,
        "content-length": st.size,
        "cache-control": "no-cache",
        ...(cors && { "access-control-allow-origin": "*", "cross-origin-resource-policy": "cross-origin" }),
        ...extra,
      };
      if (isolate && url.searchParams.get("isolate") !== "0") {
        headers["cross-origin-opener-policy"] = "same-origin";
        headers["cross-origin-embedder-policy"] = "require-corp";
      }
      if (req.method === "HEAD") {
        res.writeHead(200, headers).end();
        return;
      }
      res.writeHead(200, headers);
      fs.createReadStream(file).pipe(res);
      if (!quiet) console.log(`200 ${req.url}`);
    });
  });
  return new Promise((resolve, reject) => {
    server.once("error", reject);
    server.listen(port, host, () => resolve(server));
  });
}

if (process.argv[1] && fileURLToPath(import.meta.url) === path.resolve(process.argv[1])) {
  const root = process.argv[2] || "www";
  const port = Number(process.argv[3] || process.env.PORT || 8080);
  const server = await serve(root, port, {}, { quiet: false, isolate: process.env.ISOLATE !== "0" });
  const { port: p } = server.address();
  console.log(`serving ${path.resolve(root)} on http://127.0.0.1:${p}/`);
}
