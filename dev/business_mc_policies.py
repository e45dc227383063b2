"""business_mc's ``policy_distractor`` items (``dev.business_mc_hard`` assembles them): a short policy of several
clauses with exceptions, then a case that hinges on one clause. The right option follows the policy; each wrong
one is what a reader gets who applies another clause, misses the exception or counts from the wrong point.

Each kind returns (question, right, wrong options in order of preference, steps, facts, how an option is shown),
or None to draw again; ``facts`` hold the case in integers, strings and booleans."""

from __future__ import annotations

import random
from fractions import Fraction


def _money(dollars) -> str:
    c = int(Fraction(dollars) * 100)
    return f"{c // 100:,}.{c % 100:02d} dollars"


RETURNS = ("Returns policy: unused items can be returned within 30 days of delivery for a full refund. Opened "
           "electronics can be returned within 14 days of delivery, less a 15 percent restocking fee. Sale items can "
           "be returned within 30 days of delivery for store credit only. Loyalty members get 60 days instead of 30 "
           "under every clause, but the 14-day limit on opened electronics applies to everyone.")
RETURN_OUTCOMES = {"full": "a full refund of the price", "fee": "a refund less a 15 percent fee",
                   "credit": "store credit for the full price", "refused": "the return is not accepted"}
RETURN_ITEMS = {"unused": ["an unused jacket", "an unused coffee machine", "unused running shoes"],
                "electronics": ["an opened laptop", "an opened pair of headphones", "an opened tablet"],
                "sale": ["a sale item (a lamp that was never used)", "a sale item (an unused rug)"]}


def returns(rng: random.Random):
    item = rng.choice(list(RETURN_ITEMS))
    member = rng.random() < 0.5
    days = rng.choice({"unused": [12, 21, 35, 45, 55, 75], "electronics": [9, 12, 20, 25, 40],
                       "sale": [10, 25, 40, 50, 70]}[item])
    limit = 60 if member else 30
    if item == "electronics":
        right = "fee" if days <= 14 else "refused"
        wrong = ["full" if days <= 14 else "fee", "refused" if days <= 14 else "full", "credit"]
    else:
        ok = "full" if item == "unused" else "credit"
        right = ok if days <= limit else "refused"
        wrong = ["refused" if right == ok else ok, "credit" if item == "unused" else "full", "fee"]
    who = "A loyalty member" if member else "A customer who is not a loyalty member"
    q = (f"{RETURNS} {who} returns {rng.choice(RETURN_ITEMS[item])} {days} days after delivery. What does the "
         "customer get?")
    return q, right, wrong, 2, {"item": item, "days": days, "member": member}, RETURN_OUTCOMES.get


EXPENSES = ("Expense policy: meals are reimbursed up to 40 dollars a day. A meal with a client that a manager approved "
            "in advance is reimbursed up to 120 dollars instead. Alcohol is never reimbursed. A claim over 25 dollars "
            "without a receipt is not reimbursed at all.")


def expenses(rng: random.Random):
    client = rng.random() < 0.7
    approved = client and rng.random() < 0.7
    receipt = rng.random() < 0.8
    claim = rng.randrange(30, 181, 5) if receipt or rng.random() < 0.7 else rng.randrange(10, 26, 1)
    alcohol = rng.choice([0, 10, 15, 20, 25, 30, 35]) if rng.random() < 0.8 else 0
    if alcohol >= claim:
        return None
    eligible, cap = claim - alcohol, 120 if approved else 40
    right = 0 if claim > 25 and not receipt else min(eligible, cap)
    wrong = [min(claim, cap), min(eligible, 40 if approved else 120), eligible, 0, claim]
    meal = ("dinner with a client" + (", approved in advance by a manager" if approved else ", not approved in "
                                      "advance") if client else "lunch on a working day")
    q = (f"{EXPENSES} An employee claims {claim} dollars for a {meal}, "
         + ("with a receipt" if receipt else "without a receipt")
         + (f"; {alcohol} dollars of the bill was wine" if alcohol else "; the bill had no alcohol on it")
         + ". How much is reimbursed?")
    return q, right, wrong, 3, {"claim": claim, "alcohol": alcohol, "client": client, "approved": approved,
                                "receipt": receipt}, _money


APPROVALS = ("Purchasing policy: purchases under 500 dollars need no approval. Purchases from 500 to 5,000 dollars "
             "need the department head's approval. Purchases over 5,000 dollars need the finance director's approval. "
             "Software, whatever its price, needs the IT security team's approval instead of any other.")
APPROVERS = {"none": "no approval is needed", "head": "the department head", "director": "the finance director",
             "security": "the IT security team"}
# what a team buys, at prices it could cost
GOODS = {"software": {"a design software licence": [120, 300, 450, 1200, 2500],
                      "a year of project-tracking software": [450, 1200, 2500, 7800],
                      "an accounting software package": [300, 500, 2500, 12000]},
         "other": {"a laptop": [450, 500, 1200, 2500], "six office chairs": [450, 500, 1200, 2500, 5000],
                   "a projector": [300, 450, 500, 1200], "a used delivery van": [5000, 7800, 12000, 30000],
                   "a conference table": [500, 1200, 2500, 5000, 7800]}}


