#!/usr/bin/env bash
# The GPU benchmark table of README.md, from a prebuilt release binary, on a machine that may have
# no Rust toolchain and no network:
#
#   cargo build --release                       # here, where Rust is
#   tools/gpu_bench.sh --pack DIR               # here: DIR gets the binary, configs, this script
#                                               #   (and libvulkan1's .deb when apt-get can fetch it)
#   DIR/gpu_bench.sh                            # there: synthesises the models, runs the table
#
# There, Vulkan may need the loader from the .deb (unpacked into DIR/vulkan) and the vendor's ICD:
#   VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json DIR/gpu_bench.sh
# Output (in DIR, or in $RESULTS where that is set, file by file as each is made): one `nexttoken
# bench --json` line per model in results.jsonl, the per-kernel profile of a decode step @16 and
# @2048 and of a 512-token prefill in profile-MODEL.txt, and a Markdown table
# (decode @16 and @2048, prefill 16/128/512, dispatches per step against the 8 per layer + 6
# budget, the weights' read rate against the GPU's measured read bandwidth), then the same models
# with NEXTTOKEN_GPU_F16=0 (f32 KV cache and f32 prefill tiles) against the default f16 path
# where the device has shader-f16 (DIR/results-f32.jsonl).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

if [[ "${1:-}" == "--pack" ]]; then
    out="${2:?usage: tools/gpu_bench.sh --pack DIR}"
    root="$(cd "$here/.." && pwd)"
    mkdir -p "$out/configs"
    cp "$root/target/release/nexttoken" "$out/"
    cp "$root/tools/gpu_bench.sh" "$out/"
    cp "$root"/../shared/configs/{SmolLM2-135M-Instruct,Qwen2.5-0.5B-Instruct,Llama-3.2-1B}.config.json \
        "$out/configs/"
    (cd "$out" && apt-get download libvulkan1 >/dev/null 2>&1) || echo "note: no libvulkan1 .deb fetched"
    echo "packed into $out: run $out/gpu_bench.sh on the GPU machine"
    exit 0
fi

bin="${NEXTTOKEN:-$here/nexttoken}"
[[ -x "$bin" ]] || bin="$(cd "$here/.." && pwd)/target/release/nexttoken"
configs="$here/configs"
[[ -d "$configs" ]] || configs="$(cd "$here/../.." && pwd)/shared/configs"
models="${MODELS:-$here/models}"
results="${RESULTS:-$here}"
mkdir -p "$models" "$results"

# A Vulkan loader shipped beside the script (a machine with the driver but no loader).
deb="$(ls "$here"/libvulkan1_*.deb 2>/dev/null | head -1 || true)"
if [[ -n "$deb" ]] && ! ldconfig -p | grep -q libvulkan.so.1; then
    mkdir -p "$here/vulkan"
    dpkg -x "$deb" "$here/vulkan"
    export LD_LIBRARY_PATH="$here/vulkan/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
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
}

: > "$results/results.jsonl"
: > "$results/results-f32.jsonl"
run smollm2-135m-q8_0 SmolLM2-135M-Instruct q8_0
run qwen2.5-0.5b-q4_0 Qwen2.5-0.5B-Instruct q4_0
run llama-3.2-1b-q4_0 Llama-3.2-1B q4_0
run llama-3.2-1b-f16 Llama-3.2-1B f16

python3 - "$results/results.jsonl" "$results/results-f32.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
f32_rows = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
print("| model | decode @16 | decode @2048 | prefill 16 / 128 / 512 | weights GB/s @16 (of GPU read) | dispatches/step (budget) |")
print("| --- | ---: | ---: | --- | ---: | ---: |")
for r in rows:
    g = r["results"][0]
    d, p = g["decode_tok_s"], g["prefill_tok_s"]
    bw = g["weight_bandwidth_bytes_s"].get("16", 0)
    ref = g.get("read_bytes_s") or 1
    name = r["model"].rsplit("/", 1)[-1]
    print(f"| {name} | {d.get('16', 0):.0f} | {d.get('2048', 0):.0f} | "
          f"{p.get('16', 0):.0f} / {p.get('128', 0):.0f} / {p.get('512', 0):.0f} | "
          f"{bw / 1e9:.0f} ({100 * bw / ref:.0f}% of {ref / 1e9:.0f}) | "
          f"{g.get('dispatches_per_step')} ({g.get('dispatch_budget')}) |")
print()
print("| model | f16 path (KV, prefill tiles) | prefill 128 / 512: f16 / f32 | decode @16 / @2048: f16 / f32 |")
print("| --- | --- | --- | --- |")
for r, f in zip(rows, f32_rows):
    g, h = r["results"][0], f["results"][0]
    d, p, d32, p32 = g["decode_tok_s"], g["prefill_tok_s"], h["decode_tok_s"], h["prefill_tok_s"]
    name = r["model"].rsplit("/", 1)[-1]
    ratio = lambda a, b, k: f"{a.get(k, 0) / max(b.get(k, 0), 1e-9):.2f}x"
    print(f"| {name} | {g.get('f16_kv')}, {g.get('f16_prefill')} | "
          f"{ratio(p, p32, '128')} / {ratio(p, p32, '512')} | "
          f"{ratio(d, d32, '16')} / {ratio(d, d32, '2048')} |")
PY
