"""The nightly gate: same summary passes, a degraded variant fails with JUnit and diff naming it, noise within
the interval passes, other hardware compares drift only, promotion keeps the old baseline, history grows; the
drift metrics of a tiny model are deterministic; a two-variant multirun with the joblib launcher works."""

import copy
import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from pipeline.cli import EXIT_BAD_INPUT, run
from pipeline.config.schema import PROJECT_ROOT
from pipeline.infra.files import write_json
from tests.conftest import compose

MODEL = "smollm2-135m-instruct"


def _variant(kld, pass_rate, decode, lo=None, hi=None):
    return {"status": "ok", "reason": None,
            "drift": {"kld_mean": kld, "kld_p99": kld * 10, "top1_agreement": 1 - kld, "pass_rate": pass_rate,
                      "flip_rate": 0.1},
            "intervals": {"kld_mean": {"estimate": kld, "low": kld * 0.8, "high": kld * 1.2},
                          "pass_rate": {"estimate": pass_rate, "low": lo if lo is not None else pass_rate - 0.2,
                                        "high": hi if hi is not None else pass_rate + 0.2},
                          "flip_rate": {"estimate": 0.1, "low": 0.0, "high": 0.3}},
            "speed": {"decode_tokens_per_s": decode, "prefill_tokens_per_s": 300.0},
            "memory": {"peak_rss_mb": 300.0, "artifact_bytes": 100_000_000}}


def _summary():
    return {"schema_version": 1, "run": {"name": "nightly", "profile": "quick", "device": "auto"},
            "model": {"name": MODEL}, "recommendation": {"variant": "gguf_q8_0"},
            "hardware": {"cpu": "cpu-x", "cores": 2}, "versions": {"torch": "2.13.0"},
            "variants": {"original": _variant(0.0, 0.5, 30.0), "gguf_q8_0": _variant(0.002, 0.5, 60.0),
                         "gguf_q4_0": _variant(0.14, 0.4, 90.0)}}


@pytest.fixture
def gate(tmp_path):
    def make(new: dict, base: dict, *extra):
        write_json(tmp_path / "results" / MODEL / "nightly" / "summary.json", new)
        write_json(tmp_path / "base.json", base)
        cfg = compose(["command=regress", "run.name=nightly", f"paths.results={tmp_path / 'results'}",
                       f"paths.artifacts={tmp_path / 'artifacts'}", f"regress.baseline={tmp_path / 'base.json'}",
                       *extra])
        code = run(cfg)
        out = cfg.results_dir / "regress"
        return code, ET.parse(out / "junit.xml").getroot(), (out / "regress.md").read_text()
    return make


