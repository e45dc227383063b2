"""Bad inputs get a clear message naming the input and what was expected (exit 2) and lose nothing; faults
(kill -9, a crashing variant, a full disk) lose nothing and explain themselves."""

import json
import os
import shutil
import signal
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from pipeline.cli import EXIT_BAD_INPUT, EXIT_VARIANT_FAILED, run
from pipeline.config.schema import PROJECT_ROOT
from pipeline.infra.errors import ConfigError
from tests.conftest import compose

pytestmark = pytest.mark.slow


def _copy_model(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def _without_chat_template(model: Path) -> Path:
    tok_cfg = json.loads((model / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    for f in model.glob("chat_template.*"):
        f.unlink()
    return model


def _cfg(model: Path, root: Path, *extra):
    return compose([f"model.source={model}", "model.name=tiny", "profile=smoke", "run.suites=[smoke]",
                    f"paths.artifacts={root / 'artifacts'}", f"paths.results={root / 'results'}",
                    f"paths.cache={PROJECT_ROOT / '.cache'}", *extra])


def test_truncated_safetensors_is_named(tmp_path, tiny_llama):
    model = _copy_model(tiny_llama, tmp_path / "m")
    weights = next(model.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ConfigError, match="is not a readable safetensors file"):
        run(_cfg(model, tmp_path, "variant=original"))


def test_truncated_gguf_source_is_named(tmp_path, embedded_gguf):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(embedded_gguf.read_bytes()[:4096])
    with pytest.raises(ConfigError, match=r"model.source: could not (load GGUF|read the GGUF metadata of) .*broken.gguf"):
        run(compose([f"model.source={bad}", f"paths.artifacts={tmp_path / 'a'}", "variant=original"]))


def test_a_damaged_artifact_is_rebuilt_or_named_and_the_rest_kept(tmp_path, tiny_llama, caplog):
    """A truncated file no longer matches its manifest and is rebuilt; one damaged in place (same size) cannot
    be detected cheaply, and llama.cpp's refusal is reported with the file named."""
    import logging

    assert run(_cfg(tiny_llama, tmp_path, "variant=gguf_q8_0")) == 0
    art = tmp_path / "artifacts" / "tiny" / "variants" / "gguf_q8_0"
    evaluation = tmp_path / "artifacts" / "tiny" / "runs" / "smoke" / "gguf_q8_0"
    gguf = next(art.glob("*.gguf"))
    good = gguf.read_bytes()
    gguf.write_bytes(good[:2048])
    shutil.rmtree(evaluation)
    with caplog.at_level(logging.WARNING):
        assert run(_cfg(tiny_llama, tmp_path, "variant=gguf_q8_0")) == 0
    assert "changed on disk since it was built" in caplog.text and gguf.read_bytes() == good
    gguf.write_bytes(b"\0" * len(good))
    shutil.rmtree(evaluation)
    with pytest.raises(ConfigError, match="truncated or corrupted"):
        run(_cfg(tiny_llama, tmp_path, "variant=gguf_q8_0"))
    assert (tmp_path / "artifacts" / "tiny" / "reference" / "smoke" / "smoke" / "manifest.json").is_file()


def test_an_architecture_the_converter_does_not_support_skips_gguf_only(tmp_path, tiny_llama):
    model = _copy_model(tiny_llama, tmp_path / "m")
    cfg_json = json.loads((model / "config.json").read_text())
    cfg_json["architectures"] = ["QuantdriftTestForCausalLM"]       # transformers loads it by model_type
    (model / "config.json").write_text(json.dumps(cfg_json))
    assert run(_cfg(model, tmp_path, "variant=gguf_q4_0")) == 0
    from pipeline.stages.variant_setup import load_result

    result = load_result(_cfg(model, tmp_path, "variant=gguf_q4_0"), "gguf_q4_0")
    assert result["status"] == "skipped" and "converter does not support" in result["reason"]
    assert run(_cfg(model, tmp_path, "variant=original")) == 0


def test_a_conversation_longer_than_the_context_is_named(tmp_path, tiny_llama):
    suite = tmp_path / "long.jsonl"
    suite.write_text(json.dumps({"id": "too-long", "turns": [{"user": "Summarise the ledger entry. " * 600}]}))
    with pytest.raises(ConfigError, match="context"):
        run(_cfg(tiny_llama, tmp_path, "variant=original", f"suites.smoke.path={suite}"))


def test_an_unsupported_device_is_named(tmp_path, tiny_llama):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="sees no CUDA device"):
        run(_cfg(tiny_llama, tmp_path, "variant=original", "runtime.device=cuda"))


def test_a_tokenizer_without_a_chat_template_needs_consent(tmp_path, tiny_llama):
    model = _without_chat_template(_copy_model(tiny_llama, tmp_path / "m"))
    with pytest.raises(ConfigError, match="allow_plain_template=true"):
        run(_cfg(model, tmp_path, "variant=original"))
    assert run(_cfg(model, tmp_path, "variant=original", "model.allow_plain_template=true")) == 0


def test_a_failing_variant_is_recorded_and_the_others_complete(tmp_path, tiny_llama, monkeypatch):
    from pipeline.quantizers.gguf import GGUFQuantizer

    def boom(self, tmp):
        raise MemoryError("simulated out of memory while quantizing")

    assert run(_cfg(tiny_llama, tmp_path, "variant=original")) == 0
    monkeypatch.setattr(GGUFQuantizer, "build", boom)
    assert run(_cfg(tiny_llama, tmp_path, "variant=gguf_q4_0")) == EXIT_VARIANT_FAILED
    monkeypatch.undo()
    report = _cfg(tiny_llama, tmp_path, "command=report", "run.variants=[original,gguf_q4_0]")
    assert run(report) == EXIT_VARIANT_FAILED
    summary = json.loads((report.results_dir / "summary.json").read_text())
    assert summary["variants"]["gguf_q4_0"]["status"] == "failed"
    assert "MemoryError: simulated out of memory" in summary["variants"]["gguf_q4_0"]["reason"]
    assert summary["variants"]["original"]["status"] == "ok"
    assert "simulated out of memory" in (report.results_dir / "report.md").read_text()


def test_a_full_disk_stops_before_quantizing(tmp_path, tiny_llama, monkeypatch):
    assert run(_cfg(tiny_llama, tmp_path, "variant=original")) == 0
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**12, 10**12 - 1000, 1000))
    # the plan made before any work refuses first, naming the variant and the disk figures
    with pytest.raises(ConfigError, match=r"does not fit this machine .*variants gguf_q8_0.*disk: .*Nothing was "
                                          r"computed"):
        run(_cfg(tiny_llama, tmp_path, "variant=gguf_q8_0"))
    # without it (plan.check=false) the quantizer's own check still stops before writing
    with pytest.raises(ConfigError, match="not enough free disk space for quantizing gguf_q8_0"):
        run(_cfg(tiny_llama, tmp_path, "variant=gguf_q8_0", "plan.check=false"))
    monkeypatch.undo()
    assert (tmp_path / "artifacts" / "tiny" / "runs" / "smoke" / "original" / "manifest.json").is_file()


