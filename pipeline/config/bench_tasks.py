"""The benchmark task names the config accepts in ``run.suites`` (``bench:TASK``): the offline tasks shipped with the
project (``TASK_NAMES``; their definitions: ``TASKS`` in pipeline/suites/lmeval/tasks.py, whose keys are exactly
these names) and any other name that could be a task of lm-eval's registry (``arc_easy``, ``gsm8k``, ...).

The check here is cheap on purpose (no lm-eval import, no registry walk, no data read): whether a registry name
exists, is a single task and has its data offline is found where the task is resolved
(``pipeline.suites.lmeval.registry``, run by the comparison's pre-flight before any stage)."""

from __future__ import annotations

import re

TASK_NAMES = ("humaneval", "business_mc")

# the characters of a task name in lm-eval's registry (its YAML ``task:`` values: every one of lm-eval 0.4.13's
# tasks matches, e.g. tmmluplus_education_(profession_level))
_REGISTRY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.()\-]*\Z")


def valid_task_name(name: str) -> bool:
    """Whether ``name`` is an offline task or could name a task of lm-eval's registry."""
    return name in TASK_NAMES or bool(_REGISTRY_NAME.match(name))


def unknown_task_message(name: str) -> str:
    """What a run asking for a task name that cannot be one is told (raised as a ConfigError)."""
    known = ", ".join(sorted(TASK_NAMES))
    return (f"bench:TASK with TASK one of {known}, or the name of a task of lm-eval's registry (letters, digits, "
            f"'_', '.', '-', '(', ')'; e.g. bench:arc_easy) whose data is in the datasets cache")
