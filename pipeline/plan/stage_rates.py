"""Each stage's time, from earlier measured runs scaled to the planned one, or with a short calibration.

A measured run (``pipeline.plan.measured_runs``) is a ``summary.json`` under paths.results (its stage times:
references per suite, per variant free-running and scoring, the run's speed and load stages, each artifact's
quantization) plus, where its artifacts are still on disk, the stage manifests the summary does not carry (prepare,
the F16 conversion, parity, the dequantized stand-ins, the original's own free-running baseline). A planned stage
takes the time of the same stage of the same variant (else of the measured variant of the same weight kind with
the nearest size), carried by the ratio of its components (``TimeModel.by_component``: loading, prompt tokens
read, reply tokens decoded, work per vocabulary entry, the original's own passes; a speed probe's worker start,
load and generations; what a free-running wall leaves beside them, per decoded token); a one-off stage
(conversion, parity, quantization) by a fixed part and a part that grows with the parameters where a run of another
size with the same tokenizer on this CPU has it, else by the parameters; the F16 conversion by its recorded phases,
a GGUF quantization by the weights of each ggml type (these in ``pipeline.plan.one_off_rates``); the speed trials,
the load sweep and the benchmark tasks by the measured variant's speed figures (``pipeline.plan.speed_rates``).
Every wall is scaled by the ratio of memory bandwidths, the one its run recorded over the local machine's measured
now the same way in one to two seconds (the short calibration): from another CPU, and from the same one too, whose
readings move between machine states with its stage times (docs/plan.md, "How the prediction is made"); a
model-level stage built in another run than the summary's by that run's reading. Prompt tokens read (prefill,
teacher-forced scoring) are compute-bound: where the run recorded a compute reading, that part is rescaled by the
ratio of compute readings instead (``prefill_scale``), and for a GGUF file carried from the measured file's ggml
types to the planned one's by each type's prompt rate measured on the local machine
(``pipeline.plan.prompt_rates``): llama.cpp repacks some types for its CPU matrix products, so a small model's
K-quant file (mostly fallback types) reads prompts at another speed per weight than a large model's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.plan.measured_runs import MeasuredRun
from pipeline.plan.one_off_rates import conversion, quantization_by_type, two_sizes
from pipeline.plan.speed_rates import PlannedSweep, SpeedRates


@dataclass
class TimeModel(SpeedRates):
    """Scales a measured run's stage times to the planned run."""

    run: MeasuredRun
    factor: float
    basis: str
    plan_budget: dict                     # suite -> reply-token budget of the planned run
    leave_out: bool = False               # never a variant's own measurement (a run compared with itself)
    plan_work: dict | None = None         # suite -> the planned run's token counts (stage_plan.Workload.per_suite)
    plan_params: int | None = None
    plan_vocab: int | None = None
    plan_original_bytes: float | None = None
    plan_speed: dict | None = None        # the planned run's speed protocol (``speed_protocol``)
    plan_parity_tokens: int | None = None  # reference.parity_tokens of the planned run
    others: list = field(default_factory=list)   # the other measured runs (a second size for one-off stages)
    threads: int = 1                      # the planned run's runtime.n_threads (llama-quantize's threads)
    quant_rates: object = None            # types -> {type: seconds per weight here} (quant_rates.seconds_per_weight)
    compute_factor: float | None = None   # the run's compute reading over this machine's (None: not recorded)
    prompt_rates: object = None           # types -> {type: s per prompt token per weight here} (prompt_rates.py)

    @property
    def prefill_scale(self) -> float:
        """What a planned prompt token's time is multiplied by so that, once every planned time is rescaled by the
        bandwidth ``factor``, prompt work is rescaled by the compute reading instead (1 without one)."""
        return self.compute_factor / self.factor if self.compute_factor and self.factor else 1.0

    def _fill(self) -> float:
        """The measured run's replies' real length over their budget (replies stop before it)."""
        budget = sum((self.run.reply_budget or {}).values())
        return min(1.0, self.run.scored_tokens / budget) if budget and self.run.scored_tokens else 1.0

    def _type_factor(self, measured: str, types: dict | None) -> float:
        """A planned GGUF file's prompt work per weight over the measured variant's file's: each file's matrix
        weights (``types``, ``MeasuredRun.quant_elements``) at each ggml type's seconds per weight measured here
        (``prompt_rates``). 1 where a file's types or the measurement are missing."""
        from pipeline.plan.prompt_rates import NO_PRODUCT

        mine = self.run.quant_elements.get((self.run.variants.get(measured) or {}).get("base") or measured)
        planned, mine = ({t: n for t, n in (e or {}).items() if t not in NO_PRODUCT} for e in (types, mine))
        rates = self.prompt_rates(tuple(sorted(set(planned) | set(mine)))) if planned and mine and \
            self.prompt_rates else None
        if not rates:
            return 1.0
        mean = [sum(n * rates[t] for t, n in e.items()) / sum(e.values()) for e in (planned, mine)]
        return mean[0] / mean[1]

    def _types_note(self, measured: str, types: dict | None) -> str:
        f = self._type_factor(measured, types) if types else 1.0
        return f" (prompt work x{f:.2g} by ggml type)" if abs(f - 1.0) > 0.005 else ""

    def _rates(self, measured: str, nbytes: float, params: float, planned: bool = False,
               types: dict | None = None) -> dict | None:
        """Seconds per prefill token, per decoded token and to load, for a variant of ``nbytes`` bytes and
        ``params`` parameters, from the measured variant's speed figures: prefill is compute (per token it grows
        with the parameters); a decoded token reads every weight once (bytes over the run's measured bandwidth) on
        top of a fixed cost per token (the measured time per token less that read, which dominates a small model);
        loading is the measured load (mostly fixed costs on a small model: the runtime's start, a transformers
        model's construction) plus one pass over the added bytes. ``planned``: the planned run's, its prompt work
        rescaled by compute rather than bandwidth (``prefill_scale``) and carried from the measured file's ggml
        types to the planned file's ``types`` (``_type_factor``)."""
        r, v = self.run.rates.get(measured), self.run.variants.get(measured) or {}
        if not r or not v.get("bytes"):
            return None
        bw, mbytes = self.run.bandwidth_bytes_per_s, v["bytes"]
        per_token, load = 1.0 / r["decode"], self._load_s(measured)
        if bw:
            per_token = max(0.0, per_token - mbytes / bw) + nbytes / bw
            load += max(0.0, nbytes - mbytes) / bw
        else:
            per_token *= nbytes / mbytes
        scale = self.prefill_scale * self._type_factor(measured, types) if planned else 1.0
        prefill = params / self.run.params / r["prefill"] * scale
        return {"prefill": prefill, "decode": per_token, "load": load}

    def _factor_of(self, stage: str, key: str) -> float:
        """The calibration factor for one measured wall: the run's (its recorded bandwidth over this machine's),
        or, for a model-level stage with a bandwidth reading of its own (``MeasuredRun.wall_bandwidths``: built
        in another run than the summary's), that reading over this machine's."""
        own, bw = self.run.wall_bandwidths.get((stage, key)), self.run.bandwidth_bytes_per_s
        return self.factor * own / bw if own and bw else self.factor

    def _load_s(self, measured: str) -> float:
        """The measured variant's load: the fastest of the variants with its weights on its runtime (the original
        and the original with a KV-cache setting load the same file; on a shared machine a slower load is the
        slower one's contention, or a first import, not the weights')."""
        v = self.run.variants[measured]
        if v.get("base") is None:
            return self.run.rates[measured]["load_s"]
        same = [r["load_s"] for n, r in self.run.rates.items()
                if (self.run.variants.get(n) or {}).get("base") == v["base"]
                and (self.run.variants.get(n) or {}).get("runtime") == v.get("runtime")]
        return min(same or [self.run.rates[measured]["load_s"]])

    @staticmethod
    def _read(rates: dict, tokens: float) -> float:
        """A runtime loaded, then ``tokens`` read in one teacher-forced pass."""
        return rates["load"] + tokens * rates["prefill"]

    def _exact_cost(self, original_rates: dict | None, work: dict) -> float:
        """Building the original's exact rows (stages.score.exact_sample_logprobs), once per suite by the first
        variant compared with them: the original loaded on its runtime and its longest transcript read."""
        if not original_rates:
            return 0.0
        return sum(self._read(original_rates, w["context_tokens"]) for w in work.values())

    def _parity(self, wall: float, params: int, f16_bytes: float | None) -> tuple[float, str] | None:
        """The parity check by component (stages.parity.check_parity): the F16 file and the original loaded one
        after the other, the same parity tokens read by both, and the rest (the vocabulary loaded in a child, the
        suites' texts tokenized twice, the rows compared) grown with the vocabulary and the tokens. None without
        both runtimes' speed figures."""
        run, names = self.run, ("gguf_f16", "original")
        if not (f16_bytes and self.plan_original_bytes and self.plan_vocab and run.vocab and run.parity_tokens
                and all(n in run.rates and run.variants[n].get("bytes") for n in names)):
            return None
        tokens = self.plan_parity_tokens or run.parity_tokens
        sizes = {"gguf_f16": f16_bytes, "original": self.plan_original_bytes}

        def cost(rates: dict, n: int) -> float:
            return sum(self._read(r, n) for r in rates.values())

        measured = cost({n: self._rates(n, run.variants[n]["bytes"], run.params) for n in names}, run.parity_tokens)
        planned = cost({n: self._rates(n, sizes[n], params, planned=True) for n in names}, tokens)
        rest = max(0.0, wall - measured)
        t = planned + rest * self.plan_vocab / run.vocab * tokens / run.parity_tokens
        return t, (f"{run.label} by component (both runtimes' loads and {tokens} tokens each; the rest, "
                   f"{rest:.1f} s, x{self.plan_vocab / run.vocab:.2g} with the vocabulary)")

    @staticmethod
    def _exactness_cost(rates: dict, work: dict) -> float:
        """A variant's check of its stored KLD against the exact one (stages.score.kld_exactness): its runtime,
        already loaded, reads each suite's longest transcript once more for full-vocabulary rows (its measured
        share of a scoring: docs/plan.md, "Scoring reads the longest transcript twice")."""
        return sum(w["context_tokens"] for w in work.values()) * rates["prefill"]

    def _rows_cost(self, original_rates: dict | None, work: dict, fill: float) -> float:
        """The reference's exact rows (stages.reference.exact_rows): the original loaded on its runtime and every
        transcript read once more (its prompts and its replies)."""
        if not original_rates:
            return 0.0
        tokens = sum(w.get("prefill_tokens", w["prompt_tokens"]) + w["reply_tokens"] * fill for w in work.values())
        return self._read(original_rates, tokens)

    def _rate_pair(self, measured: str, nbytes: float, params: int | None,
                   types: dict | None = None) -> tuple[dict | None, dict | None]:
        """The measured variant's rates at its own size and at the planned one (``_rates``; ``types``: the planned
        file's weights per ggml type)."""
        run = self.run
        mbytes = (run.variants.get(measured) or {}).get("bytes") or 0
        return (self._rates(measured, mbytes, run.params),
                self._rates(measured, nbytes, params or self.plan_params or run.params, planned=True, types=types))

    def _cost(self, stage: str, rates: dict, work: dict, vocab: float, fill: float, per_row: float) -> float:
        """A stage's seconds by component: loading, prompt tokens read (each text once: the history's prefix is
        reused), reply tokens decoded (free-running and the reference) or read (teacher-forced scoring), and the
        work per scored row of the vocabulary (log-probs, KLD, top-K: ``per_row`` seconds per entry)."""
        prefill = sum(w.get("prefill_tokens", w["prompt_tokens"]) for w in work.values())
        replies = sum(w["reply_tokens"] for w in work.values()) * fill
        cost = self._read(rates, prefill)
        if stage == "score":
            return cost + replies * rates["prefill"] + replies * vocab * per_row
        cost += replies * rates["decode"]
        if stage == "reference":        # the replies generated, then read again teacher-forced for their log-probs
            cost += (prefill + replies) * rates["prefill"] + replies * vocab * per_row
        return cost

    def by_component(self, stage: str, measured: str, wall: float, nbytes: float, suites: list[str] | None,
                     params: int | None, measured_suites: list[str] | None = None,
                     builds_exact: bool = False, types: dict | None = None) -> float | None:
        """The measured stage's wall carried to the planned one by the ratio of their component costs (each at its
        own size, token counts and vocabulary); scoring's and the reference's cost per vocabulary entry is what the
        measured wall leaves after its tokens. The original's own passes are components of their own: in every
        reference its exact rows (``_rows_cost``), in the scoring that builds them its exact-sample rows
        (``_exact_cost``: taken out of the measured wall where that variant built them, ``MeasuredRun.exact_builder``,
        added where the planned one does, ``builds_exact``); in a scoring that checks its stored KLD against the
        exact one (``MeasuredRun.exactness``), the variant's own pass over the longest transcripts
        (``_exactness_cost``). None without speed figures or token counts."""
        run = self.run
        if not (self.plan_work and run.work and run.vocab and self.plan_vocab):
            return None
        mrates, prates = self._rate_pair(measured, nbytes, params, types)
        if mrates is None or prates is None:
            return None
        pwork = {s: w for s, w in self.plan_work.items() if s in (suites or self.plan_work)}
        # the measured wall covers the measured run's suites (one suite for a reference)
        mwork = {s: w for s, w in run.work.items() if s in (measured_suites or run.work)}
        fill = self._fill()
        exact_m = exact_p = 0.0
        if stage in ("score", "reference") and "original" in run.rates:
            morig, porig = self._rate_pair("original", self.plan_original_bytes or run.variants["original"]["bytes"],
                                           params)
            if stage == "reference":      # every reference: the original's exact rows (stages.reference.exact_rows)
                exact_m, exact_p = self._rows_cost(morig, mwork, fill), self._rows_cost(porig, pwork, fill)
            else:
                exact_m = self._exact_cost(morig, mwork) if measured == run.exact_builder else 0.0
                exact_p = self._exact_cost(porig, pwork) if builds_exact else 0.0
        if stage == "score" and measured in run.exactness:       # the planned variant is of the measured one's kind
            exact_m += self._exactness_cost(mrates, mwork)
            exact_p += self._exactness_cost(prates, pwork)
        base = self._cost(stage, mrates, mwork, run.vocab, fill, 0.0) + exact_m
        replies = [sum(w["reply_tokens"] for w in work.values()) * fill for work in (mwork, pwork)]
        rows = replies[0] * run.vocab
        per_row = max(0.0, wall - base) / rows if stage in ("score", "reference") and rows else 0.0
        measured_cost = self._cost(stage, mrates, mwork, run.vocab, fill, per_row) + exact_m
        if measured_cost <= 0 or not pwork or not mwork:
            return None
        if stage == "evaluate" and replies[0]:
            # free-running's own cost per decoded token beside the probe's (its sampling loop, the contexts it
            # decodes at): what the wall leaves after its components, per reply token, at any size, up to half the
            # measured time per decoded token either way (a stage of few replies must not make its noise most of a
            # larger plan); what is left beyond that bound is carried with the components
            bound = 0.5 * mrates["decode"]
            per_token = min(bound, max(-bound, (wall - base) / replies[0]))
            measured_cost = base + replies[0] * per_token
            planned = self._cost(stage, prates, pwork, self.plan_vocab, fill, 0.0) + replies[1] * per_token
            if measured_cost > 0 and planned > 0:
                return wall * planned / measured_cost
        return wall * (self._cost(stage, prates, pwork, self.plan_vocab, fill, per_row) + exact_p) / measured_cost

    def _tokens(self, suites: list[str] | None = None) -> float:
        """Planned reply-token budget over the measured run's (a suite it did not have: against all it had)."""
        mb = self.run.reply_budget or {}
        suites = suites or list(self.plan_budget)
        plan = sum(self.plan_budget.get(s, 0) for s in suites)
        meas = sum(mb[s] for s in suites if s in mb) or sum(mb.values())
        return plan / meas if meas else 1.0

    def _match(self, stage: str, name: str, kind: str, nbytes: float) -> tuple[str, float] | None:
        """(measured variant, its wall) for this stage: the same variant, else the same kind with the nearest
        size (then the time scales by the byte ratio). Free-running matches on where the replies come from."""
        field_ = "generates" if stage == "evaluate" else "kind"
        if (stage, name) in self.run.walls and not self.leave_out:
            return name, self.run.walls[(stage, name)]
        # a variant that reused the reference (0 s) says nothing about generating
        usable = {n: v for n, v in self.run.variants.items() if (stage, n) in self.run.walls and v["bytes"]
                  and self.run.walls[(stage, n)] and not (self.leave_out and n in (name, name.split("+")[0]))}
        same = [(abs(v["bytes"] - nbytes), n) for n, v in usable.items() if v[field_] == kind]
        if not same:
            same = [(abs(v["bytes"] - nbytes), n) for n, v in usable.items()]
        if not same:
            return None
        n = min(same)[1]
        return n, self.run.walls[(stage, n)]

    def estimate(self, stage: str, name: str, kind: str, nbytes: float, suites: list[str] | None = None,
                 params: int | None = None, extra: float = 1.0, load_levels: PlannedSweep | None = None,
                 source: str | None = None, builds_exact: bool = False, labels: int = 1,
                 f16_bytes: float | None = None, type_elements: dict | None = None) -> tuple[float | None, str]:
        """(seconds, basis) of ``stage`` for the planned variant ``name``. ``load_levels``: the planned load sweep
        (``PlannedSweep``), by component (``_load_sweep``) where the measured run recorded its levels, else a level's
        measured time scaled by the time per decoded token up to load.max_seconds_per_level, the levels added up."""
        run = self.run
        if stage == "prepare" and source and run.source_kind and source != run.source_kind:
            return None, (f"not comparable: {run.label}'s source was {run.source_kind}, this one is {source}")
        if stage in ("prepare", "convert_f16", "parity", "standin", "baseline"):
            # shared stages, and those of one variant with nothing comparable beside them: their own measurement
            keyed = [(k, w) for (s, k), w in run.walls.items() if s == stage and k in ("-", name)] or \
                [(k, w) for (s, k), w in run.walls.items() if s == stage]
            walls = [w for _, w in keyed]
            if not walls:
                return None, f"no {stage} stage measured in {run.label}"
            f = self._factor_of(stage, keyed[0][0])     # a model-level stage: its own bandwidth reading
            if stage == "baseline" and "original" in run.rates:
                t = self.by_component("evaluate", "original", walls[0], nbytes, None, params)
                if t is not None:
                    return t * f, f"{run.label} by component (original's speeds)"
            fit = two_sizes(run, self.others, stage, keyed[0][0], walls[0], params) if params else None
            if stage != "baseline" and fit:
                return fit[0] * f, fit[1]
            if stage == "parity" and params and (by := self._parity(walls[0], params, f16_bytes)) is not None:
                return by[0] * f, by[1]
            by = conversion(run, walls[0], params, self.plan_vocab) if stage == "convert_f16" and params else None
            if by is not None:
                return by[0] * f, by[1]
            if stage == "convert_f16" and params and (start := self._worker_start()) is not None and walls[0] > start:
                # the converter is a Python process importing torch and gguf-py: a worker's start, then its tensors
                ratio = params / run.params
                return ((start + (walls[0] - start) * ratio) * f,
                        f"{run.label}: a Python worker's start ({start:.1f} s, its speed stage's) + the rest "
                        f"x{ratio:.2g} (params)")
            if stage == "prepare" and source == "used in place":     # its facts written, the weights not read
                return walls[0] * f, f"{run.label} x1 (a folder used in place: not its size)"
            ratio = (params or run.params) / run.params * (self._tokens() if stage == "baseline" else 1.0)
            return walls[0] * ratio * f, f"{run.label} x{ratio:.2g} (params{' x tokens' * (stage == 'baseline')})"
        if stage == "reference":
            own = (stage, suites[0]) in run.walls
            walls = [run.walls[(stage, suites[0])]] if own else [w for (s, _), w in run.walls.items()
                                                                 if s == "reference"]
            if not walls:
                return None, f"no reference stage in {run.label}"
            producer = "gguf_f16" if "gguf_f16" in run.rates else (self._match("score", name, kind, nbytes) or [""])[0]
            t = self.by_component(stage, producer, sum(walls), nbytes, suites, params,
                                  [suites[0]] if own else [s for (st, s) in run.walls if st == "reference"])
            if t is not None:
                return t * self.factor, f"{run.label} by component ({producer}'s speeds)"
            mb = run.reply_budget or {}
            meas = mb.get(suites[0]) if own else sum(mb.values())
            ratio = (params or run.params) / run.params * (self.plan_budget.get(suites[0], 0) / meas if meas else 1.0)
            return sum(walls) * ratio * self.factor, f"{run.label} x{ratio:.2g} (params x tokens)"
        if stage in ("speed", "load"):
            if (stage, "*") not in run.walls:
                return None, f"no {stage} stage in {run.label}"
            if stage == "speed" and (by := self._speed(name, kind, nbytes, params, labels, type_elements)):
                return by[0] * self.factor, by[1]
            per = run.walls[(stage, "*")] / (run.speed_labels if stage == "speed" else run.load_variants)
            ref = self._match("score", name, kind, nbytes)
            ratio = nbytes / (run.variants[ref[0]]["bytes"] or nbytes) if ref else 1.0
            if stage == "load" and load_levels:
                if ref and (by := self._load_sweep(ref[0], nbytes, params, load_levels, type_elements)):
                    return by
                # a served level decodes: it grows with the time per decoded token (bytes read plus fixed costs)
                mrates, prates = self._rate_pair(ref[0], nbytes, params, type_elements) if ref else (None, None)
                if mrates and prates:
                    ratio = prates["decode"] / mrates["decode"]
                levels, cap = load_levels.levels, load_levels.cap
                level = per / run.load_cells * ratio * self.factor
                capped = " (capped: load.max_seconds_per_level)" if level > cap else ""
                return (min(level, cap) * levels, f"{run.label} per load level x{ratio:.2g} "
                        f"({'time per decoded token' if mrates and prates else 'bytes'}) x {levels} levels{capped}")
            return per * ratio * extra * self.factor, f"{run.label} per variant x{ratio * extra:.2g} (bytes)"
        if stage.startswith("bench:"):
            return self._bench(stage, name, kind, nbytes, params, extra, type_elements)
        found = self._match(stage, name, kind, nbytes)
        if found is None:
            return None, f"no {stage} stage of a comparable variant in {run.label}"
        other, wall = found
        via = "" if other == name else f" via {other}"
        if stage in ("evaluate", "score"):
            t = self.by_component(stage, other, wall, nbytes, None, params, builds_exact=builds_exact,
                                  types=type_elements)
            if t is not None:
                exact = " (the original's exact rows built here)" if builds_exact else ""
                return t * extra * self.factor, (f"{run.label}{via} by component{exact}"
                                                  f"{self._types_note(other, type_elements)}")
        if stage == "quantize" and other == name and params:
            f = self._factor_of(stage, name)
            if (by := quantization_by_type(run, name, wall, type_elements, nbytes, f16_bytes, f, self.quant_rates,
                                           self.threads)) is not None:
                return by[0] * extra, by[1]
            if fit := two_sizes(run, self.others, stage, name, wall, params):
                return fit[0] * extra * f, fit[1]
            # the same recipe reads and quantizes every weight: it grows with the parameters, not with the file
            # (a small model's K-quant file is larger per weight: rows not a multiple of 256 fall back to 8 bits)
            ratio = params / run.params * extra
            return wall * ratio * f, f"{run.label} x{ratio:.2g} (params)"
        ratio = nbytes / (run.variants.get(other, {}).get("bytes") or nbytes)
        if stage in ("evaluate", "score", "baseline"):
            ratio *= self._tokens()
        ratio *= extra
        return wall * ratio * self.factor, f"{run.label}{via} x{ratio:.2g}"
