"""The offline benchmark tasks by name, as the config validates ``bench:TASK`` suites (their definitions:
``TASKS`` in pipeline/suites/lmeval/tasks.py, whose keys are exactly these names), and what a run naming another
task is told."""

from __future__ import annotations

TASK_NAMES = ("humaneval", "business_mc")

# lm-eval's stock tasks whose data only the Hugging Face hub serves (the dataset each reads): named here so that a
# run asking for one stops when its config loads, naming the dataset, instead of inside lm-eval after the run's
# first stages (offline, datasets' download fails only then)
HUB_TASKS = {"gsm8k": "openai/gsm8k", "mmlu": "cais/mmlu", "ifeval": "google/IFEval",
             "arc_challenge": "allenai/ai2_arc", "arc_easy": "allenai/ai2_arc", "hellaswag": "Rowan/hellaswag",
             "winogrande": "allenai/winogrande", "truthfulqa_mc2": "truthfulqa/truthful_qa",
             "mbpp": "google-research-datasets/mbpp"}


def unknown_task_message(name: str) -> str:
    """What a run asking for task ``name`` that is not one of ``TASK_NAMES`` is told (raised as a ConfigError)."""
    known = ", ".join(sorted(TASK_NAMES))
    if name in HUB_TASKS:
        return (f"a task from local files ({known}): {name} is lm-eval's stock task, whose data "
                f"({HUB_TASKS[name]}) comes from the Hugging Face hub; write the dataset's local copy as a task of "
                f"pipeline/suites/lmeval/tasks.py (dataset_path: json, data_files), as business_mc is")
    return f"bench:TASK with TASK one of {known}"
