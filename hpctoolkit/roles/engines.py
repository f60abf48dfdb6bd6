"""The engine roles.

* `engine-leader` (engine i, node_rank 0) builds `CaptureEngine`, captures prompts `i::num_engines`
  of `data` (each answered by the target, turn by turn, first when `data.regenerate_tokens` is
  set), publishes each sample's loss mask beside its fragments and names it in the manifest
  (`store.fragments.LossMasks`), appends each manifest to its queue, writes its done record, and
  keeps its store segment (where the fragments live) until the trainers write `drained`.
  A resumed run (`rundir.ledger`) captures only the prompts its checkpoint's ledger does not hold
  (refusing, first, a trained one whose content changed), each manifest tagged with its prompt
  index and content key, under this attempt's own key prefix, after removing the fragments an
  earlier attempt's queue lists. On SIGUSR2 (preemption), or once the trainers'
  end record says they checkpointed on it, it stops capturing without failing the queue and waits
  as after the last sample.
* `engine-follower` starts a `HeadlessFollower` with the leader's kwargs (both from
  `engine_llm_kwargs` with `engine_node_args`) and serves until its leader leaves. When the
  engine regenerates, it first serves the leader's generating engine the same way (its own
  rendezvous, `ports/engine<i>-generate.json`), until that leaves and the leader records
  `regenerated`; then it waits for the leader's capture rendezvous (`ports/engine<i>.json`).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from hpctoolkit.capture.queue import QueueWriter, wait_drained
from hpctoolkit.config.schema import RecipeConfig
from hpctoolkit.console import speaker
from hpctoolkit.errors import ConfigError, DataIntegrityError
from hpctoolkit.plan.placement import Process
from hpctoolkit.roles import backpressure
from hpctoolkit.roles.child import Child
from hpctoolkit.roles.context import NodeContext, client_store_config, engine_node_args, store_address
from hpctoolkit.roles.waits import MASTER_REACH_TIMEOUT_S, term_event, wait_reachable
from hpctoolkit.rundir import ledger
from hpctoolkit.rundir.atomic import write_json_atomic

if TYPE_CHECKING:
    from hpctoolkit.engine.engine import CaptureEngine
    from hpctoolkit.engine.kwargs import NodeArgs
    from hpctoolkit.store.fragments import LossMasks

# Leaders: the trainers' `drained` record after the last capture.
DRAIN_TIMEOUT_S = 3600.0
# Leaders: how long the generating process may take to exit after its result.
REGENERATE_LINGER_S = 20.0
# Followers: the leader's `regenerated` record once its generating engine left.
REGENERATED_TIMEOUT_S = 600.0


say = speaker("engine")


def _regenerate(
    target_dir: str,
    rows: list[dict[str, Any]],
    spec: dict[str, Any],
    sampling: dict[str, Any],
    max_prompt_tokens: int,
    max_model_len: int,
    llm_kwargs: dict[str, Any],
    env: dict[str, str],
    replica: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from hpctoolkit.engine.regenerate import regenerate

    return regenerate(
        target_dir, rows, spec, sampling, max_prompt_tokens, max_model_len, llm_kwargs, env, replica
    )


def merge_replicas(parts: list[dict[str, Any]], total: int) -> dict[str, Any]:
    """One result from the replicas' (`parts[j]` regenerated rows `j::len(parts)` of `total`): the samples
    back in the rows' order, the counts summed. Each replica synthesized the same pool
    (`data.synth`: same seeds), so the synthesis report is the first replica's."""
    from hpctoolkit.engine.regenerate import RegenReport

    n = len(parts)
    samples: list[Any] = [None] * total
    for j, part in enumerate(parts):
        if len(part["samples"]) != len(range(j, total, n)):
            raise DataIntegrityError(
                f"regeneration replica {j} of {n} returned {len(part['samples'])} rows, "
                f"expected {len(range(j, total, n))}"
            )
        samples[j::n] = part["samples"]
    reports = [RegenReport(**p["report"]) for p in parts]
    report = {k: sum(int(getattr(r, k)) for r in reports) for k in reports[0].to_dict()}
    return {"samples": samples, "report": report, "synthesized": parts[0].get("synthesized")}


