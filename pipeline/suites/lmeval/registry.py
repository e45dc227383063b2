"""Any task of lm-eval's own registry by name (``bench:arc_easy``), run offline on the data already on this machine.

Resolution (``resolve``), done where a task is pre-flighted or run, never when the CLI loads its config:

- the name is looked up among lm-eval's task YAML files (its ``TaskIndex`` over the files that mention the name, so
  the 14,000-file registry is not walked for a known task; a name not found there is looked up in the whole
  registry, ``TaskManager()``, before it is refused, with the closest names). A group or tag (``mmlu``,
  ``ai2_arc``) is refused naming some of its tasks: a bench task is one task, with one sample list.
- its data must be readable with no network: ``datasets.load_dataset_builder`` on the task's ``dataset_path``,
  ``dataset_name`` and ``dataset_kwargs`` with the hub switched off (``hub_offline``) and the datasets cache
  (``datasets_cache``: ``HF_DATASETS_CACHE``, else datasets' default ``~/.cache/huggingface/datasets``) as its cache.
  A hub dataset is then found as ``datasets`` finds one offline (its own cache layout,
  ``<cache>/<namespace>___<name>/<config>/<version>/<hash>/``); a local path is read from that path. Otherwise the
  task is refused naming the dataset and the folder it was looked for in.
- what is counted right per sample (``correct``): ``acc_norm`` where a multiple-choice task lists it (the options'
  lengths differ; lm-eval's normalised accuracy), else ``acc``; ``acc`` for a loglikelihood task; ``exact_match``
  for a generate_until task, under the task's first filter (lm-eval's order; ``strict-match`` for gsm8k). A task
  with none of these (a perplexity task, ``loglikelihood_rolling``: no right or wrong per sample) is refused; so is
  one whose model-written code lm-eval would execute (``unsafe_code``: never outside the project's sandbox), one
  built by Python code (``class``, ``custom_dataset``: what it reads cannot be checked beforehand) and one whose
  generation settings are not greedy.
- a sample's id is lm-eval's ``doc_id`` (its position in the split evaluated, the test split where the task has one),
  the same for every variant reading the same data.
- the key (``key``): the task's name, its config's version, lm-eval's version and ``data_sha256``, a sha256 over the
  files the data is read from (the cached ``.arrow`` files and ``dataset_info.json``, or the local data files).

lm-eval and datasets are imported inside functions only.
"""

from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

from pipeline.infra.errors import ConfigError
from pipeline.infra.files import file_sha256

# the per-sample metric that counts a sample right, per output type, in order of preference
CORRECT = {"multiple_choice": ("acc_norm", "acc"), "loglikelihood": ("acc",), "generate_until": ("exact_match",)}
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def datasets_cache() -> Path:
    """The datasets cache a registry task's data is read from, as ``datasets`` places it: ``HF_DATASETS_CACHE``,
    else ``$HF_HOME/datasets``, else ``$XDG_CACHE_HOME/huggingface/datasets`` (``~/.cache`` by default)."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "datasets"


@contextmanager
def hub_offline() -> Iterator[None]:
    """The hub switched off for ``datasets`` and ``huggingface_hub`` while the block runs, whenever they were
    imported (both read the variables once, at import): nothing is fetched, a missing file is an error."""
    import datasets.config
    import huggingface_hub.constants as hub

    saved_env = {v: os.environ.get(v) for v in _OFFLINE_VARS}
    saved = (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, hub.HF_HUB_OFFLINE)
    os.environ.update({v: "1" for v in _OFFLINE_VARS})
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, hub.HF_HUB_OFFLINE = saved
        for var, value in saved_env.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def _tasks_root() -> Path:
    import lm_eval

    return Path(lm_eval.__file__).parent / "tasks"


def registry_entry(name: str):
    """lm-eval's index entry (``TaskIndex``'s ``Entry``) for ``name``, built by lm-eval's own indexer over the task
    YAML files whose text mentions the name (a task, group or tag is declared in a file that names it), in the
    registry's order; None where none declares it."""
    from lm_eval.tasks._index import TaskIndex
    from lm_eval.tasks._yaml_loader import load_yaml

    index: dict = {}
    for path in sorted(_tasks_root().glob("**/*.yaml"), key=lambda p: p.as_posix()):
        if "__pycache__" in path.parts or name not in path.read_text(encoding="utf-8", errors="replace"):
            continue
        try:
            TaskIndex.process_cfg(load_yaml(path, resolve_func=False, recursive=True), path, index)
        except Exception:         # as lm-eval's index skips a file it cannot parse
            continue
    return index.get(name)


