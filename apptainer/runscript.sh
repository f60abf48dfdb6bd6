#!/bin/sh
# The image's %runscript: `apptainer run IMAGE COMMAND ARGS...` dispatches to hpctoolkit's entry
# points, with the image's python3.
#
#   submit RECIPE [key=value ...] [--dry-run] [--render-sbatch]   python -m hpctoolkit.submit
#   roles ROLE RECIPE [key=value ...]     one role of a job (what each Slurm step runs)
#   export CHECKPOINT OUT_DIR             python -m hpctoolkit.models.export
#   evaluate EXPORT_DIR --target DIR      python -m hpctoolkit.evaluate
#   inspect DRAFT_CONFIG                  python -m hpctoolkit.models.inspect
#   python ARGS...                        the image's python3 itself
#   build-info                            the build-info file (base, vLLM, patches, versions)
set -eu
PY=${HPCTOOLKIT_IMAGE_PYTHON:-python3}
SRC=${HPCTOOLKIT_IMAGE_SRC:-/opt/hpctoolkit}
usage() {
  sed -n 's/^#   //p' "$0" >&2
}
cmd=${1:-}
[ $# -gt 0 ] && shift
case $cmd in
  submit) exec "$PY" -m hpctoolkit.submit "$@" ;;
  roles) exec "$PY" -m hpctoolkit.roles "$@" ;;
  export) exec "$PY" -m hpctoolkit.models.export "$@" ;;
  evaluate) exec "$PY" -m hpctoolkit.evaluate "$@" ;;
  inspect) exec "$PY" -m hpctoolkit.models.inspect "$@" ;;
  python) exec "$PY" "$@" ;;
  build-info) exec cat "$SRC/build-info.json" ;;
  '' | -h | --help | help)
    echo "usage: apptainer run IMAGE COMMAND ARGS..." >&2
    usage
    [ -n "$cmd" ] ;;
  *)
    echo "hpctoolkit image: unknown command '$cmd'" >&2
    usage
    exit 2 ;;
esac