def _replicated(
    ctx: NodeContext, engine: int, args: tuple[Any, ...], rows: list[dict[str, Any]], replicas: int
) -> dict[str, Any]:
    """`replicas` generating engines on this engine's GPU, replica `j` on rows `j::replicas`,
    started one after another (`engine.regenerate.Gate`) and run side by side; one result."""
    target_dir, _, spec, sampling, max_prompt, max_len, llm_kwargs, env = args
    llm_kwargs = dict(llm_kwargs)
    from hpctoolkit.engine.env import detect_backend

    if detect_backend() == "cuda":
        # vLLM's share of the GPU, split: the replicas hold together what one engine would.
        share = float(llm_kwargs.get("gpu_memory_utilization", 0.9))
        llm_kwargs["gpu_memory_utilization"] = share / replicas
    gates = [ctx.run.logs / f".regenerate-engine{engine}-replica{j}.started" for j in range(replicas)]
    for g in gates:
        g.unlink(missing_ok=True)
    children = []
    try:
        for j in range(replicas):
            replica = {
                "row_ids": list(range(j, len(rows), replicas)),
                "after": None if j == 0 else str(gates[j - 1]),
                "started": str(gates[j]),
            }
            part = (
                target_dir,
                rows[j::replicas],
                spec,
                sampling,
                max_prompt,
                max_len,
                llm_kwargs,
                env,
                replica,
            )
            children.append(Child(f"regenerate-replica{j}", _regenerate, part, ctx.run.logs))
        parts = [c.result(linger_s=REGENERATE_LINGER_S) for c in children]
    finally:
        for c in children:  # a failed replica: the others (running, or waiting for its gate) end too
            c.kill_tree()
    return merge_replicas(parts, len(rows))


def generation_node_args(ctx: NodeContext, proc: Process) -> NodeArgs:
    """This node's part of the generating engine: the capture engine's (`engine_node_args`), with
    the generating engine's own rendezvous on a multi-node engine."""
    return engine_node_args(ctx, proc, cores=_cores(), generating=True)


def regenerates(cfg: RecipeConfig, engine: int) -> bool:
    """Engine `engine` answers its rows with the target before it captures (it has rows)."""
    return (
        bool(cfg.data.regenerate_tokens)
        and len(range(engine, cfg.data.num_samples, cfg.engine.num_engines)) > 0
    )


def engine_prompts(ctx: NodeContext, proc: Process, target_dir: str) -> list[tuple[list[int], list[int]]]:
    """Engine `proc.engine`'s share of the run's samples, `(input_ids, loss_mask)`, ready to
    capture: rows `engine::num_engines` of `data`, rendered and masked, or first regenerated by the
    target with the engine's own PP x TP layout over its nodes (`engine.regenerate`, in a process
    of its own; its counts in `logs/regenerate-engine<i>.json`, and `builtin:magpie`'s in
    `logs/synth-engine<i>.json`)."""
    from transformers import AutoTokenizer

    from hpctoolkit.data.prompts import chat_spec, load_rows, load_samples, regenerate_sampling

    cfg: RecipeConfig = ctx.cfg
    d = cfg.data
    engine = proc.engine or 0
    tok = AutoTokenizer.from_pretrained(target_dir)
    n = cfg.engine.num_engines
    if not d.regenerate_tokens:
        return [(s.input_ids, s.loss_mask) for s in load_samples(d, tok, d.num_samples)[engine::n]]
    rows = load_rows(d, d.num_samples)[engine::n]
    if not rows:
        return []
    say(
        f"engine {engine}: the target answers {len(rows)} rows, turn by turn, up to {d.regenerate_tokens} tokens a turn"
    )
    spec = dataclasses.asdict(chat_spec(d))
    sampling = regenerate_sampling(d)
    from hpctoolkit.engine.regenerate import generation_kwargs

    # The engine's own PP x TP layout over its nodes, without the capture parts.
    llm_kwargs, env = generation_kwargs(cfg.engine, target_dir, generation_node_args(ctx, proc))
    args = (target_dir, rows, spec, sampling, d.max_prompt_tokens, cfg.engine.max_model_len, llm_kwargs, env)
    replicas = min(cfg.engine.regenerate_replicas, len(rows))
    if replicas > 1:
        say(f"engine {engine}: {replicas} generating engines share its GPU, each on every {replicas}th row")
        out = _replicated(ctx, engine, args, rows, replicas)
    else:
        # vLLM does not release its workers within a process: the generation gets its own.
        # Its engine's exit-time shutdown may wait on the other nodes' workers: it is ended once done.
        out = Child("regenerate", _regenerate, args, ctx.run.logs).result(linger_s=REGENERATE_LINGER_S)
    from hpctoolkit.engine.regenerate import RegenReport

    if out.get("synthesized"):
        from hpctoolkit.data.synth import report_line

        write_json_atomic(ctx.run.logs / f"synth-engine{engine}.json", out["synthesized"])
        say(f"engine {engine}: {report_line(out['synthesized'])}")
    report = RegenReport(**out["report"])
    write_json_atomic(ctx.run.logs / f"regenerate-engine{engine}.json", report.to_dict())
    say(
        f"engine {engine}: regenerated {report.turns} turns of {report.samples} rows: {report.empty} empty, "
        f"{report.truncated} truncated, {report.failed} failed, {report.degenerate} in a repetition loop "
        f"({report.bad_samples + report.degenerate_samples} rows kept their own responses)"
    )
    report.check(d.regenerate_max_bad_fraction)
    return [(list(x["input_ids"]), list(x["loss_mask"])) for x in out["samples"]]


