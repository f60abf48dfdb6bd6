"""The engine roles.

* `engine-leader` (engine i, node_rank 0) builds `CaptureEngine`, captures prompts `i::num_engines`
  of `data.prompts` (first extended by the target's own continuation when `data.regenerate_tokens`
  is set), appends each manifest to its queue in the run directory, writes its done record, and
  keeps its store segment (where the fragments live) until the trainers write `drained`.
* `engine-follower` starts a `HeadlessFollower` with the leader's kwargs (both from
  `engine_llm_kwargs` with `engine_node_args`) and serves until its leader leaves.
"""

from __future__ import annotations

import os
import time

from hpctoolkit.capture.queue import QueueWriter, wait_drained
from hpctoolkit.config.schema import RecipeConfig
from hpctoolkit.errors import DataIntegrityError
from hpctoolkit.plan.placement import Process
from hpctoolkit.roles import backpressure
from hpctoolkit.roles.child import Child
from hpctoolkit.roles.context import NodeContext, engine_node_args, store_address
from hpctoolkit.roles.waits import MASTER_REACH_TIMEOUT_S, term_event, wait_reachable
from hpctoolkit.rundir.atomic import write_json_atomic

# Leaders: the trainers' `drained` record after the last capture.
DRAIN_TIMEOUT_S = 3600.0


def say(msg: str) -> None:
    print(f"[hpctoolkit.engine] {msg}", flush=True)


def _regenerate(target_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from hpctoolkit.engine.regenerate import regenerate

    return regenerate(target_dir, prompts, max_new_tokens)


def engine_prompts(ctx: NodeContext, engine: int, target_dir: str) -> list[list[int]]:
    """Engine `engine`'s share of the run's prompts, as token ids ready to capture."""
    from transformers import AutoTokenizer

    from hpctoolkit.data.prompts import load_prompt_ids

    cfg: RecipeConfig = ctx.cfg
    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = load_prompt_ids(cfg.data.prompts, tok, cfg.data.num_samples, cfg.data.max_prompt_tokens)
    mine = prompts[engine :: cfg.engine.num_engines]
    if cfg.data.regenerate_tokens and mine:
        say(
            f"engine {engine}: the target continues {len(mine)} prompts by up to {cfg.data.regenerate_tokens} tokens"
        )
        # vLLM does not release its workers within a process: the generation gets its own.
        mine = Child(
            "regenerate", _regenerate, (target_dir, mine, cfg.data.regenerate_tokens), ctx.run.logs
        ).result()
        say(f"engine {engine}: {sum(map(len, mine))} tokens in {len(mine)} prompt + response sequences")
    return mine


def run_engine_leader(ctx: NodeContext, proc: Process) -> int:
    from hpctoolkit.engine.engine import CaptureEngine, run_prefix
    from hpctoolkit.testing.tiny_target import resolve_target

    cfg = ctx.cfg
    e = ctx.plan.engines[proc.engine or 0]
    queue = QueueWriter(ctx.run.root, e.index, run_prefix(ctx.run_id, e.index))
    # First thing: an earlier attempt's queue must not look like this one's to a trainer.
    queue.reset()
    stop = term_event()
    try:
        # The master's step starts with this one: wait for it rather than fail the engine's own
        # reachability check (which bounds a master that went away, not one still starting).
        wait_reachable(store_address(ctx), MASTER_REACH_TIMEOUT_S)
        target_dir = str(resolve_target(cfg.paths.target_model))
        mine = engine_prompts(ctx, e.index, target_dir)
        t0 = time.monotonic()
        with CaptureEngine(
            cfg.engine,
            target_dir,
            store_address(ctx),
            cfg.store,
            ctx.run_id,
            output_dir=ctx.run.root,
            **engine_node_args(ctx, proc, cores=_cores()),
        ) as eng:
            started = time.monotonic() - t0
            bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "-") if eng.backend == "cpu" else "-"
            say(
                f"engine {e.index} node_rank 0 up in {started:.1f}s on {ctx.nodename} (cpu bind {bind}); "
                f"capturing {len(mine)} prompts"
            )
            batch = cfg.engine.capture_batch
            # Between batches: wait while the trainers leave too much unread in a segment.
            gate = backpressure.for_engine(ctx, e.index, say)
            for i in range(0, len(mine), batch):
                if stop.is_set():
                    raise DataIntegrityError(
                        f"engine {e.index} stopped after {queue.published} of {len(mine)} samples"
                    )
                gate.wait(stop)
                # A batch's manifests come back once all of its fragments are published.
                for m in eng.capture(mine[i : i + batch]):
                    queue.append(m.to_json())
                    gate.published(m)
                say(f"engine {e.index}: published {queue.published}/{len(mine)} samples")
            queue.done()
            say(
                f"engine {e.index} published {queue.published} samples in {time.monotonic() - t0 - started:.1f}s"
            )
            # The fragments live in this engine's store segments: keep them until read.
            wait_drained(ctx.run.root, ctx.run_id, DRAIN_TIMEOUT_S, stop)
            say(f"engine {e.index}: the trainers drained every sample; shutting down")
    except BaseException as err:
        queue.failed(f"{type(err).__name__}: {err}")
        raise
    finally:
        write_json_atomic(ctx.run.engine_closed(e.index), {"run_id": ctx.run_id})
    return 0


def _cores() -> list[int]:
    from hpctoolkit.engine.env import available_cores

    return available_cores()


def run_engine_follower(ctx: NodeContext, proc: Process) -> int:
    from hpctoolkit.engine.engine import engine_llm_kwargs, fault_dir_for
    from hpctoolkit.engine.env import detect_backend
    from hpctoolkit.engine.follower import NODE_KEYS, HeadlessFollower
    from hpctoolkit.testing.tiny_target import resolve_target

    cfg = ctx.cfg
    e = ctx.plan.engines[proc.engine or 0]
    wait_reachable(store_address(ctx), MASTER_REACH_TIMEOUT_S)  # its workers connect at start
    target_dir = resolve_target(cfg.paths.target_model)
    # The leader's CaptureEngine makes this same call; only the node keys differ.
    _, kwargs, env = engine_llm_kwargs(
        cfg.engine,
        target_dir,
        store_address(ctx),
        cfg.store,
        ctx.run_id,
        backend=detect_backend(),
        fault_dir=fault_dir_for(ctx.run.root, e.index),
        **engine_node_args(ctx, proc, cores=_cores()),
    )
    os.environ.update(env)
    follower = HeadlessFollower(
        {k: v for k, v in kwargs.items() if k not in NODE_KEYS},
        node_rank=kwargs["node_rank"],
        nnodes=kwargs["nnodes"],
        master_addr=kwargs["master_addr"],
        master_port=kwargs["master_port"],
    )
    stop = term_event()
    try:
        follower.start()  # returns once this node's workers joined the leader
        say(
            f"engine {e.index} node_rank {proc.node_rank} serving on {ctx.nodename} "
            f"(cpu bind {env.get('VLLM_CPU_OMP_THREADS_BIND', '-')})"
        )
        follower.wait(stop, poll_s=2.0)  # until the leader leaves or the step is ended
    finally:
        follower.shutdown()
    return 0
