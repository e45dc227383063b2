"""The run-time-selected llama.cpp build: a CPU module that dies on this machine is removed so ggml's pick falls to
the next one, and the pipeline's llama.cpp runtime loads the same libraries as the tools."""

import os
import stat
import subprocess
import sys

import pytest

from pipeline.config.schema import PROJECT_ROOT

FAKE_BENCH = """#!/bin/sh
# picks the best CPU module present, as ggml does by CPUID; the AMX one dies as on a VM that does not grant AMX
dir=$(dirname "$0")
for v in sapphirerapids zen4 haswell; do
  if [ -f "$dir/libggml-cpu-$v.so" ]; then
    echo "load_backend: loaded CPU backend from $dir/libggml-cpu-$v.so" >&2
    if [ "$v" = sapphirerapids ]; then kill -ILL $$; fi
    echo '{"avg_ts": 1.0}'
    exit 0
  fi
done
echo "no CPU backend found" >&2
exit 1
"""


def fake_build(folder, modules):
    folder.mkdir()
    exe = folder / "llama-bench"
    exe.write_text(FAKE_BENCH)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    for m in modules:
        (folder / f"libggml-cpu-{m}.so").write_bytes(b"")
    (folder / "libllama.so").write_bytes(b"")
    return folder


def test_a_cpu_module_that_dies_is_removed_and_the_next_one_chosen(tmp_path):
    from pipeline.infra.llama_tools import has_selectable_cpu, prune_cpu_variants

    folder = fake_build(tmp_path / "bin", ["sapphirerapids", "zen4", "haswell"])
    assert has_selectable_cpu(folder)
    result = prune_cpu_variants(folder, tmp_path / "m.gguf")
    assert result == {"variant": "zen4", "removed": ["sapphirerapids"]}
    assert not (folder / "libggml-cpu-sapphirerapids.so").exists() and (folder / "libggml-cpu-zen4.so").exists()
    assert prune_cpu_variants(folder, tmp_path / "m.gguf") == {"variant": "zen4", "removed": []}


def test_no_runnable_cpu_module_fails_with_the_tools_output(tmp_path):
    from pipeline.infra.llama_tools import prune_cpu_variants

    folder = fake_build(tmp_path / "bin", ["sapphirerapids"])
    with pytest.raises(RuntimeError, match="no CPU backend found") as err:
        prune_cpu_variants(folder, tmp_path / "m.gguf")
    assert "removed ['sapphirerapids']" in str(err.value)


def test_the_pipeline_loads_the_tools_libraries_when_they_are_built(tmp_path, monkeypatch):
    import pipeline.infra.llama_tools as lt

    folder = fake_build(tmp_path / "bin", ["zen4"])
    monkeypatch.setattr(lt, "_library_choice", [])
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", "")    # recorded, so what the test sets is undone whatever was there
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH")
    monkeypatch.setenv("QUANTDRIFT_LLAMA_TOOLS", str(folder))
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    assert lt.use_tool_libraries() == str(folder) and os.environ["LLAMA_CPP_LIB_PATH"] == str(folder)
    # a static build (no CPU modules) is llama.cpp's build all the same: the bindings carry no libraries of their own
    monkeypatch.setattr(lt, "_library_choice", [])
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH")
    (folder / "libggml-cpu-zen4.so").unlink()
    assert lt.use_tool_libraries() == str(folder)
    # a folder without libllama.so: nothing to point the bindings at
    monkeypatch.setattr(lt, "_library_choice", [])
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH")
    (folder / "libllama.so").unlink()
    assert lt.use_tool_libraries() is None and "LLAMA_CPP_LIB_PATH" not in os.environ


def test_without_llama_cpp_libraries_the_error_names_the_build(tmp_path):
    """The bindings are installed without libraries (make llama-bindings): where none can be loaded, the pipeline
    says which folder it tried and how to build them, not ctypes' bare 'not found'."""
    empty = tmp_path / "no-libs"
    empty.mkdir()
    code = ("from pipeline.infra.errors import ConfigError\nfrom pipeline.infra.llama_tools import load_llama_cpp\n"
            "try:\n    load_llama_cpp()\nexcept ConfigError as e:\n    print('REFUSED', e)\n")
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(empty)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         cwd=str(PROJECT_ROOT))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("REFUSED"), out.stdout + out.stderr[-2000:]
    assert str(empty) in out.stdout and "make llama-tools" in out.stdout and "LLAMA_CPP_LIB_PATH" in out.stdout
