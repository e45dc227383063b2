"""Speed judged against a control on the variant's own runtime, measured in the same interleaved rounds.

A shared machine moves every variant's speed by 10-30 % between instances, and it does not move two engines alike:
between two committed runs transformers slowed 24 % while llama.cpp variants slowed 17-31 %. Nor does it move two
formats of one engine alike: on a machine that slowed 10 % the F16 GGUF, which reads twice the bytes per token of
Q8_0, slowed 2-6 % more than the quantized files. So each variant is judged against the other variants of its own
runtime: round by round, the log of its figure over the geometric mean of theirs in the same interleaved round
(``regress.controls`` may name one variant per runtime as the control instead).

A figure regresses when the change of that per-round log ratio (this run's mean against the baseline's) has its
whole 95 % interval beyond a practical margin (``regress.speed_margin``, 5 %). The interval is Welch's: the two
runs' rounds are independent samples, each with its own spread, so a run with few or noisy rounds widens it and
cannot fail a variant on a shift inside its own noise. For every variant the gate also states the smallest
regression this pair of runs would catch (with 80 % power) and, when that is over ``regress.detect_target`` (10 %),
how many rounds each run would need to bring it under, and about how long they take at this run's pace.

The change of the control (the geometric mean of the runtime's variants, or the named control) against the
baseline's is that runtime's machine drift: reported, never gated. A variant whose engine or artifact changed since
the baseline (runtime, kernel, artifact size, producer) is judged, but left out of the others' control. The check
applies per runtime only while the versions of the libraries the runtime runs on and the hardware records match; a
llama.cpp upgrade turns off llama.cpp's speed gating only, and the gate says so.
"""

from __future__ import annotations

import math
import statistics

from pipeline.config import summary_contract as catalogue
from pipeline.infra.backends import RUNTIMES
from pipeline.figures.stats import median_interval

RUNTIME_LABELS = {"hf": "transformers", "llamacpp": "llama.cpp"}
# what tells two machines apart; a key only one record has is not compared (an older baseline)
HARDWARE_KEYS = ("cpu", "cores", "machine", "cpu_key", "memory_gib", "usable_cpus")
LEVEL, POWER = 0.95, 0.80
# runtime_info keys that change what a variant's speed measures (a KV cache type, flash attention, threads...)
ENGINE_SETTINGS = ("device", "dtype", "threads", "n_batch", "flash_attn", "cache_type_k", "cache_type_v", "kv_unified",
                   "offloaded_layers")
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


def runtime_variants(base: dict) -> dict[str, list[str]]:
    """Runtime -> the baseline's measured variants of it (ok, with interleaved trials), in the baseline's order."""
    by_runtime: dict[str, list[str]] = {}
    for name, v in (base.get("variants") or {}).items():
        if v.get("status") == "ok" and _trials(base, name, "decode_tokens_per_s"):
            by_runtime.setdefault(v.get("runtime") or "", []).append(name)
    return by_runtime


def choose_controls(base: dict, configured: dict | None) -> dict[str, str | None]:
    """Runtime -> its named control (``regress.controls``), or None: each variant against the runtime's others."""
    return {rt: (configured or {}).get(rt) for rt in runtime_variants(base)}


def control_name(control: str | list[str] | None, runtime: str = "") -> str:
    """How the diff names a control: `gguf_f16`, or the other variants of the runtime."""
    if isinstance(control, str):
        return f"the control `{control}`"
    if len(control or []) == 1:
        return f"`{control[0]}` (the other {runtime_label(runtime)} variant)"
    return f"the other {len(control or [])} {runtime_label(runtime)} variants (geometric mean)"


def variant_changes(new: dict, base: dict, name: str) -> list[str] | None:
    """What changed in a variant's engine and artifact since the baseline ([] nothing); None when either run has
    no measured speed for it."""
    vn, vb = (new.get("variants") or {}).get(name), (base.get("variants") or {}).get(name)
    if not vn or not vb or vn.get("status") != "ok" or vb.get("status") != "ok":
        return None
    changes = []
    for what, get in (("runtime", lambda v: v.get("runtime")), ("kernel", lambda v: v.get("kernel")),
                      ("artifact bytes", lambda v: (v.get("memory") or {}).get("artifact_bytes")),
                      ("producer", lambda v: (v.get("artifact") or {}).get("producer"))):
        if get(vn) != get(vb):
            changes.append(f"{what} {get(vb)!r} -> {get(vn)!r}")
    # the engine settings the speed probe ran with, where both runs recorded them
    sn, sb = vn.get("runtime_info") or {}, vb.get("runtime_info") or {}
    changes += [f"{k} {sb[k]!r} -> {sn[k]!r}" for k in ENGINE_SETTINGS if k in sn and k in sb and sn[k] != sb[k]]
    return changes


