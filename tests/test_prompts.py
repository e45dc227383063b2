import json
import re

import pytest

from pipeline.config.schema import PROJECT_ROOT
from pipeline.suites.records import PromptError, load_suite, select
from pipeline.suites.checks import (check_grade, count_units, extract_json, first_json_object, has_greeting, has_table,
                                    heading_in, heading_parts, is_json_only, literal_in, numbers_in, repeated_fraction,
                                    run_check)
from pipeline.suites.language import detect_language


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
        assert {"contains", "regex", "number", "json", "echo", "json_valid", "length", "language", "no_loop",
                "format"} <= types
    if suite == "long_output":
        types = {ch["type"] for c in convs for t in c.turns for ch in t.checks}
        assert {"sections", "format"} <= types
    if suite == "smoke":
        assert len(convs) == 2


@pytest.mark.parametrize("suite", ["long_output", "multi_turn"])
def test_shipped_suites_carry_named_hard_and_graded_checks(suite):
    convs = load_suite(suite, PROJECT_ROOT / "prompts" / f"{suite}.jsonl")
    checks = [ch for c in convs for t in c.turns for ch in t.checks]
    assert all(ch.get("name") for ch in checks)
    assert {check_grade(ch) for ch in checks} == {"hard", "graded"}
    # the default profile runs the first 8 conversations: each carries hard and graded checks
    for c in convs[:8]:
        grades = [check_grade(ch) for t in c.turns for ch in t.checks]
        assert grades.count("graded") >= 2 and "hard" in grades, c.id
    # each multi-turn turn that asks for JSON carries a json_valid check
    for c in convs if suite == "multi_turn" else []:
        for t in c.turns:
            if "json" in t.user.lower():
                assert any(ch["type"] == "json_valid" for ch in t.checks), (c.id, t.user)


# Replies a damaged model produces: every graded check of the bundled suites must fail at least one of them,
# else it carries no signal.
DEGENERATE = {
    "loop": "I'm sorry for any inconvenience, but I'm unable to provide the order details right now. " * 12,
    "digit soup": "- 14:38:" + "14:" * 200,
    "German": ("Sehr geehrte Damen und Herren, vielen Dank für Ihre Nachricht. Wir haben die Angaben geprüft und "
               "melden uns bis morgen mit einer Bestätigung bei Ihnen. Mit freundlichen Grüßen, Ihr Kundenservice"),
    "cut JSON": '```json\n{\n  "order_id": "123456789012345678901234567890123456789012345678901234567890',
    "empty": "",
}


def _garble(value: str) -> str:
    """Each letter or digit moved one step on (a->b, 9->0): a literal copied wrongly."""
    def step(ch):
        if ch.isdigit():
            return str((int(ch) + 1) % 10)
        if ch.isalpha() and ch.isascii():
            base = "a" if ch.islower() else "A"
            return chr((ord(ch) - ord(base) + 1) % 26 + ord(base))
        return ch
    return "".join(step(ch) for ch in value)


@pytest.mark.parametrize("suite", ["long_output", "multi_turn"])
def test_every_graded_check_fails_a_degenerate_reply(suite):
    convs = load_suite(suite, PROJECT_ROOT / "prompts" / f"{suite}.jsonl")
    for c in convs:
        for t in c.turns:
            for ch in t.checks:
                if check_grade(ch) == "graded":
                    failed = [k for k, reply in DEGENERATE.items() if not run_check(ch, reply)]
                    assert failed, (c.id, ch)
                    if ch["type"] in ("echo", "json_valid", "sections") or ch.get("kind") == "table":
                        assert len(failed) == len(DEGENERATE), (c.id, ch)