def whole_registry_entry(name: str):
    """``name``'s entry in the whole registry (``TaskManager()``, about 10 s), or the ConfigError that refuses an
    unknown name, with the closest names."""
    import difflib

    from lm_eval.tasks import TaskManager

    from pipeline.config.bench_tasks import TASK_NAMES

    manager = TaskManager()
    if name in manager.task_index:
        return manager.task_index[name]
    close = difflib.get_close_matches(name, manager.all_tasks, n=5, cutoff=0.75)
    raise ConfigError(f"bench:{name} is neither a local task ({', '.join(sorted(TASK_NAMES))}) nor a task of "
                      f"lm-eval {lm_eval_version()}'s registry ({len(manager.all_tasks)} names)"
                      + (f"; close names: {', '.join(close)}" if close else ""))


def fingerprint(files: list[Path]) -> str:
    """sha256 over the files' names and contents (in name order): what identifies the data read."""
    h = hashlib.sha256()
    for path in sorted(files, key=lambda p: (p.name, str(p))):
        h.update(f"{path.name}\0{file_sha256(path)}\n".encode())
    return h.hexdigest()


@dataclass
class RegistryTask:
    """One task of lm-eval's registry with its data found offline (``resolve``)."""

    name: str
    version: str
    yaml_path: Path
    output_type: str
    correct: str
    filter: str
    dataset: str                       # dataset_path, and dataset_name where set
    data_files: list[Path]
    cache: Path
    max_gen_toks: int | None = None
    sample_id: str | None = None       # None: lm-eval's doc_id
    unsafe_code: bool = False

    @property
    def generates(self) -> bool:
        return self.output_type == "generate_until"

    @property
    def data_sha256(self) -> str:
        return fingerprint(self.data_files)

    def key(self) -> dict:
        """What a stage caching this task's results depends on (with the variant's runtime key)."""
        return {"task": self.name, "version": self.version, "data_sha256": self.data_sha256,
                "lm_eval": lm_eval_version(), "dataset": self.dataset, "source": "lm-eval registry",
                **({"max_gen_toks": self.max_gen_toks} if self.generates else {})}

    def config(self, cache_dir: Path | None = None) -> dict:
        """lm-eval's own config of the task (its YAML, includes and ``!function``s resolved), its datasets cache
        set to ``self.cache`` (``cache_dir``, the stage's scratch folder, is not used: the data is read where it
        was found)."""
        from lm_eval.tasks._yaml_loader import load_yaml

        cfg = load_yaml(self.yaml_path, resolve_func=True)
        cfg["dataset_kwargs"] = {**(cfg.get("dataset_kwargs") or {}), "cache_dir": str(self.cache)}
        return cfg

    def build(self):
        """lm-eval's Task object, its data read offline."""
        from lm_eval.tasks import TaskManager

        with hub_offline():
            return TaskManager(include_defaults=False).load([self.config()])["tasks"][self.name]

    def sample_count(self) -> int:
        return len(self.build().eval_docs)


def _correct(name: str, cfg: dict) -> str:
    from lm_eval.api.registry import DEFAULT_METRIC_REGISTRY

    output_type = cfg.get("output_type", "generate_until")
    metrics = ([str(m.get("metric")) for m in cfg["metric_list"]] if cfg.get("metric_list")
               else list(DEFAULT_METRIC_REGISTRY.get(output_type, [])))
    found = next((m for m in CORRECT.get(output_type, ()) if m in metrics), None)
    if found is None:
        raise ConfigError(
            f"bench:{name}: output type {output_type} with metrics {metrics} has no per-sample right/wrong metric "
            "that accuracy, recovery and flips can count (expected acc_norm or acc for multiple_choice, acc for "
            "loglikelihood, exact_match for generate_until)"
            + ("; a perplexity task is measured by `quantdrift corpus`" if output_type == "loglikelihood_rolling"
               else ""))
    return found


