"""Gemma 3 text decoder (``Gemma3ForCausalLM``) reading and writing K/V in the paged pool.

What differs from the Llama family (:mod:`prefixcache.models.llama`), all following transformers'
``modeling_gemma3.py`` op for op so that float32 logits agree with it to float rounding:

- layers of two kinds, ``config.layer_types``: local ("sliding_attention", 5 of every 6 in the
  released checkpoints) attend to the last ``sliding_window`` positions only, the query's own
  included (the metadata's ``sliding`` part, :func:`~prefixcache.layers.attention.metadata.build_attention_metadata`);
  global ("full_attention") ones to the whole context. Each kind has its own RoPE base
  (``rope_local_theta`` and ``rope_theta``).
- Gemma's RMSNorm, ``x_normed * (1 + weight)`` in float32 (:class:`~prefixcache.layers.norm.RMSNorm`
  with ``unit_offset``), on q and k per head before RoPE, and four per layer: before and after
  attention, before and after the MLP.
- GeGLU MLP, ``down(gelu_tanh(gate(x)) * up(x))``.
- the embedding multiplied by sqrt(hidden_size) rounded to the weight dtype (as transformers'
  ``Gemma3TextScaledWordEmbedding`` does), the attention scale ``query_pre_attn_scalar ** -0.5``,
  and the final logits soft-capped when ``final_logit_softcapping`` is set.

KV-cache groups (``uses_kv_cache_groups``, :mod:`prefixcache.cache.kv_cache_groups`): the engine cuts
the layers into a full-attention group and sliding groups, each with its own block tables, and hands
the model a :class:`~prefixcache.layers.grouped_attention.GroupedAttentionMetadata`; a local layer's
table keeps only the blocks its window reaches (released ones are block 0, never read). Given one
:class:`~prefixcache.layers.attention.metadata.AttentionMetadata` instead (built with ``sliding_window``), every
layer reads the one block table and the window is a mask over it (the one-group path tests use).

Weight formats: the projections and the lm_head run through :mod:`prefixcache.layers.linear`'s methods
as the Llama family's do (:class:`~prefixcache.layers.linear.StackedLinear` groups q|k|v, o, gate|up,
down, lm_head; :func:`~prefixcache.layers.linear.linear_method` picks the method from the dtype, the
quantization and the CPU): float32 ``"none"`` and ``"int8"``; bfloat16 ``"none"``, ``"int8"``,
``"int4"`` and ``"int4-int8"``. gate|up is a plain stacked product (never the AMX kernel's fused
SiLU: Gemma's gate takes gelu-tanh). The norms, the residual stream's adds and the soft-cap keep
their transformers form (the norms in float32 inside, :class:`~prefixcache.layers.norm.RMSNorm`).

Generated tokens of the int4 formats (the runner's :class:`~prefixcache.layers.quant.RowSplit` over
the step's token rows, :attr:`Gemma3ForCausalLM.splits_generated_rows`) run the same torch layers
with each projection on its 4-bit copy (``int4_mm``) and their logits on the 8-bit lm_head (Q8_0, as
the Llama family's); prompt rows keep the prompt method's products. Not the Llama family's C++ decoder
(:mod:`prefixcache.layers.decode_layers`), which knows neither the local layers' window and their KV-cache
groups, nor GeGLU, the unit-offset norms or the post-norms. A token's rows are chosen by what the token
is (position >= its prompt length), never by its batch, and each kernel is row-invariant.

Batch-invariant in every format: float32's products run as GEMM calls of exactly
:data:`~prefixcache.layers.linear.FIXED_ROW_TILE` rows (:class:`~prefixcache.layers.linear.FixedTileLinear`,
the dense method calls the modules), bf16's as the prepacked (AMX) or row-tiled products, int8's and
int4's with exact integer sums; attention runs torch's kernels over the pool (float32 or bf16, the
model's dtype) padded as ``prefixcache.layers.attention`` says for a batch-invariant model. No LoRA
(refused when a request or the server names an adapter).

Parameter names equal the HF checkpoint names (``model.layers.N.self_attn.q_norm.weight``, ...).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prefixcache.layers.attention.attention_dtype import PagedAttentionModel
from prefixcache.layers.attention.metadata import AttentionMetadata, torch_attention_batch_invariant
from prefixcache.layers.attention.torch_attention import Attention
from prefixcache.layers.grouped_attention import GroupedAttentionMetadata
from prefixcache.layers.linear import (DENSE, FixedTileLinear, LinearMethod, StackedLinear, StackedLinearModel,
                                      linear_method)
from prefixcache.layers.norm import RMSNorm
from prefixcache.layers.quant import group_int8_linear, int4_linear, split_rows
from prefixcache.layers.rotary import RotaryEmbedding, apply_rotary_emb
from prefixcache.models.config import ModelConfig

SLIDING = "sliding_attention"  # layer_types' name of a local (windowed) layer
DTYPES = (torch.float32, torch.bfloat16)  # weight dtypes whose products are batch-invariant (see the module docstring)


def project(group: StackedLinear, x: torch.Tensor) -> torch.Tensor:
    """``group``'s stacked product, [num_tokens, sum(sizes)] in x's dtype: the running
    :class:`~prefixcache.layers.quant.RowSplit`'s int4 rows (generated tokens) on the group's 4-bit
    copy where it holds one (int4 formats), every other row on the prompt method's product."""
    if group.decode_weight is None:
        return group(x)
    return split_rows(x, group, lambda rows: int4_linear(rows, group.decode_weight))


