"""The machine checks of a turn: how a reply passes each check type (``run_check``), and their helpers. Pure
functions of the check and the reply text; their code version keys the stage that applies them
(``pipeline.stages.outcomes``), so a changed check recomputes every outcome and nothing else."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from pipeline.suites.language import detect_language

log = logging.getLogger(__name__)

CHECK_TYPES = ("contains", "not_contains", "regex", "number", "json", "echo", "json_valid", "length", "language",
               "no_loop", "sections", "format")
# A check's grade: "hard" (the task itself: recall, arithmetic, exact facts) or "graded" (instruction following a
# small model manages at a useful rate: echo, JSON syntax, length, language, no loops, requested sections and
# formats). Reports may show them apart.
GRADES = ("hard", "graded")
LENGTH_UNITS = ("words", "lines", "bullets", "sentences")
FORMAT_KINDS = ("table", "json_only", "greeting")
SECTIONS_PLAIN_MAX_WORDS = 6  # sections: a bare line (no #, bold or colon) is a heading only when this short
SECTIONS_LABEL_MAX_WORDS = 8  # sections: the text before a colon is a heading label only when this short
GREETING_LINES = 5            # format greeting: the salutation is among the first non-blank lines
NO_LOOP_N = 4                 # no_loop: word n-grams compared
NO_LOOP_MAX_REPEATED = 0.3    # no_loop: most of the n-grams that may repeat an earlier one
_REGEX_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE}


# ---------------------------------------------------------------- checks

# A number starts after a non-word character (not inside a word, and not in the middle of a digit group such as the
# "249.50" of "x1,249.50"), or right after an ISO currency code written without a space ("EUR1,249.50").
_CURRENCY_CODES = "EUR USD GBP CAD AUD NZD CHF JPY CNY INR SEK NOK DKK PLN CZK HUF ZAR SGD HKD MXN BRL AED".split()
_NUMBER = re.compile(r"(?:(?<![\w.])(?<!\d,)|" + "|".join(f"(?<=(?<![A-Za-z]){c})" for c in _CURRENCY_CODES) + ")"
                     r"(?:[-+](?=[$€£¥]?\d))?[$€£¥]?\s?\d[\d,]*(?:\.\d+)?")


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
    if ctype == "echo":
        values = [check["value"]] if "value" in check else check["values"]
        found = sum(echoed(v, reply, check.get("case_sensitive", False)) for v in values)
        return found >= check.get("min", len(values))
    if ctype == "json_valid":
        return bool(first_json_object(reply))
    if ctype == "length":
        n = count_units(reply, check["unit"])
        return check.get("min", 0) <= n <= check.get("max", n)
    if ctype == "language":
        return detect_language(reply) == check["value"]
    if ctype == "no_loop":
        return repeated_fraction(reply, check.get("n", NO_LOOP_N)) <= check.get("max_repeated", NO_LOOP_MAX_REPEATED)
    if ctype == "sections":
        found = sum(heading_in(v, reply) for v in check["values"])
        return found >= check.get("min", len(check["values"]))
    if ctype == "format":
        return {"table": has_table, "json_only": is_json_only, "greeting": has_greeting}[check["kind"]](reply)
    raise ValueError(f"unknown check type {ctype!r}")  # validated at load time


def check_label(check: dict, index: int) -> str:
    return check.get("name") or f"{check['type']}#{index}"


def check_grade(check: dict) -> str:
    """'hard' (the default) or 'graded'; see GRADES."""
    return check.get("grade", "hard")


# ---------------------------------------------------------------- graded-check helpers

_TOKEN = re.compile(r"\w+")                     # letters or digits: what a loop repeats
_LIST_MARKER = r"^\s*(?:[-*+\u2022]|\d{1,2}[.)])\s+"    # a bullet or a list number opening a line
_BULLET = re.compile(_LIST_MARKER + r"\S")


def first_json_object(text: str) -> dict | None:
    """The JSON object the reply gives: the one that opens at the first "{" inside a ```json (or ```) fence, else
    at the first "{" of the reply, parsed to its end (text after it is ignored). None when that object does not
    parse (cut off, unquoted values, trailing commas, ...) or is not an object. Unlike extract_json, a broken outer
    object is not rescued by a well-formed object nested inside it."""
    fence = re.search(r"```(?:json)?[ \t]*\n?(.*?)(?:```|\Z)", text, re.DOTALL)
    body = fence.group(1) if fence and "{" in fence.group(1) else text
    start = body.find("{")
    if start == -1:
        return None
    try:
        obj, _ = json.JSONDecoder().raw_decode(body, start)
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def literal_in(value: str, text: str, case_sensitive: bool = False) -> bool:
    """``value`` occurs in ``text`` as written, and not as part of a longer word or number: where the value
    starts (ends) with a letter or digit, the character before (after) it must not be one, so "18" is not found
    in "180" or "2018", "AP-558213" not in "AP-5582130", but "$1,249.50" is found in "total: $1,249.50."."""
    return _standalone(re.escape(value.strip()), value.strip(), text, case_sensitive)


def _standalone(pattern: str, value: str, text: str, case_sensitive: bool) -> bool:
    """``pattern`` (matching ``value`` or a spelling of it) found in ``text`` not inside a longer word or number:
    where ``value`` starts (ends) with a letter or digit, the character before (after) the match must not be one."""
    if value[0].isalnum():
        pattern = r"(?<![^\W_])" + pattern
    if value[-1].isalnum():
        pattern += r"(?![^\W_])"
    return re.search(pattern, text, 0 if case_sensitive else re.IGNORECASE) is not None


_TRAILING_ZEROS = re.compile(r"^([$€£¥]?\d[\d,]*)\.(\d*?)0+$")


def echoed(value: str, text: str, case_sensitive: bool = False) -> bool:
    """An echo check's value in the reply: as written (``literal_in``), or, for an amount written with trailing
    zero decimals ("94.00", "$1,250.50"), the same amount with fewer of them ("94", "94.0", "$1,250.5") where it does
    not go on as a longer number ("94.5", "940" and "94,000" are not "94.00")."""
    if literal_in(value, text, case_sensitive):
        return True
    m = _TRAILING_ZEROS.match(value.strip())
    if not m:
        return False
    whole, digits = m.groups()
    body = re.escape(f"{whole}.{digits}") + "0*" if digits else re.escape(whole) + r"(?:\.0+)?"
    return _standalone(body + r"(?![.,]\d)", value.strip(), text, case_sensitive)


_SENTENCE_END = re.compile(r"[.!?]+(?=[\"')\]]*(?:\s|$))")
_LIST_MARK = re.compile(_LIST_MARKER, re.M)


def count_units(text: str, unit: str) -> int:
    """words: whitespace-separated tokens holding a letter or digit; lines: non-blank lines; bullets: lines that
    start with -, *, +, \u2022 or a list number ("1." / "1)"); sentences: runs ending in ".", "!" or "?" before a
    space or the end (a list number such as "1." and a decimal such as "2.5" end none), plus an unterminated last
    run holding a letter or digit."""
    if unit == "words":
        return sum(1 for w in text.split() if re.search(r"[^\W_]", w))
    if unit == "lines":
        return sum(1 for ln in text.splitlines() if ln.strip())
    if unit == "bullets":
        return sum(1 for ln in text.splitlines() if _BULLET.match(ln))
    if unit == "sentences":
        body = _LIST_MARK.sub("", text).strip()
        if not body:
            return 0
        tail = _SENTENCE_END.split(body)[-1]
        return len(_SENTENCE_END.findall(body)) + (1 if re.search(r"[^\W_]", tail) else 0)
    raise ValueError(f"unknown length unit {unit!r}")


def repeated_fraction(text: str, n: int = 4) -> float:
    """Share of the reply's word n-grams (lower-cased letter/digit tokens, punctuation ignored) that repeat an
    n-gram seen earlier in the reply. Business prose stays under 0.1; a reply stuck in a loop approaches
    1 - period/length (a sentence said three times in a row: about 0.6)."""
    tokens = [t.lower() for t in _TOKEN.findall(text)]
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    return 1 - len(set(grams)) / len(grams)


# In front of a heading: quote marks, a markdown "#" run, a list marker or number (-, *, 1., a), iv.), another "#" run
_LINE_PREFIX = re.compile(r"^\s*(?:>\s*)*(?P<hash>#{1,6}\s+)?"
                          r"(?:(?:[-*+\u2022]|\d{1,2}[.)]|[A-Za-z][.)]|[IVXivx]{1,4}[.)])\s+)?(?P<hash2>#{1,6}\s+)?")
_BOLD_LEAD = re.compile(r"(\*\*|__)(.+?)(?:\1|$)")


def _heading_words(text: str) -> str:
    """Lower-cased words of a heading, '&' read as 'and', punctuation and hyphens as spaces: 'Pre-Checks &
    Sign-off' -> 'pre checks and sign off'."""
    return " ".join(re.sub(r"[\W_]+", " ", text.casefold().replace("&", " and ")).split())


