"""The family matrix (`make families`): build every family's folder, run `make compare` on it, and write the table
(docs/families.md) from each run's own summary.json.

    python -m dev.families_matrix build [FAMILY ...]
    python -m dev.families_matrix run FAMILY --variants a,b --make-args "VENV=..."
    python -m dev.families_matrix table --out docs/families.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from dev.families import BY_NAME, FAMILIES, build_family, family
from pipeline.infra.files import atomic_write_text
from pipeline.infra.make_paths import PROJECT_ROOT

ROOT = PROJECT_ROOT / "artifacts" / "families"
RESULTS = ROOT / "results"
RUNS = ROOT / "runs"
# the variant set of CI (tests/test_families.py) and of families the time does not allow the full set for
REDUCED_VARIANTS = "original,gguf_f16,gguf_q4_k_m,gptq_w4,gguf_q8_0+kv_q8_0"


# What the reasons above come down to, each checked against the files and the converter's source
CAUSES = (
    "Mistral, GGUF variants skipped (parity KLD 0.96): llama.cpp's converter maps MistralForCausalLM to its `llama` "
    "architecture and writes no sliding window (the F16 file has no `llama.attention.sliding_window` key), so "
    "llama.cpp attends over the whole context while transformers attends over 64 tokens; every smoke prompt is "
    "longer than the window. A real Mistral 7B v0.1 (window 4,096) diverges the same way past 4,096 tokens. The "
    "pipeline's parity check catches it, as designed, and the other variants run.",
    "KV bytes per token are compared at the context each report counts: transformers' live cache after the speed "
    "probe (39 tokens, inside every window here; `tests/test_kv_layout.py` measures its cache past the window too), "
    "llama.cpp's allocation for its n_ctx (1,024 cells: Gemma 2's local layers then hold their 64-token window). "
    "Before that rule the window models were flagged (transformers' short live cache against the formula at the "
    "capacity context), and DeepSeek V2 was, because transformers 5 caches latent attention's compressed latent "
    "(kv_lora_rank + rope dims per layer), not per-head keys and values, as the formula then assumed for it.",
    "Llama 3.2 and Gemma 2 run single-turn only: their templates `trim` each message, so a reply that starts or "
    "ends with whitespace (any random model's) renders differently in the next turn's history, and the pipeline "
    "refuses to build a multi-turn token stream; Mistral's template moves the system message to the last user turn "
    "and Gemma 4's (used for Gemma 3) strips and trims earlier replies: same refusal.",
    "Qwen2-MoE is built untied, as Qwen1.5-MoE is: with tied embeddings it converts, but llama.cpp's `qwen2moe` "
    "refuses to load it (`check_tensor_dims: tensor 'output.weight' not found`), which skips the GGUF variants.",
    "Qwen2-MoE, DeepSeek V2 and Phi-3.5, gptq_w4 skipped: the checkpoint GPTQModel writes does not have the module "
    "layout this transformers builds: the experts one module per expert where transformers fuses them "
    "(`experts.gate_up_proj`, `experts.down_proj`; Qwen2-MoE's `shared_expert_gate` too), and no quantized tensors "
    "for Phi-3's fused `mlp.gate_up_proj`. transformers starts the weights it finds no tensor for from random values "
    "and only logs it; the runtime refuses such a checkpoint, naming the weights (before, Phi-3.5's gptq_w4 ran and "
    "failed with `IndexError: index 2140143488 is out of bounds`, from random group indices).",
    "DeepSeek V2, GGUF variants skipped: llama.cpp aborts loading the F16 file's vocabulary "
    "(`GGML_ASSERT(id_to_token.size() == token_to_id.size())` in llama-vocab.cpp: two ids share one token text in "
    "the written file); the vocabulary is loaded in a child process first, so the abort costs the GGUF variants "
    "only. Where the tokenizer builder's restored DeepSeek special tokens collide is not located. Without a query "
    "rank (`q_lora_rank=None`, as V2-Lite) llama.cpp loads the file only at 27 layers (its test for V2-Lite).",
    "Gemma 3, GGUF variants skipped (parity KLD 0.073): llama.cpp's Gemma 3 converter writes no sliding-window "
    "pattern (the F16 file has `gemma3.attention.sliding_window` but no `sliding_window_pattern`), so llama.cpp "
    "applies its built-in Gemma 3 pattern (five local layers to one global) and treats both layers of this "
    "two-layer model as local, while transformers keeps layer 1 global as `layer_types` says. A real Gemma 3 has "
    "the built-in pattern; a family model with six layers in that pattern would pass.",
    "Phi-3.5: the pipeline warns that the GGUF tokenizer (llama.cpp's SentencePiece path, pre-tokenizer `default`) "
    "splits 4 of 22 suite texts differently from the HF tokenizer, although both reproduce the vocab file's 46 "
    "reference tokenizations; every runtime is fed the HF ids, so the drift figures are unaffected. Not located.",
)


def model_name(name: str) -> str:
    return f"family-{name}"


def run_family(name: str, variants: str, make_args: list[str]) -> dict:
    """`make compare` on the family's folder (built first), single-turn only where the template refuses multi-turn
    conversations; the record (wall time, exit status, suites, why) goes to artifacts/families/runs/NAME.json."""
    fam = family(name)
    facts = build_family(fam, ROOT / name)
    suites = "long_output" if facts["multi_turn_refusal"] else "long_output,multi_turn"
    args = " ".join([f"model.name={model_name(name)}", f"paths.results={RESULTS}", *fam.overrides])
    cmd = ["make", "--no-print-directory", "compare", f"MODEL={ROOT / name}", "PROFILE=smoke",
           f"VARIANTS={variants}", f"SUITES={suites}", f"ARGS={args}", *make_args]
    start, commit = time.monotonic(), _commit()
    log_path = RUNS / f"{name}.log"
    RUNS.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        # `make compare` stops after a sweep with a refused job (exit 2), before its report: summarize the jobs
        # that did finish, so every variant still gets a row
        report = ["make", "--no-print-directory", "report", *cmd[3:]]
        with open(log_path, "a") as log:
            subprocess.run(report, cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT)
    record = {"family": name, "commit": commit, "variants": variants.split(","), "suites": suites.split(","),
              "exit_status": rc,
              "wall_s": round(time.monotonic() - start, 1), "log": str(log_path.relative_to(PROJECT_ROOT)),
              "suites_reason": facts["multi_turn_refusal"], "overrides": list(fam.overrides), "make": cmd,
              "job_errors": job_errors(log_path.read_text(errors="replace"))}
    atomic_write_text(RUNS / f"{name}.json", json.dumps(record, indent=1))
    return record


def job_errors(log_text: str) -> dict[str, str]:
    """variant -> the error its Hydra job stopped with (`error: ...` after its `#N : variant=...` line), with the
    line of the tool's own log that names the cause where the message quotes one."""
    import re

    errors, current, lines = {}, None, log_text.splitlines()
    for i, line in enumerate(lines):
        if m := re.search(r"\[HYDRA\]\s+#\d+ : variant=(\S+)", line):
            current = m.group(1)
        elif line.startswith("error: ") and current and current not in errors:
            text = line[len("error: "):].strip()
            tail = []
            for nxt in lines[i + 1:i + 12]:
                if nxt.startswith(("[", "error: ", "make")):
                    break
                tail.append(nxt.strip())
            cause = [t for t in tail if "error" in t.lower()]
            errors[current] = text + (" " + cause[-1] if cause else "")
    return errors


