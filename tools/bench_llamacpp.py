#!/usr/bin/env python3
"""Prefill and decode speed of llama.cpp (through llama-cpp-python) and of `nexttoken bench` on
the same GGUF files with the same thread count, and a ratio table (nexttoken / llama.cpp).

    python3 tools/bench_llamacpp.py --threads 2 MODEL.gguf [MODEL.gguf ...]

Both sides: the same pseudo-random token ids (nexttoken's `bench_token`), prefill of 16 and 128
tokens into an empty cache, decode of --steps single tokens after filling the cache to 16 and to
1024 tokens. llama.cpp runs with its default KV cache (f16) and n_batch 512; nexttoken with its
fast CPU path (`bench --backend cpu`). Each number is the best of --repeat runs (the machine this
was written on is shared, so the best run is the least disturbed one).
"""

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench_token(i, n_vocab):
    """Same as nexttoken's timing::bench_token."""
    x = ((i * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF) >> 17
    return 3 + x % (n_vocab - 3)


def toks(start, n, vocab):
    return [bench_token(i, vocab) for i in range(start, start + n)]


def llama_cpp_bench(path, threads, prefill, contexts, steps):
    import llama_cpp

    n_ctx = max(contexts + prefill) + steps + 16
    t = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, verbose=False)
    load_s = time.perf_counter() - t
    vocab = llm.n_vocab()
    llm.eval(toks(0, 4, vocab))  # warm-up
    out = {"load_s": load_s, "prefill_tok_s": {}, "decode_tok_s": {}, "fill_tok_s": {}}
    for n in prefill:
        llm.reset()
        llm._ctx.kv_cache_clear() if hasattr(llm._ctx, "kv_cache_clear") else None
        t = time.perf_counter()
        llm.eval(toks(0, n, vocab))
        out["prefill_tok_s"][str(n)] = n / (time.perf_counter() - t)
    for ctx in contexts:
        llm.reset()
        t = time.perf_counter()
        pos = 0
        while pos < ctx:
            n = min(ctx - pos, 256)
            llm.eval(toks(pos, n, vocab))
            pos += n
        out["fill_tok_s"][str(ctx)] = ctx / (time.perf_counter() - t)
        t = time.perf_counter()
        for i in range(steps):
            llm.eval([toks(ctx + i, 1, vocab)[0]])
        out["decode_tok_s"][str(ctx)] = steps / (time.perf_counter() - t)
    return out


def nexttoken_bench(binary, path, threads, prefill, contexts, steps, isa=None):
    cmd = [binary, "bench", "--model", path, "--backend", "cpu", "--threads", str(threads), "--steps", str(steps),
           "--prefill", ",".join(map(str, prefill)), "--contexts", ",".join(map(str, contexts)), "--json"]
    if isa:
        cmd += ["--isa", isa]
    res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    r = res["results"][0]
    r["cpu"] = res.get("cpu", {})
    r["weight_bytes_per_token"] = res["weight_bytes_per_token"]
    r["memcpy_bytes_s"] = res["memcpy_bytes_s"]
    return r


def llama_cpp_version():
    try:
        import llama_cpp
        info = llama_cpp.llama_print_system_info().decode()
        return f"{llama_cpp.__version__} ({info.strip()})"
    except Exception as e:  # the table still prints without it
        return f"unknown ({e})"


def best(runs):
    """Per metric, the best (highest tok/s, lowest load time) of several runs."""
    out = {}
    for key in ("prefill_tok_s", "decode_tok_s", "fill_tok_s"):
        out[key] = {k: max(r[key][k] for r in runs) for k in runs[0][key]}
    out["load_s"] = min(r["load_s"] for r in runs)
    for key in ("cpu", "isa", "decode_streams", "threads"):  # what the runs share
        if key in runs[0]:
            out[key] = runs[0][key]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prefill", default="16,128")
    ap.add_argument("--contexts", default="16,1024")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--binary", default=os.path.join(REPO, "target/release/nexttoken"))
    ap.add_argument("--json", action="store_true", help="print the raw numbers as JSON too")
    ap.add_argument("--isa", help="nexttoken's kernels (bench --isa), e.g. avx2 to compare with a llama.cpp "
                    "built without AVX-512 (put that llama-cpp-python first on PYTHONPATH)")
    a = ap.parse_args()
    prefill = [int(x) for x in a.prefill.split(",")]
    contexts = [int(x) for x in a.contexts.split(",")]

    rows, raw = [], {}
    for path in a.models:
        ours, theirs = [], []
        for _ in range(a.repeat):  # interleave so both see the same machine load
            ours.append(nexttoken_bench(a.binary, path, a.threads, prefill, contexts, a.steps, a.isa))
            # nexttoken clamps contexts to the model's; use the ones it ran.
            p_used = sorted(int(k) for k in ours[-1]["prefill_tok_s"])
            c_used = sorted(int(k) for k in ours[-1]["decode_tok_s"])
            theirs.append(llama_cpp_bench(path, a.threads, p_used, c_used, a.steps))
        o, t = best(ours), best(theirs)
        raw[path] = {"nexttoken": o, "llama.cpp": t}
        name = os.path.basename(path)
        for n in p_used:
            k = str(n)
            rows.append((name, f"prefill {n}", o["prefill_tok_s"][k], t["prefill_tok_s"][k]))
        for c in c_used:
            k = str(c)
            rows.append((name, f"decode @{c}", o["decode_tok_s"][k], t["decode_tok_s"][k]))
        print(f"# {name}: nexttoken {json.dumps(o)}; llama.cpp {json.dumps(t)}", file=sys.stderr, flush=True)

    # The host, as nexttoken detected it, and the kernels it chose: numbers differ between hosts.
    first = next(iter(raw.values()))["nexttoken"] if raw else {}
    cpu = first.get("cpu", {})
    kernels = first.get("isa", "")
    if first.get("decode_streams"):
        kernels += " (decode in streams: Q8_0 and K-quants row by row, Q4_0/Q5_0/Q5_1 in spread tiles)"
    print(f"host: {cpu.get('model', '?')} ({cpu.get('vendor', '?')}); {' '.join(cpu.get('features', []))}")
    print(f"nexttoken kernels: {kernels}; llama.cpp: llama-cpp-python {llama_cpp_version()}")
    print(f"threads {a.threads}, best of {a.repeat}, decode steps {a.steps}")
    print()
    print("| model | test | nexttoken tok/s | llama.cpp tok/s | ratio |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, test, o, t in rows:
        print(f"| {name} | {test} | {o:.1f} | {t:.1f} | {o / t:.2f} |")
    if a.json:
        print(json.dumps(raw, indent=1))


if __name__ == "__main__":
    sys.exit(main())
