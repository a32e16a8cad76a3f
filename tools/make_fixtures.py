#!/usr/bin/env python3
"""Fixture generator for the `nexttoken` test-suite.

Writes (all derived, small, committed):
  tests/fixtures/<model>/<model>-<type>.gguf   tiny random-weight models converted by llama.cpp's own
                                               convert_hf_to_gguf.py (+ llama.cpp's quantizer for
                                               q4_0 / q4_k / q6_k)
  tests/fixtures/<model>/tokenizer.json        the model's (freshly trained, tiny) HF tokenizer
  tests/fixtures/<model>/reference.json        transformers logits / greedy ids per GGUF variant,
                                               computed with the weights the GGUF actually holds
  tests/fixtures/stories260k/reference.json    transformers reference for /work/shared stories260K
  tests/fixtures/quant_blocks.json             random valid quant blocks + gguf-py dequantisation

Exact command (from the repository root, see tools/README.md for package versions):

    pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d /tmp/lcp
    tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp
    CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install /tmp/lcp/llama_cpp_python-0.3.36.tar.gz   # quantizer
    python3 tools/make_fixtures.py --llama-cpp-dir /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp

Options: --only llama,gpt2,... (subset), --skip-llamacpp (no llama.cpp logits), --shared DIR.
All randomness uses fixed seeds; transformers runs on CPU in float32 with eager attention.
"""
from __future__ import annotations

import argparse
import codecs
import ctypes
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures"
DEFAULT_LCPP = "/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp"


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp-dir", default=DEFAULT_LCPP,
                    help="llama.cpp source tree (vendor/llama.cpp of the llama-cpp-python sdist)")
    ap.add_argument("--shared", default=str(REPO.parent / "shared"))
    ap.add_argument("--only", default="", help="comma list of: llama,llama_tied,qwen2,gpt2,stories260k,quant_blocks")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--workdir", default="", help="scratch dir for HF folders (default: a temp dir)")
    return ap.parse_args()


ARGS = parse_args()
LCPP = Path(ARGS.llama_cpp_dir)
# use the gguf-py that ships with the very llama.cpp we convert with (version match)
if (LCPP / "gguf-py").is_dir():
    sys.path.insert(0, str(LCPP / "gguf-py"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import gguf  # noqa: E402
from gguf import GGUFReader  # noqa: E402
from gguf.quants import dequantize  # noqa: E402
import tokenizers  # noqa: E402
from tokenizers import Tokenizer, models, trainers, pre_tokenizers, decoders, processors, normalizers, Regex  # noqa: E402
import transformers  # noqa: E402
import lcpp_convert  # noqa: E402  (tools/lcpp_convert.py, beside this script)
import llama_tokenizer  # noqa: E402  (tools/llama_tokenizer.py, beside this script)
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,  # noqa: E402
                          GPT2Config, GPT2LMHeadModel)

torch.set_num_threads(max(1, os.cpu_count() or 1))
torch.use_deterministic_algorithms(True)

try:
    import llama_cpp  # noqa: E402
except Exception as e:  # pragma: no cover
    llama_cpp = None
    print("llama_cpp not importable:", e)


def r7(x: float) -> float:
    return float(f"{float(x):.7g}")


def r7list(a) -> list:
    return [r7(v) for v in np.asarray(a, dtype=np.float32).ravel().tolist()]


def gguf_py_version() -> str:
    pp = LCPP / "gguf-py" / "pyproject.toml"
    if pp.is_file():
        for line in pp.read_text().splitlines():
            if line.startswith("version"):
                return line.split("=")[1].strip().strip('"') + " (llama.cpp gguf-py)"
    from importlib.metadata import version
    return version("gguf")


def versions() -> dict:
    from importlib.metadata import version
    v = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
         "tokenizers": tokenizers.__version__, "numpy": np.__version__, "gguf": gguf_py_version()}
    try:
        v["llama_cpp_python"] = version("llama_cpp_python")
    except Exception:
        pass
    return v


# ----------------------------------------------------------------------------------------------
# tokenizers (trained offline on text shipped with Python itself)
# ----------------------------------------------------------------------------------------------