def library_changes(new: dict, base: dict, runtime: str) -> list[str]:
    """The libraries the runtime's speed depends on (every recorded one for a runtime the registry lacks) whose
    versions differ between the two runs."""
    backend = RUNTIMES.get(runtime)
    libs = backend.libraries if backend else tuple(set(new.get("versions") or {}) | set(base.get("versions") or {}))
    return [f"{lib} {(base.get('versions') or {}).get(lib)} -> {(new.get('versions') or {}).get(lib)}"
            for lib in sorted(libs) if (base.get("versions") or {}).get(lib) != (new.get("versions") or {}).get(lib)]


def control_unchanged(new: dict, base: dict, control: str) -> tuple[bool, str]:
    """A named control's engine, artifact and libraries are the baseline's: what the nightly job must not change
    for the control-relative check to hold."""
    changes = variant_changes(new, base, control)
    if changes is None:
        vn = (new.get("variants") or {}).get(control)
        where = "this run" if not vn or vn.get("status") != "ok" else "the baseline"
        return False, f"the control `{control}` has no measured speed in {where}"
    changes += library_changes(new, base, ((new.get("variants") or {}).get(control) or {}).get("runtime") or "")
    if changes:
        return False, f"the control `{control}` changed since the baseline ({'; '.join(changes)})"
    return True, f"the control `{control}` is unchanged since the baseline"


def _control_rounds(summary: dict, control: str | list[str], metric: str) -> list:
    """The control's value per round: the named variant's, or the geometric mean of the listed variants' (None in a
    round where one of them has none)."""
    if isinstance(control, str):
        return _trials(summary, control, metric)
    series = [_trials(summary, c, metric) for c in control]
    if not series:
        return []
    out = []
    for i in range(min(len(x) for x in series)):
        vals = [x[i] for x in series]
        ok = all(v is not None and v > 0 for v in vals)
        out.append(math.exp(statistics.fmean(math.log(v) for v in vals)) if ok else None)
    return out


def log_ratios(summary: dict, variant: str, control: str | list[str], metric: str) -> list[float]:
    """log(variant / control) round by round (the same interleaved round); rounds where either failed are left
    out."""
    return [math.log(a / b) for a, b in zip(_trials(summary, variant, metric), _control_rounds(summary, control, metric))
            if a is not None and b is not None and a > 0 and b > 0]


def relative(summary: dict, variant: str, control: str | list[str], metric: str) -> dict | None:
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


def _median_change(new: dict, base: dict, names: list[str], metric: str) -> dict | None:
    """The geometric mean of the named variants' medians in each run, and its change."""
    pairs = [(median_interval(_trials(new, n, metric)), median_interval(_trials(base, n, metric))) for n in names]
    pairs = [(a["estimate"], b["estimate"]) for a, b in pairs if a and b and a["estimate"] and b["estimate"]]
    if not pairs or len(pairs) < len(names):
        return None
    gm = lambda xs: math.exp(statistics.fmean(math.log(x) for x in xs))          # noqa: E731
    a, b = gm([x for x, _ in pairs]), gm([y for _, y in pairs])
    return {"new": a, "base": b, "change": a / b - 1}


