#!/bin/sh
# Build kvd.io._uring with ASan + UBSan into a scratch copy of the package and
# run the tests that drive it against it: the ring (tests/io/test_backend.py),
# record reads and their checks in C (tests/io/test_backend_records.py,
# tests/l2/test_format.py), the L2 tier on top (tests/l2/test_tier.py) and the
# region copies' batch (tests/io/test_copy_many.py), the native cut of striped
# record reads (tests/io/test_layout.py), the gets through the pool's
# directory (tests/io/test_pool_read_many.py), the values received from a
# socket (tests/io/test_recv_hashed.py) and the density policy's learning
# and plan (tests/store/eviction/test_density_learn.py, test_density_plan.py).
# Usage: native/asan_check.sh [pytest args]
set -eu
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

inc=$("$python" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
suffix=$("$python" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
cp -r "$repo/kvd" "$scratch/kvd"
rm -f "$scratch"/kvd/io/_uring*.so
mkdir -p "$scratch/tests/io" "$scratch/tests/l2" "$scratch/tests/store/eviction"
cp "$repo"/tests/io/*.py "$scratch/tests/io/"
cp "$repo"/tests/l2/*.py "$scratch/tests/l2/"
cp "$repo"/tests/store/__init__.py "$scratch/tests/store/"
cp "$repo"/tests/store/eviction/*.py "$scratch/tests/store/eviction/"
cp "$repo/tests/__init__.py" "$repo/tests/support.py" "$scratch/tests/"
cp "$repo/pyproject.toml" "$scratch/"  # pytest settings: asyncio mode, warnings are errors
gcc -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined \
    -fno-omit-frame-pointer -Wall -Wextra -Werror -std=gnu11 -ffp-contract=off -shared -fPIC -I"$inc" \
    -I"$repo/native" "$repo"/native/*.c -luring -o "$scratch/kvd/io/_uring$suffix"

cd "$scratch"
# The interpreter itself is not instrumented: leak detection off, and no
# quarantine so the RSS check in the leak test measures our memory, not ASan's.
LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)" \
ASAN_OPTIONS=detect_leaks=0:quarantine_size_mb=0 \
PYTHONMALLOC=malloc \
    "$python" -m pytest -q -p no:cacheprovider tests/io/test_backend.py \
    tests/io/test_backend_records.py tests/l2/test_format.py tests/l2/test_tier.py \
    tests/io/test_copy_many.py tests/io/test_layout.py tests/io/test_pool_read_many.py \
    tests/io/test_recv_hashed.py tests/store/eviction/test_density_learn.py \
    tests/store/eviction/test_density_plan.py "$@"
