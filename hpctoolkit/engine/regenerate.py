"""Regeneration: the target answers each row itself, turn by turn, before its hidden states are captured.

A draft is judged on the target's own outputs, so it should be trained on them. For a chat row
every assistant turn is replaced, in order, by the target's response to the regenerated history
(`render(messages[:i], add_generation_prompt=True)`); a row that ends in a user turn gets one
more assistant turn (a row's first `answered` assistant turns, already the target's own
(`data.synth`), are kept). A plain-text row becomes `prompt + continuation`, supervised on the
continuation only. Pre-tokenized rows are captured as given.

Turns are generated in rounds (round `r`: the `r`-th assistant turn of every row that has one),
so one engine call serves every row. Sampling comes from the recipe (`data.regenerate_*`):
temperature (0: greedy), top_p, max new tokens, and a seed per request (`seed + 1000 * row +
turn`). Each turn is counted: `empty` (no token but the end of turn), `truncated` (stopped at
the token limit; kept), `failed` (the history did not fit `data.max_prompt_tokens` or the
engine's length). An empty or failed turn keeps the row's own response (none for text); a row
with one is `bad`, and more than `data.regenerate_max_bad_fraction` of bad rows fails the run.

A chat's last regenerated turn is captured as exactly what the target produced: its prompt
(the template's render of the regenerated history with the generation prompt) and its own
tokens, end-of-turn token included where it stopped on one; earlier turns enter that history as
their decoded text. `regenerate_rows` takes any `generate(prompts, max_tokens, seeds) -> [(token_ids, finish)]`; the
vLLM one (`vllm_generator`) runs the target in this process, so call it from a child process.

A multi-node engine generates over all of its nodes, as it captures: the leader's generating
engine (`generation_kwargs` with the node's keys and a rendezvous of its own) waits for each
follower node's workers (`follow_generation`, a headless follower of that engine), and a follower
tells that it is done by its rendezvous port closing.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hpctoolkit.engine.config import EngineConfig
from hpctoolkit.engine.kwargs import ONE_NODE, CaptureSink, NodeArgs, engine_llm_kwargs
from hpctoolkit.errors import DataIntegrityError
from hpctoolkit.output.figures import figure

# (token ids, finish reason: "stop" | "length")
Generated = tuple[list[int], str]
Generate = Callable[[list[list[int]], list[int], list[int]], list[Generated]]


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class RegenReport:
    samples: int = 0
    turns: int = 0
    empty: int = 0
    truncated: int = 0
    failed: int = 0
    bad_samples: int = 0
    # Answers the target wrote in a repetition loop (`data.synth_filter.repetition_loop`): not
    # trained on (the row keeps its own response, as a failed turn's does), and not a failure:
    # they are the target's own greedy behaviour, so they do not count toward the bad fraction.
    degenerate: int = 0
    degenerate_samples: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def check(self, max_bad_fraction: float) -> None:
        if self.samples and self.bad_samples / self.samples > max_bad_fraction:
            raise DataIntegrityError(
                f"regeneration: {self.bad_samples} of {self.samples} samples had a turn that came back "
                f"empty or failed (empty {self.empty}, failed {self.failed}, truncated {self.truncated} of "
                f"{self.turns} turns), more than data.regenerate_max_bad_fraction={max_bad_fraction:g}"
            )


def _content(tok: Any, ids: Sequence[int], eot: set[int]) -> str:
    body = list(ids)
    while body and body[-1] in eot:
        body.pop()
    return str(tok.decode(body, skip_special_tokens=True))


def regenerate_rows(
    rows: Sequence[dict[str, Any]],
    tok: Any,
    spec: Any,
    generate: Generate,
    sampling: Sampling,
    *,
    max_prompt_tokens: int,
    max_model_len: int,
    row_ids: Sequence[int] | None = None,
) -> tuple[list[dict[str, Any]], RegenReport]:
    """`[{"input_ids", "loss_mask", "origin"}]` of the regenerated rows, and the counts. `row_ids`:
    each row's index in the engine's whole share, when `rows` are a replica's slice of it."""
    from hpctoolkit.data.synth_filter import degenerate
    from hpctoolkit.data.template import eot_ids, prompt_ids

    eot = eot_ids(tok, spec.end_of_turn_tokens)
    report = RegenReport(samples=len(rows))
    bad: set[int] = set()
    looping: set[int] = set()
    convs, texts = _split_rows(rows, tok, spec, max_prompt_tokens)
    text_out: dict[int, list[int]] = {}
    # The last regenerated turn of a chat: (its prompt, the target's exact tokens).
    last_turn: dict[int, tuple[list[int], list[int]]] = {}

    def run(jobs: list[tuple[int, int, list[int]]]) -> list[Generated | None]:
        return _generate_fitting(generate, sampling, jobs, max_prompt_tokens, max_model_len, row_ids)

    def note(n: int, got: Generated | None, content: str) -> bool:
        report.turns += 1
        if got is None:
            report.failed += 1
        elif got[1] == "length":
            report.truncated += 1
        if got is not None and not content:
            report.empty += 1
        ok = got is not None and bool(content)
        if not ok:
            bad.add(n)
        elif degenerate(content):
            report.degenerate += 1
            looping.add(n)
            return False
        return ok

    # Plain text: one turn.
    text_jobs = [(n, 0, ids) for n, ids in texts.items()]
    for (n, _, _), got in zip(text_jobs, run(text_jobs), strict=True):
        body = [] if got is None else list(got[0])
        note(n, got, _content(tok, body, eot))
        text_out[n] = [] if n in looping else body  # a loop: the prompt alone, nothing supervised
    # Chats: round r regenerates the r-th assistant turn of every conversation that has one.
    # A row's first `answered` assistant turns are the target's own already (`data.synth`).
    turn_index = {
        n: [i for i, m in enumerate(msgs) if m["role"] == "assistant"][int(rows[n].get("answered") or 0) :]
        for n, msgs in convs.items()
    }
    for r in range(max((len(v) for v in turn_index.values()), default=0)):
        jobs = [
            (n, r, prompt_ids(tok, convs[n][: idx[r]], spec)) for n, idx in turn_index.items() if r < len(idx)
        ]
        for (n, _, prompt), got in zip(jobs, run(jobs), strict=True):
            content = "" if got is None else _content(tok, got[0], eot)
            msg = convs[n][turn_index[n][r]]
            if note(n, got, content):
                msg["content"] = content
                msg.pop("reasoning_content", None)  # the target's own reasoning is in its response
                if r == len(turn_index[n]) - 1:
                    assert got is not None
                    last_turn[n] = (prompt, list(got[0]))
    report.bad_samples = len(bad)
    report.degenerate_samples = len(looping - bad)
    out = _assemble(
        rows, tok, spec, texts, text_out, convs, last_turn, max_prompt_tokens, sampling.max_new_tokens
    )
    return out, report