def corpus() -> list[str]:
    import contextlib, io
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401  (prints the Zen on import)
    zen = codecs.decode(this.s, "rot13")
    import collections, functools, itertools, json as _j, re as _re, string, textwrap, random, heapq, bisect
    docs = [zen] * 40
    for mod in (collections, functools, itertools, _j, _re, string, textwrap, random, heapq, bisect):
        if mod.__doc__:
            docs.append(mod.__doc__)
        for name in sorted(dir(mod)):
            d = getattr(getattr(mod, name), "__doc__", None)
            if isinstance(d, str) and not name.startswith("_"):
                docs.append(d)
    lines = []
    for d in docs:
        lines.extend(l for l in d.splitlines() if l.strip())
    return lines


def make_llama_tokenizer(vocab_size: int) -> Tokenizer:
    """A sentencepiece-like BPE with byte fallback on the fixture corpus (tools/llama_tokenizer.py):
    the same pipeline as the Llama-2 / stories260K tokenizer.json (Metaspace, prepend_scheme first)."""
    return llama_tokenizer.make_llama_tokenizer(corpus(), vocab_size, limit_alphabet=45)


def make_gpt2_tokenizer(vocab_size: int) -> Tokenizer:
    """GPT-2 style byte-level BPE, <|endoftext|> = id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    return tok


QWEN2_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
             r"\s*[\r\n]+|\s+(?!\S)|\s+")


def make_qwen2_tokenizer(vocab_size: int) -> Tokenizer:
    """Qwen2 style byte-level BPE (NFC, Qwen2 split regex); specials appended at the end of the vocab
    like the real Qwen2 (<|endoftext|>, <|im_start|>, <|im_end|>)."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PAT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    tok.add_special_tokens(specials)
    return tok


def save_hf_tokenizer(tok: Tokenizer, d: Path, cfg: dict):
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


# ----------------------------------------------------------------------------------------------
# GGUF <-> HF weight mapping (inverse of convert_hf_to_gguf.py conventions)
# ----------------------------------------------------------------------------------------------

def lcpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf LlamaModel.permute (n_head already = n_head_kv for k)
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def lcpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_to_hf_name(arch: str, name: str) -> tuple[str, str]:
    """returns (hf_name, transform) ; transform in {'', 'perm_q', 'perm_k', 'T'}"""
    if arch in ("llama", "qwen2"):
        top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
        if name in top:
            return top[name], ""
        _, bid, rest = name.split(".", 2)
        p = f"model.layers.{bid}."
        m = {"attn_norm.weight": ("input_layernorm.weight", ""), "ffn_norm.weight": ("post_attention_layernorm.weight", ""),
             "attn_q.weight": ("self_attn.q_proj.weight", "perm_q" if arch == "llama" else ""),
             "attn_k.weight": ("self_attn.k_proj.weight", "perm_k" if arch == "llama" else ""),
             "attn_v.weight": ("self_attn.v_proj.weight", ""), "attn_output.weight": ("self_attn.o_proj.weight", ""),
             "attn_q.bias": ("self_attn.q_proj.bias", ""), "attn_k.bias": ("self_attn.k_proj.bias", ""),
             "attn_v.bias": ("self_attn.v_proj.bias", ""),
             "ffn_gate.weight": ("mlp.gate_proj.weight", ""), "ffn_up.weight": ("mlp.up_proj.weight", ""),
             "ffn_down.weight": ("mlp.down_proj.weight", "")}
        hf, tr = m[rest]
        return p + hf, tr
    if arch == "gpt2":
        top = {"token_embd.weight": "transformer.wte.weight", "position_embd.weight": "transformer.wpe.weight",
               "output_norm.weight": "transformer.ln_f.weight", "output_norm.bias": "transformer.ln_f.bias",
               "output.weight": "lm_head.weight"}
        if name in top:
            return top[name], ""
        _, bid, rest = name.split(".", 2)
        p = f"transformer.h.{bid}."
        m = {"attn_norm.weight": ("ln_1.weight", ""), "attn_norm.bias": ("ln_1.bias", ""),
             "ffn_norm.weight": ("ln_2.weight", ""), "ffn_norm.bias": ("ln_2.bias", ""),
             "attn_qkv.weight": ("attn.c_attn.weight", "T"), "attn_qkv.bias": ("attn.c_attn.bias", ""),
             "attn_output.weight": ("attn.c_proj.weight", "T"), "attn_output.bias": ("attn.c_proj.bias", ""),
             "ffn_up.weight": ("mlp.c_fc.weight", "T"), "ffn_up.bias": ("mlp.c_fc.bias", ""),
             "ffn_down.weight": ("mlp.c_proj.weight", "T"), "ffn_down.bias": ("mlp.c_proj.bias", "")}
        hf, tr = m[rest]
        return p + hf, tr
    raise ValueError(arch)


