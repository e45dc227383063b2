"""llama.cpp never shares a process with torch: a GGUF loaded by a pipeline process that has imported torch (every
variant job does) runs in a worker process of its own, answering as the runtime itself would (the same figures),
raising the runtime's own errors, naming how it died when it dies, and stopped on every exit path."""

import os
import signal
import time

import numpy as np
import pytest

from pipeline.config.schema import RuntimeConfig
from pipeline.infra.errors import ConfigError
from tests.conftest import pids_running, process_alive

pytestmark = pytest.mark.integration


_alive = process_alive


@pytest.fixture
def gguf_cfg(tiny_cfg):
    return tiny_cfg("variant=gguf_q8_0", "runtime.device=cpu", "runtime.threads=1")


def test_the_process_that_loads_a_gguf_has_no_torch_and_gives_the_same_figures(gguf_cfg, embedded_gguf):
    import torch  # noqa: F401 - a variant job's process has it

    from pipeline.runtimes import load_runtime
    from pipeline.runtimes.llamacpp import LlamaCppRuntime
    from pipeline.runtimes.worker import WorkerRuntime

    rt = load_runtime(gguf_cfg.variant, embedded_gguf, gguf_cfg, n_ctx=256)
    inline = LlamaCppRuntime(embedded_gguf, {**gguf_cfg.variant.runtime_options, "n_ctx": 256}, gguf_cfg.runtime)
    try:
        assert isinstance(rt, WorkerRuntime)
        assert rt.process["torch_loaded"] is False and rt.process["pid"] != os.getpid()
        assert rt.info["torch_in_process"] is False and inline.info["torch_in_process"] is True
        assert {**rt.info, "torch_in_process": None} == {**inline.info, "torch_in_process": None}
        assert rt.batched is True and rt.n_ctx == 256
        # an instance attribute that shadows a class default is the instance's (the class's choice is plain greedy)
        assert rt.choice == inline.choice and rt.choice.repeat_penalty == gguf_cfg.runtime.repeat_penalty != 1.0
        ids = list(range(100, 160))
        positions = list(range(20, 59))
        cand = np.asarray(ids[21:60])[:, None]
        a, b = rt.score(ids, positions, cand), inline.score(ids, positions, cand)
        assert np.array_equal(a.logprobs, b.logprobs) and np.array_equal(a.argmax, b.argmax)
        rt.reset()
        inline.reset()
        assert rt.generate(ids, 12, [2]).ids == inline.generate(ids, 12, [2]).ids
        blocks = list(rt.logprob_blocks(ids, positions))                 # a generator, block by block
        assert np.array_equal(np.concatenate(blocks), np.concatenate(list(inline.logprob_blocks(ids, positions))))
        first = rt.logprob_blocks(ids, positions)
        next(first)
        first.close()                                                    # dropped in the worker; it still answers
        assert rt.tokenize_document("Invoice 42 is due.") == inline.tokenize_document("Invoice 42 is due.")
    finally:
        rt.close()
        inline.close()
    assert not _alive(rt.process["pid"])


def test_exact_rows_in_a_file_reach_the_worker_as_a_map_of_that_file(gguf_cfg, embedded_gguf, tmp_path):
    """A read-only memory map (the reference's exact rows are read so) goes to the worker as its file's name: a few
    hundred bytes whatever its size, and the worker's full-vocabulary KLD from it is the one from the rows' values;
    a view into a map goes by value."""
    import torch  # noqa: F401 - a variant job's process has it
    from multiprocessing.reduction import ForkingPickler

    from pipeline.figures.drift import log_softmax
    from pipeline.runtimes import load_runtime

    rt = load_runtime(gguf_cfg.variant, embedded_gguf, gguf_cfg, n_ctx=256)
    try:
        ids = list(range(100, 160))
        positions = list(range(20, 59))
        cand = np.asarray(ids[21:60])[:, None]
        rows = np.arange(0, 39, 4)
        other = rt.logprobs(ids, positions)[rows] + np.random.default_rng(0).normal(0, 0.5, (len(rows), 1)) \
            * np.linspace(-1, 1, rt.n_vocab)                            # another model's distributions there
        np.save(tmp_path / "rows.npy", log_softmax(other).astype(np.float32))
        mapped = np.load(tmp_path / "rows.npy", mmap_mode="r")
        assert len(ForkingPickler.dumps(mapped)) < 1024 < mapped.nbytes
        assert len(ForkingPickler.dumps(mapped[1:])) > mapped[1:].nbytes
        by_name = rt.score(ids, positions, cand, full_rows=rows, full_ref=mapped)
        by_value = rt.score(ids, positions, cand, full_rows=rows, full_ref=np.array(mapped))
        assert np.array_equal(by_name.kld_full, by_value.kld_full) and np.all(by_name.kld_full > 0)
    finally:
        rt.close()


def test_the_runtimes_own_error_comes_back_with_its_type(gguf_cfg, embedded_gguf):
    import torch  # noqa: F401

    from pipeline.runtimes import load_runtime

    rt = load_runtime(gguf_cfg.variant, embedded_gguf, gguf_cfg, n_ctx=256)
    try:
        with pytest.raises(ConfigError, match="does not fit llama.cpp's n_ctx=256"):
            rt.generate(list(range(100, 400)), 8, [2])
        assert len(rt.generate(list(range(100, 110)), 4, [2]).ids) == 4   # still serving after the error
    finally:
        rt.close()


def test_a_file_that_does_not_load_fails_with_llama_cpps_reason_and_leaves_no_process(gguf_cfg, tmp_path,
                                                                                      own_processes):
    import torch  # noqa: F401

    from pipeline.runtimes import load_runtime

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ConfigError, match="could not load"):
        load_runtime(gguf_cfg.variant, bad, gguf_cfg, n_ctx=256)
    time.sleep(0.2)
    assert own_processes(pids_running("pipeline.runtimes.worker")) == set()


def test_a_worker_that_dies_is_named_with_its_signal(gguf_cfg, embedded_gguf):
    import torch  # noqa: F401

    from pipeline.runtimes import load_runtime

    rt = load_runtime(gguf_cfg.variant, embedded_gguf, gguf_cfg, n_ctx=256)
    os.kill(rt.process["pid"], signal.SIGSEGV)               # what the CUDA load did in a shared process
    with pytest.raises(RuntimeError, match="was killed by SIGSEGV while running generate"):
        rt.generate(list(range(100, 110)), 4, [2])
    rt.close()                                                # nothing left to stop: no second error


def test_without_torch_in_the_process_the_runtime_loads_in_it(embedded_gguf):
    """The probe's own process (no torch) loads llama.cpp itself: a second process would only add a hop."""
    import subprocess
    import sys

    code = ("import sys\nfrom types import SimpleNamespace\nfrom pipeline.config.schema import RuntimeConfig, "
            "VariantConfig\nfrom pipeline.runtimes import load_runtime\n"
            "cfg = SimpleNamespace(runtime=RuntimeConfig(device='cpu', threads=1), "
            "model=SimpleNamespace(trust_remote_code=False))\n"
            "rt = load_runtime(VariantConfig(name='g', quantizer='gguf', runtime='llamacpp'), sys.argv[1], cfg, "
            "n_ctx=128)\nprint(type(rt).__name__, 'torch' in sys.modules)\nrt.close()\n")
    out = subprocess.run([sys.executable, "-c", code, str(embedded_gguf)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["LlamaCppRuntime", "False"]