def plan(new: dict, base: dict, cfg_regress) -> dict:
    """Per runtime, whether its variants' speed is judged against a control, and the machine drift:
    {"applies", "note", "runtimes": {runtime: {"control" (a named control, else None), "members" (the variants
    whose geometric mean is the control: those unchanged since the baseline), "applies", "note", "drift" {metric:
    {new, base, change}}, "round_s"}}, "controls": {named control: runtime}, "bandwidth": {new, base}}."""
    out = {"applies": False, "note": "", "runtimes": {}, "controls": {},
           "bandwidth": {"new": new.get("bandwidth"), "base": base.get("bandwidth")},
           "margin": cfg_regress.speed_margin, "target": cfg_regress.detect_target}
    if not cfg_regress.control_relative:
        out["note"] = "the control-relative speed check is off (regress.control_relative=false)"
        return out
    same_hw, hw_note = hardware_matches(new, base)
    names = runtime_variants(base)
    for runtime, control in sorted(choose_controls(base, cfg_regress.controls).items()):
        entry = {"control": control, "members": [], "applies": False, "note": "", "drift": {},
                 "round_s": _round_seconds(new, runtime)}
        out["runtimes"][runtime] = entry
        label = runtime_label(runtime)
        if control is not None:
            out["controls"][control] = runtime
            if not _ok(base, control) or (base["variants"][control].get("runtime") or "") != runtime:
                entry["note"] = (f"regress.controls.{runtime}=`{control}` is not a measured {label} variant of the "
                                 "baseline")
                continue
            members, (same_ctl, ctl_note) = [control], control_unchanged(new, base, control)
        else:
            changes = {n: variant_changes(new, base, n) for n in names[runtime]}
            members = [n for n in names[runtime] if changes[n] == []]
            changed = [f"`{n}` ({'; '.join(changes[n])})" if changes[n] else f"`{n}` (not measured in this run)"
                       for n in names[runtime] if n not in members]
            libs = library_changes(new, base, runtime)
            same_ctl = bool(members) and not libs
            ctl_note = (f"its libraries changed since the baseline ({'; '.join(libs)})" if libs else
                        f"no {label} variant is unchanged since the baseline" if not members else
                        f"`{members[0]}` is its only unchanged variant, with nothing to judge it against"
                        if len(members) == 1 else f"each {label} variant against the geometric mean of the others")
            if changed and not libs:
                ctl_note += ("; changed since the baseline, so judged but left out of the others' control: "
                             + ", ".join(changed))
        entry["members"] = members
        for metric in speed_metrics():
            d = _median_change(new, base, members, metric)
            if d:
                entry["drift"][metric] = d
        if not same_hw or not same_ctl:
            entry["note"] = hw_note if not same_hw else ctl_note
            continue
        entry.update(applies=True, note=ctl_note)
    out["applies"] = any(e["applies"] for e in out["runtimes"].values())
    out["note"] = hw_note if not same_hw else "; ".join(
        f"{runtime_label(rt)}: {e['note']}" for rt, e in out["runtimes"].items())
    return out


def control_for(entry: dict, variant: str) -> str | list[str] | None:
    """The control a variant is judged against: the runtime's named control, else its other unchanged variants
    (None when it has none)."""
    if entry.get("control") is not None:
        return entry["control"]
    others = [n for n in entry.get("members") or [] if n != variant]
    return others or None


def compare(metric: str, variant: str, new: dict, base: dict, control: str | list[str], margin: float,
            target: float, round_s: float | None = None, runtime: str = "") -> tuple[bool, str, dict | None]:
    """(regressed, message, figures) for one speed figure of one variant, as a per-round ratio to its control
    (a named variant, or the geometric mean of the listed ones). It regresses only when the whole interval of the
    change lies beyond the margin."""
    m = catalogue.BY_NAME[metric]
    rn, rb = relative(new, variant, control, metric), relative(base, variant, control, metric)
    who = control_name(control, runtime)
    if rb is None:
        return False, f"fewer than {MIN_ROUNDS} rounds against {who} in the baseline (not compared)", None
    if rn is None:
        return True, f"not measured against {who} in this run", None
    j = judge(rn, rb, margin, m.better)
    sign = "-" if m.better == "higher" else "+"
    text = (f"{rn['ratio']:.3f}× {who} (per-round spread {rn['sd']:.1%}, {rn['n']} rounds) vs "
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
               "detectable": j["detectable"], "against": control if isinstance(control, str) else "others"}
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
            n = len(e.get("members") or [])
            who = (f"its control `{e['control']}` decodes" if e.get("control") is not None else
                   f"its unchanged variant `{e['members'][0]}` decodes" if n == 1 else
                   f"its {n} unchanged variants decode (geometric mean of their medians)")
            lines.append(f"Machine drift on {runtime_label(runtime)} (reported, not gated): {who} "
                         f"{abs(d['change']):.0%} {word} than in the baseline ({d['new']:.1f} vs {d['base']:.1f} tok/s).")
    if lines and bw:
        lines.append(bw.strip())
    return lines
