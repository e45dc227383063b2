"""Speed judged against a control measured in the same interleaved rounds.

A shared machine moves every variant's speed by 10-30 % between instances; a ratio to a control variant measured in
the same rounds cancels most of that. For each variant and speed figure the gate takes the per-round ratio
variant / control (the median and its order-statistic interval over the rounds), and compares it with the same
ratio in the baseline. The tolerance comes from the two runs' A/A floors (the control measured twice per round:
``speed_noise`` in the summary): two independent ratios, each inside its run's floor, differ by up to
sqrt(floor_new^2 + floor_base^2), never less than ``regress.control_min_tolerance``. A figure regresses only when
the change's whole interval (both runs' ratio intervals combined) lies beyond that tolerance: with few rounds on a
busy machine one variant's ratio can spread far wider than the control's A/A floor, and a median moved inside that
spread decides nothing.

The control's own figures against the baseline's control are the machine drift: reported, never gated. The
control-relative check applies only when the control's engine and artifact are unchanged since the baseline
(same runtime, kernel, artifact size and producer, and the versions of the libraries its runtime runs on) and the
hardware records match; otherwise the gate says why and falls back to the absolute check.
"""

from __future__ import annotations

import math

from pipeline.config import summary_contract as catalogue
from pipeline.measure.stats import median_interval

# the libraries each runtime's speed depends on (a version change there changes the control's speed)
RUNTIME_LIBRARIES = {"hf": ("torch", "transformers"), "llamacpp": ("llama-cpp-python",)}
# what tells two machines apart; a key only one record has is not compared (an older baseline)
HARDWARE_KEYS = ("cpu", "cores", "machine", "cpu_key", "memory_gib", "usable_cpus")


def speed_metrics() -> list[str]:
    return [m.name for m in catalogue.METRICS if m.section == "speed" and m.better]


def hardware_matches(new: dict, base: dict) -> tuple[bool, str]:
    """The two runs' hardware records agree on every key both carry, and on the device."""
    hn, hb = new.get("hardware") or {}, base.get("hardware") or {}
    differ = [k for k in HARDWARE_KEYS if k in hn and k in hb and hn[k] != hb[k]]
    if differ:
        return False, "hardware differs (" + ", ".join(f"{k} {hb[k]!r} -> {hn[k]!r}" for k in differ) + ")"
    if (new.get("run") or {}).get("device") != (base.get("run") or {}).get("device"):
        return False, "device differs"
    return True, "same hardware"


def control_name(summary: dict, configured: str | None) -> str | None:
    return configured or (summary.get("speed_noise") or {}).get("control")


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
    libs = RUNTIME_LIBRARIES.get(vn.get("runtime") or "",
                                 tuple(set(new.get("versions") or {}) | set(base.get("versions") or {})))
    for lib in sorted(libs):
        a, b = (base.get("versions") or {}).get(lib), (new.get("versions") or {}).get(lib)
        if a != b:
            changes.append(f"{lib} {a} -> {b}")
    if changes:
        return False, f"the control `{control}` changed since the baseline ({'; '.join(changes)})"
    return True, f"the control `{control}` is unchanged since the baseline"


def _trials(summary: dict, variant: str, metric: str) -> list:
    """The variant's per-round values of one speed figure (None for a failed round), [] when it has none."""
    return ((((summary["variants"].get(variant) or {}).get("speed_trials") or {}).get("values") or {})
            .get(metric) or [])


def relative(summary: dict, variant: str, control: str, metric: str) -> dict | None:
    """The variant's figure over the control's, round by round (the same interleaved round), with its median and
    order-statistic interval. None when either has no trials of that figure."""
    ratios = [a / b for a, b in zip(_trials(summary, variant, metric), _trials(summary, control, metric))
              if a is not None and b is not None and a > 0 and b > 0]
    return median_interval(ratios)


def floor(summary: dict, metric: str) -> float | None:
    f = (((summary.get("speed_noise") or {}).get("figures") or {}).get(metric) or {}).get("floor")
    return None if f is None else float(f)


def tolerance(new: dict, base: dict, metric: str, minimum: float) -> float | None:
    """The relative change the two runs' noise allows: both floors combined (independent runs), at least
    ``minimum``. None when either run has no A/A floor for the figure."""
    fn, fb = floor(new, metric), floor(base, metric)
    if fn is None or fb is None:
        return None
    return max(minimum, math.hypot(fn, fb))


