"""The pool: admitted groups waiting to be used, each with the times it was used (the reuse
ledger). A batch takes them in admission order (`policy.select`), a group at most `reuse_limit`
times; groups that became too stale or whose branch a trainer restart abandoned are dropped
(`expire`), as are those of a worker who lost the trainer's trust (`drop`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from . import policy
from .config import AdmissionOrder
from .groups import Admitted


class Pool:
    def __init__(self) -> None:
        self._groups: dict[str, Admitted] = {}  # name -> group, in admission order
        self._uses: dict[str, int] = {}  # name -> times used
        self._expired_at: object = None

    def __len__(self) -> int:
        return len(self._groups)

    def __bool__(self) -> bool:
        return bool(self._groups)

    def __iter__(self) -> Iterator[Admitted]:
        return iter(list(self._groups.values()))

    def add(self, admitted: Admitted, uses: int = 0) -> None:
        self._groups[admitted.name] = admitted
        self._uses[admitted.name] = uses

    def ledger(self) -> dict[str, int]:
        """{name: times used} of every group in the pool (the state's reuse ledger)."""
        return dict(self._uses)

    def drop(self, keep: Callable[[Admitted], bool]) -> list[Admitted]:
        """Remove and return the groups `keep` refuses."""
        dropped = [a for a in self._groups.values() if not keep(a)]
        for a in dropped:
            del self._groups[a.name], self._uses[a.name]
        return dropped

    def expire(self, at: object, lag: Callable[[int], int | None], staleness_limit: int) -> tuple[int, int]:
        """Drop the groups whose weight version is on an abandoned branch (`lag` None) or lags
        more than `staleness_limit`; (off-lineage, stale) groups dropped. Nothing to do while `at`
        (what the lags depend on) is what it was at the last call."""
        if self._expired_at == at:
            return 0, 0
        self._expired_at = at
        off = stale = 0

        def keep(a: Admitted) -> bool:
            nonlocal off, stale
            steps = lag(a.group.weight_version)
            if steps is None:
                off += 1
                return False
            if policy.is_stale(steps, staleness_limit):
                stale += 1
                return False
            return True

        self.drop(keep)
        return off, stale

    def take(self, n: int, order: AdmissionOrder, reuse_limit: int) -> list[tuple[Admitted, int]]:
        """The `n` groups (fewer if there are fewer) a batch takes, in admission order, each with
        its use number (1: the first time); a group used `reuse_limit` times leaves the pool."""
        candidates = (policy.Candidate(name, a.group.weight_version, self._uses[name]) for name, a in self._groups.items())
        out = []
        for name in policy.select(candidates, n, order):
            admitted, uses = self._groups[name], self._uses[name] + 1
            if policy.can_reuse(uses, reuse_limit):
                self._uses[name] = uses
            else:
                del self._groups[name], self._uses[name]
            out.append((admitted, uses))
        return out
