"""The budget after the screen: a run cut to its budget gets back the speed rounds, load-sweep rounds and extra
rounds the cut took, as far as the variants the screen left allow.

The fit (``pipeline.plan.budget``) plans every variant's whole work, as it must before any variant is scored; a
variant the screen takes out (``decision.screen``) skips its free-running, speed and load, so the fit's time for
those stages is more than the rest of the run needs. Once every variant is scored, the cuts that only the speed and
load stages feel are undone, in the reverse of the order they were taken, as far as the plan's time for the speed and
load stages of the variants left stays within what the fit gave those stages for every variant plus what it left of
the budget. Conversations and reply caps stay cut: the scoring that they set has run.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from pipeline.config.schema import Config
from pipeline.plan.budget import allocation_of, extra_seconds, read_budget, write_budget

log = logging.getLogger(__name__)


def rest_seconds(cfg: Config) -> Callable[[Config, list[str]], float]:
    """A function giving the planned seconds of the speed and load stages still to run for some variants under an
    allocation (the extra rounds at their cap); this machine's bandwidth and compute are read once for all."""
    from pipeline.compose import variant_of
    from pipeline.plan import measured_runs
    from pipeline.plan.estimate import build_plan
    from pipeline.runtimes.model_inventory import model_inventory

    inv = model_inventory(cfg)
    here = measured_runs.bandwidth_here(cfg.runtime.n_threads), measured_runs.compute_here(cfg.runtime.n_threads)

    def planned(c: Config, names: list[str]) -> float:
        variants = [variant_of(c, n) for n in names]
        plan = build_plan(c, variants=variants, inventory=inv, bandwidth_here=here[0], compute_here=here[1])
        rows = [r for r in plan["rows"] if r.stage in ("speed", "load") and not r.exists]
        if any(r.time_s is None for r in rows):
            return float("inf")         # a stage without a time: nothing is given back on a guess
        return sum(r.time_s for r in rows) + extra_seconds(c, variants)
    return planned


def after_screen(cfg: Config, left: list[str],
                 planned: Callable[[Config, list[str]], float] | None = None) -> Config:
    """Once every variant is scored, with ``left`` the variants the screen kept for speed and load: the speed rounds,
    load-sweep rounds and extra rounds that the budget's cut took, given back (in the reverse of the order they were
    cut) as far as the plan's time for the speed and load stages of the variants left stays within what the fit
    gave those stages for every variant, plus what the fit left of the budget. The fit plans every variant's whole
    work, as it must before the screen; a variant screened out skips its free-running, speed and load. ``cfg``
    itself where the run was not cut, nothing was screened out or nothing can be given back; the record says what was."""
    record = read_budget(cfg)
    if not record or not record.get("allocation") or "after_screen" in record:
        return cfg
    out = [n for n in cfg.run.variants if n not in left]
    if not out or not left:
        return cfg
    a = allocation_of(record)
    p = record["profile_allocation"]
    given = [("the profile's speed rounds", lambda x: dataclasses.replace(x, trials=p["profile.speed.trials"]))]
    if a.load_applies:
        given.append(("the profile's load-sweep rounds",
                      lambda x: dataclasses.replace(x, load_repeats=p["load.repeats"])))
    if a.extra_applies:
        given += [("extra llama.cpp speed rounds at most 5 min", lambda x: dataclasses.replace(
                      x, extra_max_rounds=p["profile.speed.extra_max_rounds"],
                      extra_max_minutes=min(5.0, p["profile.speed.extra_max_minutes"]))),
                  ("the profile's extra llama.cpp speed rounds", lambda x: dataclasses.replace(
                      x, extra_max_rounds=p["profile.speed.extra_max_rounds"],
                      extra_max_minutes=p["profile.speed.extra_max_minutes"]))]
    chain, taken = [a], []
    for what, step in given:
        nxt = step(chain[-1])
        if nxt != chain[-1]:
            chain.append(nxt)
            taken.append(what)
    if len(chain) == 1:
        return cfg
    planned = planned or rest_seconds(cfg)
    allowed = planned(a.apply(cfg), list(cfg.run.variants)) + max(0.0, record["budget_s"] - record["planned_s"])
    if allowed == float("inf"):
        return cfg
    for i in range(len(chain) - 1, 0, -1):
        t = planned(chain[i].apply(cfg), left)
        if t <= allowed:
            record = {**record, "allocation": chain[i].settings(),
                      "after_screen": {"screened_out": out, "given_back": taken[:i], "planned_rest_s": t,
                                       "allowed_rest_s": allowed, "described": chain[i].describe()}}
            write_budget(cfg, record)
            log.info("run.budget: %d variant(s) screened out; given back: %s (speed and load planned at %.1f of "
                     "%.1f min)", len(out), "; ".join(taken[:i]), t / 60, allowed / 60)
            return chain[i].apply(cfg)
    return cfg

