"""Speed judged against a control on the variant's own runtime, measured in the same interleaved rounds.

A shared machine moves every variant's speed by 10-30 % between instances, and it does not move two engines alike:
between two committed runs transformers slowed 24 % while llama.cpp variants slowed 17-31 %. So each runtime has its
own control (``regress.controls``; by default the runtime's highest-fidelity variant of the baseline: `original` for
transformers, the F16 or Q8_0 GGUF for llama.cpp), and each variant's speed figure is taken round by round as the
log of its ratio to that control in the same interleaved round.

A figure regresses when the change of that per-round log ratio (this run's mean against the baseline's) has its
whole 95 % interval beyond a practical margin (``regress.speed_margin``, 5 %). The interval is Welch's: the two
runs' rounds are independent samples, each with its own spread, so a run with few or noisy rounds widens it and
cannot fail a variant on a shift inside its own noise. For every variant the gate also states the smallest
regression this pair of runs would catch (with 80 % power) and, when that is over ``regress.detect_target`` (10 %),
how many rounds each run would need to bring it under, and about how long they take at this run's pace.

The control's own change against the baseline's control is that runtime's machine drift: reported, never gated.
The check applies per runtime only while that runtime's control is unchanged since the baseline (same runtime,
kernel, artifact size and producer, and the versions of the libraries the runtime runs on) and the hardware
records match; a llama.cpp upgrade turns off llama.cpp's speed gating only, and the gate says so.
"""

from __future__ import annotations

import math
import statistics

from pipeline.config import summary_contract as catalogue
from pipeline.config.backends import RUNTIMES
from pipeline.measure.stats import median_interval

RUNTIME_LABELS = {"hf": "transformers", "llamacpp": "llama.cpp"}
# what tells two machines apart; a key only one record has is not compared (an older baseline)
HARDWARE_KEYS = ("cpu", "cores", "machine", "cpu_key", "memory_gib", "usable_cpus")
LEVEL, POWER = 0.95, 0.80
MIN_ROUNDS = 3


def speed_metrics() -> list[str]:
    return [m.name for m in catalogue.METRICS if m.section == "speed" and m.better]


def runtime_label(runtime: str | None) -> str:
    return RUNTIME_LABELS.get(runtime or "", runtime or "unknown runtime")


def hardware_matches(new: dict, base: dict) -> tuple[bool, str]:
    """The two runs' hardware records agree on every key both carry, and on the device."""
    hn, hb = new.get("hardware") or {}, base.get("hardware") or {}
    differ = [k for k in HARDWARE_KEYS if k in hn and k in hb and hn[k] != hb[k]]
    if differ:
        return False, "hardware differs (" + ", ".join(f"{k} {hb[k]!r} -> {hn[k]!r}" for k in differ) + ")"
    if (new.get("run") or {}).get("device") != (base.get("run") or {}).get("device"):
        return False, "device differs"
    return True, "same hardware"


def _trials(summary: dict, variant: str, metric: str) -> list:
    """The variant's per-round values of one speed figure (None for a failed round), [] when it has none."""
    return ((((summary["variants"].get(variant) or {}).get("speed_trials") or {}).get("values") or {})
            .get(metric) or [])


def _ok(summary: dict, name: str) -> bool:
    return ((summary.get("variants") or {}).get(name) or {}).get("status") == "ok"


def choose_controls(base: dict, configured: dict | None) -> dict[str, str]:
    """Runtime -> its control: the configured variant, else the baseline's highest-fidelity variant of that runtime
    with interleaved trials (`original` first, then the lowest mean KLD: the F16 or Q8_0 GGUF for llama.cpp)."""
    by_runtime: dict[str, list[str]] = {}
    for name, v in (base.get("variants") or {}).items():
        if v.get("status") == "ok" and _trials(base, name, "decode_tokens_per_s"):
            by_runtime.setdefault(v.get("runtime") or "", []).append(name)

    def fidelity(name: str):
        kld = catalogue.value(base["variants"][name], "kld_mean")
        return (name != "original", kld if kld is not None and math.isfinite(kld) else math.inf, name)

    return {rt: (configured or {}).get(rt) or min(names, key=fidelity) for rt, names in by_runtime.items()}


def control_unchanged(new: dict, base: dict, control: str) -> tuple[bool, str]:
    """The control's engine and artifact are the baseline's: what the nightly job must not change for the
    control-relative check to hold."""
    vn, vb = (new.get("variants") or {}).get(control), (base.get("variants") or {}).get(control)
    if not vn or not vb or vn.get("status") != "ok" or vb.get("status") != "ok":
        where = "this run" if not vn or vn.get("status") != "ok" else "the baseline"
        return False, f"the control `{control}` has no measured speed in {where}"
    changes = []
    for what, get in (("runtime", lambda v: v.get("runtime")), ("kernel", lambda v: v.get("kernel")),
                      ("artifact bytes", lambda v: (v.get("memory") or {}).get("artifact_bytes")),
                      ("producer", lambda v: (v.get("artifact") or {}).get("producer"))):
        if get(vn) != get(vb):
            changes.append(f"{what} {get(vb)!r} -> {get(vn)!r}")
    # the libraries the runtime's speed depends on (every recorded one for a runtime the registry lacks)
    backend = RUNTIMES.get(vn.get("runtime") or "")
    libs = backend.libraries if backend else tuple(set(new.get("versions") or {}) | set(base.get("versions") or {}))
    for lib in sorted(libs):
        a, b = (base.get("versions") or {}).get(lib), (new.get("versions") or {}).get(lib)
        if a != b:
            changes.append(f"{lib} {a} -> {b}")
    if changes:
        return False, f"the control `{control}` changed since the baseline ({'; '.join(changes)})"
    return True, f"the control `{control}` is unchanged since the baseline"


