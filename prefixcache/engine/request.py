"""A request's state as the scheduler and the KV cache manager see it.

Token ranges of a request (vLLM v1's picture)::

    | prompt                                  | output          |
    | num_computed_tokens   | scheduled now   | not yet         |

``block_hashes`` holds one hash per *full* block of ``all_token_ids`` and grows as tokens are
appended, so each block is hashed exactly once.
"""

from __future__ import annotations

import dataclasses
import enum
import time

from prefixcache.cache.hashing import BlockHash, BlockHasher
from prefixcache.layers.lora import LoRAAdapter
from prefixcache.sampling_params import SamplingParams


def sample_request_id(group_id: str, sample_index: int) -> str:
    """The engine's id of sample ``sample_index`` of a parallel-sampling group (0 is the group id)."""
    return group_id if sample_index == 0 else f"{group_id}#{sample_index}"


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One generation request.

    Args:
        request_id: unique id.
        prompt_token_ids: the prompt, ``len >= 1``.
        sampling_params: validated sampling parameters.
        block_hasher: computes the chained block hashes.
        root_key: the request's cache-key root (model fingerprint + cache_salt).
        arrival_s: arrival time (``time.monotonic()`` seconds).
        stream: report an output after every step that adds a token, not only at the finish.
        lora: the LoRA adapter applied to this request (its digest is part of ``root_key``).
        tenant_key: the tenant namespace (:func:`~prefixcache.cache.hashing.tenant_extra_key`),
            mixed into the hash of, and verified on, every block from ``num_shared_blocks`` on.
        num_shared_blocks: leading full blocks that lie inside an approved shared prefix and are
            keyed without ``tenant_key``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        block_hasher: BlockHasher,
        root_key: bytes,
        arrival_s: float | None = None,
        stream: bool = False,
        lora: LoRAAdapter | None = None,
        tenant_key: bytes = b"",
        num_shared_blocks: int = 0,
        prompt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        # Parallel sampling (n > 1): this request is sample 0 of group ``group_id``; the other
        # samples are forked from it once its prompt is computed (sharing its blocks).
        self.group_id = request_id
        self.sample_index = 0
        self.fork_params: list[SamplingParams] = [
            dataclasses.replace(
                sampling_params, n=1, seed=None if sampling_params.seed is None else sampling_params.seed + i
            )
            for i in range(1, sampling_params.n)
        ]
        self.stream = stream
        self.lora = lora
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens served from the prefix cache at first admission; None until admitted.
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.root_key = root_key
        self.tenant_key = tenant_key
        self.num_shared_blocks = num_shared_blocks
        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        block_hasher.extend(self.block_hashes, self.all_token_ids, root_key, tenant_key, num_shared_blocks)
        self.arrival_s = time.monotonic() if arrival_s is None else arrival_s
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        # Where the text ends when a stop string matched (characters of the decoded output).
        self.stop_text_end: int | None = None
        # Sampling RNG, created by the runner on first use when a seed is given.
        self.generator = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def fork(self, request_id: str, sampling_params: SamplingParams, sample_index: int) -> Request:
        """A new sample of this request's group, at the same point (prompt computed, no output).

        The child shares everything but its sampling params and id; its blocks are shared by the
        KV cache manager (:meth:`KVCacheManager.fork`).
        """
        child = Request.__new__(Request)
        child.__dict__.update(self.__dict__)
        child.request_id = request_id
        child.sampling_params = sampling_params
        child.sample_index = sample_index
        child.fork_params = []
        child.all_token_ids = list(self.all_token_ids)
        child.output_token_ids = list(self.output_token_ids)
        child.block_hashes = list(self.block_hashes)
        child.generator = None
        return child

    def block_extra_key(self, block_index: int) -> bytes:
        """The extra key of block ``block_index``: the tenant's, unless inside the shared prefix."""
        return self.tenant_key if block_index >= self.num_shared_blocks else b""

    def append_output_token_ids(self, token_id: int) -> None:
        """Appends one sampled token and hashes any block it completes."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._block_hasher.extend(
            self.block_hashes, self.all_token_ids, self.root_key, self.tenant_key, self.num_shared_blocks
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
