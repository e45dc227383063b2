"""AWQ through llm-compressor: its own environment (`make llmc-env`), used only by its make target and the child
process; its compressed-tensors artifact loads and scores in the main environment."""

import ast
import importlib.util
import json
from pathlib import Path

import pytest

from pipeline.cli import run
from pipeline.config.schema import PROJECT_ROOT
from pipeline.compose import load_variant
from pipeline.quantizers.base import Skip
from pipeline.quantizers.llmc import WORKER, environment_python

try:
    LLMC_PYTHON = environment_python()
    NO_ENV = ""
except Skip as exc:
    LLMC_PYTHON, NO_ENV = None, str(exc)
needs_env = pytest.mark.skipif(LLMC_PYTHON is None, reason=f"llm-compressor's environment is absent: {NO_ENV}")


def test_llm_compressor_never_enters_the_main_environment():
    assert importlib.util.find_spec("llmcompressor") is None, "llm-compressor belongs in `make llmc-env` only"
    tree = ast.parse(WORKER.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "pipeline" not in imported, "the worker runs in another environment: it may not import quantdrift"
    assert "llmcompressor" in imported
    # nothing in the main package imports llm-compressor; only the worker does
    for path in (PROJECT_ROOT / "pipeline").rglob("*.py"):
        if path != WORKER:
            assert "import llmcompressor" not in path.read_text() and "from llmcompressor" not in path.read_text(), path
    makefile = (PROJECT_ROOT / "Makefile").read_text()
    assert "llmcompressor==$(LLMC_VERSION)" in makefile and "$(LLMC_VENV)/bin/python -m pip install" in makefile


def test_a_missing_environment_skips_the_variant_with_the_make_target_to_run(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTDRIFT_LLMC_PYTHON", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(Skip, match=r"make llmc-env"):
        environment_python()


def test_the_child_runs_on_the_environments_interpreter_without_this_projects_path(monkeypatch, tmp_path,
                                                                                    tiny_llama):
    """Wiring: the worker is started with the environment's own python, the calibration as token ids, and no
    PYTHONPATH or VIRTUAL_ENV leaking the main environment into it."""
    import pipeline.quantizers.llmc as llmc
    from pipeline.stages.prepare import prepare
    from tests.conftest import compose

    python = tmp_path / "env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    site = tmp_path / "env" / "lib" / "python3.11" / "site-packages"
    for dist in ("llmcompressor-0.14.0.1", "compressed_tensors-0.19.0"):
        (site / f"{dist}.dist-info").mkdir(parents=True)
    monkeypatch.setenv("QUANTDRIFT_LLMC_PYTHON", str(python))
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    seen = {}

    def fake_worker(argv, scratch, env, what):
        seen.update(argv=argv, env=env, spec=json.loads(Path(argv[2]).read_text()))
        return {"peak_rss_mb": 1.0, "samples": 2, "tokens": 10}, 0.5

    monkeypatch.setattr(llmc, "run_worker", fake_worker)
    cfg = compose([f"model.source={tiny_llama}", "model.name=tiny", f"paths.artifacts={tmp_path / 'a'}"])
    original = prepare(cfg.model, cfg.model_dir)
    v = load_variant("awq_w4_llmc")
    v.quantize["calibration"]["samples"] = 2
    q = llmc.LLMCompressorQuantizer(v, original, cfg)
    assert q.key()["environment"] == {"compressed-tensors": "0.19.0", "llmcompressor": "0.14.0.1"}
    facts = q.build(tmp_path / "out")
    assert seen["argv"][:2] == [str(python), str(WORKER)]
    assert "PYTHONPATH" not in seen["env"] and "VIRTUAL_ENV" not in seen["env"]
    assert len(seen["spec"]["calibration"]) == 2 and all(isinstance(i, int) for i in seen["spec"]["calibration"][0])
    assert seen["spec"]["settings"]["group_size"] == 64 and seen["spec"]["settings"]["save_dtype"] == "float16"
    assert facts["format"] == "compressed-tensors" and facts["calibration_tokens"] == 10


@needs_env
@pytest.mark.slow
def test_an_llm_compressor_artifact_loads_scores_and_reports_its_producer_in_the_main_environment(
        tiny_cfg, tmp_path, tiny_tokenizer_dir):
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from pipeline.figures import drift as metrics
    from pipeline.quantizers.dequant import dense_state_dict

    # a tiny model whose hidden size gives AWQ group 64 (the same group as SmolLM2's)
    from tests.conftest import build_tiny_llama

    model = build_tiny_llama(tmp_path / "m", tiny_tokenizer_dir, hidden=192, layers=2)
    for v in ("original", "awq_w4_llmc"):
        assert run(tiny_cfg(f"model.source={model}", f"variant={v}")) == 0
    report = tiny_cfg(f"model.source={model}", "command=report", "run.variants=[original,awq_w4_llmc]")
    assert run(report) == 0
    summary = json.loads((report.results_dir / "summary.json").read_text())
    v = summary["variants"]["awq_w4_llmc"]
    assert v["status"] == "ok", v.get("reason")
    p = v["artifact"]["producer"]
    assert p["tool"] == "llm-compressor" and p["version"] == "0.14.0.1"
    assert p["recipe"].startswith("AWQ W4, g64, asym, float32 compute, float16 unquantized tensors, ")
    assert 0 < v["drift"]["kld_mean"] < 1.0 and v["artifact"]["bits_per_weight"] < 16
    assert "llm-compressor 0.14.0.1" in (report.results_dir / "report.md").read_text()
    assert "dequantized at load from compressed-tensors pack-quantized" in v["kernel"]
    # no native kernel on a CPU: its speed and memory are a dense model's, so none is shown, ranked or planned with
    assert v["no_native_kernel"].startswith("no native kernel on this device") and v["roofline"] is None
    assert "capacity" not in v and "awq_w4_llmc" not in summary["recommendation"]["pareto_front"]
    md = (report.results_dir / "report.md").read_text()
    assert "awq_w4_llmc ‡" in md and "‡ `awq_w4_llmc`: no native kernel on this device" in md
    # free-running asked for the dequantized stand-in (the variant's free_running: dequantized), and the check
    # of the stand-in against the kernel ran, whichever way it decided
    check = v["paths"]["dequantized_check"]
    assert check and "kld_gap" in check and "top1_agreement" in check, check
    # the checkpoint is compressed-tensors, loads with plain transformers (dequantized at load, as the runtime does:
    # transformers cannot hold packed asymmetric zero points compressed), and the dequantized stand-in is exact
    folder = Path(v["artifact"]["path"])
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    ids = torch.arange(5, 69).unsqueeze(0)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
        kernel = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
        dense = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
        state, _ = dense_state_dict(folder)
        missing, unexpected = dense.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
        dense.tie_weights()
        lr, lk, ld = (torch.log_softmax(m(ids).logits[0].float(), -1).numpy() for m in (ref, kernel, dense))
    assert np.isfinite(lk).all()
    kld_k, kld_d = metrics.kld_full(lr, lk).mean(), metrics.kld_full(lr, ld).mean()
    assert kld_k > 0 and abs(kld_d - kld_k) / kld_k < 0.01, (kld_k, kld_d)