def heading_parts(text: str) -> list[str]:
    """The heading text of every line that is laid out as a heading or a label: a markdown heading (## Timeline),
    a bold lead (**Root cause**, 1. **Procedure**: ...), the text before a colon when that text is short
    (Attendees: ..., - Summary: ...), or a short line of its own that does not end like a sentence (Timeline (UTC)).
    A list marker or number in front is ignored. Prose lines give nothing, so a heading word that only occurs in
    a sentence is not a heading."""
    parts = []
    for line in text.splitlines():
        m = _LINE_PREFIX.match(line)
        marked = bool(m.group("hash") or m.group("hash2"))
        rest = line[m.end():].strip()
        if not rest:
            continue
        bold = _BOLD_LEAD.match(rest)
        if bold:
            part = bold.group(2)
        elif marked:
            part = rest
        elif ":" in rest and len(rest.split(":", 1)[0].split()) <= SECTIONS_LABEL_MAX_WORDS:
            part = rest.split(":", 1)[0]
        elif len(rest.split()) <= SECTIONS_PLAIN_MAX_WORDS and not rest.endswith((".", ",", ";")):
            part = rest
        else:
            continue
        words = _heading_words(part)
        if words:
            parts.append(words)
    return parts


def heading_in(heading: str, text: str) -> bool:
    """``heading`` (the words the user asked for, e.g. 'Root cause') is among the words of one of the reply's
    headings (see heading_parts), as whole words and in order: 'Root cause' is found in '## 4. Root Cause
    Analysis' and in '**Root cause:** a Helm value ...', not in 'The root cause was a typo in the Helm value.'"""
    want = f" {_heading_words(heading)} "
    return any(want in f" {part} " for part in heading_parts(text))


