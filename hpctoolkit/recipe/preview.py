"""Show the first samples of a recipe's data as the trainer will see them.

    python -m hpctoolkit.recipe.preview RECIPE [section.key=value ...] [-n N] [--json]

Renders each row with the target tokenizer's chat template (`paths.target_model`: a builtin or any
HF tokenizer directory) and the recipe's `data` settings, and prints the text with the supervised
spans (loss mask 1) marked: highlighted on a terminal, between `[[` and `]]` otherwise. `--json`
prints one object per sample, `{"origin", "text", "input_ids", "loss_mask"}`. Regeneration is not
run: with `data.regenerate_tokens` set the responses shown are the rows' own, which the target's
replace before capture. Except with a `builtin:magpie` source (`data.synth`), whose user turns only
the target can write: then the target runs here (vLLM on this machine's device), writes the first
N rows' pool and answers every row, as an engine leader would; its counts go to stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from hpctoolkit.cli import parse, parser, run_cli

_ON, _OFF = "\x1b[1;32m", "\x1b[0m"


def marked_text(tok: Any, ids: list[int], mask: list[int], *, color: bool) -> str:
    """The decoded sample with each supervised run wrapped (ANSI green, or `[[ ]]`)."""
    out, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or mask[k] != mask[start]:
            text = tok.decode(ids[start:k])
            if mask[start]:
                text = f"{_ON}{text}{_OFF}" if color else f"[[{text}]]"
            out.append(text)
            start = k
    return "".join(out)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _answered(cfg: Any, target: str, n: int) -> list[Any]:
    """The first `n` rows, `builtin:magpie`'s written and every row answered by the target here."""
    import dataclasses

    from hpctoolkit.data.prompts import Encoded, chat_spec, load_rows, regenerate_sampling
    from hpctoolkit.data.synth import report_line
    from hpctoolkit.engine.regenerate import regenerate

    d = cfg.data
    rows = load_rows(d, n)
    spec = dataclasses.asdict(chat_spec(d))
    with _stdout_to_stderr():  # vLLM logs to stdout, which holds the samples
        out = regenerate(
            target, rows, spec, regenerate_sampling(d), d.max_prompt_tokens, cfg.engine.max_model_len
        )
    print(report_line(out["synthesized"]), file=sys.stderr)
    return [Encoded(list(s["input_ids"]), list(s["loss_mask"]), s["origin"]) for s in out["samples"]]


def main(argv: list[str]) -> int:
    ap = parser("hpctoolkit.recipe.preview", __doc__)
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides")
    ap.add_argument("-n", type=int, default=3, help="samples to show (default 3)")
    ap.add_argument("--json", action="store_true", help="one JSON object per sample")
    args = parse(ap, argv)
    from hpctoolkit.errors import ConfigError

    if args.n < 1:
        raise ConfigError(f"-n must be >= 1, got {args.n}")
    from transformers import AutoTokenizer

    from hpctoolkit.data.prompts import load_samples, sources_of
    from hpctoolkit.data.synth import SOURCE
    from hpctoolkit.recipe.load import compose
    from hpctoolkit.targets.resolve import resolve_target

    cfg = compose(args.recipe, args.overrides)
    target = resolve_target(cfg.paths.target_model)
    if not target.is_dir():
        raise ConfigError(f"paths.target_model: {target} is not a directory")
    tok = AutoTokenizer.from_pretrained(str(target))
    n = min(args.n, cfg.data.num_samples)
    answered = any(src.path == SOURCE for src in sources_of(cfg.data))
    samples = _answered(cfg, str(target), n) if answered else load_samples(cfg.data, tok, n)
    if cfg.data.regenerate_tokens and not args.json and not answered:
        print(
            "note: data.regenerate_tokens is set; the target's responses replace these before capture",
            file=sys.stderr,
        )
    color = sys.stdout.isatty()
    for i, s in enumerate(samples):
        if args.json:
            text = tok.decode(s.input_ids)
            print(
                json.dumps(
                    {"origin": s.origin, "text": text, "input_ids": s.input_ids, "loss_mask": s.loss_mask}
                )
            )
            continue
        head = f"--- sample {i} ({s.origin}): {len(s.input_ids)} tokens, {s.supervised} supervised"
        print(head)
        print(marked_text(tok, s.input_ids, s.loss_mask, color=color))
    return 0


if __name__ == "__main__":
    run_cli(main)
