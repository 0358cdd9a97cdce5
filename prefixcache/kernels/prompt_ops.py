"""A bf16 model's prompt rows' element-wise ops, fused (``prefixcache/kernels/csrc/prompt_ops.cpp``).

Between its GEMMs a decoder layer runs, in torch ops, the residual add, RMSNorm (a float32 copy, the
norm, a bf16 copy, the weight product), RoPE on q and k (a roll, two products, a sum), the K/V pool
write, SiLU and its product with ``up``, and a ``torch.cat`` of every row-tiled GEMM's tiles
(:func:`prefixcache.layers.linear.row_tiles`): ~15 passes over the rows per layer, ~15 % of a cold
2,178-token prefill of SmolLM2 (``tools/profile_step.py --dtype bfloat16 --prefill-tokens 2178``).
These three calls make one pass each and read the GEMMs' tiles in place:

- :func:`add_rms_norm`: ``h = residual + x``, ``y = w * rms_norm(h)``;
- :func:`rope_write_kv`: RoPE on q and k with torch's bf16 ops' bits, k and v into the pool;
- :func:`silu_mul`: ``silu(gate) * up``.

The model uses them wherever the paged prompt kernel runs (``LlamaForCausalLM.paged_attention``);
their rounding (sum-of-squares order, the exp of SiLU) is our own, so the cache key's
``attention.PAGED_KV_NUMERICS`` names them. Each row's result depends on that row alone: the same bits
in any batch.

The one source is compiled into each of our extensions, ggml's way (csrc/vec16.h): the AVX-512 one
(:mod:`prefixcache.kernels.cpu_kernels`), the AVX2 + FMA + F16C one (:mod:`prefixcache.kernels.avx2_kernels`)
and the aarch64 NEON one (:mod:`prefixcache.kernels.neon_kernels`), each with the same bits, so a row's K/V
and activations do not depend on which build ran them. Each call runs the best build the CPU, as capped by
``PREFIXCACHE_KERNELS``, loads (:func:`prompt_ops_build`).
"""

from __future__ import annotations

from types import ModuleType

import torch

from prefixcache.kernels.cpu_features import describe_cpu
from prefixcache.kernels.cpu_kernels import CpuKernelsUnavailable, int4_kernels_build, load_int4_kernels

__all__ = ["add_rms_norm", "prompt_ops_build", "prompt_ops_supported", "rope_write_kv", "silu_mul"]


def prompt_ops_build() -> str:
    """Which build the three ops run on here: ``"avx512"`` (:mod:`~prefixcache.kernels.cpu_kernels`' extension,
    where the CPU as capped by ``PREFIXCACHE_KERNELS`` has ``TIERS["avx512"]`` and it builds), ``"avx2"``
    (:mod:`~prefixcache.kernels.avx2_kernels`', ``TIERS["avx2"]``), ``"neon"``
    (:mod:`~prefixcache.kernels.neon_kernels`', an aarch64 CPU with ``asimd``) or ``""`` (none loads). Every build
    gives the same bits. The int4 kernels' choice (:func:`~prefixcache.kernels.cpu_kernels.int4_kernels_build`): one
    extension per process serves both, chosen once per set of CPU features (a build is compiled on first use)."""
    return int4_kernels_build()


def prompt_ops_supported() -> bool:
    """Whether any build of the fused prompt ops loads on this CPU (as capped by ``PREFIXCACHE_KERNELS``):
    where not, the model keeps torch's ops. Cached with :func:`prompt_ops_build`'s choice."""
    return bool(prompt_ops_build())


def _kernels() -> ModuleType:
    try:
        return load_int4_kernels()  # the build prompt_ops_build names (one cached choice per CPU-feature set)
    except CpuKernelsUnavailable:
        raise CpuKernelsUnavailable(f"the fused prompt ops need AVX-512, AVX2 + FMA + F16C or aarch64 NEON (and a "
                                    f"build of them); {describe_cpu()}") from None


def add_rms_norm(x: list[torch.Tensor], residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the RMSNorm after it.

    Args:
        x: row tiles of the sublayer's output, each [rows_i, hidden] bf16 (the embedding, one tile, for
            the first layer).
        residual: the residual stream [num_tokens, hidden] bf16, or None (the first layer: ``h = x``).
        weight: the norm's weight [hidden] bf16.
        eps: added to the mean square.

    Returns:
        (normed [num_tokens, hidden], h [num_tokens, hidden]: the new residual stream).

    Raises:
        RuntimeError: shapes or dtypes it doesn't take.
        CpuKernelsUnavailable: no build runs here (:func:`prompt_ops_supported`).
    """
    return _kernels().add_rms_norm(x, residual, weight, eps)


def rope_write_kv(qkv: list[torch.Tensor], cos: torch.Tensor, sin_rot: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """RoPE on q and k, k and v written to the pool.

    Args:
        qkv: row tiles of the fused q|k|v product, each [rows_i, (num_heads + 2 num_kv_heads) * head_dim] bf16.
        cos, sin_rot: [num_tokens, 1, head_dim] bf16 (:class:`~prefixcache.layers.rotary.RotaryEmbedding`).
        kv_cache: one layer's pool, [2, num_blocks, block_size, num_kv_heads, head_dim] bf16.
        slot_mapping: [num_tokens] int64, each token's pool slot.
        num_heads, num_kv_heads: query and KV heads.

    Returns:
        q rotated, [num_tokens, num_heads, head_dim] bf16 (contiguous).

    Raises:
        RuntimeError: shapes or dtypes it doesn't take, or a slot outside the pool.
        CpuKernelsUnavailable: no build runs here (:func:`prompt_ops_supported`).
    """
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    slots = (num_blocks * block_size, kv_heads, head_dim)
    return _kernels().rope_write_kv(qkv, cos.view(-1, head_dim), sin_rot.view(-1, head_dim), kv_cache[0].view(slots),
                                    kv_cache[1].view(slots), slot_mapping, num_heads, num_kv_heads)


def silu_mul(gate_up: list[torch.Tensor]) -> torch.Tensor:
    """SwiGLU's activation: row tiles of [gate | up], each [rows_i, 2 * intermediate] bf16 ->
    ``silu(gate) * up``, [num_tokens, intermediate] bf16.

    Raises:
        RuntimeError: shapes or dtypes it doesn't take.
        CpuKernelsUnavailable: no build runs here (:func:`prompt_ops_supported`).
    """
    return _kernels().silu_mul(gate_up)