def _split_rows(
    rows: Sequence[dict[str, Any]], tok: Any, spec: Any, max_prompt_tokens: int
) -> tuple[dict[int, list[dict[str, Any]]], dict[int, list[int]]]:
    """The rows to regenerate, by row index: each chat's messages (the system policy applied, an
    empty assistant turn appended where it ends in a user turn) and each text's prompt ids."""
    from hpctoolkit.data.prompts import _clean
    from hpctoolkit.data.template import apply_system_policy

    convs: dict[int, list[dict[str, Any]]] = {}
    texts: dict[int, list[int]] = {}
    for n, row in enumerate(rows):
        if row["kind"] == "chat":
            msgs = apply_system_policy(_clean(row["messages"]), spec)
            if msgs[-1]["role"] != "assistant":
                msgs.append({"role": "assistant", "content": ""})
            convs[n] = msgs
        elif row["kind"] == "text":
            texts[n] = list(tok(row["text"], add_special_tokens=False).input_ids)[:max_prompt_tokens]
    return convs, texts


def _generate_fitting(
    generate: Generate,
    sampling: Sampling,
    jobs: list[tuple[int, int, list[int]]],
    max_prompt_tokens: int,
    max_model_len: int,
    row_ids: Sequence[int] | None = None,
) -> list[Generated | None]:
    """(row, turn, prompt) -> generated, in one `generate` call, or None where the prompt does not
    fit. A request's seed follows its row's index in the engine's whole share (`row_ids[row]`:
    a replica's rows are a slice of it), so sampling does not depend on the replicas."""
    fits = [j for j in jobs if len(j[2]) <= max_prompt_tokens and len(j[2]) < max_model_len - 1]
    outs = iter(
        generate(
            [p for _, _, p in fits],
            # A captured sample must stay under max_model_len (`CaptureEngine.capture`).
            [min(sampling.max_new_tokens, max_model_len - 1 - len(p)) for _, _, p in fits],
            [sampling.seed + 1000 * (n if row_ids is None else row_ids[n]) + t for n, t, _ in fits],
        )
        if fits
        else []
    )
    fit_set = {id(j) for j in fits}
    return [next(outs) if id(j) in fit_set else None for j in jobs]


