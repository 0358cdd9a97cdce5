"""Turns a :class:`SchedulerOutput` into tensors, runs the model, samples tokens.

The runner makes no scheduling decision. It owns the KV pool (one tensor per layer of a KV-cache
group: one per layer for the Llama family, see :mod:`prefixcache.cache.kv_cache_groups`), the
per-request sampling generators, the structured-output matchers
(:mod:`prefixcache.runner.structured_output`, applied to the logits just before sampling) and the
token histories the penalties read (:mod:`prefixcache.runner.token_history`); everything else comes
in the step's ``SchedulerOutput``. Sampling is one call: the runner gathers each sampling row's
:class:`SamplingMetadata` and hands it with the logits to :func:`sample_batch`. It counts the prompt
tokens it actually runs through the model (``num_prompt_tokens_computed``), the ground truth that
every claimed cache hit must show up in as work not done.

A model with several KV-cache groups (sliding-window layers kept apart) declares
``uses_kv_cache_groups = True`` and receives a
:class:`~prefixcache.layers.grouped_attention.GroupedAttentionMetadata`: one metadata per group,
built from that group's tables (``ScheduledSeq.group_block_ids``; a sliding group's window-masked),
and each layer's ``(group, tensor)``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from prefixcache.cache.kv_cache_groups import KVCacheGroups, single_group
from prefixcache.config import INT4_DECODER_FORMATS
from prefixcache.layers.attention.metadata import build_attention_metadata, torch_attention_batch_invariant
from prefixcache.layers.grouped_attention import build_grouped_attention_metadata
from prefixcache.layers.lora import LoRABatch
from prefixcache.layers.quant import RowSplit, row_split
from prefixcache.layers.sampler import SamplingMetadata, TokenLogprobs, sample_batch
from prefixcache.models.loader import LoadedModel
from prefixcache.prompt_logprobs import PROMPT_LOGPROBS_TOPK, PromptLogprobsChunk
from prefixcache.runner.kv_pool import allocate_kv_caches
from prefixcache.runner.structured_output import StructuredOutputManager
from prefixcache.runner.token_history import TokenHistories
from prefixcache.sampling_params import SamplingParams
from prefixcache.scheduler_output import LoadOp, ScheduledSeq, SchedulerOutput

logger = logging.getLogger(__name__)

PROMPT_LOGITS_ROWS = 256  # prompt positions turned into logits at a time (each row: vocab_size floats)

# One sampling row: (request id, params, index into the logits rows, the sequence it comes from).
SamplingRow = tuple[str, SamplingParams, int, ScheduledSeq]


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one step computed for the engine (vLLM's ``ModelRunnerOutput``).

    Attributes:
        sampled_token_ids: request id -> sampled token id, for each sequence that completed its
            tokens this step and each sample forked from such a sequence.
        logprobs: request id -> the sampled position's logprobs, for those whose params ask.
        prompt_logprobs: request id -> the prompt logprobs of its chunk, for those whose
            ``ScheduledSeq.prompt_logprobs`` is set (see ``prefixcache.prompt_logprobs``).
        failed: request id (a sample's own id for a fork) -> why its sampling failed (its grammar,
            see ``runner/structured_output.py``); its sampled token is not to be used, the engine
            finishes it with ``"error"``.
    """

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


