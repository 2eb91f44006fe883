#!/usr/bin/env bash
# Builds the C++ API reference with Doxygen (docs/Doxyfile: the headers a user includes, detail namespaces excluded)
# into OUT (default build/api; open OUT/html/index.html) and fails on any warning, an undocumented public name
# included. ctest runs it as docs.api_reference where doxygen is installed (scripts/setup.sh test installs it).
#
#   bash scripts/api_reference.sh [OUT]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "${1:-$root/build/api}" && cd "${1:-$root/build/api}" && pwd)
if ! command -v doxygen >/dev/null; then
  echo "api_reference.sh: doxygen is not installed (Debian: apt-get install doxygen; scripts/setup.sh test does)" >&2
  exit 2
fi
cd "$root"
log="$out/doxygen.log"
if ! { cat docs/Doxyfile; echo "OUTPUT_DIRECTORY = $out"; } | doxygen - >"$log" 2>&1 || grep -qE 'warning|error' "$log"; then
  cat "$log"
  echo "api_reference.sh: $(grep -cE 'warning|error' "$log") warning(s): every public name needs a one-line contract"
  exit 1
fi
echo "api_reference.sh: $out/html/index.html, 0 warnings"
