#!/usr/bin/env bash
# Apply the vLLM patch series to a tree that contains vllm/ (site-packages, or a wheel unpacked).
#
#   patches/apply_series.sh TARGET_DIR [SERIES_FILE]
#
# One script serves `make setup`, the Apptainer image build and the tests. It is idempotent: a
# patch whose reverse applies cleanly is already in the tree and is skipped. It fails loudly on a
# rejected hunk, on any fuzz and on a patch that applies neither forward nor in reverse; offsets
# are allowed (patches that touch disjoint regions of one file shift each other) but are printed.
set -euo pipefail
target=${1:?usage: apply_series.sh TARGET_DIR [SERIES_FILE]}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
series=${2:-$here/vllm/v0.32.0/series}
dir=$(dirname "$series")
[ -d "$target/vllm" ] || { echo "apply_series: $target has no vllm/ directory" >&2; exit 1; }
[ -f "$series" ] || { echo "apply_series: no series file at $series" >&2; exit 1; }

strict() {  # patch output must not mention fuzz, rejects or reversed hunks
  if grep -Eiq 'fuzz|FAILED|reject|Reversed|ignored|malformed|garbage' <<<"$1"; then
    return 1
  fi
}

applied=0 skipped=0
while read -r name _; do
  case "$name" in ''|'#'*) continue ;; esac
  p="$dir/$name"
  [ -f "$p" ] || { echo "apply_series: $name is listed in $series but missing" >&2; exit 1; }
  if out=$(patch -p1 --fuzz=0 --forward --dry-run -d "$target" <"$p" 2>&1) && strict "$out"; then
    out=$(patch -p1 --fuzz=0 --forward -d "$target" <"$p" 2>&1)
    grep -i 'offset' <<<"$out" | sed "s|^|apply_series: $name: |" || true
    applied=$((applied + 1))
  elif out_r=$(patch -p1 --fuzz=0 --reverse --dry-run -d "$target" <"$p" 2>&1) && strict "$out_r"; then
    skipped=$((skipped + 1))
  else
    echo "apply_series: $name does not apply cleanly to $target:" >&2
    echo "$out" >&2
    exit 1
  fi
done <"$series"
echo "apply_series: $applied applied, $skipped already present ($(basename "$dir"))"
