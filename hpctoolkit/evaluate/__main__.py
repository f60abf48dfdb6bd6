"""`python -m hpctoolkit.evaluate EXPORT_DIR --target TARGET_DIR`: served vs simulated acceptance.

Prompts come from `--prompts`: `mt_bench` (the chat sets of `--sets`, through the target's chat
template: MT-Bench's 80 questions, both turns, per-category figures; `human_eval`'s 164 problems;
each set's figure), or `builtin:tiny` or a JSONL file, skipping
`--prompt-offset` of them (e.g. the training ones). Prints the two acceptance lengths, then the result JSON (also written
to `--out`); `--plot` writes a served-vs-simulated PNG. The questions served so far go to stderr
every 10 s. A k past the depth the draft was trained for (`--ttt-length` gives an Eagle3 draft's) is
warned about on stderr before serving.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from hpctoolkit.cli import parse, parser, run_cli
from hpctoolkit.data.prompts import load_prompt_ids
from hpctoolkit.errors import ConfigError
from hpctoolkit.evaluate.command import k_warning
from hpctoolkit.evaluate.compare import evaluate
from hpctoolkit.evaluate.serve import reporting
from hpctoolkit.evaluate.sets import set_lines
from hpctoolkit.output.figures import figure
from hpctoolkit.rundir.atomic import write_text_atomic
from hpctoolkit.rundir.progress import DEFAULT_EVERY_S, Counted, count_line
from hpctoolkit.targets.resolve import resolve_target


def build_parser() -> argparse.ArgumentParser:
    ap = parser("hpctoolkit.evaluate", __doc__)
    ap.add_argument("export_dir")
    ap.add_argument(
        "--target",
        required=True,
        help="target model directory, builtin:tiny-qwen3 or pypi:SmolLM2-135M-Instruct",
    )
    ap.add_argument("--prompts", default="builtin:tiny", help="mt_bench, builtin:tiny or a JSONL file")
    ap.add_argument(
        "--sets", default="mt_bench", help="with --prompts mt_bench: comma-separated mt_bench,human_eval"
    )
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument(
        "--prompt-offset", type=int, default=0, help="skip this many prompts (e.g. the training ones)"
    )
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument(
        "--ttt-length",
        type=int,
        help="the training.ttt_length an Eagle3 draft was trained with, to warn when k exceeds it",
    )
    ap.add_argument("--out", help="write the result JSON here")
    ap.add_argument("--plot", help="write a served-vs-simulated PNG here")
    return ap


def _counted(total: int, what: str) -> Counted:
    def emit(record: dict[str, Any]) -> None:
        print(count_line(record), file=sys.stderr, flush=True)

    return Counted("evaluate", what, total, DEFAULT_EVERY_S, emit)


def main(argv: list[str]) -> int:
    args = parse(build_parser(), argv)
    if args.num_speculative_tokens < 1 or args.max_tokens < 1 or args.num_prompts < 1:
        raise ConfigError("--num-speculative-tokens, --max-tokens and --num-prompts must be >= 1")
    config = Path(args.export_dir) / "config.json"
    k = args.num_speculative_tokens
    if config.is_file() and (warning := k_warning(config, k, ttt_length=args.ttt_length)):
        print(f"hpctoolkit: warning: {warning}", file=sys.stderr, flush=True)
    target = resolve_target(args.target)
    tok = AutoTokenizer.from_pretrained(str(target))
    if args.prompts == "mt_bench":
        from hpctoolkit.evaluate.chat import num_turns
        from hpctoolkit.evaluate.compare import evaluate_sets
        from hpctoolkit.evaluate.sets import load_sets

        sets = load_sets([s.strip() for s in args.sets.split(",")])
        if "mt_bench" in sets:  # the headline set, as in the evaluate role
            sets = {"mt_bench": sets.pop("mt_bench"), **sets}
        turns = sum(len(qs) * num_turns(name, qs) for name, qs in sets.items())
        with reporting(_counted(turns, "question turns")):
            result = evaluate_sets(
                args.export_dir,
                target,
                sets,
                tok,
                num_speculative_tokens=args.num_speculative_tokens,
                max_tokens=args.max_tokens,
                plot_path=args.plot,
            )
    else:
        prompts = load_prompt_ids(
            args.prompts, tok, args.num_prompts, args.max_prompt_tokens, offset=args.prompt_offset
        )
        with reporting(_counted(len(prompts), "questions")):
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
        write_text_atomic(args.out, text + "\n")
    print(
        f"served acceptance length {figure(result['served_acceptance_length'])}, simulated "
        f"{figure(result['simulated_acceptance_length'])} (both incl. bonus; k={args.num_speculative_tokens})"
    )
    print(text)
    for category, value in (result.get("served_acceptance_by_category") or {}).items():
        print(f"  {category:<11} {figure(value)}")
    for line in set_lines(result.get("per_set") or {}):
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    run_cli(main)
