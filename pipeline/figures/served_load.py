"""The figures of a served-load sweep (pure functions, tested on synthetic sweeps): per concurrency level the
median over rounds with its interval, the knee, the workload's targets judged on intervals, the operating point and
throughput_at_slo. The sweep as text is ``pipeline.stages.load.format_load`` (it names each server)."""

from __future__ import annotations

import dataclasses
import logging

from pipeline.figures.stats import median_interval

log = logging.getLogger(__name__)

# the per-level figures of one trial (pipeline.instruments.loadgen's parse) that get a median and an interval over rounds
LEVEL_FIGURES = ("output_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
                 "e2e_p50_s", "e2e_p99_s", "peak_rss_mb", "device_peak_mb")
# workload target -> (the level figure it limits, how a limit compares); every target is an upper limit
TARGETS = {"max_ttft_p99_s": "ttft_p99_s", "max_itl_p99_s": "itl_p99_s", "max_e2e_p99_s": "e2e_p99_s"}


# ---------------------------------------------------------------------------------------------------------------
# the figures (pure functions, tested on synthetic sweeps)

def level_table(trials: list[list[dict] | None]) -> dict[int, dict]:
    """Per concurrency level, every figure's median over rounds with its interval and the rounds' values.
    ``trials``: one list of per-level results per round (None for a round that failed). A level a round did not
    measure (its climb ended past the knee) has None in that round's place, so the rounds' values of two levels
    stay paired by round."""
    by_level: dict[int, list[dict | None]] = {}
    for r, levels in enumerate(trials):
        for row in levels or []:
            by_level.setdefault(int(row["concurrency"]), [None] * len(trials))[r] = row
    out = {}
    for c in sorted(by_level):
        rows = [row for row in by_level[c] if row is not None]
        fig = {"concurrency": c, "rounds": len(rows), "completed": sum(r.get("completed", 0) for r in rows),
               "errored": sum(r.get("errored", 0) for r in rows)}
        for k in LEVEL_FIGURES:
            values = [row.get(k) if row is not None else None for row in by_level[c]]
            iv = median_interval([v for v in values if v is not None])
            fig[k] = iv["estimate"] if iv else None
            fig[f"{k}_interval"] = iv
            fig[f"{k}_rounds"] = values
        out[c] = fig
    return out


def knee(table: dict[int, dict], gain: float) -> dict:
    """The knee of aggregate throughput against concurrency: the first level c after which the next level (about
    double) adds less than ``gain`` (a fraction) output tokens/s. The gain of each step is the median over rounds
    of the paired ratio (round r's next level over round r's level: measured back to back, so a slow round does
    not fake a knee). ``reached`` is False when throughput still rose by ``gain`` at the highest level measured:
    the knee lies beyond it."""
    levels = sorted(c for c, f in table.items() if f.get("output_tokens_per_s"))
    steps = []
    for a, b in zip(levels, levels[1:]):
        ra, rb = table[a]["output_tokens_per_s_rounds"], table[b]["output_tokens_per_s_rounds"]
        ratios = [y / x for x, y in zip(ra, rb) if x and y]
        iv = median_interval(ratios)
        steps.append({"from": a, "to": b, "gain": (iv["estimate"] - 1) if iv else None,
                      "gain_low": (iv["low"] - 1) if iv else None, "gain_high": (iv["high"] - 1) if iv else None})
    for s in steps:
        if s["gain"] is not None and s["gain"] < gain:
            return {"concurrency": s["from"], "reached": True, "steps": steps, "knee_gain": gain}
    return {"concurrency": levels[-1] if levels else None, "reached": False, "steps": steps, "knee_gain": gain}


KNEE_RULE_LEVELS = 3      # past_the_knee judges two doublings: it needs this many levels measured


def past_the_knee(rows: list[dict], gain: float) -> bool:
    """Whether one round's climb can end: its last two doublings each added less than ``gain`` aggregate output
    tokens/s (the knee lies behind, and the next level is the costliest), or its last level completed no request.
    One flat step is not enough: a single step of a noisy machine can look flat."""
    if rows and not rows[-1].get("completed"):
        return True
    if len(rows) < KNEE_RULE_LEVELS:
        return False
    a, b, c = (r.get("output_tokens_per_s") or 0.0 for r in rows[-KNEE_RULE_LEVELS:])
    return a > 0 and b > 0 and b < a * (1 + gain) and c < b * (1 + gain)


def judge_level(fig: dict, targets: dict) -> dict:
    """Whether one level meets the workload's latency targets: "meets" when every target's interval lies at or
    under its limit, "fails" when some interval lies wholly above, else "undecided" (a limit inside the noise
    decides nothing). No targets: "meets"."""
    verdict, why = "meets", []
    for key, limit in targets.items():
        if limit is None:
            continue
        figure = TARGETS[key]
        iv = fig.get(f"{figure}_interval")
        if not iv:
            verdict = "fails" if verdict != "fails" else verdict
            why.append(f"{figure} not measured (no request completed)")
            continue
        if iv["low"] > limit:
            verdict = "fails"
            why.append(f"{figure} {iv['estimate']:.3g} s > {limit:g} s")
        elif iv["high"] > limit and verdict == "meets":
            verdict = "undecided"
            why.append(f"{figure} {iv['estimate']:.3g} s [{iv['low']:.3g}, {iv['high']:.3g}] straddles {limit:g} s")
    return {"verdict": verdict, "why": why}