def read_gguf(path: Path):
    rd = GGUFReader(str(path))
    tensors, types = {}, {}
    for t in rd.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # numpy (rows, cols) order
        arr = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(shape)
        tensors[t.name] = arr
        types[t.name] = t.tensor_type.name
    return rd, tensors, types


def gguf_metadata(rd) -> dict:
    out = {}
    for k, f in rd.fields.items():
        if k.startswith("GGUF."):
            continue
        try:
            v = f.contents()
        except Exception:
            v = "?"
        if isinstance(v, list) and len(v) > 8:
            v = f"[{len(v)} items]"
        out[k] = v
    return out


def effective_state_dict(arch: str, gg: dict, n_head: int, n_kv: int) -> dict:
    sd = {}
    for name, w in gg.items():
        hf, tr = gguf_to_hf_name(arch, name)
        if tr == "perm_q":
            w = lcpp_unpermute(w, n_head)
        elif tr == "perm_k":
            w = lcpp_unpermute(w, n_kv)
        elif tr == "T":
            w = w.T
        sd[hf] = torch.from_numpy(np.ascontiguousarray(w))
    return sd


def load_effective(model, sd: dict, tied: bool):
    model_sd = model.state_dict()
    if tied and "lm_head.weight" in sd:
        # the converter may write output.weight for a tied model; only accept it if identical
        emb_key = [k for k in sd if k.endswith(("embed_tokens.weight", "wte.weight"))][0]
        assert torch.equal(sd["lm_head.weight"], sd[emb_key]), "tied model has a different output.weight"
        del sd["lm_head.weight"]
    missing = [k for k in model_sd if k not in sd and not (tied and k == "lm_head.weight")
               and not k.endswith((".attn.bias", ".attn.masked_bias"))]
    extra = [k for k in sd if k not in model_sd]
    assert not missing and not extra, (missing, extra)
    with torch.no_grad():
        for k, v in sd.items():
            assert model_sd[k].shape == v.shape, (k, model_sd[k].shape, v.shape)
            model_sd[k].copy_(v)


# ----------------------------------------------------------------------------------------------
# transformers references
# ----------------------------------------------------------------------------------------------

@torch.no_grad()
def hf_logits(model, ids: list[int]) -> np.ndarray:
    return model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """pure argmax greedy (no EOS suppression, no stopping), full recompute each step."""
    seq = list(ids)
    out = []
    margins = []
    for _ in range(n):
        logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
        t = int(torch.argmax(logits))
        top2 = torch.topk(logits, 2).values
        margins.append(float(top2[0] - top2[1]))
        out.append(t)
        seq.append(t)
    hf_greedy.last_margins = margins
    return out


@torch.no_grad()
def hf_generate(model, ids: list[int], n: int) -> list[int]:
    """transformers generate(do_sample=False, min_new_tokens=max_new_tokens=n) (EOS is suppressed!)"""
    out = model.generate(torch.tensor([ids]), do_sample=False, min_new_tokens=n, max_new_tokens=n,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
    return out[0, len(ids):].tolist()


def llamacpp_last_logits(path: Path, ids: list[int]):
    if llama_cpp is None or ARGS.skip_llamacpp:
        return None
    try:
        llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=128, n_batch=64, n_threads=2,
                              verbose=False, seed=0)
        llm.reset()
        llm.eval(ids)
        last = np.array(llm.scores[len(ids) - 1], dtype=np.float32)
        del llm
        return r7list(last)
    except Exception as e:
        print("  llama.cpp eval failed:", repr(e))
        return None


