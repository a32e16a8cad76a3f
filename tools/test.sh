#!/usr/bin/env bash
# Runs every test of the project: the README's test command, also what CI runs (.ci/run).
# Installs what it needs itself, so it works on a fresh Debian machine with rustup and cargo.
set -euo pipefail
cd "$(dirname "$0")/.."

# Mesa's software Vulkan (lavapipe) runs the real WGSL kernels where no GPU exists; Debian's
# Chromium runs the browser tests (WebGPU through SwiftShader with --enable-unsafe-webgpu), and
# Debian's Firefox ESR and WebKitGTK (Safari's engine: MiniBrowser under Xvfb, driven by
# WebKitWebDriver) the CPU-path ones again.
missing=()
for pkg in mesa-vulkan-drivers libvulkan1 chromium firefox-esr webkit2gtk-driver xvfb xauth; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
# Vulkan loaders warn without a private runtime folder.
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp/nexttoken-xdg-$(id -u)}"
mkdir -p -m 700 "$XDG_RUNTIME_DIR"

# Formatting and lints first: rustfmt (rustfmt.toml), then clippy with warnings as errors, natively
# (every target: lib, CLI, tests, benches) and for wasm32 with simd128 and relaxed-simd, as
# build.sh compiles its relaxed build (a superset of the simd128 build's code).
# The threads build (nightly, +atomics) compiles the same code with rayon, plus src/web/pool.rs (the
# pool's start); not linted here, since a -Z build-std clippy costs minutes of CI. By hand:
#   RUSTFLAGS="-C target-feature=+atomics,+bulk-memory,+mutable-globals,+simd128" CARGO_TARGET_DIR=target/wasm-threads-clippy \
#   cargo +nightly-2026-05-20 clippy --release --lib --target wasm32-unknown-unknown -Z build-std=panic_abort,std -- -D warnings
for component in rustfmt clippy; do
  rustup component list --installed | grep -q "^$component" || rustup component add "$component"
done
rustup target list --installed | grep -qx wasm32-unknown-unknown || rustup target add wasm32-unknown-unknown
cargo fmt --check
cargo clippy --all-targets -- -D warnings
RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+simd128,+relaxed-simd" \
  cargo clippy --lib --target wasm32-unknown-unknown -- -D warnings

# The JavaScript (www/, tests/browser/) formatted and linted by Biome (biome.jsonc says which rules
# and why); `tests/browser/node_modules/.bin/biome check --write` fixes what it can. The npm packages
# (Biome, Playwright, binaryen, TypeScript) go to tests/browser/node_modules, which build.sh also uses.
if [ ! -x tests/browser/node_modules/.bin/biome ]; then
  (cd tests/browser && npm ci --no-audit --no-fund --loglevel=error)
fi
tests/browser/node_modules/.bin/biome ci --error-on-warnings www tests/browser

# No test touches the network: models are committed under tests/fixtures and www/models, or read
# from ../shared (skipped loudly when absent, unless NEXTTOKEN_REQUIRE_SHARED=1 as in CI).
cargo build --all-targets
cargo test --all-targets -- --test-threads=2
# Both decode walks (kernels::decode_walk: long streams on AMD Zen 4, adjacent tiles elsewhere)
# against the exact path, whichever this host picks.
if [ "$(uname -m)" = x86_64 ]; then
  for walk in streams tiles; do
    NEXTTOKEN_DECODE_WALK=$walk cargo test --test cpu_kernels fast_path -- --test-threads=2
  done
fi

# The aarch64 NEON kernels, run for real: tests/cpu_kernels.rs cross-built for aarch64 (Debian's
# cross gcc links it) and run under qemu-user, which emulates NEON. qemu runs the test on the
# host's files, so ../shared is found as natively. NEXTTOKEN_REQUIRE_ISA fails the run if NEON
# is not detected, rather than letting scalar pass against itself. The cross-test profile (Cargo.toml)
# optimises the crate as release does but not its dependencies, which the test does not use.
test_aarch64() {
  local missing=()
  for pkg in qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  fi
  rustup target list --installed | grep -qx aarch64-unknown-linux-gnu || rustup target add aarch64-unknown-linux-gnu
  CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
    CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu" \
    NEXTTOKEN_REQUIRE_ISA=neon \
    cargo test --profile cross-test --target aarch64-unknown-linux-gnu --test cpu_kernels -- --test-threads=2
}
test_aarch64

# The browser app: wasm build (installs wasm-bindgen-cli, npm playwright-core and binaryen when
# missing), then Playwright drives headless Chromium with and without WebGPU. The expected texts
# come from the native CLI built above.
./build.sh test

# The CPU-path browser checks again in Firefox (puppeteer-core over WebDriver BiDi): the app, the
# element, the Cache API and offline; Firefox has no WebGPU here, so the CPU path must be chosen.
node tests/browser/firefox.mjs

# And in WebKit (WebKitGTK's MiniBrowser over plain WebDriver; no WebGPU there either): as shipped
# (one thread: SharedArrayBuffer is off, and the stats say so) and with JSC_useSharedArrayBuffer=true
# (the threads build).
node tests/browser/webkit.mjs

# The remote engine (www/remote.js) against a real llama.cpp server: llama-cpp-python's, built from
# source once into target/llama-cpp-python (about 3 minutes on 2 cores; PyPI has no Linux wheel),
# serving stories260K on the loopback address; its tokens are compared with the local engine's.
tools/llama_server.sh
node tests/browser/remote.mjs

# The browser benchmark (www/bench.html) for the wasm CPU path, WebGPU (SwiftShader here) and
# wllama (llama.cpp in wasm) on the same file: prints numbers, asserts only that each run produced them.
node tests/browser/bench.mjs
