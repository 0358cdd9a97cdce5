"""Parallel-sampling groups: the ``n`` samples of one request (``SamplingParams.n > 1``).

Sample 0 runs under the request's own id; once its prompt is computed the scheduler forks samples
``1..n-1`` (ids ``"id#i"``) sharing its blocks. This module only keeps the ids: every sample id of
a group stays reserved until the whole group is done (so an id can't be reused while a sample runs,
and an abort reaches every sample), and the group is forgotten when its last sample finishes.
"""

from __future__ import annotations

from prefixcache.request import Request, sample_request_id


class SampleGroups:
    """The engine's unfinished ``n > 1`` requests: group id → {sample id: finished?}."""

    def __init__(self) -> None:
        self._groups: dict[str, dict[str, bool]] = {}  # in sample order
        self._group_of: dict[str, str] = {}  # sample id -> group id

    def sample_ids(self, request_id: str, n: int) -> list[str]:
        """The engine ids of the ``n`` samples of ``request_id``."""
        return [sample_request_id(request_id, i) for i in range(n)]

    def is_reserved(self, sample_id: str) -> bool:
        """Whether ``sample_id`` belongs to an unfinished group."""
        return sample_id in self._group_of

    def add(self, request_id: str, n: int) -> None:
        """Reserves the sample ids of a new ``n``-sample request (nothing to do for ``n == 1``)."""
        if n > 1:
            ids = self.sample_ids(request_id, n)
            self._groups[request_id] = dict.fromkeys(ids, False)
            self._group_of.update((rid, request_id) for rid in ids)

    def members(self, request_id: str) -> list[str]:
        """The sample ids an abort of ``request_id`` must reach: the group's, or ``[request_id]``."""
        return list(self._groups.get(request_id, [request_id]))

    def finish(self, request: Request) -> None:
        """Marks one sample finished; forgets the group once all are. A sample 0 that ends before
        forking (aborted, failed) takes its never-created siblings with it."""
        group_id = self._group_of.get(request.request_id)
        if group_id is None:
            return
        group = self._groups[group_id]
        group[request.request_id] = True
        if request.fork_params:
            request.fork_params = []
            group.update(dict.fromkeys(group, True))
        if all(group.values()):
            del self._groups[group_id]
            for sample_id in group:
                del self._group_of[sample_id]
