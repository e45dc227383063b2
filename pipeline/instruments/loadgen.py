"""guidellm (vllm-project's load generator) against an engine's OpenAI-compatible endpoint. On an engine that serves no
repeated prompt from a cache (llama-server: ``cache_prompt=false``), the levels the knee rule cannot stop (the first
three: it needs two doublings measured; a level that completed no request, which also ends a climb, then ends it
only after the group) run in one guidellm invocation, each a benchmark of its own with its own request count; every
later level, and every level on other engines, in an invocation of its own, so the climb can end past the knee and
the server is checked idle before each. An invocation costs about 5 s of guidellm starting and exiting (measured
here against llama-server: 1/2/4 streams, 4/4/8 requests of 32 tokens, 29 s as three invocations, 21 s as one).

Per level: ``concurrency`` streams keep that many chat-completion requests in flight; the prompts are the suites'
business text, and every request of a level gets its own prompt; every invocation takes prompts no earlier one used
(guidellm starts its list again at each benchmark of one invocation, so the grouped levels share their first
prompts, which only an engine that serves no repeat from a cache is given); every request generates exactly
``output_tokens`` tokens by the engine's own request fields (its ``request_body``: llama-server's ``ignore_eos`` and
``cache_prompt=false``, transformers serve's per-request generation config). A level ends after max(min_requests,
concurrency x requests_per_stream) requests have finished (``max_requests``: no request is cancelled, the last ones
run at a lower concurrency), or at ``max_seconds`` (then in-flight requests are cancelled and reported incomplete).

guidellm reads token counts from the server's ``usage``; with a JSON-file dataset it loads no tokenizer, so it never
touches the hub (HF_HUB_OFFLINE is set for it all the same). Measured here: guidellm itself uses about half a core,
on the same machine as a CPU server it measures; each level spends a few seconds starting (not counted in the
level's window). By default it spawns a worker process per stream; one worker keeps every stream in flight and
takes a fifth less CPU (``processes``, load.generator_processes). It runs under pipeline.infra.child_processes's
process-group supervisor, so its workers die with it and with the run."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from pipeline.infra.child_processes import stop_supervised, supervised, supervised_options

log = logging.getLogger(__name__)


def guidellm_exe() -> Path:
    """guidellm's console script beside this interpreter (it is a dependency of the project)."""
    exe = Path(sys.executable).parent / "guidellm"
    if not exe.is_file():
        from pipeline.infra.errors import ConfigError

        raise ConfigError(f"guidellm is not installed beside {sys.executable}: run `make setup` (pyproject.toml "
                          "lists guidellm)")
    return exe


def guidellm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"guidellm {version('guidellm')}"
    except PackageNotFoundError:
        return "guidellm (not installed)"


# ---------------------------------------------------------------------------------------------------------------
# guidellm 0.8.1's JSON report (``--output kind=json``), per benchmark (= level)

def _get(d, path: str, where: str):
    cur = d
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise ValueError(f"guidellm report: missing {path!r} in {where} (at {part!r}); not a guidellm 0.8 JSON "
                             "report?")
        cur = cur[part]
    return cur


def _num(d, path: str, where: str) -> float:
    v = _get(d, path, where)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"guidellm report: {path!r} in {where} is {v!r}, expected a number")
    return float(v)


