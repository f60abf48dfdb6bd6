#!/usr/bin/env bash
# Install the offline CUDA wheelhouse (`make wheelhouse`) into a venv on a node without network.
#
#   launch/install_wheelhouse.sh [--isolated] [--image DIR]... [--series FILE] WHEELHOUSE VENV
#
# WHEELHOUSE is a folder of .whl files (dist/wheelhouse) or of the parts p00, p01, ... that
# `make wheelhouse-parts` cuts (joined into VENV/wheels, checked against their SHA256SUMS).
# Before anything is installed, every wheel is held to the lock beside the series
# (patches/vllm/vX.Y.Z/wheelhouse.lock), which pins each by its sha256: a wheel of other bytes
# (tampered or substituted), a wheel the lock does not pin, a pin without its wheel and a pin
# without its hash are refused, each named (hpctoolkit/deploy/hashes.py, standard library only).
# The lock's wheels then go in with pip's --require-hashes, which checks the bytes a second time;
# hpctoolkit's own wheel, built from this checkout, is not pinned and goes in after them.
# Every wheel goes, without dependencies or network, into VENV/wheelhouse-site. VENV is a venv of
# the base interpreter (PYTHON, default python3: the image's 3.12) whose site-packages holds
#   00-wheelhouse.pth   VENV/wheelhouse-site
#   01-image.pth        the base interpreter's site directories (or each --image DIR); none with
#                       --isolated
# Python reads them in name order, so the wheelhouse's torch and vLLM come before the image's while
# the image still supplies numpy and the rest of what the lock names under `# image:`. Each is
# added with site.addsitedir, so the .pth files inside them count too. Every process started with
# VENV/bin/python (vLLM's spawned workers included) gets this order; PYTHONPATH does not, because
# callers that build their own environment drop it.
# VENV/bin then gets the console scripts of every installed distribution (vllm, torchrun, ...: the
# console_scripts of each entry_points.txt in the site), so that activating the venv or putting
# VENV/bin on PATH runs `vllm serve` as a run prints it. pip --target writes its own scripts under
# VENV/wheelhouse-site/bin, for the base interpreter, which is neither on PATH nor the venv's. Each
# is a wrapper `#!VENV/bin/python` that imports and calls its function under an
# `if __name__ == "__main__":` guard, as pip's are: vLLM's workers start by multiprocessing's spawn,
# which imports the main script again, and must not run the command a second time. A wrapper the
# installer wrote whose command is gone is removed; another file of the command's name (a
# hand-written wrapper) is replaced, with a warning; the venv's own python* and activate* are kept.
# The vLLM patch series of the wheelhouse's vllm version (patches/vllm/vX.Y.Z/series, or --series)
# is applied to the wheelhouse site. The last line is what VENV's python sees: torch and vLLM
# versions, CUDA, the GPUs and NCCL, after a warning for any `# image:` name nothing provides.
# Idempotent: a second run reuses the joined parts, the installed site and the venv while the
# wheels are the same. One-line errors; exit 2 for bad arguments, 1 for a failure.
set -euo pipefail
usage="usage: install_wheelhouse.sh [--isolated] [--image DIR]... [--series FILE] WHEELHOUSE VENV"
die() { local code=$1; shift; echo "install_wheelhouse: $*" >&2; exit "$code"; }
say() { echo "install_wheelhouse: $*"; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
py=${PYTHON:-python3}

isolated=0 series="" images=() args=()
while [ $# -gt 0 ]; do
  case $1 in
    --isolated) isolated=1 ;;
    --image) [ $# -ge 2 ] || die 2 "--image needs a folder; $usage"; images+=("$2"); shift ;;
    --series) [ $# -ge 2 ] || die 2 "--series needs a file; $usage"; series=$2; shift ;;
    -h|--help) echo "$usage"; exit 0 ;;
    -*) die 2 "unknown option $1; $usage" ;;
    *) args+=("$1") ;;
  esac
  shift