def _drift(summary: dict) -> dict:
    return {n: (v["status"], v.get("drift"), v.get("free_running", {}).get("pass_rate"))
            for n, v in summary["variants"].items()}


def _probe_workers_left(own, wait_s: float = 10.0) -> set[int]:
    """Live speed-probe worker processes (``python -m pipeline.instruments.probe``) this test started (``own``: the
    ``own_processes`` filter), after giving the kernel's parent-death signal a moment to arrive."""
    import time

    from tests.conftest import pids_running

    def live() -> set[int]:
        return own(pids_running("pipeline.instruments.probe"))

    deadline = time.time() + wait_s
    while (left := live()) and time.time() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.full       # a whole run repeated: `make test-all` (the nightly suite), not `make test`
def test_kill_9_anywhere_then_rerun_gives_the_uninterrupted_summary(tmp_path, tiny_llama, own_processes):
    """kill -9 at the F16 conversion, the reference (transcripts, exact rows), the evaluation (scoring, then
    free-running: the order a variant job runs them in), the speed trials and the report; each rerun
    resumes, and the final summary's drift equals an uninterrupted run's."""
    common = [f"model.source={tiny_llama}", "model.name=tiny", "profile=smoke", "run.suites=[smoke]",
              f"paths.cache={PROJECT_ROOT / '.cache'}"]
    exe = [sys.executable, "-m", "pipeline.cli"]
    sweep = ["-m", "variant=original,gguf_q8_0"]
    report = ["compare", "run.variants=[original,gguf_q8_0]", "load=off"]

    def paths(root):
        return [f"paths.artifacts={root / 'a'}", f"paths.results={root / 'r'}"]

    clean = tmp_path / "clean"
    for args in (sweep, report):
        assert subprocess.run(exe + args + common + paths(clean), capture_output=True, timeout=900).returncode == 0
    killed = tmp_path / "killed"
    for args, marker in ((sweep, "convert:f16-gguf: building"), (sweep, "reference:smoke: building"),
                         (sweep, "reference:smoke:logprobs: building"), (sweep, "reference:smoke:exact_rows: building"),
                         (sweep, "score:gguf_q8_0: building"), (sweep, "evaluate:gguf_q8_0: building"),
                         (report, "speed: trial 2/"), (report, "decision: summarising")):
        proc = subprocess.Popen(exe + args + common + paths(killed), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        seen = False
        for line in proc.stdout:
            if marker in line:
                seen = True
                os.kill(proc.pid, signal.SIGKILL)
                break
        proc.wait(timeout=900)
        # strict: a renamed log line must fail here, not turn the test into a plain run
        assert seen, f"the log line {marker!r} never appeared, so nothing was killed"
        assert not _probe_workers_left(own_processes), "a speed probe worker outlived the killed run"
    for args in (sweep, report):
        r = subprocess.run(exe + args + common + paths(killed), capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    a = json.loads((clean / "r" / "tiny" / "smoke" / "summary.json").read_text())
    b = json.loads((killed / "r" / "tiny" / "smoke" / "summary.json").read_text())
    assert _drift(a) == _drift(b)
    assert not list((killed / "a").rglob("*.tmp-*")), "a killed attempt's temporary folder was left behind"


def test_unknown_config_values_and_cli_input_exit_2():
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "kv_cache=int9"], capture_output=True, text=True,
                         timeout=60, cwd=PROJECT_ROOT)
    assert out.returncode == EXIT_BAD_INPUT and "int8" in out.stdout + out.stderr


