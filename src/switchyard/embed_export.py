"""The ONNX export of all-MiniLM-L6-v2 and its disk cache.

Exported once per (weights, torch, onnx, onnxruntime) combination (`export_key`),
written to a temporary file and renamed into place under a file lock, so concurrent
starts neither corrupt it nor export twice; the int8 file is the fused float32 graph
quantised per channel. Exports of other keys that nothing loaded for a week are pruned.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from switchyard.config import EmbeddingsConfig

log = logging.getLogger("switchyard.embed")

# Bumped whenever the export recipe below changes: part of the on-disk cache key.
EXPORT_RECIPE = "minilm-meanpool-l2-opset17-eager/bert-fused/int8-dynamic-per-channel/v2"
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")


def cache_dir(cfg: EmbeddingsConfig) -> Path:
    if cfg.cache_dir != "auto":
        return Path(cfg.cache_dir)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "switchyard"


def export_key(path: str) -> str:
    """Hash of the weights, tokenizer and model config, the export recipe and the
    versions that shape the exported graph."""
    from importlib.metadata import version  # not `import torch`: that costs seconds

    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json"):
        f = Path(path) / name
        if f.exists():
            h.update(name.encode())
            with f.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    parts = [EXPORT_RECIPE] + [version(p) for p in ("torch", "onnx", "onnxruntime")]
    for part in parts:
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:20]


def exported_model(path: str, int8: bool, directory: Path) -> str:
    """Path of the cached ONNX file for these weights, exporting it first if needed."""
    directory.mkdir(parents=True, exist_ok=True)
    key = export_key(path)
    fp32 = directory / f"all-minilm-l6-v2-{key}-fp32.onnx"
    final = directory / f"all-minilm-l6-v2-{key}-int8.onnx" if int8 else fp32
    if not final.exists():
        with _locked(directory / f"all-minilm-l6-v2-{key}.lock"):
            if not fp32.exists():
                log.info("exporting all-MiniLM-L6-v2 to ONNX: %s", fp32)
                _atomic_write(fp32, lambda tmp: _export_fp32(path, tmp))
            if int8 and not final.exists():  # or another process made it meanwhile
                log.info("quantising to int8: %s", final)
                _atomic_write(final, lambda tmp: _quantize_int8(path, fp32, tmp))
    prune_exports(directory, key)
    return str(final)


EXPORT_UNUSED_S = 7 * 86400  # an export no process has loaded for this long is removed


def prune_exports(directory: Path, key: str, now: float | None = None) -> list[str]:
    """Mark this key's exports as used, and remove other keys' exports (earlier
    weights, recipes or library versions) that nothing has loaded for a week, and
    leftovers of interrupted exports. The grace period lets installs with different
    keys share the directory without exporting in turn. Returns what was removed."""
    now = time.time() if now is None else now
    removed: list[str] = []
    for f in directory.glob("all-minilm-l6-v2-*"):
        try:
            if f.name.startswith(f"all-minilm-l6-v2-{key}-") and f.suffix == ".onnx":
                os.utime(f, (now, now))
                continue
            stale = now - f.stat().st_mtime > EXPORT_UNUSED_S
            if stale and (f.suffix == ".onnx" or f.name.endswith(".tmp")):
                size = f.stat().st_size
                f.unlink()
                removed.append(f.name)
                log.info("removed unused embedding export %s (%.0f MB)", f.name, size / 1e6)
        except OSError as exc:  # another process pruned it first, or it is not ours
            log.debug("could not prune %s: %s", f, exc)
    return removed


@contextlib.contextmanager
def _locked(lock_path: Path) -> Any:
    import fcntl

    with lock_path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _atomic_write(final: Path, write: Callable[[Path], None]) -> None:
    fd, name = tempfile.mkstemp(prefix=final.name + ".", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        tmp.chmod(0o644)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def _export_fp32(path: str, dest: Path) -> None:
    import torch
    from transformers import AutoModel

    # Eager attention: the SDPA path bakes mask shortcuts into a traced graph.
    model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()

    class Pooled(torch.nn.Module):
        def __init__(self, m: Any) -> None:
            super().__init__()
            self.m = m

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            hidden = self.m(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state
            mean = mean_pooled(hidden, attention_mask)
            return torch.nn.functional.normalize(mean, p=2.0, dim=1)

    # A padded example, so the traced graph is the general (masked) one.
    ids = torch.full((2, 8), 1000, dtype=torch.long)
    mask = torch.ones((2, 8), dtype=torch.long)
    mask[1, 5:] = 0
    export_onnx(Pooled(model), (ids, mask, torch.zeros_like(ids)), dest, "embedding")


def mean_pooled(hidden: Any, attention_mask: Any) -> Any:
    """The mean of the real tokens' states (torch): the pooling of all-MiniLM-L6-v2."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


def export_onnx(module: Any, example: tuple[Any, ...], dest: Path, output: str) -> None:
    """Trace a torch module taking INPUT_NAMES to ONNX (opset 17), batch and token
    axes dynamic, its one output named `output`."""
    import torch

    axes = {name: {0: "batch", 1: "tokens"} for name in INPUT_NAMES}
    # The tracer warns about Python-level branches in transformers' masking code that
    # are constant for this model; the exports are checked against torch in the tests.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            example,
            str(dest),
            input_names=list(INPUT_NAMES),
            output_names=[output],
            dynamic_axes={**axes, output: {0: "batch"}},
            opset_version=17,
            dynamo=False,
        )


def _quantize_int8(path: str, src: Path, dest: Path) -> None:
    """Fuse the BERT blocks (attention, skip+LayerNorm, bias+GELU: ONNX Runtime's
    transformer optimizer), then quantise the weights to int8 per channel. Fusion cut
    the single-sentence forward pass by ~20 % here, with the same vectors."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.transformers.optimizer import optimize_model

    cfg = json.loads((Path(path) / "config.json").read_text())
    fused = dest.with_name(dest.name + ".fused.onnx")
    try:
        model = optimize_model(
            str(src),
            model_type="bert",
            num_heads=int(cfg["num_attention_heads"]),
            hidden_size=int(cfg["hidden_size"]),
            opt_level=1,
        )
        model.save_model_to_file(str(fused))
        quantize_dynamic(
            str(fused),
            str(dest),
            weight_type=QuantType.QInt8,
            per_channel=True,
            # Fused ops come from ONNX Runtime's own domain, which shape inference
            # does not type: their outputs are float32.
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )
    finally:
        fused.unlink(missing_ok=True)
