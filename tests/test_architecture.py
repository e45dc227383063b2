"""The shape of the house: no import cycle among pipeline modules (imports inside functions count), no module
outside the backends names a backend, the command table and the published summary schema agree with their
single sources, and every backend validates its own options when the config loads."""

import json
import re

import pytest

from pipeline.config.schema import PROJECT_ROOT
from pipeline.infra.errors import ConfigError
from tests.conftest import compose
from tests.test_layers import find_cycle, module_graph

PIPELINE = PROJECT_ROOT / "pipeline"


def import_graph() -> dict[str, set[str]]:
    """module -> the pipeline modules it imports anywhere (``tests.test_layers.module_graph``: at module level, inside
    functions, under ``if TYPE_CHECKING:``), and the packages that load backends by name (importlib: quantizers,
    runtimes, servers) with an edge to every backend their registry lines name."""
    from pipeline.infra.backends import QUANTIZERS, RUNTIMES, SERVERS

    graph = module_graph()

    def resolve(name: str) -> str | None:
        while name and name not in graph:
            name = name.rpartition(".")[0]
        return name or None

    for package, table in (("pipeline.quantizers", QUANTIZERS), ("pipeline.runtimes", RUNTIMES),
                           ("pipeline.servers", SERVERS)):
        for backend in table.values():
            graph[package].add(resolve(backend.target.split(":")[0]))
    return graph


def test_no_import_cycle_among_pipeline_modules():
    graph = import_graph()
    assert "pipeline.infra.errors" in graph["pipeline.config.schema"]
    assert "pipeline.quantizers.gguf" in graph["pipeline.quantizers"]
    assert "pipeline.config.schema" in graph["pipeline.quantizers.base"]      # a TYPE_CHECKING import counts
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_tree_reads_like_the_pipeline():
    """At most 17 entries at the top of the package (one per layer of tests/test_layers.py, and the package's
    ``__init__``), and no module long enough to hold two ideas."""
    top = sorted(p.name for p in PIPELINE.iterdir() if p.name != "__pycache__")
    assert len(top) <= 17, top
    stages = {p.stem for p in (PIPELINE / "stages").glob("*.py")}
    assert {"prepare", "quantize", "reference", "evaluate", "score", "outcomes", "speed", "load"} <= stages
    long = {str(p.relative_to(PIPELINE)): n for p in PIPELINE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_leaf_modules_import_nothing_from_the_pipeline():
    graph = import_graph()
    for leaf in ("pipeline.infra.errors", "pipeline.config.summary_contract", "pipeline.config.settings",
                 "pipeline.infra.backends", "pipeline.infra.gguf_file", "pipeline.infra.files",
                 "pipeline.figures.drift", "pipeline.suites.checks", "pipeline.suites.language"):
        # the checks use the language detector, itself a leaf
        assert graph[leaf] <= {"pipeline.infra.errors", "pipeline.suites.language"}, (leaf, graph[leaf])


def test_no_module_outside_the_backends_names_a_backend():
    """Adding a runtime or quantizer touches its own module, its registry lines and YAML files only."""
    from pipeline.quantizers import QUANTIZERS
    from pipeline.runtimes import RUNTIMES

    names = [n for n in (*RUNTIMES, *QUANTIZERS) if n != "none"]
    pattern = re.compile(r"""(==|!=|\bin\b)\s*\(?\s*["'](%s)["']|["'](%s)["']\s*(==|!=)""" % ("|".join(names),
                                                                                           "|".join(names)))
    offenders = []
    for path in PIPELINE.rglob("*.py"):
        rel = path.relative_to(PIPELINE).as_posix()
        if rel.startswith(("runtimes/", "quantizers/", "servers/")):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{rel}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_command_table_matches_the_config():
    from pipeline.cli import COMMANDS
    from pipeline.config.schema import Config

    assert set(COMMANDS) == set(Config.COMMANDS)


def test_published_schema_is_generated_from_the_catalogue():
    from pipeline.config.summary_contract import SCHEMA_FILE, summary_schema

    published = json.loads((PROJECT_ROOT / SCHEMA_FILE).read_text())
    assert published == summary_schema(), (f"{SCHEMA_FILE} is stale: regenerate it with "
                                            "`python -m pipeline.config.summary_contract > schema/summary.schema.json`")


def test_regress_tolerances_are_catalogue_metrics_with_their_direction():
    with pytest.raises(ConfigError, match="regress.tolerances metric"):
        compose(["+regress.tolerances.kld_meen={rel: 0.1}"])
    with pytest.raises(ConfigError, match="kld_mean.better"):
        compose(["+regress.tolerances.kld_mean.better=higher"])
    with pytest.raises(ConfigError, match="regress.tolerances metric"):   # counted, never judged
        compose(["+regress.tolerances.scored_tokens={abs: 1}"])


@pytest.mark.parametrize("override, key", [
    ("+variant.quantize.group_sise=64", "group_sise"),          # gptq_w4: a misspelt key
    ("variant.quantize.bits=5", "variant.quantize.bits"),
    ("+variant.runtime_options.free_runing=kernel", "free_runing"),
])
def test_a_backend_option_is_validated_when_the_config_loads(override, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        compose(["variant=gptq_w4", override])


def test_a_runtime_option_of_another_backend_is_refused():
    with pytest.raises(ConfigError, match="cache_type_k"):
        compose(["variant=original", "+variant.runtime_options.cache_type_k=q8_0"])
    with pytest.raises(ConfigError, match="variant.runtime_options.cache_type_k"):
        compose(["variant=gguf_q8_0", "+variant.runtime_options.cache_type_k=q9"])


def test_the_config_names_exactly_the_benchmark_tasks_defined():
    """The config validates bench:TASK against ``TASK_NAMES`` (a low layer); the tasks are defined in the suites."""
    from pipeline.config.bench_tasks import TASK_NAMES
    from pipeline.suites.lmeval.tasks import TASKS

    assert set(TASK_NAMES) == set(TASKS)