def _write_vocab_counts(
    ctx: NodeContext, engine: int, samples: list[tuple[list[int], list[int]]], prefix: str
) -> None:
    """`manifests/engine<i>.vocab.json`: how often each token id is supervised in this engine's
    samples (all of them, also on a resumed attempt, so every attempt chooses the same vocabulary).
    A live run's trainers read it instead of counting samples the store hands out only once."""
    from collections import Counter

    counts: Counter[int] = Counter()
    for ids, mask in samples:
        counts.update(t for t, m in zip(ids, mask, strict=True) if m)
    write_json_atomic(
        ctx.run.vocab_counts(engine),
        {
            "run_prefix": prefix,
            "samples": len(samples),
            "counts": {str(k): v for k, v in sorted(counts.items())},
        },
    )


def _loss_masks(ctx: NodeContext, samples: list[tuple[list[int], list[int]]]) -> LossMasks:
    """The leader's writer of its samples' loss masks (a small segment of its own)."""
    from hpctoolkit.store.fragments import LossMasks, mask_segment_bytes
    from hpctoolkit.store.mooncake import MooncakeStore

    seg = mask_segment_bytes([len(ids) for ids, _ in samples])
    # This node's address, as every client of a multi-host job binds and advertises.
    cfg = dataclasses.replace(
        client_store_config(ctx), global_segment_size=f"{seg}B", local_buffer_size="16MB"
    )
    return LossMasks(MooncakeStore(store_address(ctx), cfg, role="writer"), samples)


def _usr2_event() -> threading.Event:
    """Set on SIGUSR2: the job is being preempted (the trainers checkpoint)."""
    asked = threading.Event()
    signal.signal(signal.SIGUSR2, lambda *_: asked.set())
    return asked


def _trainers_preempted(ctx: NodeContext) -> bool:
    """The trainers checkpointed on SIGUSR2 (their end record says so), whether or not this step
    got the signal too (the batch script forwards the time limit's to the trainers only)."""
    from hpctoolkit.rundir.atomic import read_json

    ended = read_json(ctx.run.ended)
    return isinstance(ended, dict) and bool(ended.get("preempted"))


def _refuse_changed_prompts(ctx: NodeContext, engine: int, keys: list[str]) -> None:
    """Before anything is generated or captured: each of this engine's prompts that the attempt's
    checkpoint trained on must still have the content it trained on (`keys`: by prompt, in order)."""
    cfg = ctx.cfg
    indices = range(engine, cfg.data.num_samples, cfg.engine.num_engines)
    done = ledger.attempt_ledger(ctx.run)
    changed = done.changed(dict(zip(indices, keys, strict=True))) if done is not None else []
    if done is not None and changed:
        index, then, now = changed[0]
        raise ConfigError(
            f"data: prompt {index} is not the prompt {done.checkpoint.name} trained on (content key "
            f"{then} then, {now} now; {len(changed)} of engine {engine}'s prompts changed): the data "
            "changed since the run started; put it back, or start a new run"
        )


