#!/usr/bin/env bash
# llama-cpp-python's OpenAI-compatible server (llama.cpp underneath), the real server the remote
# engine's tests (tests/browser/remote.mjs) talk to. PyPI has no Linux wheel of it, so pip builds
# it from source: about 3 minutes on 2 cores, once; the virtual environment stays in
# target/llama-cpp-python (LLAMA_SERVER_VENV) and later runs reuse it.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${LLAMA_SERVER_VENV:-target/llama-cpp-python}"
version=0.3.36
if "$venv/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$version')" 2>/dev/null; then
  exit 0
fi
# A compiler and Python's venv module (Debian splits it out).
missing=()
command -v g++ >/dev/null || missing+=(g++)
python3 -c "import ensurepip, venv" 2>/dev/null || missing+=(python3-venv)
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
rm -rf "$venv"
python3 -m venv "$venv"
# Only the library and the server: no examples, tests or multimodal tools; portable code (no -march=native).
CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_OPENMP=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  "$venv/bin/pip" install --quiet --disable-pip-version-check "llama-cpp-python[server]==$version"
