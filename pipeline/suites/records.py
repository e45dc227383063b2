"""Prompt suites: JSONL conversations with per-turn machine checks (schema in prompts/SCHEMA.md).

Every line is validated before use, so a malformed record fails with the file, the line and the field. What a check
means (how a reply passes it) is ``pipeline.suites.checks``."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.infra.errors import ConfigError
from pipeline.suites.checks import (CHECK_TYPES, FORMAT_KINDS, GRADES, LENGTH_UNITS, NO_LOOP_MAX_REPEATED, NO_LOOP_N,
                                    _REGEX_FLAGS, check_label, literal_in)
from pipeline.suites.language import _STOPWORDS

log = logging.getLogger(__name__)
MAX_TURNS = 8
_RECORD_KEYS = {"id", "category", "system", "turns", "meta"}
_TURN_KEYS = {"user", "max_new_tokens", "min_new_tokens", "checks"}


@dataclass
class Turn:
    user: str
    max_new_tokens: int | None = None
    checks: list[dict] = field(default_factory=list)
    # The fewest tokens a correct reply needs to reach what its checks look for (a JSON object, a fact in the last
    # requested section): a profile's cap never cuts the budget below it, so no check is failed by the cap alone.
    min_new_tokens: int | None = None


@dataclass
class Conversation:
    id: str
    suite: str
    turns: list[Turn]
    system: str | None = None
    category: str = ""
    # Free-form facts about the record that scoring groups by (e.g. a recall document's length and depth).
    meta: dict = field(default_factory=dict)


class PromptError(ConfigError):
    pass


def _fail(path: Path, line: int, fld: str, msg: str) -> None:
    raise PromptError(f"{path}:{line}: field '{fld}': {msg}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tokens(path: Path, line: int, fld: str, value: Any) -> None:
    """A token count (a reply budget, its floor, a check's reach): an integer in 1..4096."""
    if not (_is_int(value) and 1 <= value <= 4096):
        _fail(path, line, fld, f"expected an integer in 1..4096, got {value!r}")


def _validate_check(path: Path, line: int, where: str, check: Any, user: str | None = None) -> dict:
    """``user``: the turn's user message, which an ``echo`` check's literals must come from."""
    if not isinstance(check, dict):
        _fail(path, line, where, f"expected an object, got {type(check).__name__}")
    ctype = check.get("type")
    if ctype not in CHECK_TYPES:
        _fail(path, line, f"{where}.type", f"unknown check type {ctype!r}: expected one of {', '.join(CHECK_TYPES)}")
    if "name" in check and (not isinstance(check["name"], str) or not check["name"].strip()):
        _fail(path, line, f"{where}.name", "expected a non-empty string or absent")
    if "grade" in check and check["grade"] not in GRADES:
        _fail(path, line, f"{where}.grade", f"expected one of {', '.join(GRADES)}, got {check['grade']!r}")
    if "needs_tokens" in check:
        _tokens(path, line, f"{where}.needs_tokens", check["needs_tokens"])
    if ctype in ("contains", "not_contains"):
        if not isinstance(check.get("value"), str) or not check["value"]:
            _fail(path, line, f"{where}.value", "expected a non-empty string")
    elif ctype == "regex":
        if not isinstance(check.get("pattern"), str):
            _fail(path, line, f"{where}.pattern", "expected a string")
        flags = check.get("flags", "")
        if not isinstance(flags, str) or any(f not in _REGEX_FLAGS for f in flags):
            _fail(path, line, f"{where}.flags", f"expected letters from 'imsx', got {flags!r}")
        try:
            re.compile(check["pattern"])
        except re.error as exc:
            _fail(path, line, f"{where}.pattern", f"invalid regular expression: {exc}")
    elif ctype == "number":
        if not isinstance(check.get("value"), (int, float)) or isinstance(check.get("value"), bool):
            _fail(path, line, f"{where}.value", "expected a number")
        tol = check.get("tolerance", 0)
        if not isinstance(tol, (int, float)) or tol < 0:
            _fail(path, line, f"{where}.tolerance", "expected a non-negative number")
    elif ctype == "json":
        schema = check.get("schema")
        if not isinstance(schema, dict):
            _fail(path, line, f"{where}.schema", "expected a JSON Schema object")
        import jsonschema

        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            _fail(path, line, f"{where}.schema", f"not a valid JSON Schema: {exc.message}")
    elif ctype == "echo":
        _validate_echo(path, line, where, check, user)
    elif ctype == "sections":
        values = check.get("values")
        if not isinstance(values, list) or not values or not all(isinstance(v, str) and v.strip() for v in values):
            _fail(path, line, f"{where}.values",
                  "expected a non-empty list of non-empty strings (the headings asked for)")
        if "min" in check and (not _is_int(check["min"]) or not 1 <= check["min"] <= len(values)):
            _fail(path, line, f"{where}.min", f"expected an integer in 1..{len(values)}, got {check['min']!r}")
        if user is not None:
            for v in values:
                if not literal_in(v, user):
                    _fail(path, line, f"{where}.values", f"{v!r} does not occur in this turn's user message (a "
                                                         "sections check looks for headings the turn asks for)")
    elif ctype == "format":
        if check.get("kind") not in FORMAT_KINDS:
            _fail(path, line, f"{where}.kind", f"expected one of {', '.join(FORMAT_KINDS)}, got {check.get('kind')!r}")
    elif ctype == "length":
        unit = check.get("unit")
        if unit not in LENGTH_UNITS:
            _fail(path, line, f"{where}.unit", f"expected one of {', '.join(LENGTH_UNITS)}, got {unit!r}")
        for bound in ("min", "max"):
            if bound in check and (not _is_int(check[bound]) or check[bound] < 0):
                _fail(path, line, f"{where}.{bound}", f"expected a non-negative integer, got {check[bound]!r}")
        if "min" not in check and "max" not in check:
            _fail(path, line, f"{where}.max", "expected 'min', 'max' or both")
        if "min" in check and "max" in check and check["min"] > check["max"]:
            _fail(path, line, f"{where}.min", f"min {check['min']} is above max {check['max']}")
    elif ctype == "language":
        if check.get("value") not in _STOPWORDS:
            _fail(path, line, f"{where}.value", f"expected a language code, one of {', '.join(_STOPWORDS)}, "
                                                f"got {check.get('value')!r}")
    elif ctype == "no_loop":
        n = check.get("n", NO_LOOP_N)
        if not _is_int(n) or not 2 <= n <= 20:
            _fail(path, line, f"{where}.n", f"expected an integer in 2..20, got {n!r}")
        ratio = check.get("max_repeated", NO_LOOP_MAX_REPEATED)
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 < ratio < 1:
            _fail(path, line, f"{where}.max_repeated", f"expected a fraction between 0 and 1, got {ratio!r}")
    return check


def _validate_echo(path: Path, line: int, where: str, check: dict, user: str | None) -> None:
    if ("value" in check) == ("values" in check):
        _fail(path, line, f"{where}.value", "expected either 'value' (a string) or 'values' (a list of strings)")
    if "value" in check:
        if not isinstance(check["value"], str) or not check["value"].strip():
            _fail(path, line, f"{where}.value", "expected a non-empty string")
        if "min" in check:
            _fail(path, line, f"{where}.min", "only allowed with 'values'")
        values, fld = [check["value"]], "value"
    else:
        values = check["values"]
        if not isinstance(values, list) or not values or not all(isinstance(v, str) and v.strip() for v in values):
            _fail(path, line, f"{where}.values", "expected a non-empty list of non-empty strings")
        if "min" in check and (not _is_int(check["min"]) or not 1 <= check["min"] <= len(values)):
            _fail(path, line, f"{where}.min", f"expected an integer in 1..{len(values)}, got {check['min']!r}")
        fld = "values"
    if user is not None:
        for v in values:
            if not literal_in(v, user, check.get("case_sensitive", False)):
                _fail(path, line, f"{where}.{fld}", f"{v!r} does not occur in this turn's user message (an echo "
                                                    "check repeats a literal given in the same turn)")


def parse_record(path: Path, line: int, raw: Any, suite: str) -> Conversation:
    if not isinstance(raw, dict):
        _fail(path, line, "<record>", f"expected a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _RECORD_KEYS)
    if unknown:
        _fail(path, line, unknown[0], f"unknown field: expected only {', '.join(sorted(_RECORD_KEYS))}")
    cid = raw.get("id")
    if not isinstance(cid, str) or not cid:
        _fail(path, line, "id", "expected a non-empty string")
    meta = raw.get("meta", {})
    if not isinstance(meta, dict):
        _fail(path, line, "meta", "expected an object or absent")
    system = raw.get("system")
    if system is not None and not isinstance(system, str):
        _fail(path, line, "system", "expected a string or absent")
    turns_raw = raw.get("turns")
    if not isinstance(turns_raw, list) or not 1 <= len(turns_raw) <= MAX_TURNS:
        _fail(path, line, "turns", f"expected a list of 1..{MAX_TURNS} turns")
    turns = []
    for i, t in enumerate(turns_raw):
        where = f"turns[{i}]"
        if not isinstance(t, dict):
            _fail(path, line, where, "expected an object with 'user'")
        extra = sorted(set(t) - _TURN_KEYS)
        if extra:
            _fail(path, line, f"{where}.{extra[0]}", f"unknown field: expected only {', '.join(sorted(_TURN_KEYS))}")
        if not isinstance(t.get("user"), str) or not t["user"].strip():
            _fail(path, line, f"{where}.user", "expected a non-empty string")
        budget, floor = t.get("max_new_tokens"), t.get("min_new_tokens")
        for name, value in (("max_new_tokens", budget), ("min_new_tokens", floor)):
            if value is not None:
                _tokens(path, line, f"{where}.{name}", value)
        if floor is not None and budget is not None and floor > budget:
            _fail(path, line, f"{where}.min_new_tokens", f"expected at most the turn's max_new_tokens ({budget}), "
                  f"got {floor}")
        checks = t.get("checks", [])
        if not isinstance(checks, list):
            _fail(path, line, f"{where}.checks", "expected a list")
        checks = [_validate_check(path, line, f"{where}.checks[{j}]", c, t["user"]) for j, c in enumerate(checks)]
        turns.append(Turn(user=t["user"], max_new_tokens=budget, checks=checks, min_new_tokens=floor))
    return Conversation(id=cid, suite=suite, turns=turns, system=system, category=str(raw.get("category", "")),
                        meta=meta)


def iter_jsonl(path: Path):
    """(line number, parsed object) for every non-blank line; invalid JSON fails naming file, line and column."""
    with open(path, encoding="utf-8") as fh:
        for lineno, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            try:
                yield lineno, json.loads(text)
            except json.JSONDecodeError as exc:
                raise PromptError(f"{path}:{lineno}: invalid JSON: {exc.msg} (column {exc.colno})") from None


def load_suite(name: str, path: str | Path) -> list[Conversation]:
    """Load and validate a suite file. Raises PromptError naming file, line and field."""
    path = Path(path)
    if not path.is_file():
        raise PromptError(f"suite '{name}': file {path} does not exist (expected a JSONL file, see prompts/SCHEMA.md)")
    convs: list[Conversation] = []
    seen: dict[str, int] = {}
    for lineno, raw in iter_jsonl(path):
        conv = parse_record(path, lineno, raw, name)
        if conv.id in seen:
            _fail(path, lineno, "id", f"duplicate id {conv.id!r} (first on line {seen[conv.id]})")
        seen[conv.id] = lineno
        convs.append(conv)
    if not convs:
        raise PromptError(f"suite '{name}': {path} holds no records (expected at least one conversation)")
    _cross_check_with_datasets(path, len(convs))
    return convs


def _cross_check_with_datasets(path: Path, n: int) -> None:
    """Read the file through `datasets` too, so a suite that our loader accepts also works for users who feed
    suites to `datasets`-based tooling. Arrow cannot unify free-form check fields (a check's `value` is a string
    in one record and a number in another), so the file is read line-wise as text and counted."""
    from datasets import load_dataset

    ds = load_dataset("text", data_files=str(path), split="train")
    rows = sum(1 for r in ds if r["text"].strip())
    if rows != n:  # pragma: no cover - both read the same file
        raise PromptError(f"{path}: datasets read {rows} records but the validator read {n}")


def select(convs: list[Conversation], max_conversations: int | None, max_new_tokens_cap: int | None,
           default_max_new_tokens: int = 512) -> list[Conversation]:
    """Apply a profile: the first N conversations, each turn's budget capped, never below the turn's own
    ``min_new_tokens`` (what a correct reply needs to reach its checks). A check whose ``needs_tokens`` (how far
    into a correct reply what it looks for comes) lies beyond the capped budget is not scored under this profile:
    no reply could pass it, so it would only lower every variant's pass rate alike."""
    chosen = convs[:max_conversations] if max_conversations else list(convs)
    out = []
    for c in chosen:
        turns = []
        for t in c.turns:
            budget = t.max_new_tokens or default_max_new_tokens
            if max_new_tokens_cap:
                budget = max(min(budget, max_new_tokens_cap), min(t.min_new_tokens or 0, budget))
            checks = [ch for ch in t.checks if ch.get("needs_tokens", 0) <= budget]
            beyond = [check_label(ch, i) for i, ch in enumerate(t.checks) if ch.get("needs_tokens", 0) > budget]
            if beyond:
                log.info("%s: %d check(s) need more than this profile's %d-token budget and are not scored: %s", c.id,
                         len(beyond), budget, ", ".join(beyond))
            turns.append(Turn(user=t.user, max_new_tokens=budget, checks=checks, min_new_tokens=t.min_new_tokens))
        out.append(Conversation(id=c.id, suite=c.suite, turns=turns, system=c.system, category=c.category,
                                meta=c.meta))
    return out


def generation_fingerprint(convs: list[Conversation]) -> str:
    """What free-running replies to these conversations depend on: their ids, system prompts, user turns and reply
    budgets, never their checks (a changed check re-scores replies, it never regenerates one)."""
    from pipeline.infra.files import stable_hash

    return stable_hash([{"id": c.id, "system": c.system, "turns": [[t.user, t.max_new_tokens] for t in c.turns]}
                        for c in convs])


def checks_fingerprint(convs: list[Conversation]) -> str:
    """What a suite's pass and flip rates are measured on: the selected conversations as the profile cut them (their
    turns, reply budgets and checks) and the version of the code that applies the checks. Two runs with the same
    fingerprint asked and checked the same; the nightly gate compares pass and flip rates only then."""
    from pipeline.infra.code_version import code_version
    from pipeline.infra.files import stable_hash

    return stable_hash({"conversations": convs,
                        "code": code_version("pipeline.suites.checks", "pipeline.suites.language")})


def probe_prompt(renderer, suites: dict, n_tokens: int) -> list[int]:
    """A fixed business prompt of exactly n_tokens for the speed probe (same ids for every variant)."""
    texts = [t.user for convs in suites.values() for c in convs for t in c.turns]
    ids: list[int] = []
    while len(ids) < n_tokens:
        for text in texts:
            ids += renderer.encode(text + "\n\n")
            if len(ids) >= n_tokens:
                break
    return ids[:n_tokens]
