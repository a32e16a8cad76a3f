#!/usr/bin/env bash
# Build the browser app: the crate for wasm32 (release, SIMD) + wasm-bindgen into www/pkg/,
# then wasm-opt when npm's binaryen is installed; and the threads build into www/pkg-threads/
# (nightly Rust, +atomics, std rebuilt: shared memory, rayon on Web Workers), which pages that are
# cross-origin isolated load instead; and each again with relaxed-simd (www/pkg-relaxed/,
# www/pkg-threads-relaxed/: the int8 tiles through its byte dot product), which browsers that
# validate relaxed-simd load instead (www/wasm.js picks; a browser downloads one build).
#
#   ./build.sh          build www/pkg/ and www/pkg-threads/
#   ./build.sh serve    build, then serve www/ on http://127.0.0.1:8080 (PORT=... to change)
#   ./build.sh test     build, then run the browser tests (tests/browser/run.mjs)
#
# Installs what is missing: the wasm32 rustup target, wasm-bindgen-cli at exactly the version
# of the wasm-bindgen crate in Cargo.lock, and the npm packages under tests/browser/
# (playwright-core, binaryen); for the threads build, the pinned nightly toolchain ($NIGHTLY below)
# with rust-src, beside any other nightly (a plain `nightly` toolchain is neither used nor updated).
# NO_WASM_OPT=1 skips wasm-opt; NO_THREADS=1 skips the threads builds (www/pkg-threads*/ are
# removed, and pages run one thread); NO_RELAXED=1 skips the relaxed-simd builds (removed; pages
# run simd128).
set -euo pipefail
cd "$(dirname "$0")"

# The nightly of the threads build, pinned by date so a build is reproducible and never upgrades
# the user's nightly (nightly-DATE holds the rustc committed the day before DATE). Change it here.
NIGHTLY=nightly-2026-05-20

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target/wasm}"
TARGET=wasm32-unknown-unknown
OUT=www/pkg

log() { printf '\033[1m[build]\033[0m %s\n' "$*" >&2; }

# -- tools -------------------------------------------------------------------------------------
if command -v rustup >/dev/null && ! rustup target list --installed | grep -qx "$TARGET"; then
  log "adding rustup target $TARGET"
  rustup target add "$TARGET"
fi

# wasm-bindgen's CLI must match the crate exactly (the generated glue is version-specific).
WB_VERSION=$(awk '/^name = "wasm-bindgen"$/ { getline; gsub(/version = |"/, ""); print; exit }' Cargo.lock 2>/dev/null || true)
if [ -z "$WB_VERSION" ]; then
  cargo generate-lockfile >/dev/null 2>&1 || true
  WB_VERSION=$(awk '/^name = "wasm-bindgen"$/ { getline; gsub(/version = |"/, ""); print; exit }' Cargo.lock)
fi
have_wb=$(wasm-bindgen --version 2>/dev/null | awk '{print $2}' || true)
if [ "$have_wb" != "$WB_VERSION" ]; then
  log "installing wasm-bindgen-cli $WB_VERSION (found: ${have_wb:-none}; takes a few minutes)"
  cargo install wasm-bindgen-cli --version "$WB_VERSION"
fi

if [ ! -d tests/browser/node_modules ] && command -v npm >/dev/null; then
  log "installing npm packages in tests/browser (playwright-core, binaryen)"
  (cd tests/browser && npm install --no-audit --no-fund --loglevel=error) || log "npm install failed: wasm-opt and the browser tests will be unavailable"
fi

# -- build -------------------------------------------------------------------------------------
WASM_OPT=tests/browser/node_modules/.bin/wasm-opt

# wasm-bindgen then wasm-opt: `bindgen WASM OUT [extra wasm-opt flags]`.
bindgen() {
  # No snippets left from an older build's dependencies.
  rm -rf "$2/snippets"
  mkdir -p "$2"
  log "wasm-bindgen --target web -> $2/"
  wasm-bindgen --target web --no-typescript --out-dir "$2" "$1"
  if [ -z "${NO_WASM_OPT:-}" ] && [ -x "$WASM_OPT" ]; then
    log "wasm-opt -O3 (npm binaryen) $2/"
    "$WASM_OPT" -O3 --enable-simd --enable-relaxed-simd --enable-bulk-memory --enable-nontrapping-float-to-int \
      --enable-sign-ext --enable-mutable-globals --enable-reference-types --enable-multivalue "${@:3}" \
      "$2/nexttoken_bg.wasm" -o "$2/nexttoken_bg.opt.wasm"
    mv "$2/nexttoken_bg.opt.wasm" "$2/nexttoken_bg.wasm"
  else
    log "wasm-opt skipped (npm binaryen not installed or NO_WASM_OPT set)"
  fi
}

