"""The decoder layers of generated tokens (quantization ``"int4"``) in our C++ (``kernels/csrc/decode_layers.cpp``).

A step's generated rows (positions >= their request's prompt length, also when recomputed after a
preemption: :class:`~prefixcache.kernels.decode_attention.DecodeRows`) run every layer as one call:
RMSNorm, the q|k|v, o, gate|up and down products on Q4_1's grid (``int4_mm``), RoPE, the K/V write and
``paged_decode_attention``, SwiGLU and the residual adds, with the residual stream in float32 from the
embedding to the final norm. Prompt rows keep the torch layers (bf16 products, flash attention), layer by
layer before the generated rows' same layer, so a recomputed generated row finds its prompt's K/V.

Why: a one-row decode step ran ~60 torch ops per layer around the 4-bit products; their dispatch took
as long as the products (``tools/profile_step.py``). Every step is per row (each row's sum of squares
in a fixed order, the kernels row-invariant), so a generated token gets the same bits alone, beside other
decodes, beside prompt rows and in a recompute: cache on and off still agree. The C++ runs in the best build
the CPU (as ``PREFIXCACHE_KERNELS`` caps it) allows, AVX512-VNNI or AVX2 + FMA
(:func:`~prefixcache.kernels.cpu_kernels.load_int4_kernels`), with the same bits wherever the attention takes
the same form (the AVX2 build runs its float32 form, as a CPU without AVX512-BF16 does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixcache.kernels.cpu_kernels import load_int4_kernels
from prefixcache.kernels.decode_attention import DecodeRows
from prefixcache.layers.quant import Int4Weight


@dataclass(slots=True)
class DecoderLayerWeights:
    """One layer's weights as the generated rows use them.

    Attributes:
        input_norm, post_norm: shape = [hidden_size], the RMSNorm weights.
        q_norm, k_norm: shape = [head_dim] (Qwen3's per-head norms), or None.
        qkv: q, k, v stacked by output rows ([(heads + 2 kv_heads) * head_dim, hidden_size]).
        o: [hidden_size, heads * head_dim]. gate_up: gate and up stacked ([2 * intermediate, hidden]).
        down: [hidden_size, intermediate_size].
    """

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv: Int4Weight
    o: Int4Weight
    gate_up: Int4Weight
    down: Int4Weight

    def tensors(self) -> list[torch.Tensor]:
        """The 20 tensors the C++ constructor takes (an empty tensor for a missing norm or bias)."""
        none = torch.empty(0)
        out = [self.input_norm.detach(), self.post_norm.detach(),
               none if self.q_norm is None else self.q_norm.detach(), none if self.k_norm is None else self.k_norm.detach()]
        for w in (self.qkv, self.o, self.gate_up, self.down):
            out += [w.packed, w.scale, w.min, none if w.bias is None else w.bias]
        return out


class DecodeLayers:
    """Runs generated rows through the decoder layers (see the module docstring).

    Args:
        layers: every layer's weights, in order.
        final_norm: shape = [hidden_size], the model's final RMSNorm weight.
        inv_freq: shape = [head_dim / 2] float32, RoPE's inverse frequencies (any rope type).
        num_heads, num_kv_heads, head_dim, intermediate_size: the model's shape.
        eps: the RMSNorms' epsilon. scale: the attention's softmax scale.

    Raises:
        CpuKernelsUnavailable: the kernels can't be built or run here.
        RuntimeError: hidden_size or intermediate_size not a multiple of 32, head_dim not a multiple of 16
            up to 256, more than 16 query heads per kv head (the paged kernel's limits), or a weight,
            bias or norm whose shape doesn't match.
    """

    def __init__(self, layers: list[DecoderLayerWeights], final_norm: torch.Tensor, inv_freq: torch.Tensor, *,
                 num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int, eps: float,
                 scale: float) -> None:
        self.num_layers = len(layers)
        # the C++ constructor's arguments, kept for building the decoder in another build (tests compare builds)
        self._args = ([w.tensors() for w in layers], final_norm.detach(), inv_freq, final_norm.shape[0], num_heads,
                      num_kv_heads, head_dim, intermediate_size, eps, scale)
        self._impl = load_int4_kernels().DecodeLayers(*self._args)

    def run(self, hidden: torch.Tensor, rows: DecodeRows, kv_caches: list[torch.Tensor], begin: int = 0,
            end: int | None = None) -> None:
        """Runs layers ``[begin, end)`` (default: all) on ``hidden`` in place, writing each row's K/V
        at its position in those layers' pools first. Releases the GIL while it runs.

        Args:
            hidden: shape = [num_rows, hidden_size] float32, contiguous: the rows' residual stream.
            rows: the step's generated rows (their block tables and context lengths).
            kv_caches: every layer's pool, each [2, num_blocks, block_size, num_kv_heads, head_dim] bf16.

        Raises:
            RuntimeError: malformed shapes, a context length outside the block table, a block outside the pool.
        """
        self._impl.run(hidden, rows.block_table, rows.context_lens, rows.block_size, kv_caches, begin,
                       self.num_layers if end is None else end)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm: [num_rows, hidden_size] float32 -> bfloat16."""
        return self._impl.final_norm(hidden)
