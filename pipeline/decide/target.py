"""The deployment target the decision judges every variant at: the workload's context and concurrency, its latency
targets, and the memory budget it is served in.

A format is judged as it will be served, not at the speed probe's short context: the memory a variant needs is its
weights + its runtime's own memory (the probe's peak less the weights and the KV cache the probe held) + the KV
cache of ``workload.concurrency`` sequences of ``workload.context_tokens``; it fits when that stays within the
budget less ``capacity.headroom``. The budget is ``decision.memory_budget_gb`` or, unset, this machine's: the
device's memory for a variant that ran on a GPU, else the host's. Time to first token at the workload's context is
estimated from the probe's median prefill rate (context ÷ prompt tokens per second; attention's growth with
context makes it a lower bound), inter-token latency is the probe's own p99: both labelled as such wherever they
are printed.
"""

from __future__ import annotations

from pipeline.figures.capacity import runtime_overhead_bytes, sequences_that_fit


def make_target(workload, decision, headroom: float, hardware: dict | None, facts: dict | None = None,
                kv_context: int | None = None) -> dict:
    """The target as the summary records it (``recommendation.target``). ``facts``: the model's geometry and KV
    layout (``summary["model"]``); ``kv_context``: the context the variants' ``kv_bytes_per_token`` were computed
    at (``capacity.context_tokens``): with both, a sliding-window layer's cache is counted at the workload's
    context as the runtime keeps it (at most its window)."""
    host_gib = (hardware or {}).get("memory_gib")
    geometry = {k: (facts or {}).get(k) for k in ("layers", "kv_heads", "head_dim", "attention_heads", "kv_layout")}
    budget_gb = decision.memory_budget_gb
    return {"workload": workload.name, "context_tokens": int(workload.context_tokens),
            "concurrency": int(getattr(workload, "concurrency", 1) or 1),
            "max_ttft_p99_s": workload.max_ttft_p99_s, "max_itl_p99_s": workload.max_itl_p99_s,
            "latency_targets": decision.latency_targets, "headroom": float(headroom),
            "budget_bytes": float(budget_gb) * 1e9 if budget_gb is not None else None,
            "budget_source": (f"decision.memory_budget_gb={budget_gb:g}" if budget_gb is not None
                              else "this machine's memory"),
            "host_bytes": float(host_gib) * 2**30 if host_gib else None,
            "geometry": geometry if geometry.get("layers") and geometry.get("kv_layout") else None,
            "kv_context": kv_context}


def kv_bytes_per_token_at(v: dict, t: dict) -> float | None:
    """The variant's KV bytes per token at the workload's context: its recorded figure, rescaled by the model's
    layout where some layers keep only a window (the ratio of the architecture's per-token bytes at the two
    contexts; the element size and any latent compression cancel)."""
    from pipeline.figures.capacity import kv_bytes_per_token_formula

    kv = (v.get("memory") or {}).get("kv_bytes_per_token")
    g = t.get("geometry")
    if kv is None or not g or not t.get("kv_context") or (v.get("runtime_info") or {}).get("swa_full"):
        return kv                   # no window, or a runtime that allocates every layer's cache in full
    unit = {**g, "kv_heads": 1, "head_dim": 1}          # the per-layer size cancels: layers kept, at each context
    at = kv_bytes_per_token_formula(unit, 1.0, t["context_tokens"])
    recorded = kv_bytes_per_token_formula(unit, 1.0, t["kv_context"])
    return kv * at / recorded if recorded else kv


def budget_bytes(v: dict, t: dict) -> tuple[float | None, str]:
    """(the budget before headroom, what it is) for this variant: the configured one, else the device's memory
    where it ran on a GPU, else the host's."""
    if t.get("budget_bytes") is not None:
        return t["budget_bytes"], t["budget_source"]
    device_total = (v.get("device_memory") or {}).get("device_total_mb")
    if device_total:
        return device_total * 2**20, f"the device's {device_total / 1024:.1f} GiB"
    if t.get("host_bytes"):
        return t["host_bytes"], f"this host's {t['host_bytes'] / 2**30:.1f} GiB"
    return None, "no budget (the machine's memory was not recorded)"


def _weights_runtime_kv(v: dict, t: dict) -> tuple[float, float, float] | None:
    """(weights, runtime overhead, KV bytes per token at the workload's context), None where one is missing."""
    weights = (v.get("memory") or {}).get("artifact_bytes")
    overhead = runtime_overhead_bytes(v)
    kv = kv_bytes_per_token_at(v, t)
    if weights is None or overhead is None or kv is None:
        return None
    return float(weights), overhead, kv


def served_bytes(v: dict, t: dict) -> float | None:
    """Weights + runtime + KV cache of the workload's sequences, in bytes (None where a figure is missing)."""
    parts = _weights_runtime_kv(v, t)
    if parts is None:
        return None
    weights, overhead, kv = parts
    return weights + overhead + kv * t["context_tokens"] * t["concurrency"]


def sequences_in_budget(v: dict, t: dict) -> int | None:
    """How many sequences of the workload's context fit the budget less headroom beside the weights and runtime
    (``capacity.sequences_that_fit``)."""
    parts = _weights_runtime_kv(v, t)
    budget, _ = budget_bytes(v, t)
    if budget is None or parts is None or not parts[2]:
        return None
    weights, overhead, kv = parts
    return sequences_that_fit(budget, t["headroom"], weights, kv, t["context_tokens"], overhead)


def ttft_estimate_s(v: dict, t: dict) -> float | None:
    rate = (v.get("speed") or {}).get("prefill_tokens_per_s")
    return t["context_tokens"] / rate if rate else None


