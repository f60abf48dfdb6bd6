"""The `evaluate` role: serve the exported draft with the target in vLLM and measure acceptance on
held-out prompts (the ones after the run's `data.num_samples`). The local launcher runs it after
the trainers; it writes `evaluate.json` in the run directory."""

from __future__ import annotations

from typing import Any

from hpctoolkit.roles.context import NodeContext
from hpctoolkit.rundir.atomic import read_json, write_json_atomic


def say(msg: str) -> None:
    print(f"[hpctoolkit.evaluate] {msg}", flush=True)


def not_served_reason(draft_config: str) -> str | None:
    """Why vLLM on this machine cannot serve this draft family, or None."""
    import torch

    from hpctoolkit.models.families import serving_for

    return None if torch.cuda.is_available() else serving_for(draft_config).cpu_unservable


def run_evaluate(ctx: NodeContext) -> int:
    from transformers import AutoTokenizer

    from hpctoolkit.data.prompts import load_prompt_ids
    from hpctoolkit.evaluate import evaluate
    from hpctoolkit.testing.tiny_target import resolve_target

    cfg = ctx.cfg
    summary = read_json(ctx.run.summary) or {}
    export_dir = summary.get("export_dir") or str(ctx.run.export)
    reason = not_served_reason(cfg.draft.config)
    result: dict[str, Any]
    if reason:
        say(f"not serving: {reason}")
        result = {"served_acceptance_length": None, "served_acceptance_skipped": reason}
    else:
        target_dir = resolve_target(cfg.paths.target_model)
        tok = AutoTokenizer.from_pretrained(target_dir)
        prompts = load_prompt_ids(
            cfg.data.prompts,
            tok,
            cfg.evaluate.num_prompts,
            cfg.data.max_prompt_tokens,
            offset=cfg.data.num_samples,
        )
        say(f"serving the exported draft with the target in vLLM on {len(prompts)} held-out prompts ...")
        ev = evaluate(
            export_dir,
            target_dir,
            prompts,
            num_speculative_tokens=cfg.evaluate.num_speculative_tokens,
            max_tokens=cfg.evaluate.max_tokens,
        )
        result = {"evaluate": ev, "served_acceptance_length": ev.get("served_acceptance_length")}
        say(f"served acceptance length {ev.get('served_acceptance_length')} ({ev.get('convention', '')})")
    write_json_atomic(ctx.run.evaluate, result, indent=2)
    return 0