def _assemble(
    rows: Sequence[dict[str, Any]],
    tok: Any,
    spec: Any,
    texts: dict[int, list[int]],
    text_out: dict[int, list[int]],
    convs: dict[int, list[dict[str, Any]]],
    last_turn: dict[int, tuple[list[int], list[int]]],
    max_prompt_tokens: int,
    max_new_tokens: int,
) -> list[dict[str, Any]]:
    """Each row as `{"input_ids", "loss_mask", "origin"}` once its turns were regenerated. A chat
    re-rendered whole (its last turn kept the dataset's response) is cut where a regenerated one
    ends at most: `max_prompt_tokens + max_new_tokens`, the length the recipe was checked for."""
    longest = max_prompt_tokens + max_new_tokens
    from hpctoolkit.data.prompts import encode_row
    from hpctoolkit.data.template import prompt_ids

    out = []
    for n, row in enumerate(rows):
        origin = row.get("origin", "")
        if n in texts:
            ids = texts[n] + text_out[n]
            out.append(
                {
                    "input_ids": ids,
                    "loss_mask": [0] * len(texts[n]) + [1] * len(text_out[n]),
                    "origin": origin,
                }
            )
            continue
        if n in convs:
            msgs = [m for m in convs[n] if m["role"] != "assistant" or m["content"]]
            kept = dataclasses.replace(spec, system_prompt_policy="keep")  # applied above
            exact = _exact_last_turn(tok, kept, convs[n], last_turn.get(n))
            if exact is not None:
                out.append({"input_ids": exact[0], "loss_mask": exact[1], "origin": origin})
            elif any(m["role"] == "assistant" for m in msgs):
                e = encode_row({**row, "messages": msgs}, tok, kept, longest)
                out.append({"input_ids": e.input_ids, "loss_mask": e.loss_mask, "origin": origin})
            else:  # a bad row with no response left: nothing to supervise (counted above)
                ids = prompt_ids(tok, msgs, kept)[:longest]
                out.append({"input_ids": ids, "loss_mask": [0] * len(ids), "origin": origin})
            continue
        e = encode_row(row, tok, spec, max_prompt_tokens)
        out.append({"input_ids": e.input_ids, "loss_mask": e.loss_mask, "origin": origin})
    return out


def _exact_last_turn(
    tok: Any, spec: Any, msgs: list[dict[str, Any]], last: tuple[list[int], list[int]] | None
) -> tuple[list[int], list[int]] | None:
    """`prompt + the target's own tokens` of a chat's last turn, with the history's mask, or None
    (the last turn was not regenerated, or the history's render is not a token prefix of its
    prompt: then the whole conversation is rendered again from the decoded responses)."""
    from hpctoolkit.data.template import encode_chat

    if last is None:
        return None
    prompt, generated = last
    history = msgs[: max(i for i, m in enumerate(msgs) if m["role"] == "assistant")]
    if spec.loss_mask == "all":
        return prompt + generated, [1] * (len(prompt) + len(generated))
    h_mask = [0] * len(prompt)
    if spec.loss_mask == "assistant" and any(m["role"] == "assistant" for m in history):
        h_ids, mask = encode_chat(tok, history, spec)
        if prompt[: len(h_ids)] != h_ids:
            return None
        h_mask[: len(mask)] = mask
    return prompt + generated, h_mask + [1] * len(generated)