@pytest.mark.parametrize("suite", ["long_output", "multi_turn"])
def test_sections_and_format_checks_follow_the_turns_own_instruction(suite):
    """A sections check passes the requested headings laid out as headings and fails them mentioned only in prose;
    a format check sits only on a turn that asks for that format."""
    convs = load_suite(suite, PROJECT_ROOT / "prompts" / f"{suite}.jsonl")
    for c in convs:
        for t in c.turns:
            for ch in t.checks:
                if ch["type"] == "sections":
                    heads = ch["values"]
                    need = ch.get("min", len(heads))
                    assert run_check(ch, "\n\n".join(f"## {h}\nSome text for this part." for h in heads)), ch
                    assert run_check(ch, "\n".join(f"**{h}:** some text for this part of the document." for h in heads))
                    assert not run_check(ch, " ".join(f"We cover the {h.lower()} in this long sentence here."
                                                      for h in heads)), ch
                    assert not run_check(ch, "\n\n".join(f"## {h}" for h in heads[:need - 1])), ch
                elif ch["type"] == "format":
                    asks = {"json_only": r"\b(only|just) the json\b",
                            "greeting": r"\b(email|e-mail|notice|notification|message|letter)\b",
                            "table": r"\btable\b"}[ch["kind"]]
                    assert re.search(asks, t.user, re.IGNORECASE), (c.id, ch, t.user)


@pytest.mark.parametrize("suite", ["long_output", "multi_turn"])
def test_echo_checks_pass_the_literals_and_fail_them_garbled_or_dropped(suite):
    convs = load_suite(suite, PROJECT_ROOT / "prompts" / f"{suite}.jsonl")
    echoes = [ch for c in convs for t in c.turns for ch in t.checks if ch["type"] == "echo"]
    assert echoes
    for ch in echoes:
        values = [ch["value"]] if "value" in ch else ch["values"]
        need = ch.get("min", len(values))
        assert run_check(ch, "As requested: " + "; ".join(values) + "."), ch
        assert not run_check(ch, "As requested: " + "; ".join(_garble(v) for v in values) + "."), ch
        assert not run_check(ch, "As requested: " + "; ".join(values[:need - 1]) + "."), ch


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
    (json.dumps({"id": "a", "turns": [{"user": "x", "min_new_tokens": 0}]}), "turns[0].min_new_tokens"),
    (json.dumps({"id": "a", "turns": [{"user": "x", "max_new_tokens": 96, "min_new_tokens": 128}]}),
     "field 'turns[0].min_new_tokens': expected at most the turn's max_new_tokens (96), got 128"),
    (json.dumps({"id": "a", "turns": [{"user": "x"}] * 9}), "1..8 turns"),
])
def test_malformed_records_fail_with_file_line_and_field(tmp_path, record, where):
    path = _write(tmp_path, [json.dumps(GOOD).replace('"a"', '"ok"'), record])
    with pytest.raises(PromptError) as exc:
        load_suite("custom", path)
    msg = str(exc.value)
    assert f"{path}:2" in msg and where in msg


def _one_check(check, user="Order AP-558213 for Priya, total $1,249.50. Reply in JSON."):
    return json.dumps({"id": "a", "turns": [{"user": user, "checks": [check]}]})