def _refuse_unrunnable(name: str, entry, cfg: dict) -> None:
    from lm_eval.tasks._index import Kind

    if entry.kind in (Kind.GROUP, Kind.TAG):
        members = sorted(entry.tags) if entry.kind == Kind.TAG else [
            m if isinstance(m, str) else str(m.get("task") or m.get("group")) for m in cfg.get("task") or []]
        raise ConfigError(f"bench:{name} is a {'group' if entry.kind == Kind.GROUP else 'tag'} of lm-eval's "
                          f"registry, not one task: name one of its tasks, e.g. {', '.join(members[:5])}")
    if entry.kind == Kind.PY_TASK or cfg.get("custom_dataset"):
        raise ConfigError(f"bench:{name} ({entry.yaml_path}) builds its task or data with Python code (class, "
                          "custom_dataset): what it reads cannot be checked offline beforehand; choose a task "
                          "whose YAML names its dataset_path")
    if cfg.get("unsafe_code"):
        raise ConfigError(f"bench:{name} executes model-written code, which lm-eval would run unconfined in this "
                          "process: refused (bench:humaneval runs HumanEval in the project's sandbox)")
    if not cfg.get("dataset_path"):
        raise ConfigError(f"bench:{name} ({entry.yaml_path}) names no dataset_path: its data cannot be found")


def _data_files(name: str, cfg: dict, cache: Path) -> tuple[str, list[Path]]:
    """(the dataset named, the files it is read from), the hub off; a ConfigError naming the task and the cache
    folder where the data is not there."""
    import datasets
    from datasets.naming import camelcase_to_snakecase

    path, config_name = str(cfg["dataset_path"]), cfg.get("dataset_name")
    kwargs = {k: v for k, v in (cfg.get("dataset_kwargs") or {}).items() if k not in ("trust_remote_code", "cache_dir")}
    dataset = path + (f" (config {config_name})" if config_name else "")
    parts = path.split("/")
    looked = cache / "___".join(parts[:-1] + [camelcase_to_snakecase(parts[-1])])
    try:
        with hub_offline():
            builder = datasets.load_dataset_builder(path, config_name, cache_dir=str(cache), **kwargs)
    except Exception as exc:
        where = (f"the local path {path}" if os.path.exists(path) else
                 f"the datasets cache {cache} (looked for {looked}{'/' + config_name if config_name else ''})")
        raise ConfigError(f"bench:{name}: its dataset {dataset} is not available offline in {where}; nothing is "
                          "fetched during a run: load it once where the hub is reachable with the same "
                          f"HF_DATASETS_CACHE (datasets.load_dataset({path!r}"
                          f"{', ' + repr(config_name) if config_name else ''})), or point HF_DATASETS_CACHE at a "
                          f"cache that holds it ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
                          ) from None
    if type(builder).__module__.endswith("packaged_modules.cache.cache"):
        folder = Path(builder.cache_dir)
        files = sorted(folder.glob("*.arrow")) + [folder / "dataset_info.json"]
    else:
        files = [Path(str(f)) for split in (builder.config.data_files or {}).values() for f in split]
        remote = [str(f) for f in files if not f.is_file()]
        if remote or not files:
            raise ConfigError(f"bench:{name}: its dataset {dataset} is read from {remote or 'no file'}, not from "
                              "local files: only local data and the datasets cache are read offline")
    return dataset, files


@lru_cache(maxsize=64)
def _resolve(name: str, cache: str) -> RegistryTask:
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = registry_entry(name) or whole_registry_entry(name)
    cfg: dict[str, Any] = (entry.cfg if entry.cfg is not None or entry.yaml_path is None
                           else load_yaml(entry.yaml_path, resolve_func=False)) or {}
    _refuse_unrunnable(name, entry, cfg)
    correct = _correct(name, cfg)
    max_gen_toks = None
    if cfg.get("output_type") == "generate_until":
        from pipeline.suites.lmeval.adapter import greedy_request

        try:
            max_gen_toks = greedy_request(cfg.get("generation_kwargs"))[1]
        except ValueError as exc:
            raise ConfigError(f"bench:{name}: {exc}") from None
    filters = cfg.get("filter_list") or []
    dataset, files = _data_files(name, cfg, Path(cache))
    version = (cfg.get("metadata") or {}).get("version")
    return RegistryTask(name=name, version=str(version), yaml_path=Path(entry.yaml_path),
                        output_type=cfg.get("output_type", "generate_until"), correct=correct,
                        filter=str(filters[0]["name"]) if filters else "none", dataset=dataset, data_files=files,
                        cache=Path(cache), max_gen_toks=max_gen_toks)


def resolve(name: str) -> RegistryTask:
    """Task ``name`` of lm-eval's registry with its data found offline in ``datasets_cache()``; a ConfigError
    naming the task (and the cache folder where its data was looked for) where it cannot run."""
    return _resolve(name, str(datasets_cache()))
