"""Long-context recall suite: synthetic business documents with one planted fact ("needle") at a chosen depth.

For every (length, depth) pair `build_recall_suite` writes one evaluation record (prompts/SCHEMA.md): a document
body of `length` tokens (within 2 %, measured with the model's own `encode`), assembled from the templates in
prompts/long_context/templates.json, with a needle sentence whose first token sits at `depth` of the body
(within 0.03). The filler is full of distractors of the same formats (invoice numbers, EUR amounts, dates, names),
while the needle's subject and its answer value occur exactly once. Everything comes from RNGs seeded with
(seed, length, depth), so the same seed and tokenizer give byte-identical output. Stdlib only, no model imports.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import tempfile
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

TEMPLATES = Path(__file__).resolve().parents[2] / "prompts" / "long_context" / "templates.json"
FACT_KINDS = ("invoice", "amount", "date", "person")
SYSTEM = "You are a careful analyst. Answer exactly from the document."
INSTRUCTION = "Read the following document and answer the question at the end.\n\n"
QUESTION_SEP = "\n\nQuestion: "
OVERHEAD_TOKENS = 200        # instruction + question + chat template, reserved when checking max_context
LENGTH_TOL, DEPTH_TOL = 0.02, 0.03
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
_PLACEHOLDER = re.compile(r"\{([a-z]+)(\d?)\}")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z{])")

Encode = Callable[[str], list]


def load_templates(path: str | Path | None = None) -> dict:
    return json.loads(Path(path or TEMPLATES).read_text(encoding="utf-8"))


def date_pattern(answer: str) -> str:
    """Regex accepting '14 March 2025', '14th March, 2025', 'March 14, 2025' and '2025-03-14' (not '4 March')."""
    day, month, year = answer.split()
    mm = MONTHS.index(month) + 1
    sfx = "(?:st|nd|rd|th)?"
    return (rf"(?<!\d){day}{sfx} {month},? {year}|{month} 0?{day}{sfx},? {year}"
            rf"|{year}-{mm:02d}-{int(day):02d}")


def make_check(fact: str, answer: str, name: str) -> dict:
    if fact == "date":
        return {"type": "regex", "pattern": date_pattern(answer), "flags": "i", "name": name}
    check = {"type": "contains", "value": answer, "name": name}
    if fact in ("invoice", "amount"):
        check["case_sensitive"] = True
    return check


def check_matches(check: dict, text: str) -> bool:
    """The subset of pipeline.suites.checks.run_check used here (kept local so this module stays import-light)."""
    if check["type"] == "regex":
        return re.search(check["pattern"], text, re.IGNORECASE if "i" in check.get("flags", "") else 0) is not None
    if check.get("case_sensitive"):
        return check["value"] in text
    return check["value"].casefold() in text.casefold()


class _Values:
    """Draws placeholder values; never a value that contains, or is contained in, a reserved one of its kind."""

    def __init__(self, rng: random.Random, pools: dict, reserved: dict[str, str] | None = None):
        self.rng, self.pools = rng, pools
        self.reserved = {k: v.casefold() for k, v in (reserved or {}).items()}

    def raw(self, kind: str) -> str:
        r, p = self.rng, self.pools
        if kind == "invoice":
            return f"INV-{r.randint(10000, 99999)}"
        if kind == "amount":
            return f"{r.randint(1500, 9_850_000) / 100:,.2f}"
        if kind == "date":
            return f"{r.randint(1, 28)} {r.choice(MONTHS)} {r.choice((2024, 2025))}"
        if kind == "person":
            return f"{r.choice(p['first_names'])} {r.choice(p['last_names'])}"
        if kind == "po":
            return f"PO-{r.randint(100000, 999999)}"
        if kind == "sku":
            return f"{r.choice('ABCDEFGHKLMNPRSTVW')}{r.choice('ABCDEFGHKLMNPRSTVW')}-{r.randint(1000, 9999)}"
        if kind == "pct":
            return f"{r.randint(5, 180) / 10:.1f}%"
        if kind == "int":
            return str(r.randint(2, 48))
        if kind == "quarter":
            return r.choice(("Q1", "Q2", "Q3", "Q4"))
        if kind == "year":
            return str(r.choice((2024, 2025)))
        pool = {"company": "companies", "item": "items", "city": "cities", "dept": "departments"}.get(kind)
        if pool is None:
            raise ValueError(f"unknown placeholder {{{kind}}} in long-context templates")
        return r.choice(p[pool])

    def draw(self, kind: str, taken: set) -> str:
        res = self.reserved.get(kind)
        while True:
            v = self.raw(kind)
            if v not in taken and not (res and (v.casefold() in res or res in v.casefold())):
                return v

    def fill(self, template: str, cache: dict | None = None) -> str:
        cache = {} if cache is None else cache

        def sub(m: re.Match) -> str:
            if m.group(0) not in cache:
                cache[m.group(0)] = self.draw(m.group(1), set(cache.values()))
            return cache[m.group(0)]

        return _PLACEHOLDER.sub(sub, template)

    def paragraph(self, template: str) -> list[str]:
        cache: dict = {}
        return [self.fill(s, cache) for s in _SENTENCE_END.split(template)]


def _render(title: str, paras: list[list[str]]) -> str:
    return "\n\n".join([title] + [" ".join(p) for p in paras if p])


def _insert(paras: list[list[str]], pos: tuple[int, int], needle: str) -> list[list[str]]:
    i, j = pos
    return [p[:j] + [needle] + p[j:] if k == i else p for k, p in enumerate(paras)]


def _build_body(encode: Encode, doc: dict, pools: dict, fact: str, length: int, depth: float, rng: random.Random):
    """(body, needle, question, answer, subject): fits the body to `length` tokens and the needle to `depth`."""
    spec = next(n for n in doc["needles"] if n["fact"] == fact)
    ncompany = rng.choice(pools["companies"])
    subject = spec["subject"].format(ncompany=ncompany, nitem=rng.choice(pools["subject_items"]))
    answer = f"{rng.randint(100000, 9999999) / 100:,.2f}" if fact == "amount" else _Values(rng, pools).raw(fact)
    needle = spec["text"].format(subject=subject, value=answer)
    question = spec["question"].format(subject=subject)
    values = _Values(rng, pools, {"company": ncompany, fact: answer})
    title, lo, hi = values.fill(doc["title"]), length * (1 - LENGTH_TOL), length * (1 + LENGTH_TOL)
    needle_tokens, paras, deck = len(encode(" " + needle)), [], []

    def ntok(candidate: list[list[str]]) -> int:   # body tokens once the needle is in
        return len(encode(_render(title, candidate))) + needle_tokens

    # Whole paragraphs while they fit; then the sentence prefix of a further paragraph that lands closest to length.
    for _ in range(1000):
        if not deck:
            deck.extend(rng.sample(doc["filler"], len(doc["filler"])))
        para = values.paragraph(deck.pop())
        if ntok(paras + [para]) <= length:
            paras.append(para)
            continue
        counts = {k: ntok(paras + [para[:k]]) for k in range(len(para))}
        fits = [k for k, n in counts.items() if lo <= n <= hi and (k or paras)]
        if fits:
            k = min(fits, key=lambda k: abs(counts[k] - length))
            paras = paras + [para[:k]] if k else paras
            break
    else:
        raise RuntimeError(f"could not fit a {length}-token body")

    # Insertion points are sentence boundaries; the needle's start token grows with the position, so bisect it.
    points = [(i, j) for i, p in enumerate(paras) for j in range(len(p))] + [(len(paras) - 1, len(paras[-1]))]
    total = len(encode(_render(title, _insert(paras, points[0], needle))))

    def place(c: int) -> tuple[str, float]:
        body = _render(title, _insert(paras, points[c], needle))
        return body, len(encode(body[:body.index(needle)])) / total

    a, b = 0, len(points) - 1
    while a < b:
        mid = (a + b) // 2
        a, b = (mid + 1, b) if place(mid)[1] < depth else (a, mid)
    best = min((place(c) for c in sorted({max(a - 1, 0), a})), key=lambda bd: abs(bd[1] - depth))
    return best[0], needle, question, answer, subject


def _record(encode: Encode, templates: dict, doc_kind: str, fact: str, length: int, depth: float, seed: int,
            answer_tokens: int) -> dict:
    rng = random.Random(f"longctx:{seed}:{length}:{depth}")
    doc, pools = templates["documents"][doc_kind], templates["pools"]
    for _ in range(20):
        body, needle, question, answer, subject = _build_body(encode, doc, pools, fact, length, depth, rng)
        at = body.index(needle)
        n_body, n_start = len(encode(body)), len(encode(body[:at]))
        pct = round(depth * 100)
        check = make_check(fact, answer, f"recall {fact} at {pct}% of {length}")
        rest = body.replace(needle, "")
        if (abs(n_body - length) <= LENGTH_TOL * length and abs(n_start / n_body - depth) <= DEPTH_TOL
                and body.count(subject) == 1 and body.casefold().count(answer.casefold()) == 1
                and check_matches(check, needle) and not check_matches(check, rest)):
            break
    else:
        raise RuntimeError(f"could not build a valid {length}-token document at depth {depth}")
    return {
        "id": f"lc-{length}-d{pct:02d}-{fact}", "category": "long_context_recall", "system": SYSTEM,
        "turns": [{"user": INSTRUCTION + body + QUESTION_SEP + question, "max_new_tokens": answer_tokens,
                   "checks": [check]}],
        "meta": {"length_tokens": length, "depth": depth, "fact_kind": fact, "answer": answer,
                 "body_tokens": n_body, "needle_token_start": n_start, "needle_depth": round(n_start / n_body, 4),
                 "doc_kind": doc_kind, "subject": subject},
    }


def build_recall_suite(encode: Encode, lengths=(1024, 2048, 4096), depths=(0.1, 0.3, 0.5, 0.7, 0.9), seed=0,
                       max_context=None, answer_tokens=32, templates_path=None) -> list[dict]:
    """One record per (length, depth); document and fact kinds cycle over the grid position, so dropping a length
    that exceeds `max_context` leaves the other records unchanged."""
    templates = load_templates(templates_path)
    doc_kinds = list(templates["documents"])
    records = []
    for li, length in enumerate(lengths):
        if max_context is not None and length + OVERHEAD_TOKENS + answer_tokens > max_context:
            log.warning("long-context recall: dropping length %d (+%d overhead +%d answer tokens > max_context %d)",
                        length, OVERHEAD_TOKENS, answer_tokens, max_context)
            continue
        for di, depth in enumerate(depths):
            i = li * len(depths) + di
            fact = FACT_KINDS[i % len(FACT_KINDS)]
            doc_kind = doc_kinds[(i + i // len(FACT_KINDS)) % len(doc_kinds)]
            records.append(_record(encode, templates, doc_kind, fact, length, depth, seed, answer_tokens))
    return records


def write_suite(path: str | Path, records: list[dict]) -> Path:
    """Write JSONL atomically: a temp file in the same folder, then os.replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def generate(path: str | Path, encode: Encode, **kw) -> list[dict]:
    records = build_recall_suite(encode, **kw)
    write_suite(path, records)
    return records
