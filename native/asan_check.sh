#!/bin/sh
# Build kvd._uring with ASan + UBSan into a scratch copy of the package and
# run tests/test_iobackend.py against it. Usage: native/asan_check.sh [pytest args]
set -eu
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

inc=$("$python" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
suffix=$("$python" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
cp -r "$repo/kvd" "$scratch/kvd"
rm -f "$scratch"/kvd/_uring*.so
mkdir "$scratch/tests"
cp "$repo/tests/test_iobackend.py" "$scratch/tests/"
gcc -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined \
    -fno-omit-frame-pointer -Wall -Wextra -Werror -shared -fPIC -I"$inc" \
    "$repo/native/kvd_uring.c" -luring -o "$scratch/kvd/_uring$suffix"

cd "$scratch"
# The interpreter itself is not instrumented: leak detection off, and no
# quarantine so the RSS check in the leak test measures our memory, not ASan's.
LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)" \
ASAN_OPTIONS=detect_leaks=0:quarantine_size_mb=0 \
PYTHONMALLOC=malloc \
    "$python" -m pytest -q -p no:cacheprovider tests/test_iobackend.py "$@"
