"""The README stays a users' guide that matches the repository: short, with what a run outputs, the own-model command
and the cost section up front; every `make` target, repository path and relative link it names exists; and neither it
nor docs/ nor results/README.md reads like a work log (a run's commit, machine and date belong in the provenance
table of results/README.md, nowhere in prose). Text only: no network, no project imports."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
RESULTS_README = ROOT / "results" / "README.md"
MAX_README_LINES = 300

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
REPO_DIRS = ("conf", "pipeline", "docs", "results", "scripts", "tests", "prompts", "schema")
REPO_PATH = re.compile(r"^(?:\./)?(?:%s)/[\w./+-]*$" % "|".join(REPO_DIRS))
ROOT_FILES = re.compile(r"^(?:README\.md|Makefile|pyproject\.toml)$")
PLACEHOLDER = re.compile(r"<|>|\*|\.\.\.|…|\bNAME\b|\bKEY\b|\bVARIANT\b|\bFILE\b|\bPACKAGE\b|\bRUN\b")
WORK_LOG = {
    "first person 'I'": re.compile(r"\bI\b"),
    "a numbered issue": re.compile(r"[Ii]ssues? #?\d+"),
    "a bare issue number such as #37": re.compile(r"(?<![\w/&-])#\d+\b"),
    "'session'": re.compile(r"\bsessions?\b", re.IGNORECASE),
    # 7-40 hex digits with at least one digit and one letter a-f, as a whole word: a commit hash or a cpu key, not
    # "decade", "f16", "bf16" or "q4_0"
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),
    "a date": re.compile(r"\b\d{4}-\d{2}-\d{2}\b"),
    "a day": re.compile(r"\b(?:same day|slower day|days? later|next day|today|yesterday)\b", re.IGNORECASE),
    "'this machine'": re.compile(r"\bthis machine\b", re.IGNORECASE),
}
# What the provenance table of results/README.md (its Markdown table rows) may carry.
PROVENANCE = {"a commit hash", "a date"}


def split_code(text: str) -> tuple[list[str], list[str]]:
    """(prose lines, code-block lines) of a Markdown text."""
    prose, code, inside = [], [], False
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside
            continue
        (code if inside else prose).append(line)
    return prose, code


def without_inline_code(line: str) -> str:
    return INLINE_CODE.sub("", line)


def makefile_targets() -> set[str]:
    """Targets of the Makefile and of the fragments it includes (mk/*.mk)."""
    text = "\n".join(p.read_text() for p in [ROOT / "Makefile", *sorted((ROOT / "mk").glob("*.mk"))])
    targets = set()
    for m in re.finditer(r"^\.PHONY:(.*)$", text, flags=re.M):
        targets.update(m.group(1).split())
    for m in re.finditer(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, flags=re.M):
        targets.add(m.group(1))
    return targets


def make_targets_named(text: str) -> set[str]:
    """The targets of `make X` in inline code and of command lines starting with `make` in code blocks (a comment
    after `#` is prose, not a command)."""
    prose, code = split_code(text)
    commands = [c for line in prose for c in INLINE_CODE.findall(line)]
    commands += [line.split("#", 1)[0] for line in code]
    named = set()
    for command in commands:
        for m in re.finditer(r"(?:^|[;&|]\s*)make((?:\s+[^\s;&|]+)*)", command.strip()):
            for word in m.group(1).split():
                if "=" in word or word.startswith("-"):
                    continue
                named.add(word)
    return named


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: Markdown markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = unicodedata.normalize("NFC", text).strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = split_code(path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for line in prose:
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_readme_is_at_most_300_lines():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; keep it a guide of at most {MAX_README_LINES}"


def test_readme_opening_names_outputs_own_model_and_cost():
    head = "\n".join(README.read_text().splitlines()[:60])
    assert "report.md" in head and "summary.json" in head, "the first 60 lines should say what a run writes"
    assert "make compare MODEL=" in head, "the first 60 lines should show how to compare one's own model"
    cost = [a for a in re.findall(r"\]\(#([^)]+)\)", head) if "cost" in a]
    assert cost, "the first 60 lines should link to the cost section"
    assert set(cost) <= anchors(README), f"cost link(s) {cost} point to no heading of README.md"


def test_every_make_target_the_readme_names_exists():
    named = make_targets_named(README.read_text())
    assert named, "the README should name make targets"
    missing = sorted(named - makefile_targets())
    assert not missing, f"README.md names make targets the Makefile lacks: {missing}"


def repo_paths_named(text: str) -> set[str]:
    """Repository paths the text names in inline code or as link targets (placeholders and globs left out)."""
    candidates = set()
    prose, _ = split_code(text)
    for line in prose:
        for span in INLINE_CODE.findall(line):
            candidates.update(span.split())
        candidates.update(t.split("#", 1)[0] for t in LINK.findall(line))
    out = set()
    for c in candidates:
        c = c.strip("`'\",;:()")
        if not c or PLACEHOLDER.search(c) or "=" in c:
            continue
        if REPO_PATH.match(c) or ROOT_FILES.match(c):
            out.add(c)
    return out


@pytest.mark.parametrize("doc", [README, *DOCS, RESULTS_README], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_named_exists(doc: Path):
    missing = sorted(p for p in repo_paths_named(doc.read_text()) if not (ROOT / p).exists())
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", [README, *DOCS, RESULTS_README], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    prose, _ = split_code(doc.read_text())
    broken = []
    for line in prose:
        for target in LINK.findall(without_inline_code(line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):       # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            dest = (doc.parent / path_part).resolve() if path_part else doc
            if not dest.exists():
                broken.append(target)
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{target} (no such heading)")
    assert not broken, f"{doc.relative_to(ROOT)} links to what does not exist: {broken}"


def test_docs_exist():
    assert DOCS, "docs/ should hold the material moved out of the README"


def work_log_voice(text: str, provenance_table: bool = False) -> list[str]:
    """What reads like a work log in the prose of a Markdown text (code blocks and inline code left out). With
    ``provenance_table`` its table rows may carry commit hashes and dates (results/README.md's provenance table)."""
    prose, _ = split_code(text)
    found = []
    for line in prose:
        stripped = without_inline_code(line)
        in_table = provenance_table and line.lstrip().startswith("|")
        for what, pattern in WORK_LOG.items():
            if in_table and what in PROVENANCE:
                continue
            if pattern.search(stripped):
                found.append(f"{what}: {line.strip()[:100]!r}")
    return found


@pytest.mark.parametrize("doc", [README, *DOCS, RESULTS_README], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_work_log_voice(doc: Path):
    found = work_log_voice(doc.read_text(), provenance_table=doc == RESULTS_README)
    assert not found, f"{doc.relative_to(ROOT)} reads like a work log:\n" + "\n".join(found)


def test_results_readme_has_one_provenance_table():
    """One table of the runs, with each run's label, commit, machine and date."""
    prose, _ = split_code(RESULTS_README.read_text())
    headers = [line for line in prose if line.startswith("| label |")]
    assert len(headers) == 1, "results/README.md should hold one provenance table (a header row starting '| label |')"
    for column in ("commit", "machine", "date"):
        assert f"| {column} |" in headers[0] + "|", f"the provenance table lacks a {column} column"


def test_the_checks_catch_what_they_are_for():
    """The helpers themselves: a fenced block is not prose, make targets are read from code, placeholders are
    skipped, and the voice patterns fire on the phrases they exist for."""
    prose, code = split_code("a\n```bash\nmake compare  # then make report\n```\nb")
    assert prose == ["a", "b"] and code == ["make compare  # then make report"]
    assert make_targets_named("Run `make load LOAD_ARGS=x` or\n```\nmake bench ARGS=y # make nightly\n```") == {
        "load", "bench"}
    assert repo_paths_named("See `conf/variant/NAME.yaml`, `docs/<x>.md` and [m](docs/methodology.md#a).") == {
        "docs/methodology.md"}
    assert slug("Against llama.cpp's own tools (`make bench`)") == "against-llamacpps-own-tools-make-bench"
    for phrase in ("I attribute it", "as issue 13 asks", "see #37", "in this session", "at commit 2ca2279",
                   "cpu key d33f879f", "fixed in 5bee80c.", "on 2026-12-05", "the same day", "on a slower day",
                   "two days later", "a day later", "the next day", "rerun today", "as yesterday",
                   "on this machine", "This machine's bandwidth"):
        assert any(p.search(phrase) for p in WORK_LOG.values()), phrase
    for phrase in ("IQ4_XS and Q4_K_M", "llm-compressor#1618", "[x](#the-metrics)", "a decade", "f16 and bf16",
                   "gguf_q4_0", "Q4_0 and q8_0 KV", "add 1234567 rows", "deadbeef", "sha256", "fp16 1e-03",
                   "run default-xeon", "`2ca2279` in code", "within 24 hours", "on the machine it runs on",
                   "a day's work"):
        assert not any(p.search(without_inline_code(phrase)) for p in WORK_LOG.values()), phrase
    table = "| label | commit | date |\n|---|---|---|\n| default-xeon | c252421 | 2026-12-06 |\n"
    assert work_log_voice(table, provenance_table=True) == []
    assert len(work_log_voice(table)) == 2
    assert work_log_voice(table + "Run at c252421 on 2026-12-06.\n", provenance_table=True) == [
        "a commit hash: 'Run at c252421 on 2026-12-06.'", "a date: 'Run at c252421 on 2026-12-06.'"]
    assert work_log_voice("| x | the same day on this machine |", provenance_table=True) == [
        "a day: '| x | the same day on this machine |'", "'this machine': '| x | the same day on this machine |'"]