# What only the capture engine needs: the generating engine is the same engine without them.
CAPTURE_ONLY_KEYS = ("speculative_config", "kv_transfer_config", "worker_extension_cls")


def generation_kwargs(
    engine_cfg: EngineConfig,
    target_dir: str | os.PathLike,
    node: NodeArgs = ONE_NODE,
    *,
    backend: str | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """`LLM` kwargs and environment of the generating engine of one node, laid out as the capture
    engine is (its PP x TP over its nodes, dtype, lengths and batching, `engine.extra_args`),
    without the capture parts. `node` as for `engine_llm_kwargs` (`roles.context.engine_node_args`):
    a multi-node engine's leader and followers each pass their own, with the generating
    rendezvous (`engine_node_args(..., generating=True)`) as `master_port`. `backend`: detected
    when None."""
    from hpctoolkit.engine.env import detect_backend

    sink = CaptureSink(None, {}, "regenerate")
    # The section's own scheduler budgets: the capture engine's prefill-batch sizing is not its.
    own = dataclasses.replace(engine_cfg, prefill_batch=1)
    _, kwargs, env = engine_llm_kwargs(own, target_dir, sink, node, backend=backend or detect_backend())
    return {k: v for k, v in kwargs.items() if k not in CAPTURE_ONLY_KEYS}, env


def generator_llm_kwargs(
    target_dir: str | os.PathLike,
    seed: int,
    max_model_len: int,
    llm_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The generating engine's whole `LLM` kwargs: what `vllm_generator` builds its `LLM` with, and
    what a follower node of a multi-node engine must start its workers with (the same dict)."""
    kwargs: dict[str, Any] = dict(llm_kwargs or {"enforce_eager": True, "max_num_seqs": 16})
    kwargs.update(
        model=str(Path(target_dir)),
        max_model_len=max_model_len,
        enable_prefix_caching=False,
        seed=seed,
    )
    return kwargs


@dataclass(frozen=True)
class Gate:
    """A replica's turn to start its engine: once `after` exists (the replica before it has its
    engine up; None: the first), and `started` once its own is up."""

    after: str | None
    started: str
    timeout_s: float = 1800.0

    def wait(self) -> None:
        if self.after is None:
            return
        deadline = time.monotonic() + self.timeout_s
        while not os.path.exists(self.after):
            if time.monotonic() > deadline:
                raise DataIntegrityError(
                    f"regeneration replica: the replica before it did not start its engine within "
                    f"{figure(self.timeout_s, 0)}s ({self.after} never appeared)"
                )
            time.sleep(0.5)

    def opened(self) -> None:
        Path(self.started).touch()


def vllm_generator(
    target_dir: str | os.PathLike,
    sampling: Sampling,
    max_model_len: int,
    llm_kwargs: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    gate: Gate | None = None,
) -> Generate:
    """A `Generate` over the target in vLLM, started from this process: `llm_kwargs`/`env` from
    `generation_kwargs` (the engine's own layout), or one device by default. `gate`: replicas
    sharing a GPU start their engines one at a time (vLLM sizes its cache from the memory it finds
    free, which an engine starting beside it changes)."""
    from hpctoolkit.engine.env import detect_backend, engine_env

    if env is None:
        env = engine_env(
            detect_backend(), in_process=True, world_size=1, cpu_kvcache_space_gb=1, pin_v1_runner=False
        )
    # The layout's environment wins over what the process inherited: a VLLM_HOST_IP or
    # VLLM_ENABLE_V1_MULTIPROCESSING=0 left in a login shell (or by an earlier in-process engine)
    # made a multi-node generating engine's message queue listen on 127.0.0.1, so its other
    # node's workers never joined and generation hung.
    os.environ.update(env)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if gate is not None:
        gate.wait()
    llm = LLM(**generator_llm_kwargs(target_dir, sampling.seed, max_model_len, llm_kwargs))
    if gate is not None:
        gate.opened()

    def generate(
        prompts: list[list[int]],
        max_tokens: list[int],
        seeds: list[int],
        *,
        temperature: float | None = None,
        top_p: float | None = None,
        stop_token_ids: list[int] | None = None,
    ) -> list[Generated]:
        # The overrides are the synthesized user turns' sampling (`data.synth`).
        temp = sampling.temperature if temperature is None else temperature
        params = [
            SamplingParams(
                temperature=temp,
                top_p=sampling.top_p if top_p is None else top_p,
                max_tokens=m,
                seed=s if temp > 0 else None,
                stop_token_ids=stop_token_ids,
                detokenize=False,
            )
            for m, s in zip(max_tokens, seeds, strict=True)
        ]
        t0 = time.monotonic()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        got = [(list(o.outputs[0].token_ids), str(o.outputs[0].finish_reason)) for o in outs]
        took = time.monotonic() - t0
        new = sum(len(g[0]) for g in got)
        # A round can take minutes on a CPU: say what it did, so a user sees the run move.
        print(
            f"[hpctoolkit.engine] regenerated {len(got)} turns, {new} tokens in {figure(took, 1)} s "
            f"({figure(new / max(took, 1e-9), 0)} tokens/s)",
            flush=True,
        )
        return got

    return generate


def follow_generation(llm_kwargs: dict[str, Any], env: dict[str, str], poll_s: float = 2.0) -> dict[str, Any]:
    """Child-process entry on a follower node of a multi-node engine: this node's workers of the
    leader's generating engine (`generator_llm_kwargs`'s dict, with this node's keys), until the
    leader's generating engine leaves. `{"left": True}` then, or `{"left": False}` if a worker died."""
    os.environ.update(env)
    from hpctoolkit.engine.follower import HeadlessFollower

    follower = HeadlessFollower.from_node_kwargs(llm_kwargs)
    try:
        follower.start()
        print(
            f"[hpctoolkit.engine] node_rank {llm_kwargs['node_rank']}: serving the leader's generating engine",
            flush=True,
        )
        follower.wait(poll_s=poll_s)
        # The leader left (this node's workers still run), or a local worker died.
        return {"left": follower.health_check(probe_leader=False)}
    finally:
        follower.shutdown()


def regenerate(
    target_dir: str,
    rows: list[dict[str, Any]],
    spec: dict[str, Any],
    sampling: dict[str, Any],
    max_prompt_tokens: int,
    max_model_len: int,
    llm_kwargs: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    replica: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Child-process entry: `{"samples": [...], "report": {...}, "synthesized": {...} | None}`
    (JSON-native); `builtin:magpie` rows are written by the target first (`data.synth`).
    `replica` (`roles.engines.engine_prompts` with `engine.regenerate_replicas > 1`): `{"row_ids",
    "after", "started"}`, this replica's rows' indices in the engine's share and its `Gate`."""
    from transformers import AutoTokenizer

    from hpctoolkit.data.synth import Limits, fill_rows
    from hpctoolkit.data.template import ChatSpec

    chat = ChatSpec(**{**spec, "end_of_turn_tokens": tuple(spec.get("end_of_turn_tokens", ()))})
    samp = Sampling(**sampling)
    tok = AutoTokenizer.from_pretrained(target_dir)
    gate = None if replica is None else Gate(replica["after"], replica["started"])
    gen = vllm_generator(target_dir, samp, max_model_len, llm_kwargs, env, gate)
    limits = Limits(samp.max_new_tokens, max_prompt_tokens, max_model_len)
    rows, synthesized = fill_rows(rows, tok, chat, gen, limits)  # type: ignore[arg-type]
    samples, report = regenerate_rows(
        rows,
        tok,
        chat,
        gen,
        samp,
        max_prompt_tokens=max_prompt_tokens,
        max_model_len=max_model_len,
        row_ids=None if replica is None else replica["row_ids"],
    )
    return {"samples": samples, "report": report.to_dict(), "synthesized": synthesized}