done
[ ${#args[@]} -eq 2 ] || die 2 "$usage"
src=${args[0]} venv=${args[1]}
[ -d "$src" ] || die 2 "no folder $src"
for d in "${images[@]}"; do [ -d "$d" ] || die 2 "--image $d is not a folder"; done
[ "$isolated" = 0 ] || [ ${#images[@]} -eq 0 ] || die 2 "--isolated and --image exclude each other"
[ -z "$series" ] || [ -f "$series" ] || die 2 "--series $series is not a file"
command -v "$py" >/dev/null || die 1 "no interpreter $py (set PYTHON)"
"$py" -m pip --version >/dev/null 2>&1 || die 1 "$py has no pip to install the wheels with"
mkdir -p "$venv"
venv=$(cd "$venv" && pwd)

# Name and size of each entry: what a stamp compares to tell "the same files" on a second run.
listing() { find "$@" -maxdepth 1 -type f -printf '%f %s\n' | LC_ALL=C sort; }

# 1. The wheels: the folder itself, or its parts joined into VENV/wheels.
shopt -s nullglob
wheel_files=("$src"/*.whl) parts=("$src"/p[0-9]*)
if [ ${#wheel_files[@]} -gt 0 ]; then
  wheels=$(cd "$src" && pwd)
elif [ ${#parts[@]} -gt 0 ]; then
  wheels=$venv/wheels
  if [ "$(listing "${parts[@]}")" != "$(cat "$wheels/.parts" 2>/dev/null)" ]; then
    if [ -f "$src/SHA256SUMS" ]; then
      (cd "$src" && sha256sum --quiet -c SHA256SUMS) >/dev/null 2>&1 \
        || die 1 "the parts in $src do not match their SHA256SUMS: copy them again"
    fi
    rm -rf "$wheels" "$wheels.tmp" && mkdir -p "$wheels.tmp"
    cat "${parts[@]}" | tar -x -C "$wheels.tmp" || die 1 "the parts in $src do not join into a tar archive"
    listing "${parts[@]}" >"$wheels.tmp/.parts"
    mv "$wheels.tmp" "$wheels"
    say "joined ${#parts[@]} parts into $wheels"
  else
    say "reusing the joined parts in $wheels"
  fi
  wheel_files=("$wheels"/*.whl)
  [ ${#wheel_files[@]} -gt 0 ] || die 1 "the parts in $src hold no .whl files"
else
  die 2 "$src holds neither .whl files nor parts p00, p01, ..."
fi

vllm_wheels=("$wheels"/vllm-*.whl)
[ ${#vllm_wheels[@]} -eq 1 ] || die 1 "$wheels holds ${#vllm_wheels[@]} vllm wheels, not 1"
vllm_version=$(basename "${vllm_wheels[0]}" | cut -d- -f2)
series=${series:-$repo/patches/vllm/v$vllm_version/series}
[ -f "$series" ] || die 1 "no patch series for vllm $vllm_version at $series: pass --series"
series=$(cd "$(dirname "$series")" && pwd)/$(basename "$series")
lock=$(dirname "$series")/wheelhouse.lock
[ -f "$lock" ] || die 1 "no lock at $lock to hold the wheels' sha256 to"

# 2. Every wheel's sha256 against the lock, on every run: what pip is given, with the lock's hashes.
hashes=$venv/wheelhouse-hashes.txt
if ! out=$("$py" -I "$repo/hpctoolkit/deploy/hashes.py" "$lock" "${wheel_files[@]}" 2>&1 >"$hashes"); then
  printf '%s\n' "$out" >&2
  die 1 "the wheels of $wheels do not match $lock (above): refused, nothing installed"
fi
pinned=$(wc -l <"$hashes")
own=("$wheels"/hpctoolkit-*.whl)
say "the $pinned pinned wheels have the sha256 that $lock names"

# 3. The wheelhouse site: installed whole into a fresh folder, then moved into place.
pip_install() {
  "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
    --no-cache-dir --target "$site.tmp" "$@" 2>&1
}
site=$venv/wheelhouse-site
if [ "$(listing "${wheel_files[@]}")" != "$(cat "$site/.wheels" 2>/dev/null)" ]; then
  rm -rf "$site" "$site.tmp"
  say "installing ${#wheel_files[@]} wheels into $site"
  if ! out=$(pip_install --require-hashes -r "$hashes") \
      || { [ ${#own[@]} -gt 0 ] && ! out=$(pip_install "${own[@]}"); }; then
    printf '%s\n' "$out" | tail -n 20 >&2
    die 1 "pip could not install the wheels of $wheels (its last lines above)"
  fi
  listing "${wheel_files[@]}" >"$site.tmp/.wheels"
  mv "$site.tmp" "$site"
else
  say "reusing $site (the same ${#wheel_files[@]} wheels)"
fi

# 4. The venv and its two .pth files.
vpy=$venv/bin/python
if [ ! -x "$vpy" ]; then
  "$py" -m venv --without-pip "$venv" || die 1 "$py could not make a venv in $venv"
fi
if [ "$isolated" = 0 ] && [ ${#images[@]} -eq 0 ]; then
  # The base's own site directories, as it sees them (user site left out).
  mapfile -t images < <("$py" -s -c 'import os, sys
for p in sys.path:
    if os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p):
        print(p)')
  [ ${#images[@]} -gt 0 ] || die 1 "$py reports no site-packages to overlay: pass --image DIR or --isolated"
fi
"$vpy" -I - "$site" "${images[@]}" <<'PY' || die 1 "could not write the .pth files of $venv"
import os, sys, sysconfig
site_dir = sysconfig.get_paths()["purelib"]

def write(name, dirs):
    lines = [f"import site; site.addsitedir({os.path.abspath(d)!r})\n" for d in dirs]
    with open(os.path.join(site_dir, name), "w", encoding="utf-8") as f:
        f.writelines(lines)

write("00-wheelhouse.pth", sys.argv[1:2])
image = os.path.join(site_dir, "01-image.pth")
if len(sys.argv) > 2:
    write("01-image.pth", sys.argv[2:])
elif os.path.exists(image):
    os.remove(image)
PY
if [ "$isolated" = 1 ]; then say "venv $venv: the wheelhouse only (--isolated)"
else say "venv $venv: the wheelhouse, then ${images[*]}"; fi

# 5. The console scripts of the site's distributions, in VENV/bin (the header says why).
"$vpy" -I - "$site" "$venv/bin" <<'PY' || die 1 "could not write the console scripts of $site into $venv/bin (above)"
import importlib.metadata as md
import os
import re
import sys

site, bindir = sys.argv[1:3]
MARK = "# written by install_wheelhouse.sh from "
python = os.path.join(bindir, "python")
shebang = f"#!{python}\n"
if len(shebang) > 127 or any(c.isspace() for c in python):
    # The kernel cuts a long #! line and splits it at blanks: start through sh instead, as pip does.
    shebang = f"#!/bin/sh\n'''exec' \"{python}\" \"$0\" \"$@\"\n' '''\n"

scripts, notes = {}, []
for dist in sorted(md.distributions(path=[site]), key=lambda d: d.metadata["Name"].lower()):
    name_version = f"{dist.metadata['Name']} {dist.version}"
    for ep in dist.entry_points.select(group="console_scripts"):
        top, _, rest = (ep.attr or "").partition(".")
        if "/" in ep.name or not top.isidentifier() or not all(p.isidentifier() for p in ep.module.split(".")):
            notes.append(f"{name_version}'s console script {ep.name} = {ep.value} is not module:function")
        elif ep.name in scripts:
            notes.append(f"{ep.name} of {name_version} left out: {scripts[ep.name][0]} has one")
        else:
            scripts[ep.name] = (
                name_version,
                f"{shebang}{MARK}{name_version}: {ep.name} = {ep.value}\n"
                f"import sys\nfrom {ep.module} import {top}\n\n"
                f'if __name__ == "__main__":\n    sys.exit({ep.attr}())\n',
            )


def ours(path):
    try:
        with open(path, encoding="utf-8") as f:
            return MARK in f.read(4096)
    except (OSError, UnicodeDecodeError):
        return False


for name in sorted(os.listdir(bindir)):
    path = os.path.join(bindir, name)
    if name not in scripts and os.path.isfile(path) and ours(path):
        os.remove(path)
written = []
for name, (source, text) in sorted(scripts.items()):
    path = os.path.join(bindir, name)
    if re.fullmatch(r"python[0-9.]*|[Aa]ctivate.*", name):
        notes.append(f"{name} of {source} left out: {path} is the venv's own")
        continue
    if os.path.lexists(path) and not ours(path):  # a hand-written wrapper, say: ours replaces it
        notes.append(f"{path} was not written by the installer: replaced by {name} of {source}")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(path + ".tmp", 0o755)
    os.replace(path + ".tmp", path)
    written.append(name)
for note in notes:
    print(f"install_wheelhouse: warning: {note}", file=sys.stderr)
if "vllm" not in written:
    print("install_wheelhouse: warning: no `vllm` console script: the wheelhouse's vllm declares none", file=sys.stderr)
among = ", vllm among them" if "vllm" in written else ""
print(f"install_wheelhouse: {len(written)} console scripts of the wheelhouse in {bindir}{among}")
PY

# 6. The patch series, on the wheelhouse's vLLM.
PYTHON=$py bash "$repo/patches/apply_series.sh" "$site" "$series" || die 1 "the patch series $series does not apply to $site"

# 7. What the venv sees, from a neutral folder so that nothing in the caller's shadows it.
cd /
"$vpy" -I - "$repo" "$lock" <<'PY' || die 1 "$vpy cannot import torch and vllm (above)"
import importlib.metadata as md
import sys

repo, lock = sys.argv[1:3]
# First the `# image:` names nothing provides: they explain an import failure below.
try:
    sys.path.append(repo)  # after the venv's own: the lock's parser, from this checkout if need be
    from hpctoolkit.deploy.lock import parse_lock

    with open(lock, encoding="utf-8") as f:
        image = parse_lock(f.read(), lock).image
except (ImportError, OSError, ValueError) as err:
    print(f"install_wheelhouse: warning: the `# image:` names were not checked ({err})", file=sys.stderr)
    image = {}
missing = []
for name in image:
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        missing.append(name)
if missing:
    print(f"install_wheelhouse: warning: {lock} expects the image to provide {', '.join(missing)}, "
          "which neither it nor the wheelhouse does", file=sys.stderr)

import torch
import vllm

cuda = torch.cuda.is_available()
count = torch.cuda.device_count() if cuda else 0
names = ", ".join(torch.cuda.get_device_name(i) for i in range(count)) or "none"
try:
    nccl = torch.cuda.nccl.version()
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
except Exception as err:  # a CPU build of torch has no NCCL
    nccl = f"none ({type(err).__name__})"
print(f"install_wheelhouse: torch {torch.__version__}, vllm {vllm.__version__}, cuda {cuda}, "
      f"{count} GPU(s): {names}, NCCL {nccl}")
PY

# 8. make's set-up stamp: `make run VENV=$venv` (and `make test`) take this venv as set up.
touch "$venv/.hpctoolkit-setup"
