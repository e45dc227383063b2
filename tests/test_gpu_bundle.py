"""`make gpu-bundle`: what the offline GPU machine lacks, laid out in folders that each fit one device call (64 MiB
with the working tree). The size check refuses an oversized call naming its largest parts; the layout splits only the
model across calls; the pruned llama.cpp tree drops what its build does not need; the install step joins pieces only
when all are there and whole. The integration test builds the Python 3.11 variant of the bundle (same pins: it
downloads, once per machine) and dry-runs scripts/gpu-check through it on this CPU."""

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


def _tiny_shape(out: Path, full: Path) -> Path:
    """A shape folder of the embedded model's tokenizer with a two-layer geometry (the dry run's model)."""
    import shutil

    out.mkdir()
    for f in full.iterdir():
        shutil.copy2(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.integration
@pytest.mark.timeout(3600)
def test_the_python_311_bundle_installs_and_gpu_check_runs_through_it_on_the_cpu(tmp_path):
    """The device run rehearsed here with the same pins built for this Python: the bundle (one call: the software
    and the model's shape) lists every file with its size; scripts/gpu-check installs it into a folder of its own
    (the project's interpreter standing for the image's; llama.cpp's build left to the tools already here), builds
    a model of the shape from a seed, runs each variant in turn writing the table after each, then the speed
    trials and the verdict, with runtime.device=cpu: every variant ran, llama.cpp never beside torch, and the
    verdict fails on the device alone."""
    bindings, sdist = _inputs()
    if not list(bindings.glob("*.whl")) or not sdist.is_file():
        pytest.skip(f"needs `make llama-bindings` ({bindings}) and llama-cpp-python's sdist ({sdist})")
    out = tmp_path / "cp311"
    stage = gb.STAGE            # outside the clone, as the compiled caches are: what it downloads is kept
    manifest = gb.build("3.11", out, stage, bindings, sdist, "seeded")
    ok, report = gb.check(out)
    assert ok, report
    assert manifest["calls"] == 1
    # every file the folder holds is in the manifest with its size and hash (and every manifest entry is there)
    listed = {(str(f["call"]), f["file"]): f for f in manifest["files"]}
    held = {(c, name): size for c, files in gb.folder_sizes(out).items() for name, size in files.items()
            if name not in ("manifest.json", "install.py")}
    assert {k: f["size"] for k, f in listed.items()} == held
    assert all(gb.sha256(out / c / name) == f["sha256"] for (c, name), f in listed.items())
    assert {p.name for p in gb.PACKAGES} | {"llama.cpp", "llama.cpp-converter", "smollm2-shape"} == \
        {f["name"] for f in manifest["files"]}

    state, results = tmp_path / "state", tmp_path / "out"
    shape = _tiny_shape(tmp_path / "shape", stage / "smollm2-shape")
    env = {**os.environ, "GPU_CHECK_BUNDLE": str(out), "GPU_CHECK_PYTHON": sys.executable,
           "GPU_CHECK_INSTALL_ARGS": f"--state {state} --cache {tmp_path / 'cache'}", "GPU_CHECK_LLAMA": "skip",
           "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_MODEL": "seeded", "GPU_CHECK_SHAPE": str(shape),
           "GPU_CHECK_MODEL_DIR": str(tmp_path / "model"), "GPU_CHECK_VARIANTS": "original,gguf_f16,gguf_q8_0",
           "GPU_CHECK_OUT": str(results), "GPU_CHECK_BUDGET_S": "3000",
           "GPU_CHECK_ARGS": f"paths.artifacts={tmp_path / 'artifacts'} paths.cache={tmp_path / 'cache'} "
                             "runtime.threads=1"}
    env.pop("OUT", None)
    proc = subprocess.run([str(PROJECT_ROOT / "scripts" / "gpu-check")], env=env, capture_output=True, text=True,
                          timeout=3000)
    log = (results / "gpu-check.log").read_text()
    assert proc.returncode == 1, log[-5000:]                    # the verdict: not on a GPU
    for module in ("hydra", "omegaconf", "jsonschema", "gptqmodel", "pcre", "optimum", "gguf", "datasets"):
        assert f"import {module}: ok\n" in log, log[-3000:]
    assert "FAILED:" not in log and str(state / "site") in (state / "env.sh").read_text()
    # progressive: a table after each variant, each naming only what had finished
    assert log.count("gpu-check: so far") == 3 and log.count("(at ") == 3
    for name in ("original", "gguf_f16", "gguf_q8_0"):
        assert f"gpu-check: {name}: exit 0" in log
    table = (results / "table.md").read_text()
    assert table.startswith("Model: smollm2-seeded-0: SmolLM2-135M's shape and tokenizer with weights from seed 0")
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| variant")]
    assert len(rows) == 3 and all("ran on 'cpu', not cuda" in r for r in rows)
    assert "process that had imported torch" not in table and "F16 GGUF parity on CUDA" in table
    summary = json.loads((results / "summary.json").read_text())
    for name in ("original", "gguf_f16", "gguf_q8_0"):
        v = summary["variants"][name]
        assert v["status"] == "ok" and v["speed"]["trials"] >= 6, (name, v.get("reason"))
    for name in ("gguf_f16", "gguf_q8_0"):
        assert summary["variants"][name]["runtime_info"]["torch_in_process"] is False
    assert json.loads((tmp_path / "model" / "seeded.json").read_text())["seed"] == 0


@pytest.mark.integration
def test_a_seeded_model_has_the_shape_and_the_same_weights_for_the_same_seed(tmp_path):
    from safetensors.numpy import load_file

    from dev.seeded_model import build, save_shape

    assert "tokenizer.json" in save_shape(tmp_path / "full")
    shape = _tiny_shape(tmp_path / "tiny", tmp_path / "full")
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)
    assert (tmp_path / "full" / "tokenizer.json").is_file() and (tmp_path / "full" / "chat_template.jinja").is_file()
    a, b, c = (build(tmp_path / name, shape, seed, "float32") for name, seed in (("a", 0), ("b", 0), ("c", 1)))
    assert a["seed"] == b["seed"] == 0 and c["seed"] == 1 and a["params"] == c["params"]
    wa, wb, wc = (load_file(str(tmp_path / n / "model.safetensors")) for n in "abc")
    name = "model.layers.0.mlp.up_proj.weight"
    assert (wa[name] == wb[name]).all() and not (wa[name] == wc[name]).all()
    assert json.loads((tmp_path / "a" / "config.json").read_text())["num_hidden_layers"] == 2
    proc = subprocess.run([sys.executable, "-m", "dev.seeded_model", str(tmp_path / "d"), "--shape",
                           str(tmp_path / "nowhere")], capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=120)
    assert proc.returncode == 2 and "no config.json" in proc.stderr
