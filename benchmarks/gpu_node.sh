#!/usr/bin/env bash
# The GPU pipeline on one offline CUDA node, driven from a checkout that reaches it through a link
# that copies a bounded size at a time (our lent H200): the wheelhouse arrives in parts (`make
# wheelhouse-parts`), then the stages run in the background, in a session of their own, so that the
# caller can poll them with short calls.
#
#   benchmarks/gpu_node.sh stage PART...     move dist/wheelhouse-parts/PART to $HPC/parts
#   benchmarks/gpu_node.sh start [STAGE...]  lay the committed tree (dist/snapshot.tar, from
#                                            `git archive HEAD`; else this checkout as it is) in
#                                            $HPC/repo and run the stages (default: install tier
#                                            run bench) there, in order
#   benchmarks/gpu_node.sh wait SECONDS      until the stages end or SECONDS pass; print the log's
#                                            tail and copy the results into $OUT (when set)
#
# A py-spy wheel in .prof/ (ignored; carried with `start`) is installed, and the ladder stage then
# records the trainer twice (profile_trainer): where its main thread goes, without polling for it.
#
# The lent machine goes back after 30 s without a call, stages and all: poll with `wait 25`, and
# make edits in the same batch of calls as a poll, not between them (2026-12-06: one node lost).
#
# Stages: ladder (one rung of benchmarks/acceptance.py --ladder), trainer_input (the trainer's input
# path alone), stress (the overlapped-steps stress test and its controls),
# install (launch/install_wheelhouse.sh into $HPC/venv), tier (`pytest -m gpu`), devsum and
# store_gpu (the GPU's checksums: tests, then their cost on the fragment path), reader (a CUDA
# reader's fetch phase by phase, benchmarks/reader_device.py), tier_new
# (the gpu tests not yet run on CUDA), flake (the overlapped-steps test after the vLLM tests), stress
# (that test under stress, with its positive controls and CUDA-sanitizer arms), run (`make run` with that venv: the GPU default), bench
# (benchmarks/gpu_pipeline.py all, on make run's draft), or its parts one at a time: regen,
# capture, serve (after run or ladder: the draft against the target alone); store (the checksums' cost, benchmarks/store_path.py). Each appends to $HPC/results/STAGE.log and records "STAGE rc=N seconds=S" in
# $HPC/results/stages.txt; the stages go on after a failed one. Every limit ends in a SIGKILL 20 s
# after its SIGTERM: on 2026-12-06 the tier's pytest outlived its SIGTERM by ten minutes.
set -uo pipefail
HPC=${HPC:-/opt/hpc}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
res=$HPC/results
py=$HPC/venv/bin/python

stage_install() {
  bash launch/install_wheelhouse.sh "$HPC/parts" "$HPC/venv" || return 1
  # This checkout, importable by every process the venv starts (as an editable install would).
  site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$HPC/repo" > "$site/zz-hpctoolkit-checkout.pth"
}

stage_tier() {
  # Only the modules that hold gpu-marked tests: collecting the others imports them all, and a
  # vLLM-CPU module's import-time settings would reach every CUDA engine of the run.
  # tests/gpu first: what only a GPU checks (CUDA graphs, side streams) before the CPU suite's
  # modules that the gpu mark also runs on CUDA.
  local files
  mapfile -t files < <(grep -l 'mark\.gpu' tests/gpu/test_*.py; grep -l 'mark\.gpu' tests/e2e/test_*.py)
  # One test at a time: vLLM refuses to start while another engine frees memory beside it. 900 s:
  # on a fresh H100 (2026-12-06) the e2e modules alone took about 5 minutes.
  timeout -k 20 900 "$py" -m pytest -m gpu -p no:cacheprovider -o addopts= -ra \
    --basetemp "$res/tmp-tier" --junitxml "$res/tier.xml" "${files[@]}"
}

stage_run() {
  touch "$HPC/venv/.hpctoolkit-setup"  # make's setup stamp: the wheelhouse venv is set up
  # 600 s cut the H100 run of 2026-12-05 off at its evaluation (80 MT-Bench + 164 HumanEval questions).
  # RUN_ARGS: overrides for a shorter run (e.g. "evaluate.enabled=false training.steps=200").
  timeout -k 20 1200 make run VENV="$HPC/venv" PY="$py" ARGS="${RUN_ARGS:-}"
  local rc=$?
  find runs/local_gpu -name summary.json -exec cp {} "$res/summary.json" \;
  return $rc
}

