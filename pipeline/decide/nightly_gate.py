"""The nightly regression gate: this run's summary.json against a baseline summary, per variant x metric.

Outputs: exit code (0 no regression, 1 regression, 2 the run itself failed), a JUnit XML file (one test case per
variant x metric), a Markdown diff table, and one appended line in results/history.jsonl.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from pipeline.config import summary_contract as catalogue
from pipeline.config.schema import PROJECT_ROOT, Config
from pipeline.figures import speed_control
from pipeline.infra.errors import ConfigError
from pipeline.infra.files import atomic_write_text, read_json, write_json

log = logging.getLogger(__name__)

EXIT_OK, EXIT_REGRESSION, EXIT_RUN_FAILED = 0, 1, 2

def baseline_dir(cfg: Config) -> Path:
    return Path(cfg.paths.results) / cfg.model.name / "baseline" / cfg.run.name


def load_summary(path: str | Path, what: str) -> dict:
    p = Path(path)
    if p.is_dir():
        p = p / "summary.json"
    if not p.is_file():
        raise ConfigError(f"{what}: {p} does not exist (expected a summary.json or a results folder holding one)")
    try:
        s = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what}: {p} is not valid JSON ({exc.msg}, line {exc.lineno})") from None
    version = s.get("schema_version") if isinstance(s, dict) else None
    if not isinstance(s, dict) or "variants" not in s or version not in catalogue.READABLE_SCHEMA_VERSIONS:
        raise ConfigError(f"{what}: {p} is not a quantdrift summary (expected schema_version "
                          f"{' or '.join(map(str, catalogue.READABLE_SCHEMA_VERSIONS))} with 'variants', "
                          f"got {version!r})")
    if version == catalogue.SCHEMA_VERSION:
        catalogue.validate_summary(s, f"{what} {p}")
    return s


def compare_metric(metric: str, new_v: dict, base_v: dict, tol: dict) -> tuple[bool, str]:
    """(regressed, message) for one metric of one variant. A metric the baseline lacks (an older schema, or not
    measured then) is not compared; one this run lacks is a regression."""
    m = catalogue.BY_NAME[metric]
    new, base = catalogue.value(new_v, metric), catalogue.value(base_v, metric)
    if base is None:
        return False, "not in the baseline (not compared)"
    if new is None:
        why = " (screened out by its mean KLD: decision.screen=false measures it)" if new_v.get("screened") else ""
        return True, f"not measured{why} (baseline {base:.6g})"
    better = m.better
    worse_by = m.worse(new, base)
    if "ratio" in tol:
        limit = tol["ratio"] * base
        bad = new < limit if better == "higher" else new > base / max(tol["ratio"], 1e-12)
        text = f"{new:.6g} vs baseline {base:.6g} (ratio {new / base if base else float('inf'):.2f}, limit {tol['ratio']})"
    else:
        allowed = max(tol.get("abs", 0.0), tol.get("rel", 0.0) * abs(base))
        bad = worse_by > allowed + 1e-12
        text = f"{new:.6g} vs baseline {base:.6g} (worse by {worse_by:+.4g}, allowed {allowed:.4g})"
    note = ""
    if bad and tol.get("interval"):
        iv = (new_v.get("intervals") or {}).get(m.interval or "")
        base_iv = (base_v.get("intervals") or {}).get(m.interval or "")
        if iv and base_iv and m.section in ("speed", "memory"):
            # a figure from interleaved trials: the baseline is a noisy median too, so the whole new interval must
            # be worse than the whole baseline interval by more than the tolerance
            if "ratio" in tol:
                bad = (iv["high"] < tol["ratio"] * base_iv["low"] if better == "higher"
                       else iv["low"] > base_iv["high"] / max(tol["ratio"], 1e-12))
            else:
                gap = base_iv["low"] - iv["high"] if better == "higher" else iv["low"] - base_iv["high"]
                bad = gap > max(tol.get("abs", 0.0), tol.get("rel", 0.0) * abs(base)) + 1e-12
            if not bad:
                note = (f"; the 95% intervals [{iv['low']:.4g}, {iv['high']:.4g}] and baseline "
                        f"[{base_iv['low']:.4g}, {base_iv['high']:.4g}] are not apart by the tolerance")
        elif iv:
            # noise never fails a job: the new interval must exclude the baseline on the bad side
            excludes = iv["high"] < base if better == "higher" else iv["low"] > base
            if not excludes:
                bad = False
                note = f"; within the 95% interval [{iv['low']:.4g}, {iv['high']:.4g}]"
    return bad, text + note


def environment_matches(new: dict, base: dict) -> tuple[bool, str]:
    same_hw, hw_note = speed_control.hardware_matches(new, base)
    if not same_hw:
        return False, hw_note
    diff = sorted(k for k in set(new.get("versions", {})) | set(base.get("versions", {}))
                  if new.get("versions", {}).get(k) != base.get("versions", {}).get(k))
    if diff:
        return False, "library versions differ: " + ", ".join(
            f"{k} {base.get('versions', {}).get(k)}->{new.get('versions', {}).get(k)}" for k in diff)
    return True, "same hardware and library versions"


def decoding_matches(new: dict, base: dict) -> tuple[bool, str]:
    dn, db = catalogue.decoding_of(new), catalogue.decoding_of(base)
    if dn == db:
        return True, "same decoding"
    show = lambda d: ", ".join(f"{k} {v}" for k, v in d.items())   # noqa: E731
    return False, (f"free-running replies decoded differently ({show(db)} -> {show(dn)}): their pass and flip rates "
                   "are not comparable")


def checks_match(new: dict, base: dict) -> tuple[bool, str]:
    """Both runs asked and checked the same on every suite they share (``suites.*.checks_hash``: the conversations,
    reply budgets and checks). A run without the fingerprint (a summary from before it existed) cannot say: its
    pass and flip rates are not compared against one that has it."""
    def hashes(summary: dict) -> dict:
        return {s: (v or {}).get("checks_hash") for s, v in (summary.get("suites") or {}).items()}

    hn, hb = hashes(new), hashes(base)
    if not any(hn.values()) and not any(hb.values()):
        return True, "same checks (neither run records them)"
    shared = sorted(set(hn) & set(hb))
    unknown = [s for s in shared if not hn[s] or not hb[s]]
    if unknown:
        return False, (f"{'the baseline' if any(not hb[s] for s in unknown) else 'this run'} records no fingerprint "
                       f"of the conversations and checks of {', '.join(unknown)}: pass and flip rates are not "
                       "comparable")
    changed = [s for s in shared if hn[s] != hb[s]]
    if not changed:
        return True, "same checks"
    return False, (f"the conversations, reply budgets or checks of {', '.join(changed)} changed since the baseline: "
                   "pass and flip rates are not comparable")


def regress(new: dict, base: dict, cfg_regress) -> dict:
    """Every variant x metric compared; returns {"cases": [...], "regressions": n, "environment": ...}. Metrics of
    the free-running replies are compared only when both runs decoded them the same way (``run.decoding``)."""
    same_env, env_note = environment_matches(new, base)
    same_dec, dec_note = decoding_matches(new, base)
    same_checks, checks_note = checks_match(new, base)
    # speed as a per-round ratio to a control on the variant's own runtime, measured in the same rounds: judged
    # wherever that runtime's libraries and the hardware are unchanged, even when other libraries changed
    control = speed_control.plan(new, base, cfg_regress)
    applies = {rt for rt, e in control["runtimes"].items() if e["applies"]}
    speed = set(speed_control.speed_metrics())
    absolute_ok = same_env or cfg_regress.compare_all
    judged = [m.name for m in catalogue.METRICS if m.better]
    metrics = [m for m in judged if absolute_ok or catalogue.BY_NAME[m].hardware_independent
               or (m in speed and applies)]
    # why each left-out metric is left out: "environment" or "decoding" (the result's note of that name says how)
    why = {m: "environment" for m in judged if m not in metrics}
    # the free-running replies' metrics (pass and flip rates) need the same decoding and the same checks
    for kind, same in (("decoding", same_dec), ("checks", same_checks)):
        if not same:
            why.update({m: kind for m in metrics if catalogue.BY_NAME[m].source == "free"})
            metrics = [m for m in metrics if m not in why]
    cases = []
    for name, base_v in base["variants"].items():
        new_v = new["variants"].get(name)
        if base_v.get("status") != "ok":
            continue
        if new_v is None or new_v.get("status") != "ok":
            reason = "missing from this run" if new_v is None else f"{new_v.get('status')}: {new_v.get('reason')}"
            cases.append({"variant": name, "metric": "status", "regressed": True, "message": reason})
            continue
        runtime = new_v.get("runtime") or ""
        entry = control["runtimes"].get(runtime) or {}
        for metric in metrics:
            tol = {**(cfg_regress.tolerances or {}).get(metric, {}),
                   **((cfg_regress.per_variant or {}).get(name, {}) or {}).get(metric, {})}
            if not tol:
                continue
            case = {"variant": name, "metric": metric}
            judge_against = speed_control.control_for(entry, name) if runtime in applies else None
            if metric in speed and runtime in applies and name == entry["control"]:
                d = entry["drift"].get(metric)
                case.update(regressed=False, message=(
                    f"the {speed_control.runtime_label(runtime)} control: its own change is that runtime's machine "
                    "drift, reported and not gated" + (f" ({d['new']:.4g} vs {d['base']:.4g}, {d['change']:+.0%})"
                                                        if d else "")))
            elif metric in speed and runtime in applies and judge_against is None:
                d = entry["drift"].get(metric)
                case.update(regressed=False, message=(
                    f"the only unchanged {speed_control.runtime_label(runtime)} variant: no other variant of its "
                    "runtime to judge it against; its own change is that runtime's machine drift, reported and not "
                    "gated" + (f" ({d['new']:.4g} vs {d['base']:.4g}, {d['change']:+.0%})" if d else "")))
            elif metric in speed and runtime in applies:
                bad, msg, figures = speed_control.compare(metric, name, new, base, judge_against,
                                                          cfg_regress.speed_margin, cfg_regress.detect_target,
                                                          entry["round_s"], runtime)
                case.update(regressed=bad, message=msg, relative=figures)
            elif metric in speed and not absolute_ok:
                case.update(regressed=False, skipped=True, message=(
                    f"not compared: {speed_control.runtime_label(runtime)} speed is not judged against a control "
                    f"({entry.get('note') or 'no control of that runtime in the baseline'}) and {env_note}"))
            else:
                bad, msg = compare_metric(metric, new_v, base_v, tol)
                case.update(regressed=bad, message=msg)
            cases.append(case)
    skipped = [m for m in (cfg_regress.tolerances or {}) if m in judged and m not in metrics]
    return {"cases": cases, "regressions": sum(c["regressed"] for c in cases), "environment": env_note,
            "same_environment": same_env, "decoding": dec_note, "same_decoding": same_dec,
            "checks": checks_note, "same_checks": same_checks,
            "speed_control": control, "control_relative": sorted(speed) if applies else [],
            "skipped_metrics": skipped, "skipped_because": {m: why[m] for m in skipped}}


def junit_xml(result: dict, suite_name: str) -> str:
    cases = result["cases"]
    root = ET.Element("testsuite", name=suite_name, tests=str(len(cases)), failures=str(result["regressions"]),
                      errors="0", skipped=str(len(result["skipped_metrics"]) + sum(bool(c.get("skipped"))
                                                                                  for c in cases)))
    for c in cases:
        tc = ET.SubElement(root, "testcase", classname=f"quantdrift.{c['variant']}", name=c["metric"])
        if c["regressed"]:
            ET.SubElement(tc, "failure", message=f"{c['variant']} {c['metric']} regressed: {c['message']}").text = c["message"]
        elif c.get("skipped"):
            ET.SubElement(tc, "skipped", message=c["message"])
        else:
            ET.SubElement(tc, "system-out").text = c["message"]
    for m in result["skipped_metrics"]:
        tc = ET.SubElement(root, "testcase", classname="quantdrift.environment", name=m)
        ET.SubElement(tc, "skipped", message=f"not compared: {result[result['skipped_because'][m]]}")
    return ET.tostring(root, encoding="unicode", xml_declaration=True)


def diff_markdown(result: dict, new_path: Path, base_path: Path) -> str:
    lines = ["# quantdrift regression check", "",
             f"Run `{new_path}` against baseline `{base_path}`: **{result['regressions']} regression(s)**.", "",
             f"Environment: {result['environment']}."]
    left_out = {kind: [m for m in result["skipped_metrics"] if result["skipped_because"][m] == kind]
                for kind in ("environment", "decoding", "checks")}
    if left_out["environment"]:
        lines.append("Compared on hardware-independent metrics only (drift and checks); not compared: "
                     + ", ".join(left_out["environment"]) + " (set regress.compare_all=true to compare them).")
    if not result["same_decoding"]:
        lines.append(f"Decoding: {result['decoding']}; not compared: " + ", ".join(left_out["decoding"])
                     + " (promote a baseline decoded as this run is: `make promote`).")
    if not result.get("same_checks", True):
        lines.append(f"Checks: {result['checks']}; not compared: " + ", ".join(left_out["checks"])
                     + " (promote a baseline scored with this run's checks: `make promote`).")
    control = result.get("speed_control") or {}
    if control:
        lines.append(("Speed: each variant judged as a ratio to a control on its own runtime measured in the same "
                      f"interleaved rounds ({control['note']}); a figure regresses when its change's 95 % interval "
                      f"lies wholly beyond the {control['margin']:.0%} margin." if result.get("control_relative") else
                      f"Speed: judged on absolute figures ({control['note']})."))
        lines += speed_control.drift_lines(control)
        detect = _detectable(result)
        if detect:
            lines.append("Smallest regression this pair of runs would catch (80 % power), per variant: "
                         + "; ".join(detect) + ".")
    lines += ["", "| variant | metric | result | detail |", "|---|---|---|---|"]
    for c in sorted(result["cases"], key=lambda c: (not c["regressed"], c["variant"], c["metric"])):
        lines.append(f"| {c['variant']} | {c['metric']} | {'**REGRESSED**' if c['regressed'] else 'ok'} | "
                     f"{c['message'].replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def _detectable(result: dict) -> list[str]:
    """'<variant> decode -9.1 %, prefill -7.0 %' for every variant judged against a control on its runtime."""
    short = {"decode_tokens_per_s": "decode", "prefill_tokens_per_s": "prefill"}
    out: dict[str, list[str]] = {}
    for c in sorted(result["cases"], key=lambda c: list(short).index(c["metric"]) if c["metric"] in short else 9):
        if c.get("relative") and c["metric"] in short:
            sign = "-" if catalogue.BY_NAME[c["metric"]].better == "higher" else "+"
            out.setdefault(c["variant"], []).append(f"{short[c['metric']]} {sign}{c['relative']['detectable']:.1%}")
    return [f"{v} {', '.join(parts)}" for v, parts in out.items()]


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def history_line(summary: dict, result: dict | None) -> dict:
    return {
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": summary["model"]["name"], "run": summary["run"]["name"], "profile": summary["run"]["profile"],
        "commit": _git_commit(), "versions": summary.get("versions"), "hardware": summary.get("hardware"),
        "recommendation": summary["recommendation"].get("variant"),
        "regressions": None if result is None else result["regressions"],
        # each runtime's control against the baseline's: this machine's drift per engine (a trend across runs)
        "machine_drift": None if result is None else {
            rt: {"control": e["control"] or "geometric mean of the runtime's unchanged variants",
                 "members": e.get("members"), **{m: d["change"] for m, d in e["drift"].items()}}
            for rt, e in ((result.get("speed_control") or {}).get("runtimes") or {}).items()},
        # every variant's speed as a ratio to its control on its runtime, and the regression the gate could detect
        "speed_relative": None if result is None else _relative_rows(result),
        "schema_version": summary.get("schema_version"),
        # every judged metric of the catalogue (a trend plot reads what it knows)
        "variants": {n: {"status": v["status"], **({m.name: catalogue.value(v, m.name) for m in catalogue.METRICS
                                                    if m.better} if v["status"] == "ok" else {})}
                     for n, v in summary["variants"].items()},
    }


def _relative_rows(result: dict) -> dict:
    rows: dict[str, dict] = {}
    for c in result["cases"]:
        if c.get("relative"):
            rows.setdefault(c["variant"], {})[c["metric"]] = {
                k: c["relative"][k] for k in ("ratio", "change", "detectable", "rounds", "against")}
    return rows


def append_history(path: Path, line: dict) -> None:
    """One JSON line appended under a lock (concurrent nightly jobs on a shared results folder)."""
    from pipeline.infra.stage_cache import locked

    path.parent.mkdir(parents=True, exist_ok=True)
    with locked(path):
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line, sort_keys=True) + "\n")
            fh.flush()


def run_regress(cfg: Config) -> int:
    new_path = cfg.results_dir / "summary.json"
    if not new_path.is_file():
        log.error("no summary for this run at %s: the comparison did not finish", new_path)
        print(f"error: the run itself failed: {new_path} does not exist (run `make compare` first)")
        return EXIT_RUN_FAILED
    new = load_summary(new_path, "this run's summary")
    failed = [n for n, v in new["variants"].items() if v["status"] == "failed"]
    base_path = Path(cfg.regress.baseline) if cfg.regress.baseline else baseline_dir(cfg)
    base = load_summary(base_path, "regress.baseline")
    result = regress(new, base, cfg.regress)
    out_dir = cfg.results_dir / "regress"
    junit = Path(cfg.regress.junit) if cfg.regress.junit else out_dir / "junit.xml"
    out_dir.mkdir(parents=True, exist_ok=True)
    junit.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(junit, junit_xml(result, f"quantdrift.{cfg.model.name}.{cfg.run.name}"))
    md = diff_markdown(result, new_path, base_path)
    atomic_write_text(out_dir / "regress.md", md)
    write_json(out_dir / "regress.json", result)
    append_history(Path(cfg.paths.results) / "history.jsonl", history_line(new, result))
    print(md)
    print(f"junit: {junit}")
    if failed:
        print(f"error: the run itself failed: variant(s) {', '.join(failed)} failed (see the report)")
        return EXIT_RUN_FAILED
    return EXIT_REGRESSION if result["regressions"] else EXIT_OK


def promote(cfg: Config, run_name: str) -> int:
    """Make results/<model>/<run_name>/summary.json the baseline of that run name; the old one is kept."""
    src = Path(cfg.paths.results) / cfg.model.name / run_name / "summary.json"
    load_summary(src, f"baseline promote {run_name}")
    dest_dir = Path(cfg.paths.results) / cfg.model.name / "baseline" / run_name
    dest = dest_dir / "summary.json"
    had_previous = dest.is_file()
    if had_previous:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(dest.stat().st_mtime))
        (dest_dir / "previous").mkdir(parents=True, exist_ok=True)
        shutil.copy2(dest, dest_dir / "previous" / f"summary-{stamp}.json")
    write_json(dest, read_json(src))
    print(f"baseline for run '{run_name}': {dest}" + (" (previous kept in previous/)" if had_previous else ""))
    return EXIT_OK
