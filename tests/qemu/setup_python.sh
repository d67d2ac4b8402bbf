#!/bin/sh
# An aarch64 Python for tests/qemu/test_aarch64_e2e.py: Debian's arm64 python3 unpacked into a
# sysroot (never installed: it would clash with the host's python3) plus aarch64 wheels of what
# the runtime imports. Run under `qemu-aarch64 -L SYSROOT SYSROOT/usr/bin/python3.X` (X: Debian's).
# Layout: $LLMRS_AARCH64_ROOT (default .cache/aarch64 in the repo, ignored by git)
#   debs/     the downloaded .debs           sysroot/  their contents (dpkg -x)
#   site/     aarch64 wheels (pip --target)  .done     written last: what the cache holds
# Idempotent: a complete cache of the same contents is left alone. Needs root (dpkg/apt), Debian's
# archive and PyPI; about 30 s and 350 MB.
set -eu
REPO=$(cd "$(dirname "$0")/../.." && pwd)
ROOT=${LLMRS_AARCH64_ROOT:-$REPO/.cache/aarch64}
WHEELS="numpy llvmlite networkx"  # what llmrs.runtime's CPU back end imports
command -v qemu-aarch64 >/dev/null || { echo "qemu-aarch64 absent: run tests/qemu/setup.sh first" >&2; exit 1; }

# arm64 packages are only downloaded, so adding the architecture changes nothing installed
if ! dpkg --print-foreign-architectures | grep -qx arm64; then dpkg --add-architecture arm64; fi
if ! apt-cache show python3-minimal:arm64 >/dev/null 2>&1; then apt-get update -qq; fi
# Debian's python3 version (python3.11 on bookworm); the wheels are picked for it
PY=$(apt-cache depends python3-minimal:arm64 | sed -n 's/.*Depends: \(python3\.[0-9]*\)-minimal:arm64$/\1/p' | head -n 1)
[ -n "$PY" ] || { echo "no python3-minimal:arm64 in the apt indexes: check /etc/apt/sources.list*" >&2; exit 1; }

STAMP="$PY $WHEELS"
if [ "$(cat "$ROOT/.done" 2>/dev/null)" = "$STAMP" ] && [ -x "$ROOT/sysroot/usr/bin/$PY" ]; then
  echo "aarch64 python: $ROOT is ready ($STAMP)"
  exit 0
fi
rm -rf "$ROOT/debs" "$ROOT/sysroot" "$ROOT/site" "$ROOT/.done"
mkdir -p "$ROOT/debs" "$ROOT/sysroot"
printf '*\n' > "$ROOT/.gitignore"  # keep the cache out of git status
apt-get update -qq
# the interpreter, its standard library, llvmlite's C++ runtime, and everything they need
PKGS=$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
         --no-replaces --no-enhances "$PY-minimal:arm64" "lib$PY-stdlib:arm64" libstdc++6:arm64 \
       | grep -E '^[a-z0-9][^ <]*:arm64$' | grep -vE '^(dpkg|tar|install-info):' | sort -u)
(cd "$ROOT/debs" && apt-get download -qq -o APT::Sandbox::User=root $PKGS)
for deb in "$ROOT"/debs/*.deb; do dpkg -x "$deb" "$ROOT/sysroot"; done

python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore --target "$ROOT/site" \
  --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 --platform manylinux_2_28_aarch64 \
  --python-version "${PY#python}" --implementation cp --only-binary=:all: $WHEELS

qemu-aarch64 -L "$ROOT/sysroot" "$ROOT/sysroot/usr/bin/$PY" -c \
  "import sys; sys.path.insert(0, '$ROOT/site'); import numpy, llvmlite.binding as b; \
b.initialize_native_target(); print('aarch64 python ok:', sys.version.split()[0], b.get_process_triple())"
echo "$STAMP" > "$ROOT/.done"
