#!/usr/bin/env bash
# The GPU's correctness and speed on a real GPU, from prebuilt binaries, on a machine that may
# have no Rust toolchain and no network (docs/gpu.md has the H200's numbers it produced):
#
#   cargo build --release                       # here, where Rust is
#   tools/gpu_bench.sh --pack DIR               # here: DIR gets the CLI, the GPU test binary and
#                                               #   the files it reads, the configs, this script,
#                                               #   and the Vulkan loader's .debs (apt-get download)
#   DIR/gpu_bench.sh                            # there
#
# There, the loader and the libraries NVIDIA's Vulkan driver loads (libglvnd, X11 client
# libraries) are unpacked from the .debs into DIR/vulkan where the system lacks them, and
# VK_DRIVER_FILES defaults to NVIDIA's ICD when that file exists. First the GPU tests
# (tests/gpu.rs: every kernel and whole models against the CPU oracle) run on the real GPU
# (tests.log; a failure stops the script), then the models are synthesised from the configs and
# measured. Output (in DIR, or in $RESULTS where that is set, file by file as each is made): one
# `nexttoken bench --json` line per model in results.jsonl (decode @16 and @2048, prefill
# 16/128/512, the GPU's time per decode step from timestamps and chained decode), the per-kernel
# profile of a decode step @16 and @2048 and of a 512-token prefill in profile-MODEL.txt, the
# same models with NEXTTOKEN_GPU_F16=0 (f32 KV cache and f32 prefill tiles) in
# results-f32.jsonl, the CPU path on the same machine (every core) in results-cpu.jsonl, and
# Markdown tables of all of it on stdout.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
debs=(libvulkan1 libglvnd0 libgl1 libglx0 libegl1 libopengl0 libgles2 libx11-6 libxext6 libxcb1
    libxau6 libxdmcp6 libbsd0 libmd0)

if [[ "${1:-}" == "--pack" ]]; then
    out="${2:?usage: tools/gpu_bench.sh --pack DIR}"
    root="$(cd "$here/.." && pwd)"
    mkdir -p "$out/configs" "$out/debs" "$out/shared/models"
    cp "$root/target/release/nexttoken" "$out/"
    cp "$root/tools/gpu_bench.sh" "$out/"
    cp "$root"/../shared/configs/{SmolLM2-135M-Instruct,Qwen2.5-0.5B-Instruct,Llama-3.2-1B}.config.json \
        "$out/configs/"
    # The GPU tests, built as release (the binary finds ../shared through NEXTTOKEN_SHARED).
    tests="$(cd "$root" && cargo test --release --test gpu --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu" and m.get("executable"):
        print(m["executable"])')"
    cp "$tests" "$out/gpu-tests"
    cp -r "$root/../shared/models/stories260K" "$out/shared/models/"
    (cd "$out/debs" && apt-get download "${debs[@]}" >/dev/null 2>&1) ||
        echo "note: not every .deb was fetched (${debs[*]}): the GPU machine must have them"
    echo "packed into $out ($(du -sh "$out" | cut -f1)): run $out/gpu_bench.sh on the GPU machine"
    exit 0
fi

bin="${NEXTTOKEN:-$here/nexttoken}"
[[ -x "$bin" ]] || bin="$(cd "$here/.." && pwd)/target/release/nexttoken"
configs="$here/configs"
[[ -d "$configs" ]] || configs="$(cd "$here/../.." && pwd)/shared/configs"
models="${MODELS:-$here/models}"
results="${RESULTS:-$here}"
mkdir -p "$models" "$results"