def parse_guidellm(report: dict) -> list[dict]:
    """One dict per level, times in seconds: concurrency, completed / errored / incomplete requests,
    output_tokens_per_s (every token streamed inside the level's window / its duration), requests_per_s,
    TTFT / ITL / end-to-end latency p50 and p99 (successful requests only; None when the level completed none:
    guidellm writes 0.0 there), duration_s, output_tokens_per_request, start_time / end_time (unix seconds)."""
    if not isinstance(report, dict) or not isinstance(report.get("benchmarks"), list):
        raise ValueError("guidellm report: expected a JSON object with a 'benchmarks' list")
    if not report["benchmarks"]:
        raise ValueError("guidellm report: 'benchmarks' is empty (no level ran)")
    rows = []
    for i, b in enumerate(report["benchmarks"]):
        where = f"benchmarks[{i}]"
        strategy = _get(b, "config.strategy", where)
        streams = strategy.get("streams") if isinstance(strategy, dict) else None
        if not isinstance(streams, int):
            raise ValueError(f"guidellm report: {where}.config.strategy has no integer 'streams' (type "
                             f"{strategy.get('type_') if isinstance(strategy, dict) else strategy!r}): run guidellm "
                             "with --profile kind=concurrent")
        m = _get(b, "metrics", where)
        mw = where + ".metrics"
        completed = int(_num(m, "request_totals.successful", mw))
        has = completed > 0

        def pct(name: str, p: str, scale: float) -> float | None:
            v = _num(m, f"{name}.successful.percentiles.{p}", mw) * scale
            return v if has else None

        rows.append({
            "concurrency": streams, "completed": completed,
            "errored": int(_num(m, "request_totals.errored", mw)),
            "incomplete": int(_num(m, "request_totals.incomplete", mw)),
            "output_tokens_per_s": _num(m, "output_tokens_per_second.total.mean", mw),
            "requests_per_s": _num(m, "requests_per_second.successful.mean", mw),
            "ttft_p50_s": pct("time_to_first_token_ms", "p50", 1e-3),
            "ttft_p99_s": pct("time_to_first_token_ms", "p99", 1e-3),
            "itl_p50_s": pct("inter_token_latency_ms", "p50", 1e-3),
            "itl_p99_s": pct("inter_token_latency_ms", "p99", 1e-3),
            "e2e_p50_s": pct("request_latency", "p50", 1.0),       # guidellm gives this one in seconds
            "e2e_p99_s": pct("request_latency", "p99", 1.0),
            "duration_s": _num(b, "duration", where),
            "output_tokens_per_request": _num(m, "output_token_count.successful.mean", mw) if has else None,
            "prompt_tokens_per_request": _num(m, "prompt_token_count.successful.mean", mw) if has else None,
            "start_time": _num(b, "start_time", where), "end_time": _num(b, "end_time", where),
        })
    return rows


# ---------------------------------------------------------------------------------------------------------------

def level_requests(levels: list[int], min_requests: int, requests_per_stream: int) -> dict[int, int]:
    """The requests each level sends: max(min_requests, concurrency x requests_per_stream)."""
    return {c: max(min_requests, c * requests_per_stream) for c in sorted(levels)}


def prompts_needed(levels: list[int], min_requests: int, requests_per_stream: int) -> int:
    """Prompts a trial draws (an upper bound: levels run in one guidellm invocation share their first ones)."""
    return sum(level_requests(levels, min_requests, requests_per_stream).values())


def level_groups(levels: list[int], grouped: int) -> list[list[int]]:
    """The guidellm invocations of a climb: the first ``grouped`` levels together, then one level each."""
    ordered = sorted(levels)
    return ([ordered[:grouped]] if ordered[:grouped] else []) + [[c] for c in ordered[grouped:]]


