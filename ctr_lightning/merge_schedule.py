"""When ranks that train on their own merge: the k-step schedule, with no communication in it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MergeSchedule:
    """Counts the steps of ranks that train locally and says when they merge.

    The first ``warmup_steps`` steps are synchronous (the ranks stay equal, by averaged
    gradients); after them, the ranks take local steps and merge after every ``k``-th.
    Between scheduled merges, others may be asked for (validation, the end of fit): they
    happen only while local steps are :meth:`pending`, and do not move the schedule.
    :class:`KStepAdamStrategy` keeps one for the dense model; the sparse tables of a
    ``sparse_sync="k_step"`` collection keep their own, with the same ``k``.

    Example::

        schedule = MergeSchedule(k=4, warmup_steps=2)
        [(schedule.synchronous(), schedule.step()) for _ in range(7)]
        # steps 1-2 synchronous; merges after steps 6 (2 + 4) and not after 7
    """

    k: int = 16
    warmup_steps: int = 0
    steps: int = 0  # steps taken
    last_merge: int = 0  # the ranks were equal after this many steps

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k must be an integer >= 1, got {self.k!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")

    def synchronous(self) -> bool:
        """Whether the step about to run keeps the ranks equal (k = 1, or warm-up)."""
        return self.k == 1 or self.steps < self.warmup_steps

    def step(self) -> bool:
        """Count one step; True when a scheduled merge follows it."""
        synchronous = self.synchronous()
        self.steps += 1
        local = self.steps - self.warmup_steps
        due = not synchronous and local > 0 and local % self.k == 0
        if due:
            self.last_merge = self.steps
        return due

    def pending(self) -> bool:
        """Whether the ranks took steps on their own since they were last equal."""
        return self.k > 1 and self.steps > max(self.warmup_steps, self.last_merge)

    def note_merge(self) -> None:
        """An unscheduled merge made the ranks equal now."""
        self.last_merge = self.steps

    def resume(self, steps: int) -> None:
        """Continue after ``steps`` steps, from a checkpoint that holds one (merged) model."""
        self.steps = self.last_merge = steps