def plan(new: dict, base: dict, cfg_regress) -> dict:
    """Whether the speed figures are judged against the control, and with what: {"applies", "note", "control",
    "tolerances" {metric: relative tolerance}, "drift" {metric: {new, base, change}}, "bandwidth" {new, base}}."""
    out = {"applies": False, "control": None, "tolerances": {}, "drift": {}, "note": "",
           "bandwidth": {"new": new.get("bandwidth"), "base": base.get("bandwidth")}}
    if not cfg_regress.control_relative:
        out["note"] = "the control-relative speed check is off (regress.control_relative=false)"
        return out
    control, base_control = control_name(new, cfg_regress.control), control_name(base, cfg_regress.control)
    if not control:
        out["note"] = "this run measured no A/A control (profile.speed.aa=false) and regress.control is unset"
        return out
    out["control"] = control
    if base_control != control:
        out["note"] = f"the baseline's control is `{base_control}`, this run's `{control}`"
        return out
    same_hw, hw_note = hardware_matches(new, base)
    same_ctl, ctl_note = control_unchanged(new, base, control)
    for metric in speed_metrics():
        a, b = median_interval(_trials(new, control, metric)), median_interval(_trials(base, control, metric))
        if a and b and b["estimate"]:
            out["drift"][metric] = {"new": a["estimate"], "base": b["estimate"],
                                    "change": a["estimate"] / b["estimate"] - 1}
        tol = tolerance(new, base, metric, cfg_regress.control_min_tolerance)
        if tol is not None:
            out["tolerances"][metric] = tol
    if not same_hw or not same_ctl:
        out["note"] = (hw_note if not same_hw else ctl_note)
        return out
    if not out["tolerances"]:
        out["note"] = "one of the runs has no A/A floor (speed_noise) to size the tolerance from"
        return out
    out.update(applies=True, note=f"{ctl_note}; {hw_note}")
    return out


def change_interval(rn: dict, rb: dict) -> tuple[float, float, float]:
    """The change of the control-relative ratio (new / baseline) with its interval: each run's median ratio is
    uncertain by its own order-statistic interval, and the two runs are independent, so the half-widths combine in
    quadrature on the log scale. Returns (change, low, high)."""
    change = rn["estimate"] / rb["estimate"]
    up = math.hypot(math.log(rn["high"] / rn["estimate"]), math.log(rb["estimate"] / rb["low"]))
    down = math.hypot(math.log(rn["estimate"] / rn["low"]), math.log(rb["high"] / rb["estimate"]))
    return change, change * math.exp(-down), change * math.exp(up)


def compare(metric: str, variant: str, new: dict, base: dict, control: str, tol: float) -> tuple[bool, str]:
    """(regressed, message) for one speed figure of one variant, as a ratio to the control. It regresses only when
    the whole interval of the change lies beyond the tolerance: a change inside either run's own trial-to-trial
    spread is noise, however far its median moved."""
    m = catalogue.BY_NAME[metric]
    rn, rb = relative(new, variant, control, metric), relative(base, variant, control, metric)
    if rb is None:
        return False, "no control-relative figure in the baseline (not compared)"
    if rn is None:
        return True, f"not measured against the control `{control}` in this run"
    change, low, high = change_interval(rn, rb)
    # a higher-is-better figure regresses when its ratio falls by more than tol; a time when it rises by as much
    bad = high < 1 - tol if m.better == "higher" else low > 1 / (1 - tol)
    beyond = "" if bad or not (change < 1 - tol if m.better == "higher" else change > 1 / (1 - tol)) else (
        "; the change's interval reaches inside the tolerance (noise, not a regression)")
    return bad, (f"{rn['estimate']:.3f}× the control `{control}` [{rn['low']:.3f}, {rn['high']:.3f}] vs baseline "
                 f"{rb['estimate']:.3f}× [{rb['low']:.3f}, {rb['high']:.3f}]: change {change - 1:+.1%} "
                 f"[{low - 1:+.1%}, {high - 1:+.1%}], allowed "
                 f"{'-' if m.better == 'higher' else '+'}{(tol if m.better == 'higher' else 1 / (1 - tol) - 1):.1%} "
                 f"(both runs' A/A floors){beyond}")


def drift_lines(p: dict) -> list[str]:
    """The machine drift and the gate's power, for the diff."""
    lines = []
    ctl = p.get("control")
    d = p["drift"].get("decode_tokens_per_s")
    if ctl and d:
        word = "slower" if d["change"] < 0 else "faster"
        bw = ""
        new_bandwidth, base_bandwidth = p["bandwidth"]["new"], p["bandwidth"]["base"]
        if (base_bandwidth or {}).get("bytes_per_s") and (new_bandwidth or {}).get("bytes_per_s"):
            bw = (f"; memory bandwidth probe {new_bandwidth['bytes_per_s'] / 1e9:.1f} vs "
                  f"{base_bandwidth['bytes_per_s'] / 1e9:.1f} GB/s")
        lines.append(f"Machine drift (reported, not gated): this machine decodes {abs(d['change']):.0%} {word} "
                     f"than the baseline's (control `{ctl}`: {d['new']:.1f} vs {d['base']:.1f} tok/s{bw}).")
    if p["tolerances"]:
        shown = ", ".join(f"{catalogue.BY_NAME[m].label} {p['tolerances'][m]:.0%}"
                          for m in ("decode_tokens_per_s", "prefill_tokens_per_s") if m in p["tolerances"])
        if shown:
            lines.append("Smallest control-relative speed regression this run can detect (both runs' A/A floors "
                         f"combined; a change must also clear both runs' trial intervals): {shown}.")
    return lines
