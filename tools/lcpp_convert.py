"""llama.cpp's own `convert_hf_to_gguf.py`, run on a Hugging Face folder: what both
tools/make_fixtures.py and tools/train_default_model.py export their models with."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# Runs the converter from llama.cpp's source tree ($LCPP_DIR), naming the pre-tokenizer of a
# freshly trained tokenizer (unknown to llama.cpp's hash table) from $FIXTURE_TOKPRE.
CONVERT_WRAPPER = r'''
import os, sys, runpy
lcpp = os.environ["LCPP_DIR"]
sys.path.insert(0, lcpp); sys.path.insert(0, os.path.join(lcpp, "gguf-py"))
import conversion.base as base
_orig = base.TextModel.get_vocab_base_pre
def _patched(self, tokenizer):
    # our trained tokenizers are unknown to llama.cpp's hash table: name the pre-tokenizer explicitly
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:
        return os.environ["FIXTURE_TOKPRE"]
base.TextModel.get_vocab_base_pre = _patched
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
runpy.run_path(os.path.join(lcpp, "convert_hf_to_gguf.py"), run_name="__main__")
'''


def convert(lcpp: Path, hf_dir: Path, out: Path, outtype: str, tokpre: str = "default"):
    """Convert `hf_dir` to the GGUF `out` (`outtype`: f32, f16, bf16, q8_0) with the llama.cpp
    source tree at `lcpp`; exits with the converter's output on failure."""
    env = dict(os.environ, LCPP_DIR=str(lcpp), FIXTURE_TOKPRE=tokpre, NO_LOCAL_GGUF="1",
               PYTHONPATH=str(lcpp / "gguf-py"))
    r = subprocess.run([sys.executable, "-c", CONVERT_WRAPPER, str(hf_dir), "--outfile", str(out),
                        "--outtype", outtype], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stdout[-3000:], r.stderr[-6000:])
        raise SystemExit(f"convert failed for {out}")
