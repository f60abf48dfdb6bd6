#!/usr/bin/env bash
# The image's %post, as one script: apptainer/hpctoolkit.def runs it during `apptainer build`, and
# tests/e2e/test_apptainer_post.py runs it on a scratch virtualenv holding the CUDA vLLM wheel, so the
# rehearsal exercises these very steps.
#
#   apptainer/post.sh SRC_DIR
#
# SRC_DIR is the copy of the tree %files made (/opt/hpctoolkit in the image): apptainer/, patches/,
# hpctoolkit/, pyproject.toml, README.md. Environment:
#   PYTHON          the interpreter whose site-packages hold vLLM (default: python3)
#   VLLM_VERSION    the vLLM the base ships; its patch series is patches/vllm/v$VLLM_VERSION/series
#   BASE_IMAGE      the base image reference, BASE_DIGEST its digest ("unknown" when not known)
#   BUILD_INFO      where the build-info file goes (default: SRC_DIR/build-info.json)
#   APPTAINER_LABELS  set by apptainer during %post: labels appended there land in the image
#   HPCTOOLKIT_POST_APT=0  never run apt-get (missing system libraries then fail the step)
#
# Steps: patch vLLM, install hpctoolkit, install the Mooncake wheel of the base's CUDA major,
# byte-compile, write the build info. The base's own packages are never changed: every pip
# install is constrained to the versions the base ships, and the step fails if any of them moved.
set -euo pipefail
src=$(cd "${1:?usage: post.sh SRC_DIR}" && pwd)
# Away from any checkout: python puts the working directory first on its path.
cd /
py=${PYTHON:-python3}
version=${VLLM_VERSION:?VLLM_VERSION must name the vLLM version the base image ships}
build_info=${BUILD_INFO:-$src/build-info.json}
series=$src/patches/vllm/v$version/series
say() { echo "hpctoolkit post: $*"; }
die() { echo "hpctoolkit post: $*" >&2; exit 1; }

[ -f "$series" ] || die "no patch series for vLLM $version at $series: only a pinned directory under" \
  "patches/vllm/ carries one, and a vLLM without the series captures aux states on the last PP stage only"

apt_install() {  # Debian/Ubuntu packages, only where allowed and possible
  if [ "${HPCTOOLKIT_POST_APT:-1}" = 0 ] || [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    die "missing system packages $*; install them (or let this step run apt-get as root)"
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# --- 1. vLLM: the installed version must be the one the series is pinned to --------------------
site=$("$py" -c 'import importlib.util, os; s = importlib.util.find_spec("vllm"); print(os.path.dirname(list(s.submodule_search_locations)[0]))')
have=$("$py" -c 'import importlib.metadata as m; print(m.version("vllm"))')
[ "${have%%+*}" = "$version" ] || die "the base ships vLLM $have, but VLLM_VERSION is $version"
command -v patch >/dev/null || apt_install patch
say "patching vLLM $have in $site"
# Fails the build on fuzz, a rejected or ambiguous hunk, or a partly patched tree.
PYTHON=$py bash "$src/patches/apply_series.sh" "$site" "$series"

# What the base ships, name==version per line: the constraint of every install below, and what
# must still hold once they are done.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
freeze() {
  "$py" - <<'PY'
import importlib.metadata as m
seen = {}
for d in m.distributions():
    name = (d.metadata["Name"] or "").lower().replace("_", "-")
    if name and name not in seen:
        seen[name] = d.version
print("\n".join(sorted(f"{n}=={v}" for n, v in seen.items())))  # sorted as lines, for comm
PY
}
freeze >"$work/base.txt"

# --- 2. hpctoolkit ------------------------------------------------------------------------------
# Without extras, and so without a flash-attention one: flash-attn-4 pins nvidia-cutlass-dsl
# exactly (4.6.0.dev0 against a base's 4.6.0) and pulls apache-tvm-ffi past the version vLLM's
# flashinfer was built against; every worker then aborted at start (memory profiling) with
# `tvm::ffi::Error: TypeAttr __ffi_repr__ is already registered`, after a clean build and import.
# hpctoolkit itself goes in without dependencies; its runtime dependencies that the base lacks
# follow, constrained to the base, so torch, transformers, flashinfer and CUTLASS stay the base's.
"$py" -m pip install -q --no-deps --no-build-isolation "$src"
"$py" - "$src/pyproject.toml" "$work/base.txt" "$work/missing.txt" "$work/differ.txt" <<'PY'
import re, sys, tomllib
pyproject, base, missing_out, differ_out = sys.argv[1:5]
with open(pyproject, "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
have = dict(line.split("==", 1) for line in open(base).read().split())
missing, differ = [], []
for dep in deps:
    name, spec = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*)$", dep).groups()
    key = name.lower().replace("_", "-")
    if key not in have:
        missing.append(dep)
    elif spec.startswith("==") and have[key].split("+")[0] != spec[2:].strip():
        differ.append(f"{key}: hpctoolkit pins {spec[2:].strip()}, the base ships {have[key]} (kept)")
open(missing_out, "w").write("".join(f"{d}\n" for d in missing))
open(differ_out, "w").write("".join(f"{d}\n" for d in differ))
PY
if [ -s "$work/missing.txt" ]; then
  say "adding what the base lacks: $(tr '\n' ' ' <"$work/missing.txt")"
  "$py" -m pip install -q -c "$work/base.txt" -r "$work/missing.txt"
fi
sed 's/^/hpctoolkit post: /' "$work/differ.txt"

# --- 3. Mooncake: the wheel of the CUDA major the base's torch (and so vLLM) was built for -------
cuda=$("$py" -c 'import torch; print(torch.version.cuda or "")')
[ -n "$cuda" ] || die "the base's torch is not a CUDA build (torch.version.cuda is unset)"
mooncake_version=$("$py" - "$src/pyproject.toml" <<'PY'
import re, sys, tomllib
with open(sys.argv[1], "rb") as f:
    extra = tomllib.load(f)["project"]["optional-dependencies"]["engine"]
print(next(re.split("==", d)[1].strip() for d in extra if d.startswith("mooncake-transfer-engine")))
PY
)
case ${cuda%%.*} in
  12) mooncake="mooncake-transfer-engine" ;;
  13) mooncake="mooncake-transfer-engine-cuda13" ;;
  *) die "no Mooncake wheel is published for CUDA $cuda" ;;
