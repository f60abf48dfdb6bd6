"""The scheduler side of the connector: which request's sample is handed to the stages, and when.

Pure bookkeeping over vLLM's scheduler outputs (read by attribute; no vLLM import), so every rule
is unit-tested without an engine. One instance lives in the engine core, next to vLLM's scheduler,
and is called from its thread only.

A request moves through: tracked (`_prompts`: its prompt is being computed) -> completing (its
last prompt token was scheduled in the step just built) -> handed (the next step carried its
sample to every stage) -> finished (`finish`, when vLLM finishes the request). Two departures:

* **Abort after hand-out.** The stages publish the sample regardless; `finish` holds the blocks
  until they reported, returns no manifest, and the next step tells every stage to remove its
  fragments (`discard`, run after that stage's publish). Nobody would read them, and a hard-pinned
  store never evicts them.
* **Preemption after hand-out** (KV-cache pressure). vLLM frees the request's blocks while the
  stages may still be reading them, then recomputes the request (our connector is a KV producer,
  so vLLM drops the stale output: `KVConnectorBase_V1.requires_kv_delivery`). The sample handed
  out is discarded like an aborted one and the request is tracked again from its recompute, which
  is handed out anew, under the same sample key, into the blocks it then holds. A preempted
  request whose sample was not handed out yet is tracked again the same way.

A request whose sample was ever handed out is reported by every stage, so its blocks are always
held (`finish` returns True): vLLM asserts that a request reported sent is still known.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpctoolkit.errors import DataIntegrityError


@dataclass
class PendingSample:
    """Scheduler → worker: one finished request to publish. Plain data (it is pickled to workers)."""

    req_id: str
    block_ids: list[int]
    token_ids: list[int]
    manifest: dict[str, Any]


@dataclass
class _Prompt:
    """A request whose prompt is being computed, as the scheduler outputs show it."""

    token_ids: list[int]
    block_ids: list[int]  # of the hidden-state KV group, in order


# (request id, prompt token ids, block ids) -> the sample to hand out.
MakeSample = Callable[[str, list[int], list[int]], PendingSample]


class SampleTracker:
    """See the module docstring. `gid` is the hidden-state KV cache group's index."""

    def __init__(self, gid: int, make_sample: MakeSample):
        self.gid = gid
        self._make = make_sample
        self._prompts: dict[str, _Prompt] = {}
        self._completing: dict[str, PendingSample] = {}
        self._handed: dict[str, PendingSample] = {}
        self._ever_handed: set[str] = set()
        self._discard: list[PendingSample] = []
        # Finished while completing (PP=1: before the next step hands the sample out).
        self._finished: set[str] = set()

    def step(self, scheduler_output: Any) -> tuple[list[PendingSample], list[PendingSample]]:
        """(samples to publish, samples whose fragments to remove) for the step just scheduled."""
        self._retrack(getattr(scheduler_output, "preempted_req_ids", None) or ())
        pending = list(self._completing.values())
        out = {rid: s for rid, s in self._completing.items() if rid not in self._finished}
        self._handed.update(out)
        self._ever_handed.update(out)
        self._completing, self._finished = {}, set()
        discard, self._discard = self._discard, []
        self._track(scheduler_output)
        return pending, discard

    def _retrack(self, preempted: Any) -> None:
        for rid in preempted:
            sample = self._handed.pop(rid, None)
            if sample is not None:
                self._discard.append(sample)
            else:
                sample = self._completing.pop(rid, None)
            if sample is not None:
                # Recomputed from scratch; its blocks arrive with the step that resumes it.
                self._prompts[rid] = _Prompt(list(sample.token_ids), [])

    def _track(self, scheduler_output: Any) -> None:
        """Follow each request's prompt and blocks through the scheduler output of one step.

        The same bookkeeping as the model runner's: a new request brings its prompt and block
        table, a running one appends its new blocks, a resumed (preempted) one replaces them.
        A request whose computed tokens reach its prompt length in this step completes.
        """
        gid = self.gid
        scheduled = scheduler_output.num_scheduled_tokens
        progress: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            if new.prompt_token_ids is None or new.req_id in self._completing or new.req_id in self._handed:
                continue  # embeds only (finish refuses it), or its sample is out already
            self._prompts[new.req_id] = _Prompt(list(new.prompt_token_ids), list(new.block_ids[gid]))
            progress.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            prompt = self._prompts.get(req_id)
            if prompt is None:
                continue  # completed already, or untracked
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                prompt.block_ids = list(new_blocks[gid]) if new_blocks is not None else []
            elif new_blocks is not None:
                prompt.block_ids.extend(new_blocks[gid])
            progress.append((req_id, cached.num_computed_tokens[i]))
        for req_id, computed in progress:
            prompt = self._prompts[req_id]
            if computed + scheduled.get(req_id, 0) >= len(prompt.token_ids):
                del self._prompts[req_id]
                self._completing[req_id] = self._make(req_id, prompt.token_ids, prompt.block_ids)

    def finish(
        self,
        rid: str,
        prompt: list[int],
        block_ids: list[int],
        *,
        aborted: bool,
        num_computed_tokens: int,
    ) -> tuple[bool, PendingSample | None]:
        """(hold the blocks, the sample whose manifest goes to the client or None) for a request
        vLLM finished; raises `DataIntegrityError` when the sample handed out is not the request's.
        """
        self._prompts.pop(rid, None)
        handed_before = rid in self._ever_handed
        self._ever_handed.discard(rid)
        if rid in self._handed:
            sample = self._handed.pop(rid)
            if aborted:
                self._discard.append(sample)  # published regardless; removed after that
                return True, None
        elif rid in self._completing:
            sample = self._completing[rid]
            if aborted:
                del self._completing[rid]  # never handed out: nothing is published
                return handed_before, None
            self._finished.add(rid)
        else:
            if handed_before:
                return True, None  # its earlier sample is discarded; the stages still report it
            # Never seen completing its prompt in a scheduler output (e.g. a connector unit
            # test): publish with the next step, from the blocks vLLM reports now. Never a
            # partial sample: a request finished before its last prefill chunk ran has no
            # complete set of rows.
            if aborted or num_computed_tokens < len(prompt):
                return False, None
            sample = self._make(rid, list(prompt), list(block_ids))
            self._completing[rid] = sample
            self._finished.add(rid)
        used = len(sample.block_ids)
        if list(block_ids[:used]) != sample.block_ids or list(prompt) != sample.token_ids:
            raise DataIntegrityError(
                f"request {rid}: the sample was handed out with blocks {sample.block_ids} and "
                f"{len(sample.token_ids)} prompt tokens, but the request finished with blocks "
                f"{list(block_ids[:used])} and {len(prompt)} prompt tokens"
            )
        return True, sample
