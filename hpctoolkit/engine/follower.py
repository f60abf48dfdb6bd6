"""Follower nodes of a multi-node engine, and the `VllmConfig` both node roles must agree on.

vLLM's multiprocessing backend runs exactly one scheduler and one EngineCore per engine, on
`node_rank=0`. Every other node only hosts workers: it runs vLLM's headless path
(`vllm/entrypoints/cli/serve.py` `run_headless`), which builds a `MultiprocExecutor` whose workers
join the leader's `torch.distributed` rendezvous at `master_addr:master_port` and its broadcast
message queue. A follower therefore never constructs an `LLM`: a second EngineCore on a follower
would issue control-plane RPCs that no leader queue answers.

Contract of `HeadlessFollower`:

* `start()` returns once this node's workers have loaded the model and joined the leader (vLLM's
  `WorkerProc.wait_for_ready`), so it blocks until the leader is starting too. The liveness monitor
  runs on a daemon thread (`start_worker_monitor(inline=False)`) instead of blocking the caller as
  `run_headless` does, so a Ray actor's or a Slurm step's `init()` returns.
* `health_check()` is True while the executor has not failed or been shut down, every local
  worker process is alive, and the leader's rendezvous endpoint still accepts connections (a
  follower whose leader left keeps its workers alive, blocked on the leader's queue). vLLM's own
  `check_health` is an RPC over the broadcast queue, which only the leader owns.
* `wait()` blocks while `health_check()` holds (what a node's step does between start and
  shutdown), and returns once the leader left or a worker died.
* `shutdown()` tears down the executor and waits for its worker processes; it is idempotent, and
  afterwards no worker process of this follower remains. Once the leader has left, a worker
  blocked on the leader's queue ignores the death pipe and SIGTERM, so vLLM's escalation ends it
  with SIGKILL (about 9 s on vLLM-CPU).

Leader and followers must build field-identical `VllmConfig`s, or they disagree about the model,
the KV layout and the capture path. The leader builds its config inside `LLM.__init__`, which
turns dict-valued arguments into config objects before `EngineArgs` sees them; the headless path
bypasses `LLM.__init__`, so `build_vllm_config` redoes that conversion (`kv_transfer_config`,
`compilation_config` as a dict or a mode int, and the other dict-valued configs), applies `LLM`'s
own defaults (its signature's, read at run time so they cannot drift, and `disable_log_stats=True`)
and `LLM`'s usage context, which picks the default batch limits where `run_headless`'s would not.
`tests/e2e/test_follower.py` checks the result against the config a real `LLM.__init__` builds. The
shared kwargs must pin `kv_transfer_config["engine_id"]` (`check_node_invariant`): unpinned, each
node draws its own random id. `start()` also runs the preflight gates (`pp_gates`) on the config it
built, so a follower fails before its workers load weights, as the leader does.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import socket
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hpctoolkit.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

logger = logging.getLogger(__name__)

# The per-node keys: the only `VllmConfig` inputs on which leader and follower may differ.
NODE_KEYS = ("nnodes", "node_rank", "master_addr", "master_port")

LEADER_PROBE_TIMEOUT_S = 2.0

# Dict-valued `LLM` arguments that `LLM.__init__` turns into config objects (vllm 0.32
# `entrypoints/llm.py`): argument name -> (module, class).
_DICT_CONFIGS = {
    "kv_transfer_config": ("vllm.config.kv_transfer", "KVTransferConfig"),
    "compilation_config": ("vllm.config", "CompilationConfig"),
    "structured_outputs_config": ("vllm.config", "StructuredOutputsConfig"),
    "profiler_config": ("vllm.config", "ProfilerConfig"),
    "attention_config": ("vllm.config", "AttentionConfig"),
}


def _config_class(name: str) -> type:
    import importlib

    module, cls = _DICT_CONFIGS[name]
    return getattr(importlib.import_module(module), cls)


def _to_config(name: str, value: Any) -> Any:
    """`LLM.__init__`'s conversion of one dict/None/int argument into its config object."""
    from vllm.config.utils import is_init_field

    cls = _config_class(name)
    if name == "kv_transfer_config":
        # LLM converts only a dict here and passes None through (no connector).
        return cls(**value) if isinstance(value, Mapping) else value
    if name == "compilation_config" and isinstance(value, int) and not isinstance(value, bool):
        from vllm.config.compilation import CompilationMode

        return cls(mode=CompilationMode(value))
    if value is None:
        return cls()
    if isinstance(value, Mapping):
        return cls(**{k: v for k, v in value.items() if is_init_field(cls, k)})
    return value