def at_target(v: dict, t: dict) -> dict:
    """The variant's figures at the target: {"served_mb", "budget_mb", "budget_source", "fits", "sequences",
    "ttft_s", "itl_p99_s", "meets_ttft", "meets_itl", "meets_latency"} (None where not measured)."""
    served = served_bytes(v, t)
    budget, source = budget_bytes(v, t)
    usable = budget * (1 - t["headroom"]) if budget is not None else None
    ttft = ttft_estimate_s(v, t)
    itl = (v.get("speed") or {}).get("itl_p99_s")
    meets_ttft = None if t.get("max_ttft_p99_s") is None or ttft is None else ttft <= t["max_ttft_p99_s"]
    meets_itl = None if t.get("max_itl_p99_s") is None or itl is None else itl <= t["max_itl_p99_s"]
    configured = [m for m, limit in ((meets_ttft, t.get("max_ttft_p99_s")), (meets_itl, t.get("max_itl_p99_s")))
                  if limit is not None]
    return {"served_mb": served / 2**20 if served is not None else None,
            "budget_mb": usable / 2**20 if usable is not None else None, "budget_source": source,
            "fits": None if served is None or usable is None else served <= usable,
            "sequences": sequences_in_budget(v, t), "ttft_s": ttft, "itl_p99_s": itl,
            "meets_ttft": meets_ttft, "meets_itl": meets_itl,
            # met only where every configured target was judged (an unmeasured figure meets nothing)
            "meets_latency": None if not configured or None in configured else all(configured)}


def where(t: dict) -> str:
    """The target in words: "workload chat: 2,048 tokens × 1 sequence"."""
    n = t["concurrency"]
    return f"workload {t['workload']}: {t['context_tokens']:,} tokens × {n} sequence{'s' if n != 1 else ''}"


def target_constraints(v: dict, t: dict) -> list[dict]:
    """The constraints of the target the variant fails: it does not fit the budget as served; under
    ``latency_targets=enforce`` it misses a latency target. Same shape as ``constraints.judge_constraints``."""
    if v.get("no_native_kernel"):
        return [{"constraint": "memory_budget", "verdict": "not measurable", "violation": 0.0,
                 "message": f"memory and latency as served not judged: {v['no_native_kernel']}"}]
    a = at_target(v, t)
    out = []
    if a["fits"] is None:
        out.append({"constraint": "memory_budget", "verdict": "undecided", "violation": 0.0,
                    "message": f"memory as served ({where(t)}) not measured, so not shown to fit "
                               f"({a['budget_source']})"})
    if a["fits"] is False:
        out.append({"constraint": "memory_budget", "verdict": "fail",
                    "violation": a["served_mb"] / a["budget_mb"] - 1 if a["budget_mb"] else float("inf"),
                    "message": f"needs {a['served_mb']:.0f} MB as served ({where(t)}: weights + runtime + KV cache) "
                               f"> {a['budget_mb']:.0f} MB ({a['budget_source']} less {t['headroom']:.0%} headroom)"})
    if t.get("latency_targets") == "enforce":
        for what, key, limit in (("time to first token", "meets_ttft", "max_ttft_p99_s"),
                                 ("inter-token latency p99", "meets_itl", "max_itl_p99_s")):
            if t.get(limit) is not None and a[key] is None:
                out.append({"constraint": limit, "verdict": "undecided", "violation": 0.0,
                            "message": f"{what} not measured, so not shown to meet workload {t['workload']}'s "
                                       "target"})
        if a["meets_ttft"] is False:
            out.append({"constraint": "max_ttft_p99_s", "verdict": "fail",
                        "violation": a["ttft_s"] / t["max_ttft_p99_s"] - 1,
                        "message": f"time to first token at {t['context_tokens']:,} tokens {a['ttft_s']:.2f} s "
                                   f"(estimated from the probe's prefill rate) > {t['max_ttft_p99_s']:g} s "
                                   f"(workload {t['workload']})"})
        if a["meets_itl"] is False:
            out.append({"constraint": "max_itl_p99_s", "verdict": "fail",
                        "violation": a["itl_p99_s"] / t["max_itl_p99_s"] - 1,
                        "message": f"inter-token latency p99 {a['itl_p99_s'] * 1000:.0f} ms (the probe's) > "
                                   f"{t['max_itl_p99_s'] * 1000:.0f} ms (workload {t['workload']})"})
    return out


def latency_statement(ok: dict[str, dict], names: list[str], t: dict) -> str | None:
    """Whether any of ``names`` meets the workload's latency targets, in words (None without targets)."""
    if t.get("max_ttft_p99_s") is None and t.get("max_itl_p99_s") is None:
        return None
    rows = {n: at_target(ok[n], t) for n in names}
    meets = [n for n, a in rows.items() if a["meets_latency"]]
    targets = " and ".join(x for x in (
        f"time to first token ≤ {t['max_ttft_p99_s']:g} s" if t.get("max_ttft_p99_s") is not None else "",
        f"inter-token p99 ≤ {t['max_itl_p99_s'] * 1000:.0f} ms" if t.get("max_itl_p99_s") is not None else "") if x)
    if meets:
        return (f"{len(meets)} of {len(names)} eligible variants meet workload {t['workload']}'s {targets} at "
                f"{t['context_tokens']:,} tokens ({', '.join(meets)})")
    timed = {n: a["ttft_s"] for n, a in rows.items() if a["ttft_s"] is not None}
    best = min(timed, key=timed.get) if timed else None
    return (f"no eligible variant meets workload {t['workload']}'s {targets} at {t['context_tokens']:,} tokens"
            + (f" (closest: {best}, time to first token {timed[best]:.2f} s estimated from its prefill rate, "
               f"inter-token p99 {rows[best]['itl_p99_s'] * 1000:.0f} ms)"
               if best and rows[best]["itl_p99_s"] is not None else ""))