def test_same_summary_passes_and_history_grows(gate, tmp_path):
    code, junit, md = gate(_summary(), _summary())
    assert code == 0 and junit.get("failures") == "0" and int(junit.get("tests")) == 27   # 3 variants x 9 metrics
    assert "0 regression(s)" in md
    gate(_summary(), _summary())
    lines = (tmp_path / "results" / "history.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["variants"]["gguf_q8_0"]["kld_mean"] == 0.002


def test_degraded_variant_fails_naming_variant_and_metric(gate):
    new = _summary()
    new["variants"]["gguf_q8_0"]["drift"]["kld_mean"] = 0.02          # ten times the baseline drift
    code, junit, md = gate(new, _summary())
    assert code == 1
    failed = [(tc.get("classname"), tc.get("name")) for tc in junit.iter("testcase") if tc.find("failure") is not None]
    assert failed == [("quantdrift.gguf_q8_0", "kld_mean")]
    assert "| gguf_q8_0 | kld_mean | **REGRESSED**" in md


def test_zero_tolerance_and_a_missing_variant_fail(gate):
    new = _summary()
    new["variants"]["gguf_q4_0"]["speed"]["decode_tokens_per_s"] = 89.0
    del new["variants"]["original"]
    code, junit, md = gate(new, _summary(), "regress.tolerances.decode_tokens_per_s.ratio=1.0")
    assert code == 1
    assert "| gguf_q4_0 | decode_tokens_per_s | **REGRESSED**" in md and "| original | status | **REGRESSED**" in md


def test_noise_within_the_interval_does_not_fail(gate):
    new = _summary()
    new["variants"]["gguf_q4_0"]["drift"]["pass_rate"] = 0.3          # lower, but the baseline 0.4 is inside [0.1, 0.5]
    new["variants"]["gguf_q4_0"]["intervals"]["pass_rate"] = {"estimate": 0.3, "low": 0.1, "high": 0.5}
    assert gate(new, _summary())[0] == 0
    new["variants"]["gguf_q4_0"]["intervals"]["pass_rate"] = {"estimate": 0.3, "low": 0.25, "high": 0.35}
    code, _, md = gate(new, _summary())
    assert code == 1 and "| gguf_q4_0 | pass_rate | **REGRESSED**" in md


def test_other_hardware_compares_only_hardware_independent_metrics(gate):
    base, new = _summary(), _summary()
    base["hardware"]["cpu"] = "another-cpu"
    new["variants"]["gguf_q8_0"]["speed"]["decode_tokens_per_s"] = 1.0   # would fail on the same hardware
    code, junit, md = gate(new, base)
    assert code == 0 and "hardware differs" in md and "not compared: decode_tokens_per_s" in md
    assert int(junit.get("skipped")) == 4
    assert gate(new, base, "regress.compare_all=true")[0] == 1


def test_replies_decoded_another_way_are_not_compared_on_their_checks(gate):
    """A baseline decoded with plain greedy (a summary from before run.decoding) against a run with a repetition
    penalty: pass and flip rates are left out and said so; drift (teacher-forced) is still judged."""
    base, new = _summary(), _summary()
    new["run"]["decoding"] = {"repeat_penalty": 1.1, "repeat_last_n": 64, "repeat_scope": "reply"}
    new["variants"]["gguf_q4_0"]["drift"]["pass_rate"] = 0.0          # would fail under the same decoding
    new["variants"]["gguf_q4_0"]["intervals"]["pass_rate"] = {"estimate": 0.0, "low": 0.0, "high": 0.01}
    code, junit, md = gate(new, base)
    assert code == 0, md
    assert "decoded differently (repeat_penalty 1.0 -> repeat_penalty 1.1" in md and "pass_rate" in md
    skipped = {tc.get("name"): tc.find("skipped").get("message") for tc in junit.iter("testcase")
               if tc.find("skipped") is not None}
    assert "decoded differently" in skipped["pass_rate"]
    assert not any(c.get("name") == "pass_rate" for c in junit.iter("testcase") if c.find("skipped") is None)
    same = copy.deepcopy(new)
    same["variants"] = base["variants"]
    assert gate(new, same)[0] == 1                                  # the same decoding: the drop is judged
    new["variants"]["gguf_q4_0"]["drift"]["kld_mean"] = 5.0           # drift is judged across decodings
    assert gate(new, base)[0] == 1


def test_replies_scored_with_other_checks_are_not_compared_on_their_checks(gate):
    """The suites' checks or reply budgets changed since the baseline (suites.*.checks_hash): pass and flip rates are
    left out and said so; drift is still judged; the same checks (or a baseline without the fingerprint) compare."""
    base, new = _summary(), _summary()
    base["suites"] = {"multi_turn": {"checks_hash": "aaaa"}, "long_output": {"checks_hash": "bbbb"}}
    new["suites"] = {"multi_turn": {"checks_hash": "aaaa"}, "long_output": {"checks_hash": "cccc"}}
    new["variants"]["gguf_q4_0"]["drift"]["pass_rate"] = 0.0          # would fail with the same checks
    new["variants"]["gguf_q4_0"]["intervals"]["pass_rate"] = {"estimate": 0.0, "low": 0.0, "high": 0.01}
    code, junit, md = gate(new, base)
    assert code == 0, md
    assert "Checks: the conversations, reply budgets or checks of long_output changed since the baseline" in md
    assert "pass_rate" in md
    skipped = {tc.get("name"): tc.find("skipped").get("message") for tc in junit.iter("testcase")
               if tc.find("skipped") is not None}
    assert "long_output changed" in skipped["pass_rate"]
    new["suites"]["long_output"]["checks_hash"] = "bbbb"
    assert gate(new, base)[0] == 1                                  # the same checks: the drop is judged
    del base["suites"]["long_output"]["checks_hash"]                # a baseline from before the fingerprint
    code, _, md = gate(new, base)
    assert code == 0 and "the baseline records no fingerprint of the conversations and checks of long_output" in md
    del base["suites"], new["suites"]
    assert gate(new, base)[0] == 1                                  # neither records it (old runs): judged
    base["suites"] = {"long_output": {"checks_hash": "bbbb"}}
    new["suites"] = {"long_output": {"checks_hash": "cccc"}}
    new["variants"]["gguf_q4_0"]["drift"]["kld_mean"] = 5.0           # drift is judged across checks
    assert gate(new, base)[0] == 1


def test_checks_fingerprint_follows_what_was_asked_and_checked():
    from pipeline.suites.records import Conversation, Turn, checks_fingerprint

    def conv(checks, budget=96, user="Order 4471?"):
        return [Conversation(id="a", suite="s", turns=[Turn(user=user, max_new_tokens=budget, checks=checks)])]

    one = [{"type": "contains", "value": "4471"}]
    assert checks_fingerprint(conv(one)) == checks_fingerprint(conv(list(one)))
    assert checks_fingerprint(conv(one)) != checks_fingerprint(conv(one, user="Order 4471, please?"))
    assert checks_fingerprint(conv(one)) != checks_fingerprint(conv(one, budget=192))
    assert checks_fingerprint(conv(one)) != checks_fingerprint(conv([{"type": "contains", "value": "4417"}]))


def test_bad_baseline_and_failed_run(gate, tmp_path):
    write_json(tmp_path / "results" / MODEL / "nightly" / "summary.json", _summary())
    cfg = compose(["command=regress", "run.name=nightly", f"paths.results={tmp_path / 'results'}",
                   f"regress.baseline={tmp_path / 'nope.json'}"])
    from pipeline.infra.errors import ConfigError

    with pytest.raises(ConfigError, match="nope.json does not exist"):
        run(cfg)
    new = _summary()
    new["variants"]["gguf_q4_0"] = {"status": "failed", "reason": "RuntimeError: out of memory"}
    assert gate(new, _summary())[0] == 2


def test_promote_keeps_the_previous_baseline(tmp_path):
    results = tmp_path / "results"
    for k in (0.001, 0.002):
        s = _summary()
        s["variants"]["gguf_q8_0"]["drift"]["kld_mean"] = k
        write_json(results / MODEL / "nightly" / "summary.json", s)
        assert run(compose(["command=baseline", "regress.promote=nightly", f"paths.results={results}"])) == 0
    base_dir = results / MODEL / "baseline" / "nightly"
    assert json.loads((base_dir / "summary.json").read_text())["variants"]["gguf_q8_0"]["drift"]["kld_mean"] == 0.002
    assert len(list((base_dir / "previous").glob("summary-*.json"))) == 1


@pytest.mark.integration
def test_cli_regress_exit_codes(tmp_path):
    """The console entry point as the nightly job calls it: 0 when nothing regressed, 1 for a regression, 2 when
    the run itself failed (a variant failed) and for bad input."""
    exe = [sys.executable, "-m", "pipeline.cli"]
    base = tmp_path / "base.json"
    write_json(base, _summary())

    def regress_with(new: dict) -> int:
        write_json(tmp_path / "results" / MODEL / "nightly" / "summary.json", new)
        return subprocess.run(exe + ["regress", f"baseline={base}", "run.name=nightly",
                                     f"paths.results={tmp_path / 'results'}", f"paths.artifacts={tmp_path / 'a'}"],
                              capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=300).returncode

    worse, failed = _summary(), _summary()
    worse["variants"]["gguf_q8_0"]["drift"]["kld_mean"] = 0.02
    failed["variants"]["gguf_q4_0"] = {"status": "failed", "reason": "RuntimeError: out of memory"}
    assert [regress_with(_summary()), regress_with(worse), regress_with(failed)] == [0, 1, 2]
    r = subprocess.run(exe + ["baseline", "--oops"], capture_output=True, text=True, cwd=PROJECT_ROOT)
    assert r.returncode == EXIT_BAD_INPUT


@pytest.mark.slow
def test_drift_metrics_are_deterministic(tiny_cfg):
    from pipeline.decide.variant_summary import variant_summary
    from pipeline.stages.variant_setup import load_result

    runs = []
    for _ in range(2):
        cfg = tiny_cfg("variant=gguf_q8_0", "force=true")
        assert run(cfg) == 0
        v = variant_summary(load_result(cfg, "gguf_q8_0"))
        runs.append((copy.deepcopy(v["drift"]), v["drift_detail"], v["free_running"]["pass_rate"]))
    assert runs[0] == runs[1]


@pytest.mark.slow
@pytest.mark.full       # a whole run repeated: `make test-all` (the nightly suite), not `make test`
def test_two_variant_multirun_with_the_joblib_launcher(tmp_path, tiny_llama):
    common = [f"model.source={tiny_llama}", "model.name=tiny", "profile=smoke", "run.suites=[smoke]",
              f"paths.artifacts={tmp_path / 'a'}", f"paths.results={tmp_path / 'r'}",
              f"paths.cache={PROJECT_ROOT / '.cache'}"]
    exe = [sys.executable, "-m", "pipeline.cli"]
    r = subprocess.run(exe + ["-m", "hydra/launcher=parallel", "hydra.launcher.n_jobs=2",
                              "variant=original,gguf_q8_0"] + common, capture_output=True, text=True, cwd=PROJECT_ROOT,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "JoblibLauncher" in r.stderr or "Joblib" in r.stderr + r.stdout
    r = subprocess.run(exe + ["report", "run.variants=[original,gguf_q8_0]"] + common, capture_output=True, text=True,
                       cwd=PROJECT_ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "r" / "tiny" / "smoke" / "summary.json").read_text())
    assert {n: v["status"] for n, v in summary["variants"].items()} == {"original": "ok", "gguf_q8_0": "ok"}
    # the shared stages were built once, under their locks
    assert len(list((tmp_path / "a" / "tiny").glob("gguf-f16/manifest.json"))) == 1


def test_slurm_launcher_config_composes():
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        c = hcompose("config", overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu"],
                     return_hydra_config=True)
    assert c.hydra.launcher._target_.endswith("SlurmLauncher")
    assert c.hydra.launcher.gpus_per_node == 1 and c.hydra.launcher.partition == "gpu"


def test_a_previous_schema_baseline_is_read_and_a_metric_it_lacks_is_not_compared(gate):
    """Schema 1 baselines are still read; a metric one side lacks is reported as not compared, never as a
    regression (and a summary of an unknown schema version is refused)."""
    base = _summary()
    del base["variants"]["gguf_q8_0"]["drift"]["kld_p99"]
    code, junit, md = gate(_summary(), base)
    assert code == 0
    assert "| gguf_q8_0 | kld_p99 | ok | not in the baseline (not compared) |" in md
    future = {**_summary(), "schema_version": 99}
    from pipeline.infra.errors import ConfigError

    with pytest.raises(ConfigError, match="expected schema_version 1 or 2 or 3"):
        gate(_summary(), future)


@pytest.mark.slow
@pytest.mark.full       # a whole run repeated: `make test-all` (the nightly suite), not `make test`
def test_the_gate_passes_a_rerun_and_fails_a_worse_file_under_an_existing_name(tiny_cfg):
    """The gate has power both ways: rerunning the same configuration from scratch (new evaluation, new speed
    trials) passes; the Q4_0 file evaluated under the name gguf_q8_0 fails, naming the variant and the metrics."""
    names = "run.variants=[original,gguf_q8_0]"
    # longer probes and three rounds than the smoke profile's, so that a 32-token prefill of a 3.5M-parameter
    # model (a few ms, mostly scheduler noise) does not decide the speed intervals; one thread, so that a neighbour
    # taking one of the two cores for a while does not stall llama.cpp's thread barriers at every one of its
    # 0.2 ms tokens (a clean-clone run saw Q8_0 decode 40 % slower against the control in the rerun alone)
    speed = ("profile.speed.prompt_tokens=128", "profile.speed.decode_tokens=32", "profile.speed.trials=3",
             "runtime.threads=1")
    # a random 3.5M-parameter model drifts in millionths of a nat: the default absolute floor of 0.001 nats (made
    # for real models) would hide a 100x worse file, so the gate here judges mean KLD on its relative tolerance
    gate = ("regress.tolerances.kld_mean.abs=0.0",)

    def compare(*extra, q8_extra=()):
        extra = (*extra, *speed)
        assert run(tiny_cfg("variant=original", *extra)) == 0
        assert run(tiny_cfg("variant=gguf_q8_0", *extra, *q8_extra)) == 0
        assert run(tiny_cfg("command=report", names, *extra)) == 0

    compare()
    assert run(tiny_cfg("command=baseline", "regress.promote=smoke", names, *speed)) == 0
    compare("force=true")
    rerun = tiny_cfg("command=regress", names, *speed, *gate)
    assert run(rerun) == 0, (rerun.results_dir / "regress" / "regress.md").read_text()
    compare(q8_extra=("variant.quantize.type=Q4_0",))
    swapped = tiny_cfg("command=regress", names, *speed, *gate)
    assert run(swapped) == 1
    md = (swapped.results_dir / "regress" / "regress.md").read_text()
    failed = {(c.get("classname"), c.get("name")) for c in ET.parse(swapped.results_dir / "regress" / "junit.xml")
              .getroot().iter("testcase") if c.find("failure") is not None}
    assert ("quantdrift.gguf_q8_0", "kld_mean") in failed, md
    assert "| gguf_q8_0 | kld_mean | **REGRESSED** |" in md
    from pipeline.config.summary_contract import BY_NAME

    # the original's drift is untouched (its speed is re-measured with the rest, and judged on intervals)
    assert not [m for cls, m in failed if cls == "quantdrift.original" and m in BY_NAME
                and BY_NAME[m].section == "drift"], failed


def test_a_trial_figure_regresses_only_when_both_intervals_are_apart(gate):
    """Speed from interleaved trials: the baseline is itself a noisy median, so a speed regresses only when the
    new interval lies below the baseline interval by more than the ratio tolerance."""
    base, new = _summary(), _summary()
    base["variants"]["gguf_q8_0"]["intervals"]["decode_tokens_per_s"] = {"estimate": 60.0, "low": 20.0, "high": 90.0}
    new["variants"]["gguf_q8_0"]["speed"]["decode_tokens_per_s"] = 25.0      # ratio 0.42 < 0.5 on the medians
    new["variants"]["gguf_q8_0"]["intervals"]["decode_tokens_per_s"] = {"estimate": 25.0, "low": 15.0, "high": 30.0}
    extra = "regress.tolerances.decode_tokens_per_s.interval=true"
    code, _, md = gate(new, base, extra)
    assert code == 0 and "are not apart by the tolerance" in md
    new["variants"]["gguf_q8_0"]["intervals"]["decode_tokens_per_s"] = {"estimate": 8.0, "low": 6.0, "high": 9.0}
    new["variants"]["gguf_q8_0"]["speed"]["decode_tokens_per_s"] = 8.0
    code, _, md = gate(new, base, extra)
    assert code == 1 and "| gguf_q8_0 | decode_tokens_per_s | **REGRESSED**" in md


ROUND_NOISE = [1.0, 1.03, 0.97, 1.01, 0.99, 1.02]     # what the machine does to every variant in a round


def _with_trials(summary: dict, scale: float = 1.0, slow: dict | None = None, floor: float = 0.05) -> dict:
    """Stored interleaved trials for every variant (both runtimes' controls included) and the A/A floor: a
    round's machine noise moves every variant alike, ``scale`` moves the whole machine, ``slow`` one variant."""
    s = copy.deepcopy(summary)
    for i, (name, v) in enumerate(s["variants"].items()):
        own = scale * (slow or {}).get(name, 1.0)
        jitter = [1.0, 0.995, 1.004, 1.0, 0.998, 1.003]
        jitter = jitter[i:] + jitter[:i]           # each variant's own small jitter
        values = {m: [v["speed"][m] * own * n * j for n, j in zip(ROUND_NOISE, jitter)]
                  for m in ("decode_tokens_per_s", "prefill_tokens_per_s")}
        v["speed_trials"] = {"rounds": 6, "failed": [], "values": values}
        v["speed"] = {m: sorted(x)[3] for m, x in values.items()}
        v["runtime"], v["kernel"] = ("hf", "torch") if name == "original" else ("llamacpp", "ggml-cpu")
    s["speed_noise"] = {"control": "original", "rounds": 6,
                        "figures": {m: {"floor": floor} for m in ("decode_tokens_per_s", "prefill_tokens_per_s")}}
    s["versions"] = {"torch": "2.13.0", "transformers": "5.24.0", "llama-cpp-python": "0.3.36"}
    s["hardware"] = {"cpu": "AMD EPYC", "cores": 2, "cpu_key": "d33f879f", "memory_gib": 23.4}
    s["bandwidth"] = {"bytes_per_s": 40e9}
    return s


def test_a_uniformly_slower_machine_passes_and_its_drift_is_reported(gate, tmp_path):
    """Every variant 30 % slower (another instance of the same machine type): each variant's ratio to the other
    variants of its runtime is unchanged, so nothing regresses; the diff states each runtime's machine drift and the
    regression the two runs could detect, and the history line records them. A runtime with one variant has nothing
    to judge it against: its change is that runtime's drift."""
    base = _with_trials(_summary())
    code, junit, md = gate(_with_trials(_summary(), scale=0.7), base,
                           "regress.tolerances.decode_tokens_per_s.ratio=0.9")   # absolute figures would fail
    assert code == 0, md
    assert "each variant judged as a ratio to a control on its own runtime" in md
    assert ("Machine drift on transformers (reported, not gated): its unchanged variant `original` decodes 30% "
            "slower than in the baseline (21.1 vs 30.1 tok/s)") in md
    assert "Machine drift on llama.cpp (reported, not gated): its 2 unchanged variants decode (geometric mean" in md
    assert ("Smallest regression this pair of runs would catch (80 % power), per variant: gguf_q4_0 decode -6.0%, "
            "prefill -6.0%; gguf_q8_0 decode -6.0%, prefill -6.0%.") in md
    assert "transformers: `original` is its only unchanged variant, with nothing to judge it against" in md
    assert "| original | decode_tokens_per_s | ok | the only unchanged transformers variant: no other variant" in md
    line = json.loads((tmp_path / "results" / "history.jsonl").read_text().splitlines()[-1])
    assert line["machine_drift"]["hf"]["decode_tokens_per_s"] == pytest.approx(-0.3, abs=1e-9)
    assert sorted(line["machine_drift"]["llamacpp"]["members"]) == ["gguf_q4_0", "gguf_q8_0"]
    q4 = line["speed_relative"]["gguf_q4_0"]["decode_tokens_per_s"]
    assert q4["ratio"] == pytest.approx(1.5, rel=0.01) and q4["change"] == pytest.approx(0, abs=0.01)
    assert 0.05 < q4["detectable"] < 0.07 and q4["rounds"] == 6


def test_one_variant_slower_against_its_runtime_control_fails_naming_it(gate):
    """One llama.cpp variant alone 20 % slower against the other llama.cpp variant, on a machine 30 % slower
    overall: that variant and figure fail, nothing else does (the other reads 25 % faster against it: not a
    regression); a torch upgrade leaves llama.cpp's check on; a llama.cpp upgrade turns off llama.cpp's check only,
    and says so. A named control (regress.controls) is judged by nothing: its change is the drift."""
    base = _with_trials(_summary())
    new = _with_trials(_summary(), scale=0.7, slow={"gguf_q4_0": 0.8})
    code, junit, md = gate(new, base)
    assert code == 1, md
    failed = [(tc.get("classname"), tc.get("name")) for tc in junit.iter("testcase") if tc.find("failure") is not None]
    assert sorted(failed) == [("quantdrift.gguf_q4_0", "decode_tokens_per_s"),
                              ("quantdrift.gguf_q4_0", "prefill_tokens_per_s")]
    assert ("| gguf_q4_0 | decode_tokens_per_s | **REGRESSED** | 1.200× `gguf_q8_0` (the other llama.cpp variant)"
            in md)
    assert "change -20.0%" in md and "change +25.0%" in md
    code, junit, md = gate(new, base, "+regress.controls.llamacpp=gguf_q8_0")
    assert code == 1 and "| gguf_q4_0 | decode_tokens_per_s | **REGRESSED** | 1.200× the control `gguf_q8_0`" in md
    assert "| gguf_q8_0 | decode_tokens_per_s | ok | the llama.cpp control: its own change is that runtime's" in md
    new["versions"]["torch"] = "2.14.0"
    code, _, md = gate(new, base)
    assert code == 1 and "transformers: its libraries changed since the baseline (torch 2.13.0 -> 2.14.0)" in md
    assert "| gguf_q4_0 | decode_tokens_per_s | **REGRESSED**" in md
    new["versions"]["torch"] = "2.13.0"
    new["versions"]["llama-cpp-python"] = "0.3.40"
    code, junit, md = gate(new, base)
    assert code == 0, md
    assert "llama.cpp: its libraries changed since the baseline (llama-cpp-python 0.3.36 -> 0.3.40)" in md
    skipped = {(tc.get("classname"), tc.get("name")) for tc in junit.iter("testcase") if tc.find("skipped") is not None}
    assert ("quantdrift.gguf_q4_0", "decode_tokens_per_s") in skipped
    # an engine setting of the slow variant changed (its KV cache): it is judged, and left out of the other's
    # control, which then has nothing left to be judged against
    new["versions"]["llama-cpp-python"] = "0.3.36"
    base["variants"]["gguf_q4_0"]["runtime_info"] = {"cache_type_k": "f16", "threads": 2}
    new["variants"]["gguf_q4_0"]["runtime_info"] = {"cache_type_k": "q4_0", "threads": 2}
    code, _, md = gate(new, base)
    assert code == 1 and "| gguf_q4_0 | decode_tokens_per_s | **REGRESSED** | 1.200× `gguf_q8_0`" in md
    assert ("changed since the baseline, so judged but left out of the others' control: `gguf_q4_0` (cache_type_k "
            "'f16' -> 'q4_0')") in md
    assert "| gguf_q8_0 | decode_tokens_per_s | ok | the only unchanged llama.cpp variant" in md
    # inside the 5 % margin: a 4 % slowdown is never a regression, however tight the rounds
    assert gate(_with_trials(_summary(), scale=0.7, slow={"gguf_q4_0": 0.96}), base)[0] == 0


def test_a_shift_inside_the_rounds_own_spread_is_noise_and_a_clear_shift_still_fails(gate):
    """Three rounds on a busy machine: the variant's ratio to the control spread 1.06-2.22 while the baseline's sat
    at 2.12-2.49 (what CI once saw). Its mean fell 35 %, far past the 5 % margin, but with three rounds Welch's
    interval reaches back inside it: noise, not a regression. The same three rounds around a ratio halved do fail."""
    def three(summary):
        for v in summary["variants"].values():
            v["speed_trials"]["values"] = {m: x[:3] for m, x in v["speed_trials"]["values"].items()}
        return summary

    base = three(_with_trials(_summary()))
    ctl = base["variants"]["gguf_q8_0"]["speed_trials"]["values"]["prefill_tokens_per_s"]
    base["variants"]["gguf_q4_0"]["speed_trials"]["values"]["prefill_tokens_per_s"] = [
        c * r for c, r in zip(ctl, [2.32, 2.12, 2.49])]
    new = three(_with_trials(_summary()))
    ctl = new["variants"]["gguf_q8_0"]["speed_trials"]["values"]["prefill_tokens_per_s"]
    new["variants"]["gguf_q4_0"]["speed_trials"]["values"]["prefill_tokens_per_s"] = [
        c * r for c, r in zip(ctl, [1.44, 1.06, 2.22])]
    code, _, md = gate(new, base)
    assert code == 0, md
    assert "the change's interval reaches inside the margin (noise, not a regression)" in md
    new["variants"]["gguf_q4_0"]["speed_trials"]["values"]["prefill_tokens_per_s"] = [
        c * r for c, r in zip(ctl, [1.15, 1.10, 1.20])]
    code, _, md = gate(new, base)
    assert code == 1 and "| gguf_q4_0 | prefill_tokens_per_s | **REGRESSED**" in md, md


def test_instances_told_apart_by_the_hardware_record(gate):
    """Same CPU model string, other instruction set (a cpu_key) or memory: not the same hardware; the speed
    figures are then not compared at all unless compare_all."""
    base = _with_trials(_summary())
    new = _with_trials(_summary(), slow={"gguf_q8_0": 0.5})
    new["hardware"]["cpu_key"] = "0badc0de"
    code, _, md = gate(new, base)
    assert code == 0 and "hardware differs (cpu_key 'd33f879f' -> '0badc0de')" in md
    assert "not compared: decode_tokens_per_s" in md


def _scaled(summary: dict, names, factor: float, metrics=("decode_tokens_per_s", "prefill_tokens_per_s")) -> dict:
    s = copy.deepcopy(summary)
    for n in names:
        values = s["variants"][n]["speed_trials"]["values"]
        for m in metrics:
            values[m] = [None if x is None else x * factor for x in values[m]]
    return s


def test_the_gate_on_copies_of_the_committed_default_run(gate):
    """The committed default run against itself passes; every variant 30 % slower passes with
    each runtime's machine drift reported; one llama.cpp variant's decode 10 % slower fails, naming the variant,
    the figure and the change (its rounds, the extra llama.cpp rounds included, resolve it)."""
    run = json.loads((PROJECT_ROOT / "results" / MODEL / "quick" / "summary.json").read_text())
    ok = [n for n, v in run["variants"].items() if v["status"] == "ok"]
    code, _, md = gate(run, run)
    assert code == 0, md
    code, _, md = gate(_scaled(run, ok, 0.7), run)
    assert code == 0, md
    assert "Machine drift on llama.cpp (reported, not gated): its 6 unchanged variants decode (geometric mean of their medians) 30% slower" in md
    assert "Machine drift on transformers (reported, not gated): its 4 unchanged variants decode (geometric mean of their medians) 30% slower" in md
    code, junit, md = gate(_scaled(run, ["gguf_q4_k_m"], 0.9, ("decode_tokens_per_s",)), run)
    assert code == 1, md
    failed = [(tc.get("classname"), tc.get("name")) for tc in junit.iter("testcase") if tc.find("failure") is not None]
    assert failed == [("quantdrift.gguf_q4_k_m", "decode_tokens_per_s")], md
    assert "| gguf_q4_k_m | decode_tokens_per_s | **REGRESSED** |" in md and "change -10.0%" in md
