"""The decision's constraints: every configured limit judged on the variant's figure (on its 95 % interval under
``decision.confidence=upper``), and the "checks significantly worse than the original" test judged across the
variants with a family-wise correction (``decision.multiple_comparisons``), so that one variant in nine failing at
p < 0.05 by chance is not read as a measured drop.

Where a variant's replies were generated on another runtime than the reference's, its checks are judged against
the original's own replies on that runtime (``free_running.same_runtime``): the runtime switch's own flips are
not the format's.
"""

from __future__ import annotations

from pipeline.config.commands import DecisionConfig
from pipeline.config.summary_contract import BY_NAME

# constraint -> (catalogue metric, "max" | "min", message format, the interval key used under confidence=upper)
CONSTRAINTS = (
    ("max_kld_mean", "kld_mean", "max", "mean KLD {x}", "kld_mean"),
    ("max_kld_p99", "kld_p99", "max", "p99 KLD {x}", None),
    ("max_flip_rate", "flip_rate", "max", "flip rate {x}", "flip_rate"),
    ("min_pass_rate_ratio", "pass_rate_ratio", "min", "pass rate {x} of the original's", "pass_rate_ratio"),
    ("min_decode_tokens_per_s", "decode_tokens_per_s", "min", "decode {x} tok/s", "decode_tokens_per_s"),
    ("max_peak_rss_mb", "peak_rss_mb", "max", "peak RSS {x} MB", "peak_rss_mb"),
    ("max_artifact_bytes", "artifact_bytes", "max", "artifact {x} bytes", None),
)
FMT = {"kld_mean": ".4f", "kld_p99": ".3f", "flip_rate": ".1%", "pass_rate_ratio": ".0%",
       "decode_tokens_per_s": ".1f", "peak_rss_mb": ".0f", "artifact_bytes": "d"}
# checks-based figures: judged against the original on the variant's own runtime where that baseline exists
SAME_RUNTIME = ("flip_rate", "pass_rate_ratio")


def fmt(metric: str, x) -> str:
    return format(int(x) if FMT[metric] == "d" else x, FMT[metric])


def checks_test(v: dict) -> tuple[dict | None, str]:
    """The conversation-level test of the variant's checks the decision uses, and against what: the original on the
    same runtime where the replies came from another runtime than the reference's, else the reference."""
    fr = v.get("free_running") or {}
    same = (fr.get("same_runtime") or {}).get("vs_original_same_runtime")
    if same and same.get("conversation_test"):
        return same["conversation_test"], f"the original on {fr['same_runtime']['runtime']}"
    return fr.get("conversation_test"), "the original"


def pass_drop_family(variants: dict[str, dict], d: DecisionConfig) -> dict[str, dict]:
    """Per variant (the original excluded: it is the reference), the conversation-level test of its checks against
    the original with the p-value adjusted across every variant tested (Holm by default), and whether it fails
    ``decision.max_pass_drop_p``: a drop (mean difference < 0) with an adjusted p under the limit."""
    from pipeline.measure.stats import adjust_p

    tests = {}
    for name, v in variants.items():
        if v.get("status") != "ok" or name == "original":
            continue
        test, against = checks_test(v)
        if test and test.get("p") is not None:
            tests[name] = {**test, "against": against}
    adjusted = adjust_p({n: t["p"] for n, t in tests.items()}, d.multiple_comparisons)
    out = {}
    for name, t in tests.items():
        fails = (d.max_pass_drop_p is not None and t["mean_difference"] < 0
                 and adjusted[name] is not None and adjusted[name] < d.max_pass_drop_p)
        out[name] = {**t, "p_adjusted": adjusted[name], "method": d.multiple_comparisons, "family": len(tests),
                     "fails": bool(fails)}
    return out


def _value_and_interval(v: dict, metric: str, iv_key: str | None, d: DecisionConfig) -> tuple:
    """(value, interval or None, where from: "" or " against the original on RUNTIME")."""
    same = (v.get("intervals_same_runtime") or {}) if metric in SAME_RUNTIME else {}
    intervals = same or v.get("intervals") or {}
    where = f" against the original on {v['free_running']['same_runtime']['runtime']}" if same else ""
    if metric == "pass_rate_ratio" or (same and metric in same):
        x = (intervals.get(metric) or {}).get("estimate")
    else:
        x = v[BY_NAME[metric].section][metric]
    iv = intervals.get(iv_key) if (iv_key and d.confidence == "upper") else None
    return x, iv, where


