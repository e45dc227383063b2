"""Turn one variant's raw results into its summary.json entry: drift, free-running checks and flips, recall,
the deployment path, speed and memory figures (the summary contract, ``pipeline.config.summary_contract``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.figures import drift as metrics
from pipeline.config.summary_contract import SCHEMA_VERSION, section_values
from pipeline.infra.gguf_file import fallback_tensors
from pipeline.runtimes import runtime_class
from pipeline.figures.speed_trials import trial_figures
from pipeline.figures.stats import (checks_intervals, conversation_intervals, conversation_test,
                                    minimum_detectable)
from pipeline.infra.files import read_json, read_jsonl
from pipeline.figures.capacity import (kv_bytes_per_token_formula, kv_live_tokens, kv_reported_per_token,
                                       roofline)

__all__ = ["variant_summary", "pooled_exactness", "imatrix_effects"]


def pooled_exactness(exactness: dict | None) -> dict | None:
    """The per-suite samples of stored vs exact KLD pooled by tokens: {"ratio" (None when the exact KLD is 0),
    "exact_mean", "tokens"}; None without a sample."""
    ex = [e for e in (exactness or {}).values() if e and e.get("kld_exact_mean") is not None]
    tokens = sum(e["tokens"] for e in ex)
    if not tokens:
        return None
    exact = sum(e["kld_exact_mean"] * e["tokens"] for e in ex)
    stored = sum(e["kld_stored_mean"] * e["tokens"] for e in ex)
    return {"ratio": stored / exact if exact > 0 else None, "exact_mean": exact / tokens, "tokens": tokens}


def drift_figures(tf: dict) -> dict:
    """Token-level drift over every suite's reply tokens, plus position buckets, turns and suites."""
    kld, top1, dnll, pos, turn_keys, tail, nll_ref, nll_var = [], [], [], [], [], [], [], []
    per_suite, per_conv = {}, {}
    for suite, convs in tf.items():
        s_kld, s_tail = [], []
        for cid, c in convs.items():
            per_conv[f"{suite}/{cid}"] = [float(np.sum(c["kld"], dtype=np.float64)), len(c["kld"])]
            kld += c["kld"]
            s_kld += c["kld"]
            top1 += c["top1"]
            tail += c.get("tail_mass", [])
            s_tail += c.get("tail_mass", [])
            nll_ref += c["nll_reference"]
            nll_var += c["nll_variant"]
            dnll += list(np.asarray(c["nll_variant"]) - np.asarray(c["nll_reference"]))
            pos += c["out_pos"]
            turn_keys += [f"{suite}:{t + 1}" for t in c["turn"]]
        per_suite[suite] = {**metrics.distribution(s_kld),
                            "tail_mass_mean": float(np.mean(s_tail)) if s_tail else None}
    dist = metrics.distribution(kld)
    kld_pct = metrics.percentiles(kld, metrics.KLD_PERCENTILES)
    dp = metrics.delta_p(nll_ref, nll_var)
    by_turn: dict[str, list[float]] = {}
    for key, v in zip(turn_keys, kld):
        by_turn.setdefault(key, []).append(v)
    return {
        "kld_mean": dist["mean"], "kld_median": dist["median"], "kld_p90": dist["p90"], "kld_p99": dist["p99"],
        "kld_max": dist["max"], "scored_tokens": dist["n"],
        "kld_p99_9": kld_pct["99.9"] if kld_pct else None,
        "delta_p_mean": dp["mean"] if dp else None, "delta_p_rms": dp["rms"] if dp else None,
        "kld_percentiles": kld_pct, "delta_p": dp,
        "tail_mass_mean": float(np.mean(tail)) if tail else None,
        "top1_agreement": float(np.mean(top1)) if top1 else None,
        "delta_nll": float(np.mean(dnll)) if dnll else None,
        "kld_by_position": metrics.position_buckets(pos, kld, 128),
        "kld_by_turn": {k: {"mean": float(np.mean(v)), "n": len(v)} for k, v in by_turn.items()},
        "kld_by_suite": per_suite,
        "kld_by_conversation": per_conv,     # [sum of per-token KLD, tokens]: paired comparisons between variants
    }


def degenerate(sample: dict, limits: dict) -> bool:
    """A reply that loops: its repeated 4-gram rate or its longest periodic tail crosses the configured limit."""
    return (sample["repeated_4gram_rate"] > limits.get("max_repeated_4gram_rate", 1.0)
            or sample["longest_loop_tokens"] >= limits.get("max_loop_tokens", 10**9))