def llm_engine_args(engine_kwargs: Mapping[str, Any]) -> EngineArgs:
    """The `EngineArgs` that `vllm.LLM(**engine_kwargs)` would build, without building an engine."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    if "model" not in engine_kwargs:
        raise ConfigError("engine kwargs lack 'model'")
    kwargs = dict(engine_kwargs)
    # LLM's signature defaults win over EngineArgs' for every argument the caller left out. LLM
    # consumes a few of its arguments itself (e.g. `chat_template`); those never reach EngineArgs.
    engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for name, param in inspect.signature(LLM.__init__).parameters.items():
        if name in engine_fields and param.default is not inspect.Parameter.empty:
            kwargs.setdefault(name, param.default)
    kwargs.setdefault("disable_log_stats", True)
    if kwargs.get("hf_overrides") is None:
        kwargs["hf_overrides"] = {}
    if kwargs.get("offload_params") is None:
        kwargs["offload_params"] = set()
    if isinstance(kwargs.get("worker_cls"), type):
        import cloudpickle

        kwargs["worker_cls"] = cloudpickle.dumps(kwargs["worker_cls"])
    for name in _DICT_CONFIGS:
        kwargs[name] = _to_config(name, kwargs.get(name))
    return EngineArgs(**kwargs)


def build_vllm_config(engine_kwargs: Mapping[str, Any], *, headless: bool = False) -> VllmConfig:
    """The `VllmConfig` of `LLM(**engine_kwargs)`; with `headless`, as vLLM's headless path builds it.

    `UsageContext.LLM_CLASS` on both roles: the usage context selects the default batch limits, and
    `run_headless`'s `OPENAI_API_SERVER` would give the follower different ones from an `LLM` leader.
    """
    from vllm.usage.usage_lib import UsageContext

    return llm_engine_args(engine_kwargs).create_engine_config(
        usage_context=UsageContext.LLM_CLASS, headless=headless
    )


def check_node_invariant(engine_kwargs: Mapping[str, Any]) -> None:
    """Reject engine kwargs from which two nodes would build different configs.

    `KVTransferConfig` draws a random `engine_id` when none is given, so leader and follower would
    each get their own; a multi-node engine must pin it in the shared kwargs.
    """
    kv = engine_kwargs.get("kv_transfer_config")
    if isinstance(kv, Mapping) and not kv.get("engine_id"):
        raise ConfigError(
            "kv_transfer_config has no engine_id: each node would draw a random one and leader and "
            "followers would disagree; set kv_transfer_config['engine_id'] in the shared engine kwargs "
            "(e.g. the run prefix)"
        )


class HeadlessFollower:
    """The workers of one follower node (`node_rank > 0`) of a multi-node engine.

    `engine_kwargs` are the leader's `LLM` keyword arguments without the per-node keys
    (`NODE_KEYS`), which are passed separately so that both roles share one dict.
    """

    def __init__(
        self,
        engine_kwargs: Mapping[str, Any],
        node_rank: int,
        nnodes: int,
        master_addr: str,
        master_port: int,
    ) -> None:
        clash = sorted(set(NODE_KEYS) & set(engine_kwargs))
        if clash:
            raise ConfigError(f"engine kwargs may not set {clash}: HeadlessFollower sets the per-node keys")
        if nnodes < 2:
            raise ConfigError(f"nnodes={nnodes}: a follower only exists in a multi-node engine")
        if not 0 < node_rank < nnodes:
            raise ConfigError(
                f"node_rank={node_rank} is not a follower rank of a {nnodes}-node engine; "
                "node 0 is the leader and constructs the LLM"
            )
        check_node_invariant(engine_kwargs)
        backend = engine_kwargs.get("distributed_executor_backend", "mp")
        if backend != "mp":
            raise ConfigError(
                f"distributed_executor_backend={backend!r}: headless followers need vLLM's 'mp' backend"
            )
        self.engine_kwargs = {
            **engine_kwargs,
            "distributed_executor_backend": "mp",
            "nnodes": nnodes,
            "node_rank": node_rank,
            "master_addr": master_addr,
            "master_port": master_port,
        }
        self.node_rank = node_rank
        self.vllm_config: VllmConfig | None = None
        self._executor: Any = None

    @classmethod
    def from_node_kwargs(cls, kwargs: Mapping[str, Any]) -> HeadlessFollower:
        """A follower from one node's whole `LLM` kwargs (the shared ones plus `NODE_KEYS`)."""
        return cls(
            {k: v for k, v in kwargs.items() if k not in NODE_KEYS},
            node_rank=kwargs["node_rank"],
            nnodes=kwargs["nnodes"],
            master_addr=kwargs["master_addr"],
            master_port=kwargs["master_port"],
        )

    def start(self) -> None:
        """Spawn this node's workers and return once they are up; the monitor runs on a daemon thread."""
        if self._executor is not None:
            raise RuntimeError("HeadlessFollower.start() called twice")
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor

        from hpctoolkit.engine.pp_gates import preflight_vllm_config

        self.vllm_config = build_vllm_config(self.engine_kwargs, headless=True)
        # The leader runs the same gates; here they fail this node before it loads weights too.
        preflight_vllm_config(self.vllm_config)
        parallel = self.vllm_config.parallel_config
        if parallel.node_rank_within_dp < 1:
            raise ConfigError(
                f"node_rank={self.node_rank} maps to node_rank_within_dp={parallel.node_rank_within_dp}; "
                "a headless follower must not be a data-parallel leader"
            )
        logger.info(
            "follower node_rank=%d: starting %d worker(s), head at %s:%d",
            self.node_rank,
            parallel.local_world_size,
            parallel.master_addr,
            parallel.master_port,
        )
        # monitor_workers=False as in run_headless; the monitor is started below, off this thread.
        executor = MultiprocExecutor(self.vllm_config, monitor_workers=False)
        executor.start_worker_monitor(inline=False)
        self._executor = executor

    def health_check(self, probe_leader: bool = True) -> bool:
        """True while this node's workers run and, with `probe_leader`, the leader is reachable.

        vLLM tells a follower nothing when its leader goes away: the workers stay alive, blocked
        on the leader's queue. The probe connects to the leader's rendezvous store
        (`master_addr:master_port`, served by the leader's rank-0 worker for its lifetime).
        """
        ex = self._executor
        if ex is None or ex.is_failed or getattr(ex, "shutting_down", False):
            return False
        workers = getattr(ex, "workers", None) or []
        if not workers or not all(w.proc.is_alive() for w in workers):
            return False
        if probe_leader:
            addr = (self.engine_kwargs["master_addr"], int(self.engine_kwargs["master_port"]))
            try:
                with socket.create_connection(addr, timeout=LEADER_PROBE_TIMEOUT_S):
                    pass
            except OSError:
                return False
        return True

    def wait(self, stop: threading.Event | None = None, poll_s: float = 5.0) -> bool:
        """Block while this follower is healthy; True if `stop` was set, False once it is not healthy.

        What a node's step does between `start()` and `shutdown()`: it returns when the leader has
        left or a local worker died, so the step ends instead of holding its node.
        """
        stop = stop or threading.Event()
        while not stop.is_set():
            if not self.health_check():
                return False
            stop.wait(poll_s)
        return True

    def worker_pids(self) -> list[int]:
        ex = self._executor
        return [w.proc.pid for w in (getattr(ex, "workers", None) or [])] if ex is not None else []

    def shutdown(self) -> None:
        """Stop the workers and wait for them; safe to call twice or before `start()`."""
        ex, self._executor = self._executor, None
        if ex is None:
            return
        procs = [w.proc for w in (getattr(ex, "workers", None) or [])]
        ex.shutdown()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                raise RuntimeError(f"follower worker pid {proc.pid} survived shutdown")

    def __enter__(self) -> HeadlessFollower:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
