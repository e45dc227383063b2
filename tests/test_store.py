import json

import pytest

from pipeline.infra.stage_cache import Journal, journal_path, load_manifest, run_stage


def test_stage_is_skipped_when_its_key_matches_and_rebuilt_otherwise(tmp_path, monkeypatch):
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
    import time

    from pipeline.infra.stage_cache import INVOCATION_ENV

    monkeypatch.setenv(INVOCATION_ENV, repr(time.time()))      # a new invocation: what exists predates it
    run_stage("s", out, {"a": 2}, build, force=True)
    assert len(calls) == 3
    run_stage("s", out, {"a": 2}, build, force=True)     # a second variant job of the same forced invocation
    assert len(calls) == 3
    monkeypatch.delenv(INVOCATION_ENV)          # called in-process, no invocation: force redoes it every time
    run_stage("s", out, {"a": 2}, build, force=True)
    assert len(calls) == 4
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


def _hold_mb(mb: int) -> bytearray:
    buf = bytearray(mb * 2**20)
    buf[::4096] = b"\x01" * len(buf[::4096])       # touch every page: resident, not just reserved
    return buf


def test_each_stage_records_its_own_peak_host_memory_not_the_process_lifetime_one(tmp_path):
    """A stage that held 300 MB, then a small stage in the same process: the small stage's peak must not carry
    the first one's (a lifetime high-water mark would), and a nested stage's reset must not erase the outer's."""
    def big(tmp):
        buf = _hold_mb(300)
        del buf
        return {}

    first = run_stage("big", tmp_path / "big", {"k": 1}, big)["host_memory"]
    assert first["peak_own_rss_mb"] - first["start_rss_mb"] >= 280
    second = run_stage("small", tmp_path / "small", {"k": 1}, lambda tmp: {})["host_memory"]
    assert second["peak_host_mb"] < first["peak_host_mb"] - 200

    def outer(tmp):
        buf = _hold_mb(250)
        del buf
        inner = run_stage("inner", tmp_path / "inner", {"k": 1}, lambda t: {})
        return {"inner_peak": inner["host_memory"]["peak_host_mb"]}

    m = run_stage("outer", tmp_path / "outer", {"k": 1}, outer)
    assert m["host_memory"]["peak_own_rss_mb"] - m["host_memory"]["start_rss_mb"] >= 230
    assert m["inner_peak"] < m["host_memory"]["peak_host_mb"] - 150


@pytest.mark.integration
def test_a_stage_counts_the_memory_of_the_children_it_ran(tmp_path):
    import subprocess
    import sys

    code = "b = bytearray(200 * 2**20); b[::4096] = b'\\x01' * len(b[::4096]); import time; time.sleep(0.6)"
    m = run_stage("child", tmp_path / "child", {"k": 1},
                  lambda tmp: subprocess.run([sys.executable, "-c", code], check=True) and {})
    mem = m["host_memory"]
    assert mem["peak_children_rss_mb"] >= 200
    assert mem["peak_host_mb"] >= mem["peak_children_rss_mb"]
    assert mem["peak_host_mb"] >= mem["start_rss_mb"] + 150       # the child sampled beside this process