def judge_constraints(v: dict, d: DecisionConfig, pass_drop: dict | None = None) -> list[dict]:
    """Every configured constraint the variant does not clearly meet: {"constraint", "verdict": fail | undecided |
    not measurable, "message", "violation"} in the configured order.

    confidence=point judges the point estimate. confidence=upper judges the 95 % interval where the figure has
    one: a limit inside the interval is "undecided" (neither passes nor fails; the variant is not recommended),
    the whole interval on the wrong side fails. "not measurable" (a pass-rate ratio when the original passes no
    check) is reported, never judged. ``pass_drop``: this variant's entry of ``pass_drop_family`` (its checks
    significantly worse than the original's after the family-wise correction fails it)."""
    out = []
    for key, metric, kind, msg, iv_key in CONSTRAINTS:
        limit = getattr(d, key)
        if limit is None:
            continue
        x, iv, where = _value_and_interval(v, metric, iv_key, d)
        over = (lambda a: a > limit) if kind == "max" else (lambda a: a < limit)
        sign = ">" if kind == "max" else "<"
        lim_s = fmt(metric, limit) if metric not in ("flip_rate", "pass_rate_ratio") else format(limit, ".0%")
        if x is None:
            if metric == "pass_rate_ratio":
                out.append({"constraint": key, "verdict": "not measurable", "violation": 0.0,
                            "message": "pass-rate ratio not measurable: the original passes none of the checks"})
            else:
                out.append({"constraint": key, "verdict": "fail", "violation": float("inf"),
                            "message": msg.format(x="").replace("  ", " ").strip() + " not measured"})
            continue
        if iv and iv.get("low") is not None and iv.get("high") is not None:
            bad_side, good_side = (iv["low"], iv["high"]) if kind == "max" else (iv["high"], iv["low"])
            shown = f"{fmt(metric, x)} [{fmt(metric, iv['low'])}, {fmt(metric, iv['high'])}]{where}"
            if over(bad_side):
                verdict = "fail"
            elif over(good_side):
                verdict = "undecided"
            else:
                continue
            text = (msg.format(x=shown) + f" {sign} {lim_s}" if verdict == "fail"
                    else msg.format(x=shown) + f": its 95 % interval straddles the limit {lim_s}")
        elif over(x):
            verdict, text = "fail", msg.format(x=fmt(metric, x) + where) + f" {sign} {lim_s}"
        else:
            continue
        out.append({"constraint": key, "verdict": verdict, "message": text,
                    "violation": abs(x - limit) / max(abs(limit), 1e-12)})
    out += recovery_constraints(v, d)
    if pass_drop and pass_drop["fails"]:
        out.append({"constraint": "max_pass_drop_p", "verdict": "fail", "violation": -pass_drop["mean_difference"],
                    "message": f"checks significantly worse than {pass_drop['against']}'s (per-conversation pass "
                               f"rate {pass_drop['mean_difference']:+.0%}, sign-flip p={pass_drop['p']:.3f}, "
                               f"{pass_drop['method']}-adjusted over {pass_drop['family']} variants "
                               f"p={pass_drop['p_adjusted']:.3f} < {d.max_pass_drop_p})"})
    return out


def recovery_constraints(v: dict, d: DecisionConfig) -> list[dict]:
    """``decision.min_recovery`` on every benchmark task of the variant (``v["benchmarks"]``, the summary's rows):
    fails where the LOWER bound of recovery's 95 % interval (its accuracy / the original's on the same samples) is
    below the limit, whatever ``decision.confidence`` says; "not measurable" where the task has no recovery (no
    original's answers in the run, or the original answered none right) or did not run on the variant."""
    if d.min_recovery is None:
        return []
    out = []
    for task, row in (v.get("benchmarks") or {}).items():
        rec = row.get("recovery") if row.get("status") == "ok" else None
        if rec is None or rec.get("low") is None:
            why = (f"did not run ({row.get('reason')})" if row.get("status") != "ok"
                   else "has no recovery (no original's answers to compare with, or the original answered none "
                        "right)")
            out.append({"constraint": "min_recovery", "verdict": "not measurable", "violation": 0.0,
                        "message": f"bench:{task} recovery not measurable: the task {why}"})
            continue
        if rec["low"] < d.min_recovery:
            out.append({"constraint": "min_recovery", "verdict": "fail",
                        "violation": (d.min_recovery - rec["low"]) / d.min_recovery,
                        "message": f"bench:{task} recovery {rec['estimate']:.0%} [{rec['low']:.0%}, {rec['high']:.0%}] "
                                   f"of the original's {row['metric']} over {row['samples']} samples: its lower "
                                   f"bound {rec['low']:.1%} < {d.min_recovery:.0%}"})
    return out


def failed_constraints(v: dict, d: DecisionConfig, pass_drop: dict | None = None) -> list[tuple[str, float]]:
    """The constraints the variant fails or leaves undecided: (message, relative violation)."""
    return [(("undecided: " if c["verdict"] == "undecided" else "") + c["message"], c["violation"])
            for c in judge_constraints(v, d, pass_drop) if c["verdict"] in ("fail", "undecided")]