def _left_to_capture(
    ctx: NodeContext, engine: int, mine: list[list[int]], keys: list[str]
) -> list[tuple[int, str, list[int]]]:
    """`(prompt index, content key, ids)` of this engine's prompts that no completed checkpoint
    trained on."""
    cfg = ctx.cfg
    indices = range(engine, cfg.data.num_samples, cfg.engine.num_engines)
    if not len(indices) == len(mine) == len(keys):
        raise DataIntegrityError(
            f"engine {engine} has {len(mine)} prompts ({len(keys)} keys), but data.num_samples="
            f"{cfg.data.num_samples} over {cfg.engine.num_engines} engine(s) gives it {len(indices)}"
        )
    done = ledger.attempt_ledger(ctx.run)
    left = ledger.remaining(indices, done)
    if done is not None:
        say(
            f"engine {engine}: {done.checkpoint.name} trained {len(mine) - len(left)} of its prompts; capturing the other {len(left)}"
        )
    key_of = dict(zip(indices, keys, strict=True))
    by_index = dict(zip(indices, mine, strict=True))
    return [(g, key_of[g], by_index[g]) for g in left]


def _remove_stale_fragments(ctx: NodeContext, engine: int) -> None:
    """Remove from the store what an earlier attempt's queue lists (a store that outlived that
    attempt still holds it; a new master never had it), then the list."""
    import json

    stale = ctx.run.stale_queue(engine)
    lines = [x for x in stale.read_text().splitlines() if x.strip()] if stale.exists() else []
    if lines:
        from hpctoolkit.store.mooncake import MooncakeStore

        keys = [f["key"] for line in lines for m in [json.loads(line)] for f in _objects(m)]
        store = MooncakeStore(store_address(ctx), client_store_config(ctx), role="reader")
        try:
            store.remove(keys)
        finally:
            store.close()
        say(
            f"engine {engine}: removed {len(keys)} store objects of {len(lines)} samples an earlier attempt left"
        )
    stale.unlink(missing_ok=True)


def _objects(manifest: dict) -> list[dict]:
    mask = [manifest["loss_mask"]] if manifest.get("loss_mask") else []
    return [manifest["input_ids"], *manifest["fragments"], *mask, *(manifest.get("sums") or [])]


def run_engine_leader(ctx: NodeContext, proc: Process) -> int:
    from hpctoolkit.data.prompts import row_keys
    from hpctoolkit.engine.engine import CaptureEngine
    from hpctoolkit.engine.kwargs import run_prefix
    from hpctoolkit.targets.resolve import resolve_target

    cfg = ctx.cfg
    e = ctx.plan.engines[proc.engine or 0]
    # This attempt's keys: a requeued attempt never reuses an earlier one's (`rundir.ledger`).
    attempt = ledger.attempt_run_id(ctx.run_id, ctx.slurm.job_id if ctx.slurm else None)
    queue = QueueWriter(ctx.run.root, e.index, run_prefix(attempt, e.index))
    # First thing: an earlier attempt's queue must not look like this one's to a trainer.
    queue.reset()
    stop = term_event()
    masks: LossMasks | None = None
    preempted = _usr2_event()
    try:
        # The master's step starts with this one: wait for it rather than fail the engine's own
        # reachability check (which bounds a master that went away, not one still starting).
        wait_reachable(store_address(ctx), MASTER_REACH_TIMEOUT_S)
        _remove_stale_fragments(ctx, e.index)
        target_dir = str(resolve_target(cfg.paths.target_model))
        keys = row_keys(cfg.data, cfg.data.num_samples)[e.index :: cfg.engine.num_engines]
        _refuse_changed_prompts(ctx, e.index, keys)
        samples = engine_prompts(ctx, proc, target_dir)
        # What a pruned draft vocabulary is chosen from: every sample's supervised tokens.
        _write_vocab_counts(ctx, e.index, samples, queue.run_prefix)
        if regenerates(cfg, e.index):
            # The generating engine has left: a follower node may now join the capture engine.
            write_json_atomic(ctx.run.regenerated(e.index), {"run_prefix": queue.run_prefix})
        masks = _loss_masks(ctx, samples)
        todo = _left_to_capture(ctx, e.index, [ids for ids, _ in samples], keys)
        t0 = time.monotonic()
        with CaptureEngine(
            cfg.engine,
            target_dir,
            store_address(ctx),
            cfg.store,
            attempt,
            engine_index=e.index,
            fault_dir=ctx.run.faults(e.index),
            node=engine_node_args(ctx, proc, cores=_cores()),
        ) as eng:
            started = time.monotonic() - t0
            bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "-") if eng.backend == "cpu" else "-"
            say(
                f"engine {e.index} node_rank 0 up in {started:.1f}s on {ctx.nodename} (cpu bind {bind}); "
                f"capturing {len(todo)} prompts"
            )
            _capture(ctx, e.index, eng, queue, masks, todo, stop, preempted)
            if preempted.is_set():
                # The queue stays open: the next attempt captures again what was not trained on.
                say(f"engine {e.index}: SIGUSR2 after {queue.published} samples; stopped capturing")
            else:
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
        if masks is not None:
            masks.close()  # after the drain: the masks live in its segment
        write_json_atomic(ctx.run.engine_closed(e.index), {"run_id": ctx.run_id})
    return 0


