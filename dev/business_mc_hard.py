"""business_mc's harder items, written by code: `python -m dev.business_mc_hard` rewrites
prompts/bench/business_mc.jsonl with the hand-written questions kept as they are and these appended.

Three categories of 32 questions each, for a model that answers the elementary ones:

- ``invoice_multistep``: invoice lines (quantity x unit price), then a percentage discount and tax, a coupon taken
  before tax, free shipping above a threshold judged after the discount, a per-day pro-rated seat or upgrade, an
  overtime rate, a volume price on the whole order;
- ``policy_distractor`` (``dev.business_mc_policies``): a policy of several clauses with exceptions; the case
  hinges on one clause, and the wrong options are what a reader applying another clause would answer;
- ``date_unit_reasoning`` (``dev.business_mc_dates``): a due date some calendar or business days after a date
  (month ends, leap years, holidays), a meeting time across two UTC offsets, a quantity converted in two steps.

The right option is computed here; the wrong ones are the typical slips (tax before the coupon, a day off by one,
a 30-day month, an exception forgotten, a unit converted once), the first three that differ from it and from each
other. Every item keeps its inputs in ``facts`` (integers and strings: ``kind`` names the rule), so
tests/test_business_mc.py recomputes each answer on its own; ``difficulty`` counts the steps from the question to
the answer. Seeded: the file is the same on every run; within a category the right option sits 8 times in each
position."""

from __future__ import annotations

import datetime as dt
import json
import random
from fractions import Fraction
from pathlib import Path

from dev.business_mc_dates import DATE_KINDS, MONTHS, whole
from dev.business_mc_policies import POLICY_KINDS

SEED = 4099
CATEGORIES = ("invoice_multistep", "policy_distractor", "date_unit_reasoning")
PER_CATEGORY = 32
DATA = Path(__file__).resolve().parents[1] / "prompts" / "bench" / "business_mc.jsonl"

GOODS = [("desks", 9000, 18000), ("office chairs", 4000, 9000), ("monitors", 12000, 26000),
         ("printer cartridges", 2000, 5000), ("desk lamps", 1500, 4500), ("keyboards", 2500, 6000),
         ("filing cabinets", 8000, 15000), ("headsets", 3000, 8000), ("whiteboards", 5000, 12000),
         ("webcams", 4000, 9500)]


def money(cents, currency: str = "dollars") -> str:
    c = Fraction(cents)
    assert c.denominator == 1 and c >= 0, cents
    c = int(c)
    return f"{c // 100:,}.{c % 100:02d} {currency}"


def _lines(rng: random.Random, n: int) -> list[list]:
    goods = rng.sample(GOODS, n)
    return [[rng.randint(2, 9), rng.randrange(lo, hi + 1, 50), name] for name, lo, hi in goods]


def _lines_text(lines) -> str:
    parts = [f"{q} {name} at {money(p)} each" for q, p, name in lines]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def _subtotal(lines) -> int:
    return sum(q * p for q, p, _ in lines)


# ------------------------------------------------------------------ invoice_multistep

def discount_tax(rng):
    lines, d, t = _lines(rng, 2), rng.choice([5, 10, 15, 20, 25]), rng.choice([5, 8, 10, 20])
    s = Fraction(_subtotal(lines))
    q = (f"An invoice lists {_lines_text(lines)}. A {d} percent discount is taken off the subtotal, and {t} "
         "percent sales tax is then added to the discounted amount. What is the amount due?")
    right = s * (100 - d) * (100 + t) / 10000
    wrong = [s * (100 - d + t) / 100, s * (100 - d) / 100, s * (100 + t) / 100, s]
    facts = {"lines": [[a, b] for a, b, _ in lines], "discount_pct": d, "tax_pct": t}
    return q, right, wrong, 4, facts, money


def coupon_tax(rng):
    lines, c, t = _lines(rng, 2), rng.choice([1500, 2000, 2500, 3000, 4000, 5000]), rng.choice([5, 8, 10, 20])
    s = _subtotal(lines)
    q = (f"An invoice lists {_lines_text(lines)}. A coupon worth {money(c)} is taken off before tax, and {t} "
         "percent sales tax is charged on what remains. What is the amount due?")
    right = Fraction(s - c) * (100 + t) / 100
    wrong = [Fraction(s) * (100 + t) / 100 - c, Fraction(s - c), Fraction(s) * (100 + t) / 100,
             Fraction(s - c) * (100 - t) / 100]
    return q, right, wrong, 3, {"lines": [[a, b] for a, b, _ in lines], "coupon": c, "tax_pct": t}, money


