"""What a scheduler reports for metrics: plain dataclasses, taken as a snapshot."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class QueueStats:
    index: int  # 0 is the queue of the smallest requests
    upper_boundary: float | None  # WRS below which a request belongs here (None: no upper bound)
    length: int  # waiting requests
    head_wait_s: float  # how long the oldest waiting request has waited
    mean_wait_s: float | None = None  # recent arrival-to-admission time (None: not measured)
    quota_tokens: int | None = None  # None: the policy has no quotas
    held_tokens: int = 0  # borrowed by running requests charged to this queue
    min_quota_tokens: int | None = None  # the M/M/1 floor S*D*(1/SLO + lambda)
    quota_seats: int | None = None
    held_seats: int = 0
    arrival_rate: float | None = None  # requests per second over the last refresh window


@dataclass
class PredictorStats:
    observations: int  # finished requests learnt from
    mean_abs_error: float  # tokens, recent (exponentially weighted)
    mean_rel_error: float  # |predicted - actual| / actual, recent
    bias: float  # predicted - actual in tokens, recent: > 0 over-predicts


@dataclass
class IdleCapacity:
    """Steps that ended with a free seat and unused token budget while a waiting request fitted: the
    capacity a policy left idle where a request could have run (0 everywhere: work-conserving)."""

    steps: int = 0
    seats: int = 0  # free seats summed over those steps
    tokens: int = 0  # unused budget tokens summed over those steps
    reasons: dict[str, int] = field(default_factory=dict)  # steps by why the policy held the request

    def add(self, seats: int, tokens: int, reason: str, steps: int = 1) -> None:
        self.steps += steps
        self.seats += seats * steps
        self.tokens += tokens * steps
        self.reasons[reason] = self.reasons.get(reason, 0) + steps

    def snapshot(self) -> IdleCapacity:
        return IdleCapacity(self.steps, self.seats, self.tokens, dict(self.reasons))

    def __add__(self, other: IdleCapacity) -> IdleCapacity:
        reasons = dict(self.reasons)
        for reason, steps in other.reasons.items():
            reasons[reason] = reasons.get(reason, 0) + steps
        return IdleCapacity(self.steps + other.steps, self.seats + other.seats, self.tokens + other.tokens, reasons)


@dataclass
class SchedulerStats:
    policy: str
    queues: list[QueueStats]
    num_preemptions: int = 0  # for memory (recompute), not for priority
    num_squashes: int = 0  # bypassing requests stopped so the request they passed could start
    num_bypasses: int = 0  # requests admitted ahead of an older one whose adapter had no memory
    num_refreshes: int = 0  # queue reconfigurations (K-means, boundaries, quotas)
    num_idle_admissions: int = 0  # chameleon: requests started on what the quotas left idle (work-conserving)
    overloaded: bool = False  # the quota floors need more tokens than the pool has
    token_pool: int | None = None  # tokens the quotas share
    spare_held_tokens: int = 0  # lent from the spare of emptied queues
    predictor: PredictorStats | None = None
    adapter_service: dict[str, int] = field(default_factory=dict)  # adapter ('' = base) -> tokens served
    adapter_counters: dict[str, float] = field(default_factory=dict)  # vtc: virtual token counters
    # steps that left requests waiting, by what ended admission (scheduler.ADMISSION_LIMITS)
    admission_limits: dict[str, int] = field(default_factory=dict)
    idle: IdleCapacity = field(default_factory=IdleCapacity)  # capacity left idle while a request fitted
