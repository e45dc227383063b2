"""The times of the stages carried by the measured variant's speed figures (its load, prefill and decode rates)
rather than by a stage of the same kind, by component, used through ``pipeline.plan.stage_rates.TimeModel``: a
speed trial's probe workers (a worker's start, its model's load and the protocol's generations), a served variant's
load sweep (the measured levels carried by the prefill and decode ratios, a round's fixed part, each level capped at
load.max_seconds_per_level) and a benchmark task (per sample, by the time per decoded or prompt token)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlannedSweep:
    """The planned load sweep of one served variant: its rounds (a fresh server each), the context depths, the
    requests each concurrency level sends (loadgen.level_requests) and the seconds a level may last."""

    rounds: int
    depths: tuple[int, ...]
    requests: dict              # concurrency -> requests
    cap: float

    @property
    def levels(self) -> int:
        return self.rounds * len(self.depths) * len(self.requests)


class SpeedRates:
    """The speed, load and benchmark stages' part of ``TimeModel``, on its measured run (``run``), calibration
    ``factor``, planned sizes (``plan_params``, ``plan_speed``) and rates (``_rates``, ``_rate_pair``, ``_match``,
    ``_types_note``)."""

    @staticmethod
    def _probe_cost(rates: dict, protocol: dict) -> float:
        """One speed-probe label: its model loaded, then every generation of the protocol."""
        n = protocol["warmup"] + protocol["rounds"] * protocol["repeats"]
        return rates["load"] + n * (protocol["prompt_tokens"] * rates["prefill"]
                                    + protocol["decode_tokens"] * rates["decode"])

    def _speed(self, name: str, kind: str, nbytes: float, params: int | None,
               labels: int, types: dict | None = None) -> tuple[float, str] | None:
        """The speed stage's time for one variant (``labels``: 2 for the A/A control) by component: each label's
        model load and generations at the planned size, plus each label's share of what the measured stage's wall
        leaves after its own labels' components (a probe worker's start: the interpreter, the runtime's imports,
        the CPU checks). None without the measured run's protocol or speed figures."""
        run, start = self.run, self._worker_start()
        if start is None or not self.plan_speed:
            return None
        ref = self._match("score", name, kind, nbytes)
        if not ref or ref[0] not in run.rates:
            return None
        rates = self._rates(ref[0], nbytes, params or self.plan_params or run.params, planned=True, types=types)
        t = labels * (start + self._probe_cost(rates, self.plan_speed))
        via = "" if ref[0] == name else f" via {ref[0]}"
        return t, (f"{run.label}{via} by component ({labels} label{'s' * (labels > 1)}: a worker's start "
                   f"{start:.1f} s + its load and probes){self._types_note(ref[0], types)}")

    def _worker_start(self) -> float | None:
        """A Python worker's start with the runtimes' imports (the interpreter, torch or llama.cpp, the CPU checks),
        as the measured speed stage gives it: its wall less its labels' loads and generations, per label. None
        without the measured run's protocol or speed figures."""
        run = self.run
        if not (run.speed_protocol and run.speed_round and ("speed", "*") in run.walls):
            return None
        measured = [label.split("#", 1)[0] for label in run.speed_round]
        if any(v not in run.rates or not run.variants[v].get("bytes") for v in measured):
            return None
        costs = [self._probe_cost(self._rates(v, run.variants[v]["bytes"], run.params), run.speed_protocol)
                 for v in measured]
        return max(0.0, run.walls[("speed", "*")] - sum(costs)) / len(costs)

    def _load_sweep(self, measured: str, nbytes: float, params: int | None,
                    sweep: PlannedSweep, types: dict | None = None) -> tuple[float, str] | None:
        """A served variant's load sweep by component: per round what the measured rounds spent outside their levels
        (a server's start, guidellm's start and exit: ``MeasuredRun.load_fixed_s``) plus the planned load's growth;
        per level its requests at the measured level's seconds per request (the nearest concurrency), the time to
        first token carried by the prefill ratio and the depth, the rest of a request by the decode ratio; a level
        capped at load.max_seconds_per_level. None without the measured levels or speed figures."""
        import math

        run, rows = self.run, self.run.load_levels.get(measured)
        mrates, prates = self._rate_pair(measured, nbytes, params, types)
        if not rows or run.load_fixed_s is None or not (mrates and prates):
            return None
        pre, dec = prates["prefill"] / mrates["prefill"], prates["decode"] / mrates["decode"]
        total, capped = 0.0, 0
        for depth in sweep.depths:
            for c, requests in sweep.requests.items():
                lv = min(rows, key=lambda r: (abs(math.log(r["concurrency"] / c)), abs(r["depth"] - depth)))
                first = min(1.0, lv["ttft"] / lv["e2e"])
                ratio = first * pre * (depth / lv["depth"] if lv["depth"] else 1.0) + (1.0 - first) * dec
                level = requests * lv["wall"] / lv["requests"] * ratio * self.factor
                capped += level > sweep.cap
                total += min(level, sweep.cap) * sweep.rounds
        fixed = (run.load_fixed_s + max(0.0, prates["load"] - mrates["load"])) * self.factor
        return (total + fixed * sweep.rounds,
                f"{run.label} by component ({measured}'s levels: prefill x{pre:.2g}, decode x{dec:.2g}; "
                f"{sweep.rounds} round(s) of {fixed:.0f} s outside the levels){' (capped levels)' * bool(capped)}")

    def _bench(self, stage: str, name: str, kind: str, nbytes: float, params: int | None,
               samples: float, types: dict | None = None) -> tuple[float | None, str]:
        """A benchmark task's stage: the same task on the nearest measured variant, per sample, carried by the time
        per decoded token (a task that generates) or per prompt token (log-likelihoods), times ``samples``."""
        run, task = self.run, stage.split(":", 1)[1]
        found = self._match(stage, name, kind, nbytes)
        if found is None or not run.bench_samples.get((task, found[0])):
            return None, f"no {stage} stage in {run.label}"
        other, wall = found
        mrates, prates = self._rate_pair(other, nbytes, params, types)
        from pipeline.suites.lmeval.tasks import get_task

        rate = "decode" if get_task(task).generates else "prefill"
        ratio = prates[rate] / mrates[rate] if mrates and prates else nbytes / run.variants[other]["bytes"]
        ratio *= samples / run.bench_samples[(task, other)]
        via = "" if other == name else f" via {other}"
        return wall * ratio * self.factor, f"{run.label}{via} x{ratio:.2g} (samples x time per {rate} token)"
