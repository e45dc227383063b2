"""The long-context recall suite generator, measured with the embedded model's real (SmolLM2) tokenizer."""

import json
import logging
import re
from pathlib import Path

import pytest

from pipeline.suites import recall_docs as longctx
from pipeline.suites.records import parse_record
from pipeline.suites.checks import run_check

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
_DATE = r"\b\d{1,2} (?:%s) \d{4}\b" % "|".join(longctx.MONTHS)


@pytest.fixture(scope="module")
def encode(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def suite(encode):
    return (longctx.build_recall_suite(encode, lengths=(1024, 2048), depths=DEPTHS)
            + longctx.build_recall_suite(encode, lengths=(4096,), depths=(0.5,)))


def body_of(record: dict) -> str:
    user = record["turns"][0]["user"]
    assert user.startswith(longctx.INSTRUCTION)
    return user[len(longctx.INSTRUCTION):user.rindex(longctx.QUESTION_SEP)]


def needle_of(record: dict, body: str) -> str:
    """The needle sentence: the one sentence that carries the subject."""
    return next(s for s in re.split(r"(?<=\.)\s+", body) if record["meta"]["subject"] in s)


def distractors(fact: str, text: str) -> list[str]:
    pools = longctx.load_templates()["pools"]
    pattern = {"invoice": r"INV-\d{5}", "amount": r"(?<=EUR )\d[\d,]*\.\d{2}", "date": _DATE,
               "person": r"\b(?:%s) (?:%s)\b" % ("|".join(pools["first_names"]), "|".join(pools["last_names"]))}[fact]
    return re.findall(pattern, text)


def test_lengths_and_depths_are_measured_with_the_tokenizer(suite, encode):
    assert [(r["meta"]["length_tokens"], r["meta"]["depth"]) for r in suite] == (
        [(1024, d) for d in DEPTHS] + [(2048, d) for d in DEPTHS] + [(4096, 0.5)])
    for r in suite:
        m, body = r["meta"], body_of(r)
        n_body = len(encode(body))
        start = len(encode(body[:body.index(needle_of(r, body))]))
        assert n_body == m["body_tokens"] and abs(n_body - m["length_tokens"]) <= 0.02 * m["length_tokens"], r["id"]
        assert start == m["needle_token_start"] and abs(start / n_body - m["depth"]) <= 0.03, r["id"]
        assert len(encode(r["turns"][0]["user"])) - n_body < 100   # instruction + question stay well inside 200


def test_records_parse_and_checks_separate_answer_from_distractors(suite):
    assert {r["meta"]["fact_kind"] for r in suite} == set(longctx.FACT_KINDS)
    assert len({r["meta"]["doc_kind"] for r in suite}) == 4
    assert len({r["id"] for r in suite}) == len(suite)
    for line, r in enumerate(suite, start=1):
        conv = parse_record(Path("lc.jsonl"), line, json.loads(json.dumps(r)), "long_context")
        assert conv.category == "long_context_recall" and conv.meta == r["meta"]
        (check,) = conv.turns[0].checks
        fact, answer, body = r["meta"]["fact_kind"], r["meta"]["answer"], body_of(r)
        assert run_check(check, f"The answer is {answer}.")
        if fact == "date":
            day, month, year = answer.split()
            mm = longctx.MONTHS.index(month) + 1
            assert run_check(check, f"{month} {day}, {year}") and run_check(check, f"{year}-{mm:02d}-{int(day):02d}")
        rest = body.replace(needle_of(r, body), "")
        others = distractors(fact, rest)
        assert len(others) >= 3, (r["id"], others)   # the filler really is full of same-format facts
        for other in others:
            assert not run_check(check, f"The answer is {other}."), (r["id"], other)


def test_answer_and_subject_occur_exactly_once(suite):
    for r in suite:
        body, m = body_of(r), r["meta"]
        assert body.count(m["subject"]) == 1, r["id"]
        assert body.count(m["answer"]) == 1, r["id"]
        assert m["answer"] in needle_of(r, body)
        assert m["subject"] in r["turns"][0]["user"].rsplit(longctx.QUESTION_SEP, 1)[1]


def test_output_is_deterministic_per_seed(encode, tmp_path):
    kw = dict(lengths=(1024,), depths=(0.3, 0.7))
    a = longctx.generate(tmp_path / "a.jsonl", encode, seed=0, **kw)
    b = longctx.generate(tmp_path / "b.jsonl", encode, seed=0, **kw)
    c = longctx.generate(tmp_path / "c.jsonl", encode, seed=1, **kw)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert (tmp_path / "a.jsonl").read_bytes() != (tmp_path / "c.jsonl").read_bytes()
    assert a == b and [r["turns"][0]["user"] for r in a] != [r["turns"][0]["user"] for r in c]
    lines = (tmp_path / "a.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(x) for x in lines] == a
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl", "c.jsonl"]   # no temp files left


def test_max_context_drops_lengths_that_do_not_fit(encode, suite, caplog):
    with caplog.at_level(logging.WARNING, logger="pipeline.suites.recall_docs"):
        kept = longctx.build_recall_suite(encode, lengths=(1024, 2048), depths=DEPTHS, max_context=1500)
    assert kept == suite[:5]   # the 1024 records are unchanged by dropping 2048
    assert "dropping length 2048" in caplog.text
    assert longctx.build_recall_suite(encode, lengths=(4096,), max_context=4096) == []
