import json

import pytest

from pipeline.config import PROJECT_ROOT
from pipeline.prompts import PromptError, extract_json, load_suite, numbers_in, run_check, select


@pytest.mark.parametrize("suite,min_records,turns", [("long_output", 8, (1, 1)), ("multi_turn", 8, (4, 8)),
                                                      ("smoke", 2, (1, 2))])
def test_shipped_suites_load_and_meet_their_shape(suite, min_records, turns):
    convs = load_suite(suite, PROJECT_ROOT / "prompts" / f"{suite}.jsonl")
    assert len(convs) >= min_records
    for c in convs:
        assert turns[0] <= len(c.turns) <= turns[1]
    if suite == "multi_turn":
        assert all(sum(1 for t in c.turns if t.checks) >= 2 for c in convs)
        types = {ch["type"] for c in convs for t in c.turns for ch in t.checks}
        assert {"contains", "regex", "number", "json"} <= types
    if suite == "smoke":
        assert len(convs) == 2


def _write(tmp_path, lines):
    path = tmp_path / "suite.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = {"id": "a", "turns": [{"user": "Order 4471 please", "checks": [{"type": "contains", "value": "4471"}]}]}


@pytest.mark.parametrize("record,where", [
    ('{"id": "a", "turns": [', "invalid JSON"),
    (json.dumps({"turns": GOOD["turns"]}), "field 'id'"),
    (json.dumps({"id": "a"}), "field 'turns'"),
    (json.dumps({"id": "a", "turns": [{"usr": "x"}]}), "field 'turns[0].usr'"),
    (json.dumps({**GOOD, "max_tokens": 5}), "field 'max_tokens': unknown field"),     # SCHEMA.md: rejected, not ignored
    (json.dumps({"id": "a", "turns": [{"user": "x", "max_tokens": 5}]}), "field 'turns[0].max_tokens': unknown field"),
    (json.dumps({"id": "a", "turns": [{"user": "x", "checks": [{"type": "vibes"}]}]}), "unknown check type 'vibes'"),
    (json.dumps({"id": "a", "turns": [{"user": "x", "checks": [{"type": "regex", "pattern": "("}]}]}),
     "turns[0].checks[0].pattern"),
    (json.dumps({"id": "a", "turns": [{"user": "x", "max_new_tokens": 0}]}), "turns[0].max_new_tokens"),
    (json.dumps({"id": "a", "turns": [{"user": "x"}] * 9}), "1..8 turns"),
])
def test_malformed_records_fail_with_file_line_and_field(tmp_path, record, where):
    path = _write(tmp_path, [json.dumps(GOOD).replace('"a"', '"ok"'), record])
    with pytest.raises(PromptError) as exc:
        load_suite("custom", path)
    msg = str(exc.value)
    assert f"{path}:2" in msg and where in msg


def test_duplicate_ids_and_empty_suites_are_errors(tmp_path):
    with pytest.raises(PromptError, match="duplicate id 'a'"):
        load_suite("custom", _write(tmp_path, [json.dumps(GOOD), json.dumps(GOOD)]))
    with pytest.raises(PromptError, match="holds no records"):
        load_suite("custom", _write(tmp_path, [""]))
    with pytest.raises(PromptError, match="does not exist"):
        load_suite("custom", tmp_path / "missing.jsonl")


def test_profile_selection_caps_budgets():
    convs = load_suite("multi_turn", PROJECT_ROOT / "prompts" / "multi_turn.jsonl")
    chosen = select(convs, 2, 50)
    assert len(chosen) == 2 and all(t.max_new_tokens <= 50 for c in chosen for t in c.turns)


def test_checks():
    reply = 'Your order ORD-5521 totals $1,249.50.\n```json\n{"order": "ORD-5521", "total": 1249.5}\n```'
    assert run_check({"type": "contains", "value": "ord-5521"}, reply)
    assert not run_check({"type": "contains", "value": "ord-5521", "case_sensitive": True}, reply)
    assert run_check({"type": "not_contains", "value": "refund"}, reply)
    assert run_check({"type": "regex", "pattern": r"totals \$1,249\.50"}, reply)
    assert run_check({"type": "number", "value": 1249.5, "tolerance": 0.001}, reply)
    assert not run_check({"type": "number", "value": 1250}, reply)
    schema = {"type": "object", "required": ["order", "total"], "properties": {"total": {"type": "number"}}}
    assert run_check({"type": "json", "schema": schema}, reply)
    assert not run_check({"type": "json", "schema": schema}, "no json here {oops}")
    assert extract_json('prefix {"a": {"b": 1}} suffix') == {"a": {"b": 1}}
    assert numbers_in("€2,000 and 3.5%") == [2000.0, 3.5]
