#!/usr/bin/env python3
"""Train nexttoken's small default language model (issue 5) and ship it.

A ~2M-parameter llama-architecture decoder (transformers `LlamaForCausalLM`, float32, CPU, plain PyTorch
loop: next-token prediction with teacher forcing under the causal mask) trained on the King James Bible
as shipped by Debian's `bible-kjv-text` package (text public domain; package software GPL-2+).

Writes
  www/models/default.gguf                       Q8_0 GGUF made by llama.cpp's own convert_hf_to_gguf.py
  www/models/default-tokenizer.json             the BPE tokenizer (sentencepiece-like, byte fallback)
  www/models/README.md                          model card (numbers + samples filled in by this script)
  www/models/loss.png                           loss curve
  tests/fixtures/default_model/reference.json   transformers logits/greedy ids of the EXPORTED weights

Exact command (repository root; ~20 min on 1 shared CPU core; see www/models/README.md):

    apt-get download bible-kjv bible-kjv-text      # done by the script itself into --corpus-dir
    cargo build --release                          # for the sample outputs in the card
    python3 tools/train_default_model.py --llama-cpp-dir /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp

Options: --from-checkpoint (skip training, reuse <workdir>/hf + <workdir>/train_log.json),
--steps N, --threads N, --no-samples.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "www" / "models"
FIX = REPO / "tests" / "fixtures" / "default_model"
DEFAULT_LCPP = "/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp"

ap = argparse.ArgumentParser()
ap.add_argument("--llama-cpp-dir", default=DEFAULT_LCPP)
ap.add_argument("--corpus-dir", default="/tmp/kjv", help="where the two .deb files are downloaded/unpacked")
ap.add_argument("--workdir", default="/tmp/nexttoken_default_model")
ap.add_argument("--steps", type=int, default=1000)
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--eval-every", type=int, default=125)
ap.add_argument("--max-minutes", type=float, default=21.0, help="safety stop (the card says if it fired)")
ap.add_argument("--from-checkpoint", action="store_true")
ap.add_argument("--no-samples", action="store_true")
ap.add_argument("--cli", default="cargo run --release --quiet --",
                help="how to run nexttoken's CLI for the card's samples (e.g. target/release/nexttoken)")
ARGS = ap.parse_args()
LCPP = Path(ARGS.llama_cpp_dir)
if (LCPP / "gguf-py").is_dir():
    sys.path.insert(0, str(LCPP / "gguf-py"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import gguf  # noqa: E402
from gguf import GGUFReader  # noqa: E402
from gguf.quants import dequantize  # noqa: E402
import tokenizers  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
import lcpp_convert  # noqa: E402  (tools/lcpp_convert.py, beside this script)
from llama_tokenizer import make_llama_tokenizer  # noqa: E402  (tools/llama_tokenizer.py, beside this script)
import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

torch.set_num_threads(ARGS.threads)
torch.use_deterministic_algorithms(True)

SEED = 1234
VOCAB = 2048
CTX = 256
SHAPE = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=CTX, rope_theta=10000.0, rms_norm_eps=1e-5,
             tie_word_embeddings=True, initializer_range=0.02)
HELDOUT_EVERY = 20          # every 20th chapter (index % 20 == 19) is held out
FIXTURE_PROMPTS = ["And God said, Let there be", "And God said", "In the beginning God created",
                   "And the LORD spake unto Moses, saying,"]
MIN_MARGIN = 0.02  # first prompt whose greedy top1-top2 logit gaps all exceed this
FIXTURE_GREEDY = 40
SAMPLE_PROMPTS = ["In the beginning", "And the LORD said unto Moses,", "Blessed are the"]


def r7(x: float) -> float:
    return float(f"{float(x):.7g}")


def r7list(a) -> list:
    return [r7(v) for v in np.asarray(a, dtype=np.float32).ravel().tolist()]


# ----------------------------------------------------------------------------------------------
# corpus: Debian bible-kjv-text (data) read with Debian bible-kjv's `bible` program
# ----------------------------------------------------------------------------------------------

def get_corpus() -> list[tuple[str, list[str]]]:
    d = Path(ARGS.corpus_dir)
    d.mkdir(parents=True, exist_ok=True)
    root = d / "root"
    if not (root / "usr/bin/bible").exists():
        subprocess.run(["apt-get", "download", "bible-kjv", "bible-kjv-text"], cwd=d, check=True)
        for deb in sorted(d.glob("*.deb")):
            subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
    txt = subprocess.run([str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "-l1000", "gen1:1-rev22:21"],
                         check=True, capture_output=True, text=True).stdout
    chapters: list[tuple[str, list[str]]] = []
    for line in txt.splitlines():
        if not line.strip():
            continue
        m = re.match(r"^\s+(\d+) (.*)$", line)
        if m:
            chapters[-1][1].append(m.group(2).strip())
        else:
            chapters.append((line.strip(), []))
    assert len(chapters) == 1189 and sum(len(v) for _, v in chapters) == 31102, "unexpected KJV layout"
    return chapters


# ----------------------------------------------------------------------------------------------
# tokenizer: the sentencepiece-like BPE layout of tools/llama_tokenizer.py (as the fixtures use)
# ----------------------------------------------------------------------------------------------

def make_tokenizer(lines: list[str], vocab_size: int) -> Tokenizer:
    """<unk>,<s>,</s> = 0,1,2; <0x00>..<0xFF> = 3..258; byte fallback; Metaspace (prepend_scheme first)."""
    return make_llama_tokenizer(lines, vocab_size)


TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, "add_eos_token": False,
                    "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": False,
                    "clean_up_tokenization_spaces": False, "model_max_length": CTX}


def chapter_ids(tok: Tokenizer, verses: list[str]) -> list[int]:
    """<s> verse verse ... </s>  (one chapter = one document; BOS comes from the post-processor)"""
    return tok.encode(" ".join(verses)).ids + [2]


def windows(stream: np.ndarray) -> np.ndarray:
    """non-overlapping (CTX+1)-token windows, stride CTX: x = w[:-1], y = w[1:]"""
    n = (len(stream) - 1) // CTX
    return np.stack([stream[i * CTX: i * CTX + CTX + 1] for i in range(n)]).astype(np.int64)


# ----------------------------------------------------------------------------------------------
# baselines: add-k unigram / bigram on the same tokenizer, split and target positions
# ----------------------------------------------------------------------------------------------

def ngram_nll(train: np.ndarray, pairs_prev: np.ndarray, pairs_next: np.ndarray, k: float, order: int) -> float:
    V = VOCAB
    if order == 1:
        c = np.bincount(train, minlength=V).astype(np.float64)
        p = (c + k) / (c.sum() + k * V)
        return float(-np.log(p[pairs_next]).mean())
    big = np.zeros((V, V), dtype=np.float64)
    np.add.at(big, (train[:-1], train[1:]), 1.0)
    row = big.sum(1)
    p = (big[pairs_prev, pairs_next] + k) / (row[pairs_prev] + k * V)
    return float(-np.log(p).mean())


def baselines(train_stream: np.ndarray, held_w: np.ndarray) -> dict:
    prev, nxt = held_w[:, :-1].ravel(), held_w[:, 1:].ravel()
    # choose k on a validation tail of the TRAIN stream, then refit on the whole train stream
    cut = int(len(train_stream) * 0.9)
    fit, val = train_stream[:cut], train_stream[cut:]
    grid = [1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0]
    out = {}
    for order, name in ((1, "unigram"), (2, "bigram")):
        scores = {k: ngram_nll(fit, val[:-1], val[1:], k, order) for k in grid}
        k = min(scores, key=scores.get)
        nll = ngram_nll(train_stream, prev, nxt, k, order)
        out[name] = {"k": k, "heldout_nll": nll, "heldout_ppl": math.exp(nll)}
        print(f"  {name}: add-k k={k} held-out nll {nll:.4f} ppl {math.exp(nll):.2f}")
    return out


# ----------------------------------------------------------------------------------------------
# model / training
# ----------------------------------------------------------------------------------------------

def make_config(attn: str) -> LlamaConfig:
    cfg = LlamaConfig(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=None, **SHAPE)
    cfg._attn_implementation = attn
    return cfg


@torch.no_grad()
def evaluate(model, w: np.ndarray, bs: int = 16) -> float:
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, len(w), bs):
        b = torch.from_numpy(w[i:i + bs])
        logits = model(input_ids=b[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), b[:, 1:].reshape(-1),
                                                 reduction="sum")
        tot += float(loss)
        n += b[:, 1:].numel()
    model.train()
    return tot / n


def train(train_w: np.ndarray, held_w: np.ndarray) -> tuple[LlamaForCausalLM, dict]:
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(make_config("sdpa")).float()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=ARGS.lr, betas=(0.9, 0.95), eps=1e-8)
    steps, B = ARGS.steps, ARGS.batch
    warm = max(1, steps // 20)

    def lr_at(s):  # linear warmup, cosine decay to 10 %
        if s < warm:
            return ARGS.lr * (s + 1) / warm
        t = (s - warm) / max(1, steps - warm)
        return ARGS.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    per_epoch = len(train_w) // B
    rng = np.random.default_rng(SEED)
    order = rng.permutation(len(train_w))
    log = {"n_params": n_params, "steps_planned": steps, "batch": B, "ctx": CTX, "lr": ARGS.lr, "warmup": warm,
           "windows_per_epoch": int(len(train_w)), "steps_per_epoch": per_epoch, "step_loss": [], "evals": [],
           "epochs": [], "stopped_early": False}
    init = evaluate(model, held_w)
    log["evals"].append({"step": 0, "epoch": 0.0, "heldout_loss": init})
    print(f"  params {n_params}; {len(train_w)} train windows ({per_epoch} steps/epoch); "
          f"held-out loss at init {init:.3f}", flush=True)
    t0 = time.time()
    epoch_losses = []
    pos = 0
    for s in range(steps):
        if pos + B > len(order):  # epoch boundary: report, reshuffle
            log["epochs"].append(epoch_row(model, held_w, len(log["epochs"]) + 1, s, epoch_losses, log))
            epoch_losses = []
            order = rng.permutation(len(train_w))
            pos = 0
        idx = order[pos:pos + B]
        pos += B
        b = torch.from_numpy(train_w[idx])
        for g in opt.param_groups:
            g["lr"] = lr_at(s)
        # teacher forcing: inputs w[:, :-1], targets w[:, 1:] (the causal mask is the model's own)
        logits = model(input_ids=b[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), b[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = float(loss.detach())
        epoch_losses.append(lv)
        log["step_loss"].append(lv)
        if (s + 1) % 10 == 0:
            el = time.time() - t0
            print(f"  step {s + 1}/{steps} loss {lv:.3f} lr {lr_at(s):.2e} {el:.0f}s "
                  f"({(s + 1) * B * CTX / el:.0f} tok/s)", flush=True)
        if (s + 1) % ARGS.eval_every == 0 and (s + 1) != steps:
            h = evaluate(model, held_w)
            log["evals"].append({"step": s + 1, "epoch": (s + 1) / per_epoch, "heldout_loss": h})
            print(f"  eval step {s + 1}: held-out loss {h:.4f} ppl {math.exp(h):.2f}", flush=True)
        if time.time() - t0 > ARGS.max_minutes * 60:
            log["stopped_early"] = True
            print("  !! time guard fired", flush=True)
            break
    log["steps_done"] = s + 1
    log["train_seconds"] = time.time() - t0
    log["epochs"].append(epoch_row(model, held_w, (s + 1) / per_epoch, s + 1, epoch_losses, log))
    return model, log


def epoch_row(model, held_w, epoch, step, losses, log) -> dict:
    h = evaluate(model, held_w)
    tr = float(np.mean(losses)) if losses else float("nan")
    row = {"epoch": round(float(epoch), 3), "step": int(step), "train_loss": tr, "train_ppl": math.exp(tr),
           "heldout_loss": h, "heldout_ppl": math.exp(h)}
    log["evals"].append({"step": int(step), "epoch": float(epoch), "heldout_loss": h})
    print(f"  == epoch {row['epoch']}: train loss {tr:.4f} (ppl {math.exp(tr):.2f}), held-out loss {h:.4f} "
          f"(ppl {math.exp(h):.2f})", flush=True)
    return row


# ----------------------------------------------------------------------------------------------
# export (llama.cpp converter, as tools/make_fixtures.py) and GGUF -> HF inverse mapping
# ----------------------------------------------------------------------------------------------

def convert(hf_dir: Path, out: Path, outtype: str):
    """llama.cpp's converter (tools/lcpp_convert.py) with this script's llama.cpp tree."""
    lcpp_convert.convert(LCPP, hf_dir, out, outtype)


def lcpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def effective_state_dict(path: Path, n_head: int, n_kv: int):
    rd = GGUFReader(str(path))
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    m = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
         "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
         "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
         "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
         "ffn_down.weight": "mlp.down_proj.weight"}
    sd, types = {}, {}
    for t in rd.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        w = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(shape)
        types[t.name] = t.tensor_type.name
        if t.name in top:
            hf = top[t.name]
        else:
            _, bid, rest = t.name.split(".", 2)
            hf = f"model.layers.{bid}." + m[rest]
            if rest == "attn_q.weight":
                w = lcpp_unpermute(w, n_head)
            elif rest == "attn_k.weight":
                w = lcpp_unpermute(w, n_kv)
        sd[hf] = torch.from_numpy(np.ascontiguousarray(w))
    return rd, sd, types


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    seq, out, margins = list(ids), [], []
    for _ in range(n):
        logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
        t = int(torch.argmax(logits))
        top2 = torch.topk(logits, 2).values
        margins.append(float(top2[0] - top2[1]))
        out.append(t)
        seq.append(t)
    return out, margins


def versions() -> dict:
    from importlib.metadata import version
    v = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
         "tokenizers": tokenizers.__version__, "numpy": np.__version__}
    pp = LCPP / "gguf-py" / "pyproject.toml"
    if pp.is_file():
        for line in pp.read_text().splitlines():
            if line.startswith("version"):
                v["gguf"] = line.split("=")[1].strip().strip('"') + " (llama.cpp gguf-py)"
    try:
        v["bible-kjv-text"] = subprocess.run(["dpkg-deb", "-f", str(next(Path(ARGS.corpus_dir).glob(
            "bible-kjv-text_*.deb"))), "Version"], capture_output=True, text=True).stdout.strip()
    except Exception:
        pass
    return v


# ----------------------------------------------------------------------------------------------
# card, plot, samples
# ----------------------------------------------------------------------------------------------

def plot(log: dict, base: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sl = np.array(log["step_loss"])
    k = 10
    sm = np.convolve(sl, np.ones(k) / k, mode="valid")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(np.arange(1, len(sl) + 1), sl, color="#bbb", lw=0.8, label="train loss (per step)")
    ax.plot(np.arange(k, len(sl) + 1), sm, color="C0", lw=1.5, label=f"train loss ({k}-step mean)")
    ev = log["evals"]
    ax.plot([e["step"] for e in ev], [e["heldout_loss"] for e in ev], "o-", color="C3", label="held-out loss")
    ax.axhline(base["bigram"]["heldout_nll"], color="C2", ls="--", lw=1, label="bigram (held-out)")
    ax.axhline(base["unigram"]["heldout_nll"], color="C1", ls=":", lw=1, label="unigram (held-out)")
    ax.set_xlabel("step (%d sequences x %d tokens)" % (log["batch"], log["ctx"]))
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(min(sm.min(), min(e["heldout_loss"] for e in ev)) - 0.2, max(base["unigram"]["heldout_nll"] + 0.5, 6))
    ax.set_title("nexttoken default model: KJV Bible, %.1fM params" % (log["n_params"] / 1e6))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def cli_samples() -> list[dict]:
    """samples from nexttoken's own CLI (the engine, not transformers) on the shipped GGUF"""
    out = []
    for prompt in SAMPLE_PROMPTS:
        for temp in ("0", "0.8"):
            cmd = ARGS.cli.split() + ["generate", "--model", "www/models/default.gguf",
                   "--tokenizer", "www/models/default-tokenizer.json", "--prompt", prompt, "--temperature", temp,
                   "--max-tokens", "60", "--seed", "42"]
            r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            text = r.stdout.strip() if r.returncode == 0 else f"(cargo failed: {r.stderr.strip()[-300:]})"
            out.append({"prompt": prompt, "temperature": temp, "text": text,
                        "command": " ".join(c if " " not in c and "," not in c else json.dumps(c) for c in cmd)})
            print(f"  [{temp}] {text[:200]!r}", flush=True)
    return out


