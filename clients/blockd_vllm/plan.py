"""One request's blockd sequence: which of its blocks are saved when, and when it is committed.

A plan covers the request's prompt and, unless ``save_generated`` is off, what it generates:
every full block of ``request.all_token_ids`` whose K/V vLLM has computed, the blocks vLLM's own
prefix cache would hash, so the next turn of a conversation (previous prompt + answer + new
text) hits the previous answer too. The last sampled token never has K/V (it is the input of a
step that does not come). In the step that computes the K/V of a block's last token the
bookkeeping Step appends the block's tokens to blockd's sequence (one append in flight per plan,
and only once the prompt's Commit went, so an append never holds the prompt back); that Step is
answered off the scheduler thread, so the block is saved, from the request's own vLLM block,
in the first step after the answer in which the request runs. A request that ends with such a
block unsaved keeps its vLLM blocks (``request_finished`` answers True: ``held``) until the step
that saves them, whose worker reports the request in ``finished_sending``.

The invariant that makes a Commit safe: blockd's sequence holds the prompt and then only whole
blocks of generated tokens; a Commit (which publishes every full block of the sequence) goes
only when no append is in flight, no appended block is unsaved and no save of the plan is
unreported, so every block it publishes is one a worker reported written. A plan whose appended
blocks can no longer be saved (``growth_lost``) publishes nothing more.
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
    #: Tokens of an append in flight (its Step not answered yet).
    appending: int = 0
    #: Blocks appended (in blockd's sequence) whose save is not handed to a step yet.
    to_save: list[int] = field(default_factory=list)
    #: The request ended with blocks to save: vLLM keeps its blocks (``vblocks``, holding the
    #: K/V of ``kv_upto`` tokens) until a step saved them.
    held: bool = False
    vblocks: list[int] = field(default_factory=list)
    kv_upto: int = 0
    #: Appended blocks that will never be saved: nothing more is committed.
    growth_lost: bool = False

    def __post_init__(self) -> None:
        self.num_tokens = self.num_tokens or self.num_prompt

    def quiet(self, end: int, B: int) -> bool:
        """Whether a step that leaves ``end`` tokens computed has nothing to do for this plan
        (``Copies.plan`` would change nothing: most decode steps): its first step is past and
        its loads went, its prompt blocks are handed out, no appended block waits for its save,
        and no block completes past blockd's sequence."""
        return (self.scheduled and not self.loads and not self.to_save
                and self.saved >= self.num_prompt // B and end // B * B <= self.num_tokens)

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
        there), only once the prompt's Commit went and no append is in flight or unsaved,
        never a partial block."""
        if end // B * B <= self.num_tokens:
            return []  # no block completed past the sequence (most decode steps)
        if (self.request is None or self.failed or self.appending or self.to_save
                or self.committed < self.prompt_blocks(B)):
            return []
        tokens = self.request.all_token_ids
        upto = min(end, len(tokens)) // B * B
        if upto <= self.num_tokens:
            return []
        return list(tokens[self.num_tokens:upto])

    def grew(self, count: int, start: int | None, block_ids: list[int], B: int
             ) -> list[int]:
        """blockd appended ``count`` tokens (its table changed from ``start`` on, when given):
        the blocks to save (``to_save``), all of them full."""
        if start is not None:
            self.table[start:] = block_ids
        self.num_tokens += count
        self.to_save = list(range(self.saved, self.num_tokens // B))
        return self.to_save

    def savable(self, computed: int, B: int) -> bool:
        """Whether vLLM's blocks hold the K/V of every block in ``to_save`` when ``computed``
        tokens are computed."""
        return bool(self.to_save) and (self.to_save[-1] + 1) * B <= computed

    def decide(self, B: int) -> tuple[bool, bool]:
        """(commit now, done: release and forget) for a plan that is not abandoned."""
        if self.held or self.appending:
            return False, False  # the append's answer, or the step saving it, decides
        if self.failed or self.growth_lost:
            return False, True  # nothing more is published: the save may not have happened
        if self.pending or self.to_save or not (self.scheduled or self.finished):
            return False, False
        whole_prompt = self.saved >= self.prompt_blocks(B)
        # Done: the request ended, or its prompt is in and nothing more will be saved.
        done = self.finished or (whole_prompt and self.request is None)
        # The prompt is committed as soon as it is in (other requests may share it while this
        # one generates); generated blocks once the request ends, in one Commit.
        commit = (whole_prompt and self.saved > self.committed
                  and (done or self.committed < self.prompt_blocks(B)))
        return commit, done
