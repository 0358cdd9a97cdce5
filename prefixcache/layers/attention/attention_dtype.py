"""A model's attention routing: which form of the paged kernel its layers run, and its ``attention_dtype``, the
precision of its prompt attention's two products.

``"float"`` (the default): the pool's dtype, each row's sums in float32, on the paged kernel's form the model and
the machine pick (:func:`prefixcache.kernels.prefill_attention.kernel_form`) or torch's padded path.
``"int8"``: every row on the paged kernel's AVX2 form with int8 products (:data:`~prefixcache.kernels.prefill_attention.INT8_FORM`,
``csrc/prefill_attention_avx2.cpp`` says how q, K, p and V are rounded): the attention's multiply-adds run as
``vpmaddubsw`` integer sums, about twice the float32 FMAs' rate on an AVX2 CPU, where attention is most of a long
prompt's time; it costs a little quality (docs/benchmarks.md's quality table). A row's bits stay independent of
its batch (each rounding scale is fixed by the row's own values), so cache on == off holds; the cache key names
the form (:func:`prefixcache.layers.attention.numerics.kv_numerics`). An int4 format's generated rows keep their
own decoder (:mod:`prefixcache.layers.decode_layers`).
"""

from __future__ import annotations

import torch
from torch import nn

from prefixcache.config import ATTENTION_DTYPES, INT8_ATTENTION_NEEDS_AVX2, INT8_ATTENTION_NEEDS_KERNEL_FORMAT
from prefixcache.kernels.prefill_attention import INT8_FORM, kernel_form, prefill_kernel_supported
from prefixcache.layers.attention.torch_attention import Attention


class PagedAttentionModel:
    """For a model (an ``nn.Module`` with ``config`` and ``model.embed_tokens``) whose layers hold :class:`Attention`
    modules. The model decides ``paged_attention`` (whether it runs the paged kernel: its own rule) and
    ``batch_invariant``; this class derives the forms from them, the same way for every model."""

    attention_dtype = "float"
    has_sliding_layers = False  # whether some layers attend over a sliding window (Gemma 3's local ones)

    @property
    def paged_attention(self) -> bool:  # pragma: no cover - each model has its own rule
        raise NotImplementedError

    @property
    def _pool_dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def _kernel_supported(self, windowed: bool = False) -> bool:
        """Whether a form of the paged kernel runs this model's head shape and pool here (with a window where
        ``windowed``; with int8 products where its attention_dtype says so), on the CPU."""
        cfg = self.config
        return (self.model.embed_tokens.weight.device.type == "cpu"
                and prefill_kernel_supported(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                             self._pool_dtype, windowed, self.attention_dtype == "int8"))

    @property
    def paged_attention_form(self) -> str | None:
        """The paged kernel's form of its (global) layers: ``kernel_form`` of its pool's dtype and attention_dtype,
        None off the kernel."""
        return kernel_form(self._pool_dtype, int8=self.attention_dtype == "int8") if self.paged_attention else None

    @property
    def sliding_attention_form(self) -> str | None:
        """The form of its sliding-window layers (the AVX2 form masks a window, with its int8 products or not),
        None off the kernel or without such layers."""
        if not (self.paged_attention and self.has_sliding_layers):
            return None
        return kernel_form(self._pool_dtype, windowed=True, int8=self.attention_dtype == "int8")

    def int8_attention_unavailable_reason(self) -> str | None:
        """Why ``attention_dtype="int8"`` can't run here (None: it can): it runs on the paged kernel, which takes a
        batch-invariant format only, in its AVX2 form."""
        if not self.batch_invariant:
            return INT8_ATTENTION_NEEDS_KERNEL_FORMAT
        cfg = self.config
        if not (self.model.embed_tokens.weight.device.type == "cpu" and prefill_kernel_supported(
                cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, self._pool_dtype, int8=True)):
            return INT8_ATTENTION_NEEDS_AVX2
        return None

    def set_attention_dtype(self, attention_dtype: str) -> None:
        """Runs every attention layer's prompt rows in ``attention_dtype`` (one of ``config.ATTENTION_DTYPES``).

        Raises:
            ValueError: naming ``attention_dtype``: an unknown one, or ``"int8"`` where the model or the CPU can't
                run it (the message says why and what to use instead).
        """
        if attention_dtype not in ATTENTION_DTYPES:
            raise ValueError(f"attention_dtype must be one of {ATTENTION_DTYPES}, got {attention_dtype!r}")
        if attention_dtype == "int8":
            reason = self.int8_attention_unavailable_reason()
            if reason is not None:
                raise ValueError(f"attention_dtype='int8' {reason}; use attention_dtype='float'")
        self.attention_dtype = attention_dtype
        assert isinstance(self, nn.Module)
        for module in self.modules():
            if isinstance(module, Attention):
                module.kernel_form = INT8_FORM if attention_dtype == "int8" else None
