#!/usr/bin/env bash
# foretell vs mlx-lm on the GPU host, in one call: random-weight Qwen3 0.6B and 4B, bf16.
#
#   bash tools/bench-h200.sh [extra foretell-bench options]
#
# Run from a checkout on the host whose PYTHONPATH holds mlx, mlx-cuda and mlx-lm
# (shared/tools/mlx-cuda-parts.sh stages them; default /root/site). Writes $OUT/h200.json
# (every run, machine, versions) and $OUT/h200.txt (the table). Weights are made on the GPU
# once per host under ~/.cache/foretell/bench (4B: ~8 GB on disk). About 2-4 minutes; the
# JSON is rewritten after each model, so a cut-short run still returns what it finished.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/foretell-bench}
mkdir -p "$out"
export PYTHONPATH="$repo/core:$repo/plugins:${PYTHONPATH:-/root/site}"

# foretell runs from this checkout, not installed: without its dist-info, importlib.metadata
# would find no built-in plugins (they register through entry points). Write one if missing.
if ! python3 -c "import importlib.metadata as m; m.distribution('foretell')" 2>/dev/null; then
  meta=$(mktemp -d)
  python3 - "$repo" "$meta" <<'PY'
import pathlib, re, sys, tomllib
repo, meta = map(pathlib.Path, sys.argv[1:])
project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
init = (repo / "core/foretell/__init__.py").read_text()
version = re.search(r'__version__ = "([^"]+)"', init).group(1)
info = meta / f"foretell-{version}.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: foretell\nVersion: {version}\n")
groups = project["entry-points"]
(info / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
    for group, eps in groups.items() if group == "foretell.plugins"
))
PY
  export PYTHONPATH="$PYTHONPATH:$meta"
fi

python3 -c "import mlx.core, mlx_lm" || {
  echo "bench-h200: the bench needs mlx (CUDA build) and mlx-lm on PYTHONPATH=$PYTHONPATH" >&2
  exit 2
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true

python3 -m foretell.bench --synthetic 0.6b,4b --dtype bfloat16 \
  --prompt-tokens 512 --generate 128 --repeats 3 --json "$out/h200.json" "$@" \
  | tee "$out/h200.txt"