def paired_checks(before: list[bool], after: list[bool]) -> dict:
    """Two paired runs of the same checks: each side's pass rate, the flips between them and their exact McNemar
    p-value (one computation for the variant against the original, per suite, and for the deployment path)."""
    f = metrics.flips(before, after)
    n = len(after)
    return {"checks": n, "pass_rate": sum(after) / n if n else None,
            "reference_pass_rate": sum(before) / n if n else None,
            "pass_to_fail": f["pass_to_fail"], "fail_to_pass": f["fail_to_pass"],
            "flip_rate": (f["pass_to_fail"] + f["fail_to_pass"]) / n if n else None,
            "mcnemar_p": metrics.mcnemar_exact_p(f["pass_to_fail"], f["fail_to_pass"])}


def flips_by_suite(samples: list[dict], seed: int = 0) -> dict:
    """Per suite: the check-level paired figures (exact McNemar) and the conversation-level sign-flip test."""
    out: dict = {}
    for s in samples:
        g = out.setdefault(s["suite"], ([], [], []))
        g[0].extend(s["checks_reference"])
        g[1].extend(s["checks_variant"])
        g[2].append(s)
    keys = ("checks", "pass_rate", "reference_pass_rate", "pass_to_fail", "fail_to_pass", "mcnemar_p")
    return {suite: {**{k: v for k, v in paired_checks(ref, var).items() if k in keys},
                    "conversation_test": conversation_test(rows, seed)} for suite, (ref, var, rows) in out.items()}


def free_running_figures(samples: list[dict], degeneration: dict | None = None, seed: int = 0) -> dict:
    ref_checks, var_checks = [], []
    chrf, rep, ratio, diverge = [], [], [], []
    for s in samples:
        ref_checks += s["checks_reference"]
        var_checks += s["checks_variant"]
        chrf.append(s["chrf"])
        rep.append(s["repeated_4gram_rate"])
        if s["length_ratio"] is not None:
            ratio.append(s["length_ratio"])
        diverge.append(s["first_divergence"])
    paired = paired_checks(ref_checks, var_checks)
    identical = sum(1 for d in diverge if d is None)
    return {
        **paired,
        "flips": paired["pass_to_fail"] + paired["fail_to_pass"],
        "chrf_mean": float(np.mean(chrf)) if chrf else None,
        "identical_replies": identical,
        "replies": len(diverge),
        "first_divergence_median": (float(np.median([d for d in diverge if d is not None]))
                                    if len(diverge) > identical else None),
        "repeated_4gram_rate_mean": float(np.mean(rep)) if rep else None,
        "length_ratio_mean": float(np.mean(ratio)) if ratio else None,
        "conversation_test": conversation_test(samples, seed),
        "by_suite": flips_by_suite(samples, seed),
        "degenerate_replies": sum(1 for s in samples if degenerate(s, degeneration or {})),
        "degeneration_limits": degeneration or {},
        "same_runtime": same_runtime_figures(samples, seed),
    }


def same_runtime_figures(samples: list[dict], seed: int = 0) -> dict | None:
    """Where the variant's replies were generated on another runtime than the reference's: its checks against the
    original's own replies on that runtime (flips, exact McNemar, the conversation-level test: the variant's own
    change), and that baseline against the reference (the runtime switch's floor: what changing runtime alone
    flips). None where the samples carry no baseline."""
    if not samples or "checks_baseline" not in samples[0]:
        return None
    base, var, ref = ([c for s in samples for c in s[k]] for k in ("checks_baseline", "checks_variant",
                                                                 "checks_reference"))
    own = paired_checks(base, var)
    floor = paired_checks(ref, base)
    return {"runtime": samples[0].get("baseline_runtime"),
            "vs_original_same_runtime": {**own, "flips": own["pass_to_fail"] + own["fail_to_pass"],
                                         "conversation_test": conversation_test(samples, seed, "checks_baseline",
                                                                                "checks_variant")},
            "runtime_switch_floor": {**floor, "flips": floor["pass_to_fail"] + floor["fail_to_pass"],
                                     "conversation_test": conversation_test(samples, seed, "checks_reference",
                                                                            "checks_baseline")}}