@pytest.mark.parametrize("check,where", [
    ({"type": "contains", "value": "x", "name": ""}, "field 'turns[0].checks[0].name'"),
    ({"type": "contains", "value": "x", "grade": "soft"}, "field 'turns[0].checks[0].grade': expected one of hard"),
    ({"type": "echo", "value": "AP-999999"}, "'AP-999999' does not occur in this turn's user message"),
    ({"type": "echo", "value": "AP-55821"}, "does not occur"),          # part of a longer ID is not the literal
    ({"type": "echo", "values": ["AP-558213", "Gemma"], "min": 1}, "field 'turns[0].checks[0].values': 'Gemma'"),
    ({"type": "echo"}, "field 'turns[0].checks[0].value': expected either 'value'"),
    ({"type": "echo", "value": "Priya", "values": ["Priya"]}, "expected either 'value'"),
    ({"type": "echo", "values": []}, "field 'turns[0].checks[0].values': expected a non-empty list"),
    ({"type": "echo", "values": ["Priya", "AP-558213"], "min": 3}, "field 'turns[0].checks[0].min': expected an integer in 1..2"),
    ({"type": "echo", "value": "Priya", "min": 1}, "field 'turns[0].checks[0].min': only allowed with 'values'"),
    ({"type": "length", "unit": "pages", "max": 3}, "field 'turns[0].checks[0].unit'"),
    ({"type": "length", "unit": "words"}, "field 'turns[0].checks[0].max': expected 'min', 'max' or both"),
    ({"type": "length", "unit": "words", "min": 50, "max": 10}, "field 'turns[0].checks[0].min': min 50 is above max 10"),
    ({"type": "length", "unit": "lines", "max": -1}, "field 'turns[0].checks[0].max': expected a non-negative integer"),
    ({"type": "language", "value": "english"}, "field 'turns[0].checks[0].value': expected a language code"),
    ({"type": "language"}, "field 'turns[0].checks[0].value'"),
    ({"type": "no_loop", "n": 1}, "field 'turns[0].checks[0].n': expected an integer in 2..20"),
    ({"type": "no_loop", "max_repeated": 1.5}, "field 'turns[0].checks[0].max_repeated': expected a fraction"),
    ({"type": "sections"}, "field 'turns[0].checks[0].values': expected a non-empty list"),
    ({"type": "sections", "values": "Order"}, "field 'turns[0].checks[0].values': expected a non-empty list"),
    ({"type": "sections", "values": ["Order", "Summary"]},
     "field 'turns[0].checks[0].values': 'Summary' does not occur"),
    ({"type": "sections", "values": ["Order"], "min": 2},
     "field 'turns[0].checks[0].min': expected an integer in 1..1"),
    ({"type": "format"}, "field 'turns[0].checks[0].kind': expected one of table, json_only, greeting"),
    ({"type": "format", "kind": "bullets"}, "field 'turns[0].checks[0].kind'"),
    ({"type": "contains", "value": "x", "needs_tokens": 0}, "field 'turns[0].checks[0].needs_tokens': expected an integer"),
    ({"type": "contains", "value": "x", "needs_tokens": "late"}, "field 'turns[0].checks[0].needs_tokens'"),
])
def test_malformed_new_checks_fail_with_file_line_and_field(tmp_path, check, where):
    path = _write(tmp_path, [json.dumps(GOOD), _one_check(check).replace('"a"', '"b"', 1)])
    with pytest.raises(PromptError) as exc:
        load_suite("custom", path)
    msg = str(exc.value)
    assert f"{path}:2" in msg and where in msg, msg


def test_well_formed_new_checks_load_and_keep_their_grade(tmp_path):
    checks = [{"type": "echo", "value": "ap-558213", "name": "echoes order", "grade": "graded"},
              {"type": "echo", "values": ["Priya", "$1,249.50"], "min": 1, "grade": "graded"},
              {"type": "json_valid", "grade": "graded"}, {"type": "length", "unit": "bullets", "max": 5},
              {"type": "language", "value": "de"}, {"type": "no_loop", "n": 6, "max_repeated": 0.2},
              {"type": "contains", "value": "AP-558213"},
              {"type": "sections", "values": ["order", "Priya"], "min": 1, "grade": "graded"},
              {"type": "format", "kind": "greeting", "grade": "graded"}, {"type": "format", "kind": "table"}]
    record = {"id": "a", "turns": [{"user": "Order AP-558213 for Priya, total $1,249.50.", "checks": checks}]}
    conv, = load_suite("custom", _write(tmp_path, [json.dumps(record)]))
    assert [check_grade(c) for c in conv.turns[0].checks] == ["graded"] * 3 + ["hard"] * 4 + ["graded"] * 2 + ["hard"]
    assert select([conv], 1, 50)[0].turns[0].checks == checks


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
    assert len(chosen) == 2 and all(t.max_new_tokens <= max(50, t.min_new_tokens or 0) for c in chosen for t in c.turns)
    assert any(t.min_new_tokens for c in chosen for t in c.turns)      # the shipped suite has a floor among these


def test_a_cap_never_cuts_a_turn_below_what_its_checks_need(tmp_path):
    turns = [{"user": "Give the dispute as JSON.", "max_new_tokens": 256, "min_new_tokens": 192},
             {"user": "And in one line?", "max_new_tokens": 64},
             {"user": "Now the full letter.", "min_new_tokens": 600}]
    conv, = load_suite("custom", _write(tmp_path, [json.dumps({"id": "a", "turns": turns})]))
    assert [t.max_new_tokens for t in select([conv], 1, 96)[0].turns] == [192, 64, 512]   # 512: the default budget
    assert [t.max_new_tokens for t in select([conv], 1, 300)[0].turns] == [256, 64, 512]
    assert [t.max_new_tokens for t in select([conv], 1, None)[0].turns] == [256, 64, 512]


