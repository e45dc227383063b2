"""prompts/bench/business_mc.jsonl holds up: every question well formed (four distinct options, the answer's index in
range, unique ids and questions, known categories, the right option spread over the four positions), and every
generated question's right option recomputed here from its ``facts`` with other tools than the generator's
(``Decimal`` money, ``numpy.busday_offset``, aware datetimes, ``calendar``), the other three options differing from
it. The generator (dev/business_mc_hard.py) writes the file as it is. Text only: no model, no lm-eval."""

from __future__ import annotations

import calendar
import json
from collections import Counter
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal

import numpy as np
import pytest

from pipeline.config.schema import PROJECT_ROOT

DATA = PROJECT_ROOT / "prompts" / "bench" / "business_mc.jsonl"
HAND_WRITTEN = {"units", "terms", "invoice", "policy", "dates", "arithmetic", "percent", "finance", "logistics"}
GENERATED = {"invoice_multistep", "policy_distractor", "date_unit_reasoning"}
ROWS = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
NEW = [r for r in ROWS if r["category"] in GENERATED]


def test_every_question_is_well_formed_and_the_answers_are_spread():
    assert len(ROWS) == 360 and len(NEW) == 96
    assert [r["id"] for r in ROWS] == [f"bmc-{i:03d}" for i in range(1, len(ROWS) + 1)]
    assert len({r["question"] for r in ROWS}) == len(ROWS), "a question is repeated"
    for r in ROWS:
        base = {"id", "category", "question", "choices", "answer"}
        assert set(r) == (base | {"difficulty", "facts"} if r["category"] in GENERATED else base), r["id"]
        assert r["category"] in HAND_WRITTEN | GENERATED, r["id"]
        assert len(r["choices"]) == 4 and len(set(r["choices"])) == 4, r["id"]
        assert all(isinstance(c, str) and c.strip() == c and c for c in r["choices"]), r["id"]
        assert isinstance(r["answer"], int) and 0 <= r["answer"] < 4, r["id"]
    assert set(Counter(r["answer"] for r in ROWS).values()) == {len(ROWS) // 4}
    for category in GENERATED:
        rows = [r for r in NEW if r["category"] == category]
        assert len(rows) == 32 and Counter(r["answer"] for r in rows) == {0: 8, 1: 8, 2: 8, 3: 8}, category
        assert all(isinstance(r["difficulty"], int) and 2 <= r["difficulty"] <= 4 for r in rows)


def test_the_generator_writes_the_file_as_it_is():
    from dev.business_mc_hard import render

    assert render() == DATA.read_text(encoding="utf-8")


# ------------------------------------------------------------------ the right option, recomputed

def dollars(cents) -> str:
    d = Decimal(cents) / 100
    assert d == d.quantize(Decimal("0.01")), cents
    return f"{d:,.2f} dollars"


def subtotal(f) -> int:
    return sum(q * p for q, p in f["lines"])


def long_date(d: date, weekday: bool = False) -> str:
    return (f"{d:%A} " if weekday else "") + f"{d.day} {d:%B} {d.year}"


MONDAY = date(2024, 1, 1)         # any Monday: the week that holds a weekday named in the question
WEEKDAYS = list(calendar.day_name)


def invoice(f) -> str:
    k = f["kind"]
    if k == "discount_tax":
        return dollars(Decimal(subtotal(f)) * (100 - f["discount_pct"]) * (100 + f["tax_pct"]) / 10000)
    if k == "coupon_tax":
        return dollars(Decimal(subtotal(f) - f["coupon"]) * (100 + f["tax_pct"]) / 100)
    if k == "shipping_threshold":
        after = Decimal(subtotal(f)) * (100 - f["discount_pct"]) / 100
        return dollars(after + (f["shipping"] if after < f["threshold"] else 0))
    if k == "prorated":
        days = calendar.monthrange(f["year"], f["month"])[1]
        return dollars(Decimal(f["monthly"] - f["old_monthly"]) / days * (days - f["start_day"] + 1))
    if k == "overtime":
        h = f["hours"]
        return dollars(min(h, 40) * f["rate"] + Decimal(max(h - 40, 0) * f["rate"]) * Decimal("1.5") + f["materials"])
    if k == "volume_price":
        unit = f["volume_unit"] if f["qty"] >= f["volume_qty"] else f["unit"]
        return dollars(Decimal(f["qty"] * unit) * (100 + f["tax_pct"]) / 100)
    raise AssertionError(k)


RETURNS = {"full": "a full refund of the price", "fee": "a refund less a 15 percent fee",
           "credit": "store credit for the full price", "refused": "the return is not accepted"}
COVER = {(True, True): "parts and labour are both covered", (True, False): "parts are covered, labour is charged",
         (False, True): "labour is covered, parts are charged", (False, False): "neither parts nor labour are covered"}


def next_business(d: date, n: int) -> date:
    return np.busday_offset(np.datetime64(d), n, roll="forward").astype(date)


def policy(f) -> str:
    k = f["kind"]
    if k == "returns":
        if f["item"] == "electronics":
            return RETURNS["fee" if f["days"] <= 14 else "refused"]
        window = 60 if f["member"] else 30
        return RETURNS[("full" if f["item"] == "unused" else "credit") if f["days"] <= window else "refused"]
    if k == "expenses":
        if f["claim"] > 25 and not f["receipt"]:
            return dollars(0)
        return dollars(100 * min(f["claim"] - f["alcohol"], 120 if f["client"] and f["approved"] else 40))
    if k == "approvals":
        if f["item"] == "software":
            return "the IT security team"
        p = f["price"]
        return "no approval is needed" if p < 500 else "the department head" if p <= 5000 else "the finance director"
    if k == "warranty":
        damaged = f["fault"] in ("dropped", "water")
        parts_months = 6 if f["fault"] == "battery" else 24
        return COVER[(not damaged and f["months"] <= parts_months, not damaged and f["months"] <= 12)]
    if k == "late_fee":
        if f["charity"] or f["amount"] < 100 or f["paid_day"] <= 30:
            return dollars(0)
        periods = (f["paid_day"] - 30 + 29) // 30
        return dollars(Decimal(f["amount"] * 100) * 2 * periods / 100)
    if k == "delivery":
        ordered = MONDAY + timedelta(days=WEEKDAYS.index(f["weekday"]))
        dispatched = next_business(ordered, 1 if f["hour"] >= 14 else 0)
        arrives = next_business(dispatched, (4 if f["service"] == "standard" else 1) + 2 * f["island"])
        week = ["in the same week", "in the following week", "two weeks later"][(arrives - MONDAY).days // 7]
        return f"{arrives:%A} {week}"
    raise AssertionError(k)


def dates_units(f) -> str:
    k = f["kind"]
    if k == "due_calendar":
        return long_date(date.fromisoformat(f["start"]) + timedelta(days=f["days"]))
    if k == "due_business":
        due = np.busday_offset(np.datetime64(f["start"]), f["days"], roll="forward",
                               holidays=[np.datetime64(h) for h in f["holidays"]])
        return long_date(due.astype(date), weekday=True)
    if k == "timezone":
        h, m = map(int, f["time"].split(":"))
        day = MONDAY + timedelta(days=WEEKDAYS.index(f["weekday"]))
        start = datetime(day.year, day.month, day.day, h, m, tzinfo=timezone(timedelta(minutes=f["from_offset"])))
        there = start.astimezone(timezone(timedelta(minutes=f["to_offset"])))
        return f"{there:%H:%M} on {there:%A}"
    if k == "units":
        a, b, c = f["a"], f["b"], f["c"]
        value, unit = {"bottles": (lambda: Decimal(a * b * c) / 1000, "litres"),       # cases, bottles, ml
                       "sacks": (lambda: Decimal(a) / 10 * 1_000_000 / c, "bags"),       # tenths of a tonne, g
                       "speed": (lambda: Decimal(a) * 1000 / 60, "metres"),              # km/h
                       "filling": (lambda: Decimal(a) * (b * 60 + c), "bottles"),        # per minute, h, min
                       "tiles": (lambda: Decimal(a * b) / (Decimal(c) / 100) ** 2, "tiles")}[f["unit_kind"]]
        value = value()
        assert value == int(value), f
        return f"{int(value):,} {unit}"
    raise AssertionError(k)


RECOMPUTE = {"invoice_multistep": invoice, "policy_distractor": policy, "date_unit_reasoning": dates_units}


@pytest.mark.parametrize("row", NEW, ids=[r["id"] for r in NEW])
def test_the_right_option_of_a_generated_question_is_recomputed_from_its_facts(row):
    expected = RECOMPUTE[row["category"]](row["facts"])
    assert row["choices"][row["answer"]] == expected, (row["question"], row["choices"])
    assert row["choices"].count(expected) == 1


def crosses_leap_day(f) -> bool:
    start = date.fromisoformat(f["start"])
    end = start + timedelta(days=f["days"])
    return any(calendar.isleap(y) and start < date(y, 2, 29) <= end for y in range(start.year, end.year + 1))


def test_the_generated_kinds_are_those_the_recomputation_knows():
    kinds = Counter((r["category"], r["facts"]["kind"]) for r in NEW)
    assert {k for _, k in kinds} == {"discount_tax", "coupon_tax", "shipping_threshold", "prorated", "overtime",
                                     "volume_price", "returns", "expenses", "approvals", "warranty", "late_fee",
                                     "delivery", "due_calendar", "due_business", "timezone", "units"}
    # the cases that make a category hard are there: free shipping lost to the discount, a leap day crossed, a
    # holiday skipped, a day boundary crossed between time zones, the policy exception that changes the answer
    assert any(r["facts"]["kind"] == "shipping_threshold"
               and Decimal(subtotal(r["facts"])) * (100 - r["facts"]["discount_pct"]) / 100 < r["facts"]["threshold"]
               <= subtotal(r["facts"]) for r in NEW)
    assert any(r["facts"]["kind"] == "due_calendar" and crosses_leap_day(r["facts"]) for r in NEW)
    assert any(r["facts"]["kind"] == "timezone" and not dates_units(r["facts"]).endswith(r["facts"]["weekday"])
               for r in NEW)
    assert any(r["facts"]["kind"] == "approvals" and r["facts"]["item"] == "software" for r in NEW)
