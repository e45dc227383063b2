"""Prompt suites: JSONL conversations with per-turn machine checks (schema in prompts/SCHEMA.md).

Every line is validated before use, so a malformed record fails with the file, the line and the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError

CHECK_TYPES = ("contains", "not_contains", "regex", "number", "json")
MAX_TURNS = 8
_RECORD_KEYS = {"id", "category", "system", "turns", "meta"}
_TURN_KEYS = {"user", "max_new_tokens", "checks"}
_REGEX_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE}


@dataclass
class Turn:
    user: str
    max_new_tokens: int | None = None
    checks: list[dict] = field(default_factory=list)


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


def _validate_check(path: Path, line: int, where: str, check: Any) -> dict:
    if not isinstance(check, dict):
        _fail(path, line, where, f"expected an object, got {type(check).__name__}")
    ctype = check.get("type")
    if ctype not in CHECK_TYPES:
        _fail(path, line, f"{where}.type", f"unknown check type {ctype!r}: expected one of {', '.join(CHECK_TYPES)}")
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
    return check


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
        budget = t.get("max_new_tokens")
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or not 1 <= budget <= 4096):
            _fail(path, line, f"{where}.max_new_tokens", f"expected an integer in 1..4096, got {budget!r}")
        checks = t.get("checks", [])
        if not isinstance(checks, list):
            _fail(path, line, f"{where}.checks", "expected a list")
        checks = [_validate_check(path, line, f"{where}.checks[{j}]", c) for j, c in enumerate(checks)]
        turns.append(Turn(user=t["user"], max_new_tokens=budget, checks=checks))
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
    """Apply a profile: the first N conversations, each turn's budget capped."""
    chosen = convs[:max_conversations] if max_conversations else list(convs)
    out = []
    for c in chosen:
        turns = []
        for t in c.turns:
            budget = t.max_new_tokens or default_max_new_tokens
            if max_new_tokens_cap:
                budget = min(budget, max_new_tokens_cap)
            turns.append(Turn(user=t.user, max_new_tokens=budget, checks=t.checks))
        out.append(Conversation(id=c.id, suite=c.suite, turns=turns, system=c.system, category=c.category,
                                meta=c.meta))
    return out


# ---------------------------------------------------------------- checks

_NUMBER = re.compile(r"(?<![\w.])[-+]?[$€£¥]?\s?\d[\d,]*(?:\.\d+)?")


def numbers_in(text: str) -> list[float]:
    out = []
    for m in _NUMBER.finditer(text):
        token = re.sub(r"[^\d.\-+]", "", m.group())
        try:
            out.append(float(token))
        except ValueError:
            continue
    return out


def extract_json(text: str) -> Any | None:
    """The first JSON object in the text: a ```json fence first, then any balanced {...} that parses."""
    fence = re.search(r"```(?:json)?\s*(\{.*?\})\s*```", text, re.DOTALL)
    candidates = [fence.group(1)] if fence else []
    start = text.find("{")
    while start != -1:
        depth = 0
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    candidates.append(text[start:i + 1])
                    break
        start = text.find("{", start + 1)
    for cand in candidates:
        try:
            return json.loads(cand)
        except json.JSONDecodeError:
            continue
    return None


def run_check(check: dict, reply: str) -> bool:
    ctype = check["type"]
    if ctype in ("contains", "not_contains"):
        if check.get("case_sensitive"):
            found = check["value"] in reply
        else:
            found = check["value"].casefold() in reply.casefold()
        return found if ctype == "contains" else not found
    if ctype == "regex":
        flags = 0
        for f in check.get("flags", ""):
            flags |= _REGEX_FLAGS[f]
        return re.search(check["pattern"], reply, flags) is not None
    if ctype == "number":
        tol = float(check.get("tolerance", 0))
        return any(abs(n - float(check["value"])) <= tol + 1e-9 for n in numbers_in(reply))
    if ctype == "json":
        import jsonschema

        obj = extract_json(reply)
        if obj is None:
            return False
        return jsonschema.Draft202012Validator(check["schema"]).is_valid(obj)
    raise ValueError(f"unknown check type {ctype!r}")  # validated at load time


def check_label(check: dict, index: int) -> str:
    return check.get("name") or f"{check['type']}#{index}"
