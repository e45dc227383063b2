"""business_mc's ``date_unit_reasoning`` items (``dev.business_mc_hard`` assembles them): a due date some calendar
or business days after a date (across month ends, the end of February in leap and common years, holidays), a call's
time across two UTC offsets, a quantity converted in two steps.

Each kind returns (question, right, wrong options in order of preference, steps, facts, how an option is shown),
or None to draw again; ``facts`` hold the inputs in integers and strings (dates as ISO text)."""

from __future__ import annotations

import datetime as dt
from fractions import Fraction
from functools import partial

MONTHS = [None, "January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def whole(x) -> bool:
    return Fraction(x).denominator == 1 and x >= 0


def long_date(d: dt.date, weekday: bool = False) -> str:
    return (WEEKDAYS[d.weekday()] + " " if weekday else "") + f"{d.day} {MONTHS[d.month]} {d.year}"


def _thirty_day_months(start: dt.date, n: int) -> dt.date | None:
    """The slip of a reader who takes every month to have 30 days."""
    y, m, d = start.year, start.month, start.day + n
    while d > 30:
        d -= 30
        y, m = (y + 1, 1) if m == 12 else (y, m + 1)
    try:
        return dt.date(y, m, d)
    except ValueError:
        return None


def due_calendar(rng, february: str | None = None):
    """``february``: "leap" or "common" to start late in February of such a year, so the span crosses its end."""
    if february:
        start = dt.date(rng.choice([2024, 2028] if february == "leap" else [2023, 2025, 2026]), 2,
                        rng.randint(16, 28))
    else:
        year, month = rng.choice([(2024, 1), (2024, 4), (2025, 6), (2024, 9), (2025, 11), (2024, 12), (2025, 12),
                                  (2027, 12)])
        start = dt.date(year, month, rng.randint(12, 28))
    n = rng.choice([10, 14, 15, 21, 30, 45, 60, 90])
    due = start + dt.timedelta(days=n)
    q = (f"An invoice dated {long_date(start)} is due {n} days after its date. On which date is it due?")
    wrong = []
    feb = next((y for y in range(start.year, due.year + 1) if start < dt.date(y, 3, 1) <= due), None)
    if feb is not None:                     # the span crosses the end of February: taken as the other length
        leap = (dt.date(feb, 3, 1) - dt.date(feb, 2, 1)).days == 29
        wrong.append(due + dt.timedelta(days=1 if leap else -1))
    wrong += [_thirty_day_months(start, n), *(due + dt.timedelta(days=k) for k in (-1, 1, -2, 2))]
    return q, due, [w for w in wrong if w], 2, {"start": start.isoformat(), "days": n}, long_date


HOLIDAY_SETS = [("25 and 26 December are public holidays", ["12-25", "12-26"]),
                ("1 January is a public holiday", ["01-01"]),
                ("25 December and 1 January are public holidays", ["12-25", "01-01"]),
                ("the company is closed on 4 July", ["07-04"]),
                ("1 May is a public holiday", ["05-01"])]


def _add_business(start: dt.date, n: int, holidays: set) -> dt.date:
    d = start
    while n:
        d += dt.timedelta(days=1)
        if d.weekday() < 5 and d not in holidays:
            n -= 1
    return d


def due_business(rng):
    text, days = rng.choice(HOLIDAY_SETS)
    year = rng.choice([2024, 2025, 2026])
    first = dt.date(year, int(days[0][:2]), int(days[0][3:]))
    start = first - dt.timedelta(days=rng.randint(2, 8))
    while start.weekday() > 4:
        start -= dt.timedelta(days=1)
    holidays = set()
    for md in days:
        h = dt.date(start.year, int(md[:2]), int(md[3:]))
        holidays.add(h if h >= start else dt.date(start.year + 1, h.month, h.day))
    n = rng.choice([3, 5, 7, 10])
    due = _add_business(start, n, holidays)
    if not any(start < h <= due and h.weekday() < 5 for h in holidays):     # no holiday to skip on the way
        return None
    q = (f"An order is confirmed on {long_date(start, True)}. Payment is due {n} business days after that "
         f"(business days are Monday to Friday, and {text}). On which date is payment due?")
    wrong = [_add_business(start, n, set()), start + dt.timedelta(days=n), _add_business(start, n - 1, holidays),
             _add_business(start, n + 1, holidays)]
    return (q, due, wrong, 3, {"start": start.isoformat(), "days": n,
                               "holidays": sorted(h.isoformat() for h in holidays)}, lambda d: long_date(d, True))


CITIES = [("Tokyo", 540), ("New York", -240), ("London", 60), ("Mumbai", 330), ("Sydney", 600),
          ("Los Angeles", -420), ("Berlin", 120), ("Singapore", 480), ("Sao Paulo", -180), ("Dubai", 240)]


def utc(offset: int) -> str:
    sign, a = ("+" if offset >= 0 else "-"), abs(offset)
    return f"UTC{sign}{a // 60}" + (f":{a % 60:02d}" if a % 60 else "")


def clock(minutes: int, day: int) -> str:
    day, minutes = day + minutes // 1440, minutes % 1440
    return f"{minutes // 60:02d}:{minutes % 60:02d} on {WEEKDAYS[day % 7]}"


def timezone(rng):
    (a, fa), (b, fb) = rng.sample(CITIES, 2)
    if abs(fa - fb) < 300:
        return None
    t, day = rng.randrange(0, 1440, 30), rng.randint(0, 4)
    q = (f"A video call starts at {t // 60:02d}:{t % 60:02d} on {WEEKDAYS[day]} in {a} ({utc(fa)}). What are the "
         f"local time and day in {b} ({utc(fb)}) when it starts?")
    local = t - fa + fb
    shifted = (local // 1440) != 0
    # the offsets' difference the wrong way, the right clock on the wrong day, the start taken as UTC, the UTC time
    wrong = [clock(t + fa - fb, day), clock(local % 1440, day if shifted else day + 1), clock(t + fb, day),
             clock(t - fa, day)]
    facts = {"time": f"{t // 60:02d}:{t % 60:02d}", "weekday": WEEKDAYS[day], "from_offset": fa, "to_offset": fb}
    return q, clock(local, day), wrong, 3, facts, str


def number(x: Fraction, unit: str) -> str:
    return f"{int(x):,} {unit}"


def units(rng, sub: str):
    if sub == "bottles":
        a, b, c = rng.choice([24, 30, 40, 48, 60]), rng.choice([6, 12, 20, 24]), rng.choice([250, 330, 500, 750])
        q = (f"A pallet holds {a} cases; each case holds {b} bottles of {c} millilitres. How many litres does one "
             "pallet hold?")
        right, wrong, unit = Fraction(a * b * c, 1000), [Fraction(a * b * c, 100), Fraction(b * c, 1000),
                                                         Fraction(a * b * c, 10000), Fraction(a * c, 1000)], "litres"
    elif sub == "sacks":
        a, c = rng.randint(12, 60), rng.choice([250, 400, 500, 800, 1250])
        q = (f"A shipment of {a / 10:g} tonnes of coffee is packed in bags of {c} grams. How many bags are needed?")
        right, unit = Fraction(a * 100000, c), "bags"
        wrong, b = [right / 10, right * 10, right / 1000, right * 100], 0
    elif sub == "speed":
        a, b, c = rng.choice([36, 48, 54, 66, 72, 84, 90, 102]), 0, 0
        q = f"A delivery van keeps a steady {a} kilometres per hour. How many metres does it cover in one minute?"
        right, unit = Fraction(a * 1000, 60), "metres"
        wrong = [Fraction(a * 1000), Fraction(a * 100, 6) * 10, Fraction(a * 1000, 3600), Fraction(a * 60)]
    elif sub == "filling":
        a, b, c = rng.choice([35, 45, 48, 55, 64, 75]), rng.randint(2, 5), rng.choice([10, 15, 20, 25, 40, 45])
        q = (f"A machine fills {a} bottles a minute. How many bottles does it fill in {b} hours and {c} minutes of "
             "running?")
        right, unit = Fraction(a * (60 * b + c)), "bottles"
        wrong = [Fraction(a * 60 * b), Fraction(a * (100 * b + c)), Fraction(a * (60 * b + c) * 60),
                 Fraction(a * (b + c))]
    else:
        a, b, c = rng.choice([12, 15, 18, 20, 24, 30]), rng.choice([8, 10, 12, 16, 20]), rng.choice([20, 25, 40, 50])
        q = (f"A storeroom floor measures {a} metres by {b} metres. How many square tiles of {c} centimetres a side "
             "cover it?")
        right, unit = Fraction(a * b * 10000, c * c), "tiles"
        wrong = [Fraction(a * b * 100, c), right * 10, Fraction(2 * (a + b) * 100, c), right / 10]
    if not whole(right):
        return None
    return q, right, [w for w in wrong if whole(w)], 2, {"unit_kind": sub, "a": a, "b": b, "c": c}, \
        lambda x: number(x, unit)


DATE_KINDS = [(partial(due_calendar, february="leap"), 3), (partial(due_calendar, february="common"), 2),
              (due_calendar, 3), (due_business, 8), (timezone, 8), (partial(units, sub="bottles"), 2),
              (partial(units, sub="sacks"), 1), (partial(units, sub="speed"), 2), (partial(units, sub="filling"), 2),
              (partial(units, sub="tiles"), 1)]