# ----------------------------------------------------------------------------------------------
# conversion / quantisation with llama.cpp
# ----------------------------------------------------------------------------------------------

def convert(hf_dir: Path, out: Path, outtype: str, tokpre: str):
    """llama.cpp's converter (tools/lcpp_convert.py) with this script's llama.cpp tree."""
    lcpp_convert.convert(LCPP, hf_dir, out, outtype, tokpre)


QUANT_FTYPES = {"q4_0": ("LLAMA_FTYPE_MOSTLY_Q4_0", True), "q4_k": ("LLAMA_FTYPE_MOSTLY_Q4_K_M", False),
                "q6_k": ("LLAMA_FTYPE_MOSTLY_Q6_K", True)}


def quantize(inp: Path, out: Path, kind: str):
    if llama_cpp is None:
        raise RuntimeError("llama_cpp not installed: cannot quantize " + kind)
    ftype_name, pure = QUANT_FTYPES[kind]
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, ftype_name)
    p.nthread = 2
    p.pure = pure
    rc = llama_cpp.llama_model_quantize(str(inp).encode(), str(out).encode(), ctypes.byref(p))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed rc={rc}")


# ----------------------------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------------------------

def randomise(model, seed: int, norm_std=0.2, bias_std=0.1):
    """default init (initializer_range set in config) + random norm gains and nonzero random biases"""
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and name.endswith("weight"):  # RMSNorm / LayerNorm gains
                p.copy_(1.0 + norm_std * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(bias_std * torch.randn(p.shape, generator=g))


SPECS = {
    "llama": dict(arch="llama", seed=1, vocab=384, variants=["f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q6_k"],
                  prompt="Flat is better than",
                  config=dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0,
                              rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.1)),
    "llama_tied": dict(arch="llama", seed=2, vocab=384, variants=["f32"], prompt="Simple is better than",
                       config=dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128, rope_theta=500000.0,
                                   rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.15)),
    "qwen2": dict(arch="qwen2", seed=3, vocab=384, variants=["f32", "q8_0"], prompt="Now is better than never.",
                  config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=128, rope_theta=1000000.0,
                              rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.15,
                              use_sliding_window=False)),
    "gpt2": dict(arch="gpt2", seed=4, vocab=384, variants=["f32", "q8_0"], prompt="Sparse is better than",
                 config=dict(n_embd=64, n_layer=2, n_head=4, n_positions=128, n_ctx=128, initializer_range=0.15,
                             tie_word_embeddings=True)),
}


def build_model(name: str, spec: dict, tok: Tokenizer):
    arch = spec["arch"]
    V = tok.get_vocab_size()
    c = dict(spec["config"])
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=V, bos_token_id=1, eos_token_id=2, pad_token_id=None, **c)
        cls = LlamaForCausalLM
    elif arch == "qwen2":
        eot = tok.token_to_id("<|endoftext|>")
        cfg = Qwen2Config(vocab_size=V, bos_token_id=eot, eos_token_id=eot, **c)
        cls = Qwen2ForCausalLM
    else:
        cfg = GPT2Config(vocab_size=V, bos_token_id=0, eos_token_id=0, **c)
        cls = GPT2LMHeadModel
    cfg._attn_implementation = "eager"
    torch.manual_seed(spec["seed"])
    model = cls(cfg).float().eval()
    randomise(model, spec["seed"])
    if getattr(cfg, "tie_word_embeddings", False):
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    return model


def tokenizer_for(name: str, spec: dict) -> tuple[Tokenizer, dict, str]:
    if spec["arch"] == "llama":
        tok = make_llama_tokenizer(spec["vocab"])
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, "add_eos_token": False,
               "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": False,
               "clean_up_tokenization_spaces": False, "model_max_length": 128}
        return tok, cfg, "default"
    if spec["arch"] == "qwen2":
        tok = make_qwen2_tokenizer(spec["vocab"])
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "bos_token": None,
               "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": False,
               "model_max_length": 128}
        return tok, cfg, "qwen2"
    tok = make_gpt2_tokenizer(spec["vocab"])
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "bos_token": "<|endoftext|>",
           "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "clean_up_tokenization_spaces": False,
           "model_max_length": 128}
    return tok, cfg, "gpt-2"


