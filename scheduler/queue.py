"""The waiting queue: which waiting request goes next, by the policy (with aging) within a
tenant and by weighted fair queueing between tenants."""

from __future__ import annotations

import math
from collections.abc import Iterator

from scheduler.sequence import Sequence
from surge.config import SchedulerConfig


def urgency(seq: Sequence, cfg: SchedulerConfig, now: float) -> tuple[float, ...]:
    """The policy's sort key (lower goes first); its first item is the class that goes before
    fair sharing, so a more urgent request is never held back by its tenant's share."""
    if cfg.policy == "fcfs":
        return (0, seq.arrival_time)
    aged = (now - seq.arrival_time) / cfg.priority_aging_s if cfg.priority_aging_s else 0.0
    if cfg.policy == "priority":
        return (seq.priority - math.floor(aged), seq.arrival_time)
    # sjf: predicted steps to finish; each aging period halves it, so a long job waits at most
    # aging * log2(longest / shortest) behind a stream of short ones.
    steps = seq.remaining_output + math.ceil(seq.num_tokens / cfg.max_num_batched_tokens)
    return (0, math.log2(max(steps, 1)) - aged, seq.arrival_time)


class WaitingQueue:
    def __init__(self) -> None:
        self.by_tenant: dict[str, list[Sequence]] = {}
        self.num_seqs = 0
        self.num_tokens = 0  # prompt tokens waiting, for max_queued_tokens

    def __len__(self) -> int:
        return self.num_seqs

    def __iter__(self) -> Iterator[Sequence]:
        for queue in self.by_tenant.values():
            yield from queue

    def add(self, seq: Sequence) -> None:
        self.by_tenant.setdefault(seq.tenant.name, []).append(seq)
        self.num_seqs += 1
        self.num_tokens += seq.num_prompt_tokens
        seq.tenant.num_waiting += 1

    def remove(self, seq: Sequence) -> None:
        self.by_tenant[seq.tenant.name].remove(seq)
        self.num_seqs -= 1
        self.num_tokens -= seq.num_prompt_tokens
        seq.tenant.num_waiting -= 1

    def order(self, cfg: SchedulerConfig, now: float) -> Iterator[Sequence]:
        """Waiting sequences in the order to admit them: the most urgent class first; within a
        class, the tenant with the least service per weight (charging each pick its predicted
        tokens as it goes); within a tenant, the policy's order. Safe to admit while iterating."""
        lines = {name: sorted(((urgency(s, cfg, now), s) for s in queue), key=lambda p: p[0])
                 for name, queue in self.by_tenant.items() if queue}
        heads = dict.fromkeys(lines, 0)
        vtime = {name: line[0][1].tenant.vtime for name, line in lines.items()}
        while heads:
            name = min(heads, key=lambda n: (lines[n][heads[n]][0][0], vtime[n],
                                             lines[n][heads[n]][0][1:]))
            seq = lines[name][heads[name]][1]
            yield seq
            vtime[name] += (seq.num_tokens + seq.remaining_output) / seq.tenant.cfg.weight
            heads[name] += 1
            if heads[name] == len(lines[name]):
                del heads[name]