def _capture(
    ctx: NodeContext,
    engine: int,
    eng: CaptureEngine,
    queue: QueueWriter,
    masks: LossMasks,
    todo: list[tuple[int, str, list[int]]],
    stop: threading.Event,
    preempted: threading.Event,
) -> None:
    """Capture `todo` in batches of `engine.capture_batch`: each manifest, tagged with its prompt
    index and content key, gets its loss mask and joins the queue. Stops early, without failing, on
    preemption (`preempted` is then set); a stopped step fails it."""
    mine = [ids for *_, ids in todo]
    batch = ctx.cfg.engine.capture_batch
    # Between batches: wait while the trainers leave too much unread in a segment.
    gate = backpressure.for_engine(ctx, engine, say, prefix=queue.run_prefix)
    for i in range(0, len(mine), batch):
        if stop.is_set():
            raise DataIntegrityError(
                f"engine {engine} stopped after {queue.published} of {len(mine)} samples"
            )
        if preempted.is_set() or _trainers_preempted(ctx):
            preempted.set()
            return
        gate.wait(stop)
        # A batch's manifests come back once all of its fragments are published.
        captured = eng.capture(mine[i : i + batch])
        for raw, (index, key, _) in zip(captured, todo[i : i + batch], strict=True):
            tags = {ledger.PROMPT_KEY: index, ledger.CONTENT_KEY: key}
            m = dataclasses.replace(raw, extra={**raw.extra, **tags})
            m = masks.publish(m)
            queue.append(m.to_json())
            gate.published(m)
        say(f"engine {engine}: published {queue.published}/{len(mine)} samples")


def _cores() -> list[int]:
    from hpctoolkit.engine.env import available_cores

    return available_cores()


def run_engine_follower(ctx: NodeContext, proc: Process) -> int:
    from hpctoolkit.engine.env import detect_backend
    from hpctoolkit.engine.follower import HeadlessFollower
    from hpctoolkit.engine.kwargs import CaptureSink, engine_llm_kwargs
    from hpctoolkit.targets.resolve import resolve_target

    cfg = ctx.cfg
    e = ctx.plan.engines[proc.engine or 0]
    # The job is being preempted: serve on until the leader leaves or the step is ended.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    attempt = ledger.attempt_run_id(ctx.run_id, ctx.slurm.job_id if ctx.slurm else None)
    wait_reachable(store_address(ctx), MASTER_REACH_TIMEOUT_S)  # its workers connect at start
    target_dir = resolve_target(cfg.paths.target_model)
    # The leader's CaptureEngine makes this same call; only the node keys differ.
    sink = CaptureSink(store_address(ctx), cfg.store, attempt, e.index, str(ctx.run.faults(e.index)))
    stop = term_event()
    if regenerates(cfg, e.index):
        _follow_generation(ctx, proc, str(target_dir), stop)
    # After the generation: the leader records its capture rendezvous only once that is done.
    _, kwargs, env = engine_llm_kwargs(
        cfg.engine, target_dir, sink, engine_node_args(ctx, proc, cores=_cores()), backend=detect_backend()
    )
    os.environ.update(env)
    follower = HeadlessFollower.from_node_kwargs(kwargs)
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