def n_heads(cfg) -> tuple[int, int]:
    if hasattr(cfg, "num_key_value_heads"):
        return cfg.num_attention_heads, cfg.num_key_value_heads
    return cfg.n_head, cfg.n_head


def do_model(name: str, spec: dict, work: Path, meta_report: dict):
    print(f"== {name}")
    out_dir = FIX / name
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_dir = work / name
    if hf_dir.exists():
        shutil.rmtree(hf_dir)
    hf_dir.mkdir(parents=True)

    tok, tok_cfg, tokpre = tokenizer_for(name, spec)
    model = build_model(name, spec, tok)
    model.save_pretrained(hf_dir, safe_serialization=True)
    save_hf_tokenizer(tok, hf_dir, tok_cfg)
    tok.save(str(out_dir / "tokenizer.json"))
    hf_config = json.loads((hf_dir / "config.json").read_text())
    tied = bool(hf_config.get("tie_word_embeddings", False))
    nh, nkv = n_heads(model.config)
    orig_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}

    prompt_ids = tok.encode(spec["prompt"]).ids  # BOS via post-processor for llama family, none otherwise
    if spec["arch"] == "llama":
        assert prompt_ids[0] == 1
    assert 6 <= len(prompt_ids) <= 10, (spec["prompt"], prompt_ids)

    ref = {"model": name, "generator": "tools/make_fixtures.py", "versions": versions(),
           "hf_config": hf_config, "prompt": spec["prompt"], "prompt_ids": prompt_ids,
           "prompt_tokens": tok.encode(spec["prompt"]).tokens,
           "notes": ("logits: transformers (float32, eager attention) logits at every prompt position, rounded to 7 "
                     "significant digits, computed with the weights the GGUF file holds (dequantised with gguf-py, "
                     "q/k RoPE permutation / Conv1D transposes undone). greedy_ids: pure argmax continuation of "
                     "24 tokens (no EOS suppression, no stopping); greedy_top2_margins[i] = top1 - top2 logit at step i (small margins = fragile ties). llamacpp_last_logits: llama.cpp's logits for the "
                     "last prompt position (informational)."),
           "variants": {}, "max_abs_dequant_vs_f32": {}}

    f32_path = out_dir / f"{name}-f32.gguf"
    for var in spec["variants"]:
        path = out_dir / f"{name}-{var}.gguf"
        if var in ("f32", "f16", "bf16", "q8_0"):
            convert(hf_dir, path, var, tokpre)
        else:
            quantize(f32_path, path, var)
        rd, gg, types = read_gguf(path)
        if var == "f32":
            meta_report[name] = gguf_metadata(rd)
        sd = effective_state_dict(spec["arch"], gg, nh, nkv)
        if var == "f32":
            # self-check of the inverse mapping: f32 GGUF must give back the HF weights bit for bit
            for k, v in sd.items():
                assert torch.equal(v, orig_sd[k]), f"f32 roundtrip mismatch {k}"
        load_effective(model, dict(sd), tied)
        logits = hf_logits(model, prompt_ids)
        greedy = hf_greedy(model, prompt_ids, 24)
        entry = {"file": path.name, "tensor_types": types, "logits": [r7list(row) for row in logits],
                 "greedy_ids": greedy, "greedy_top2_margins": [r7(m) for m in hf_greedy.last_margins]}
        gen = hf_generate(model, prompt_ids, 24)
        if gen != greedy:
            entry["greedy_ids_hf_generate_eos_suppressed"] = gen
        ll = llamacpp_last_logits(path, prompt_ids)
        if ll is not None:
            entry["llamacpp_last_logits"] = ll
            entry["llamacpp_vs_hf_last_max_abs"] = r7(np.max(np.abs(np.array(ll) - logits[-1])))
        ref["variants"][var] = entry
        ref["max_abs_dequant_vs_f32"][var] = {k: r7(float((v - orig_sd[k]).abs().max())) for k, v in sd.items()
                                              if k in orig_sd and v.shape == orig_sd[k].shape}
        print(f"  {var}: {path.stat().st_size} bytes; types {sorted(set(types.values()))}; greedy {greedy}"
              + (f"; llama.cpp max|d| {entry.get('llamacpp_vs_hf_last_max_abs')}" if ll is not None else ""))
        # restore the original weights for the next variant
        with torch.no_grad():
            for k, v in model.state_dict().items():
                v.copy_(orig_sd[k])
    (out_dir / "reference.json").write_text(json.dumps(ref, separators=(",", ":")) + "\n")