def write_card(meta: dict):
    FIXTURE_PROMPT = meta["fixture_prompt"]
    log, base, ep = meta["log"], meta["baselines"], meta["log"]["epochs"]
    final = ep[-1]
    rows = "\n".join(f"| {e['epoch']} | {e['step']} | {e['train_loss']:.4f} | {e['train_ppl']:.2f} | "
                     f"{e['heldout_loss']:.4f} | {e['heldout_ppl']:.2f} |" for e in ep)
    evals = ", ".join(f"step {e['step']}: {e['heldout_loss']:.3f}" for e in log["evals"])
    samples = "\n\n".join(
        f"**{s['prompt']!r}, temperature {s['temperature']}**\n\n```text\n{s['text']}\n```" for s in meta["samples"]
    ) if meta["samples"] else "(not generated: run without --no-samples)"
    sc = meta["samples"][0]["command"] if meta["samples"] else ""
    sizes = meta["sizes"]
    cli_note = "" if ARGS.cli.startswith("cargo run --release") else (
        f" These were made with `--cli {ARGS.cli}` (a debug build of the same CLI, because the working tree's release"
        " build did not compile at the time); the documented way is `cargo run --release -- generate ...`, the"
        " script's default.")
    card = f"""# nexttoken default model (`default.gguf`)

A small llama-architecture language model trained from scratch for this project, so that `nexttoken` has
a model of its own to demonstrate with: it writes in the style of the King James Bible. It is tiny
({log['n_params'] / 1e6:.2f}M parameters) and saw about {final['epoch']:.2f} epochs of text, so expect
fluent-looking KJV phrasing with little sense, not knowledge.

| file | bytes |
| --- | --- |
| `default.gguf` (GGUF v3, llama, Q8_0) | {sizes['gguf']:,} |
| `default-tokenizer.json` | {sizes['tokenizer']:,} |
| together | {sizes['gguf'] + sizes['tokenizer']:,} |

## Corpus and licence

* **Debian package `bible-kjv-text` {meta['versions'].get('bible-kjv-text', '')}** (source package `bible-kjv`,
  `apt-get download bible-kjv-text`), read with the `bible` program of the Debian package `bible-kjv`
  (`bible -l1000 gen1:1-rev22:21`). The packaged `copyright` file says: *"The copyright for the King James
  Version text of the Bible is expired since the translation was done in 1611"* — the text is in the
  **public domain** (the packaging/software is GPL-2+; only the text is used). (In the UK the Authorized
  Version is under perpetual Crown letters patent; elsewhere it is public domain.)
* 66 books, 1,189 chapters, 31,102 verses, ~4.3 MB of text. One chapter = one document: `<s>` + verses
  joined with spaces + `</s>`; verse numbers and chapter headings are dropped.
* **Split**: every {HELDOUT_EVERY}th chapter (chapter index % {HELDOUT_EVERY} == {HELDOUT_EVERY - 1} in canonical order) is
  held out: {meta['split']['train_chapters']} train / {meta['split']['heldout_chapters']} held-out chapters,
  {meta['split']['train_tokens']:,} / {meta['split']['heldout_tokens']:,} tokens. The tokenizer and the
  baselines see only the train chapters.

## Tokenizer

BPE trained with 🤗 `tokenizers` on the train chapters, laid out like Llama-2/sentencepiece: `<unk>` `<s>`
`</s>` = 0, 1, 2, byte-fallback tokens `<0x00>`..`<0xFF>` = 3..258, then {VOCAB - 259} learned
tokens (the train text's characters and BPE merges); Metaspace
(`▁`, prepend_scheme `first`), no normalizer, BOS added by the post-processor. Vocabulary {VOCAB}. In the GGUF
it is the `llama` (SPM) vocab with `tokenizer.ggml.pre = default` (llama.cpp's converter does not know this
tokenizer's hash, so `tools/train_default_model.py` names the pre-tokenizer, as `tools/make_fixtures.py` does).

## Model

`transformers.LlamaForCausalLM`: vocab {VOCAB}, hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers,
{SHAPE['num_attention_heads']} query heads / {SHAPE['num_key_value_heads']} key-value heads (GQA, head dim
{SHAPE['hidden_size'] // SHAPE['num_attention_heads']}), SwiGLU FFN {SHAPE['intermediate_size']}, RMSNorm eps
{SHAPE['rms_norm_eps']}, RoPE theta {SHAPE['rope_theta']:g}, context {CTX}, tied input/output embeddings.
**{log['n_params']:,} parameters.** Every weight matrix has rows of 192 values (512 for `ffn_down`), whole
Q8_0 blocks of 32, so the converter stores every 2-D tensor, the embedding included, as Q8_0; only the RMSNorm
gains stay F32.

Why transformers' `LlamaForCausalLM` on CPU with a plain PyTorch loop: the reference implementation that
the engine's parity tests already trust (`tests/transformers_parity.rs`) is also the trainer, so the
weights go through exactly one conversion path (llama.cpp's `convert_hf_to_gguf.py`) that we test
elsewhere; a plain loop (no Trainer, no accelerate) keeps every step visible and reproducible; CPU float32
with fixed seeds, one thread and `torch.use_deterministic_algorithms(True)` needs no GPU and should give the
same weights again with the same package versions on the same kind of CPU (a bit-for-bit rerun was not
checked; float summation order can differ between CPU kernels). A 2M-parameter model is what ~20 minutes of
one shared CPU core can train on ~2M tokens; a bigger one would see less than one epoch in that time.

## Training

Next-token prediction (teacher forcing, causal mask, cross-entropy over all {CTX} positions of each window).
Train chapters concatenated into one token stream, cut into non-overlapping windows of {CTX}+1 tokens,
shuffled each epoch (seed {SEED}). AdamW (β = 0.9, 0.95; weight decay 0.1 on matrices), peak LR {log['lr']},
{log['warmup']} warm-up steps then cosine decay to 10 %, gradient clipping 1.0, batch {log['batch']} × {CTX}
tokens, **{log['steps_done']} steps** ({log['steps_done'] * log['batch'] * CTX:,} tokens,
{log['windows_per_epoch']} windows = {log['steps_per_epoch']} steps per epoch), float32, 1 CPU thread,
{log['train_seconds'] / 60:.1f} min wall clock on a shared 2-core machine.{' **The wall-clock guard (`--max-minutes`) stopped training early.**' if log['stopped_early'] else ' The wall-clock guard (`--max-minutes`, default %g) did not fire; on a slower machine raise it, or the run stops early and differs.' % ARGS.max_minutes}

| epoch | step | train loss (mean over the epoch's steps) | train ppl | held-out loss | held-out ppl |
| --- | --- | --- | --- | --- | --- |
{rows}

Train loss is the mean of the per-step batch losses during the epoch (the weights improve along the way,
so it sits above the end-of-epoch held-out loss). Held-out loss at every evaluation: {evals}. Curve: [`loss.png`](loss.png).

![loss curve](loss.png)

## Held-out perplexity vs baselines

Same tokenizer, same held-out windows, same target positions (each of the {CTX} targets of every held-out
window; the bigram conditions on the token before it, which the model sees too). Add-k constants chosen on
the last 10 % of the train stream, then refitted on the whole train split.

| model | held-out cross-entropy (nats/token) | held-out perplexity |
| --- | --- | --- |
| unigram, add-k (k = {base['unigram']['k']:g}) | {base['unigram']['heldout_nll']:.4f} | {base['unigram']['heldout_ppl']:.2f} |
| bigram, add-k (k = {base['bigram']['k']:g}) | {base['bigram']['heldout_nll']:.4f} | {base['bigram']['heldout_ppl']:.2f} |
| **this model (float32, transformers)** | **{final['heldout_loss']:.4f}** | **{final['heldout_ppl']:.2f}** |
| this model, exported Q8_0 weights (dequantized, transformers) | {meta['q8_heldout_loss']:.4f} | {math.exp(meta['q8_heldout_loss']):.2f} |

## Samples (nexttoken's own CLI on `default.gguf`)

Produced by `{sc}` (and the same with the other prompts / `--temperature 0.8`; `--seed 42`).{cli_note}

{samples}

## Test fixture

`tests/fixtures/default_model/reference.json`: prompt {FIXTURE_PROMPT!r}, its ids, transformers (float32, eager
attention) logits at every prompt position computed from the weights **in the Q8_0 GGUF** (dequantized with
gguf-py, RoPE q/k permutation undone), and a {FIXTURE_GREEDY}-token pure-argmax continuation (the first prompt of\n`FIXTURE_PROMPTS` whose greedy steps all have a top-1/top-2 logit gap ≥ {MIN_MARGIN}, so that float rounding\ncannot flip a near-tie).
`tests/default_model.rs` checks the engine against it (max abs logit error ≤ 1e-4, greedy ids exact) and
that `HfTokenizer` gives the same prompt ids.

## Reproduce

```sh
pip install torch==2.15.0 transformers==5.24.0 tokenizers==0.23.3 numpy==2.4.6 safetensors==0.8.0 sentencepiece==0.2.3 matplotlib
pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d /tmp/lcp
tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp      # only for convert_hf_to_gguf.py + gguf-py
cargo build --release                                              # the card's samples use the CLI
python3 tools/train_default_model.py --llama-cpp-dir /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp
cargo test --test default_model
```

The script downloads the two Debian packages itself (`apt-get download bible-kjv bible-kjv-text`, into
`--corpus-dir`, default `/tmp/kjv`), and writes every file named above, this card included. Versions used:
`{json.dumps(meta['versions'])}`.
"""
    (OUT / "README.md").write_text(card)


