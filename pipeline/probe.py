"""Speed and memory probe, run in a fresh subprocess per variant so that peak RSS belongs to that variant alone
and nothing loaded earlier in the parent (another model, a warm allocator) colours the numbers.

Protocol of one trial: load, ``warmup`` untimed generations, then ``repeats`` cold generations (cache reset)
of exactly ``decode_tokens`` tokens from a fixed ``prompt_tokens`` prompt; the trial's figures are the medians
of its repeats. Prefill (TTFT) and decode are reported separately: prefill is compute-bound, decode
memory-bound. The CPU time other processes used meanwhile is measured from /proc/stat; a noisy trial is
repeated once and flagged if still noisy. ``pipeline.speed`` runs the trials of all variants interleaved.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from pipeline.children import child_options
from pipeline.memory import device_memory, peak_rss_mb

log = logging.getLogger(__name__)


def _busy_jiffies() -> int | None:
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    values = [int(v) for v in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values[:8]) - idle


def own_cpu_s() -> float:
    """CPU seconds of this process and of its children that have been waited for."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class OtherCpu:
    """The share of the machine's CPU that other processes used during a ``with`` block: the busy time of
    /proc/stat minus our own and our waited-for children's, over wall time x cores (``share`` is None without
    procfs). The noise check of every speed figure: the probe's trials, the bandwidth, the load sweep's rounds."""

    def __enter__(self) -> "OtherCpu":
        self.share = None
        self._busy, self._ours, self._t = _busy_jiffies(), own_cpu_s(), time.time()
        return self

    def __exit__(self, *exc) -> None:
        busy, ours, wall = _busy_jiffies(), own_cpu_s(), time.time() - self._t
        if self._busy is not None and busy is not None and wall > 0:
            others = max(0.0, (busy - self._busy) / os.sysconf("SC_CLK_TCK") - (ours - self._ours))
            self.share = others / (wall * (os.cpu_count() or 1))


def _run_child(spec: dict, timeout_s: float) -> tuple[dict, float | None]:
    with tempfile.TemporaryDirectory(prefix="qd-probe-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        with OtherCpu() as other:
            proc = subprocess.run([sys.executable, "-m", "pipeline.probe", str(spec_path), str(out_path)],
                                  capture_output=True, text=True, timeout=timeout_s, **child_options())
        if proc.returncode != 0 or not out_path.is_file():
            tail = "\n".join((proc.stderr or "").strip().splitlines()[-8:])
            raise RuntimeError(f"speed probe failed (exit {proc.returncode}):\n{tail}")
        result = json.loads(out_path.read_text())
    return result, other.share


def probe_spec(cfg, variant, artifact, prompt_ids: list[int]) -> dict:
    """Everything one speed trial of this variant needs, JSON-ready (kept in the variant's result file, so the
    run-level speed stage can measure every variant in interleaved trials after the sweep)."""
    sp = cfg.profile.speed
    return {
        "runtime": variant.runtime,
        "artifact": str(artifact.path),
        "options": {**variant.runtime_options,
                    "n_ctx": ((len(prompt_ids) + sp.decode_tokens + 64 + 255) // 256) * 256},
        # the engine's decode as llama-bench times it: plain argmax, no repetition penalty (the penalty's per-token
        # numpy pass is the pipeline's, not the format's, and would only blur the comparison with llama-bench)
        "runtime_cfg": {**asdict(cfg.runtime), "repeat_penalty": 1.0},
        "trust_remote_code": cfg.model.trust_remote_code,
        "prompt_ids": prompt_ids,
        "decode_tokens": sp.decode_tokens,
        "repeats": sp.repeats,
        "warmup": sp.warmup,
    }


def run_trial(spec: dict, max_cpu_noise: float, label: str = "") -> dict:
    """One trial: a fresh process loads the variant and measures it. A trial during which other processes used
    more than ``max_cpu_noise`` of the CPU is measured once more (the quieter of the two is kept, flagged when
    still noisy)."""
    result, noise = _run_child(spec, timeout_s=3600)
    if noise is not None and noise > max_cpu_noise:
        log.warning("%s: other processes used %.0f%% of the CPU during the speed trial; measuring again",
                    label or spec["runtime"], 100 * noise)
        retry, retry_noise = _run_child(spec, timeout_s=3600)
        if retry_noise is None or retry_noise < noise:
            result, noise = retry, retry_noise
    result["cpu_noise"] = noise
    result["noisy"] = bool(noise is not None and noise > max_cpu_noise)
    return result


def probe_speed(cfg, variant, artifact, prompt_ids: list[int]) -> dict:
    """One trial of cfg.variant (``make bench``)."""
    return run_trial(probe_spec(cfg, variant, artifact, prompt_ids), cfg.profile.speed.max_cpu_noise, variant.name)


def _percentile(values: list[float], q: float) -> float | None:
    import numpy as np

    return float(np.percentile(values, q)) if values else None


def _child(spec_path: str, out_path: str) -> None:
    from pipeline.config import RuntimeConfig
    from pipeline.runtimes import runtime_class

    spec = json.loads(Path(spec_path).read_text())
    rcfg = RuntimeConfig(**spec["runtime_cfg"])
    from pipeline.memory import nvml_device_used_mb

    baseline = nvml_device_used_mb() if str(rcfg.device).startswith(("cuda", "auto")) else None
    t0 = time.perf_counter()
    rt = runtime_class(spec["runtime"])(Path(spec["artifact"]), spec["options"], rcfg, spec["trust_remote_code"])
    load_s = time.perf_counter() - t0
    prompt = spec["prompt_ids"]
    for _ in range(spec["warmup"]):
        rt.reset()
        rt.generate(prompt, min(8, spec["decode_tokens"]), [])
    ttft, decode_rates, itl = [], [], []
    for _ in range(spec["repeats"]):
        rt.reset()
        gen = rt.generate(prompt, spec["decode_tokens"], [])
        ttft.append(gen.ttft_s)
        itl += gen.decode_times_s
        if gen.decode_times_s:
            decode_rates.append(len(gen.decode_times_s) / sum(gen.decode_times_s))
    kv = rt.kv_cache_bytes()
    device = device_memory(rt.info.get("device") or rcfg.device, baseline)     # None off CUDA
    import numpy as np

    result = {
        "ttft_s": float(np.median(ttft)),
        "prefill_tokens_per_s": float(len(prompt) / np.median(ttft)),
        "decode_tokens_per_s": float(np.median(decode_rates)) if decode_rates else None,
        "itl_p50_s": _percentile(itl, 50),
        "itl_p99_s": _percentile(itl, 99),
        "prompt_tokens": len(prompt),
        "decode_tokens": spec["decode_tokens"],
        "repeats": spec["repeats"],
        "load_s": load_s,
        "peak_rss_mb": peak_rss_mb(),
        "device_peak_mb": (device or {}).get("peak_mb"),
        "device_memory": device,
        "kv_reported": kv,
        "runtime_info": rt.info,
    }
    rt.close()
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    _child(sys.argv[1], sys.argv[2])