def log_ratios(summary: dict, variant: str, control: str, metric: str) -> list[float]:
    """log(variant / control) round by round (the same interleaved round); rounds where either failed are left
    out."""
    return [math.log(a / b) for a, b in zip(_trials(summary, variant, metric), _trials(summary, control, metric))
            if a is not None and b is not None and a > 0 and b > 0]


def relative(summary: dict, variant: str, control: str, metric: str) -> dict | None:
    """The variant's figure over the control's, round by round: the geometric mean ratio, the per-round spread of
    its log (``sd``) and the number of rounds. None with fewer than MIN_ROUNDS rounds."""
    d = log_ratios(summary, variant, control, metric)
    if len(d) < MIN_ROUNDS:
        return None
    return {"ratio": math.exp(statistics.fmean(d)), "mean": statistics.fmean(d), "sd": statistics.stdev(d),
            "n": len(d)}


def _welch(rn: dict, rb: dict) -> tuple[float, float]:
    """Standard error of the difference of two independent means, and Welch's degrees of freedom."""
    vn, vb = rn["sd"] ** 2 / rn["n"], rb["sd"] ** 2 / rb["n"]
    se = math.sqrt(vn + vb)
    if se == 0:
        return 0.0, float(rn["n"] + rb["n"] - 2)
    df = (vn + vb) ** 2 / ((vn ** 2 / (rn["n"] - 1) if vn else 0.0) + (vb ** 2 / (rb["n"] - 1) if vb else 0.0))
    return se, df


def _t(q: float, df: float) -> float:
    from scipy.stats import t as student_t

    return float(student_t.ppf(q, df))


def as_regression(log_change: float, better: str) -> float:
    """A worsening on the log scale as the fraction a reader says: a speed that falls by x (1 - e^-L), a time that
    grows by x (e^L - 1)."""
    return 1 - math.exp(-log_change) if better == "higher" else math.exp(log_change) - 1


def from_regression(fraction: float, better: str) -> float:
    return -math.log(1 - fraction) if better == "higher" else math.log(1 + fraction)


def rounds_needed(rn: dict, rb: dict, margin: float, target: float, better: str) -> int | None:
    """Rounds each run would need (both alike, at these spreads) for the detectable regression to reach ``target``;
    None when the target is not beyond the margin."""
    gap = from_regression(target, better) - from_regression(margin, better)
    if gap <= 0:
        return None
    z = 1.959964 + 0.841621                      # normal quantiles of the 95 % interval and 80 % power
    return max(MIN_ROUNDS, math.ceil((rn["sd"] ** 2 + rb["sd"] ** 2) * (z / gap) ** 2) + 1)


def judge(rn: dict, rb: dict, margin: float, better: str) -> dict:
    """The change of the per-round log ratio (this run against the baseline), its Welch 95 % interval, whether it
    lies wholly beyond the margin, and the smallest regression this pair of runs detects with 80 % power."""
    se, df = _welch(rn, rb)
    tq, tp = _t((1 + LEVEL) / 2, df), _t(POWER, df)
    delta = rn["mean"] - rb["mean"]
    low, high = delta - tq * se, delta + tq * se
    worse = -1.0 if better == "higher" else 1.0                  # the log direction a regression moves
    bound = from_regression(margin, better)
    regressed = (high < -bound) if better == "higher" else (low > bound)
    return {"change": math.exp(delta) - 1, "low": math.exp(low) - 1, "high": math.exp(high) - 1,
            "regressed": regressed, "beyond_margin_median": worse * delta > bound,
            "detectable": as_regression(bound + (tq + tp) * se, better), "se": se, "df": df}


def _round_seconds(summary: dict, runtime: str) -> float | None:
    """Seconds one more round of this runtime's variants would take at this run's pace: an extra round of the
    cheap runtimes where the run took some (profile.speed.extra_runtimes), else an interleaved round of every
    variant (the speed stage's time over its rounds)."""
    sp = summary.get("speed_protocol") or {}
    labels = set(sp.get("extra_labels") or [])
    if sp.get("extra_rounds") and sp.get("extra_seconds") and any(
            (summary["variants"].get(n) or {}).get("runtime") == runtime for n in labels):
        return sp["extra_seconds"] / sp["extra_rounds"]
    t = ((summary.get("stage_times") or {}).get("run_s") or {}).get("speed")
    n = sp.get("rounds")
    if t and n and sp.get("extra_seconds"):
        t -= sp["extra_seconds"]
    return t / n if t and n else None