# An 8 MB stack (the default is 1 MB): compiling a stranger's grammar or schema recurses, and
# the limits in src/constraint.rs are set for this much (natively such work runs on a 64 MB
# thread of its own).
STACK="-C link-arg=-zstack-size=8388608"
# One build: `build FEATURES OUT` (FEATURES: "simd128" or "simd128,relaxed-simd").
build() {
  local dir="$CARGO_TARGET_DIR${1#simd128}"
  dir="${dir//,/-}"
  log "cargo build --release --target $TARGET ($1) -> $2/"
  RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+${1//,/,+} $STACK" CARGO_TARGET_DIR="$dir" \
    cargo build --release --lib --target "$TARGET"
  bindgen "$dir/$TARGET/release/nexttoken.wasm" "$2"
}

# The threads build of FEATURES into OUT: std must be rebuilt with atomics (nightly -Z build-std);
# the memory is imported and shared (so Web Workers can run on it), up to wasm32's 4 GiB.
build_threads() {
  local dir="$CARGO_TARGET_DIR-threads${1#simd128}"
  dir="${dir//,/-}"
  log "cargo +$NIGHTLY build --release --target $TARGET ($1, atomics: the threads build) -> $2/"
  RUSTFLAGS="-C target-feature=+atomics,+bulk-memory,+mutable-globals,+${1//,/,+} $STACK -C link-arg=--shared-memory \
-C link-arg=--max-memory=4294967296 -C link-arg=--import-memory -C link-arg=--export=__wasm_init_tls \
-C link-arg=--export=__tls_size -C link-arg=--export=__tls_align -C link-arg=--export=__tls_base" \
  CARGO_TARGET_DIR="$dir" \
    cargo "+$NIGHTLY" build --release --lib --target "$TARGET" -Z build-std=panic_abort,std 2>&1 |
    # rustc warns for every crate that +atomics is an unstable target feature: it is, and it is
    # what wasm threads are made of (the reason for nightly here), so the warning says nothing.
    # The filter drops that warning, its note, and a crate's "generated 1 warning" when it was the one.
    awk '/unstable feature specified for `-Ctarget-feature`: `atomics`/ { skip = 1; hidden = 1; next }
         skip && /^ *(=|[|]|$)/ { next }
         { skip = 0 }
         /^warning: `.*` \(lib\) generated 1 warning$/ && hidden { hidden = 0; next }
         /^warning: / { hidden = 0 }
         { print }' >&2
  bindgen "$dir/$TARGET/release/nexttoken.wasm" "$2" --enable-threads
}

build simd128 "$OUT"
if [ -n "${NO_RELAXED:-}" ]; then
  rm -rf www/pkg-relaxed www/pkg-threads-relaxed
else
  build simd128,relaxed-simd www/pkg-relaxed
fi

THREADS_OUT=www/pkg-threads
if [ -n "${NO_THREADS:-}" ]; then
  rm -rf "$THREADS_OUT" www/pkg-threads-relaxed
else
  if ! rustup run "$NIGHTLY" rustc --version >/dev/null 2>&1 || ! rustup component list --toolchain "$NIGHTLY" --installed 2>/dev/null | grep -q '^rust-src'; then
    log "installing $NIGHTLY with rust-src (for the wasm threads build)"
    rustup toolchain install "$NIGHTLY" --profile minimal --component rust-src --target "$TARGET"
  fi
  build_threads simd128 "$THREADS_OUT"
  [ -n "${NO_RELAXED:-}" ] || build_threads simd128,relaxed-simd www/pkg-threads-relaxed
fi

# A build id for the service worker's cache name: a new build replaces the cached app shell.
BUILD_ID=$({ cat "$OUT/nexttoken_bg.wasm" "$OUT/nexttoken.js" www/*.js www/*.html www/*.css; cat www/pkg-*/*.wasm 2>/dev/null || true; } | sha256sum | cut -c1-12)
printf 'self.NEXTTOKEN_BUILD = "%s";\n' "$BUILD_ID" > "$OUT/build-id.js"
log "done: $(du -h "$OUT/nexttoken_bg.wasm" | cut -f1) $OUT/nexttoken_bg.wasm (build $BUILD_ID)"

case "${1:-}" in
  serve)
    PORT="${PORT:-8080}"
    log "serving www/ on http://127.0.0.1:$PORT/  (Ctrl-C to stop)"
    exec node tests/browser/serve.mjs www "$PORT"
    ;;
  test)
    exec node tests/browser/run.mjs
    ;;
  "") ;;
  *) echo "usage: $0 [serve|test]" >&2; exit 2 ;;
esac
