"""The pre-flight of `make compare`: what would stop every variant is found once, before any stage runs, with the
setting that gets past it; the setting named does get past it."""

import json
import shutil

import pytest

from pipeline.cli import run
from pipeline.config.schema import PROJECT_ROOT
from pipeline.infra.errors import ConfigError
from tests.conftest import compose


def _cfg(model, root, *extra):
    return compose(["command=preflight", f"model.source={model}", "model.name=tiny", "profile=smoke",
                    "run.suites=[smoke]", f"paths.artifacts={root / 'artifacts'}", f"paths.results={root / 'results'}",
                    f"paths.cache={PROJECT_ROOT / '.cache'}", *extra])


def _nothing_measured(cfg) -> bool:
    return not any((cfg.model_dir / d).exists() for d in ("variants", "runs", "reference", "gguf-f16"))


def _no_template(model):
    (model / "chat_template.jinja").unlink()


def _last_turn_only(model):
    (model / "chat_template.jinja").write_text("{{ messages[-1]['content'] }}")   # renders the last turn alone


@pytest.mark.parametrize("change, run_args, match, way_out", [
    (_no_template, ("run.variants=[original,gptq_w4]",),
     r"(?s)before any stage ran.*has no chat template.*model\.allow_plain_template=true",
     ("run.variants=[original,gptq_w4]", "model.allow_plain_template=true")),
    (_last_turn_only, ("run.variants=[original]", "run.suites=[multi_turn]"),
     r"(?s)rewrites earlier turns.*run\.suites=\[long_output\].*found on multi_turn/",
     ("run.variants=[original]", "run.suites=[long_output]")),
], ids=["a base model without a chat template", "a template that rewrites earlier turns on a multi-turn suite"])
def test_what_stops_every_variant_is_found_once_before_any_stage_and_its_way_out_works(tmp_path, tiny_llama, change,
                                                                                      run_args, match, way_out):
    model = shutil.copytree(tiny_llama, tmp_path / "model")
    change(model)
    cfg = _cfg(model, tmp_path, *run_args)
    with pytest.raises(ConfigError, match=match):
        run(cfg)
    assert _nothing_measured(cfg)
    assert run(_cfg(model, tmp_path, *way_out)) == 0


def test_a_tokenizer_the_converter_does_not_recognise_is_named_once_for_the_gguf_variants(tmp_path, tiny_llama):
    model = shutil.copytree(tiny_llama, tmp_path / "finetuned")
    tok = json.loads((model / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    (model / "tokenizer.json").write_text(json.dumps(tok))
    cfg = _cfg(model, tmp_path, "run.variants=[original,gguf_q8_0,gguf_q4_k_m]")
    with pytest.raises(ConfigError) as err:
        run(cfg)
    text = str(err.value)
    assert text.count("llama.cpp's converter does not recognise this tokenizer's BPE") == 1
    assert "- gguf_q8_0, gguf_q4_k_m: llama.cpp's converter" in text
    assert "model.gguf_pre_tokenizer" in text and _nothing_measured(cfg)
    # without a GGUF variant the converter is not asked; with the override it converts
    assert run(_cfg(model, tmp_path, "run.variants=[original]")) == 0
    assert run(_cfg(model, tmp_path, "run.variants=[gguf_q8_0]", "model.gguf_pre_tokenizer=smollm")) == 0


def test_make_plan_on_a_local_folder_finds_it_without_preparing_anything(tmp_path, tiny_llama, monkeypatch):
    from pipeline.plan import estimate as plan

    monkeypatch.setattr(plan, "machine_free", lambda cfg, on_device: {
        "disk_bytes": 500e9, "disk_path": "/injected", "memory_bytes": 16e9, "memory_source": "injected",
        "device_bytes": None})
    model = shutil.copytree(tiny_llama, tmp_path / "base")
    _no_template(model)
    cfg = _cfg(model, tmp_path, "command=plan", "run.variants=[original,gguf_q8_0]",
               f"paths.results={PROJECT_ROOT / 'results'}")
    with pytest.raises(ConfigError, match=r"(?s)before any stage ran.*has no chat template"):
        run(cfg)
    assert not (cfg.model_dir / "original").exists()


def test_a_registry_bench_task_without_its_data_stops_the_run_before_any_stage(tmp_path, tiny_llama, monkeypatch):
    """bench:arc_easy (lm-eval's registry) with an empty datasets cache: the pre-flight stops the run naming the task
    and the cache folder, nothing measured; with allenai/ai2_arc's ARC-Easy in the cache it passes."""
    from tests.conftest import ARC_SPLITS, arc_docs, write_arc_easy_cache

    cache = tmp_path / "datasets-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    cfg = _cfg(tiny_llama, tmp_path, "run.variants=[original]", "run.suites=[smoke,bench:arc_easy]")
    with pytest.raises(ConfigError, match=r"(?s)before any stage ran.*- bench:arc_easy: its dataset allenai/ai2_arc "
                                          r"\(config ARC-Easy\) is not available offline in the datasets cache "
                                          + str(cache).replace(".", r"\.")):
        run(cfg)
    assert _nothing_measured(cfg)
    write_arc_easy_cache(cache, tmp_path / "scratch", {split: arc_docs(split) for split in ARC_SPLITS})
    assert run(cfg) == 0
