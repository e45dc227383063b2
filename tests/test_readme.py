"""The README stays a users' guide that matches the repository: short, with what a run outputs, the own-model command
and the cost section up front; every `make` target, repository path and relative link it names exists; and neither it
nor docs/ reads like a work log. Text only: no network, no project imports."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
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
}


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


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_named_exists(doc: Path):
    missing = sorted(p for p in repo_paths_named(doc.read_text()) if not (ROOT / p).exists())
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
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


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_work_log_voice(doc: Path):
    prose, _ = split_code(doc.read_text())
    found = []
    for number, line in enumerate(prose, 1):
        text = without_inline_code(line)
        for what, pattern in WORK_LOG.items():
            if pattern.search(text):
                found.append(f"{what}: {line.strip()[:100]!r}")
    assert not found, f"{doc.relative_to(ROOT)} reads like a work log:\n" + "\n".join(found)


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
    for phrase in ("I attribute it", "as issue 13 asks", "see #37", "in this session"):
        assert any(p.search(phrase) for p in WORK_LOG.values()), phrase
    for phrase in ("IQ4_XS and Q4_K_M", "llm-compressor#1618", "[x](#the-metrics)"):
        assert not any(p.search(phrase) for p in WORK_LOG.values()), phrase
