"""A run budget (``run.budget``; ``make compare BUDGET=30m``): the profile's work cut, step by step, until the plan
of the whole comparison fits the budget, or the run refused before any work.

The time of an allocation is the plan's (``pipeline.plan.estimate.build_plan``): every stage still to run, timed
from the measured runs on this machine, plus the speed stage's extra llama.cpp rounds at their cap
(``profile.speed.extra_max_minutes``), which the plan leaves out. The steps (``STEPS``) are taken in order, each
cutting further, and the first allocation that fits is run: first what only the nightly gate reads (the extra speed
rounds, the load sweep's repeated rounds), then conversations and reply caps in turn, then the speed rounds down to
the fewest whose sign-flip test can still rank the variants after the family-wise correction, then three
conversations per suite. That last allocation is the least that carries a signal (three conversations give a
per-conversation interval; fewer rounds cannot rank); where it does not fit either, the run is refused naming its
planned time, so the user can raise the budget or compare fewer variants.

``auto`` (what ``make compare`` passes by default): ``AUTO_CPU_S`` on a CPU, which the demo's default comparison
fits uncut; no budget on a CUDA device. The allocation is kept in the run's folder (``budget.json``): a resumed run
with the same budget, variants and profile runs the same allocation, so its finished stages stay valid. ``quantdrift
plan`` keeps its own fit beside it (``budget.planned.json``), and a comparison with the same budget and inputs started
within ``PLAN_KEPT_S`` runs that allocation (or is refused as the plan was) instead of planning again.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Callable

from pipeline.config.schema import Config, budget_seconds
from pipeline.infra.errors import ConfigError

log = logging.getLogger(__name__)

AUTO_CPU_S = 180 * 60
MIN_CONVERSATIONS = 3
MIN_REPLY_CAP = 16
RECORD = "budget.json"
PLANNED = "budget.planned.json"
PLAN_KEPT_S = 3600         # how long `quantdrift plan`'s fit stands for the comparison with the same inputs


class NoTimeBasis(ConfigError):
    """The plan has no time for the run on this machine (no measured run to take one from)."""


@dataclasses.dataclass(frozen=True)
class Allocation:
    """The work a run is given: per conversation suite its conversations and reply cap, the interleaved speed
    rounds, the extra llama.cpp rounds' cap, the load sweep's rounds."""

    per_suite: dict            # suite -> {"max_conversations": n, "max_new_tokens_cap": cap}
    trials: int
    extra_max_rounds: int
    extra_max_minutes: float
    load_repeats: int
    extra_applies: bool = True     # some variant runs on a runtime of profile.speed.extra_runtimes
    load_applies: bool = True      # the comparison runs a load sweep (load is not off)

    def settings(self) -> dict:
        """The allocation as dotted config keys and their values."""
        return {"profile.per_suite": self.per_suite, "profile.speed.trials": self.trials,
                "profile.speed.extra_max_rounds": self.extra_max_rounds,
                "profile.speed.extra_max_minutes": self.extra_max_minutes, "load.repeats": self.load_repeats}

    def applies(self) -> dict:
        return {"extra_applies": self.extra_applies, "load_applies": self.load_applies}

    def overrides(self) -> list[str]:
        """Hydra overrides that give a composed config this allocation (each variant's job is composed anew)."""
        suites = ",".join(f"{s}:{{max_conversations:{v['max_conversations']},"
                          f"max_new_tokens_cap:{v['max_new_tokens_cap']}}}" for s, v in self.per_suite.items())
        out = [f"++profile.per_suite={{{suites}}}"]
        return out + [f"++{k}={v}" for k, v in self.settings().items() if k != "profile.per_suite"]

    def apply(self, cfg: Config) -> Config:
        """``cfg`` with this allocation (the same settings ``overrides`` gives a composed config)."""
        per_suite = {**(cfg.profile.per_suite or {}), **{s: dict(v) for s, v in self.per_suite.items()}}
        speed = dataclasses.replace(cfg.profile.speed, trials=self.trials, extra_max_rounds=self.extra_max_rounds,
                                    extra_max_minutes=self.extra_max_minutes)
        profile = dataclasses.replace(cfg.profile, per_suite=per_suite, speed=speed)
        return dataclasses.replace(cfg, profile=profile, load=dataclasses.replace(cfg.load, repeats=self.load_repeats))

    def describe(self) -> str:
        suites = "; ".join(f"{s}: {v['max_conversations']} conversations, replies capped at "
                           f"{v['max_new_tokens_cap']} tokens" for s, v in self.per_suite.items())
        out = f"{suites}; {self.trials} speed rounds"
        if self.extra_applies:
            out += (f", extra llama.cpp rounds at most {self.extra_max_minutes:g} min" if self.extra_max_rounds
                    else ", no extra speed rounds")
        return out + (f"; {self.load_repeats} load-sweep round(s)" if self.load_applies else "")


def whole_suites(cfg: Config) -> list[str]:
    """The selected suites a budget leaves whole: those generated per tokenizer (the long-context recall documents),
    whose work the plan takes from their generation settings, not from the profile's limits."""
    return [suite.name for suite in cfg.selected_suites() if suite.generate]


def profile_allocation(cfg: Config) -> Allocation:
    """The profile's own allocation, every conversation suite's limits made explicit (all conversations, a cap at
    the suite's largest turn budget where the profile sets none: the same work)."""
    import inspect

    from pipeline.compose import variant_of
    from pipeline.suites.records import load_suite, select

    default = inspect.signature(select).parameters["default_max_new_tokens"].default    # a turn without a budget
    per_suite = {}
    for suite in cfg.selected_suites():
        if suite.generate:
            continue
        convs = load_suite(suite.name, suite.path)
        n, cap = cfg.profile.limits(suite.name)
        largest = max((t.max_new_tokens or default for c in convs for t in c.turns), default=default)
        per_suite[suite.name] = {"max_conversations": min(n or len(convs), len(convs)),
                                 "max_new_tokens_cap": min(cap or largest, largest)}
    s = cfg.profile.speed
    runtimes = {variant_of(cfg, name).runtime for name in cfg.run.variants}
    return Allocation(per_suite=per_suite, trials=s.trials, extra_max_rounds=s.extra_max_rounds,
                      extra_max_minutes=float(s.extra_max_minutes), load_repeats=cfg.load.repeats,
                      extra_applies=bool(s.extra_max_rounds and runtimes & set(s.extra_runtimes)),
                      load_applies=cfg.load.name != "off")


def _conversations(n: int) -> Callable[[Allocation, Allocation], Allocation]:
    def step(a: Allocation, first: Allocation) -> Allocation:
        return dataclasses.replace(a, per_suite={s: {**v, "max_conversations": min(v["max_conversations"], n)}
                                                 for s, v in a.per_suite.items()})
    return step


def _caps(share: float) -> Callable[[Allocation, Allocation], Allocation]:
    def step(a: Allocation, first: Allocation) -> Allocation:
        return dataclasses.replace(a, per_suite={s: {**v, "max_new_tokens_cap": min(v["max_new_tokens_cap"], max(
            MIN_REPLY_CAP, math.ceil(first.per_suite[s]["max_new_tokens_cap"] * share)))}
            for s, v in a.per_suite.items()})
    return step


def steps(cfg: Config, first: Allocation) -> list[tuple[str, Callable[[Allocation, Allocation], Allocation]]]:
    """The cuts in the order they are taken, each (what it does, allocation and the profile's -> allocation);
    ``first``: the profile's own allocation."""
    from pipeline.figures.speed_trials import rounds_to_rank

    comparisons = max(1, len(cfg.run.variants) - 1)
    fewest = rounds_to_rank(comparisons, cfg.decision.alpha, cfg.decision.multiple_comparisons)
    gate_only = [
        ("extra llama.cpp speed rounds at most 5 min",
         lambda a, f: dataclasses.replace(a, extra_max_minutes=min(a.extra_max_minutes, 5.0))),
        ("no extra speed rounds", lambda a, f: dataclasses.replace(a, extra_max_rounds=0)),
    ] if first.extra_applies else []
    load = [("one load-sweep round", lambda a, f: dataclasses.replace(a, load_repeats=1))] if first.load_applies else []
    return gate_only + load + [
        ("at most 6 conversations per suite", _conversations(6)),
        ("replies capped at 3/4 of the profile's caps", _caps(0.75)),
        ("at most 4 conversations per suite", _conversations(4)),
        ("replies capped at half the profile's caps", _caps(0.5)),
        (f"{fewest} speed rounds, the fewest that rank {comparisons} comparison(s) at alpha {cfg.decision.alpha} "
         f"after the {cfg.decision.multiple_comparisons} correction",
         lambda a, f: dataclasses.replace(a, trials=min(a.trials, fewest))),
        (f"{MIN_CONVERSATIONS} conversations per suite", _conversations(MIN_CONVERSATIONS)),
    ]


def resolved_budget(cfg: Config) -> float | None:
    """run.budget in seconds; auto: ``AUTO_CPU_S`` on a CPU, None on a CUDA device."""
    b = budget_seconds(cfg.run.budget)
    if b != "auto":
        return b
    from pipeline.plan.estimate import _on_device

    return None if _on_device(cfg) else float(AUTO_CPU_S)


def plan_seconds(cfg: Config) -> Callable[[Config], tuple[float, int, str]]:
    """A function giving an allocation's planned seconds (the stages still to run, the extra rounds at their cap),
    its untimed stages and the time basis; this machine's bandwidth and compute are read once for all."""
    from pipeline.plan import measured_runs
    from pipeline.plan.estimate import build_plan, plan_variants
    from pipeline.runtimes.model_inventory import NotLocal, model_inventory

    variants = plan_variants(cfg)           # the same in every allocation
    try:
        inv = model_inventory(cfg)
    except NotLocal as exc:
        raise NoTimeBasis(f"run.budget={cfg.run.budget}: the plan has no time for this run before the model is "
                          f"downloaded ({exc}); `quantdrift command=prepare` fetches it, or run without a budget "
                          "(BUDGET=off, run.budget=null)") from None
    here = measured_runs.bandwidth_here(cfg.runtime.n_threads), measured_runs.compute_here(cfg.runtime.n_threads)

    def planned(c: Config) -> tuple[float, int, str]:
        records = logging.getLogger("pipeline.suites.records")      # its per-selection notes, once per allocation
        level = records.level
        records.setLevel(logging.WARNING)
        try:
            plan = build_plan(c, variants=variants, inventory=inv, bandwidth_here=here[0],
                              compute_here=here[1])
        finally:
            records.setLevel(level)
        todo = [r for r in plan["rows"] if not r.exists]
        timed = [r.time_s for r in todo if r.time_s is not None]
        if todo and not timed:
            raise NoTimeBasis(f"run.budget={c.run.budget}: the plan has no time for this run here "
                              f"({plan.get('time_basis') or 'no measured run to scale from'}), so no budget can be "
                              "kept: run it once without one (BUDGET=off, run.budget=null)")
        return sum(timed) + extra_seconds(c, variants), len(todo) - len(timed), plan.get("time_basis") or ""
    return planned


def extra_seconds(c: Config, variants: list) -> float:
    """The extra llama.cpp speed rounds at their cap where one of ``variants`` takes them (not in the plan's table)."""
    s = c.profile.speed
    extra = s.extra_max_rounds and any(v.runtime in s.extra_runtimes for v in variants)
    return 60.0 * s.extra_max_minutes if extra else 0.0


def fit(cfg: Config, budget_s: float, planned: Callable[[Config], tuple[float, int, str]]) -> dict:
    """The first allocation along ``steps`` whose planned time fits ``budget_s``: the record of the fit
    ({"budget_s", "profile_planned_s", "planned_s", "steps", "allocation": its settings or None where the profile
    fits uncut, ...}). A step that lowers no planned time is not taken. Raises ConfigError naming the most the
    steps can cut the run to, and its planned time, where nothing fits."""
    first = profile_allocation(cfg)
    t0, untimed, basis = planned(cfg)
    record = {"budget_s": budget_s, "profile_planned_s": t0, "planned_s": t0, "untimed_stages": untimed,
              "time_basis": basis, "steps": [], "allocation": None, "whole_suites": whole_suites(cfg),
              **reuse_key(cfg, first)}
    if t0 <= budget_s:
        return record
    a, t, taken = first, t0, []
    for what, step in steps(cfg, first):
        nxt = step(a, first)
        if nxt == a:
            continue
        t_next, untimed_next, _ = planned(nxt.apply(cfg))
        if t_next >= t:
            continue            # saves nothing planned: not a cut worth reporting
        a, t, untimed = nxt, t_next, untimed_next
        taken.append(what)
        log.info("run.budget: %s -> planned %.1f min", what, t / 60)
        if t <= budget_s:
            return {**record, "planned_s": t, "untimed_stages": untimed, "steps": taken,
                    "allocation": a.settings(), "described": a.describe()}
    most = (f"the most the steps cut it to ({a.describe()}; fewer conversations or speed rounds would carry no "
            f"signal) is planned at {t / 60:.0f} min" if taken else "no step cuts it further")
    raise ConfigError(
        f"run.budget={cfg.run.budget} ({budget_s / 60:.0f} min) cannot be kept: the profile's work is planned at "
        f"{t0 / 60:.0f} min{_untimed(untimed)}, and {most} ({basis}). Nothing was computed. Raise the budget to at "
        f"least {math.ceil(t / 60)}m, compare fewer variants (run.variants=[...]), or run without a budget "
        "(BUDGET=off)")


def _untimed(n: int) -> str:
    return f" ({n} stage(s) without a time estimate, not counted)" if n else ""


def reuse_key(cfg: Config, first: Allocation | None = None) -> dict:
    """What a kept fit must match to be taken again by a resumed run: the run's variants, suites and profile, the
    profile's own allocation as composed (overrides included; ``first`` where already known), the load sweep and
    the test the rounds serve."""
    a = first or profile_allocation(cfg)
    return {"variants": list(cfg.run.variants), "profile": cfg.profile.name, "suites": list(cfg.run.suites),
            "profile_allocation": {**a.settings(), **a.applies()}, "load": cfg.load.name,
            "rank_test": [cfg.decision.alpha, cfg.decision.multiple_comparisons]}


def fit_line(cfg: Config) -> str | None:
    """``quantdrift plan``'s line on run.budget: what `make compare` will cut to keep it (None: no budget).
    Raises ConfigError where it cannot be kept, as the comparison would."""
    budget_s = resolved_budget(cfg)
    if budget_s is None:
        return None
    try:
        r = fit(cfg, budget_s, plan_seconds(cfg))
    except NoTimeBasis as exc:
        if budget_seconds(cfg.run.budget) != "auto":
            raise
        return f"budget: auto, none kept ({exc})"
    except ConfigError as exc:
        _keep_plan(cfg, {"budget_s": budget_s, **reuse_key(cfg), "refused": str(exc)})
        raise
    _keep_plan(cfg, {**r, "budget": str(cfg.run.budget)})
    head = f"budget: run.budget={cfg.run.budget} ({budget_s / 60:.0f} min)"
    whole = f"; left whole: {', '.join(r['whole_suites'])} (generated)" if r["whole_suites"] else ""
    if r["allocation"] is None:
        return (f"{head}: the profile's work (the extra speed rounds at their cap), planned at "
                f"{r['planned_s'] / 60:.1f} min{_untimed(r['untimed_stages'])}, fits uncut")
    return (f"{head}: the profile's work (the extra speed rounds at their cap) is planned at "
            f"{r['profile_planned_s'] / 60:.1f} min; the comparison will cut it ({'; '.join(r['steps'])}) to "
            f"{r['described']}, planned at {r['planned_s'] / 60:.1f} min{_untimed(r['untimed_stages'])}{whole}")


def _record_path(cfg: Config, name: str = RECORD) -> Path:
    return cfg.model_dir / "runs" / cfg.run.name / name


def write_budget(cfg: Config, record: dict) -> None:
    """The run's budget record, written (atomically) where ``read_budget`` finds it."""
    from pipeline.infra.files import write_json
    write_json(_record_path(cfg), record)


def _keep_plan(cfg: Config, record: dict) -> None:
    """``quantdrift plan``'s fit (or refusal), kept for ``fit_budget``: the plan reads the machine's speed anew each
    time, and two readings a minute apart can move a budget at the edge across it."""
    import time

    from pipeline.infra.files import write_json

    write_json(_record_path(cfg, PLANNED), {**record, "planned_at": time.time()})


def _planned_fit(cfg: Config, same: dict) -> dict | None:
    """The fit ``quantdrift plan`` kept for this run within ``PLAN_KEPT_S``, with the same budget and inputs."""
    import time

    planned = read_budget(cfg, PLANNED)
    age = time.time() - float((planned or {}).get("planned_at") or 0)
    return planned if 0 <= age <= PLAN_KEPT_S and _matches(planned, same) else None


def _matches(record: dict | None, same: dict) -> bool:
    """Whether a kept fit was made for the budget and inputs ``same`` (``reuse_key``'s, with the budget)."""
    return bool(record) and all(record.get(k) == v for k, v in same.items())


def read_budget(cfg: Config, name: str = RECORD) -> dict | None:
    """The run's budget record (``fit``'s, with the budget as given; ``PLANNED``: the plan's), or None where the run
    had none."""
    from pipeline.infra.files import read_json

    path = _record_path(cfg, name)
    return read_json(path) if path.is_file() else None


def allocation_of(record: dict) -> Allocation:
    """The allocation a fit's record holds (its ``allocation`` must be set)."""
    s = record["allocation"]
    first = record["profile_allocation"]        # whether the extra rounds and the load sweep apply: as it was
    return Allocation(per_suite=s["profile.per_suite"], trials=s["profile.speed.trials"],
                      extra_max_rounds=s["profile.speed.extra_max_rounds"],
                      extra_max_minutes=s["profile.speed.extra_max_minutes"], load_repeats=s["load.repeats"],
                      extra_applies=bool(first.get("extra_applies", True)),
                      load_applies=record.get("load") != "off")


def kept_allocation(cfg: Config) -> Config:
    """``cfg`` with the allocation its run was given under a budget (``quantdrift report`` and the summary read the
    run as it ran); ``cfg`` itself where the run was not cut."""
    record = read_budget(cfg)
    return allocation_of(record).apply(cfg) if record and record.get("allocation") else cfg


def fit_budget(cfg: Config, planned: Callable[[Config], tuple[float, int, str]] | None = None
               ) -> tuple[Config, list[str]]:
    """The comparison's config within its budget and the Hydra overrides that give each variant's job the same
    allocation; ``cfg`` itself and no overrides where there is no budget or the profile fits it. The fit is kept
    in the run's folder, and a resumed run with the same budget, variants, profile and suites takes it again."""
    import time

    budget_s = resolved_budget(cfg)
    path = _record_path(cfg)
    if budget_s is None:
        path.unlink(missing_ok=True)
        return cfg, []
    kept = read_budget(cfg)
    same = {"budget_s": budget_s, **reuse_key(cfg)}
    if _matches(kept, same):
        record = kept
        log.info("run.budget: the allocation of this run's first sitting, kept (%s)", path)
    elif (planned_fit := _planned_fit(cfg, same)) is not None:
        ago = (time.time() - planned_fit.pop("planned_at")) / 60
        if "refused" in planned_fit:
            raise ConfigError(f"{planned_fit['refused']} (as `quantdrift plan` found {ago:.0f} min ago with the "
                              f"same budget and inputs; its fit stands for {PLAN_KEPT_S // 60} min: "
                              f"{_record_path(cfg, PLANNED)})")
        record = {**planned_fit, "planned_by": f"quantdrift plan, {ago:.0f} min before the run"}
        log.info("run.budget: the allocation `quantdrift plan` fitted %.0f min ago with the same inputs", ago)
        write_budget(cfg, record)
    else:
        try:
            record = {**fit(cfg, budget_s, planned or plan_seconds(cfg)), "budget": str(cfg.run.budget)}
        except NoTimeBasis as exc:
            if budget_seconds(cfg.run.budget) != "auto":
                raise
            log.warning("run.budget=auto: nothing cut, no plan time: %s", exc)
            # kept as a fit that cut nothing, so a resumed sitting (the model downloaded by then) keeps it uncut
            record = {**same, "budget": "auto", "no_time": str(exc), "allocation": None, "steps": [],
                      "profile_planned_s": None, "planned_s": None, "untimed_stages": None, "time_basis": None,
                      "whole_suites": whole_suites(cfg)}
        write_budget(cfg, record)
    if record["allocation"] is None:
        if record["planned_s"] is not None:
            log.info("run.budget: the profile's work is planned at %.1f min, inside %.0f min: nothing cut",
                     record["planned_s"] / 60, budget_s / 60)
        return cfg, []
    a = allocation_of(record)
    log.warning("run.budget %s: the profile's work is planned at %.1f min; cut to %s, planned at %.1f min",
                record["budget"], record["profile_planned_s"] / 60, a.describe(), record["planned_s"] / 60)
    return a.apply(cfg), a.overrides()