def shipping_threshold(rng):
    lines, d = _lines(rng, 2), rng.choice([10, 15, 20, 25])
    ship, s = rng.choice([795, 1200, 1495, 1950]), _subtotal(lines)
    after = Fraction(s) * (100 - d) / 100
    if rng.random() < 0.75:       # the trap: the subtotal reaches the threshold, the discounted amount does not
        t = rng.choice([x for x in range(5000, 200001, 5000) if after < x <= s] or [0])
    else:
        t = rng.choice([x for x in range(5000, 200001, 5000) if x <= after] or [0])
    if not t:
        return None
    q = (f"An order has {_lines_text(lines)}, with a {d} percent discount on the items. Shipping costs "
         f"{money(ship)} and is free when the amount after the discount is {money(t)} or more. What is the total "
         "to pay?")
    right = after + (ship if after < t else 0)
    wrong = [after + (ship if s < t else 0), after + ship if after >= t else after,
             Fraction(s) + (ship if s < t else 0), Fraction(s) + ship]
    return q, right, wrong, 3, {"lines": [[a, b] for a, b, _ in lines], "discount_pct": d,
                                "threshold": t, "shipping": ship}, money


def _month(rng):
    year, month = rng.choice([(2024, 2), (2025, 2), (2028, 2), (2025, 3), (2024, 4), (2025, 6), (2024, 8),
                              (2025, 9), (2024, 11), (2025, 12)])
    days = ((dt.date(year + month // 12, month % 12 + 1, 1)) - dt.date(year, month, 1)).days
    return year, month, days


def prorated(rng):
    year, month, days = _month(rng)
    start, per_day = rng.randint(5, days - 4), rng.randrange(200, 601, 50)
    rest, name = days - start + 1, MONTHS[month]
    if rng.random() < 0.5:
        old = 0
        q = (f"A software seat costs {money(days * per_day)} a month, charged per day for a part month (the monthly "
             f"price divided by the number of days in that month). A seat is added on {start} {name} {year} and "
             f"billed from that day to the end of {name}, both included. What is the charge?")
        wrong = [per_day * (rest - 1), Fraction(days * per_day * rest, 30), per_day * (rest + 1),
                 per_day * (start - 1)]
    else:
        old = rng.randrange(100, per_day, 50)
        q = (f"A plan costs {money(days * old)} a month and a larger plan {money(days * per_day)} a month; part "
             "months are charged per day (the monthly price divided by the number of days in that month). A customer "
             f"upgrades on {start} {name} {year} and pays the difference from that day to the end of {name}, both "
             "included. What is the upgrade charge?")
        wrong = [(per_day - old) * (rest - 1), Fraction(days * (per_day - old) * rest, 30), per_day * rest,
                 (per_day - old) * (rest + 1)]
    return q, Fraction((per_day - old) * rest), wrong, 3, {"year": year, "month": month, "start_day": start,
                                                           "monthly": days * per_day, "old_monthly": days * old}, money


def overtime(rng):
    rate, hours, mat = rng.randrange(2400, 6001, 200), rng.randint(42, 52), rng.randrange(4000, 20001, 500)
    q = (f"A contractor bills the first 40 hours of a week at {money(rate)} an hour and every hour beyond 40 at one "
         f"and a half times that rate, plus {money(mat)} of materials. One week the contractor worked {hours} hours. "
         "What is the invoice total?")
    extra = hours - 40
    right = Fraction(40 * rate) + Fraction(3 * rate * extra, 2) + mat
    wrong = [Fraction(hours * rate + mat), Fraction(3 * rate * hours, 2) + mat,
             Fraction(40 * rate) + Fraction(3 * rate * extra, 2), Fraction(40 * rate) + Fraction(rate * extra, 2) + mat]
    return q, right, wrong, 3, {"rate": rate, "hours": hours, "materials": mat}, money


def volume_price(rng):
    name, lo, hi = rng.choice([("cables", 300, 900), ("notebooks", 200, 600), ("mugs", 400, 1200),
                               ("USB drives", 500, 1500), ("name badges", 100, 400)])
    unit = rng.randrange(lo, hi + 1, 50)
    cheap, at, t = unit - rng.choice([50, 100]), rng.choice([50, 100, 200]), rng.choice([5, 8, 10])
    qty = at + rng.randint(5, at // 2) if rng.random() < 0.8 else at - rng.randint(1, 5)
    price = cheap if qty >= at else unit
    q = (f"{name[0].upper() + name[1:]} cost {money(unit)} each, or {money(cheap)} each on the whole order when "
         f"{at} or more are ordered. Sales tax of {t} percent is added. What is the total for {qty} {name}?")
    right = Fraction(qty * price * (100 + t), 100)
    wrong = [Fraction((at * unit + (qty - at) * cheap) * (100 + t), 100) if qty >= at
             else Fraction(qty * cheap * (100 + t), 100),
             Fraction(qty * (unit if qty >= at else cheap) * (100 + t), 100), Fraction(qty * price),
             Fraction(qty * price * (100 - t), 100)]
    return q, right, wrong, 3, {"unit": unit, "volume_unit": cheap, "volume_qty": at, "qty": qty, "tax_pct": t}, money


INVOICE_KINDS = [(discount_tax, 6), (coupon_tax, 5), (shipping_threshold, 6), (prorated, 5), (overtime, 5),
                 (volume_price, 5)]


KINDS = {"invoice_multistep": INVOICE_KINDS, "policy_distractor": POLICY_KINDS, "date_unit_reasoning": DATE_KINDS}


# ------------------------------------------------------------------ assembly

def category_items(category: str, rng: random.Random, seen: set[str]) -> list[dict]:
    """``PER_CATEGORY`` items of one category: each kind's count of them, the answer positions balanced."""
    positions = [i % 4 for i in range(PER_CATEGORY)]
    rng.shuffle(positions)
    out = []
    for make, count in KINDS[category]:
        made, tries = 0, 0
        while made < count:
            tries += 1
            assert tries < 1000, f"{category}: {make} draws no usable question"
            got = make(rng)
            if got is None:
                continue
            question, right, wrong, steps, facts, show = got
            if isinstance(right, (int, Fraction)) and not whole(right):
                continue
            right_text = show(right)
            choices = []
            for w in wrong:
                if isinstance(w, (int, Fraction)) and not whole(w):
                    continue                # a slip that lands between cents or units is no option
                text = show(w)
                if text != right_text and text not in choices:
                    choices.append(text)
            if len(choices) < 3 or question in seen:
                continue
            seen.add(question)
            choices = choices[:3]
            rng.shuffle(choices)
            pos = positions[len(out)]
            choices.insert(pos, right_text)
            out.append({"category": category, "question": question, "choices": choices, "answer": pos,
                        "difficulty": steps, "facts": {"kind": getattr(make, "func", make).__name__, **facts}})
            made += 1
    order = list(range(len(out)))          # the kinds mixed, each item keeping its answer position
    rng.shuffle(order)
    return [out[i] for i in order]


def generate(first_id: int, seed: int = SEED) -> list[dict]:
    """The new items, categories interleaved (a task limited to its first N samples meets all three), ids from
    ``bmc-<first_id>`` on."""
    rng = random.Random(seed)
    seen: set[str] = set()
    per = {c: category_items(c, rng, seen) for c in CATEGORIES}
    rows = [per[c][i] for i in range(PER_CATEGORY) for c in CATEGORIES]
    return [{"id": f"bmc-{first_id + i:03d}", **r} for i, r in enumerate(rows)]


def hand_written(path: Path = DATA) -> list[str]:
    """The file's lines that this module did not write, as they are."""
    return [line for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line)["category"] not in CATEGORIES]


def render(path: Path = DATA) -> str:
    kept = hand_written(path)
    new = [json.dumps(r) for r in generate(len(kept) + 1)]
    return "\n".join(kept + new) + "\n"


def main() -> int:
    DATA.write_text(render(), encoding="utf-8")
    print(f"{DATA}: {len(hand_written())} hand-written questions, {PER_CATEGORY * len(CATEGORIES)} generated")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