# One rung of the acceptance ladder (benchmarks/acceptance.py --ladder), the GPU's utilization
# sampled every second beside it (smi.csv), each point's summary and trainer log copied back.
# LADDER_POINTS (default 4096:2048) and LADDER_FAMILIES (default dflash) pick the rung; LADDER_ARGS
# adds recipe overrides (e.g. "engine.regenerate_replicas=1").
# Two 8-second py-spy records (raw) of the rung's trainer, 20 s and 150 s after its first step:
# its live pass and its replay, without a caller polling for them. Needs $HPC/pyspy (a py-spy wheel
# carried in .prof/, installed by `start`).
profile_trainer() {
  local spy=$HPC/pyspy/bin/py-spy log="" pid="" at
  for _ in $(seq 900); do
    # shellcheck disable=SC2012  # the newest run's log; these paths hold no odd characters
    log=$(ls -t runs/acceptance/*/*/logs/trainer0.log 2>/dev/null | head -n 1)
    pid=$(pgrep -f "hpctoolkit.roles trainer" | head -n 1)
    [ -n "$pid" ] && [ -n "$log" ] && grep -qs "hpctoolkit.trainer\] step" "$log" && break
    sleep 2
  done
  [ -n "$pid" ] || return 0
  for at in 20 150; do
    sleep $((at == 20 ? 20 : 122))
    "$spy" record --pid "$pid" -d 8 -r 100 -f raw -o "$res/trainer-at$at.raw" > /dev/null 2>&1 || return 0
    grep -s "hpctoolkit.trainer\] step" "$log" | tail -n 1 > "$res/trainer-at$at.step"
  done
}

