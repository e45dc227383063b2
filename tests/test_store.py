import json

import pytest

from pipeline.infra.stage_cache import Journal, journal_path, load_manifest, run_stage


def test_stage_is_skipped_when_its_key_matches_and_rebuilt_otherwise(tmp_path):
    calls = []

    def build(tmp):
        calls.append(tmp)
        (tmp / "out.txt").write_text(f"build {len(calls)}")
        return {"artifact": "out.txt"}

    out = tmp_path / "stage"
    m1 = run_stage("s", out, {"a": 1}, build)
    m2 = run_stage("s", out, {"a": 1}, build)
    assert len(calls) == 1 and m1["key_hash"] == m2["key_hash"]
    run_stage("s", out, {"a": 2}, build)
    assert len(calls) == 2 and (out / "out.txt").read_text() == "build 2"
    run_stage("s", out, {"a": 2}, build, force=True)
    assert len(calls) == 3
    assert load_manifest(out)["artifact"] == "out.txt"


def test_a_failed_build_leaves_the_previous_output_intact_and_no_partial_dir(tmp_path):
    out = tmp_path / "stage"
    run_stage("s", out, {"a": 1}, lambda tmp: (tmp / "f").write_text("good") and None)

    def broken(tmp):
        (tmp / "f").write_text("half")
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError):
        run_stage("s", out, {"a": 2}, broken)
    assert (out / "f").read_text() == "good"
    assert load_manifest(out)["key"] == {"a": 1}


def test_a_directory_without_manifest_is_never_taken_as_complete(tmp_path):
    out = tmp_path / "stage"
    out.mkdir()
    (out / "f").write_text("partial")
    calls = []
    run_stage("s", out, {"a": 1}, lambda tmp: calls.append(1))
    assert calls == [1]


def test_journal_resumes_finished_items_and_drops_a_torn_line(tmp_path):
    out = tmp_path / "stage"
    j = Journal(out, "items", {"k": 1})
    j.add("a", {"v": 1})
    j.add("b", {"v": 2})
    with open(j.path, "a") as fh:
        fh.write('{"key": "torn')   # a kill in the middle of a write
    resumed = Journal(out, "items", {"k": 1})
    assert "a" in resumed and "b" in resumed and resumed.get("b") == {"v": 2}
    resumed.add("c", 3)
    assert Journal(out, "items", {"k": 1}).get("c") == 3
    assert "a" not in Journal(out, "items", {"k": 2}), "another config's items are not reused"


def test_stage_build_sees_the_journal_of_an_interrupted_attempt(tmp_path):
    out = tmp_path / "stage"
    key = {"k": 1}
    done_first = []

    def interrupted(tmp):
        j = Journal(out, "items", key)
        for item in ("x", "y", "z"):
            if item not in j:
                if item == "z":
                    raise KeyboardInterrupt
                done_first.append(item)
                j.add(item, item.upper())

    with pytest.raises(KeyboardInterrupt):
        run_stage("s", out, key, interrupted)
    redone = []

    def resumed(tmp):
        j = Journal(out, "items", key)
        for item in ("x", "y", "z"):
            if item not in j:
                redone.append(item)
                j.add(item, item.upper())
        (tmp / "all.json").write_text(json.dumps([j.get(i) for i in ("x", "y", "z")]))

    run_stage("s", out, key, resumed)
    assert done_first == ["x", "y"] and redone == ["z"]
    assert json.loads((out / "all.json").read_text()) == ["X", "Y", "Z"]
    assert not journal_path(out).exists(), "the journal is removed once the stage is complete"
