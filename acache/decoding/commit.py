"""Commit rules: which masked positions of the current block take their proposed token this step.

Every rule works on a whole batch at once: ``conf [B, L]`` holds the confidence of each block
position (``-inf`` where the position is already committed) and the result is a boolean ``[B, L]``.
A row that still has masks always commits at least one position, so decoding always terminates.
"""

from __future__ import annotations

import torch

from acache.sampling_params import SamplingParams


def commit_top_k(conf: torch.Tensor, masked: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Commits the ``k[b]`` most confident masked positions of each row (all of them if fewer)."""
    order = conf.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(conf.shape[-1], device=conf.device).expand_as(order))
    return masked & (ranks < k[:, None])


class CommitRule:
    """Chooses the positions to commit from the block's confidences."""

    def begin_block(self, num_masked: torch.Tensor, head_forced: bool = False) -> None:
        """Called once per block with the number of masked positions of each row; ``head_forced`` when
        step 0 commits only the block's first token (see :func:`commit_step`)."""

    def select(self, conf: torch.Tensor, masked: torch.Tensor, step: int) -> torch.Tensor:
        raise NotImplementedError

    def least_commits(self, step: int) -> int:
        """The fewest positions a step commits (of a one-row block): what FOCUS must keep at least."""
        return 1


class LowConfidence(CommitRule):
    """LLaDA's low-confidence remasking: a fixed quota a step from the linear schedule."""

    def __init__(self, steps_per_block: int) -> None:
        self.steps = steps_per_block
        self.schedule: torch.Tensor | None = None

    @staticmethod
    def quota_schedule(num_masked: torch.Tensor, steps: int) -> torch.Tensor:
        """``[B, steps]``: ``n // steps`` each step, plus one on the first ``n % steps`` steps."""
        base = (num_masked // steps)[:, None]
        extra = (torch.arange(steps, device=num_masked.device)[None, :] < (num_masked % steps)[:, None])
        return base + extra.long()

    def begin_block(self, num_masked: torch.Tensor, head_forced: bool = False) -> None:
        if head_forced and self.steps > 1:  # step 0 is the forced head; the rest share the other steps
            rest = self.quota_schedule((num_masked - 1).clamp_min(0), self.steps - 1)
            self.schedule = torch.cat((torch.ones_like(rest[:, :1]), rest), dim=1)
        else:
            self.schedule = self.quota_schedule(num_masked, self.steps)

    def least_commits(self, step: int) -> int:
        return int(self.schedule[0, step]) if step < self.steps else 1 << 30

    def select(self, conf: torch.Tensor, masked: torch.Tensor, step: int) -> torch.Tensor:
        # The schedule covers every mask of the block; past it (never reached) commit what is left.
        k = self.schedule[:, step] if step < self.steps else masked.sum(-1)
        return commit_top_k(conf, masked, k)


class Threshold(CommitRule):
    """Fast-dLLM threshold rule: every masked position with confidence >= threshold, at least one."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def select(self, conf: torch.Tensor, masked: torch.Tensor, step: int) -> torch.Tensor:
        best = commit_top_k(conf, masked, torch.ones(conf.shape[0], dtype=torch.long, device=conf.device))
        return masked & ((conf >= self.threshold) | best)


class Factor(CommitRule):
    """Fast-dLLM factor rule: with ``c1 >= c2 >= ...`` accept the largest ``n`` with
    ``c_n >= 1 - factor / (n + 1)``, and at least one."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def count(self, conf: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        sorted_conf = conf.sort(dim=-1, descending=True).values
        n = torch.arange(1, conf.shape[-1] + 1, device=conf.device, dtype=torch.float64)
        ok = (sorted_conf.double() >= 1.0 - self.factor / (n + 1)) & (n[None, :] <= masked.sum(-1, keepdim=True))
        largest = (ok * n).amax(-1).long()
        return largest.clamp_min(1)

    def select(self, conf: torch.Tensor, masked: torch.Tensor, step: int) -> torch.Tensor:
        return commit_top_k(conf, masked, self.count(conf, masked))


def commit_step(rule: CommitRule, tokens: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor, masked: torch.Tensor,
                step: int, force_head: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of a block ``[B, L]``: the rule picks among masked positions, which take their proposal.

    With ``force_head`` (a shifted model whose later steps cannot see the column before the block) step 0
    commits the block's first position and nothing else, as upstream Fast-dLLM's Dream loop does on its
    refresh forward. Returns the new block tokens and mask.
    """
    conf = torch.where(masked, conf, float("-inf"))
    commit = rule.select(conf, masked, step)
    if step == 0 and force_head:
        head = torch.zeros_like(masked)
        head[:, 0] = masked[:, 0]
        commit = torch.where(masked[:, :1], head, commit)
    return torch.where(commit, x0, tokens), masked & ~commit


def make_commit_rule(params: SamplingParams) -> CommitRule:
    if params.remasking == "low_confidence":
        return LowConfidence(params.steps_per_block)
    if params.remasking == "factor":
        return Factor(params.factor)
    return Threshold(params.threshold)
