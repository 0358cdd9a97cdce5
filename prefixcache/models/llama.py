"""Llama-family decoder (Llama, Qwen2, Qwen3) reading and writing K/V in the paged pool.

One class serves the family; the differences come from `ModelConfig`: q/k/v bias (Qwen2), o_proj bias,
per-head q/k RMSNorm before RoPE (Qwen3), head_dim != hidden_size / num_heads (Qwen3), tied lm_head.
Parameter names equal the HF checkpoint names (`model.layers.N.self_attn.q_proj.weight`, ...), so
safetensors load straight in. The op order follows transformers' modeling code, so fp32 logits agree
with it to float rounding.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn

from prefixcache.config import W8A8_FORMATS
from prefixcache.kernels.prefill_attention import paged_prefill_attention
from prefixcache.layers.attention.attention_dtype import PagedAttentionModel
from prefixcache.kernels.prompt_ops import add_rms_norm, rope_write_kv, silu_mul
from prefixcache.layers.attention.metadata import (AttentionMetadata, build_attention_metadata,
                                                   torch_attention_batch_invariant)
from prefixcache.layers.attention.torch_attention import Attention
from prefixcache.layers.decode_layers import DecodeLayers, DecoderLayerWeights
from prefixcache.layers.linear import DENSE, LinearMethod, StackedLinear, StackedLinearModel, linear_method
from prefixcache.layers.lora import LoRABatch, LoRALinear
from prefixcache.layers.norm import RMSNorm
from prefixcache.layers.quant import SMOOTH_ALPHA, Int8Weight, group_int8_linear, recording_activation_amax, split_rows
from prefixcache.layers.rotary import RotaryEmbedding, apply_rotary_emb
from prefixcache.models.config import ModelConfig

CALIBRATION_LENGTH = 256  # tokens of the int8 smoothing's calibration prefill when no text is given


class LlamaAttention(nn.Module):
    """Projections, optional q/k norm, RoPE and paged attention of one layer."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = LoRALinear(hidden, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = LoRALinear(hidden, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = LoRALinear(hidden, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = LoRALinear(self.num_heads * self.head_dim, hidden, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = None
            self.k_norm = None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5)
        self.qkv = StackedLinear([self.q_proj, self.k_proj, self.v_proj])  # q|k|v: one product where the method stacks
        self.o = StackedLinear([self.o_proj])

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Args: hidden_states shape = [num_tokens, hidden_size]; cos_sin each [num_tokens, 1, head_dim].

        Returns:
            shape = [num_tokens, hidden_size].
        """
        return self.o(self._attend(hidden_states, cos_sin, kv_cache, attn_metadata, lora), lora)

    def forward_fused(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                      md: AttentionMetadata, lora: LoRABatch | None) -> list[torch.Tensor]:
        """:meth:`forward` on the paged kernel with :mod:`prefixcache.kernels.prompt_ops`: RoPE and the
        K/V write in one pass over the q|k|v product's row tiles (the same bits as the torch ops: LoRA
        and Qwen3's q/k norm keep them). Returns o_proj's row tiles, [num_tokens, hidden_size] in all."""
        qkv = self.qkv.stacked_tiles(x) if lora is None and self.q_norm is None else None
        if qkv is None:
            out = self._attend(x, cos_sin, kv_cache, md, lora)
        else:
            q = rope_write_kv(qkv, *cos_sin, kv_cache, md.slot_mapping, self.num_heads, self.num_kv_heads)
            out = paged_prefill_attention(q, kv_cache, md.paged, self.attn.scale, self.attn.kernel_form).view(x.shape[0], -1)
        return self.o.tiles(out, lora)

    def _attend(self, hidden_states: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata, lora: LoRABatch | None) -> torch.Tensor:
        """Projections, RoPE, K/V write and attention: [num_tokens, heads * head_dim]."""
        num_tokens, heads, kv_heads, hd = hidden_states.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = cos_sin
        qkv = self.qkv.stacked(hidden_states)  # [T, (heads + 2 kv_heads) * hd], or None: q, k, v one by one
        if qkv is not None and lora is None and self.q_norm is None:
            # q and k are adjacent columns of the fused product: RoPE over both in one call (element-wise,
            # the same bits as two calls)
            qk = apply_rotary_emb(qkv[:, : (heads + kv_heads) * hd].view(num_tokens, heads + kv_heads, hd), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]  # [T, heads, hd], [T, kv_heads, hd]
            v = qkv[:, (heads + kv_heads) * hd :].view(num_tokens, kv_heads, hd)  # [T, kv_heads, hd]
        else:
            q, k, v = self.qkv.split(hidden_states, lora, qkv)
            q = q.view(num_tokens, heads, hd)  # [T, heads, hd]
            k = k.view(num_tokens, kv_heads, hd)  # [T, kv_heads, hd]
            v = v.view(num_tokens, kv_heads, hd)  # [T, kv_heads, hd]
            if self.q_norm is not None:
                q = self.q_norm(q)
                k = self.k_norm(k)
            q = apply_rotary_emb(q, cos, sin)
            k = apply_rotary_emb(k, cos, sin)
        return self.attn(q, k, v, kv_cache, attn_metadata)  # [T, heads * head_dim]


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = LoRALinear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = LoRALinear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = LoRALinear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.gate_up = StackedLinear([self.gate_proj, self.up_proj], gate_up=True)
        self.down = StackedLinear([self.down_proj])

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        """Args: x shape = [num_tokens, hidden_size]. Returns: shape = [num_tokens, hidden_size]."""
        gate, up = self.gate_up.split(x, lora)
        return self.down(F.silu(gate) * up, lora)

    def forward_fused(self, x: torch.Tensor, lora: LoRABatch | None) -> list[torch.Tensor]:
        """:meth:`forward` with :func:`~prefixcache.kernels.prompt_ops.silu_mul` over gate|up's row
        tiles (or silu(gate) * up fused into the product where the linear method can). Returns
        down_proj's row tiles, [num_tokens, hidden_size] in all."""
        act = self.gate_up.silu_linear(x) if lora is None else None  # the bits of silu_mul on its product
        if act is None:
            act = silu_mul(self.gate_up.tiles(x, lora))
        return self.down.tiles(act, lora)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block, each with a residual add."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Args: hidden_states shape = [num_tokens, hidden_size]. Returns: the same shape."""
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), cos_sin, kv_cache, attn_metadata, lora)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states), lora)
        return residual + hidden_states

    def forward_fused(self, x: list[torch.Tensor], residual: torch.Tensor | None,
                      cos_sin: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor, md: AttentionMetadata,
                      lora: LoRABatch | None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """:meth:`forward` with :mod:`prefixcache.kernels.prompt_ops`: takes the previous layer's MLP
        output as row tiles (the embedding for the first layer) and the residual stream before its
        add (None for the first layer); returns its own (the add is the next layer's, or the final norm's)."""
        normed, residual = add_rms_norm(x, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        attn = self.self_attn.forward_fused(normed, cos_sin, kv_cache, md, lora)
        normed, residual = add_rms_norm(attn, residual, self.post_attention_layernorm.weight,
                                        self.post_attention_layernorm.eps)
        return self.mlp.forward_fused(normed, lora), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (`model.*` in the checkpoint)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.decode_layers: DecodeLayers | None = None  # quantization int4(-int8): generated rows' layers
        # layers' forward_fused (prompt_ops) in every step of a bf16 model whose metadata runs the paged kernel
        # (md.paged), which the cache key names with them (attention.numerics.kv_numerics); False only in A/B runs
        # (benchmarks/prompt_ops.py). Every extension that holds a form of the paged kernel (AVX-512, AVX2) also
        # builds the prompt ops, so where the kernel runs they do.
        self.fused_prompt_ops = True

    def build_decode_layers(self, config: ModelConfig) -> None:
        """The generated rows' decoder over the layers' int4 weights (quantization "int4", "int4-int8")."""
        layers = [DecoderLayerWeights(
            input_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
            q_norm=None if layer.self_attn.q_norm is None else layer.self_attn.q_norm.weight,
            k_norm=None if layer.self_attn.k_norm is None else layer.self_attn.k_norm.weight,
            qkv=layer.self_attn.qkv.decode_weight, o=layer.self_attn.o.decode_weight,
            gate_up=layer.mlp.gate_up.decode_weight, down=layer.mlp.down.decode_weight) for layer in self.layers]
        self.decode_layers = DecodeLayers(
            layers, self.norm.weight, self.rotary_emb.inv_freq, num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
            intermediate_size=config.intermediate_size, eps=config.rms_norm_eps, scale=config.head_dim**-0.5)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """See `LlamaForCausalLM.forward`."""
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        if attn_metadata.generated is not None:
            return self._forward_split(hidden_states, positions, attn_metadata, kv_caches, lora)
        cos_sin = self.rotary_emb(positions, hidden_states.dtype)  # computed once, shared by all layers
        if self.fused_prompt_ops and attn_metadata.paged is not None and hidden_states.dtype == torch.bfloat16:
            return self._run_fused(hidden_states, cos_sin, kv_caches, attn_metadata, lora)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states = layer(hidden_states, cos_sin, kv_cache, attn_metadata, lora)
        return self.norm(hidden_states)

    def _run_fused(self, hidden_states: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                   kv_caches: list[torch.Tensor], md: AttentionMetadata, lora: LoRABatch | None,
                   after_layer=None) -> torch.Tensor:
        """Every layer's ``forward_fused`` then the final norm; ``after_layer(i)`` runs after layer i."""
        x, residual = [hidden_states], None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer.forward_fused(x, residual, cos_sin, kv_cache, md, lora)
            if after_layer is not None:
                after_layer(i)
        return add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def _forward_split(self, hidden_states: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                       kv_caches: list[torch.Tensor], lora: LoRABatch | None) -> torch.Tensor:
        """quantization "int4" ("int4-int8"): the metadata's generated rows through :attr:`decode_layers`, the
        other rows (``md.dense_token_indices``, which the rest of ``md`` describes) through the torch
        layers, each layer's prompt rows first (a recomputed generated row reads its prompt's K/V)."""
        if self.decode_layers is None:
            raise RuntimeError("attention metadata with generated rows needs quantization 'int4' or 'int4-int8'")
        if lora is not None:
            raise RuntimeError("quantization 'int4' ('int4-int8') runs no LoRA adapter (refused when the request "
                               "is added)")
        gen, dense = md.generated, md.dense_token_indices
        num_tokens = hidden_states.shape[0]
        gen_hidden = (hidden_states if gen.token_indices.numel() == num_tokens
                      else hidden_states.index_select(0, gen.token_indices)).float().contiguous()  # [G, hidden]
        if dense is None or dense.numel() == 0:
            self.decode_layers.run(gen_hidden, gen, kv_caches)  # all layers in one call
            return self.decode_layers.final_norm(gen_hidden)
        dense_hidden = hidden_states.index_select(0, dense)  # [P, hidden]
        cos_sin = self.rotary_emb(positions.index_select(0, dense), hidden_states.dtype)
        if self.fused_prompt_ops and md.paged is not None and dense_hidden.dtype == torch.bfloat16:
            dense_hidden = self._run_fused(dense_hidden, cos_sin, kv_caches, md, None,
                                           lambda i: self.decode_layers.run(gen_hidden, gen, kv_caches, i, i + 1))
        else:
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                dense_hidden = layer(dense_hidden, cos_sin, kv_cache, md)
                self.decode_layers.run(gen_hidden, gen, kv_caches, i, i + 1)
            dense_hidden = self.norm(dense_hidden)
        out = hidden_states.new_empty(hidden_states.shape)  # [num_tokens, hidden]
        out.index_copy_(0, dense, dense_hidden)
        return out.index_copy_(0, gen.token_indices, self.decode_layers.final_norm(gen_hidden))


class LlamaForCausalLM(StackedLinearModel, PagedAttentionModel, nn.Module):
    """Causal LM for Llama, Qwen2 and Qwen3 checkpoints.

    Args:
        config: The parsed model config. With `tie_word_embeddings`, `lm_head.weight` is the embedding
            parameter itself (call `tie_weights()` again after replacing parameters, e.g. `to_empty`).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.head = StackedLinear([self.lm_head], logits=True)
        self.quantization = "none"
        self.linear_method: LinearMethod = DENSE  # set by quantize, from the dtype, quantization and CPU
        # int8, int4-int8: SmoothQuant's smoothing, calibrated by a prefill of calibration_ids (the loader sets
        # them from a fixed text; None: CALIBRATION_LENGTH fixed pseudo-random ids); False only in A/B probes
        self.int8_smoothing = True
        self.calibration_ids: list[int] | None = None
        self._int8_key = ""  # what the int8 weights were derived with (quantization_key)
        self.tie_weights()
        for name, module in self.named_modules():
            if isinstance(module, LoRALinear):
                module.module_name = name  # the key into LoRAAdapter.weights

    def tie_weights(self) -> None:
        """Makes lm_head share the embedding weight when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def quantize(self, scheme: str) -> None:
        """Derives the forward pass's weights from the float ones: ``"int8"`` (the W8A8 scheme of
        :mod:`prefixcache.layers.quant` for every projection and lm_head; the embedding stays
        float), ``"int4"`` (bfloat16 model: generated tokens run every layer in
        :class:`~prefixcache.layers.decode_layers.DecodeLayers`, projections on a 4-bit grid,
        and their logits rows on an 8-bit lm_head, both with int8 activations; prompt tokens'
        layers and logits bf16), ``"int4-int8"`` (int4's generated tokens, int8's prompt tokens) or
        ``"none"`` (the float weights). Call again after the float weights change.

        Raises:
            RuntimeError: the float weights were released (:meth:`release_float_weights`) and not
                loaded again (``LoadedModel.replace_weights`` restores and loads them).
            ValueError: an unknown scheme, or int4(-int8) on a model that is not bfloat16.
            CpuKernelsUnavailable: int4 where its kernels can't be built or run.
            RuntimeError: int4 on a model shape the generated rows' decoder can't run (see
                :class:`~prefixcache.layers.decode_layers.DecodeLayers`).
        """
        self.check_float_weights_loaded(scheme)
        method = linear_method(self.lm_head.weight.dtype, scheme)
        self.apply_linear_method(method)
        self.model.decode_layers = None
        if method.decodes:
            self.model.build_decode_layers(self.config)
        self.quantization = scheme
        self._int8_key = ""
        if method.smoothed and self.int8_smoothing:
            try:
                self._smooth_int8()
            except BaseException:  # no half-smoothed model under the unsmoothed key: back to the plain rule
                self._set_int8_weights()
                raise

    def linear_groups(self) -> list[StackedLinear]:
        """Every linear product, in a fixed order: per layer q|k|v, o, gate|up, down; then lm_head."""
        groups = [g for layer in self.model.layers
                  for g in (layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up, layer.mlp.down)]
        return groups + [self.head]

    @property
    def quantization_key(self) -> str:
        """What the quantized weights depend on beyond the float weights and the format's name (the
        smoothing's rule, strength and calibration tokens), for the cache key; "" when nothing."""
        return self._int8_key

    @property
    def numerics_key(self) -> str:
        """The model's own rules that decide K/V bits beyond the weights, the dtype, the quantization
        and the attention path (``InputProcessor.model_key``): "" (every layer attends to the whole
        context; an empty key leaves the cache key what it always was)."""
        return ""

    @torch.inference_mode()
    def _smooth_int8(self) -> None:
        """Re-derives the int8 weights with SmoothQuant's smoothing (:func:`~prefixcache.layers.quant.
        smooth_factors`): one prefill of the calibration tokens on the unsmoothed int8 weights records
        each int8 matrix's largest input per channel, from which each matrix and its input's multiplier
        are derived (q|k|v and gate|up, which share an input, share one). Deterministic: same weights
        and tokens, same bits."""
        cfg = self.config
        ids = [t for t in self.calibration_ids or () if 0 <= t < cfg.vocab_size][: cfg.max_position_embeddings]
        if not ids:  # no text, or a tokenizer whose ids the model lacks (indexing them would fail)
            gen = torch.Generator().manual_seed(0)
            ids = torch.randint(0, cfg.vocab_size, (min(CALIBRATION_LENGTH, cfg.max_position_embeddings),),
                                generator=gen).tolist()
        device, dtype = self.lm_head.weight.device, self.lm_head.weight.dtype
        block_size = 16
        num_blocks = -(-len(ids) // block_size) + 512 // block_size  # room for keys padded to a multiple of 512
        kv = [torch.zeros(2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=device)
              for _ in range(cfg.num_hidden_layers)]
        md, positions = build_attention_metadata([(0, len(ids), list(range(num_blocks)))], block_size, device,
                                                  batch_invariant=self.batch_invariant, dtype=dtype,
                                                  num_pool_blocks=num_blocks, paged_kernel=self.paged_attention)
        with recording_activation_amax() as amax:
            hidden = self(torch.tensor(ids, dtype=torch.long, device=device), positions, md, kv)
            self._dense_logits(hidden)
        self._set_int8_weights(amax)
        # the multipliers themselves: the calibration's float prefill may round by CPU (a float32 model's
        # GEMMs under another instruction set give other maxima, so other weights)
        digest = hashlib.sha256(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
        for weight in self._int8_weights():
            digest.update(b"-" if weight.act_mul is None else weight.act_mul.cpu().numpy().tobytes())
        self._int8_key = f"int8-smooth:sq-alpha={SMOOTH_ALPHA}-median-floor:{digest.hexdigest()[:32]}"

    def _set_int8_weights(self, act_amax: dict[int, torch.Tensor] | None = None) -> None:
        """Re-derives every int8 matrix from the float weights: smoothed by the calibration maxima
        ``act_amax`` (by ``id`` of the current int8 weights) where given, else the plain rule."""
        for group in self.linear_groups():
            self.linear_method.calibrate(group, act_amax)

    def _int8_weights(self) -> list[Int8Weight]:
        """Every int8 matrix, in a fixed order (per layer q|k|v, o, gate|up, down; then lm_head)."""
        return [self.linear_method.int8_weight(group) for group in self.linear_groups()]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Runs the new tokens of a batch through the decoder, writing their K/V into the pool.

        Args:
            input_ids: int64, shape = [num_tokens].
            positions: int64, shape = [num_tokens] (from `build_attention_metadata`).
            attn_metadata: The step's metadata (from `build_attention_metadata`).
            kv_caches: One pool tensor per layer, each
                shape = [2, num_blocks, block_size, num_kv_heads, head_dim].
            lora: per-request LoRA adapters by token range; None when no request uses one.

        Returns:
            Final hidden states, shape = [num_tokens, hidden_size].
        """
        return self.model(input_ids, positions, attn_metadata, kv_caches, lora)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Args: hidden_states shape = [n, hidden_size]. Returns: float32 logits, shape = [n, vocab_size].

        int4 (int4-int8): rows of generated tokens (the running :class:`~prefixcache.layers.quant.RowSplit`,
        which the runner sets for the logits rows) use the Q8_0 lm_head, the others (a prompt's last
        token, prompt logprobs) the bf16 (int8) one, as generated and prompt rows run different layers."""
        if self.head.decode_weight is None:
            return self._dense_logits(hidden_states)
        # int4: generated tokens' rows (the running RowSplit) on Q8_0's grid
        return split_rows(hidden_states, self._dense_logits,
                          lambda rows: group_int8_linear(rows, self.head.decode_weight, torch.float32))

    def _dense_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits of prompt rows (every row but int4's generated ones), float32 [n, vocab_size]."""
        return self.head(hidden_states, out_dtype=torch.float32)

    @property
    def batch_invariant(self) -> bool:
        """Whether a token's result has the same bits in any batch: the int8 format (exact integer
        GEMMs) and bfloat16 (its GEMMs run in calls of <= ROW_TILE rows, see
        :func:`~prefixcache.layers.linear.row_tiled_linear`, or on our AMX kernel, whose rows are
        independent by construction); the attention metadata then pads as
        ``prefixcache.layers.attention`` says. float32's GEMMs round by batch size (MKL), so it
        keeps the cheaper untiled calls and agrees with a batch only to float rounding."""
        return self.quantization in W8A8_FORMATS or self.lm_head.weight.dtype == torch.bfloat16  # int4 is bf16

    @property
    def paged_attention(self) -> bool:
        """Whether attention runs our paged kernel (:mod:`prefixcache.kernels.prefill_attention`): a
        batch-invariant model (bfloat16, int4, int8 over either dtype) whose head shape the kernel takes, on
        a CPU where a form for its pool's dtype runs (:func:`~prefixcache.kernels.prefill_attention.kernel_form`:
        AVX2 or AVX512-BF16 for bf16, AVX2 for float32); else torch's flash kernel with the padding of
        :mod:`prefixcache.layers.attention`. A float32 pool (float32 + int8) keeps torch's padded path where
        that is batch-invariant (MKL's AVX-512 path: :func:`torch_attention_batch_invariant`), which is the
        faster there on a cold prompt (``benchmarks/prefill_attention.py --dtype float32``), and takes the
        kernel where it isn't (AVX2-only CPUs); with ``attention_dtype="int8"`` it always takes the kernel (its
        AVX2 form's int8 products). The paths round differently, so the cache key names the one in use
        (``attention.numerics.kv_numerics``)."""
        dtype = self.lm_head.weight.dtype
        return (self.batch_invariant and self._kernel_supported()
                and (dtype == torch.bfloat16 or self.attention_dtype == "int8" or not torch_attention_batch_invariant()))

    @property
    def fuses_prompt_ops(self) -> bool:
        """Whether its prompt rows run :mod:`prefixcache.kernels.prompt_ops` around the paged kernel: a bf16
        model on the kernel (the ops are bf16 only)."""
        return self.paged_attention and self.model.fused_prompt_ops and self.lm_head.weight.dtype == torch.bfloat16