def operating_point(table: dict[int, dict], targets: dict, memory_budget_mb: float | None, gain: float) -> dict:
    """The knee, the largest concurrency meeting every target (levels above a failing one are not trusted: latency
    only grows with load), and throughput_at_slo: the highest median aggregate output tokens/s among levels that
    meet the targets and whose peak memory fits ``memory_budget_mb``. The recommendation: the knee, or the
    largest level meeting the targets when that is lower."""
    verdicts = {}
    for c in sorted(table):
        v = judge_level(table[c], targets)
        peak = table[c].get("device_peak_mb") or table[c].get("peak_rss_mb")
        if memory_budget_mb is not None and peak is not None and peak > memory_budget_mb:
            v = {"verdict": "fails", "why": v["why"] + [f"peak memory {peak:.0f} MB > budget {memory_budget_mb:.0f} MB"]}
        verdicts[c] = v
    meeting = []
    for c in sorted(table):
        if verdicts[c]["verdict"] != "meets":
            break
        meeting.append(c)
    k = knee(table, gain)
    best = max(meeting, key=lambda c: table[c]["output_tokens_per_s"] or 0.0) if meeting else None
    top = meeting[-1] if meeting else None
    recommend = None
    if top is not None and k["concurrency"] is not None:
        recommend = min(top, k["concurrency"])
    return {"knee": k, "verdicts": {str(c): v for c, v in verdicts.items()},
            "max_concurrency_meeting_targets": top,
            "throughput_at_slo": table[best]["output_tokens_per_s"] if best is not None else None,
            "throughput_at_slo_interval": table[best]["output_tokens_per_s_interval"] if best is not None else None,
            "throughput_at_slo_concurrency": best,
            "recommended_concurrency": recommend}


def levels_within(levels: list[int], fits: int | None) -> tuple[list[int], int | None]:
    """The configured concurrency levels the capacity plan allows (at least the first one)."""
    if fits is None:
        return sorted(levels), None
    kept = [c for c in sorted(levels) if c <= fits] or sorted(levels)[:1]
    return kept, fits


def slo_depth(depths: list[int], context_tokens: int) -> int:
    """The measured depth the workload's targets are judged at: its own context, else the deepest shallower one."""
    return context_tokens if context_tokens in depths else max([d for d in depths if d <= context_tokens] or depths[:1])


def rejudge(result: dict, wl) -> dict:
    """The sweep's level tables judged against workload ``wl``: every depth's operating point, the depth its targets
    are judged at, throughput_at_slo, the knee and the recommendation. The measurements are untouched."""
    targets = {k: getattr(wl, k) for k in TARGETS}
    for v in result["variants"].values():
        if v.get("status") != "ok":
            continue
        for block in v["depths"].values():
            table = {int(c): f for c, f in block["levels"].items()}
            block["operating_point"] = operating_point(table, targets, result["memory_budget_mb"], result["knee_gain"])
        at = str(slo_depth([int(d) for d in v["depths"]], wl.context_tokens))
        op = v["depths"][at]["operating_point"]
        v.update({"slo_depth": int(at), "throughput_at_slo": op["throughput_at_slo"],
                  "throughput_at_slo_interval": op["throughput_at_slo_interval"],
                  "throughput_at_slo_concurrency": op["throughput_at_slo_concurrency"],
                  "knee_concurrency": op["knee"]["concurrency"], "knee_reached": op["knee"]["reached"],
                  "recommended_concurrency": op["recommended_concurrency"]})
    result["workload"] = dataclasses.asdict(wl)
    return result


def advice(v: dict, bold: str = "") -> str:
    """One variant's served-load verdict in words: its knee, its throughput at the workload's targets and the
    concurrency to run it at (``bold``: the Markdown emphasis around that number, "" for plain text)."""
    knee_txt = (f"knee at {v['knee_concurrency']}" if v["knee_reached"]
                else f"no knee up to {v['knee_concurrency']} (throughput still rising)")
    slo = (f"throughput at the targets {v['throughput_at_slo']:.1f} tok/s at {v['throughput_at_slo_concurrency']} "
           "concurrent" if v["throughput_at_slo"] is not None else "no level meets the targets")
    rec = (f"operate at up to {bold}{v['recommended_concurrency']}{bold} concurrent requests"
           if v["recommended_concurrency"] else "no operating point meets the targets")
    return f"{knee_txt}; {slo}; {rec} (context {v['slo_depth']})"


def numeric_order(table: dict) -> list[tuple[str, object]]:
    """A table keyed by numbers written as text (depths, concurrency levels), in numeric order: load.json is read
    back with its keys sorted as text, which puts 16 before 2."""
    return sorted(table.items(), key=lambda kv: float(kv[0]))