def approvals(rng: random.Random):
    kind = "software" if rng.random() < 0.45 else "other"
    good = rng.choice(sorted(GOODS[kind]))
    price = rng.choice(GOODS[kind][good])
    by_price = "none" if price < 500 else "head" if price <= 5000 else "director"
    right = "security" if kind == "software" else by_price
    wrong = [by_price if kind == "software" else "security", *(k for k in ("head", "director", "none")
                                                               if k != by_price)]
    q = (f"{APPROVALS} A team wants to buy {good} for {price:,} dollars. Who must approve the "
         "purchase?")
    return q, right, wrong, 2, {"item": kind, "price": price}, APPROVERS.get


WARRANTY = ("Warranty terms: parts are covered for 24 months from purchase. Labour is covered for the first 12 months "
            "only. Batteries are covered for 6 months. Damage from a drop or from water is never covered.")
COVER = {"both": "parts and labour are both covered", "parts": "parts are covered, labour is charged",
         "labour": "labour is covered, parts are charged", "nothing": "neither parts nor labour are covered"}
FAULTS = {"battery": "its battery no longer holds a charge", "screen": "its screen shows dead pixels",
          "keyboard": "several keys of its keyboard stopped working",
          "dropped": "it was dropped and its screen cracked",
          "water": "coffee was spilled into it and it fails to start"}


def warranty(rng: random.Random):
    fault = rng.choice(list(FAULTS))
    months = rng.choice([3, 5, 8, 10, 14, 18, 20, 27, 30])
    damage = fault in ("dropped", "water")
    parts = not damage and months <= (6 if fault == "battery" else 24)
    labour = not damage and months <= 12
    right = {(True, True): "both", (True, False): "parts", (False, True): "labour", (False, False): "nothing"}[
        (parts, labour)]
    loose = {(True, True): "both", (True, False): "parts", (False, True): "labour", (False, False): "nothing"}[
        (months <= 24, months <= 12)]             # the reader who misses the battery or the damage clause
    wrong = [loose, *(k for k in ("parts", "both", "nothing", "labour") if k != loose)]
    q = (f"{WARRANTY} A laptop bought {months} months ago is brought in for repair: {FAULTS[fault]}. What does the "
         "warranty cover?")
    return q, right, wrong, 2, {"fault": fault, "months": months}, COVER.get


LATE = ("Payment terms: invoices are due 30 days after the invoice date. For each started period of 30 days past "
        "the due date, a late fee of 2 percent of the invoice amount is added. Registered charities are never "
        "charged a late fee, and neither are invoices under 100 dollars.")


def late_fee(rng: random.Random):
    amount = rng.choice([80, 95, 450, 600, 1250, 2400, 3800, 5000])
    paid = rng.choice([25, 41, 58, 64, 75, 95, 118])
    charity = rng.random() < 0.25
    late = max(paid - 30, 0)
    periods = -(-late // 30)
    fee = Fraction(amount * 2 * periods, 100)
    exempt = charity or amount < 100
    right = 0 if exempt else fee
    wrong = [fee if exempt else 0, Fraction(amount * 2 * -(-paid // 30), 100), Fraction(amount * 2 * (late // 30), 100),
             Fraction(amount * 2, 100), Fraction(amount * 2 * (periods + 1), 100)]
    who = "a registered charity" if charity else "a retail company"
    q = (f"{LATE} An invoice of {amount:,} dollars to {who} is paid {paid} days after the invoice date. What late "
         "fee is charged?")
    return q, right, wrong, 3, {"amount": amount, "paid_day": paid, "charity": charity}, _money


DELIVERY = ("Delivery policy: orders placed before 2 pm on a business day are dispatched that day; orders placed "
            "later are dispatched the following business day. Standard delivery arrives 4 business days after "
            "dispatch and express delivery 1 business day after dispatch. Deliveries to an island take 2 more "
            "business days with either service. Business days are Monday to Friday.")
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]


def arrival(b: int) -> str:
    """A business-day index counted from the order's Monday, as a weekday in that week or a later one."""
    week = ["in the same week", "in the following week", "two weeks later"][b // 5]
    return f"{DAYS[b % 5]} {week}"


def delivery(rng: random.Random):
    service, island = rng.choice(["standard", "express"]), rng.random() < 0.5
    day, hour = rng.randint(0, 4), rng.choice([9, 11, 13, 15, 16, 17])
    after = hour >= 14
    transit = (4 if service == "standard" else 1) + (2 if island else 0)
    right = day + after + transit
    wrong = [day + transit, day + after + transit - 2 if island else right + 2,
             day + after + (1 if service == "standard" else 4) + (2 if island else 0), right + 1, right - 1]
    clock = f"{hour % 12 or 12} {'am' if hour < 12 else 'pm'}"
    order = "A standard order" if service == "standard" else "An express order"
    where = "an island address" if island else "a mainland address"
    q = f"{DELIVERY} {order} to {where} is placed at {clock} on a {DAYS[day]}. When does it arrive?"
    return q, right, [w for w in wrong if 0 <= w < 15], 3, {"service": service, "island": island,
                                                           "weekday": DAYS[day], "hour": hour}, arrival


POLICY_KINDS = [(returns, 6), (expenses, 6), (approvals, 5), (warranty, 5), (late_fee, 5), (delivery, 5)]