def test_a_check_beyond_the_capped_budget_is_not_scored(tmp_path, caplog):
    late = {"type": "contains", "value": "Priyanka", "name": "action item owner", "needs_tokens": 900}
    early = {"type": "contains", "value": "INC-4471", "name": "incident id"}
    record = {"id": "pm", "turns": [{"user": "Write the postmortem of INC-4471.", "max_new_tokens": 1024,
                                     "checks": [early, late]}]}
    conv, = load_suite("custom", _write(tmp_path, [json.dumps(record)]))
    with caplog.at_level("INFO", logger="pipeline.suites.records"):
        assert select([conv], 1, 512)[0].turns[0].checks == [early]
    assert "pm: 1 check(s) need more than this profile's 512-token budget and are not scored: action item owner" \
        in caplog.text
    assert select([conv], 1, 900)[0].turns[0].checks == [early, late]
    assert select([conv], 1, None)[0].turns[0].checks == [early, late]
    shipped = load_suite("long_output", PROJECT_ROOT / "prompts" / "long_output.jsonl")
    assert any(c.get("needs_tokens") for conv in shipped for t in conv.turns for c in t.checks)


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
    # a currency code written without a space is read; a number never starts inside a digit group
    assert numbers_in("EUR1,249.50, GBP9,430 and USD 88,000") == [1249.5, 9430.0, 88000.0]
    assert numbers_in("INV2024 x1,249.50 AP-558213") == [558213.0]
    # a sign belongs to a number only when written against it: "a - 700" subtracts 700, it does not state -700
    assert numbers_in("Q3 actual - 1,250,000 = 87.6%; change -4.5% or +$120") == [1250000.0, 87.6, -4.5, 120.0]
    assert run_check({"type": "number", "value": 1249.5, "tolerance": 0.01}, "total EUR1,249.50")
    assert not run_check({"type": "number", "value": 249.5, "tolerance": 0.01}, "total x1,249.50")


GOOD_EMAIL = """Dear Ms Brennan,

Thank you for raising the March invoice with us. I have checked INV-20931 against your account QTB-771204 and
agree that the roaming bundle (EUR 128.00) and the early termination adjustment (EUR 255.50) were charged in
error. I have also applied the 10% goodwill credit on the Business Fibre 500 line for the outage on 4 March,
which is EUR 31.00.

The corrected invoice total is EUR 835.00, a total credit of EUR 414.50. The credit will be applied as soon as
you confirm by replying to this email, and you will receive a revised invoice within two working days.

Kind regards,
Quayside Telecom Business billing support"""

RUNBOOK = """## Pre-checks
1. On bastion-db-01 run `patronictl -c /etc/patroni/orders-prod.yml list` and confirm pg-orders-prod-01 is the
   leader and pg-orders-prod-02 is the sync standby with lag under 16 MB.
2. Check for transactions older than 5 minutes with the query in the appendix; do not proceed if there are any.

## Procedure
1. Announce the start in #ops-bridge and notify pharmacy-int-oncall.
2. Run `patronictl -c /etc/patroni/orders-prod.yml switchover --leader pg-orders-prod-01 --candidate pg-orders-prod-02`.
3. Run `patronictl -c /etc/patroni/orders-prod.yml list` again: pg-orders-prod-02 must now be the leader.

## Verification
| Check | Expected |
|---|---|
| HAProxy GET /primary on port 8008 | 200 from pg-orders-prod-02 only |
| orders-api error rate | under 1% within 5 minutes |

## Rollback
If the error rate stays above 1% for 5 minutes, run the switchover command with the hosts swapped."""