def recall_figures(tf: dict, samples: list[dict]) -> dict | None:
    """Long-context recall by planted depth and by document length: check pass rate (recall), flips against the
    original, and mean teacher-forced KLD on the answer tokens. None when no sample carries a depth."""
    rows = [s for s in samples if (s.get("meta") or {}).get("depth") is not None]
    if not rows:
        return None
    kld_by_conv = {(suite, cid): c["kld"] for suite, convs in tf.items() for cid, c in convs.items()}

    def group(key: str) -> dict:
        out: dict = {}
        for r in rows:
            g = out.setdefault(str(r["meta"][key]), {"ref": [], "var": [], "kld": []})
            g["ref"] += r["checks_reference"]
            g["var"] += r["checks_variant"]
            g["kld"] += kld_by_conv.get((r["suite"], r["conversation"]), [])
        table = {}
        for k in sorted(out, key=float):
            g = out[k]
            f = metrics.flips(g["ref"], g["var"])
            n = len(g["var"])
            table[k] = {"recall": sum(g["var"]) / n if n else None,
                        "reference_recall": sum(g["ref"]) / n if n else None, "checks": n,
                        "flips": f["pass_to_fail"] + f["fail_to_pass"], "pass_to_fail": f["pass_to_fail"],
                        "kld_mean": float(np.mean(g["kld"])) if g["kld"] else None, "answer_tokens": len(g["kld"])}
        return table

    ref_all = [c for r in rows for c in r["checks_reference"]]
    var_all = [c for r in rows for c in r["checks_variant"]]
    return {"recall": sum(var_all) / len(var_all) if var_all else None,
            "reference_recall": sum(ref_all) / len(ref_all) if ref_all else None,
            "documents": len(rows), "by_depth": group("depth"), "by_length": group("length_tokens")}


def deployment_figures(deployment: dict | None, samples: list[dict], served: list[dict]) -> dict | None:
    """The deployment path (the runtime tokenizing rendered chat text, as a server does) against the same variant's
    measurement path (HF ids): check pass rates of both, flips between them with an exact McNemar p-value, and
    chrF of the served reply to the HF-id reply, turn by turn. ``served``: the checks stage's rows of the
    deployment path's replies (suite, conversation, turn, check outcomes, text)."""
    if not deployment:
        return None
    by_turn = {(s["suite"], s["conversation"], s["turn"]): s for s in samples}
    ids_checks, served_checks, chrf, identical, replies = [], [], [], 0, 0
    for row in served:
        s = by_turn.get((row["suite"], row["conversation"], row["turn"]))
        if s is None:
            continue
        replies += 1
        ids_checks += s["checks_variant"]
        served_checks += row["checks"]
        identical += row["text"] == s["variant_text"]
        chrf.append(metrics.chrf(row["text"], s["variant_text"]) if row["text"] or s["variant_text"] else 100.0)
    paired = paired_checks(ids_checks, served_checks)
    return {"suites": deployment["suites"], "replies": replies, "identical_replies": identical,
            "checks": paired["checks"], "pass_rate_ids": paired["reference_pass_rate"],
            "pass_rate_served": paired["pass_rate"],
            **{k: paired[k] for k in ("pass_to_fail", "fail_to_pass", "flip_rate", "mcnemar_p")},
            "chrf_mean": float(np.mean(chrf)) if chrf else None, "wall_s": deployment.get("wall_s")}


