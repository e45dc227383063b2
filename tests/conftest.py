"""Shared fixtures: a tiny random llama with the embedded model's real tokenizer (converter-compatible), built in
seconds, config composition through the real Hydra config tree, and a hub dataset (ARC-Easy-shaped) written into a
datasets cache in the datasets library's own layout, for lm-eval registry tasks run offline."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from pipeline.config.schema import PROJECT_ROOT
from pipeline.compose import from_omegaconf, register_resolvers  # noqa: E402
from pipeline.commands.prune_cpu import embedded_gguf  # noqa: E402

EMBEDDED = embedded_gguf()            # conf/model/smollm2.yaml's packaged GGUF


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie waiting for its reaper is gone too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split(")")[-1].split()[0] != "Z"


def pids_running(text: str) -> list[int]:
    """The pids of the processes whose command line holds ``text`` (a module run with -m: its name)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def compose(overrides: list[str]):
    """The real conf/ tree composed with overrides, as a typed Config (like lightning-hydra-template's tests)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        return from_omegaconf(hydra_compose("config", overrides=overrides))


@pytest.fixture(scope="session")
def embedded_gguf() -> Path:
    from pipeline.infra.model_source import locate_packaged_file

    return locate_packaged_file(EMBEDDED)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory, embedded_gguf) -> Path:
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    tok = AutoTokenizer.from_pretrained(str(embedded_gguf.parent), gguf_file=embedded_gguf.name)
    tok.save_pretrained(str(out))
    return out


def build_tiny_llama(out: Path, tokenizer_dir: Path, seed: int = 0, hidden: int = 64, layers: int = 2,
                     heads: int = 4) -> Path:
    """A random LlamaForCausalLM with SmolLM2's 49152-token vocabulary: ~3.5M parameters, fp32 safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():   # larger-than-default init so the distributions are peaked enough to matter
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(out), safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tiny_tokenizer_dir)


@pytest.fixture
def tiny_cfg(tmp_path, tiny_llama):
    """A Config for the tiny model with every output under tmp_path and the smoke suite."""

    def make(*extra: str):
        return compose([
            f"model.source={tiny_llama}", "model.name=tiny", "profile=smoke", "run.suites=[smoke]",
            f"paths.artifacts={tmp_path / 'artifacts'}", f"paths.results={tmp_path / 'results'}",
            f"paths.cache={PROJECT_ROOT / '.cache'}", *extra,
        ])

    return make


@pytest.fixture
def own_processes(monkeypatch):
    """Marks every process this test starts: its environment carries ``QD_TEST_RUN=<tag>``, which children and
    theirs inherit, also once re-parented after a kill. Returns a filter that keeps, of a list of pids, only the
    live ones so marked: a process check then counts this test's own processes, never a user's run beside the
    tests."""
    tag = uuid.uuid4().hex
    monkeypatch.setenv("QD_TEST_RUN", tag)
    mark = f"QD_TEST_RUN={tag}".encode()

    def own(pids) -> set[int]:
        out = set()
        for pid in pids:
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if mark in env and state != "Z":
                out.add(int(pid))
        return out

    return own


# A test is of the integration tier when it builds a model, starts a process or runs a tool: it asks for one of
# these fixtures (directly or through its own), or its module or itself is marked so; of the system tier when it
# runs whole comparisons (the family matrix, the SLURM cluster); the unit tier is the rest (`make test-fast`).
INTEGRATION_FIXTURES = {"tiny_llama", "tiny_cfg", "tiny_tokenizer_dir", "embedded_gguf", "own_processes"}
INTEGRATION_MARKS = {"slow", "smoke", "gpu", "integration"}
SYSTEM_MARKS = {"slurm", "system", "full"}


def tier(item) -> str:
    marks = {m.name for m in item.iter_markers()}
    if marks & SYSTEM_MARKS:
        return "system"
    if marks & INTEGRATION_MARKS or INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())):
        return "integration"
    return "unit"


def pytest_collection_modifyitems(config, items):
    """Each test gets its tier's marker (unit, integration, system: ``-m unit`` is `make test-fast`). GPU tests run
    only where CUDA is present; CI has none, so `make test` skips them with the reason."""
    for item in items:
        item.add_marker(getattr(pytest.mark, tier(item)))
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ------------------------------------------------------------------ a hub dataset in a datasets cache

ARC_SPLITS = ("train", "validation", "test")


def arc_docs(split: str, n: int = 6) -> list[dict]:
    """ARC-Easy-shaped rows (allenai/ai2_arc's columns), each split's questions its own."""
    return [{"id": f"{split}-{i}", "question": f"In the {split} set, which number follows {i}?",
             "choices": {"text": [str(i + 7), str(i + 1), "a rock", "blue"], "label": ["A", "B", "C", "D"]},
             "answerKey": "B"} for i in range(n)]


def write_arc_easy_cache(cache: Path, scratch: Path, docs: dict[str, list[dict]], revision: str = "0123abcd") -> Path:
    """allenai/ai2_arc's ARC-Easy config in ``cache`` exactly as ``datasets`` leaves a hub dataset it has loaded:
    ``allenai___ai2_arc/ARC-Easy/0.0.0/<revision>/`` with ``ai2_arc-<split>.arrow`` and ``dataset_info.json``
    (config_name ARC-Easy), written by datasets' own json builder. Offline, ``load_dataset("allenai/ai2_arc",
    "ARC-Easy")`` finds it there through its cache module (datasets/packaged_modules/cache/cache.py)."""
    import datasets
    from datasets.packaged_modules.json.json import Json

    scratch.mkdir(parents=True, exist_ok=True)
    for split, rows in docs.items():
        (scratch / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    features = datasets.Features({
        "id": datasets.Value("string"), "question": datasets.Value("string"),
        "choices": {"text": datasets.Sequence(datasets.Value("string")),
                    "label": datasets.Sequence(datasets.Value("string"))},
        "answerKey": datasets.Value("string")})
    builder = Json(cache_dir=str(scratch / "build"), dataset_name="ai2_arc", config_name="ARC-Easy",
                   data_files={split: str(scratch / f"{split}.jsonl") for split in docs}, features=features)
    folder = cache / "allenai___ai2_arc" / "ARC-Easy" / "0.0.0" / revision
    builder.download_and_prepare(output_dir=str(folder))
    return folder