def plan(new: dict, base: dict, cfg_regress) -> dict:
    """Per runtime, whether its variants' speed is judged against its control, and the machine drift:
    {"applies", "note", "runtimes": {runtime: {"control", "applies", "note", "drift" {metric: {new, base, change}},
    "round_s"}}, "controls": {variant: runtime}, "bandwidth": {new, base}}."""
    out = {"applies": False, "note": "", "runtimes": {}, "controls": {},
           "bandwidth": {"new": new.get("bandwidth"), "base": base.get("bandwidth")},
           "margin": cfg_regress.speed_margin, "target": cfg_regress.detect_target}
    if not cfg_regress.control_relative:
        out["note"] = "the control-relative speed check is off (regress.control_relative=false)"
        return out
    same_hw, hw_note = hardware_matches(new, base)
    for runtime, control in sorted(choose_controls(base, cfg_regress.controls).items()):
        entry = {"control": control, "applies": False, "note": "", "drift": {}, "round_s": _round_seconds(new, runtime)}
        out["runtimes"][runtime] = entry
        out["controls"][control] = runtime
        if not _ok(base, control) or (base["variants"][control].get("runtime") or "") != runtime:
            entry["note"] = (f"regress.controls.{runtime}=`{control}` is not a measured {runtime_label(runtime)} "
                             "variant of the baseline")
            continue
        for metric in speed_metrics():
            a = median_interval(_trials(new, control, metric))
            b = median_interval(_trials(base, control, metric))
            if a and b and b["estimate"]:
                entry["drift"][metric] = {"new": a["estimate"], "base": b["estimate"],
                                          "change": a["estimate"] / b["estimate"] - 1}
        same_ctl, ctl_note = control_unchanged(new, base, control)
        if not same_hw or not same_ctl:
            entry["note"] = hw_note if not same_hw else ctl_note
            continue
        entry.update(applies=True, note=ctl_note)
    out["applies"] = any(e["applies"] for e in out["runtimes"].values())
    out["note"] = hw_note if not same_hw else "; ".join(
        f"{runtime_label(rt)}: {e['note']}" for rt, e in out["runtimes"].items())
    return out


def compare(metric: str, variant: str, new: dict, base: dict, control: str, margin: float,
            target: float, round_s: float | None = None) -> tuple[bool, str, dict | None]:
    """(regressed, message, figures) for one speed figure of one variant, as a per-round ratio to its runtime's
    control. It regresses only when the whole interval of the change lies beyond the margin."""
    m = catalogue.BY_NAME[metric]
    rn, rb = relative(new, variant, control, metric), relative(base, variant, control, metric)
    if rb is None:
        return False, (f"fewer than {MIN_ROUNDS} rounds against the control `{control}` in the baseline "
                       "(not compared)"), None
    if rn is None:
        return True, f"not measured against the control `{control}` in this run", None
    j = judge(rn, rb, margin, m.better)
    sign = "-" if m.better == "higher" else "+"
    text = (f"{rn['ratio']:.3f}× the control `{control}` (per-round spread {rn['sd']:.1%}, {rn['n']} rounds) vs "
            f"baseline {rb['ratio']:.3f}× ({rb['sd']:.1%}, {rb['n']}): change {j['change']:+.1%} "
            f"[{j['low']:+.1%}, {j['high']:+.1%}], margin {sign}{margin:.0%}; detectable {sign}{j['detectable']:.1%}")
    if j["detectable"] > target:
        need = rounds_needed(rn, rb, margin, target, m.better)
        if need:
            text += f" ({need} rounds in each run would bring it to {sign}{target:.0%}"
            text += (f", about {need * round_s / 60:.0f} min of speed rounds at this run's pace)" if round_s else ")")
    if not j["regressed"] and j["beyond_margin_median"]:
        text += "; the change's interval reaches inside the margin (noise, not a regression)"
    figures = {"ratio": rn["ratio"], "sd": rn["sd"], "rounds": rn["n"], "change": j["change"],
               "detectable": j["detectable"]}
    return j["regressed"], text, figures


def drift_lines(p: dict) -> list[str]:
    """Each runtime's machine drift (its control against the baseline's), for the diff."""
    lines = []
    bw = ""
    nb, bb = (p.get("bandwidth") or {}).get("new"), (p.get("bandwidth") or {}).get("base")
    if (bb or {}).get("bytes_per_s") and (nb or {}).get("bytes_per_s"):
        bw = (f" Memory bandwidth probe: {nb['bytes_per_s'] / 1e9:.1f} vs {bb['bytes_per_s'] / 1e9:.1f} GB/s.")
    for runtime, e in (p.get("runtimes") or {}).items():
        d = e["drift"].get("decode_tokens_per_s")
        if d:
            word = "slower" if d["change"] < 0 else "faster"
            lines.append(f"Machine drift on {runtime_label(runtime)} (reported, not gated): its control "
                         f"`{e['control']}` decodes {abs(d['change']):.0%} {word} than in the baseline "
                         f"({d['new']:.1f} vs {d['base']:.1f} tok/s).")
    if lines and bw:
        lines.append(bw.strip())
    return lines
