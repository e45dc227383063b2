"""The times of the stages a run does once per model or artifact (the F16 conversion, a quantization, the parity
check's and prepare's fixed parts), carried from a measured run to a planned model: each measured stage split into
what it does once (an interpreter's start, imports, reading the tokenizer) and what grows with the model, where
the measured runs say how. The per-variant stages (free-running, scoring, speed, load) are
``pipeline.plan.stage_rates``'s; both are used through its ``TimeModel``.
"""

from __future__ import annotations

from pipeline.plan.measured_runs import MeasuredRun


def two_sizes(run: MeasuredRun, others: list, stage: str, key: str, wall: float,
              params: int) -> tuple[float, str] | None:
    """A one-off stage (a conversion, the parity check, a quantization) at ``params`` from a fixed part and a
    part that grows with the parameters, fitted on ``run``'s wall and the same stage of another run on the same
    CPU and vocabulary whose model is at least twice smaller or larger (the one furthest in size): on a small
    model the fixed part (an interpreter's start, imports, reading the tokenizer) is most of the time, so one
    size scaled by the parameters alone over-plans a large one. The fixed part depends on the tokenizer (the
    converter reads and checks the whole vocabulary), so only runs with the same vocabulary size pair. The CPU
    is each wall's own (``MeasuredRun.cpu_of``); a prepare stage pairs only with one that prepared the same kind
    of source. None without such a run."""
    cpu = run.cpu_of(stage, key)
    pairs = [(o.params, o.walls[(stage, key)], o) for o in others
             if o is not run and cpu and o.cpu_of(stage, key) == cpu and (stage, key) in o.walls
             and o.vocab == run.vocab and max(o.params, run.params) >= 2 * min(o.params, run.params)
             and (stage != "prepare" or o.source_kind == run.source_kind)]
    if not pairs or run.params <= 0:
        return None
    size, other_wall, other = max(pairs, key=lambda p: max(p[0], run.params) / min(p[0], run.params))
    (s1, t1), (s2, t2) = sorted([(size, other_wall), (run.params, wall)])
    slope = max(0.0, (t2 - t1) / (s2 - s1))
    fixed = max(0.0, t2 - slope * s2)
    return fixed + slope * params, (f"{run.label} and {other.label}: {fixed:.1f} s fixed + "
                                    f"{slope * 1e9:.1f} s per billion parameters")


def conversion(run: MeasuredRun, wall: float, params: int, plan_vocab: int | None) -> tuple[float, str] | None:
    """The F16 conversion by its recorded phases (``MeasuredRun.convert_phases``): the converter's start and
    exit and what the stage adds around the child as they are, the vocabulary and metadata grown with the
    vocabulary, the tensors (every weight read and written) with the parameters. None without the phases."""
    ph = run.convert_phases
    if not (ph and all(ph.get(k) is not None for k in ("start", "vocabulary", "tensors", "exit"))):
        return None
    vocab = plan_vocab / run.vocab if plan_vocab and run.vocab else 1.0
    fixed = max(0.0, wall - ph["vocabulary"] - ph["tensors"])
    t = fixed + ph["vocabulary"] * vocab + ph["tensors"] * params / run.params
    return t, (f"{run.label} by phase (start and exit {fixed:.1f} s; vocabulary {ph['vocabulary']:.1f} s "
               f"x{vocab:.2g}; tensors {ph['tensors']:.1f} s x{params / run.params:.2g} with the parameters)")


def quantization_by_type(run: MeasuredRun, name: str, wall: float, planned: dict | None, nbytes: float,
                         f16_bytes: float | None, factor: float, quant_rates, threads: int) -> tuple[float, str] | None:
    """A GGUF quantization by what llama-quantize does: every weight quantized at its ggml type's cost per weight
    measured here now (``quant_rates``: ``pipeline.plan.quant_rates.seconds_per_weight``, on ``threads``
    threads), and the F16 file read and the output written at the seconds per byte the measured stage leaves for
    them (its wall less its quantization; rescaled by ``factor``). None without both files' weights per type or
    the calibration."""
    measured = run.quant_elements.get(name)
    mbytes = (run.variants.get(name) or {}).get("bytes")
    if not (measured and planned and f16_bytes and mbytes and quant_rates):
        return None
    rates = quant_rates(tuple(sorted(set(measured) | set(planned))))
    if rates is None:
        return None
    threads = max(1, int(threads))

    def compute(elements: dict) -> float:
        return sum(n * rates[t] for t, n in elements.items()) / threads

    m_f16 = (run.variants.get("gguf_f16") or {}).get("bytes") or 2 * sum(measured.values())
    per_byte = max(0.0, wall - compute(measured)) / (m_f16 + mbytes)
    quantizing, io = compute(planned), (f16_bytes + nbytes) * per_byte * factor
    return quantizing + io, (f"{run.label} by type (quantizing {quantizing:.1f} s at this CPU's seconds per "
                             f"weight of each type on {threads} thread(s); reading and writing {io:.1f} s at "
                             f"the measured stage's {per_byte * 1e9:.2f} s per GB)")