def test_echo():
    reply = "Your order AP-558213 totals $1,249.50; we'll ship it to Denver."
    assert run_check({"type": "echo", "value": "AP-558213"}, reply)
    assert run_check({"type": "echo", "value": "ap-558213"}, reply)                      # case-insensitive by default
    assert not run_check({"type": "echo", "value": "ap-558213", "case_sensitive": True}, reply)
    assert not run_check({"type": "echo", "value": "AP-558213"}, "Your order AP-558231 totals $1,249.50.")  # garbled
    assert not run_check({"type": "echo", "value": "AP-558213"}, "Your order AP-5582130 is on its way.")
    assert run_check({"type": "echo", "value": "$1,249.50"}, reply)
    assert not run_check({"type": "echo", "value": "$1,249.50"}, "It comes to $1,294.50.")
    assert not run_check({"type": "echo", "value": "18"}, "180 pallets were booked in 2018.")
    check = {"type": "echo", "values": ["AP-558213", "$1,249.50", "Denver"], "min": 2}
    assert run_check(check, reply) and run_check(check, "AP-558213 ships to Denver.")
    assert not run_check(check, "Your order ships to Denver.")                           # a fact dropped
    assert run_check({"type": "echo", "values": ["AP-558213", "Denver"]}, reply)          # min defaults to all
    assert not run_check({"type": "echo", "values": ["AP-558213", "Boulder"]}, reply)
    assert literal_in("14:38", "at 14:38, the rollback") and not literal_in("4:38", "at 14:38")
    # an amount with trailing zero decimals is the same amount without them, never a longer or other number
    for same in ("the static IP block (€94) is", "€94.0 for the block", "94 EUR", "$1,250.5 due"):
        assert run_check({"type": "echo", "values": ["94.00", "$1,250.50"], "min": 1}, same), same
    for other in ("€94.5 for the block", "€940", "94,000 EUR", "€9.40", "$1,250.55", "$1,25"):
        assert not run_check({"type": "echo", "values": ["94.00", "$1,250.50"], "min": 1}, other), other
    assert not run_check({"type": "echo", "value": "AP-100"}, "order AP-1 shipped")        # not an amount


def test_json_valid():
    check = {"type": "json_valid"}
    assert run_check(check, 'Here it is:\n```json\n{"order_id": "AP-558213", "new_total": 382.25}\n```\nAnything else?')
    assert run_check(check, '{"order_id": "AP-558213", "items": [{"sku": "TH2-GRN"}]} Let me know.')
    assert run_check(check, '```\n{"a": 1}\n```')
    # damaged: cut off at the budget, unquoted values, trailing comma, broken outer object around a valid inner one
    assert not run_check(check, '```json\n{"order_id": "AP-558213", "new_total": 38')
    assert not run_check(check, '{"ticket_id": 2022-01-22 12:32:53, "priority": 1}')
    assert not run_check(check, '{"a": 1,}')
    assert not run_check(check, '{"customer": {"plan": {"name": "Team"}, "plan_json": {"plan_json_json": ')
    assert extract_json('{"customer": {"plan": {"name": "Team"}, "plan_json": {') == {"name": "Team"}   # the lenient one
    # not JSON at all, an array, or an empty object
    assert not run_check(check, "The order number is AP-558213.")
    assert not run_check(check, "[1, 2, 3]") and not run_check(check, "{}") and not run_check(check, "")
    assert first_json_object('{"a": {"b": [1, "}"]}} trailing') == {"a": {"b": [1, "}"]}}


def test_length():
    assert count_units("Dear Ana,\n\nthe total is $1,249.50 - thanks!", "words") == 7    # "-" is not a word
    assert count_units("a\n\n b \n  \nc", "lines") == 3
    bullets = "Risks:\n- churn\n* pricing\n• timing\n1. budget\n2) legal\n-not a bullet\n12.5% is not one"
    assert count_units(bullets, "bullets") == 5
    five = {"type": "length", "unit": "bullets", "min": 2, "max": 5}
    assert run_check(five, bullets)
    assert not run_check(five, bullets + "\n- a sixth")
    assert not run_check(five, "There are several risks: churn, pricing and timing.")  # asked for a list
    words = {"type": "length", "unit": "words", "min": 40, "max": 150}
    assert run_check(words, GOOD_EMAIL)
    assert not run_check(words, GOOD_EMAIL * 2)                                            # too long
    assert not run_check(words, "Dear Mirela, the quote is EUR 21,880.")                   # stopped early
    assert run_check({"type": "length", "unit": "lines", "max": 2}, "AP-558213, Denver.")
    assert count_units("INC-4471: reset done. The user (Gemma) confirmed at 14:05! Closing", "sentences") == 3
    assert count_units("Total is 2.5% above plan. Refund $1,249.50 today.", "sentences") == 2
    assert count_units("1. Reset the password.\n2. Revoke sessions.\n- Close it", "sentences") == 3
    assert count_units("  \n- ", "sentences") == 0
    two_or_three = {"type": "length", "unit": "sentences", "min": 2, "max": 3}
    assert run_check(two_or_three, "INC-4471 resolved. Password reset and sessions revoked.")
    assert not run_check(two_or_three, "INC-4471 resolved. Reset done. Sessions revoked. User told.")  # four
    assert not run_check(two_or_three, "INC-4471 resolved")


