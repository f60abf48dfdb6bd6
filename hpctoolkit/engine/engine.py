"""The capture engine: vLLM's `LLM` with `extract_hidden_states` and `HpcHiddenStatesConnector`.

`build_llm_kwargs` (`engine.kwargs`, pure, no vLLM import) decides every engine argument and environment
variable. `CaptureEngine` applies them, checks the store master is reachable *before* vLLM is
built (an unreachable master fails within `store.connect_timeout_s`, naming the address), and
runs prefill-only requests, `engine.prefill_batch` per `generate()` call, the batches cut at
fixed sample positions (`engine.prefill`), so batch composition never varies with the layout, a
re-run or the timing. Each request's manifest comes back through `kv_transfer_params`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpctoolkit.capture import Manifest, capture_ids_for, check_layer_layout
from hpctoolkit.engine.config import EngineConfig
from hpctoolkit.engine.connector_api import DEFAULT_REACHABILITY_CHECK, MANIFEST_PARAM, load_spec, read_faults
from hpctoolkit.engine.env import detect_backend
from hpctoolkit.engine.kwargs import (
    ONE_NODE,
    PUBLISH_WAIT_S,
    CaptureSink,
    NodeArgs,
    StoreCfg,
    engine_llm_kwargs,
    store_cfg_dict,
)
from hpctoolkit.engine.prefill import GROUP_PARAM, prefill_groups
from hpctoolkit.errors import ConfigError, DataIntegrityError, StoreError
from hpctoolkit.targets.resolve import target_num_layers

if TYPE_CHECKING:
    import psutil


class CaptureEngine:
    """One vLLM engine capturing hidden states into the store. Use as a context manager.

    `cfg.target_layer_ids` are the draft's 0-based layers; the target's layer count is read from
    `model_dir/config.json`. `store_address`, `store_cfg`, `run_id`, `engine_index`,
    `store_factory` and `reachability_check` are where the workers write (`CaptureSink`).
    `capture` returns each sample's manifest (the sample metadata the trainer reads by). A store
    failure surfaces from `capture` as `StoreError` carrying the writer's message; after any
    failure the engine refuses further captures.

    `node` is this node's place in a multi-node engine (`NodeArgs`); a follower node builds its
    kwargs through the same `build_llm_kwargs` call (`engine_llm_kwargs`). Workers record a store
    error in the fault directory: `fault_dir` when given (the run's `RunDir.faults(engine_index)`,
    shared by every node), emptied at start and kept afterwards, so a follower's error reaches the
    leader; without, a private tempdir removed at shutdown.
    """

    def __init__(
        self,
        cfg: EngineConfig,
        model_dir: str | os.PathLike,
        store_address: str | None,
        store_cfg: StoreCfg,
        run_id: str,
        *,
        engine_index: int = 0,
        store_factory: str | None = None,
        reachability_check: str | None = None,
        fault_dir: str | os.PathLike | None = None,
        node: NodeArgs = ONE_NODE,
    ):
        self._llm: Any = None
        self._own_fault_dir = fault_dir is None
        self._fault_dir: str | None = None
        self._broken: BaseException | None = None
        # Command lines of processes vLLM's shutdown left and `shutdown` had to end itself.
        self.reaped: list[str] = []
        self._captured = 0
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.num_layers = target_num_layers(model_dir)
        self.capture_ids = capture_ids_for(cfg.target_layer_ids, self.num_layers)
        check_layer_layout(self.capture_ids, self.num_layers)
        store_d = store_cfg_dict(store_cfg)
        if store_address is not None:
            # Fail fast, before vLLM spends its start-up time; the worker checks again.
            _check_reachable(store_address, store_d, reachability_check)
        import psutil

        self._baseline_children = {p.pid for p in psutil.Process().children(recursive=True)}
        # Every process the engine started, noted while they are still our descendants: a worker
        # whose EngineCore died is re-parented to init and no longer shows among our children.
        self._engine_procs: dict[int, Any] = {}
        self._fault_dir = _fresh_fault_dir(fault_dir)
        self.backend = detect_backend()
        sink = CaptureSink(
            store_address, store_d, run_id, engine_index, self._fault_dir, store_factory, reachability_check
        )
        _, kwargs, env = engine_llm_kwargs(cfg, model_dir, sink, node, backend=self.backend)
        self.in_process = env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        self.pp_size = cfg.pp_size
        self._groups = 0  # prefill batches submitted: each gets its own id
        self._start(model_dir, kwargs, env)
        self._check_batch_fits()

    def _start(self, model_dir: str | os.PathLike, kwargs: dict[str, Any], env: dict[str, str]) -> None:
        """Apply the engine's environment, run the preflight gates and build the `LLM`."""
        import logging

        logging.getLogger(__name__).info(
            "capture engine, PP=%d: VLLM_USE_V2_MODEL_RUNNER=%s (protected; the connector and the "
            "patch series are tested on the V1 runner only)",
            self.pp_size,
            env["VLLM_USE_V2_MODEL_RUNNER"],
        )
        os.environ.update(env)
        try:
            # After the environment is applied (the gates read what the workers inherit, e.g.
            # VLLM_PP_LAYER_PARTITION) and inside `try`, so a refusal still runs `shutdown()`.
            from hpctoolkit.engine.pp_gates import preflight

            preflight(self.cfg, model_dir, self.capture_ids)
            with self._translate_faults():
                from vllm import LLM

                self._llm = LLM(**kwargs)
            self._note_engine_procs()
        except BaseException:
            self.shutdown()
            raise

    def _check_batch_fits(self) -> None:
        """Refuse a KV cache that cannot hold one prefill batch of `max_model_len` prompts: vLLM
        would admit part of a batch and the rest a step later, as its memory allows."""
        b = self.cfg.prefill_batch
        if b == 1:
            return
        cache = self._llm.llm_engine.vllm_config.cache_config
        holds = int(cache.num_gpu_blocks or 0) * int(cache.block_size)
        if holds < b * self.cfg.max_model_len:
            self.shutdown()
            raise ConfigError(
                f"engine.prefill_batch={b} needs KV cache room for {b} x engine.max_model_len="
                f"{self.cfg.max_model_len} tokens; the engine holds {holds}: lower it, or give the "
                "engine more KV cache memory"
            )

    # ------------------------------------------------------------------ faults

    @contextlib.contextmanager
    def _translate_faults(self) -> Iterator[None]:
        """Re-raise an engine failure as the writer's `StoreError` when a worker recorded one.

        In-process the writer's exception arrives as itself; across processes vLLM reports only
        that the engine died, and the fault record carries the real message.
        """
        try:
            yield
        except (StoreError, DataIntegrityError):
            raise
        except Exception as err:
            faults = read_faults(self._fault_dir)
            if faults:
                last = faults[-1]
                cls = DataIntegrityError if last["type"] == "DataIntegrityError" else StoreError
                raise cls(
                    f"engine writer failed ({last['where']}): {last['type']}: {last['message']}"
                ) from err
            raise

    # ------------------------------------------------------------------ capture

    def _drain(self, deadline: float) -> None:
        """Step the engine until the connector published every finished request.

        `deadline` bounds the whole wait; the error names what was still outstanding.
        """
        llm = self._llm
        if self.in_process:
            # In-process nothing steps unless we do: the last request's sample is published in
            # the step after it finished, which also reports it, and its blocks are freed then.
            scheduler = llm.llm_engine.engine_core.engine_core.scheduler
            while scheduler.has_requests():
                if time.monotonic() > deadline:
                    raise DataIntegrityError(
                        f"the connector did not publish the {self._captured} captured sample(s) "
                        f"within {PUBLISH_WAIT_S} s: the engine still holds unfinished requests"
                    )
                llm.llm_engine.step()
            return
        # Multiprocess: EngineCore keeps stepping on its own; wait for every stage's report.
        want = self._captured * self.pp_size
        # The last publish usually lands within a step or two of generate() returning: poll
        # tightly first, then back off, so a capture does not pay a fixed sleep.
        pause = 0.002
        while (have := self._published_total(deadline)) < want:
            if time.monotonic() > deadline:
                raise DataIntegrityError(
                    f"the connector did not publish within {PUBLISH_WAIT_S} s: {have} of {want} "
                    f"stage publishes reported ({self._captured} samples x {self.pp_size} stages)"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    # ---- PP barrier: a stage failing after the last rank sampled (hpctoolkit/patches owner) ----
    def _published_total(self, deadline: float) -> int:
        """Sum of every worker's published count, without hanging on a dead engine.

        A stage whose put fails raises in its worker *after* the request was sampled, so
        `generate()` has already returned; the EngineCore then dies, and a `collective_rpc`
        issued to it is never answered (vLLM 0.32 leaves the utility future pending). The call
        runs on a helper thread while this one watches the writers' fault records and the
        client's engine-dead flag.
        """
        llm = self._llm
        box: dict[str, Any] = {}
        done = threading.Event()

        def call() -> None:
            try:
                box["counts"] = llm.collective_rpc("hpctoolkit_published_count")
            except BaseException as err:  # noqa: BLE001  (re-raised on the calling thread)
                box["error"] = err
            finally:
                done.set()

        # A daemon thread: one left blocked on a dead engine must not hold up interpreter exit.
        threading.Thread(target=call, name="hpctoolkit-drain", daemon=True).start()
        resources = getattr(llm.llm_engine.engine_core, "resources", None)
        while not done.wait(0.2):
            faults = read_faults(self._fault_dir)
            if faults or getattr(resources, "engine_dead", False) or time.monotonic() > deadline:
                raise RuntimeError(
                    "the engine stopped answering while the stages published"
                    + (f" ({len(faults)} writer fault record(s))" if faults else "")
                )
        if "error" in box:
            raise box["error"]
        return sum(box["counts"])

    # ---- end PP barrier ----

    def capture(
        self, prompts_token_ids: Sequence[Sequence[int]], positions: Sequence[int] | None = None
    ) -> list[Manifest]:
        """Prefill the prompts and return their manifests, in order.

        `positions` are the prompts' engine-local sample positions (increasing; default 0, 1, ...):
        prompts whose `position // engine.prefill_batch` agree share one `generate()` call, which
        vLLM runs as one step (`engine.prefill`), so a sample gets the same bits in every run and
        layout that captures its batch whole.

        Returns only after every fragment of every returned manifest is published. The connector
        publishes a finished request in a later engine step, which the next prompt's first step
        usually is, so the wait for the stages' reports (`_drain`) runs once, after the last
        prompt, bounded by `PUBLISH_WAIT_S` from then: capturing prompts in batches pays it once
        per batch rather than per sample. All prompts are checked before the first is run.

        Raises `StoreError` if a writer failed on any sample of the call (the writer's message),
        `DataIntegrityError` if a request comes back without a manifest or the publish reports do
        not arrive in time. Any failure returns no manifest of the call and leaves the engine
        refusing further captures (the call's earlier samples may be in the store unreported).
        """
        if self._broken is not None:
            raise StoreError(f"engine is unusable after an earlier failure: {self._broken}") from self._broken
        if self._llm is None:
            raise RuntimeError("CaptureEngine is shut down")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        batch = [[int(t) for t in prompt] for prompt in prompts_token_ids]
        for i, ids in enumerate(batch):
            if not ids:
                raise ConfigError(f"cannot capture an empty prompt (prompt {i} of {len(batch)})")
            if len(ids) >= self.cfg.max_model_len:
                raise ConfigError(
                    f"prompt {i} of {len(batch)} has {len(ids)} tokens and does not fit "
                    f"engine.max_model_len={self.cfg.max_model_len}"
                )
        where = range(len(batch)) if positions is None else [int(p) for p in positions]
        if len(where) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(where)} positions")
        groups = prefill_groups(where, self.cfg.prefill_batch)
        manifests = []
        try:
            with self._translate_faults():
                for group in groups:
                    params = self._group_params(SamplingParams, len(group))
                    prompts = [TokensPrompt(prompt_token_ids=batch[i]) for i in group]
                    outs = self._llm.generate(prompts, params, use_tqdm=False)
                    for i, out in zip(group, outs, strict=True):
                        manifests.append(self._manifest_of(out, batch[i]))
                self._drain(time.monotonic() + PUBLISH_WAIT_S)
        except BaseException as err:
            self._broken = err
            raise
        return manifests

    def _group_params(self, sampling_params: Any, size: int) -> Any:
        """One prefill batch's sampling parameters: a single sampled token; a batch of several
        carries its id and size to the connector's gate (`engine.prefill.PrefillGate`)."""
        extra = None
        if self.cfg.prefill_batch > 1:
            self._groups += 1
            extra = {"kv_transfer_params": {GROUP_PARAM: [f"b{self._groups}", size]}}
        return sampling_params(max_tokens=1, temperature=0.0, detokenize=False, extra_args=extra)

    def _manifest_of(self, out: Any, ids: list[int]) -> Manifest:
        """The manifest `out` returned for prompt `ids`, checked to be that prompt's."""
        import torch  # lazily, as vLLM: this module imports without either

        from hpctoolkit.store.fragments import INPUT_IDS_SHA256, input_ids_digest

        raw = (out.kv_transfer_params or {}).get(MANIFEST_PARAM)
        if raw is None:
            raise DataIntegrityError(
                f"request {out.request_id} ({len(ids)} tokens) returned no manifest in kv_transfer_params"
            )
        self._captured += 1
        manifest = Manifest.from_dict(raw)
        # Outputs come back in prompt order; the digest the connector put in says so per sample.
        digest = manifest.extra.get(INPUT_IDS_SHA256)
        if manifest.num_tokens != len(ids) or digest != input_ids_digest(torch.tensor(ids, dtype=torch.long)):
            raise DataIntegrityError(
                f"sample {manifest.sample_key}: manifest says {manifest.num_tokens} tokens, prompt has "
                f"{len(ids)}, or its input ids digest is another prompt's"
            )
        return manifest

    # ------------------------------------------------------------------ lifetime

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine and every process it started, within about `timeout_s` + 15 s. Idempotent.

        vLLM's own shutdown runs first, on a helper thread: after an engine death it has been seen
        to block, and a stuck shutdown must not keep the caller (or the engine's processes) alive.
        """
        self._note_engine_procs()
        llm, self._llm = self._llm, None
        if llm is not None:

            def _stop() -> None:
                with contextlib.suppress(Exception):
                    llm.llm_engine.engine_core.shutdown()

            stopper = threading.Thread(target=_stop, name="hpctoolkit-engine-shutdown", daemon=True)
            stopper.start()
            stopper.join(timeout_s)
            if stopper.is_alive():
                self.reaped.append(f"<vLLM shutdown still blocked after {timeout_s:g}s>")
            del llm
            gc.collect()
        self._reap_children(timeout_s)
        if self._fault_dir is not None and self._own_fault_dir:
            shutil.rmtree(self._fault_dir, ignore_errors=True)
            self._fault_dir = None

    def _note_engine_procs(self) -> None:
        import psutil

        baseline = getattr(self, "_baseline_children", None)
        if baseline is None:
            return
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process().children(recursive=True):
                if p.pid not in baseline:
                    self._engine_procs.setdefault(p.pid, p)

    def _reap_children(self, timeout_s: float) -> None:
        """End what vLLM's own shutdown left of the processes started since construction.

        vLLM already waited for its engine core and workers; what remains (multiprocessing's
        resource tracker, a worker stuck in a native call, a worker orphaned when its EngineCore
        died, which vLLM's shutdown no longer reaches) is ended by pid, and recorded in
        `self.reaped` so tests can tell vLLM's cleanup from ours. A noted process is matched by
        pid and start time, so a reused pid is never signalled.
        """
        import psutil

        if getattr(self, "_baseline_children", None) is None:
            return
        self._note_engine_procs()  # anything started since `shutdown` began
        ours = [p for p in self._engine_procs.values() if p.is_running()]
        # multiprocessing's resource tracker ignores SIGTERM and lives until every holder of its
        # pipe has exited, this process included: waiting for it, or terminating it, only took
        # 7 s of every multiprocess engine's shutdown before it was killed anyway.
        trackers = [p for p in ours if _is_resource_tracker(p)]
        _, alive = psutil.wait_procs([p for p in ours if p not in trackers], timeout=min(timeout_s, 2.0))
        for p in alive + trackers:
            with contextlib.suppress(psutil.Error):
                self.reaped.append(" ".join(p.cmdline()[:3]) or p.name())
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.terminate()
        _, alive = psutil.wait_procs(alive, timeout=5)
        for p in alive + trackers:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(alive + trackers, timeout=5)  # reaped, so no caller sees them

    @property
    def engine_pids(self) -> list[int]:
        """Pids of the processes this engine started (noted at start and at shutdown)."""
        return sorted(self._engine_procs)

    def __enter__(self) -> CaptureEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _is_resource_tracker(proc: psutil.Process) -> bool:
    """Whether `proc` is a multiprocessing resource tracker (`python -c 'from
    multiprocessing.resource_tracker import main;main(FD)'`)."""
    import psutil

    with contextlib.suppress(psutil.Error):
        return any("multiprocessing.resource_tracker" in arg for arg in proc.cmdline())
    return False


def _check_reachable(address: str, store_d: dict[str, Any], check: str | None) -> None:
    """Raise `StoreError` naming `address` when the store master does not answer in time."""
    timeout = float(store_d.get("connect_timeout_s", 10.0))
    # `connect_timeout_s` bounds the whole failure, so leave a little for our own overhead.
    load_spec(check or DEFAULT_REACHABILITY_CHECK)(address, max(0.5, timeout - 0.25))


def _fresh_fault_dir(fault_dir: str | os.PathLike | None) -> str:
    """`fault_dir`, emptied (a record an earlier run left there is not this run's), or a new tempdir."""
    if fault_dir is None:
        return tempfile.mkdtemp(prefix="hpctoolkit-engine-faults-")
    shutil.rmtree(fault_dir, ignore_errors=True)
    Path(fault_dir).mkdir(parents=True)
    return str(fault_dir)
