"""`switchyard determinism` end to end, as a user runs it: the command starts its own
engine (llama-server here; vLLM in tests/integration/test_vllm_determinism.py), runs
the prompts alone, in batches, joining a running batch and after a restart, and
reports each case (support/determinism.py runs the command and checks the report).

Only what the engine promises is asserted as equality: greedy decoding of a prompt
alone, twice, on the same engine. The other cases are reported, not assumed."""

from __future__ import annotations

from support.determinism import check_report, run_determinism


def test_determinism_on_llama_server() -> None:
    model = {
        "alias": "smol",
        "engine": {"kind": "llamacpp", "gguf": "auto", "threads": 2, "ctx": 1024},
    }
    code, report = run_determinism(model, timeout_s=300)
    check_report(code, report, "llamacpp")