def test_language():
    assert detect_language(GOOD_EMAIL) == "en"
    assert run_check({"type": "language", "value": "en"}, GOOD_EMAIL)
    assert run_check({"type": "language", "value": "de"}, DEGENERATE["German"])
    assert not run_check({"type": "language", "value": "en"}, DEGENERATE["German"])      # switched language
    spanish = ("Estimada señora Brennan, gracias por su mensaje. Hemos revisado la factura y el abono es correcto; "
               "lo aplicaremos cuando usted lo confirme.")
    french = ("Madame, merci pour votre message. Nous avons vérifié la facture et le crédit sera appliqué dès que "
              "vous nous aurez confirmé votre accord.")
    assert detect_language(spanish) == "es" and detect_language(french) == "fr"
    assert not run_check({"type": "language", "value": "fr"}, GOOD_EMAIL)
    for damaged in (DEGENERATE["digit soup"], DEGENERATE["cut JSON"], "Thanks, noted.", "",
                    "| HX-2201 | 1,240 | 0 | 310 | 3 | 400 |\n| HX-2202 | 860 | 500 | 265 | 3 | 350 |",
                    "这是一个测试回复，我们已经检查了发票并确认了信用额度。" * 3):
        assert not run_check({"type": "language", "value": "en"}, damaged), damaged


def test_no_loop():
    check = {"type": "no_loop"}
    assert repeated_fraction(GOOD_EMAIL) < 0.1 and run_check(check, GOOD_EMAIL)
    assert repeated_fraction(RUNBOOK) < 0.1 and run_check(check, RUNBOOK)   # a repeated command and a table are fine
    assert run_check(check, "AP-558213, Denver.") and run_check(check, "")
    sentence = "The customer confirms that they are using the Fibre 500, which is a standard Fibre 500. "
    assert 0.55 < repeated_fraction(sentence * 3) < 0.7
    assert not run_check(check, "Aoife,\n\nI'm glad to hear your invoice is in order. " + sentence * 3)
    assert not run_check(check, DEGENERATE["loop"]) and not run_check(check, DEGENERATE["digit soup"])
    assert not run_check(check, "Booking reference: " + "18 pallets of porcelain floor tiles, " * 8)
    assert not run_check(check, GOOD_EMAIL + "\n" + "\n".join(["Priya"] * 60))  # a loop after a good start
    # stricter settings
    base = "alpha bravo charlie delta echo foxtrot golf hotel india juliet"
    text = f"{base} {base} kilo lima mike november oscar papa quebec romeo sierra tango uniform victor"
    assert 0.2 < repeated_fraction(text) < 0.3 and run_check(check, text)      # 7 of 29 4-grams repeat
    assert not run_check({"type": "no_loop", "max_repeated": 0.2}, text)
    assert run_check({"type": "no_loop", "n": 11, "max_repeated": 0.2}, text)


POSTMORTEM = """# Postmortem: INC-4471 checkout-api connection pool

## Summary
On 2024-11-19 the deploy of checkout-api v2.31.0 cut the acquirer connection pool from 200 to 20.

**Customer impact:** 2,318 failed charge attempts across 611 merchants.

### Timeline (UTC)
- 13:58 Deploy starts

1. **Root cause**: the Helm value acquirer.pool.max_conns was typed as '20'.
What went well
"""


def test_sections():
    assert heading_parts(POSTMORTEM)[:4] == ["postmortem inc 4471 checkout api connection pool", "summary",
                                             "customer impact", "timeline utc"]
    for h in ("Summary", "Customer impact", "Timeline", "Root cause", "What went well", "summary"):
        assert heading_in(h, POSTMORTEM), h
    assert heading_in("Pre-checks", "2. **Pre-Checks and Verifications**: run these first")
    assert heading_in("Goals and non-goals", "## Goals & Non-Goals")
    assert heading_in("Attendees", "Attendees: Ingrid Solberg (chair), Dev Malhotra")
    # only mentioned in prose, or a longer word: not a heading
    assert not heading_in("Contributing factors", POSTMORTEM)
    assert not heading_in("Root cause", "The root cause was a typo in the Helm value, which we fixed on the same day.")
    assert not heading_in("Goals", "## Goal")
    check = {"type": "sections", "values": ["Summary", "Customer impact", "Timeline", "Root cause"], "min": 3}
    assert run_check(check, POSTMORTEM)
    assert not run_check(check, "Summary:\n\nImpact:\n\n- 14:38:14:14:38:14:14:14")     # one of four
    assert not run_check(check, DEGENERATE["loop"]) and not run_check(check, "")
    assert not run_check({"type": "sections", "values": ["Summary", "Contributing factors"]}, POSTMORTEM)  # min: all