def variant_summary(result: dict, bandwidth: dict | None = None, degeneration: dict | None = None,
                    seed: int = 0, trials: list[dict] | None = None, kv_context: int | None = None) -> dict:
    """The summary.json entry for one variant, from its result file, its evaluation directory and its speed
    trials (``pipeline.stages.speed``: one per round; None when the speed stage has not run). A result written
    under another summary schema is reported as skipped (rerunning the comparison recomputes it: the evaluation
    stage's key holds the schema version), never read with the wrong layout. ``kv_context``: the context the KV
    bytes per token are stated at (the capacity plan's; sliding-window layers cost less per token beyond their
    window)."""
    if result["status"] == "ok" and result.get("schema_version", 1) != SCHEMA_VERSION:
        return {"status": "skipped", "runtime": result.get("runtime"), "description": result.get("description"),
                "reason": f"evaluated under summary schema {result.get('schema_version', 1)}, this is schema "
                          f"{SCHEMA_VERSION}: rerun the comparison (make compare) to recompute it"}
    if result["status"] != "ok":
        return {"status": result["status"], "reason": result.get("reason"), "runtime": result.get("runtime"),
                "description": result.get("description")}
    # a screened variant (``screened``: its mean KLD failed the limit) has its scoring alone: no samples, no trials
    ev_dir = Path(result["evaluation"]["dir"]) if result["evaluation"].get("dir") else None
    # teacher-forced scores: their own stage (older results kept them beside the samples)
    tf = read_json(Path(result["evaluation"].get("scores_dir") or ev_dir) / "teacher_forced.json")
    samples = read_jsonl(ev_dir / "samples.jsonl") if ev_dir else []
    timing = trial_figures(trials)
    speed = {**timing["medians"], **{k: timing[k] for k in ("prompt_tokens", "decode_tokens", "repeats", "load_s",
                                                           "trials", "noisy_trials", "cpu_noise")}}
    drift = drift_figures(tf)
    exactness = result["evaluation"].get("kld_exactness") or {}
    drift["kld_stored_exact_ratio"] = (pooled_exactness(exactness) or {}).get("ratio")
    free = free_running_figures(samples, degeneration, seed)
    recall = recall_figures(tf, samples)
    intervals = conversation_intervals(tf, samples, seed)
    facts = result["model"]["facts"]
    info = result["evaluation"].get("runtime_info") or timing["runtime_info"] or {}
    info_a = result["artifact"]["info"]
    runtime = runtime_class(result["runtime"])
    element = runtime.cache_element_bytes(info, facts["head_dim"])
    windows = runtime.keeps_window_only(info)
    formula = kv_bytes_per_token_formula(facts, element, kv_context, runtime.latent_kv_cache, windows)
    kv = timing["kv_reported"]
    reported = kv_reported_per_token(kv)
    # the formula is checked at the context the report counts: llama.cpp's allocation for its own context (n_ctx
    # cells), transformers' live cache at the tokens it holds (its sliding-window layers keep at most their window)
    report_context = int(kv_live_tokens(kv) or info.get("n_ctx") or kv_context)
    at_runtime = kv_bytes_per_token_formula(facts, element, report_context, runtime.latent_kv_cache, windows)
    gap = abs(reported - at_runtime) / at_runtime if reported else None
    memory = {
        "artifact_bytes": result["artifact"]["bytes"],
        "peak_rss_mb": speed.get("peak_rss_mb"),
        "load_peak_rss_mb": speed.get("load_peak_rss_mb"),
        "steady_rss_mb": speed.get("steady_rss_mb"),
        "kv_bytes_per_token": formula,
        "kv_bytes_per_token_reported": reported,
    }
    sources = {"drift": drift, "free": free, "speed": speed, "memory": memory}
    out = {
        "status": "ok",
        "reason": None,
        "description": result.get("description"),
        "runtime": result["runtime"],
        "kernel": info.get("kernel"),
        # where the format's own kernel did not run (weights made dense at load), its speed and memory are another
        # model's: reported with this reason, never ranked, never planned with
        "no_native_kernel": (None if info.get("native_kernel", True) else
                             f"no native kernel on this device: {info.get('kernel')}"),
        "runtime_info": info,
        "drift": section_values("drift", sources),
        "intervals": {**intervals, **timing["intervals"]},
        # the checks' intervals against the original on the variant's own runtime, where its replies came from
        # another runtime than the reference's (what the decision judges flips and pass rates on)
        "intervals_same_runtime": (checks_intervals(samples, seed, "checks_baseline", "checks_variant")
                                   if samples and "checks_baseline" in samples[0] else None),
        "speed_trials": {"rounds": len(trials or []), "values": timing["values"],
                         "failed": timing["failed_trials"]},
        "drift_detail": {**{k: drift[k] for k in ("kld_by_position", "kld_by_turn", "kld_by_suite",
                                                   "kld_percentiles", "delta_p", "kld_by_conversation")},
                         "kld_exactness": exactness or None},
        "free_running": {**free, "source": result["evaluation"].get("free_running_source")},
        "recall": recall,
        "power": minimum_detectable(samples, tf),
        "deployment": deployment_figures(result.get("deployment"), samples,
                                         read_jsonl(ev_dir / "served.jsonl") if ev_dir and
                                         (ev_dir / "served.jsonl").is_file() else []),
        "speed": {**section_values("speed", sources),
                  **{k: speed.get(k) for k in ("prompt_tokens", "decode_tokens", "repeats", "cpu_noise", "trials",
                                               "noisy_trials", "load_s")}},
        # where the variant ran on a GPU: its device memory, read where the work ran (host RSS stays in memory)
        "device_memory": ({"peak_mb": speed.get("device_peak_mb"), "device": dm.get("device"),
                           "device_total_mb": dm.get("device_total_mb"), "source": dm.get("source")}
                          if (dm := timing.get("device_memory")) else None),
        "memory": {
            **section_values("memory", sources),
            "kv_reported_source": (kv or {}).get("source") if not (kv or {}).get("allocated_bytes")
            else "llama.cpp log: KV buffer size / cells",
            "kv_cache": runtime.kv_cache_label(info),
            "kv_formula_gap": gap,
            # the formula at the context the runtime's report counts (what the gap compares)
            "kv_formula_at_report": at_runtime,
            "kv_report_context": report_context if reported else None,
            "kv_gap_flagged": bool(gap is not None and gap > 0.10),
        },
        "artifact": {"path": result["artifact"]["path"], "format": info_a.get("format"),
                     "bits_per_weight": result["artifact"].get("bits_per_weight"),
                     "producer": info_a.get("producer"),
                     "gguf_type": info_a.get("gguf_type"), "tensor_types": info_a.get("tensor_types"),
                     "type_elements": info_a.get("type_elements"),
                     "fallback_tensors": fallback_tensors(info_a.get("gguf_type") or "", info_a.get("tensor_types")),
                     "imatrix": info_a.get("imatrix"),
                     "group_size": info_a.get("group_size"), "quantize_settings": info_a.get("quantize_settings"),
                     "quantize_wall_s": info_a.get("quantize_wall_s", info_a.get("wall_s")),
                     "quantize_peak_rss_mb": info_a.get("quantize_peak_rss_mb")},
        "paths": {
            "teacher_forced": f"{result['runtime']} ({info.get('kernel')})",
            "speed_memory": f"{result['runtime']} ({info.get('kernel')}), {timing['trials']} interleaved trials "
                            "in a probe process of its own",
            "free_running": result["evaluation"].get("free_running_source"),
            "dequantized_check": result["evaluation"].get("dequantized_check"),
        },
    }
    out["roofline"] = roofline(out, bandwidth) if not out["no_native_kernel"] else None
    if result.get("screened"):
        out["screened"] = result["screened"]
    return out