class Gemma3Attention(nn.Module):
    """Projections, per-head q/k norm, RoPE and paged attention of one layer."""

    def __init__(self, config: ModelConfig, is_sliding: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.is_sliding = is_sliding
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = FixedTileLinear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = FixedTileLinear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = FixedTileLinear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = FixedTileLinear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, unit_offset=True)
        scalar = config.query_pre_attn_scalar or config.head_dim
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=scalar**-0.5)
        self.qkv = StackedLinear([self.q_proj, self.k_proj, self.v_proj])  # q|k|v: one product where the method stacks
        self.o = StackedLinear([self.o_proj])

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        """Args: x shape = [num_tokens, hidden_size]; cos_sin each [num_tokens, 1, head_dim] (this
        layer kind's RoPE); md the metadata of this layer kind. Returns: [num_tokens, hidden_size]."""
        num_tokens = x.shape[0]
        q, k, v = project(self.qkv, x).split(self.qkv.sizes, dim=-1)  # column slices of [T, (heads + 2 kv) * hd]
        q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))  # [T, heads, hd]
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))  # [T, kv_heads, hd]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, kv_heads, hd]
        cos, sin = cos_sin
        q = apply_rotary_emb(q, cos, sin)
        k = apply_rotary_emb(k, cos, sin)
        return project(self.o, self.attn(q, k, v, kv_cache, md))  # attn: [T, heads * hd]


