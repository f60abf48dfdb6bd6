"""Loss masks from three template styles (ChatML, a Llama-3-style header template, a template with a
thinking block), by generation markers and by prefix rendering; every template is written here."""

from __future__ import annotations

import pytest

from hpctoolkit.data.template import ChatSpec, encode_chat
from hpctoolkit.errors import ConfigError
from hpctoolkit.targets.builtin import tiny_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_MARKED = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\\n' }}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama-3 style: a BOS, role headers, <|eot_id|> closing each turn, no newline after it.
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# (transformers renders with trim_blocks: a newline right after a block tag is written as {{ '\\n' }}.)
# Qwen3 style: the last assistant turn keeps its reasoning in a <think> block, earlier ones lose it;
# enable_thinking=false puts an empty block into the generation prompt.
THINKING = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% if loop.last and m.reasoning_content is defined %}<think>\n{{ m.reasoning_content }}\n</think>\n\n"
    "{% endif %}{{ m['content'] }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
THINKING_MARKED = THINKING.replace(
    "<|im_start|>assistant\n{% if loop.last", "<|im_start|>assistant\n{% generation %}{% if loop.last"
).replace(
    "{{ m['content'] }}<|im_end|>\n{% else %}",
    "{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\\n' }}{% else %}",
)

CONV = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "the cat"},
    {"role": "assistant", "content": "sat on the mat"},
    {"role": "user", "content": "and the dog"},
    {"role": "assistant", "content": "ran in the park"},
]


@pytest.fixture(scope="module")
def base_tok():
    return tiny_tokenizer()


def tok_with(base, template: str, extra_specials=()):
    import copy

    tok = copy.deepcopy(base)
    if extra_specials:
        tok.add_special_tokens({"additional_special_tokens": list(extra_specials)})
    tok.chat_template = template
    if "bos_token" in template:
        tok.add_special_tokens({"bos_token": "<|begin_of_text|>"})
    return tok


def supervised(tok, ids, mask) -> str:
    return tok.decode([i for i, m in zip(ids, mask, strict=True) if m])


def runs(tok, ids, mask) -> list[str]:
    out, cur = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    if cur:
        out.append(tok.decode(cur))
    return out


@pytest.mark.parametrize("method", ["prefix", "template"])
def test_chatml_masks_assistant_content_and_end_of_turn_only(base_tok, method):
    tok = tok_with(base_tok, CHATML_MARKED if method == "template" else CHATML)
    ids, mask = encode_chat(tok, CONV, ChatSpec(mask_method=method))
    assert runs(tok, ids, mask) == ["sat on the mat<|im_end|>", "ran in the park<|im_end|>"]
    assert len(ids) == len(mask)


def test_chatml_both_methods_give_the_same_ids_and_mask(base_tok):
    a = encode_chat(tok_with(base_tok, CHATML), CONV, ChatSpec(mask_method="prefix"))
    b = encode_chat(tok_with(base_tok, CHATML_MARKED), CONV, ChatSpec(mask_method="auto"))
    assert a == b


def test_last_assistant_only(base_tok):
    tok = tok_with(base_tok, CHATML)
    ids, mask = encode_chat(tok, CONV, ChatSpec(loss_mask="last_assistant"))
    assert runs(tok, ids, mask) == ["ran in the park<|im_end|>"]
    tok2 = tok_with(base_tok, CHATML_MARKED)
    assert encode_chat(tok2, CONV, ChatSpec(loss_mask="last_assistant")) == (ids, mask)


def test_all_supervises_every_token(base_tok):
    ids, mask = encode_chat(tok_with(base_tok, CHATML), CONV, ChatSpec(loss_mask="all"))
    assert all(mask) and len(mask) == len(ids)


def test_llama3_header_template(base_tok):
    tok = tok_with(
        base_tok, LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|begin_of_text|>"]
    )
    ids, mask = encode_chat(tok, CONV, ChatSpec())
    assert ids[0] == tok.convert_tokens_to_ids("<|begin_of_text|>")  # the template's BOS, once
    assert ids.count(ids[0]) == 1
    assert runs(tok, ids, mask) == ["sat on the mat<|eot_id|>", "ran in the park<|eot_id|>"]
    # No header token is supervised.
    head = {tok.convert_tokens_to_ids(t) for t in ("<|start_header_id|>", "<|end_header_id|>")}
    assert not any(m for i, m in zip(ids, mask, strict=True) if i in head)


def test_thinking_template_last_turn_keeps_its_think_block(base_tok):
    conv = [*CONV[:-1], {**CONV[-1], "reasoning_content": "a dog runs"}]
    tok = tok_with(base_tok, THINKING, ["<think>", "</think>"])
    ids, mask = encode_chat(tok, conv, ChatSpec(loss_mask="last_assistant"))
    assert runs(tok, ids, mask) == ["<think>\na dog runs\n</think>\n\nran in the park<|im_end|>"]
    # Markers in the template: every turn, the earlier one without its (dropped) reasoning.
    tok2 = tok_with(base_tok, THINKING_MARKED, ["<think>", "</think>"])
    ids2, mask2 = encode_chat(tok2, conv, ChatSpec())
    assert ids2 == ids
    assert runs(tok2, ids2, mask2) == [
        "sat on the mat<|im_end|>",
        "<think>\na dog runs\n</think>\n\nran in the park<|im_end|>",
    ]


def test_thinking_template_with_enable_thinking_false_kwarg(base_tok):
    tok = tok_with(base_tok, THINKING, ["<think>", "</think>"])
    spec = ChatSpec(template_kwargs={"enable_thinking": False}, loss_mask="last_assistant")
    from hpctoolkit.data.template import prompt_ids

    p = prompt_ids(tok, CONV[:-1], spec)
    assert tok.decode(p).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_prefix_method_refuses_a_template_whose_prefixes_do_not_match(base_tok):
    # enable_thinking=false puts an empty think block in the generation prompt that an earlier
    # assistant turn of the whole conversation does not have: prefixes cannot place that turn.
    tok = tok_with(base_tok, THINKING, ["<think>", "</think>"])
    spec = ChatSpec(template_kwargs={"enable_thinking": False}, mask_method="prefix")
    with pytest.raises(ConfigError, match=r"messages\[:2\].*assistant message 2"):
        encode_chat(tok, CONV, spec)


def test_template_method_needs_markers(base_tok):
    with pytest.raises(ConfigError, match="no \\{% generation %\\} markers"):
        encode_chat(tok_with(base_tok, CHATML), CONV, ChatSpec(mask_method="template"))


@pytest.mark.parametrize(
    ("policy", "prompt", "first"),
    [("keep", "", "be brief"), ("drop", "", "the cat"), ("default", "S", "be brief"), ("replace", "S", "S")],
)
def test_system_prompt_policy(base_tok, policy, prompt, first):
    from hpctoolkit.data.template import apply_system_policy

    msgs = apply_system_policy(CONV, ChatSpec(system_prompt_policy=policy, system_prompt=prompt))
    assert msgs[0]["content"] == first
    assert sum(m["role"] == "system" for m in msgs) == (0 if policy == "drop" else 1)
    no_system = apply_system_policy(CONV[1:], ChatSpec(system_prompt_policy="default", system_prompt="S"))
    assert no_system[0] == {"role": "system", "content": "S"}
