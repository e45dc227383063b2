"""The follow-up targets act on the model this clone has run, and scripts/nightly does what `make compare` does.

`make report`, `make promote` and `make nightly` without MODEL= read the run records `make compare` writes
(artifacts/.runs/); with runs of several models they stop and ask for MODEL=. scripts/nightly builds what
`make compare` builds, runs the comparison, the short load sweep, the report and the gate, and keeps the gate's
exit code (0/1) apart from a failed run (2). Checked with `make -n` and with recording stand-ins for `make` and
`quantdrift` (the real nightly run takes as long as a comparison)."""

import hashlib
import os
import shutil
import stat
import subprocess

import pytest

from pipeline.config.schema import PROJECT_ROOT


@pytest.fixture
def clone(tmp_path):
    shutil.copy(PROJECT_ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").touch()
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "smollm2.yaml").touch()
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / ".installed").touch()
    return tmp_path


def record(clone, model, variants):
    runs = clone / "artifacts" / ".runs"
    runs.mkdir(parents=True, exist_ok=True)
    (runs / f"{hashlib.sha1(model.encode()).hexdigest()[:8]}.mk").write_text(
        f"MODEL := {model}\nVARIANTS := {variants}\n")


def dry(clone, *args):
    return subprocess.run(["make", "-n", *args], cwd=clone, capture_output=True, text=True, timeout=60)


def test_report_acts_on_the_model_of_the_run(clone):
    assert "model=smollm2 " in dry(clone, "report").stdout                         # nothing run yet: the demo
    record(clone, "/models/acme-8b", "original,gguf_q4_k_m")
    out = dry(clone, "report").stdout
    assert "model=local model.source=/models/acme-8b" in out and "run.variants=[original,gguf_q4_k_m]" in out
    assert "model.source=/models/acme-8b" in dry(clone, "promote").stdout
    record(clone, "smollm2", "original")
    refused = dry(clone, "report")
    assert refused.returncode != 0 and "runs of several models exist here" in refused.stderr
    assert "/models/acme-8b" in refused.stderr and "pass MODEL=" in refused.stderr
    out = dry(clone, "report", "MODEL=smollm2").stdout
    assert "model=smollm2 " in out and "run.variants=[original]" in out            # its own variants


def test_compare_records_its_run_and_never_runs_the_full_load_sweep(clone):
    out = dry(clone, "compare", "MODEL=/models/acme-8b", "PROFILE=full").stdout
    assert "artifacts/.runs" in out and "load=short" in out and "load=full" not in out


def test_plan_plans_the_comparison_that_compare_runs(clone):
    """`make plan` passes what `make compare` passes (the load sweep, the budget, the tools): a plan that counted
    a load sweep `COMPARE_LOAD=off` drops would fit another budget than the comparison's."""
    shutil.copytree(PROJECT_ROOT / "mk", clone / "mk")
    args = ["MODEL=/models/acme-8b", "VARIANTS=original,gguf_q8_0", "COMPARE_LOAD=off", "BUDGET=30m",
            "LOAD_ARGS=load.repeats=1", "PROFILE=smoke"]

    def settings(target: str, command: str) -> set:
        line = next(ln for ln in dry(clone, target, *args).stdout.replace("\\\n", " ").splitlines()
                    if "/bin/quantdrift" in ln)
        return set(line.split()[1:]) - {command}

    plan = settings("plan", "plan")
    assert plan == settings("compare", "command=compare")
    assert {"load=off", "run.budget=30m", "load.repeats=1", "profile=smoke"} <= plan


def _stub(path, body):
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("gate,compare,expected", [(0, 0, 0), (1, 0, 1), (0, 1, 2), (0, 3, 0), (0, 2, 2)])
def test_nightly_runs_what_compare_runs_and_keeps_its_exit_codes(tmp_path, gate, compare, expected):
    """The nightly job runs the comparison as `make compare` does, then the gate; a comparison that failed (1) or
    was refused (2: bad input, a problem the pre-flight found) ends the job with 2 before the gate, and one whose
    variants partly failed (3) is still gated."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(PROJECT_ROOT / "scripts" / "nightly", tmp_path / "scripts" / "nightly")
    log = tmp_path / "calls.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir / "make", f"""echo "make $*" >> {log}