def run_guidellm(url: str, prompts: list[str], *, levels: list[int], output_tokens: int, request_body: dict,
                 requests_per_stream: int, min_requests: int, max_seconds: float, workdir: Path,
                 stop=None, idle=None, processes: int | None = 1, grouped: int = 1) -> list[dict]:
    """Every level in increasing order, in the guidellm runs of ``level_groups(levels, grouped)`` (see the module
    docstring); returns ``parse_guidellm``'s rows, one per level. ``grouped``: the first levels run in one
    invocation (pipeline.figures.served_load.KNEE_RULE_LEVELS for an engine that serves no repeated prompt from a cache;
    1, one invocation per level, for one that may: guidellm repeats its first prompts at each benchmark of an
    invocation). ``request_body``: the engine's fields for exactly ``output_tokens`` tokens per request
    (pipeline.servers: ``Engine.request_body``). ``prompts``: at least ``prompts_needed`` of them; level after level
    takes the next ones. ``stop(rows)``, asked before each level after the first, ends the climb early (the levels
    measured so far are returned). ``idle()``, called before each level, returns once the server has finished what an
    earlier level left running (the engine's ``wait_idle``). A level whose guidellm run fails raises with the tail of
    its log. ``processes``: guidellm's worker processes (None: its default, one per stream)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    counts = level_requests(levels, min_requests, requests_per_stream)
    if len(prompts) < sum(counts.values()):
        raise ValueError(f"run_guidellm: {len(prompts)} prompts for {sum(counts.values())} requests "
                         f"(levels {sorted(levels)}): every request needs its own prompt")
    backend = json.dumps({"kind": "openai_http", "target": url, "timeout": int(max_seconds),
                          "extras": {"body": request_body}})
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.pop("GUIDELLM__MAX_WORKER_PROCESSES", None)
    if processes is not None:
        env["GUIDELLM__MAX_WORKER_PROCESSES"] = str(processes)
    rows, start = [], 0
    data = workdir / f"prompts-{os.getpid()}.jsonl"
    try:
        for group in level_groups(list(counts), grouped):
            c, tag = group[0], "-".join(f"c{g}" for g in group)
            if rows and stop is not None and stop(rows):
                log.info("load: climb ended before concurrency %d (past the knee)", c)
                break
            if idle is not None:
                idle()
            need = max(counts[g] for g in group)     # guidellm starts the list again at each benchmark
            data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts[start:start + need]))
            start += need
            out = workdir / f"guidellm-{os.getpid()}-{tag}.json"
            errlog = workdir / f"guidellm-{tag}.log"
            cmd = [str(guidellm_exe()), "run", "--backend", backend,
                   "--profile", json.dumps({"kind": "concurrent", "streams": group}),
                   "--constraint", json.dumps({"kind": "max_requests", "count": [counts[g] for g in group]}),
                   "--constraint", f"kind=max_duration,seconds={int(max_seconds)}",
                   "--data", f"kind=json_file,path={data}", "--output", f"kind=json,path={out}",
                   "--disable-console"]
            with open(errlog, "w") as fh:
                # supervised: guidellm spawns a worker process per stream, and they must not outlive the run
                proc = subprocess.Popen(supervised(cmd), stdout=fh, stderr=subprocess.STDOUT, env=env,
                                        **supervised_options())
                try:
                    proc.wait(timeout=len(group) * max_seconds + 300)
                finally:
                    stop_supervised(proc)
            where = f"concurrency {'/'.join(map(str, group))}"
            if proc.returncode != 0 or not out.is_file():
                tail = "\n".join(errlog.read_text(errors="replace").strip().splitlines()[-8:])
                raise RuntimeError(f"guidellm failed at {where} (exit {proc.returncode}): {' '.join(cmd)}\n"
                                   f"{tail}")
            measured = parse_guidellm(json.loads(out.read_text()))
            out.unlink()
            if [r["concurrency"] for r in measured] != group:
                raise RuntimeError(f"guidellm at {where} reported the levels "
                                   f"{[r['concurrency'] for r in measured]}, not {group}")
            for level in measured:
                got = level.get("output_tokens_per_request")
                if level["completed"] and got is not None and abs(got - output_tokens) > 0.5:
                    raise RuntimeError(f"the engine at {url} generated {got:.1f} tokens per request at concurrency "
                                       f"{level['concurrency']}, not the {output_tokens} asked for: its request "
                                       f"fields {request_body} do not fix the output length")
                log.info("load: concurrency %d: %d requests, %.1f output tok/s", level["concurrency"],
                         level["completed"], level["output_tokens_per_s"])
            rows += measured
    finally:
        data.unlink(missing_ok=True)
    return rows