def imatrix_effects(variants: dict, seed: int = 0) -> list[dict]:
    """Per GGUF type evaluated both plain and with an importance matrix (weights only, no KV-cache variant): the
    change in mean KLD, importance matrix minus plain, paired over the same reference conversations (the same
    token positions), with its 95 % bootstrap interval (conversations resampled) and a sign-flip test on the
    per-conversation differences; significant when the interval excludes 0."""
    from pipeline.figures.stats import ALPHA, bootstrap_ratio, sign_flip_p

    by_type: dict[str, dict[str, tuple[str, dict]]] = {}
    for name, v in variants.items():
        art = v.get("artifact") or {}
        if v.get("status") != "ok" or not art.get("gguf_type") or "+" in name:   # "+": a KV-cache variant
            continue
        by_type.setdefault(art["gguf_type"], {})["imatrix" if art.get("imatrix") else "plain"] = (name, v)
    out = []
    for gtype, pair in sorted(by_type.items()):
        if len(pair) < 2:
            continue
        (pn, pv), (imn, iv) = pair["plain"], pair["imatrix"]
        pc = (pv.get("drift_detail") or {}).get("kld_by_conversation") or {}
        ic = (iv.get("drift_detail") or {}).get("kld_by_conversation") or {}
        common = [c for c in pc if c in ic and pc[c][1] == ic[c][1] and pc[c][1] > 0]
        if not common:
            continue
        num = np.array([ic[c][0] - pc[c][0] for c in common])
        den = np.array([pc[c][1] for c in common], dtype=np.float64)
        ci = bootstrap_ratio(num, den, seed)
        p = sign_flip_p(num / den, seed)
        base = float(sum(pc[c][0] for c in common) / den.sum())
        out.append({"type": gtype, "plain": pn, "imatrix": imn, "conversations": len(common),
                    "kld_plain": base, "kld_imatrix": base + ci["estimate"],
                    "delta": ci["estimate"], "low": ci["low"], "high": ci["high"],
                    "relative": ci["estimate"] / base if base > 0 else None, "p_value": p,
                    "significant": bool(ci["low"] > 0 or ci["high"] < 0), "alpha": ALPHA,
                    "bits_plain": (pv.get("artifact") or {}).get("bits_per_weight"),
                    "bits_imatrix": (iv.get("artifact") or {}).get("bits_per_weight")})
    return out