def test_a_gguf_llama_cpp_cannot_load_costs_the_gguf_variants_only(tmp_path, tiny_llama, monkeypatch):
    """llama.cpp refusing the converted F16 file (a missing tensor, an unknown key) stops no transformers variant:
    the original is measured with its reference on transformers, a GGUF variant is skipped naming llama.cpp's
    error, and the report says both."""
    import pipeline.stages.parity as parity

    def refuse(*args, **kwargs):
        raise ValueError("Failed to load model from file: check_tensor_dims: tensor 'output.weight' not found")

    monkeypatch.setattr(parity, "check_parity", refuse)
    assert run(_cfg(tiny_llama, tmp_path, "variant=original")) == 0
    assert run(_cfg(tiny_llama, tmp_path, "variant=gguf_q8_0")) == 0
    report = _cfg(tiny_llama, tmp_path, "command=report", "run.variants=[original,gguf_q8_0]")
    run(report)
    summary = json.loads((report.results_dir / "summary.json").read_text())
    assert summary["variants"]["original"]["status"] == "ok"
    q8 = summary["variants"]["gguf_q8_0"]
    assert q8["status"] == "skipped" and "llama.cpp could not load the F16 GGUF" in q8["reason"], q8
    assert "output.weight" in q8["reason"]
    assert "Parity: GGUF skipped (llama.cpp could not load the F16 GGUF" in (report.results_dir / "report.md").read_text()


def test_bad_input_inside_a_variant_job_is_reported_with_its_cause(tmp_path, tiny_llama):
    """A job stopped by bad input (exit 2) leaves a failed result naming the input, so the report of the run says
    why that variant has no figures instead of 'not evaluated'."""
    model = _without_chat_template(_copy_model(tiny_llama, tmp_path / "m"))
    with pytest.raises(ConfigError, match="allow_plain_template=true"):
        run(_cfg(model, tmp_path, "variant=original"))
    report = _cfg(model, tmp_path, "command=report", "run.variants=[original]")
    run(report)
    v = json.loads((report.results_dir / "summary.json").read_text())["variants"]["original"]
    assert v["status"] == "failed" and "stopped on bad input" in v["reason"], v
    assert "allow_plain_template=true" in v["reason"], v