# The Vulkan loader and what NVIDIA's driver loads, where the system lacks them.
if ! ldconfig -p | grep -q libvulkan.so.1 && ls "$here"/debs/*.deb >/dev/null 2>&1; then
    mkdir -p "$here/vulkan"
    for deb in "$here"/debs/*.deb; do dpkg -x "$deb" "$here/vulkan"; done
    export LD_LIBRARY_PATH="$here/vulkan/usr/lib/x86_64-linux-gnu:$here/vulkan/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
nvidia_icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [[ -z "${VK_DRIVER_FILES:-}" && -f "$nvidia_icd" ]]; then
    export VK_DRIVER_FILES="$nvidia_icd"
fi

if [[ -x "$here/gpu-tests" ]]; then
    NEXTTOKEN_REQUIRE_GPU=1 NEXTTOKEN_REQUIRE_SHARED=1 NEXTTOKEN_SHARED="$here/shared" \
        "$here/gpu-tests" --test-threads 4 > "$results/tests.log" 2>&1 ||
        { tail -30 "$results/tests.log"; echo "the GPU tests failed: no timings"; exit 1; }
    grep "test result" "$results/tests.log" >&2
fi

run() { # name config type
    local file="$models/$1.gguf"
    [[ -f "$file" ]] || "$bin" synth --config "$configs/$2.config.json" --type "$3" --out "$file" >/dev/null
    "$bin" bench --model "$file" --backend gpu --prefill 16,128,512 --contexts 16,2048 \
        --steps "${STEPS:-32}" --json | tee -a "$results/results.jsonl" >/dev/null
    # The per-kernel profile (timestamp queries) of one step at each context and of a
    # 512-token prefill, kept beside.
    "$bin" bench --model "$file" --backend gpu --prefill 512 --contexts 16,2048 --steps 2 \
        --profile > "$results/profile-$1.txt"
    grep -E "device|per step|GPU read" "$results/profile-$1.txt" | sed "s/^/  $1: /" >&2
    # The f32 path on the same model: what f16 (KV cache, prefill tiles) buys.
    NEXTTOKEN_GPU_F16=0 "$bin" bench --model "$file" --backend gpu --prefill 128,512 \
        --contexts 16,2048 --steps "${STEPS:-32}" --json | tee -a "$results/results-f32.jsonl" >/dev/null
    # The CPU path on the same machine, every core: which backend is faster where.
    "$bin" bench --model "$file" --backend cpu --prefill 16,128,512 --contexts 16 --steps 16 \
        --json | tee -a "$results/results-cpu.jsonl" >/dev/null
}

: > "$results/results.jsonl"
: > "$results/results-f32.jsonl"
: > "$results/results-cpu.jsonl"
run smollm2-135m-q8_0 SmolLM2-135M-Instruct q8_0
run qwen2.5-0.5b-q4_0 Qwen2.5-0.5B-Instruct q4_0
run llama-3.2-1b-q4_0 Llama-3.2-1B q4_0
run llama-3.2-1b-f16 Llama-3.2-1B f16

python3 - "$results/results.jsonl" "$results/results-f32.jsonl" "$results/results-cpu.jsonl" <<'PY'
import json, sys
load = lambda f: [json.loads(l) for l in open(f) if l.strip()]
rows, f32_rows, cpu_rows = (load(f) for f in sys.argv[1:4])
name = lambda r: r["model"].rsplit("/", 1)[-1]
print("| model | decode @16 | decode @2048 | prefill 16 / 128 / 512 | GPU µs per step @16 / @2048 | chained decode @16 | weights GB/s @16 (of GPU read) | dispatches/step (budget) |")
print("| --- | ---: | ---: | --- | --- | ---: | ---: | ---: |")
for r in rows:
    g = r["results"][0]
    d, p = g["decode_tok_s"], g["prefill_tok_s"]
    us = g.get("gpu_step_us") or {}
    chained = (g.get("chained_decode_tok_s") or {}).get("16") or 0
    bw = g["weight_bandwidth_bytes_s"].get("16", 0)
    ref = g.get("read_bytes_s") or 1
    print(f"| {name(r)} | {d.get('16', 0):.0f} | {d.get('2048', 0):.0f} | "
          f"{p.get('16', 0):.0f} / {p.get('128', 0):.0f} / {p.get('512', 0):.0f} | "
          f"{us.get('16') or 0:.0f} / {us.get('2048') or 0:.0f} | {chained:.0f} | "
          f"{bw / 1e9:.0f} ({100 * bw / ref:.0f}% of {ref / 1e9:.0f}) | "
          f"{g.get('dispatches_per_step')} ({g.get('dispatch_budget')}) |")
print()
print("| model | f16 path (KV, prefill tiles) | prefill 128 / 512: f16 / f32 | decode @16 / @2048: f16 / f32 |")
print("| --- | --- | --- | --- |")
for r, f in zip(rows, f32_rows):
    g, h = r["results"][0], f["results"][0]
    d, p, d32, p32 = g["decode_tok_s"], g["prefill_tok_s"], h["decode_tok_s"], h["prefill_tok_s"]
    ratio = lambda a, b, k: f"{a.get(k, 0) / max(b.get(k, 0), 1e-9):.2f}x"
    print(f"| {name(r)} | {g.get('f16_kv')}, {g.get('f16_prefill')} | "
          f"{ratio(p, p32, '128')} / {ratio(p, p32, '512')} | "
          f"{ratio(d, d32, '16')} / {ratio(d, d32, '2048')} |")
print()
print("| model | CPU threads | CPU decode @16 | GPU decode @16 | CPU prefill 512 | GPU prefill 512 |")
print("| --- | ---: | ---: | ---: | ---: | ---: |")
for r, c in zip(rows, cpu_rows):
    g, h = r["results"][0], c["results"][0]
    print(f"| {name(r)} | {h.get('threads')} | {h['decode_tok_s'].get('16', 0):.0f} | "
          f"{g['decode_tok_s'].get('16', 0):.0f} | {h['prefill_tok_s'].get('512', 0):.0f} | "
          f"{g['prefill_tok_s'].get('512', 0):.0f} |")
PY