def test_format():
    table = {"type": "format", "kind": "table"}
    assert has_table("Rules at a glance\n\n| Rule | Limit |\n|---|:---:|\n| Hotel | EUR 180 |\n")
    assert run_check(table, "Rule | Limit\n--- | ---\nHotel | EUR 180")                 # outer pipes optional
    assert not run_check(table, "| Rule | Limit |\n| Hotel | EUR 180 |")                    # no delimiter row
    assert not run_check(table, "| Rule | Limit |\n|---|---|---|\n| Hotel | EUR 180 |")    # cells do not line up
    assert not run_check(table, "Hotel: EUR 180 a night; meals: EUR 60 a day.")

    only = {"type": "format", "kind": "json_only"}
    assert is_json_only('{"order_id": "AP-558213", "new_total": 382.25}')
    assert run_check(only, '```json\n{"order_id": "AP-558213", "note": "a } in a string"}\n```\n')
    assert run_check(only, DEGENERATE["cut JSON"])          # cut off inside the JSON: json_valid fails it instead
    assert not run_check(only, 'Here is the JSON:\n{"order_id": "AP-558213"}')             # a lead-in
    assert not run_check(only, '{"order_id": "AP-558213"}\n\nLet me know if you need anything else.')
    assert not run_check(only, '```json\n{"a": 1}\n```\nThis JSON object contains the keys.')
    assert not run_check(only, "The order is AP-558213.") and not run_check(only, "")

    greet = {"type": "format", "kind": "greeting"}
    assert has_greeting(GOOD_EMAIL)
    assert run_check(greet, "Subject: Final interview schedule\n\nDear Tomás,\n\nThank you for ...")
    assert run_check(greet, "Here is the draft:\n\n> Hi Mirela,\n> thanks for your time today.")
    assert run_check(greet, "Aoife,\n\nThank you for your patience with the March invoice.")
    assert run_check(greet, "Bonjour Madame Lefèvre,\n\nNous confirmons la réservation.")
    assert not run_check(greet, "Booking reference: 18 pallets of porcelain floor tiles, 412 kg")
    assert not run_check(greet, "The total is $2,108.00.\n\nThanks,\nVireo Foods")         # a sign-off only
    assert not run_check(greet, "Highlights\n- faster reports")                              # not "Hi"
    assert not run_check(greet, "Sure thing,\nthe order ships on Monday.")                   # not a name
    assert not run_check(greet, "line one\nline two\nline three\nline four\nline five\nDear Ama,")  # too late
    assert not run_check(greet, DEGENERATE["loop"]) and not run_check(greet, "")


def test_calibration_text_is_kept_apart_from_every_evaluation_text():
    """GPTQ/AWQ/imatrix calibration must never see what is scored: no calibration text shares a run of eight words
    with any prompt, document or check of the shipped suites, and there are enough texts for the 512-sample
    calibration sweep (`make calibration`)."""
    def grams(text, n=8):
        words = re.findall(r"\w+", text.lower())
        return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}

    calibration = [json.loads(line) for line in (PROJECT_ROOT / "prompts" / "calibration.jsonl").open()]
    ids = [r["id"] for r in calibration]
    assert len(ids) == len(set(ids)) and len(calibration) >= 512
    scored = set()
    for path in (PROJECT_ROOT / "prompts").rglob("*"):
        if path.is_file() and path.name not in ("calibration.jsonl", "SCHEMA.md"):
            scored |= grams(path.read_text(encoding="utf-8"))
    shared = {r["id"]: sorted(grams(r["text"]) & scored)[:2] for r in calibration if grams(r["text"]) & scored}
    assert not shared, shared