case "$*" in
  *print-variants*) echo original,gguf_q8_0,awq_w4_llmc ;;
  *print-suites*) echo long_output,multi_turn ;;
  *print-model-args*) echo model=smollm2 ;;
  *print-llama-tools*) echo /cache/llama-tools/bin ;;
  *print-compare-load*) echo short ;;
esac
exit 0
""")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    _stub(tmp_path / ".venv" / "bin" / "quantdrift", f"""echo "quantdrift $*" >> {log}
case "$1" in
  compare) exit {compare} ;;
  regress) exit {gate} ;;
esac
exit 0
""")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "scripts/nightly", "BASELINE=base.json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == expected, proc.stderr
    calls = log.read_text().splitlines()
    assert any(c.startswith("make -s compare-deps") and "VARIANTS=original,gguf_q8_0,awq_w4_llmc" in c
               for c in calls)
    qd = [c for c in calls if c.startswith("quantdrift")]
    assert qd[0].split()[1] == "compare" and "run.variants=[original,gguf_q8_0,awq_w4_llmc]" in qd[0]
    assert "load=short" in qd[0] and "bench.llama_tools=/cache/llama-tools/bin" in qd[0]
    assert "decision.screen=false" in qd[0]          # the gate compares every variant's every figure
    if expected == 2:
        assert len(qd) == 1 and "comparison failed" in proc.stderr
        return
    assert [c.split()[1] for c in qd] == ["compare", "regress"]
    assert "baseline=base.json" in qd[1]
    assert list((tmp_path / "artifacts" / ".runs").glob("*.mk"))


def test_the_tiers_sort_tests_by_what_they_start():
    """A test that asks for a model-building or process-starting fixture (also through its own fixture) or is
    marked slow is integration; the family matrix and the SLURM cluster are system; the rest is unit."""
    from types import SimpleNamespace

    from tests.conftest import tier

    def item(marks=(), fixtures=()):
        return SimpleNamespace(iter_markers=lambda: [SimpleNamespace(name=m) for m in marks],
                               fixturenames=list(fixtures))

    assert tier(item()) == "unit"
    assert tier(item(fixtures=["tmp_path", "monkeypatch"])) == "unit"
    assert tier(item(fixtures=["built", "tiny_tokenizer_dir"])) == "integration"
    assert tier(item(marks=["slow"])) == "integration"
    assert tier(item(marks=["slow", "system"], fixtures=["tiny_llama"])) == "system"
    assert tier(item(marks=["slurm"])) == "system"


def test_the_slurm_cluster_moves_a_port_something_else_listens_on_to_a_free_one(tmp_path):
    """scripts/slurm-cluster writes its configuration with free ports: a port another process listens on (here the
    slurmctld one) moves to the next free port above those already chosen; the four stay distinct and free."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {**os.environ, "QD_SLURM_HOME": str(tmp_path), "QD_SLURM_CTLD_PORT": str(port),
               "QD_SLURM_SLURMD_PORT": str(port + 1), "QD_SLURM_DBD_PORT": str(port + 2),
               "QD_SLURM_DB_PORT": str(port + 3)}
        r = subprocess.run([str(PROJECT_ROOT / "scripts" / "slurm-cluster"), "ports"], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        ports = [int(p) for p in r.stdout.split()]
        assert len(ports) == 4 and len(set(ports)) == 4 and port not in ports
        assert ports[0] > port and ports == sorted(ports)
        assert f"port {port} is in use: CTLD_PORT={ports[0]}" in r.stderr
        for p in ports:
            with socket.socket() as probe:
                assert probe.connect_ex(("127.0.0.1", p)) != 0       # nothing listens there
