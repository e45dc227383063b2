"""`python -m pipeline.commands.prune_cpu FOLDER` (`make llama-tools`): llama_tools.prune_cpu_variants on the embedded
model, the choice written to FOLDER/cpu-variant.json. Apart from pipeline.infra.llama_tools, which stays a leaf
module."""

from __future__ import annotations

import json
import sys
from pathlib import Path

def embedded_gguf() -> str:
    """The embedded model's packaged GGUF ("package/file"), as conf/model/smollm2.yaml names it (its one source)."""
    import yaml

    from pipeline.config.schema import PROJECT_ROOT

    source = yaml.safe_load((PROJECT_ROOT / "conf" / "model" / "smollm2.yaml").read_text())["source"]
    if not source.startswith("pypi:"):
        raise ValueError(f"conf/model/smollm2.yaml: source {source!r} is not a pypi: packaged file")
    return source.removeprefix("pypi:")


def main(argv: list[str] | None = None) -> int:
    from pipeline.infra.llama_tools import prune_cpu_variants
    from pipeline.infra.model_source import locate_packaged_file

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m pipeline.commands.prune_cpu FOLDER", file=sys.stderr)
        return 2
    folder = Path(args[0])
    result = prune_cpu_variants(folder, locate_packaged_file(embedded_gguf()))
    (folder / "cpu-variant.json").write_text(json.dumps(result) + "\n")
    print(f"llama.cpp CPU kernels: {result['variant']}"
          + (f" (removed, they died here: {', '.join(result['removed'])})" if result["removed"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
