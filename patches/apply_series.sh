#!/usr/bin/env bash
# Apply the vLLM patch series to a tree that contains vllm/ (site-packages, or a wheel unpacked).
#
#   patches/apply_series.sh [--check] TARGET_DIR [SERIES_FILE]
#
# One script serves `make setup`, the Apptainer image build and the tests. It is idempotent: a
# patch whose reverse applies cleanly is already in the tree and is skipped. It fails loudly
#   * on a rejected hunk and on any fuzz (patch runs with --fuzz=0, and its output is checked);
#   * on an ambiguous hunk: before a patch is applied, the lines each hunk expects (context and
#     removed lines) must occur exactly once in the file. An offset is allowed (patches touching
#     disjoint regions of one file shift each other) and printed, but a hunk that could land in
#     two places is refused, because `patch` would silently pick the one nearest the old line;
#   * on a patch that applies neither forward nor in reverse (a partly patched tree included).
# --check applies nothing: it reports per patch "applies", "present" or fails as above.
# PYTHON names the interpreter for the ambiguity check (default: python3).
set -euo pipefail
check_only=0
if [ "${1:-}" = "--check" ]; then check_only=1; shift; fi
target=${1:?usage: apply_series.sh [--check] TARGET_DIR [SERIES_FILE]}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
series=${2:-$here/vllm/v0.32.0/series}
dir=$(dirname "$series")
py=${PYTHON:-python3}
[ -d "$target/vllm" ] || { echo "apply_series: $target has no vllm/ directory" >&2; exit 1; }
[ -f "$series" ] || { echo "apply_series: no series file at $series" >&2; exit 1; }
command -v patch >/dev/null || { echo "apply_series: the 'patch' program is not installed" >&2; exit 1; }

strict() {  # patch output must not mention fuzz, rejects or reversed hunks
  if grep -Eiq 'fuzz|FAILED|reject|Reversed|ignored|malformed|garbage' <<<"$1"; then
    return 1
  fi
}

# Exit 0 when every hunk of patch $1 matches exactly one place of its file under $2 (side $3:
# "old" = the lines before the patch, "new" = after it); print the offending hunks otherwise.
unique_hunks() {
  "$py" - "$1" "$2" "$3" <<'PY'
import os, re, sys
patch_path, root, side = sys.argv[1:4]
hunk_re = re.compile(r"^@@ -(\d+)(?:,\d+)? \+(\d+)(?:,\d+)? @@")
bad, path, lines, hunk = [], None, [], None

def check(path, hunk):
    if path is None or hunk is None:
        return
    start, block = hunk
    if not block:
        return  # a pure insertion at the top of a new file
    full = os.path.join(root, path)
    if not os.path.isfile(full):
        bad.append(f"{path}: file missing")
        return
    with open(full, encoding="utf-8", errors="surrogateescape") as f:
        text = f.read().split("\n")
    n, hits = len(block), 0
    first = block[0]
    for i in range(len(text) - n + 1):
        if text[i] == first and text[i:i + n] == block:
            hits += 1
    if hits != 1:
        what = "nowhere" if hits == 0 else f"{hits} times"
        bad.append(f"{path}: hunk at line {start} matches {what}")

with open(patch_path, encoding="utf-8", errors="surrogateescape") as f:
    for raw in f.read().split("\n"):
        if raw.startswith("+++ "):
            check(path, hunk)
            hunk = None
            name = raw[4:].split("\t")[0]
            path = None if name == "/dev/null" else name.split("/", 1)[1]
        elif raw.startswith("--- ") or raw.startswith("diff ") or raw.startswith("index "):
            continue
        elif (m := hunk_re.match(raw)):
            check(path, hunk)
            hunk = (int(m.group(1) if side == "old" else m.group(2)), [])
        elif hunk is not None and raw[:1] in (" ", "-", "+"):
            keep = " -" if side == "old" else " +"
            if raw[0] in keep:
                hunk[1].append(raw[1:])
        elif hunk is not None and raw == "":
            continue
    check(path, hunk)
for b in bad:
    print(b)
sys.exit(1 if bad else 0)
PY
}

applied=0 skipped=0
while read -r name _; do
  case "$name" in ''|'#'*) continue ;; esac
  p="$dir/$name"
  [ -f "$p" ] || { echo "apply_series: $name is listed in $series but missing" >&2; exit 1; }
  if out=$(patch -p1 --fuzz=0 --forward --dry-run -d "$target" <"$p" 2>&1) && strict "$out"; then
    if ! amb=$(unique_hunks "$p" "$target" old); then
      echo "apply_series: $name is ambiguous in $target (a hunk could land in more than one place):" >&2
      echo "$amb" >&2
      exit 1
    fi
    if [ "$check_only" = 1 ]; then
      echo "apply_series: $name applies"
    else
      out=$(patch -p1 --fuzz=0 --forward --no-backup-if-mismatch -d "$target" <"$p" 2>&1)
    fi
    grep -i 'offset' <<<"$out" | sed "s|^|apply_series: $name: |" || true
    applied=$((applied + 1))
  elif out_r=$(patch -p1 --fuzz=0 --reverse --dry-run -d "$target" <"$p" 2>&1) && strict "$out_r" \
      && unique_hunks "$p" "$target" new >/dev/null; then
    [ "$check_only" = 1 ] && echo "apply_series: $name present"
    skipped=$((skipped + 1))
  else
    echo "apply_series: $name does not apply cleanly to $target:" >&2
    echo "$out" >&2
    exit 1
  fi
done <"$series"
verb=applied; [ "$check_only" = 1 ] && verb="would apply"
echo "apply_series: $applied $verb, $skipped already present ($(basename "$dir"))"