class Gemma3MLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = FixedTileLinear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = FixedTileLinear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = FixedTileLinear(config.intermediate_size, config.hidden_size, bias=False)
        # gate_up=False: [gate; up] stacked as is, never interleaved for the AMX kernel's fused SiLU
        self.gate_up = StackedLinear([self.gate_proj, self.up_proj], gate_up=False)
        self.down = StackedLinear([self.down_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x shape = [num_tokens, hidden_size]. Returns: the same shape."""
        gate, up = project(self.gate_up, x).split(self.gate_up.sizes, dim=-1)  # each [T, intermediate]
        return project(self.down, F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    """Attention then MLP, each between a pre- and a post-norm, each with a residual add."""

    def __init__(self, config: ModelConfig, is_sliding: bool) -> None:
        super().__init__()
        self.is_sliding = is_sliding
        self.self_attn = Gemma3Attention(config, is_sliding)
        self.mlp = Gemma3MLP(config)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps=eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps=eps, unit_offset=True)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        """Args: x shape = [num_tokens, hidden_size]. Returns: the same shape."""
        attn = self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, md)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    """Scaled embedding, decoder layers and final norm (``model.*`` in the checkpoint)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        kinds = config.layer_types or ("full_attention",) * config.num_hidden_layers
        self.layers = nn.ModuleList([Gemma3DecoderLayer(config, kind == SLIDING) for kind in kinds])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, unit_offset=True)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, None)
        self.rotary_emb_local = RotaryEmbedding(config.head_dim, config.rope_local_theta or config.rope_theta, None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                md: AttentionMetadata | GroupedAttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """See :meth:`Gemma3ForCausalLM.forward`."""
        grouped = isinstance(md, GroupedAttentionMetadata)
        if not grouped and md.sliding is None and any(layer.is_sliding for layer in self.layers):
            raise RuntimeError("Gemma 3's local layers need the window's metadata: build_attention_metadata("
                               "..., sliding_window=config.sliding_window)")
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        # sqrt(hidden) rounded to the weight dtype first, as transformers' Gemma3TextScaledWordEmbedding
        hidden = hidden * torch.tensor(self.hidden_size**0.5, dtype=hidden.dtype)
        cos_sin_global = self.rotary_emb(positions, hidden.dtype)  # once per step, shared by the layers of a kind
        cos_sin_local = self.rotary_emb_local(positions, hidden.dtype)
        if not grouped and len(kv_caches) != len(self.layers):
            raise ValueError(f"one-group metadata needs one pool tensor per layer ({len(self.layers)}), "
                             f"got {len(kv_caches)}")
        for i, layer in enumerate(self.layers):
            cos_sin = cos_sin_local if layer.is_sliding else cos_sin_global
            if grouped:  # the layer's group's tables (its window's metadata for a local layer)
                layer_md, kv_cache = md.for_layer(i, kv_caches)
            else:
                layer_md, kv_cache = (md.sliding if layer.is_sliding else md), kv_caches[i]
            hidden = layer(hidden, cos_sin, kv_cache, layer_md)
        return self.norm(hidden)


class Gemma3ForCausalLM(StackedLinearModel, PagedAttentionModel, nn.Module):
    """Causal LM for Gemma 3 text checkpoints (the weight formats of the module docstring, no LoRA).

    Class attributes: ``uses_kv_cache_groups`` (the runner passes per-group metadata, local layers
    keep only their window's blocks), ``supports_lora`` False (the engine refuses adapters, naming
    ``lora``), ``splits_generated_rows`` (under an int4 format the runner sets a
    :class:`~prefixcache.layers.quant.RowSplit` of the step's token rows around the forward pass and
    builds no ``generated`` metadata: generated rows run these layers, not the C++ decoder).

    Args:
        config: The parsed model config (``ModelConfig._from_gemma3``). With ``tie_word_embeddings``
            (every Gemma 3), ``lm_head.weight`` is the embedding parameter itself (call
            ``tie_weights()`` again after replacing parameters, e.g. ``to_empty``).
    """

    uses_kv_cache_groups = True
    supports_lora = False
    splits_generated_rows = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Gemma3Model(config)
        self.lm_head = FixedTileLinear(config.hidden_size, config.vocab_size, bias=False)
        self.head = StackedLinear([self.lm_head], logits=True)
        self.quantization = "none"
        self.linear_method: LinearMethod = DENSE  # set by quantize, from the dtype, quantization and CPU
        self.calibration_ids: list[int] | None = None  # set by the loader; unused (int8 takes no smoothing here)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Makes lm_head share the embedding weight when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def quantize(self, scheme: str) -> None:
        """Derives the forward pass's weights from the float ones (the loader calls this after casting
        them; call again after they change): ``"none"`` (the float weights: float32 in
        :class:`~prefixcache.layers.linear.FixedTileLinear` calls, bf16 prepacked), ``"int8"`` (W8A8 for
        every projection and the lm_head, the plain per-channel rule: no SmoothQuant calibration),
        ``"int4"`` / ``"int4-int8"`` (bfloat16 only: generated rows' projections on 4-bit copies and
        their logits on the 8-bit lm_head; prompt rows bf16 / int8). The embedding stays float.

        Raises:
            ValueError: naming ``dtype`` (anything but float32 or bfloat16: float16's products are not
                known to be batch-invariant) or ``quantization`` (an unknown scheme, int4 without bf16).
            RuntimeError: the float weights were released (:meth:`release_float_weights`) and not loaded again.
            CpuKernelsUnavailable: int4 where its kernels can't be built or run.
        """
        dtype = self.lm_head.weight.dtype
        if dtype not in DTYPES:
            raise ValueError(f"dtype {str(dtype).removeprefix('torch.')!r} is not supported for Gemma3ForCausalLM; "
                             "use dtype='float32' or 'bfloat16'")
        self.check_float_weights_loaded(scheme)
        try:
            method = linear_method(dtype, scheme)
        except ValueError as e:
            raise ValueError(f"quantization {scheme!r} is not supported for Gemma3ForCausalLM here: {e}") from e
        self.apply_linear_method(method)
        self.quantization = scheme

    def linear_groups(self) -> list[StackedLinear]:
        """Every linear product, in a fixed order: per layer q|k|v, o, gate|up, down; then lm_head."""
        groups = [g for layer in self.model.layers
                  for g in (layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up, layer.mlp.down)]
        return groups + [self.head]

    @property
    def quantization_key(self) -> str:
        """What the forward pass's weights and rows depend on beyond the float weights and the format's
        name, for the cache key: "" for ``"none"``; the int8 rule (plain per-channel, not the Llama
        family's smoothing); for int4 the generated rows' rule (these layers on 4-bit copies, not the
        C++ decoder). The window's rule is in :attr:`numerics_key`."""
        parts = []
        if self.quantization in ("int8", "int4-int8"):
            parts.append("int8-plain")
        if self.quantization in ("int4", "int4-int8"):
            parts.append("int4-rows:torch-layers-int4-mm|lm_head=q8_0")
        return "|".join(parts)

    @property
    def numerics_key(self) -> str:
        """What K/V depends on beyond the weights' files, the dtype and the attention path, in the cache
        key's model part (``InputProcessor.model_key``): the local layers' attention rule.

        The window changes which keys a local layer reads, not how a K/V row is computed from its
        layer's input. But that input, at every layer after the first local one, is the output of
        earlier layers' attention, which read the window: so K/V of layer >= 1 at position ``p``
        depends on the window size and on its convention (keys ``p - window + 1 .. p``, the query
        itself included: transformers' ``sliding_window_overlay``), and cached K/V computed under
        another window or convention must never be served. The weights' fingerprint covers
        config.json (hence ``sliding_window`` and ``layer_types`` as read from the files); the key
        names the value the forward pass actually runs with and the convention, which code, not the
        files, decides.
        """
        cfg = self.config
        kinds = ",".join("L" if kind == SLIDING else "G" for kind in (cfg.layer_types or ()))
        return f"sliding_window={cfg.sliding_window}|keys=p-w+1..p|layers={kinds}"

    @property
    def batch_invariant(self) -> bool:
        """True: every product is row-invariant in its format (float32 in calls of one fixed row count,
        :class:`~prefixcache.layers.linear.FixedTileLinear`; bf16 prepacked or row-tiled; int8 and
        int4 exact integer sums), the rest is row-wise, and the attention metadata pads as
        ``prefixcache.layers.attention`` says for a batch-invariant model; a token's logits have the
        same bits alone and in any batch."""
        return True

    @property
    def paged_attention(self) -> bool:
        """Whether attention runs our paged kernel (:mod:`prefixcache.kernels.prefill_attention`): where torch's
        padded flash path is not batch-invariant (MKL's AVX2 path, an AVX2-only CPU:
        :func:`torch_attention_batch_invariant`) or ``attention_dtype="int8"`` asks for the kernel's int8
        products, and a form for its pool's dtype with a sliding window runs (the kernel's AVX2 form). Elsewhere
        torch's flash kernel with the padding of :mod:`prefixcache.layers.attention`, batch-invariant there and
        the faster on AVX-512 CPUs for a window (``benchmarks/prefill_attention.py --window 512``). The cache key
        names the forms (``attention.numerics.kv_numerics``)."""
        return ((self.attention_dtype == "int8" or not torch_attention_batch_invariant())
                and self._kernel_supported(windowed=self.has_sliding_layers) and self._kernel_supported())

    @property
    def has_sliding_layers(self) -> bool:
        return any(layer.is_sliding for layer in self.model.layers)

    @property
    def fuses_prompt_ops(self) -> bool:
        """False: its element-wise ops stay torch's."""
        return False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_caches: list[torch.Tensor], lora: object | None = None) -> torch.Tensor:
        """Runs the new tokens of a batch through the decoder, writing their K/V into the pool.

        Args:
            input_ids: int64, shape = [num_tokens].
            positions: int64, shape = [num_tokens] (from ``build_attention_metadata``).
            attn_metadata: The step's metadata: per KV-cache group (``GroupedAttentionMetadata``, the
                runner's), or one built with ``sliding_window=config.sliding_window`` (its ``sliding``
                part serves the local layers).
            kv_caches: The pool's tensors, each shape = [2, num_blocks, block_size, num_kv_heads,
                head_dim]: ``layers_per_group`` of them with grouped metadata, one per layer without.
            lora: must be None (no LoRA for this model).

        Returns:
            Final hidden states, shape = [num_tokens, hidden_size].

        Raises:
            RuntimeError: a LoRA batch, or one-group metadata without its ``sliding`` part.
            ValueError: one-group metadata with a pool tensor count other than the layers'.
        """
        if lora is not None:
            raise RuntimeError("Gemma3ForCausalLM runs no LoRA adapter")
        return self.model(input_ids, positions, attn_metadata, kv_caches)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Args: hidden_states shape = [n, hidden_size]. Returns: float32 logits, shape = [n, vocab_size],
        soft-capped (``cap * tanh(logits / cap)``) when the config sets ``final_logit_softcapping``.

        int4 formats: rows of generated tokens (the running :class:`~prefixcache.layers.quant.RowSplit`,
        which the runner sets for the logits rows) on the Q8_0 lm_head, the others on the prompt method's."""
        if self.head.decode_weight is None:
            logits = self.head(hidden_states, out_dtype=torch.float32)  # row-invariant: the same bits in any batch
        else:
            logits = split_rows(hidden_states, lambda rows: self.head(rows, out_dtype=torch.float32),
                                lambda rows: group_int8_linear(rows, self.head.decode_weight, torch.float32))
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