def summary_of(name: str) -> dict | None:
    path = RESULTS / model_name(name) / "smoke" / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


# ---- the table -------------------------------------------------------------------------------------------------

def _machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return f"{cpu}, {os.cpu_count()} cores (shared with other work while it ran)"


def _commit() -> str:
    """The commit a family runs at, marked where tracked files differ from it."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=PROJECT_ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PROJECT_ROOT,
                           capture_output=True, text=True).stdout.strip()
    return commit + (" with uncommitted changes" if dirty else "")


def _kv_cell(summary: dict) -> str:
    """KV bytes per token by the architecture's formula against each runtime's own report, at the context the report
    counts (llama.cpp: its n_ctx cells; transformers: the tokens its live cache holds): llama.cpp
    on the F16 file (an f16 cache) and transformers on the original, plus which ok variants the pipeline flagged
    (gap over 10 %)."""
    variants = summary["variants"]
    parts = []
    for name, label in (("gguf_f16", "llama.cpp F16"), ("original", "transformers")):
        v = variants.get(name) or {}
        m = v.get("memory") or {}
        if v.get("status") == "ok" and m.get("kv_bytes_per_token_reported") is not None:
            formula = m.get("kv_formula_at_report") or m["kv_bytes_per_token"]
            at = f" at {m['kv_report_context']:,} tokens" if m.get("kv_report_context") else ""
            parts.append(f"{label}: {formula:,.0f} vs {m['kv_bytes_per_token_reported']:,.0f}{at} "
                         f"({m['kv_formula_gap']:+.1%})")
        else:
            parts.append(f"{label}: no report ({name} not ok)")
    flagged = [n for n, x in variants.items()
               if x.get("status") == "ok" and (x.get("memory") or {}).get("kv_gap_flagged")]
    return "; ".join(parts) + (f"; flagged over 10 %: {', '.join(flagged)}" if flagged else "")


def _status(v: dict | None, job_error: str | None) -> tuple[str, str | None]:
    if job_error:           # the job itself refused (exit 2): its own message is the reason
        return "refused", job_error
    if v is None:
        return "not run", None
    if v.get("status") == "ok":
        return "ok", None
    return v.get("status", "?"), str(v.get("reason") or v.get("error") or "no reason recorded")


def _variant_sets() -> str:
    """Which variant set each family ran: the default set where the time allowed, the reduced one elsewhere."""
    sets: dict[str, list[str]] = {}
    for fam in FAMILIES:
        run_path = RUNS / f"{fam.name}.json"
        if run_path.is_file():
            sets.setdefault(",".join(json.loads(run_path.read_text())["variants"]), []).append(fam.title)
    if not sets:
        return "No family has been run yet."
    return "Variant sets: " + "; ".join(
        f"`{v}`{' (the reduced set of the CI test)' if v == REDUCED_VARIANTS else ''} for {', '.join(t)}"
        for v, t in sets.items()) + "."


def table(out: Path) -> str:
    all_variants: list[str] = []
    rows, matrix, reasons = [], [], []
    for fam in FAMILIES:
        facts_path = ROOT / fam.name / "family.json"
        facts = json.loads(facts_path.read_text()) if facts_path.is_file() else {}
        run_path = RUNS / f"{fam.name}.json"
        run = json.loads(run_path.read_text()) if run_path.is_file() else None
        summary = summary_of(fam.name) if run else None
        tok = facts.get("tokenizer") or {}
        tok_cell = (f"`{fam.vocab}`: {tok['agree']}/{tok['cases']} reference tokenizations"
                    + (f" (differs on {', '.join(repr(t) for t in tok['disagree'])})" if tok.get("disagree") else "")
                    if tok else f"`{fam.vocab}`: not built")
        spm = facts.get("tokenizer_model")
        if spm:
            tok_cell += f"; tokenizer.model through SentencePiece: {spm['agree']}/{spm['cases']}"
        if fam.tokenizer_note:
            tok_cell += f"; {fam.tokenizer_note}"
        role = {"native": "system role rendered", "rejected": "template raises on a system message: folded into "
                "the first user turn", "dropped": "template drops the system message: folded into the first user "
                "turn"}.get(facts.get("system_role"), "?")
        suites = ", ".join(run["suites"]) if run else "not run"
        if run and run.get("suites_reason"):
            suites += " (multi-turn refused by the pipeline: the template rewrites earlier turns)"
        wall = f"{run['wall_s'] / 60:.1f} min" if run else "–"
        extra = [a for a in (run or {}).get("make", []) if a.startswith("LOAD_ARGS=") and a != "LOAD_ARGS="]
        if extra:
            wall += f" (served-load sweep with `{extra[0]}`)"
        if run:
            wall += f"; at {run.get('commit') or 'an unrecorded commit'}"
        if run and run.get("overrides"):
            suites += "; " + ", ".join(f"`{o}`" for o in run["overrides"])
        kv = _kv_cell(summary) if summary else "–"
        rows.append([f"{fam.title} (`{fam.model_class}`)", fam.features, f"{facts.get('params', 0) / 1e6:.1f} M",
                     tok_cell, f"`{fam.template}`; {role}", suites, kv, wall])
        statuses = {}
        for name in (run or {}).get("variants", []):
            if name not in all_variants:
                all_variants.append(name)
            status, reason = _status((summary or {}).get("variants", {}).get(name) if summary else None,
                                     (run.get("job_errors") or {}).get(name))
            if reason and reason.startswith("not evaluated") and run["exit_status"] != 0:
                reason = (f"not evaluated: the sweep stopped before this variant's job finished (make exit "
                          f"{run['exit_status']}); the cause is in {run['log']} and under Causes below")
            if reason:
                if reason not in reasons:
                    reasons.append(reason)
                status += f" [{reasons.index(reason) + 1}]"
            statuses[name] = status
        matrix.append((fam.title, statuses))
    head = ["family", "architecture features", "params", "tokenizer (llama.cpp .inp/.out)", "chat template",
            "suites", "KV bytes/token: formula vs runtime report (gap)", "wall time; commit"]
    lines = [
        "# Family matrix", "",
        "Small random models of each family (transformers config class, hidden 256, 2 layers, the family's real "
        "tokenizer from llama.cpp's vocab files, its published chat template from llama.cpp's `models/templates/`), run "
        "through `make compare PROFILE=smoke` by `make families`. Random weights: the matrix says whether every "
        "variant's path works on the architecture, not how a trained model of the family quantizes. Regenerate "
        "with `make families`; the builder is `dev/families.py`.", "",
        f"Machine: {_machine()}; each row's wall-time cell names the commit its family ran at.", "",
        _variant_sets(), "",
        "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
        *("| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows), "",
        "## Variants", "",
        "| family | " + " | ".join(f"`{v}`" for v in all_variants) + " |", "|---|" + "---|" * len(all_variants),
        *("| " + t + " | " + " | ".join(s.get(v, "not in set" if s else "not run") for v in all_variants) + " |"
          for t, s in matrix),
        "",
    ]
    if reasons:
        lines += ["Reasons: a skipped or failed variant's reason from the run's summary.json; a refused job's own "
                  "error message (the job exits 2 and writes no result) from the run's log:", ""]
        lines += [f"{i}. {r.replace(chr(10), ' ')}" for i, r in enumerate(reasons, 1)] + [""]
    lines += ["## Causes, checked by hand at this llama.cpp revision", ""]
    lines += [f"- {cause}" for cause in CAUSES] + [""]
    text = "\n".join(lines)
    atomic_write_text(out, text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dev.families_matrix")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("families", nargs="*")
    r = sub.add_parser("run")
    r.add_argument("family", choices=sorted(BY_NAME))
    r.add_argument("--variants", required=True)
    r.add_argument("--make-args", default="")
    t = sub.add_parser("table")
    t.add_argument("--out", type=Path, default=PROJECT_ROOT / "docs" / "families.md")
    a = p.parse_args(argv)
    if a.cmd == "build":
        for name in a.families or [f.name for f in FAMILIES]:
            facts = build_family(family(name), ROOT / name)
            print(name, json.dumps({k: v for k, v in facts.items() if k != "spec"}, ensure_ascii=False))
    elif a.cmd == "run":
        rec = run_family(a.family, a.variants, a.make_args.split())
        print(json.dumps({k: rec[k] for k in ("family", "exit_status", "wall_s", "suites")}))
    else:
        table(a.out)
        print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