stage_ladder() {
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -l 1 \
    > "$res/smi.csv" 2>&1 &
  local smi=$!
  [ -x "$HPC/pyspy/bin/py-spy" ] && profile_trainer &
  local extra
  read -r -a extra <<< "${LADDER_ARGS:-}"
  timeout -k 20 1500 "$py" benchmarks/acceptance.py --ladder --points "${LADDER_POINTS:-4096:2048}" \
    --families "${LADDER_FAMILIES:-dflash}" --out runs/acceptance --record "$res/ladder.jsonl" \
    "${extra[@]}"
  local rc=$?
  kill "$smi" 2>/dev/null
  cp runs/acceptance/acceptance.json "$res/" 2>/dev/null
  # Each point's `latest` is a link (find does not follow it, so the 2026-12-08 rung's summary
  # stayed behind): glob through it. The logs' last 4 MiB each, named by point.
  local f point
  for f in runs/acceptance/*/latest/summary.json; do
    [ -f "$f" ] || continue
    point=$(basename "$(dirname "$(dirname "$f")")")
    cp "$f" "$res/summary-$point.json"
    for log in "$(dirname "$f")"/logs/*.log "$(dirname "$f")"/logs/*.json; do
      [ -f "$log" ] && tail -c 4194304 "$log" > "$res/$point-$(basename "$log")"
    done
  done
  return $rc
}

# The first runs on CUDA of tests written after the last GPU session, ahead of the whole tier.
NEW_GPU_TESTS=(
  "tests/gpu/test_train_gpu.py::test_a_batch_packed_on_the_host_is_padded_on_the_device_bitwise"
  "tests/e2e/test_engine_real.py::test_a_request_aborted_mid_prefill_leaves_no_fragment"
  "tests/gpu/test_gpu_vllm.py::test_graphs_round_as_compiled_without_graphs"
  "tests/gpu/test_gpu_vllm.py::test_no_stale_rows_under_graphs"
  "tests/gpu/test_train_gpu.py::test_overlapped_steps_train_as_drained_ones"
  "tests/e2e/test_vllm_serve_cli.py::test_the_printed_serve_command_serves_the_export"
)

# The trainer's collate, padded on the host against packed and padded on the GPU (benchmarks/collate.py).
stage_collate() {
  timeout -k 20 300 "$py" benchmarks/collate.py --device cuda
}

stage_tier_new() {
  timeout -k 20 420 "$py" -m pytest -m gpu -p no:cacheprovider -o addopts= -ra \
    --basetemp "$res/tmp-tier_new" --junitxml "$res/tier_new.xml" "${NEW_GPU_TESTS[@]}"
}

# The benchmark's parts one at a time, so that a lease cut short keeps the parts that finished.
stage_regen() {
  timeout -k 20 480 "$py" benchmarks/gpu_pipeline.py regen --max-num-seqs --json "$res/regen.json"
}

stage_capture() {
  timeout -k 20 540 "$py" benchmarks/gpu_pipeline.py capture --prefill-batch 1 8 32 --json "$res/capture.json"
}

# The draft against the target alone (issue 43 item 3): SERVE_EXPORT, else the newest export of a
# ladder rung or of the run stage.
stage_serve() {
  local export_dir=${SERVE_EXPORT:-}
  if [ -z "$export_dir" ]; then
    # shellcheck disable=SC2012  # the newest by time, and these paths hold no odd characters
    export_dir=$(ls -td runs/acceptance/*/latest/train/export runs/local_gpu/*/train/export 2>/dev/null | head -n 1)
  fi
  [ -n "$export_dir" ] || { echo "no export under runs/acceptance or runs/local_gpu: no draft to serve"; return 1; }
  echo "serving $export_dir"
  timeout -k 20 420 "$py" benchmarks/gpu_pipeline.py serve --export "$export_dir" --json "$res/serve.json"
}

stage_bench() {
  export_dir=$(find runs/local_gpu -type d -name export -print -quit 2>/dev/null)
  [ -n "$export_dir" ] || { echo "no export under runs/local_gpu: the run stage made no draft"; return 1; }
  timeout -k 20 480 "$py" benchmarks/gpu_pipeline.py all --export "$export_dir" --json "$res/bench.json"
}

# The GPU's own checksums (wmix64, hpctoolkit/integrity/devsum.py): the kernel against the definition, a
# CUDA stage's publish and a CUDA reader's check end to end, the collate from checked copies; then
# their cost on the fragment path of a CUDA engine and a CUDA trainer.
stage_devsum() {
  timeout -k 20 300 "$py" -m pytest -m gpu -p no:cacheprovider -o addopts= -ra \
    --basetemp "$res/tmp-devsum" --junitxml "$res/devsum.xml" \
    tests/gpu/test_devsum_gpu.py tests/gpu/test_publish_gpu.py tests/gpu/test_train_gpu.py
}

# The overlapped-steps test that failed once in the tier of 2026-12-06, after the vLLM engine tests
# in the same process (and passed 14 times elsewhere). First ten times after `import vllm` alone:
# vLLM's import patches torch's inductor for the whole process (vllm/env_override.py; a trainer
# role never imports vLLM). Then ten times after the vLLM engine tests.
stage_flake() {
  local t=tests/gpu/test_train_gpu.py::test_overlapped_steps_train_as_drained_ones
  export HPCTOOLKIT_OVERLAP_REPEATS=10
  timeout -k 20 300 "$py" -c "import sys, vllm, pytest; sys.exit(pytest.main(sys.argv[1:]))" \
    -m gpu -p no:cacheprovider -o addopts= -ra -s --basetemp "$res/tmp-flake-import" "$t"
  timeout -k 20 600 "$py" -m pytest -m gpu -p no:cacheprovider -o addopts= -ra -s \
    --basetemp "$res/tmp-flake" --junitxml "$res/flake.xml" tests/gpu/test_gpu_vllm.py "$t"
}

# Issue 42, item 2: the overlapped steps under stress (spins on both streams, poisoned page-locked
# batches, freed device blocks handed out again), its positive controls (DeviceFeeder.put without
# wait_stream, without record_stream: each in a child, each must differ) and its CUDA-sanitizer
# arms, with the pool's copy-event test. The STRESS-REPORT lines (-s) say which statistic differed
# and each arm's dynamo recompiles. Then the stress test once more after `import vllm`, as in flake.
stage_stress() {
  local f=tests/gpu/test_train_gpu.py
  timeout -k 20 900 "$py" -m pytest -m gpu -p no:cacheprovider -o addopts= -ra -s \
    --basetemp "$res/tmp-stress" --junitxml "$res/stress.xml" \
    "$f::test_a_pooled_buffer_goes_out_again_only_after_its_copy_has_read_it" \
    "$f::test_overlapped_steps_under_stress" \
    "$f::test_the_stress_catches_a_feeder_without" \
    "$f::test_the_stressed_steps_under_the_cuda_sanitizer"
  local rc=$?
  timeout -k 20 300 "$py" -c "import sys, vllm, pytest; sys.exit(pytest.main(sys.argv[1:]))" \
    -m gpu -p no:cacheprovider -o addopts= -ra -s --basetemp "$res/tmp-stress-import" \
    "$f::test_overlapped_steps_under_stress" || rc=$?
  return $rc
}

stage_store_gpu() {
  _with_variants timeout -k 20 240 "$py" benchmarks/store_path.py --device cuda --iters 15
}

# Where a CUDA reader's fetch time goes (benchmarks/reader_device.py): phase by phase, no store.
stage_reader() {
  _with_variants timeout -k 20 180 "$py" benchmarks/reader_device.py --iters 15 --profile
}

# The trainer's input path alone on CUDA (benchmarks/trainer_input.py): a real master, an engine-like
# writer on the GPU, the live source and its replay, read ahead against inline, at 1k and 8k samples
# and 32k with short samples (the node's 64 GiB disk holds the spool; it is removed after each arm).
stage_trainer_input() {
  timeout -k 20 420 "$py" benchmarks/trainer_input.py --device cuda --samples 1024,8192 --compare \
    --tokens-max 1024 --json "$res/trainer_input.json" || return $?
  timeout -k 20 300 "$py" benchmarks/trainer_input.py --device cuda --samples 32768 --tokens-max 256 \
    --step-ms 40 --json "$res/trainer_input_32k.json"
}

# The checksums' cost on the fragment path (benchmarks/store_path.py) on this node's cores.
stage_store() {
  _with_variants timeout -k 20 240 "$py" benchmarks/store_path.py --iters 15
}

# CMD in the committed tree, then in each variant in dist/variant-*/ (files laid over a copy of
# the tree). The variants are read when the stage runs: a later call can still bring one (carry).
_with_variants() {
  "$@"
  for v in "$here"/dist/variant-*/; do
    [ -d "$v" ] || continue
    local tree
    tree=$HPC/$(basename "$v")
    rm -rf "$tree" && cp -a "$HPC/repo" "$tree" && cp -a "$v." "$tree/"
    echo "== variant $(basename "$v")"
    (cd "$tree" && PYTHONPATH=$tree "$@")
  done
}

run_stages() {
  cd "$HPC/repo" || exit 1
  # HPCTOOLKIT_ALLOW_SKIPS: the suite's expected-skip list (tests/conftest.py) is written for the
  # CPU machines; here a stage's skips are listed, not failed.
  export HPCTOOLKIT_CACHE=$HPC/cache PYTHONUNBUFFERED=1 HPCTOOLKIT_ALLOW_SKIPS=1
  for s in "$@"; do
    t0=$(date +%s)
    echo "== $s $(date -u +%FT%TZ)" >> "$res/$s.log"
    "stage_$s" >> "$res/$s.log" 2>&1
    rc=$?
    echo "$s rc=$rc seconds=$(( $(date +%s) - t0 ))" >> "$res/stages.txt"
  done
  echo "finished" >> "$res/stages.txt"
}

case ${1:-} in
  stage)
    shift
    mkdir -p "$HPC/parts"
    for p in "$@"; do mv "$here/dist/wheelhouse-parts/$p" "$HPC/parts/"; done
    echo "staged $(find "$HPC/parts" -type f | wc -l) parts, $(du -sh "$HPC/parts" | cut -f1)";;
  start)
    shift
    [ $# -gt 0 ] || set -- install tier run bench
    mkdir -p "$res"
    rm -rf "$res/stages.txt" "$HPC/repo" && mkdir -p "$HPC/repo"
    if [ -f "$here/dist/snapshot.tar" ]; then
      tar -xf "$here/dist/snapshot.tar" -C "$HPC/repo"
      # The commit `git archive` wrote into the tar's header: what a ladder row records.
      python3 -c 'import sys, tarfile; print(tarfile.open(sys.argv[1]).pax_headers.get("comment", ""))' \
        "$here/dist/snapshot.tar" > "$HPC/repo/.commit"
    else
      cp -a "$here/." "$HPC/repo/"
    fi
    if compgen -G "$here/.prof/py_spy-*.whl" > /dev/null; then
      python3 -m pip install -q --no-index --no-deps --target "$HPC/pyspy" "$here"/.prof/py_spy-*.whl
    fi
    setsid nohup "$0" _run "$@" > "$res/driver.log" 2>&1 < /dev/null &
    echo "started: $*";;
  _run)
    shift
    run_stages "$@";;
  wait)
    deadline=$(( $(date +%s) + ${2:-60} ))
    while [ "$(date +%s)" -lt "$deadline" ] && ! grep -qx "finished" "$res/stages.txt" 2>/dev/null; do sleep 3; done
    cat "$res/stages.txt" 2>/dev/null
    last=$(find "$res" -name "*.log" -printf "%T@ %p\n" 2>/dev/null | sort -n | tail -1 | cut -d" " -f2)
    [ -n "$last" ] && { echo "--- tail of $last"; tail -n 40 "$last"; }
    if [ -n "${OUT:-}" ]; then
      # At most 8 files come back: stages.txt, and one archive of every stage's log (its last 4 MB)
      # and what the stages wrote.
      cp "$res/stages.txt" "$OUT/" 2>/dev/null
      tmp=$(mktemp -d)
      for f in "$res"/*; do
        [ -f "$f" ] || continue
        case $f in *.log) tail -c 4000000 "$f" > "$tmp/$(basename "$f")";; *) cp "$f" "$tmp/";; esac
      done
      # The logs the tests wrote under their --basetemp (an engine arm's, a master's), each's last
      # 200 kB: what tells a slow or stuck test from a failed one.
      find "$res" -mindepth 2 -name "*.log" -print | while read -r f; do
        rel=${f#"$res"/}
        mkdir -p "$tmp/$(dirname "$rel")" && tail -c 200000 "$f" > "$tmp/$rel"
      done
      tar -czf "$OUT/results.tgz" -C "$tmp" . && rm -rf "$tmp"
    fi;;
  *) echo "usage: gpu_node.sh stage PART... | start [STAGE...] | wait SECONDS" >&2; exit 2;;
esac
