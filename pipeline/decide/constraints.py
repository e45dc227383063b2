"""The decision's constraints, each judged per variant, so that adding variants never relieves one:

- every figure the decision reads is finite (a NaN compares false against every limit: a variant whose
  log-probabilities overflowed would otherwise pass them all);
- every configured limit on the variant's figure, on its 95 % interval under ``decision.confidence=upper`` (the
  variant must show it meets the limit: a straddled limit is "undecided");
- the checks' non-inferiority: the 95 % interval of the pass-rate change against the original must lie above
  ``-decision.max_pass_drop`` (wholly below it fails; straddling it is undecided);
- degeneration: the share of looping replies may exceed the original's by at most
  ``decision.max_degenerate_increase``, and the replies' mean repeated-4-gram rate may not exceed the configured
  limit;
- the deployment target (``pipeline.decide.target``): the variant fits the memory budget as served, and under
  ``decision.latency_targets=enforce`` meets the workload's latency targets.

Where a variant's replies were generated on another runtime than the reference's, its checks are judged against
the original's own replies on that runtime (``free_running.same_runtime``): the runtime switch's own flips are
not the format's.
"""

from __future__ import annotations

import math

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


def pass_drop_test(v: dict, d: DecisionConfig) -> dict | None:
    """The checks' non-inferiority test of one variant: the 95 % interval of its pass-rate change against the
    original (per conversation; on its own runtime where its replies came from another), judged against the margin
    ``decision.max_pass_drop``: "fails" when the whole interval lies below -margin, "undecided" when it straddles
    it, else "passes". The conversation-level sign-flip p is kept beside it for the reader; it decides nothing (a
    loss must not need proving). None for the original (the reference) and where no interval exists."""
    test, against = checks_test(v)
    same = (v.get("intervals_same_runtime") or {}).get("pass_rate_delta")
    iv = same or (v.get("intervals") or {}).get("pass_rate_delta")
    if not iv or iv.get("low") is None or iv.get("high") is None:
        return None
    margin = d.max_pass_drop
    verdict = ("not tested" if margin is None else "fails" if iv["high"] < -margin
               else "undecided" if iv["low"] < -margin else "passes")
    return {"against": against if same else "the original",
            "mean_difference": iv["estimate"], "low": iv["low"], "high": iv["high"], "margin": margin,
            "conversations": (test or {}).get("conversations") or iv.get("units"),
            "p": (test or {}).get("p"), "p_adjusted": None, "method": d.multiple_comparisons,
            "verdict": verdict, "fails": verdict == "fails"}


def pass_drop_tests(variants: dict[str, dict], d: DecisionConfig) -> dict[str, dict]:
    """``pass_drop_test`` of every evaluated variant but the original."""
    return {n: t for n, v in variants.items() if v.get("status") == "ok" and n != "original"
            and (t := pass_drop_test(v, d)) is not None}


# the figures every decision reads: a non-finite one fails the variant
FINITE = (("drift", "kld_mean", "mean KLD"), ("drift", "kld_p99", "p99 KLD"), ("drift", "top1_agreement",
          "top-1 agreement"), ("speed", "decode_tokens_per_s", "decode tok/s"),
          ("speed", "prefill_tokens_per_s", "prefill tok/s"))


def non_finite(v: dict) -> list[dict]:
    """A failed constraint per figure that is NaN or infinite, with its likely cause; a variant without a mean KLD
    (the figure every decision reads) fails as not measured."""
    out = []
    if (v.get("drift") or {}).get("kld_mean") is None:
        out.append({"constraint": "finite", "verdict": "fail", "violation": float("inf"),
                    "message": "mean KLD not measured"})
    dtype = (v.get("runtime_info") or {}).get("dtype")
    for section, key, label in FINITE:
        x = (v.get(section) or {}).get(key)
        if isinstance(x, (int, float)) and not math.isfinite(x):
            cause = (f"computed in {dtype}, whose range the model's activations likely exceed"
                     if dtype == "float16" else "overflowing or invalid log-probabilities, or a failed measurement")
            out.append({"constraint": "finite", "verdict": "fail", "violation": float("inf"),
                        "message": f"{label} is {x} (not a number): {cause}"})
    return out


