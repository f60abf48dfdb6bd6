"""Rendering a conversation with the target tokenizer's own chat template, and its loss mask.

The mask rule
    1 on every token of an assistant turn's content and on the end-of-turn token that closes it;
    0 on system and user turns and on the template's own tokens (role headers, the generation
    prompt, separators after the end-of-turn token). `last_assistant` keeps only the last
    assistant turn; `all` supervises every token.

How it is derived (`mask_method`)
    `template`: the template's `{% generation %}` blocks, through transformers'
    `return_assistant_tokens_mask`. `prefix`: assistant turn `i` starts at the first token reaching
    past where
    `render(messages[:i], add_generation_prompt=True)` ends (that render must be a prefix of the whole
    conversation's, else the template cannot be masked this way and the row is refused) and ends
    at the first end-of-turn token after it. `auto` picks `template` when the template has
    generation markers. Either way, a supervised run is then cut after its first end-of-turn token
    and extended by one when the end-of-turn token follows it directly, so both methods agree.

End-of-turn tokens: the tokenizer's eos, the usual chat ones present in its vocabulary
(`<|im_end|>`, `<|eot_id|>`, `<|end|>`, `<end_of_turn>`, `<|eom_id|>`, `</s>`), and
`data.end_of_turn_tokens`.

The text is tokenized once, with `add_special_tokens=False` (the template writes its own BOS), so
`input_ids` are exactly what the target sees.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hpctoolkit.errors import ConfigError

KNOWN_EOT = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|eom_id|>", "</s>")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

Message = Mapping[str, Any]


@dataclass(frozen=True)
class ChatSpec:
    """How conversations become token ids and a mask (from the `data` section)."""

    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    loss_mask: str = "assistant"
    mask_method: str = "auto"
    end_of_turn_tokens: tuple[str, ...] = ()
    system_prompt_policy: str = "keep"
    system_prompt: str = ""


def eot_ids(tok: Any, extra: Sequence[str] = ()) -> set[int]:
    """Ids of the end-of-turn tokens this tokenizer knows (see the module docstring)."""
    vocab = tok.get_vocab()
    ids = {vocab[t] for t in (*KNOWN_EOT, *extra) if t in vocab}
    for t in extra:
        if t not in vocab:
            raise ConfigError(f"data.end_of_turn_tokens: {t!r} is not a token of the target tokenizer")
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    return ids


def has_generation_markers(tok: Any) -> bool:
    template = tok.chat_template
    if isinstance(template, Mapping):
        template = template.get("default", "")
    return bool(template) and bool(_GENERATION_TAG.search(str(template)))


def apply_system_policy(messages: Sequence[Message], spec: ChatSpec) -> list[dict[str, Any]]:
    msgs = [dict(m) for m in messages]
    policy = spec.system_prompt_policy
    if policy == "keep":
        return msgs
    has_system = any(m["role"] == "system" for m in msgs)
    if policy in ("drop", "replace"):
        msgs = [m for m in msgs if m["role"] != "system"]
    if policy == "replace" or (policy == "default" and not has_system):
        msgs.insert(0, {"role": "system", "content": spec.system_prompt})
    return msgs


def render(tok: Any, messages: Sequence[Message], spec: ChatSpec, *, add_generation_prompt: bool) -> str:
    if not tok.chat_template:
        raise ConfigError("the target tokenizer has no chat template; chat rows need one (or give text rows)")
    return tok.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **spec.template_kwargs
    )


def prompt_ids(tok: Any, messages: Sequence[Message], spec: ChatSpec) -> list[int]:
    """The conversation so far with the generation prompt: what the target answers."""
    text = render(tok, messages, spec, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False).input_ids)


def _assistant_indices(messages: Sequence[Message], which: str) -> list[int]:
    idx = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return idx[-1:] if which == "last_assistant" else idx


def _prefix_mask(
    tok: Any, messages: Sequence[Message], spec: ChatSpec, full: str, eot: set[int]
) -> tuple[list[int], list[int]]:
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc.input_ids)
    ends = [int(b) for _, b in enc.offset_mapping]
    mask = [0] * len(ids)
    for i in _assistant_indices(messages, spec.loss_mask):
        head = render(tok, messages[:i], spec, add_generation_prompt=True) if i else ""
        if not full.startswith(head):
            raise ConfigError(
                f"the chat template renders messages[:{i}] with its generation prompt differently "
                f"from the whole conversation, so assistant message {i} cannot be placed by prefixes; "
                "use a template with {% generation %} markers or data.loss_mask=last_assistant"
            )
        # The first token that reaches into the turn (one merged across the boundary included).
        t = next((k for k, e in enumerate(ends) if e > len(head)), len(ids))
        end = next((k for k in range(t, len(ids)) if ids[k] in eot), None)
        if end is None:
            if i != len(messages) - 1:
                raise ConfigError(
                    f"no end-of-turn token after assistant message {i}; name it in data.end_of_turn_tokens"
                )
            end = len(ids) - 1
        for k in range(t, end + 1):
            mask[k] = 1
    return ids, mask


def _template_mask(tok: Any, messages: Sequence[Message], spec: ChatSpec) -> tuple[list[int], list[int]]:
    out = tok.apply_chat_template(
        list(messages),
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        **spec.template_kwargs,
    )
    ids, mask = list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]
    if spec.loss_mask == "last_assistant":
        ones = [k for k, v in enumerate(mask) if v]
        if ones:
            start = ones[-1]
            while start > 0 and mask[start - 1]:
                start -= 1
            mask = [1 if k >= start and v else 0 for k, v in enumerate(mask)]
    return ids, mask


def _normalise_runs(ids: list[int], mask: list[int], eot: set[int]) -> list[int]:
    """Each supervised run ends at its first end-of-turn token, which it includes."""
    out = list(mask)
    k = 0
    while k < len(out):
        if not out[k]:
            k += 1
            continue
        j = k
        while j < len(out) and out[j]:
            j += 1
        cut = next((p for p in range(k, j) if ids[p] in eot), None)
        if cut is not None:
            for p in range(cut + 1, j):
                out[p] = 0
        elif j < len(out) and ids[j] in eot:
            out[j] = 1
            j += 1
        k = j
    return out


def encode_chat(tok: Any, messages: Sequence[Message], spec: ChatSpec) -> tuple[list[int], list[int]]:
    """`(input_ids, loss_mask)` of a whole conversation (after the system-prompt policy)."""
    msgs = apply_system_policy(messages, spec)
    full = render(tok, msgs, spec, add_generation_prompt=False)
    if spec.loss_mask == "all":
        ids = list(tok(full, add_special_tokens=False).input_ids)
        return ids, [1] * len(ids)
    eot = eot_ids(tok, spec.end_of_turn_tokens)
    method = spec.mask_method
    if method == "auto":
        method = "template" if has_generation_markers(tok) else "prefix"
    if method == "template":
        if not has_generation_markers(tok):
            raise ConfigError(
                "data.mask_method=template but the chat template has no {% generation %} markers; "
                "use mask_method=prefix or auto"
            )
        ids, mask = _template_mask(tok, msgs, spec)
    else:
        ids, mask = _prefix_mask(tok, msgs, spec, full, eot)
    return ids, _normalise_runs(ids, mask, eot)