def _table_cells(line: str) -> list[str] | None:
    s = line.strip()
    if "|" not in s:
        return None
    cells = s.strip("|").split("|")
    return cells if len(cells) >= 2 else None


def has_table(text: str) -> bool:
    """A markdown table: a header row of at least two cells, a delimiter row with as many cells (---, :--:), and
    at least one body row."""
    lines = text.splitlines()
    for i in range(len(lines) - 2):
        head, delim, body = (_table_cells(ln) for ln in lines[i:i + 3])
        if head and delim and body and len(delim) == len(head) and \
                all(re.fullmatch(r"\s*:?-+:?\s*", c) for c in delim):
            return True
    return False


def _json_end(text: str, start: int) -> int | None:
    """Index just after the bracket that closes the one at ``start`` (strings and escapes respected); None when
    the text ends first."""
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def is_json_only(text: str) -> bool:
    """The reply is the JSON and nothing else ("Only the JSON"): it opens with "{" or "[" (or with a ``` / ```json
    fence around it), and once the JSON closes, only whitespace and the closing fence follow. A reply cut off
    inside the JSON passes: whether it parses is json_valid's question."""
    s = text.strip()
    fence = re.match(r"```(?:json)?[ \t]*\n", s, re.IGNORECASE)
    body = s[fence.end():].lstrip() if fence else s
    if not body.startswith(("{", "[")):
        return False
    end = _json_end(body, 0)
    if end is None:
        return True
    rest = body[end:].strip()
    if fence and rest.startswith("```"):
        rest = rest[3:].strip()
    return rest == ""


_SALUTATION = re.compile(
    r"(?:dear|hi|hello|hey|good (?:morning|afternoon|evening)|greetings|to whom it may concern|bonjour|madame|"
    r"monsieur|ch[eè]re?|hallo|liebe[rs]?|sehr geehrte[rs]?|hola|estimad[oa]s?|buongiorno|gentil[ei]|ciao|beste|"
    r"geachte|ol[aá]|prezad[oa]s?)\b", re.IGNORECASE)
# "Aoife," / "Ms Brennan," on a line of its own: up to four capitalised words and a comma (not a sign-off)
_ADDRESS_LINE = re.compile(r"(?!(?i:thanks|thank you|regards|best|cheers|sincerely|yours|many thanks)\b)"
                           r"[A-Z][\w.'\u2019-]*(?:\s+[A-Z][\w.'\u2019-]*){0,3},")


def has_greeting(text: str) -> bool:
    """The reply opens like a letter or email: one of its first GREETING_LINES non-blank lines (quote marks and
    markdown stripped) is a salutation ("Dear ...", "Hi ...", "Hello ...", "Good morning ...", "Bonjour", "Sehr
    geehrte ...", ...) or a name and a comma on a line of its own ("Aoife,"). A subject line or a one-line lead-in
    ("Here is the draft:") before it is fine."""
    lines = [re.sub(r"^[\s>*_#\"'\u201c\u201d-]+|[\s*_\"'\u201c\u201d]+$", "", ln) for ln in text.splitlines()]
    lines = [ln for ln in lines if ln][:GREETING_LINES]
    return any(_SALUTATION.match(ln) or _ADDRESS_LINE.fullmatch(ln) for ln in lines)