def _leader_record(ctx: NodeContext, engine: int, prefix: str) -> str | None:
    """ "regenerated" or the leader's error once this attempt's leader wrote either, else None."""
    from hpctoolkit.rundir.atomic import read_json

    failed = read_json(ctx.run.queue_failed(engine))
    if isinstance(failed, dict) and failed.get("run_prefix") == prefix:
        return f"error: {failed.get('error')}"
    done = read_json(ctx.run.regenerated(engine))
    if isinstance(done, dict) and done.get("run_prefix") == prefix:
        return "regenerated"
    return None


def _follow_generation(ctx: NodeContext, proc: Process, target_dir: str, stop: threading.Event) -> None:
    """A follower node's part of its leader's generating engine, before the capture engine: this
    node's workers of it (a headless follower in a process of its own, as the leader's engine is)
    until it leaves, then the leader's `regenerated` record (bounded). The leader failing, or this
    step being ended, stops it at once."""
    from hpctoolkit.engine.kwargs import run_prefix
    from hpctoolkit.engine.regenerate import follow_generation, generation_kwargs, generator_llm_kwargs

    cfg = ctx.cfg
    e = ctx.plan.engines[proc.engine or 0]
    prefix = run_prefix(ledger.attempt_run_id(ctx.run_id, ctx.slurm.job_id if ctx.slurm else None), e.index)
    llm_kwargs, env = generation_kwargs(cfg.engine, target_dir, generation_node_args(ctx, proc))
    kwargs = generator_llm_kwargs(target_dir, cfg.data.regenerate_seed, cfg.engine.max_model_len, llm_kwargs)
    say(
        f"engine {e.index} node_rank {proc.node_rank}: joining the leader's generating engine on {ctx.nodename}"
    )
    child = Child(
        f"regenerate-follower{e.index}-{proc.node_rank}", follow_generation, (kwargs, env), ctx.run.logs
    )
    gone_at: float | None = None
    try:
        while child.alive():
            record = _leader_record(ctx, e.index, prefix)
            if stop.is_set() or (record is not None and record != "regenerated"):
                raise DataIntegrityError(
                    f"engine {e.index}: the leader stopped while generating ({record or 'step ended'}); "
                    f"node_rank {proc.node_rank} leaves"
                )
            if record == "regenerated":
                # The leader's generating engine is gone (it writes the record after ending it,
                # killed when its own exit lingered): this node's workers may wait on it forever.
                gone_at = gone_at or time.monotonic()
                if time.monotonic() - gone_at > REGENERATE_LINGER_S:
                    say(
                        f"engine {e.index} node_rank {proc.node_rank}: the generating workers outlived "
                        f"the leader's engine by {REGENERATE_LINGER_S:.0f}s; ending them"
                    )
                    break
            child.proc.join(1.0)
        out = {"left": True} if child.alive() else child.result(linger_s=REGENERATE_LINGER_S)
    finally:
        child.kill_tree()
    if not out["left"]:
        raise DataIntegrityError(
            f"engine {e.index}: a worker of node_rank {proc.node_rank} died while the leader generated"
        )
    deadline = time.monotonic() + REGENERATED_TIMEOUT_S
    while (record := _leader_record(ctx, e.index, prefix)) is None:
        if stop.is_set() or time.monotonic() > deadline:
            raise DataIntegrityError(
                f"engine {e.index}: the leader's generating engine left but {ctx.run.regenerated(e.index)} "
                f"did not appear within {REGENERATED_TIMEOUT_S:.0f}s"
            )
        time.sleep(0.5)
    if record != "regenerated":
        raise DataIntegrityError(f"engine {e.index}: the leader failed after generating ({record})")
    say(f"engine {e.index} node_rank {proc.node_rank}: generation done; joining the capture engine")