# ----------------------------------------------------------------------------------------------

def main():
    OUT.mkdir(parents=True, exist_ok=True)
    FIX.mkdir(parents=True, exist_ok=True)
    work = Path(ARGS.workdir)
    work.mkdir(parents=True, exist_ok=True)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)

    print("== corpus")
    chapters = get_corpus()
    train_ch = [c for i, c in enumerate(chapters) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    held_ch = [c for i, c in enumerate(chapters) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]

    print("== tokenizer")
    tok = make_tokenizer([" ".join(v) for _, v in train_ch], VOCAB)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    tok.save(str(OUT / "default-tokenizer.json"))
    train_stream = np.array([t for _, v in train_ch for t in chapter_ids(tok, v)], dtype=np.int64)
    held_stream = np.array([t for _, v in held_ch for t in chapter_ids(tok, v)], dtype=np.int64)
    train_w, held_w = windows(train_stream), windows(held_stream)
    split = {"train_chapters": len(train_ch), "heldout_chapters": len(held_ch),
             "train_tokens": int(len(train_stream)), "heldout_tokens": int(len(held_stream))}
    print("  ", split, "train windows", len(train_w), "held-out windows", len(held_w))

    print("== baselines")
    base = baselines(train_stream, held_w)

    hf_dir = work / "hf"
    if ARGS.from_checkpoint:
        model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
        log = json.loads((work / "train_log.json").read_text())
    else:
        print("== train")
        model, log = train(train_w, held_w)
        if hf_dir.exists():
            shutil.rmtree(hf_dir)
        model.config._attn_implementation = "eager"
        model.save_pretrained(hf_dir, safe_serialization=True)
        tok.save(str(hf_dir / "tokenizer.json"))
        (hf_dir / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2))
        (work / "train_log.json").write_text(json.dumps(log))
    final = log["epochs"][-1]
    if not final["heldout_loss"] < base["bigram"]["heldout_nll"] < base["unigram"]["heldout_nll"]:
        print("!! the model does not beat both baselines", flush=True)
        if log["steps_done"] >= 100:
            raise SystemExit(1)

    print("== export Q8_0")
    gguf_path = OUT / "default.gguf"
    convert(hf_dir, gguf_path, "q8_0")
    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    orig = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rd, sd, types = effective_state_dict(gguf_path, SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"])
    if "lm_head.weight" in sd:
        assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
        del sd["lm_head.weight"]
    msd = model.state_dict()
    assert set(sd) == set(k for k in msd if k != "lm_head.weight"), (set(sd) ^ set(msd))
    with torch.no_grad():
        for k, v in sd.items():
            msd[k].copy_(v)
    max_dq = {k: r7(float((v - orig[k]).abs().max())) for k, v in sd.items()}
    q8_loss = evaluate(model, held_w)
    model.eval()
    print(f"  types {sorted(set(types.values()))}; q8_0 held-out loss {q8_loss:.4f}")

    print("== fixture")
    for FIXTURE_PROMPT in FIXTURE_PROMPTS:  # greedy must not hinge on a near-tie (Q8_0 engine vs transformers)
        prompt_ids = tok.encode(FIXTURE_PROMPT).ids
        assert prompt_ids[0] == 1
        greedy, margins = hf_greedy(model, prompt_ids, FIXTURE_GREEDY)
        print(f"  prompt {FIXTURE_PROMPT!r}: min top-2 margin {min(margins):.4f}")
        if min(margins) >= MIN_MARGIN:
            break
    else:
        raise SystemExit("no fixture prompt with a safe greedy margin")
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids]), use_cache=False).logits[0].float().numpy()
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    ref = {"model": "default", "generator": "tools/train_default_model.py", "versions": versions(),
           "file": "www/models/default.gguf", "tokenizer": "www/models/default-tokenizer.json",
           "hf_config": hf_cfg, "prompt": FIXTURE_PROMPT, "prompt_ids": prompt_ids,
           "prompt_tokens": tok.encode(FIXTURE_PROMPT).tokens, "tensor_types": types,
           "logits": [r7list(r) for r in logits], "greedy_ids": greedy,
           "greedy_text": tok.decode(prompt_ids + greedy, skip_special_tokens=True),
           "greedy_top2_margins": [r7(m) for m in margins], "max_abs_dequant_vs_f32": max_dq,
           "notes": ("logits: transformers (float32, eager attention) logits at every prompt position (7 significant "
                     "digits) computed with the weights www/models/default.gguf holds (Q8_0 dequantized by gguf-py, "
                     "q/k RoPE permutation undone). greedy_ids: pure argmax continuation (no EOS suppression, no "
                     "stopping), full recompute each step; greedy_top2_margins = top1 - top2 logit per step.")}
    (FIX / "reference.json").write_text(json.dumps(ref, separators=(",", ":"), ensure_ascii=False) + "\n")
    print("  greedy:", repr(ref["greedy_text"]), "min margin", min(margins))

    print("== plot / samples / card")
    plot(log, base, OUT / "loss.png")
    samples = [] if ARGS.no_samples else cli_samples()
    sizes = {"gguf": gguf_path.stat().st_size, "tokenizer": (OUT / "default-tokenizer.json").stat().st_size}
    assert sizes["gguf"] + sizes["tokenizer"] <= 8 * 1024 * 1024, sizes
    meta = {"log": log, "baselines": base, "split": split, "sizes": sizes, "samples": samples,
            "q8_heldout_loss": q8_loss, "versions": versions(),
            "fixture_prompt": FIXTURE_PROMPT}
    write_card(meta)
    (work / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "log"}, indent=1))
    print("done:", sizes)


if __name__ == "__main__":
    main()