esac
other=$(grep -E '^mooncake-transfer-engine' "$work/base.txt" | grep -v "^$mooncake==" || true)
[ -z "$other" ] || die "the base already ships another Mooncake build ($other); $mooncake is the one for CUDA $cuda"
say "CUDA $cuda: installing $mooncake==$mooncake_version"
"$py" -m pip install -q -c "$work/base.txt" "$mooncake==$mooncake_version"
# Its native libraries need system libraries the base may lack (libcuda.so.1 is the driver's,
# which `apptainer exec --nv` brings from the host).
mc_dir=$("$py" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("mooncake").origin))')
mapfile -t lost < <(for so in "$mc_dir"/store.so "$mc_dir"/engine.so; do ldd "$so"; done \
  | sed -n 's/^[[:space:]]*\([^ ]*\) => not found.*/\1/p' | grep -v '^libcuda\.so\.1$' | sort -u)
if [ "${#lost[@]}" -gt 0 ]; then
  pkgs=()
  for lib in "${lost[@]}"; do
    case $lib in
      libibverbs.so.1) pkgs+=(libibverbs1) ;;
      libmlx5.so.1) pkgs+=(ibverbs-providers) ;;
      librdmacm.so.1) pkgs+=(librdmacm1) ;;
      libnuma.so.1) pkgs+=(libnuma1) ;;
      libcurl.so.4) pkgs+=(libcurl4) ;;
      *) die "$mooncake needs $lib, which no known package provides" ;;
    esac
  done
  say "system libraries for $mooncake: ${pkgs[*]}"
  apt_install "${pkgs[@]}"
fi

freeze >"$work/after.txt"
moved=$(LC_ALL=C comm -23 "$work/base.txt" "$work/after.txt")
[ -z "$moved" ] || die "the install changed packages the base ships (base versions shown): $moved"

# --- 4. byte-compile what was patched and installed (the image is read-only at run time) --------
"$py" -m compileall -q -j 0 "$site/vllm" "$("$py" -c 'import hpctoolkit, os; print(os.path.dirname(hpctoolkit.__file__))')" >/dev/null

# --- 5. build info: a file in the image, and the same facts as labels ---------------------------
"$py" - "$build_info" "$src" "$series" "$mooncake==$mooncake_version" "$cuda" "$work/differ.txt" <<'PY'
import hashlib, importlib.metadata as m, json, os, platform, sys
out, src, series, mooncake, cuda, differ = sys.argv[1:7]
names = [ln.split("#", 1)[0].split()[0] for ln in open(series) if ln.split("#", 1)[0].strip()]
here = os.path.dirname(series)
info = {
    "base_image": os.environ.get("BASE_IMAGE", "unknown"),
    "base_digest": os.environ.get("BASE_DIGEST", "unknown") or "unknown",
    "vllm_version": m.version("vllm"),
    "patch_series": os.path.relpath(series, src),
    "patches": [
        {"name": n, "sha256": hashlib.sha256(open(os.path.join(here, n), "rb").read()).hexdigest()}
        for n in names
    ],
    "hpctoolkit_version": m.version("hpctoolkit"),
    "python": platform.python_version(),
    "torch": m.version("torch"),
    "cuda": cuda,
    "mooncake": mooncake,
    "pins_kept_from_base": open(differ).read().split("\n")[:-1],
}
with open(out, "w") as f:
    json.dump(info, f, indent=2)
    f.write("\n")
labels = {
    "org.hpctoolkit.base-image": info["base_image"],
    "org.hpctoolkit.base-digest": info["base_digest"],
    "org.hpctoolkit.vllm-version": info["vllm_version"],
    "org.hpctoolkit.version": info["hpctoolkit_version"],
    "org.hpctoolkit.mooncake": mooncake,
    **{f"org.hpctoolkit.patch.{p['name']}": f"sha256:{p['sha256']}" for p in info["patches"]},
}
dest = os.environ.get("APPTAINER_LABELS") or os.environ.get("SINGULARITY_LABELS")
if dest:
    with open(dest, "a") as f:
        f.writelines(f"{k} {v}\n" for k, v in labels.items())
print(f"hpctoolkit post: build info in {out}")
PY
