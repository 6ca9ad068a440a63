"""One request's blockd sequence: which of its blocks are saved when, and when it is committed.

A plan covers the request's prompt and, unless ``save_generated`` is off, what it generates:
every full block of ``request.all_token_ids`` whose K/V vLLM has computed, the blocks vLLM's own
prefix cache would hash, so the next turn of a conversation (previous prompt + answer + new
text) hits the previous answer too. The last sampled token never has K/V (it is the input of a
step that does not come), so a block is saved in the step that computes the K/V of its last
token, from the request's own vLLM block, while the request runs: nothing waits for vLLM to
free its blocks at the end.

The invariant that makes a Commit safe: blockd's sequence holds the prompt and then only whole
blocks of generated tokens, appended in the step whose saves write them; a Commit (which
publishes every full block of the sequence) goes only when no save of the plan is unreported,
so every block it publishes is one a worker reported written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Plan:
    """One request's blockd sequence and what is left to copy."""

    seq_id: str
    epoch: int
    num_prompt: int
    hit_tokens: int
    table: list[int]
    #: vLLM's block-aligned local hit at the last query.
    local_tokens: int = 0
    loads: list[tuple[int, int]] = field(default_factory=list)
    #: Blocks [0, saved) are in blockd or handed to a step to save.
    saved: int = 0
    #: Steps whose saves the workers have not reported yet.
    pending: set[int] = field(default_factory=set)
    #: Its loads went out in a step (the pin may go once that step's fence completes).
    scheduled: bool = False
    finished: bool = False
    failed: bool = False
    #: blockd went away (or changed epoch) under it: loads only, then let go.
    abandoned: bool = False
    #: The session its block ids belong to (the worker loads from that session's mapping).
    session_id: str = ""
    #: The vLLM request, whose ``all_token_ids`` grow as it generates; None: the prompt only.
    request: Any = None
    #: Tokens in blockd's sequence: the prompt, then whole blocks of generated tokens.
    num_tokens: int = 0
    #: Leading blocks already in blockd's index (the hit, then what this plan committed).
    committed: int = 0

    def __post_init__(self) -> None:
        self.num_tokens = self.num_tokens or self.num_prompt

    def prompt_blocks(self, B: int) -> int:
        return self.num_prompt // B

    def prompt_saves(self, end: int, B: int) -> range:
        """The prompt blocks a step that leaves ``end`` tokens computed completes (and that
        are not saved yet)."""
        return range(self.saved, max(self.saved, min(end, self.num_prompt) // B))

    def generated(self, end: int, B: int) -> list[int]:
        """The generated tokens to append so that blockd's sequence ends at the last full
        block whose K/V is computed once a step leaves ``end`` tokens computed: only tokens
        vLLM knows now (``all_token_ids``; a speculative or not yet sampled token is not
        there), only once the prompt is handed out, never a partial block."""
        if self.request is None or self.failed or self.saved < self.prompt_blocks(B):
            return []
        tokens = self.request.all_token_ids
        upto = min(end, len(tokens)) // B * B
        if upto <= self.num_tokens:
            return []
        return list(tokens[self.num_tokens:upto])

    def grew(self, count: int, start: int | None, block_ids: list[int], B: int) -> range:
        """blockd appended ``count`` tokens (its table changed from ``start`` on, when given):
        the blocks to save now, all of them full."""
        if start is not None:
            self.table[start:] = block_ids
        self.num_tokens += count
        blocks = range(self.saved, self.num_tokens // B)
        self.saved = self.num_tokens // B
        return blocks

    def decide(self, B: int) -> tuple[bool, bool]:
        """(commit now, done: release and forget) for a plan that is not abandoned."""
        if self.failed:
            return False, True  # nothing more is published: the save may not have happened
        if self.pending or not (self.scheduled or self.finished):
            return False, False
        whole_prompt = self.saved >= self.prompt_blocks(B)
        # Done: the request ended, or its prompt is in and nothing more will be saved.
        done = self.finished or (whole_prompt and self.request is None)
        # The prompt is committed as soon as it is in (other requests may share it while this
        # one generates); generated blocks once the request ends, in one Commit.
        commit = (whole_prompt and self.saved > self.committed
                  and (done or self.committed < self.prompt_blocks(B)))
        return commit, done