def degeneration(v: dict, d: DecisionConfig, original: dict | None) -> list[dict]:
    """Looping replies: a share over the original's by more than ``decision.max_degenerate_increase`` (over none
    where the run has no original; the original itself is not compared with itself), or a mean repeated-4-gram
    rate over ``decision.degeneration.max_repeated_4gram_rate``."""
    fr = v.get("free_running") or {}
    if not fr.get("replies"):
        return []
    out = []
    if d.max_degenerate_increase is not None and original is not v:
        share = fr.get("degenerate_replies", 0) / fr["replies"]
        ofr = (original or {}).get("free_running") or {}
        base = ofr.get("degenerate_replies", 0) / ofr["replies"] if ofr.get("replies") else 0.0
        against = (f"against the original's {ofr.get('degenerate_replies', 0)} of {ofr['replies']}"
                   if ofr.get("replies") else "(no original's replies in this run: against none)")
        if share - base > d.max_degenerate_increase:
            out.append({"constraint": "max_degenerate_increase", "verdict": "fail", "violation": share - base,
                        "message": f"{fr.get('degenerate_replies')} of {fr['replies']} replies degenerate {against}: "
                                   f"more than {d.max_degenerate_increase * 100:.0f} points over"
                                   + (" the original's share" if ofr.get("replies") else " none")})
    limit = (d.degeneration or {}).get("max_repeated_4gram_rate")
    rate = fr.get("repeated_4gram_rate_mean")
    if limit is not None and rate is not None and rate > limit:
        out.append({"constraint": "degeneration.max_repeated_4gram_rate", "verdict": "fail",
                    "violation": rate / limit - 1,
                    "message": f"mean repeated-4-gram rate of its replies {rate:.2f} > {limit:g}"})
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


def judge_constraints(v: dict, d: DecisionConfig, pass_drop: dict | None = None, original: dict | None = None,
                      target: dict | None = None) -> list[dict]:
    """Every configured constraint the variant does not clearly meet: {"constraint", "verdict": fail | undecided |
    not measurable, "message", "violation"} in the configured order.

    confidence=point judges the point estimate. confidence=upper judges the 95 % interval where the figure has
    one: a limit inside the interval is "undecided" (neither passes nor fails; the variant is not recommended),
    the whole interval on the wrong side fails. "not measurable" (a pass-rate ratio when the original passes no
    check) is reported, never judged. A non-finite figure fails first. ``pass_drop``: this variant's
    ``pass_drop_test`` (a pass-rate change wholly below the margin fails, straddling it is undecided);
    ``original``: the original's entry (its degeneration is the baseline); ``target``: the deployment target
    (``pipeline.decide.target``)."""
    out = non_finite(v)
    for key, metric, kind, msg, iv_key in CONSTRAINTS:
        limit = getattr(d, key)
        if limit is None:
            continue
        x, iv, where = _value_and_interval(v, metric, iv_key, d)
        if isinstance(x, float) and not math.isfinite(x):
            if not any(metric == key for _, key, _ in FINITE):      # else failed above as not finite
                out.append({"constraint": key, "verdict": "fail", "violation": float("inf"),
                            "message": msg.format(x=str(x)) + " (not a number)"})
            continue
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
    if pass_drop and pass_drop["verdict"] in ("fails", "undecided"):
        shown = (f"pass-rate change against {pass_drop['against']} {pass_drop['mean_difference']:+.1%} "
                 f"[{pass_drop['low']:+.1%}, {pass_drop['high']:+.1%}] over {pass_drop['conversations']} conversations")
        out.append({"constraint": "max_pass_drop", "verdict": "fail" if pass_drop["fails"] else "undecided",
                    "violation": max(0.0, -pass_drop["low"] - pass_drop["margin"]),
                    "message": shown + (f" < -{pass_drop['margin']:.0%}" if pass_drop["fails"] else
                                        f": its 95 % interval straddles the margin -{pass_drop['margin']:.0%}")})
    out += degeneration(v, d, original)
    if target is not None:
        from pipeline.decide.target import target_constraints

        out += target_constraints(v, target)
    if v.get("screened"):     # not measured past its scoring: never shipped, whatever limits a re-decision sets
        out.append({"constraint": "screen", "verdict": "fail", "violation": float("inf"),
                    "message": f"screened out at its scoring: {v['screened']['reason']}"})
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
