"""A model's ``attention_dtype``: the precision of its prompt attention's two products.

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

from torch import nn

from prefixcache.config import ATTENTION_DTYPES
from prefixcache.kernels.prefill_attention import INT8_FORM
from prefixcache.layers.attention.torch_attention import Attention


class AttentionDtypeModel:
    """For a model (an ``nn.Module``) whose layers hold :class:`Attention` modules and which says whether it can
    run the int8 form (``int8_attention_unavailable_reason``)."""

    attention_dtype = "float"

    def int8_attention_unavailable_reason(self) -> str | None:  # pragma: no cover - each model has its own
        raise NotImplementedError

    def set_attention_dtype(self, attention_dtype: str) -> None:
        """Runs every attention layer's prompt rows in ``attention_dtype`` (one of :data:`ATTENTION_DTYPES`).

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
