#!/usr/bin/env bash
# The image's %test, as one script: apptainer/hpctoolkit.def's %test runs it (`apptainer build`
# runs %test on the build host, and `apptainer test IMAGE` anywhere), and
# tests/e2e/test_apptainer_post.py runs it after rehearsing %post on a scratch virtualenv.
#
#   apptainer/test.sh SRC_DIR        (SRC_DIR: /opt/hpctoolkit in the image)
#
# PYTHON names the interpreter (default: python3), BUILD_INFO the build-info file post.sh wrote
# (default: SRC_DIR/build-info.json). No check needs a GPU: a build host (a login node) has none.
# Where a GPU node could check more, it does so when it finds one (`apptainer test --nv`), and
# says which way it went.
#   1. the build info names the series' patches with their sha256, and every patch is applied;
#   2. supports_pp(ExtractHiddenStatesModel) (the config-time guard PP export must pass);
#   3. vLLM's output types carry what the export path reads: ModelRunnerOutput.kv_connector_output
#      and KVConnectorOutput.finished_sending (the PP completion barrier), RequestOutput's
#      kv_transfer_params (the manifest);
#   4. the environment hpctoolkit gives an export engine selects vLLM's V1 model runner;
#   5. Mooncake's native libraries load and link the CUDA runtime of the base's CUDA major;
#   6. hpctoolkit's connector and Mooncake store modules import against the patched vLLM.
set -euo pipefail
src=$(cd "${1:?usage: test.sh SRC_DIR}" && pwd)
# Away from any checkout: python puts the working directory first on its path.
cd /
py=${PYTHON:-python3}
build_info=${BUILD_INFO:-$src/build-info.json}
die() { echo "hpctoolkit test: $*" >&2; exit 1; }
[ -f "$build_info" ] || die "no build info at $build_info (apptainer/post.sh writes it)"
field() { "$py" -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$build_info" "$1"; }
series=$src/$(field patch_series)
version=$(field vllm_version)
site=$("$py" -c 'import importlib.util, os; s = importlib.util.find_spec("vllm"); print(os.path.dirname(list(s.submodule_search_locations)[0]))')

# 1. Every patch of the series is applied (and none would apply again).
n=$(grep -cvE '^[[:space:]]*(#|$)' "$series")
out=$(PYTHON=$py bash "$src/patches/apply_series.sh" --check "$site" "$series")
echo "$out"
grep -q "^apply_series: 0 would apply, $n already present" <<<"$out" \
  || die "the patch series ($n patches) is not fully applied to vLLM $version in $site"

# 5 (setup). Mooncake's libraries link libcuda.so.1, the driver's, which `--nv` brings from the
# host. Without it (a build host with no GPU) they cannot load; then the CUDA compat driver of the
# base, or else an empty stand-in, provides the name, so that everything else they link is still
# checked (they resolve driver symbols lazily, at the first call).
gpu=0
nvidia-smi -L >/dev/null 2>&1 && gpu=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if ! err=$("$py" -c 'import mooncake.store, mooncake.engine' 2>&1); then
  if ! grep -q 'libcuda\.so\.1' <<<"$err" || [ "$gpu" = 1 ]; then die "Mooncake does not load: $err"; fi
  compat=$(find /usr/local/cuda*/compat -name 'libcuda.so.1' 2>/dev/null | head -n 1 || true)
  if [ -n "$compat" ]; then
    ln -s "$compat" "$work/libcuda.so.1"
    echo "hpctoolkit test: no GPU here; Mooncake loads against the CUDA compat driver $compat"
  elif command -v cc >/dev/null; then
    # One empty function per driver symbol the libraries name (some are bound at load time).
    "$py" - "$work/stub.c" "$("$py" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("mooncake").origin))')" <<'PY'
import glob, os, re, sys
out, mc = sys.argv[1:3]
names = set()
for so in glob.glob(os.path.join(mc, "*.so")):
    names |= {m.decode() for m in re.findall(rb"\x00(cu[A-Z][A-Za-z0-9_]*)\x00", open(so, "rb").read())}
open(out, "w").write("".join(f"void {n}(void) {{}}\n" for n in sorted(names)))
PY
    cc -shared -o "$work/libcuda.so.1" "$work/stub.c"
    echo "hpctoolkit test: no GPU and no compat driver here; Mooncake loads against a stand-in libcuda.so.1 (no symbol is called)"
  else
    die "no GPU, no CUDA compat driver and no C compiler: cannot load Mooncake here ($err)"
  fi
  export LD_LIBRARY_PATH=$work${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi

# 5. Mooncake's store and engine load on their own (before anything else loads a CUDA runtime) and
# link the libcudart of the CUDA major the base was built for.
major=$(field cuda)
major=${major%%.*}
mc=$("$py" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("mooncake").origin))')
for so in store.so engine.so; do
  # Read whole first: under pipefail, `ldd | grep -q` fails when grep exits before ldd is done.
  libs=$(ldd "$mc/$so")
  grep -Eq "^[[:space:]]*libcudart\.so\.$major => /" <<<"$libs" \
    || die "$mc/$so does not link libcudart.so.$major: $(grep -E 'cudart|not found' <<<"$libs" | tr -s '[:space:]' ' ')"
done
"$py" - "$major" <<'PY'
import os
import sys

import mooncake.engine
import mooncake.store  # noqa: F401

major = sys.argv[1]
loaded = sorted({ln.split()[-1] for ln in open("/proc/self/maps") if "/libcudart.so." in ln})
if "torch" in sys.modules or not any(os.path.basename(p).startswith(f"libcudart.so.{major}") for p in loaded):
    raise SystemExit(f"hpctoolkit test: FAILED: Mooncake alone should load libcudart.so.{major}, loaded {loaded}")
print(f"hpctoolkit test: ok: Mooncake's store and engine load, linking {loaded}")
PY

HPCTOOLKIT_TEST_GPU=$gpu "$py" - "$build_info" "$series" <<'PY'
import dataclasses
import hashlib
import importlib.metadata as md
import inspect
import json
import os
import sys
from types import SimpleNamespace

build_info, series = sys.argv[1:3]
info = json.load(open(build_info))
gpu = os.environ["HPCTOOLKIT_TEST_GPU"] == "1"


def check(ok, what):
    if not ok:
        raise SystemExit(f"hpctoolkit test: FAILED: {what}")
    print(f"hpctoolkit test: ok: {what}")


# 1. The build info names each patch of the series with the sha256 of the file in the image.
here = os.path.dirname(series)
names = [ln.split("#", 1)[0].split()[0] for ln in open(series) if ln.split("#", 1)[0].strip()]
recorded = {p["name"]: p["sha256"] for p in info["patches"]}
check(list(recorded) == names, f"build info lists the series' patches {names}")
for n in names:
    digest = hashlib.sha256(open(os.path.join(here, n), "rb").read()).hexdigest()
    check(recorded[n] == digest, f"{n} sha256 {digest[:12]}")
check(md.version("vllm") == info["vllm_version"], f"vLLM {info['vllm_version']}")
check(md.version("hpctoolkit") == info["hpctoolkit_version"], f"hpctoolkit {info['hpctoolkit_version']}")

# 2. The config-time guard is lifted.
from vllm.model_executor.models.extract_hidden_states import ExtractHiddenStatesModel
from vllm.model_executor.models.interfaces import supports_pp

check(supports_pp(ExtractHiddenStatesModel), "supports_pp(ExtractHiddenStatesModel)")

# 3. The output fields the export path reads.
from vllm.outputs import RequestOutput
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

check(
    "kv_connector_output" in {f.name for f in dataclasses.fields(ModelRunnerOutput)},
    "ModelRunnerOutput carries kv_connector_output",
)
check(
    "finished_sending" in {f.name for f in dataclasses.fields(KVConnectorOutput)},
    "KVConnectorOutput carries finished_sending (the PP completion barrier)",
)
check(
    "kv_transfer_params" in inspect.signature(RequestOutput.__init__).parameters,
    "RequestOutput carries kv_transfer_params (the manifest)",
)

# 4. The engine's environment selects the V1 runner. Without a GPU, VllmConfig() cannot infer a
# device, so vLLM's own selection (VllmConfig.use_v2_model_runner) is evaluated on a stand-in
# config without the two features that force V2 (HiSparse, watermarking); with one, on VllmConfig().
from hpctoolkit.engine.env import engine_env

env = engine_env("cuda", in_process=False, world_size=16, cpu_kvcache_space_gb=0, host_ip="10.0.0.1")
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = env["VLLM_USE_V2_MODEL_RUNNER"]
from vllm.config import VllmConfig

if gpu:
    v2 = VllmConfig().use_v2_model_runner
else:
    stand_in = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None), watermark_config=None)
    v2 = VllmConfig.use_v2_model_runner.fget(stand_in)
check(
    v2 is False,
    f"VLLM_USE_V2_MODEL_RUNNER={env['VLLM_USE_V2_MODEL_RUNNER']} selects the V1 runner"
    + ("" if gpu else " (vLLM's selection on a stand-in config: no GPU here)"),
)

# 5. The Mooncake build of the base's CUDA major (its loading is checked before this script).
import torch

check(torch.version.cuda == info["cuda"], f"torch's CUDA is {info['cuda']}, as at build time")
major = info["cuda"].split(".")[0]
dist = info["mooncake"].split("==")[0]
check(
    dist == ("mooncake-transfer-engine-cuda13" if major == "13" else "mooncake-transfer-engine"),
    f"{dist} is the Mooncake build for CUDA {info['cuda']}",
)

# 6. What vLLM loads out of tree, and our store client.
import hpctoolkit.engine.connector
import hpctoolkit.store.mooncake  # noqa: F401

check(True, "hpctoolkit.engine.connector and hpctoolkit.store.mooncake import")
PY
