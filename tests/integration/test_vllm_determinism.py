"""`switchyard determinism` on the `vllm` engine kind (a real vLLM, CPU build, from
.venv-vllm): the same cases and report as on llama-server
(tests/integration/test_determinism.py). Its own module, so it runs after
tests/integration/test_vllm.py's vLLM has stopped (keep the three test_vllm*.py files
together, in this name order)."""

from __future__ import annotations

from support.determinism import check_report, run_determinism


def test_determinism_on_vllm() -> None:
    model = {
        "alias": "smol-vllm",
        "engine": {"kind": "vllm", "max_model_len": 1024, "max_num_seqs": 2},
    }
    code, report = run_determinism(model, timeout_s=900)
    check_report(code, report, "vllm")
