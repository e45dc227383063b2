"""Stage keys carry the version of the code that computes each figure: a changed check recomputes the check
outcomes and nothing else; a changed KLD, speed or load protocol changes its stage's key; an edit that changes no
behaviour (a comment, a docstring) keeps every version."""

import importlib
import json
import sys

import pytest

from pipeline.infra.code_version import code_version, module_version


def _module(tmp_path, monkeypatch, name: str, text: str):
    (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(name, None)
    importlib.invalidate_caches()
    return importlib.import_module(name)


def test_a_module_version_ignores_comments_and_docstrings_and_sees_code_and_constants(tmp_path, monkeypatch):
    base = 'LIMIT = 3\nWORDS = {"b", "a"}\n\n\ndef f(x):\n    """Doc."""\n    return x + LIMIT\n'
    v0 = module_version(_module(tmp_path, monkeypatch, "qd_mod_a", base))
    reworded = ('"""A module docstring."""\nLIMIT = 3  # a comment\nWORDS = {"a", "b"}\n\n\n'
                'def f(x):\n    """Another doc."""\n    # why\n    return (x +\n            LIMIT)\n')
    assert module_version(_module(tmp_path, monkeypatch, "qd_mod_b", reworded)) == v0
    assert module_version(_module(tmp_path, monkeypatch, "qd_mod_c", base.replace("x + LIMIT", "x - LIMIT"))) != v0
    assert module_version(_module(tmp_path, monkeypatch, "qd_mod_d", base.replace("LIMIT = 3", "LIMIT = 4"))) != v0
    mod = _module(tmp_path, monkeypatch, "qd_mod_e", base)
    monkeypatch.setattr(mod, "f", lambda x: x * 2)          # the code bound to the name now is what counts
    assert module_version(mod) != v0


def test_the_speed_and_load_protocols_change_with_their_code(monkeypatch):
    import pipeline.instruments.loadgen as loadgen
    import pipeline.instruments.probe as probe
    from pipeline.stages.load import load_protocol
    from pipeline.stages.speed import speed_protocol
    from pipeline.servers.llama_server import LlamaServer

    speed, load = speed_protocol(), load_protocol({"a": {"engine": LlamaServer}})
    assert speed == speed_protocol() and "pipeline.instruments.probe" in speed
    assert "pipeline.servers.llama_server" in load
    monkeypatch.setattr(probe, "own_cpu_s", lambda: 0.0)
    assert speed_protocol() != speed
    monkeypatch.setattr(loadgen, "prompts_needed", lambda *a: 1)
    assert load_protocol({"a": {"engine": LlamaServer}}) != load


def test_code_version_names_functions_by_their_module(monkeypatch):
    from pipeline.stages.score import kld_exactness

    v = code_version("pipeline.figures.drift", kld_exactness)
    assert set(v) == {"pipeline.figures.drift", "pipeline.stages.score.kld_exactness"}


def test_a_runtime_code_version_covers_every_module_its_class_is_built_from():
    """A runtime class assembled from parts in other modules (the hf scoring, llama.cpp's batched decoding) keys its stages on all of them."""
    from pipeline.runtimes import runtime_code

    assert set(runtime_code("hf")) == {"pipeline.runtimes.base", "pipeline.runtimes.hf",
                                       "pipeline.runtimes.hf_scoring"}
    assert set(runtime_code("llamacpp")) == {"pipeline.runtimes.base", "pipeline.runtimes.llamacpp",
                                             "pipeline.runtimes.llamacpp_batched"}


def _stage_times(root) -> dict[str, tuple[float, str]]:
    """Every stage folder under ``root`` -> (when it was built, its key hash)."""
    out = {}
    for m in root.rglob("manifest.json"):
        data = json.loads(m.read_text())
        out[m.parent.relative_to(root).as_posix()] = (data["created_unix"], data["key_hash"])
    return out


@pytest.mark.slow
def test_a_changed_check_recomputes_its_outcomes_and_nothing_else(tiny_cfg, tmp_path, monkeypatch):
    """The tiny model through the whole job; then a check's code changes (``run_check`` now passes every check):
    the run again rebuilds only the check stage, whose outcomes follow the new code, and the suite's checks
    fingerprint (what the nightly gate compares pass rates under) changes with it."""
    import pipeline.suites.checks as checks
    from pipeline.infra.files import read_jsonl
    from pipeline.commands.variant_job import evaluate_job

    cfg = tiny_cfg("variant=gguf_q8_0")
    first = evaluate_job(cfg)
    assert first["status"] == "ok", first.get("reason")
    before = _stage_times(tmp_path / "artifacts")
    samples = read_jsonl(tmp_path / "artifacts" / "tiny" / "runs" / "smoke" / "gguf_q8_0.checks" / "samples.jsonl")
    assert not all(all(s["checks_reference"]) for s in samples), "a random model fails some check"

    monkeypatch.setattr(checks, "run_check", lambda check, reply: True)
    second = evaluate_job(tiny_cfg("variant=gguf_q8_0"))
    after = _stage_times(tmp_path / "artifacts")
    changed = sorted(k for k in after if after[k] != before.get(k))
    assert changed == ["tiny/runs/smoke/gguf_q8_0.checks"], changed
    samples = read_jsonl(tmp_path / "artifacts" / "tiny" / "runs" / "smoke" / "gguf_q8_0.checks" / "samples.jsonl")
    assert all(all(s["checks_reference"]) and all(s["checks_variant"]) for s in samples)
    assert second["checks"] != first["checks"]
    # and back: the original code's version is the original key, so its outcomes are built again from the replies
    monkeypatch.undo()
    evaluate_job(tiny_cfg("variant=gguf_q8_0"))
    assert _stage_times(tmp_path / "artifacts")["tiny/runs/smoke/gguf_q8_0.checks"][1] == \
        before["tiny/runs/smoke/gguf_q8_0.checks"][1]