class ModelRunner:
    """Runs forward passes over the paged KV pool.

    Args:
        loaded: the model and its config.
        num_blocks: KV pool size in blocks.
        block_size: tokens per block.
        device: where the model and pool live.
        seed: seed of the generator used by sampled requests that give no seed.
        kv_cache_groups: the model's KV-cache groups (``runner.kv_pool.kv_cache_groups_of``; the pool
            holds ``layers_per_group`` tensors); ``None``: one group of every layer.

    Raises:
        ValueError: several groups for a model that does not take per-group metadata
            (``uses_kv_cache_groups``).
    """

    def __init__(
        self, loaded: LoadedModel, num_blocks: int, block_size: int, device: torch.device, seed: int,
        kv_cache_groups: KVCacheGroups | None = None,
    ) -> None:
        self.model = loaded.model
        self.block_size = block_size
        self.device = device
        cfg = loaded.config
        self.kv_cache_groups = kv_cache_groups or single_group(cfg.num_hidden_layers)
        self.uses_kv_cache_groups = bool(getattr(self.model, "uses_kv_cache_groups", False))
        if self.kv_cache_groups.is_hybrid and not self.uses_kv_cache_groups:
            raise ValueError(f"{type(self.model).__name__} has {self.kv_cache_groups.num_groups} KV-cache groups "
                             "(sliding-window layers) but does not take per-group attention metadata "
                             "(uses_kv_cache_groups)")
        dtype = next(self.model.parameters()).dtype
        self.kv_caches = allocate_kv_caches(
            self.kv_cache_groups.layers_per_group, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
            dtype, device
        )
        self._default_generator = torch.Generator(device="cpu").manual_seed(generator_seed(seed))
        self._generators: dict[str, torch.Generator] = {}
        self.structured_output = StructuredOutputManager(loaded.tokenizer, cfg.vocab_size, loaded.eos_token_ids)
        self._histories = TokenHistories()
        self.eos_token_ids = tuple(loaded.eos_token_ids)
        self.sliding_window = cfg.sliding_window  # a model with local layers: their window's metadata too
        # Prompt tokens run through the model so far (recomputes after preemption included).
        self.num_prompt_tokens_computed = 0
        if (device.type == "cpu" and getattr(self.model, "batch_invariant", False)
                and not getattr(self.model, "paged_attention", False) and not torch_attention_batch_invariant()):
            logger.warning("torch's attention kernels on this CPU give a row other bits in another batch (MKL's AVX2 "
                           "path; layers/attention/metadata.py), so this model's outputs with the cache on equal "
                           "those with it off to float rounding only, as float32's do")

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step.

        Returns:
            The token sampled for each sequence that completed its tokens this step, and for each
            sample forked from such a sequence (its last logits, sampled again with the fork's
            params and generator), with logprobs where asked.
        """
        for req_id in scheduler_output.finished_req_ids:
            self._generators.pop(req_id, None)
            self._histories.drop(req_id)
        self.structured_output.free(scheduler_output.finished_req_ids)
        seqs = scheduler_output.seqs
        if not seqs:
            return ModelRunnerOutput()
        if scheduler_output.load_ops:  # KV tier hits, before the copies and the forward pass
            self.write_blocks(scheduler_output.load_ops)
        # Partial-block reuse and copy-on-write, in order, before anything reads or writes the KV;
        # every tensor: both blocks hold the K/V of one group's layers, one layer per tensor.
        for op in scheduler_output.copy_ops:
            for kv_cache in self.kv_caches:  # [2, num_blocks, block_size, kv_heads, head_dim]
                kv_cache[:, op.dst_block_id, : op.num_tokens] = kv_cache[:, op.src_block_id, : op.num_tokens]
        input_ids = torch.tensor(
            [t for s in seqs for t in s.token_ids], dtype=torch.long, device=self.device
        )  # [num_tokens]
        attn_metadata, positions = self._attention_metadata(seqs)
        lora_segments, start = [], 0
        for s in seqs:
            if s.lora is not None:
                lora_segments.append((start, start + len(s.token_ids), s.lora))
            start += len(s.token_ids)
        lora = LoRABatch(lora_segments) if lora_segments else None
        with row_split(self._token_split(seqs)):  # a model that splits generated rows in its own layers
            hidden = self.model(input_ids, positions, attn_metadata, self.kv_caches, lora)  # [num_tokens, hidden]
        self.num_prompt_tokens_computed += sum(
            max(0, min(s.num_computed_tokens + len(s.token_ids), s.num_prompt_tokens) - s.num_computed_tokens)
            for s in seqs
        )
        output, start = ModelRunnerOutput(), 0
        for s in seqs:
            if s.prompt_logprobs is not None:
                output.prompt_logprobs[s.request_id] = self._prompt_logprobs_chunk(hidden[start : start + len(s.token_ids)], s)
            start += len(s.token_ids)

        # Logits only at each sampling sequence's last new token.
        rows, sampling = [], []  # sampling: SamplingRow per sampled sequence and fork
        end = 0
        for s in seqs:
            end += len(s.token_ids)
            if s.sampling_params is not None:
                rows.append(end - 1)
                sampling.append((s.request_id, s.sampling_params, len(rows) - 1, s))
                sampling.extend((fork_id, params, len(rows) - 1, s) for fork_id, params in s.forks)
        if not rows:
            return output
        with row_split(self._logits_split(seqs)):
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
        logits = logits.float().cpu()  # [num_rows, vocab_size]
        if len(sampling) > len(rows):  # forked samples reuse their parent's row
            logits = logits[torch.tensor([row for _, _, row, _ in sampling])]
        ids, params = [rid for rid, *_ in sampling], [p for _, p, _, _ in sampling]
        logits, failed = self.structured_output.mask_logits(logits, ids, params)  # grammar: -inf where not allowed
        out = sample_batch(logits, self._sampling_metadata(sampling, logits.shape[-1]))
        output.failed = self.structured_output.accept_tokens(ids, params, out.token_ids, failed)
        if output.failed:  # the engine fails such a sample's whole group: its forks' matchers go now
            self.structured_output.free([fork_id for s in seqs if s.forks and any(
                i in output.failed for i in [s.request_id] + [f for f, _ in s.forks]) for fork_id, _ in s.forks])
        output.sampled_token_ids = dict(zip(ids, out.token_ids))
        output.logprobs = {rid: lp for rid, lp in zip(ids, out.logprobs) if lp is not None}
        return output

    def _attention_metadata(self, seqs: list[ScheduledSeq]):
        """The step's attention metadata and positions (shape = [num_tokens] int64).

        One ``AttentionMetadata`` over ``block_ids`` (with ``sliding`` for a model with a window),
        or, for a model with ``uses_kv_cache_groups``, a ``GroupedAttentionMetadata``: per group, the
        metadata over that group's tables, a sliding group's masked to its window (its released
        blocks, block 0 in the tables, lie before every window and are never read).
        """
        options = dict(
            batch_invariant=self.model.batch_invariant,  # batch-invariant linear layers: attention too
            dtype=self.kv_caches[0].dtype,
            num_pool_blocks=self.kv_caches[0].shape[1],
            # int4: generated tokens (their blocks keyed apart) run through layers.decode_layers
            num_prompt_tokens=([s.num_prompt_tokens for s in seqs] if self.model.quantization in INT4_DECODER_FORMATS
                               and not getattr(self.model, "splits_generated_rows", False) else None),
            paged_kernel=self.model.paged_attention,
        )
        if not self.uses_kv_cache_groups:
            return build_attention_metadata([(s.num_computed_tokens, len(s.token_ids), s.block_ids) for s in seqs],
                                            self.block_size, self.device, sliding_window=self.sliding_window, **options)

        def seqs_of_group(g: int) -> list[tuple[int, int, list[int]]]:
            return [(s.num_computed_tokens, len(s.token_ids),
                     s.block_ids if s.group_block_ids is None else s.group_block_ids[g]) for s in seqs]

        return build_grouped_attention_metadata(self.kv_cache_groups, seqs_of_group, self.block_size, self.device,
                                                **options)

    def _token_split(self, seqs: list[ScheduledSeq]) -> RowSplit | None:
        """For an int4 model with ``splits_generated_rows`` (Gemma 3), the step's token rows split as
        the logits rows are: a generated token's (position >= its prompt length) on the 4-bit copies."""
        if self.model.quantization not in INT4_DECODER_FORMATS or not getattr(self.model, "splits_generated_rows", False):
            return None
        generated = torch.tensor([s.num_computed_tokens + i >= s.num_prompt_tokens
                                  for s in seqs for i in range(len(s.token_ids))])  # [num_tokens] bool
        return RowSplit(int4_rows=generated.nonzero().flatten().to(self.device),
                        dense_rows=(~generated).nonzero().flatten().to(self.device))

    def _logits_split(self, seqs: list[ScheduledSeq]) -> RowSplit | None:
        """For an int4 model, the logits rows (each sampling sequence's last new token, in order) split
        like the forward pass's: a generated token's row (position >= the prompt length) on the
        8-bit lm_head, a prompt's last token on the bf16 one."""
        if self.model.quantization not in INT4_DECODER_FORMATS:
            return None
        generated = torch.tensor([s.num_computed_tokens + len(s.token_ids) > s.num_prompt_tokens
                                  for s in seqs if s.sampling_params is not None])  # [num_rows] bool
        return RowSplit(int4_rows=generated.nonzero().flatten().to(self.device),
                        dense_rows=(~generated).nonzero().flatten().to(self.device))

    def _sampling_metadata(self, sampling: list[SamplingRow], vocab_size: int) -> SamplingMetadata:
        """The step's sampling rows as the sampler takes them; penalty rows' histories brought up
        to date (O(new tokens) each, see :mod:`prefixcache.runner.token_history`)."""
        metadata = SamplingMetadata(
            params=[p for _, p, _, _ in sampling],
            generators=[self._generator(rid, p) for rid, p, _, _ in sampling],
            # A fork samples in its parent's first sampling step: nothing generated yet by either.
            num_output_tokens=[len(s.output_token_ids or ()) for *_, s in sampling],
            eos_token_ids=self.eos_token_ids,
            history_rows=[-1] * len(sampling),
        )
        histories = []
        for i, (rid, params, _, s) in enumerate(sampling):
            if params.has_penalties:
                metadata.history_rows[i] = len(histories)
                histories.append(self._histories.get(rid, s.prompt_token_ids or [], s.output_token_ids or [], vocab_size))
        if histories:
            metadata.prompt_mask = torch.stack([h.prompt_mask for h in histories])  # [num_history_rows, vocab_size]
            metadata.output_counts = torch.stack([h.output_counts for h in histories])
        return metadata

    def write_blocks(self, load_ops: list[LoadOp]) -> None:
        """Writes K/V loaded from a KV tier into pool blocks (all layers, all slots).

        Args:
            load_ops: each a block id and its payload, ``shape = [num_layers, 2, block_size,
                num_kv_heads, head_dim]`` in the pool's dtype (see :class:`LoadOp`).
        """
        data = bytearray().join(op.payload for op in load_ops)  # one writable host buffer
        kv0 = self.kv_caches[0]
        blocks = torch.frombuffer(data, dtype=kv0.dtype).view(
            len(load_ops), len(self.kv_caches), 2, *kv0.shape[2:])  # [n, layers, 2, block_size, kv_heads, head_dim]
        blocks = blocks.to(self.device, non_blocking=False)
        ids = torch.tensor([op.block_id for op in load_ops], device=self.device)
        for layer, kv_cache in enumerate(self.kv_caches):  # [2, num_blocks, block_size, kv_heads, head_dim]
            kv_cache[:, ids] = blocks[:, layer].transpose(0, 1)

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Copies blocks' K/V out of the pool (for a KV tier), in :class:`LoadOp`'s payload layout.

        Returns:
            One bytes object per block, ``shape = [num_layers, 2, block_size, num_kv_heads,
            head_dim]`` in the pool's dtype, C order; later steps can't change them.
        """
        if not block_ids:
            return []
        ids = torch.tensor(block_ids, device=self.device)
        blocks = torch.stack([kv[:, ids] for kv in self.kv_caches], dim=1)  # [2, layers, n, block_size, ...]
        blocks = blocks.permute(2, 1, 0, 3, 4, 5).contiguous().cpu()  # [n, layers, 2, block_size, kv_heads, head_dim]
        flat = blocks.view(torch.uint8).view(len(block_ids), -1).numpy()
        return [row.tobytes() for row in flat]

    def _prompt_logprobs_chunk(self, hidden: torch.Tensor, s: ScheduledSeq) -> PromptLogprobsChunk:
        """Prompt logprobs of the tokens a chunk's positions predict (see ``prefixcache.prompt_logprobs``).

        Args:
            hidden: shape = [len(s.token_ids), hidden_size], the chunk's final hidden states.
            s: the chunk, with ``prompt_logprobs`` set.
        """
        work, start, bs = s.prompt_logprobs, s.num_computed_tokens, self.block_size
        num_rows = max(0, min(start + len(s.token_ids), s.num_prompt_tokens - 1) - start)  # positions
        # predicting a prompt token: position p predicts token p + 1
        rows, targets = hidden[:num_rows], s.token_ids[1 : num_rows + 1]
        if len(targets) < num_rows:
            targets = targets + [work.next_token_id]
        first = start + 1
        if work.prev_hidden is not None:  # the chunk's first token, predicted by the last cached position
            rows = torch.cat([work.prev_hidden[None].to(hidden.dtype), rows])
            targets, first = [s.token_ids[0]] + targets, start
        targets_t = torch.tensor(targets, dtype=torch.int64)
        parts = []
        for i in range(0, rows.shape[0], PROMPT_LOGITS_ROWS):
            logprobs = self.model.compute_logits(rows[i : i + PROMPT_LOGITS_ROWS]).float().cpu().log_softmax(-1)
            chosen = logprobs.gather(1, targets_t[i : i + PROMPT_LOGITS_ROWS, None])  # [n, 1]
            top = logprobs.topk(PROMPT_LOGPROBS_TOPK, dim=-1)
            parts.append((chosen[:, 0], (logprobs >= chosen).sum(-1), top.indices, top.values))  # rank: vLLM's, ties worse
        if parts:
            chosen, ranks, top_ids, top_values = (torch.cat(x) for x in zip(*parts))
        else:  # a chunk of the prompt's last token only, nothing before it to predict
            chosen, ranks = torch.zeros(0), torch.zeros(0, dtype=torch.int64)
            top_ids, top_values = torch.zeros(0, PROMPT_LOGPROBS_TOPK, dtype=torch.int64), torch.zeros(0, PROMPT_LOGPROBS_TOPK)
        block_hidden = {
            p // bs: hidden[p - start].clone()
            for p in range(start, min(start + len(s.token_ids), s.num_prompt_tokens)) if (p + 1) % bs == 0
        }
        return PromptLogprobsChunk(first, chosen, ranks, top_ids, top_values, block_hidden)

    def _generator(self, request_id: str, params) -> torch.Generator:
        if params.seed is None:
            return self._default_generator
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator(device="cpu").manual_seed(generator_seed(params.seed))
        return gen


def generator_seed(seed: int) -> int:
    """A request's 64-bit seed mixed into the 32 bits torch's CPU generator uses (mt19937 keeps only
    the low 32 bits, so seeds 0 and 2**32 would draw the same samples): splitmix64's finalizer,
    then the high and low halves folded together.

    Args:
        seed: in ``[-2**63, 2**64)``.
    """
    z = (seed & 0xFFFF_FFFF_FFFF_FFFF) + 0x9E37_79B9_7F4A_7C15 & 0xFFFF_FFFF_FFFF_FFFF
    z = (z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9 & 0xFFFF_FFFF_FFFF_FFFF
    z = (z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB & 0xFFFF_FFFF_FFFF_FFFF
    z ^= z >> 31
    return (z ^ (z >> 32)) & 0xFFFF_FFFF
