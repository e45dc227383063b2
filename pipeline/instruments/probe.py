"""Speed and memory probe, run in a subprocess of its own per variant (``ProbeWorker``) so that peak RSS belongs to
that variant alone and nothing loaded in the parent (another model, a warm allocator) colours the numbers.

Protocol of one trial: ``warmup`` untimed generations, then ``repeats`` cold generations (cache reset) of exactly
``decode_tokens`` tokens from a fixed ``prompt_tokens`` prompt, on the variant the worker loaded once; the
trial's figures are the medians of its repeats. Prefill (TTFT) and decode are reported separately: prefill is
compute-bound, decode memory-bound. The CPU time other processes used meanwhile is measured from /proc/stat; a
noisy trial is repeated once and flagged if still noisy. ``pipeline.stages.speed`` runs the trials of all variants
interleaved.
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

from pipeline.infra.child_processes import child_options
from pipeline.infra.stage_memory import reset_peak_rss, status_mb
from pipeline.instruments.memory import device_memory, peak_rss_mb

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


class ProbeWorker:
    """One variant's speed probe in a process of its own that lives for the speed stage: it loads the variant once,
    then measures one trial per request, so rounds of interleaved trials cost the trials, not a fresh import of
    torch and a model load each (about 15 s of a transformers trial's 20 on two CPU cores). The process holds
    nothing but this variant, so its peak RSS is the variant's own, as a fresh process per trial had it. Requests
    and answers are JSON lines on two pipes of their own (libraries may print to stdout); the child's output goes
    to a file whose tail is quoted on failure. Stopped by ``close`` and, if the run dies, by the parent-death
    signal (``pipeline.infra.child_processes``)."""

    def __init__(self, spec: dict, label: str = "", timeout_s: float = 3600):
        self.label, self.timeout_s = label or spec["runtime"], timeout_s
        self._log = tempfile.NamedTemporaryFile(prefix="qd-probe-", suffix=".log", delete=False)
        req_r, self._req = os.pipe()
        self._res, res_w = os.pipe()
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.instruments.probe", str(req_r), str(res_w)],
                                         pass_fds=(req_r, res_w), stdin=subprocess.DEVNULL, stdout=self._log,
                                         stderr=subprocess.STDOUT, **child_options())
        finally:
            os.close(req_r)
            os.close(res_w)
        self._pending = b""
        self._loaded = False
        self._send({"spec": spec})

    def _send(self, message: dict) -> None:
        try:
            os.write(self._req, (json.dumps(message) + "\n").encode())
        except BrokenPipeError:
            self.proc.wait(timeout=30)
            raise RuntimeError(f"speed probe failed (exit {self.proc.returncode}):\n{self._tail()}") from None

    def _receive(self) -> dict:
        import select

        deadline = time.monotonic() + self.timeout_s
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._res], [], [], left)[0]:
                raise RuntimeError(f"speed probe of {self.label} gave no answer in {self.timeout_s:.0f} s")
            chunk = os.read(self._res, 1 << 16)
            if not chunk:
                self.proc.wait(timeout=30)
                raise RuntimeError(f"speed probe failed (exit {self.proc.returncode}):\n{self._tail()}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"speed probe failed: {answer['error']}\n{self._tail()}")
        return answer["result"]

    def _tail(self) -> str:
        try:
            return "\n".join(Path(self._log.name).read_text(errors="replace").strip().splitlines()[-8:])
        except OSError:
            return ""

    def trial(self) -> tuple[dict, float | None]:
        """One trial: (figures, share of the CPU other processes used while it ran)."""
        if not self._loaded:             # the answer to the spec: loaded, or why not
            self._receive()
            self._loaded = True
        self._send({"trial": True})
        result = self._receive()
        return result, result.pop("other_cpu")

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                try:
                    self._send({"exit": True})
                    self.proc.wait(timeout=30)
                except (OSError, subprocess.TimeoutExpired):
                    self.proc.kill()
                    self.proc.wait()
        finally:
            for fd in (self._req, self._res):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._log.close()
            Path(self._log.name).unlink(missing_ok=True)

    def __enter__(self) -> "ProbeWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


def run_trial(spec: dict, max_cpu_noise: float, label: str = "", worker: ProbeWorker | None = None) -> dict:
    """One trial, by ``worker`` (kept for later trials) or by a fresh process. A trial during which other
    processes used more than ``max_cpu_noise`` of the CPU is measured once more (the quieter of the two is kept,
    flagged when still noisy)."""
    if worker is None:
        with ProbeWorker(spec, label) as fresh:
            return run_trial(spec, max_cpu_noise, label, fresh)
    result, noise = worker.trial()
    if noise is not None and noise > max_cpu_noise:
        log.warning("%s: other processes used %.0f%% of the CPU during the speed trial; measuring again",
                    label or spec["runtime"], 100 * noise)
        retry, retry_noise = worker.trial()
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


def _load(spec: dict):
    from pipeline.config.schema import RuntimeConfig
    from pipeline.instruments.memory import nvml_device_used_mb
    from pipeline.runtimes import runtime_class

    rcfg = RuntimeConfig(**spec["runtime_cfg"])
    baseline = nvml_device_used_mb() if str(rcfg.device).startswith(("cuda", "auto")) else None
    t0 = time.perf_counter()
    rt = runtime_class(spec["runtime"])(Path(spec["artifact"]), spec["options"], rcfg, spec["trust_remote_code"])
    # the memory of the load itself, apart from any trial's: its transient peak and what stays resident after it
    rt.load_memory = {"load_peak_rss_mb": peak_rss_mb(), "steady_rss_mb": status_mb("VmRSS")}
    return rt, rcfg, baseline, time.perf_counter() - t0


def _measure(rt, rcfg, spec: dict, baseline, load_s: float) -> dict:
    """One trial on a loaded runtime: ``warmup`` untimed generations, then ``repeats`` cold ones (cache reset). Its
    peak RSS is this trial's (the high-water mark reset first); the load's peak and the resident size after the
    load are reported beside it."""
    import numpy as np

    prompt = spec["prompt_ids"]
    # this trial's own peak: the high-water mark restarts here, so every trial reads its own (a process kept for
    # all rounds would otherwise report the same highest peak, its load's, in every trial)
    per_trial = reset_peak_rss()
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
    return {
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
        # what the peak covers: this trial alone, or (the kernel refused the reset) the process's life so far
        "peak_rss_per_trial": per_trial,
        **getattr(rt, "load_memory", {}),
        "device_peak_mb": (device or {}).get("peak_mb"),
        "device_memory": device,
        "kv_reported": kv,
        "runtime_info": rt.info,
        # whether this probe process has torch loaded (a llama.cpp probe must not: two CUDA runtimes in one process)
        "torch_loaded": "torch" in sys.modules,
    }


def _serve(req_fd: int, res_fd: int) -> None:
    """The worker's loop: the first request carries the spec (load it), then one answer per trial request."""
    import traceback

    loaded = None
    with os.fdopen(req_fd, "r") as requests, os.fdopen(res_fd, "w") as answers:
        for line in requests:
            message = json.loads(line)
            if message.get("exit"):
                break
            try:
                if "spec" in message:
                    spec = message["spec"]
                    loaded = _load(spec)
                    answers.write(json.dumps({"result": {"load_s": loaded[3]}}) + "\n")
                    answers.flush()
                    continue
                rt, rcfg, baseline, load_s = loaded
                with OtherCpu() as other:
                    result = _measure(rt, rcfg, spec, baseline, load_s)
                answer = {"result": {**result, "other_cpu": other.share}}
            except Exception as exc:     # reported to the parent, which records the trial as failed
                answer = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"}
                if loaded is None:
                    answers.write(json.dumps(answer) + "\n")
                    answers.flush()
                    return
            answers.write(json.dumps(answer) + "\n")
            answers.flush()
    if loaded is not None:
        loaded[0].close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    _serve(int(sys.argv[1]), int(sys.argv[2]))