# ----------------------------------------------------------------------------------------------
# stories260K reference (derived from read-only shared data; nothing is copied)
# ----------------------------------------------------------------------------------------------

def do_stories(shared: Path):
    print("== stories260k")
    base = shared / "models" / "stories260K"
    hf = base / "hf"
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    prompt = "Once upon a time"
    ids = tok.encode(prompt).ids
    assert ids == [1, 403, 407, 261, 378], ids
    model = LlamaForCausalLM.from_pretrained(hf, torch_dtype=torch.float32, attn_implementation="eager").eval()
    cfg = model.config
    orig_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    N = 200
    ref = {"model": "stories260K", "generator": "tools/make_fixtures.py", "versions": versions(),
           "source": "/work/shared/models/stories260K/hf (transformers, float32, eager attention)",
           "prompt": prompt, "prompt_ids": ids,
           "notes": ("logits: all 5 prompt positions (BOS + 4 text tokens), 7 significant digits. greedy_ids: pure "
                     "argmax continuation of 200 tokens (no EOS suppression, no stopping); if transformers "
                     "generate(min_new_tokens=max_new_tokens=200), which suppresses EOS, differs it is stored "
                     "as greedy_ids_hf_generate_eos_suppressed. greedy_text: tokenizer decode of greedy_ids.")}
    logits = hf_logits(model, ids)
    greedy = hf_greedy(model, ids, N)
    ref["logits"] = [r7list(r) for r in logits]
    ref["greedy_ids"] = greedy
    ref["greedy_top2_margins"] = [r7(m) for m in hf_greedy.last_margins]
    ref["greedy_text"] = tok.decode(greedy, skip_special_tokens=False)
    gen = hf_generate(model, ids, N)
    if gen != greedy:
        ref["greedy_ids_hf_generate_eos_suppressed"] = gen
    print("  greedy:", repr(ref["greedy_text"][:200]))
    # q8_0 effective weights
    rd, gg, types = read_gguf(base / "stories260K-q8_0.gguf")
    sd = effective_state_dict("llama", gg, cfg.num_attention_heads, cfg.num_key_value_heads)
    load_effective(model, sd, True)
    ql = hf_logits(model, ids)
    qg = hf_greedy(model, ids, N)
    q = {"file": "/work/shared/models/stories260K/stories260K-q8_0.gguf (not copied)", "tensor_types": types,
         "logits": [r7list(r) for r in ql], "greedy_ids": qg,
         "greedy_top2_margins": [r7(m) for m in hf_greedy.last_margins], "greedy_text": tok.decode(qg, skip_special_tokens=False)}
    qgen = hf_generate(model, ids, N)
    if qgen != qg:
        q["greedy_ids_hf_generate_eos_suppressed"] = qgen
    ll = llamacpp_last_logits(base / "stories260K-q8_0.gguf", ids)
    if ll is not None:
        q["llamacpp_last_logits"] = ll
        q["llamacpp_vs_hf_last_max_abs"] = r7(np.max(np.abs(np.array(ll) - ql[-1])))
    ref["q8_0"] = q
    # and a sanity check that the f32 GGUF maps back onto the HF weights exactly
    _, gf, _ = read_gguf(base / "stories260K-f32.gguf")
    sdf = effective_state_dict("llama", gf, cfg.num_attention_heads, cfg.num_key_value_heads)
    for k, v in sdf.items():
        assert torch.equal(v, orig_sd[k]), k
    ll = llamacpp_last_logits(base / "stories260K-f32.gguf", ids)
    if ll is not None:
        ref["llamacpp_last_logits_f32"] = ll
        ref["llamacpp_vs_hf_last_max_abs_f32"] = r7(np.max(np.abs(np.array(ll) - logits[-1])))
    print("  q8_0 greedy same as f32 for", next((i for i, (a, b) in enumerate(zip(greedy, qg)) if a != b), N), "tokens")
    out = FIX / "stories260k"
    out.mkdir(parents=True, exist_ok=True)
    (out / "reference.json").write_text(json.dumps(ref, separators=(",", ":"), ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------------------------
# quant block vectors
# ----------------------------------------------------------------------------------------------

def f16b_of(vals):
    return np.asarray(vals, dtype=np.float16).view(np.uint8)


def do_quant_blocks():
    print("== quant_blocks")
    rng = np.random.default_rng(12345)
    Q = gguf.GGMLQuantizationType

    def f16b(vals):
        return np.asarray(vals, dtype=np.float16).view(np.uint8)

    def block(kind: str) -> np.ndarray:
        if kind == "Q8_0":  # d (f16) + 32 x int8
            return np.concatenate([f16b([rng.uniform(0.001, 0.05) * rng.choice([-1, 1])]),
                                   rng.integers(-128, 128, 32).astype(np.int8).view(np.uint8)])
        if kind == "Q4_0":  # d (f16) + 16 bytes of nibbles
            return np.concatenate([f16b([rng.uniform(0.001, 0.05) * rng.choice([-1, 1])]),
                                   rng.integers(0, 256, 16).astype(np.uint8)])
        if kind == "Q4_K":  # d, dmin (f16), 12 bytes packed 6-bit scales/mins, 128 bytes nibbles
            return np.concatenate([f16b([rng.uniform(0.0005, 0.01), rng.uniform(0.0005, 0.01)]),
                                   rng.integers(0, 256, 12).astype(np.uint8), rng.integers(0, 256, 128).astype(np.uint8)])
        if kind == "Q6_K":  # ql[128], qh[64], scales int8[16], d (f16)
            return np.concatenate([rng.integers(0, 256, 192).astype(np.uint8),
                                   rng.integers(-128, 128, 16).astype(np.int8).view(np.uint8),
                                   f16b([rng.uniform(0.0005, 0.01) * rng.choice([-1, 1])])])
        raise ValueError(kind)

    out = {"generator": "tools/make_fixtures.py", "versions": versions(),
           "notes": ("bytes: hex of `rows` rows laid out back to back (each row = blocks_per_row blocks); "
                     "values: gguf.quants.dequantize(bytes, type) as float32 (exactly representable in JSON "
                     "doubles), row-major, rows*elements_per_row values."), "types": {}}
    for kind, blocks_per_row, rows in (("Q8_0", 4, 2), ("Q4_0", 4, 2), ("Q4_K", 2, 2), ("Q6_K", 2, 2)):
        qt = Q[kind]
        blk, tsz = gguf.GGML_QUANT_SIZES[qt]
        data = np.stack([np.concatenate([block(kind) for _ in range(blocks_per_row)]) for _ in range(rows)])
        assert data.shape[1] == blocks_per_row * tsz, (kind, data.shape)
        vals = dequantize(data, qt).astype(np.float32)
        assert vals.shape == (rows, blocks_per_row * blk) and np.all(np.isfinite(vals))
        out["types"][kind] = {"ggml_type": int(qt), "block_size": blk, "type_size": tsz, "rows": rows,
                              "blocks_per_row": blocks_per_row, "elements_per_row": blocks_per_row * blk,
                              "bytes": data.tobytes().hex(), "values": [float(v) for v in vals.ravel()]}
    # F16 / BF16: 2 rows x 32 values, including a few special-but-finite values (subnormal, -0.0)
    for kind in ("F16", "BF16"):
        qt = Q[kind]
        x = (rng.standard_normal((2, 32)) * 3).astype(np.float32)
        x[0, 0], x[0, 1], x[0, 2], x[0, 3] = -0.0, 1e-6, 65504.0 if kind == "F16" else 1e30, 1.0
        if kind == "F16":
            raw = x.astype(np.float16).view(np.uint8).reshape(2, 64)
        else:
            raw = (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(2, 64)  # truncation, valid bf16
        vals = dequantize(raw.view(np.float16) if kind == "F16" else raw, qt).astype(np.float32)
        assert vals.shape == (2, 32)
        out["types"][kind] = {"ggml_type": int(qt), "block_size": 1, "type_size": 2, "rows": 2, "blocks_per_row": 32,
                              "elements_per_row": 32, "bytes": raw.tobytes().hex(),
                              "values": [float(v) for v in vals.ravel()]}
    # Q5_0 (Q4_K_M files use it for rows that are not whole super-blocks of 256), from a generator
    # of its own so the entries above stay as they were: d (f16), qh (32 fifth bits), 16 bytes of
    # nibbles.
    rng5 = np.random.default_rng(5005)
    qt = Q["Q5_0"]
    blk, tsz = gguf.GGML_QUANT_SIZES[qt]
    data = np.stack([np.concatenate([np.concatenate([
        f16b_of([rng5.uniform(0.001, 0.05) * rng5.choice([-1, 1])]),
        rng5.integers(0, 256, 4).astype(np.uint8), rng5.integers(0, 256, 16).astype(np.uint8)])
        for _ in range(4)]) for _ in range(2)])
    vals = dequantize(data, qt).astype(np.float32)
    out["types"]["Q5_0"] = {"ggml_type": int(qt), "block_size": blk, "type_size": tsz, "rows": 2,
                            "blocks_per_row": 4, "elements_per_row": 4 * blk, "bytes": data.tobytes().hex(),
                            "values": [float(v) for v in vals.ravel()]}
    # Q5_1 and Q5_K (Q5_K_M files: Q5_K, and Q5_1 for rows that are not whole super-blocks of
    # 256), again from generators of their own. Q5_1: d, m (f16), qh, 16 bytes of nibbles;
    # Q5_K: d, dmin (f16), 12 bytes of packed 6-bit scales/mins, qh[32], 128 bytes of nibbles.
    rng51 = np.random.default_rng(5105)
    rng5k = np.random.default_rng(5505)

    def q5_1_block():
        return np.concatenate([f16b_of([rng51.uniform(0.001, 0.05), rng51.uniform(-0.8, 0.0)]),
                               rng51.integers(0, 256, 20).astype(np.uint8)])

    def q5_k_block():
        return np.concatenate([f16b_of([rng5k.uniform(0.0005, 0.01), rng5k.uniform(0.0005, 0.01)]),
                               rng5k.integers(0, 256, 12 + 32 + 128).astype(np.uint8)])

    for kind, make, blocks_per_row in (("Q5_1", q5_1_block, 4), ("Q5_K", q5_k_block, 2)):
        qt = Q[kind]
        blk, tsz = gguf.GGML_QUANT_SIZES[qt]
        data = np.stack([np.concatenate([make() for _ in range(blocks_per_row)]) for _ in range(2)])
        assert data.shape[1] == blocks_per_row * tsz, (kind, data.shape)
        vals = dequantize(data, qt).astype(np.float32)
        out["types"][kind] = {"ggml_type": int(qt), "block_size": blk, "type_size": tsz, "rows": 2,
                              "blocks_per_row": blocks_per_row, "elements_per_row": blocks_per_row * blk,
                              "bytes": data.tobytes().hex(), "values": [float(v) for v in vals.ravel()]}
    out["versions"]["gguf_q5_1_q5_k"] = f"gguf-py {gguf_py_version()} (the Q5_1 and Q5_K entries)"
    (FIX / "quant_blocks.json").write_text(json.dumps(out, indent=1) + "\n")


def main():
    only = set(filter(None, ARGS.only.split(",")))
    want = lambda k: not only or k in only  # noqa: E731
    FIX.mkdir(parents=True, exist_ok=True)
    work = Path(ARGS.workdir) if ARGS.workdir else Path(tempfile.mkdtemp(prefix="nexttoken_fixtures_"))
    meta = {}
    if want("quant_blocks"):
        do_quant_blocks()
    for name, spec in SPECS.items():
        if want(name):
            do_model(name, spec, work, meta)
    if want("stories260k"):
        if (Path(ARGS.shared) / "models" / "stories260K").is_dir():
            do_stories(Path(ARGS.shared))
        else:
            print("!! shared data missing, stories260k reference skipped")
    if meta:
        (work / "gguf_metadata.json").write_text(json.dumps(meta, indent=1, default=str))
        print("metadata dump:", work / "gguf_metadata.json")


if __name__ == "__main__":
    main()
