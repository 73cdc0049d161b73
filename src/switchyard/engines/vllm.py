"""vLLM as a managed engine: Switchyard starts and supervises its OpenAI server.

The server runs from its own virtual environment (`make vllm` builds `.venv-vllm`:
vLLM's dependencies may move torch, starlette or pydantic, and it is a subprocess
anyway) as `python -m vllm.entrypoints.openai.api_server` (its `vllm` console script
fails on a metadata lookup in the CPU build). Supervision, readiness (a real
multi-token chat answered), restarts, residency and adapter checksums are the
llama.cpp supervisor's (engines/llamacpp.py); only the command, the model folder and
the adapters' form differ: vLLM takes PEFT adapter folders (`--lora-modules
name=path`) and serves each under its name, so a request names its adapter as the
model and no `lora` list is sent. On a GPU machine this is only configuration.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import aiohttp

from switchyard.config import VllmEngine
from switchyard.engines.llamacpp import AdapterFile, ManagedLlamaCpp


def vllm_python(spec: VllmEngine) -> str:
    """The Python of vLLM's own virtual environment."""
    if spec.python != "auto":
        return spec.python
    venv = Path(sys.prefix)
    beside = venv.with_name(venv.name + "-vllm") / "bin" / "python"
    if beside.exists():
        return str(beside)
    raise FileNotFoundError(
        f"vLLM is not installed: no {beside} (run `make vllm`, or set engine.python)"
    )


class ManagedVllm(ManagedLlamaCpp):
    kind = "vllm"
    # vLLM's API server stops its engine-core process on SIGTERM; SIGKILL would
    # orphan that process (and the model it holds).
    parent_death_signal = "TERM"
    # Not in a session of its own: its worker processes were seen to outlive the API
    # server and its engine core for seconds at 90 % of a core (reparented to init), so
    # vLLM stays in the gateway's process group, where whatever stops that group (a
    # supervisor, a terminal's Ctrl-C) stops all of them at once.
    own_session = False

    @property
    def vllm(self) -> VllmEngine:
        assert isinstance(self.spec, VllmEngine)
        return self.spec

    def runtime_info(self) -> dict[str, Any]:
        spec = self.vllm
        return {
            "runtime": "vllm",
            "parallel": spec.max_num_seqs,
            "dtype": spec.dtype,
            "enforce_eager": spec.enforce_eager,
        }

    def resolve(self) -> tuple[str, str]:
        spec = self.vllm
        python = vllm_python(spec)
        if spec.model == "auto":
            from switchyard.engines.hf_base import hf_base_dir

            model = str(hf_base_dir())
        else:
            model = spec.model
        if not (Path(model) / "config.json").exists():
            raise FileNotFoundError(f"the model folder cannot be used: no config.json in {model}")
        return model, python

    def command(self, model: str, binary: str, port: int, loras: list[AdapterFile]) -> list[str]:
        spec = self.vllm
        cmd = [
            binary,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--served-model-name",
            self.alias,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            spec.dtype,
            "--max-model-len",
            str(spec.max_model_len),
            "--max-num-seqs",
            str(spec.max_num_seqs),
            "--kv-cache-memory-bytes",
            str(spec.kv_cache_mb * 1024 * 1024),
        ]
        if spec.enforce_eager:
            cmd.append("--enforce-eager")
        if spec.scheduling_policy != "fcfs":
            cmd += ["--scheduling-policy", spec.scheduling_policy]
        if self.adapters:
            # --max-loras: adapters in one batch (the active cap); --max-cpu-loras: the
            # ones kept loaded. Loaded ones beyond those at start come at run time.
            cmd += ["--enable-lora", "--max-loras", str(max(1, spec.active_adapters))]
            cmd += ["--max-cpu-loras", str(max(1, spec.max_adapters))]
            if loras:
                cmd += ["--lora-modules", *(f"{a.name}={a.path}" for a in loras)]
        return cmd + list(spec.extra_args)

    @property
    def isolate_base(self) -> bool:
        return bool(self.adapters) and not self.vllm.base_beside_adapters

    def env(self) -> dict[str, str] | None:
        """Runtime adapter loading on when more adapters are registered than it loads:
        only the gateway calls it (the server listens on 127.0.0.1), with the
        registry's paths, after their checksum."""
        if len(self.adapters) <= self.spec.max_adapters:
            return None
        return {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}

    async def swap_adapter(self, evict: str | None, load: AdapterFile) -> bool:
        root = self.base_url
        timeout = aiohttp.ClientTimeout(total=120, sock_connect=2)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            if evict is not None:
                await _post(session, root + "/unload_lora_adapter", {"lora_name": evict})
                self.adapter_ids.pop(evict, None)
                self.adapter_loaded_at.pop(evict, None)
            body = {"lora_name": load.name, "lora_path": load.path}
            await _post(session, root + "/load_lora_adapter", body)
        self.adapter_ids[load.name] = max(self.adapter_ids.values(), default=-1) + 1
        return True

    def adapter_digest_path(self, a: AdapterFile) -> str:
        return os.path.join(a.path, "adapter_model.safetensors")

    def estimated_mb(self) -> float | None:
        """The weights on disk and the runtime (vLLM on CPU holds ~1.5 GB besides)."""
        try:
            model, _ = self.resolve()
        except Exception:
            return None
        size = sum(p.stat().st_size for p in Path(model).glob("*.safetensors"))
        return size / (1 << 20) + self.vllm.kv_cache_mb + 1536.0

    def info_line(self, line: str) -> bool:
        return line.startswith(("INFO", "DEBUG", "(APIServer pid=")) and " WARNING " not in line

    def spec_runtime(self) -> str:
        return "vllm"

    async def after_health(self, session: aiohttp.ClientSession) -> bool:
        return True


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, str]) -> None:
    try:
        async with session.post(url, json=body) as r:
            if r.status != 200:
                text = (await r.text())[:200]
                raise RuntimeError(f"{url.rsplit('/', 1)[-1]} answered {r.status}: {text}")
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise RuntimeError(f"{url.rsplit('/', 1)[-1]} failed ({type(exc).__name__})") from exc
