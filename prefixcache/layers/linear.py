"""The linear layers' methods: how a model's projections compute, chosen once at load.

A model's float weights are loaded into its ``nn.Linear`` modules under the checkpoint's names. What
the forward pass multiplies by is the method's business (vLLM's ``LinearMethodBase`` pattern):
:func:`linear_method` picks one from the weights' dtype, the quantization and what this CPU runs, each
:class:`StackedLinear` (q|k|v, o, gate|up, down, lm_head) derives its copy with
:meth:`LinearMethod.process_weights_after_loading` and runs its products through the method, so the
model's code holds its math only.

Each weight is held once where it runs: a method that multiplies by a copy of its own (prepacked bf16,
int8, the int4 formats over one of those) lets the model release the modules' float weights once the
copy is made (:meth:`StackedLinear.release_float_weights`; ``load_model(keep_float_weights=False)``,
the engine's load). What still reads them: deriving the copies again (another format, SmoothQuant's
calibration, weight replacement), which restores them first; never LoRA, whose deltas read the
adapter's A and B only. The dense and row-tiled methods multiply by the modules' weights, so those are
their one copy and stay. A released weight is an empty tensor: a product that reads it by mistake
raises instead of computing garbage.

| method | dtype / quantization | product | batch-invariant |
|---|---|---|---|
| :class:`DenseLinearMethod` | float32 (any float but bf16) / none | ``F.linear`` per module (MKL) | no |
| :class:`RowTiledLinearMethod` | bf16 / none, int4, without oneDNN's prepacked ops | ``F.linear`` per module in row tiles | yes |
| :class:`PrepackedLinearMethod` | bf16 / none, int4 | stacked, prepacked: our AMX GEMM where it packs the shape, else oneDNN's, in row tiles | yes |
| :class:`Int8LinearMethod` | any / int8, int4-int8 | stacked W8A8, exact int32 sums (:mod:`prefixcache.layers.quant`) | yes |
| :class:`Int4LinearMethod` | bf16 / int4, int4-int8 | the prompt rows' method above, plus the generated rows' 4-bit copies | yes |
| :class:`FixedTileLinear` | float32 / none (Gemma 3) | ``F.linear`` in calls of exactly :data:`FIXED_ROW_TILE` rows | yes |

What each keeps once the float weights are released (no other copy of a weight is held):

| method | holds |
|---|---|
| dense, row-tiled, fixed-tile | the modules' float weights |
| prepacked | the prepacked (AMX or oneDNN) copy |
| int8 | the int8 matrices (one layout: ``_int_mm``'s, or our AVX2 kernel's) and their scales |
| int4 over prepacked / row-tiled | the prepacked copy / the modules' bf16 weights, plus the 4-bit copies |
| int4 over int8 (int4-int8) | the int8 matrices plus the 4-bit copies |

A tied lm_head's weight is the embedding's matrix, which the embedding reads: it is never released.

AMX is no method of its own: :class:`PrepackedWeight` decides it per matrix from its shape
(``amx_packable``), so a model can run some matrices on AMX tiles and the others on oneDNN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prefixcache.config import INT4_DECODER_FORMATS, QUANTIZATIONS, W8A8_FORMATS
from prefixcache.kernels.amx_gemm import (GATE_UP, SILU_MUL, amx_gemm_supported, amx_linear, amx_packable,
                                          interleave_gate_up, pack_weight)
from prefixcache.kernels.cpu_features import format_unavailable_reason
from prefixcache.kernels.cpu_kernels import load_int4_kernels
from prefixcache.layers.lora import LoRABatch, LoRALinear
from prefixcache.layers.quant import (Int8Weight, int8_product, quantize_weight, quantize_weight_group_int8,
                                     quantize_weight_int4, smooth_factors, stacked_weight_and_bias)

ROW_TILE = 32  # rows per plain bf16 GEMM call of a batch-invariant model (see row_tiled_linear)
PREPACKED_ROW_TILE = 128  # rows per call with a PrepackedWeight (see PrepackedWeight)


class PrepackedWeight:
    """oneDNN's reordered copy of one or more bfloat16 weights stacked by output rows (q, k, v →
    qkv), made once and re-made when one of them changes; where the CPU has AMX-BF16, our AMX kernel's
    packed copy instead (``amx``: :mod:`prefixcache.kernels.amx_gemm`, whose rows never depend on the
    call's other rows, so :func:`row_tiles` makes one call).

    torch's plain bf16 ``F.linear`` on the CPU reorders the weight into oneDNN's blocked layout on
    every call, and a row-tiled prefill makes one call per tile. The prepacked product
    (``torch.ops.mkldnn._reorder_linear_weight`` once, then ``_linear_pointwise``: what
    torch.compile's CPU backend (inductor) emits for bf16 linears) skips it, and a fused qkv or
    gate_up matrix makes one call where there were three or two. A row gets the same bits in
    every call of 2 to 128 rows (1 and 2 threads), on every SmolLM2 shape, fused ones and the lm_head included (the
    1536 -> 576 down_proj differs from 160 rows on, and in a one-row call), so the row-tiled path
    calls it with 2 to :data:`PREPACKED_ROW_TILE` rows and stays batch-invariant
    (``tests/engine/test_bf16_engine.py``'s row-tiled tests). The copy costs the weights' size again
    in memory until the modules' float weights are released (:meth:`detach_modules`): then it is the
    only copy.

    Args:
        modules: the linear layers whose weights (and biases) are stacked, in output order.
        allow_amx: False keeps oneDNN's product also where our AMX kernel runs (A/B measurements).
    """

    def __init__(self, modules: list[nn.Linear], allow_amx: bool = True, gate_up: bool = False) -> None:
        self.modules, self.allow_amx = modules, allow_amx  # allow_amx=False: oneDNN's (A/B probes)
        self.gate_up = gate_up  # [gate; up]: on AMX, packed interleaved so silu_linear can fuse silu(gate) * up
        self.interleaved = False
        self._key: tuple | None = None  # (data_ptr, _version) of every weight and bias packed
        self.detached = False  # the modules' weights released: the packed copy is final (detach_modules)
        self._packed: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        # our AMX kernel instead of oneDNN where it runs (a row's bits then independent of the call's rows);
        # decided again by each pack, from the weights packed
        self.amx = allow_amx and amx_gemm_supported() and all(amx_packable(m.weight) for m in modules)
        self.out_features = sum(m.weight.shape[0] for m in modules)

    def pack(self) -> torch.Tensor:
        """The packed copy, made now unless the one held is of the modules' current bits (or final:
        :meth:`detach_modules`)."""
        if self.detached:
            return self._packed
        # the modules' parameter dicts read directly: nn.Module's attribute lookup made this check ~14 us of
        # each of a step's ~120 calls (a Parameter is the only thing a parameter's name can be set to)
        key = tuple((p.data_ptr(), p._version) for m in self.modules for name in ("weight", "bias")
                    if (p := m._parameters.get(name)) is not None)
        if key != self._key:  # first use, or a weight was replaced or written in place
            weight, self._bias = stacked_weight_and_bias(self.modules)  # [sum(out), in], [sum(out)] | None
            self.amx = self.allow_amx and amx_gemm_supported() and amx_packable(weight)
            self.out_features = weight.shape[0]
            self.interleaved = self.amx and self.gate_up and self.out_features % 32 == 0
            if self.interleaved:
                weight, self._bias = interleave_gate_up(weight, self._bias)
            self._packed = pack_weight(weight) if self.amx else torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            self._key = key
        return self._packed

    def detach_modules(self) -> None:
        """Packs now if needed, then stops following the modules' weights, so they can be released:
        a later change of them reaches the model through a new method (``StackedLinear.set_method``)."""
        self.pack()
        self.detached = True

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """The stacked product of a bfloat16 ``x`` [rows, in]: [rows, sum(out_features)]."""
        packed = self.pack()
        if self.amx:
            return amx_linear(x, packed, self._bias, self.out_features, GATE_UP if self.interleaved else 0)
        return torch.ops.mkldnn._linear_pointwise(x, packed, self._bias, "none", [], "")

    def silu_linear(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of a gate|up weight's product, fused into the AMX kernel's store: [rows, out / 2]
        bf16, the bits of ``prompt_ops.silu_mul`` on :meth:`linear`'s output; None where it doesn't run
        (oneDNN, or a width that doesn't interleave)."""
        packed = self.pack()
        if not self.interleaved:
            return None
        return amx_linear(x, packed, self._bias, self.out_features, SILU_MUL)


def prepacked_linear_supported() -> bool:
    """Whether oneDNN's prepacked bf16 linear ops run here: a torch build with mkldnn, on a CPU whose features
    its bf16 path needs (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; elsewhere ``_reorder_linear_weight`` raises, and a
    bf16 model keeps torch's plain product)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and format_unavailable_reason("bfloat16", "none") is None)


def row_tiled_linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
                     packed: PrepackedWeight | None = None) -> torch.Tensor:
    """``F.linear`` in calls of 2 to :data:`ROW_TILE` rows (:data:`PREPACKED_ROW_TILE` with
    ``packed``), so each row's bits do not depend on how many rows share the call.

    torch's plain bf16 GEMM on the CPU (oneDNN) gives a row the same bits for every call of 2 to 32 rows, and other
    bits beyond 32 (another kernel blocking), for every projection shape of the model and the
    lm_head; the prepacked product for 2 to 128 rows (:class:`PrepackedWeight`). A call of one row
    takes another kernel whose sums differ for the 1536-input down_proj (~1 row in 10 with SiLU-like
    activations, enough for a bf16 decode alone and in a batch to diverge), so a
    single row runs as two (itself twice) and a last tile of one row is taken with the row before it.
    Where a prepacked weight runs on our AMX kernel (:mod:`prefixcache.kernels.amx_gemm`: a row's bits
    never depend on the call's rows), all rows go in one call.

    Args:
        x: shape = [num_tokens, in_features].
        weight: shape = [out_features, in_features] (ignored with ``packed``).
        bias: shape = [out_features] or None (ignored with ``packed``).
        packed: the prepacked weight (bfloat16 only): each call uses it.

    Returns:
        shape = [num_tokens, out_features].
    """
    tiles = row_tiles(x, weight, bias, packed)
    return tiles[0] if len(tiles) == 1 else torch.cat(tiles)


def row_tiles(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
              packed: PrepackedWeight | None = None) -> list[torch.Tensor]:
    """:func:`row_tiled_linear`'s calls' outputs, not concatenated: row tiles of [num_tokens,
    out_features] in order (:mod:`prefixcache.kernels.prompt_ops` reads them in place)."""
    if packed is not None and packed.amx:  # any number of rows in one call (amx_gemm.py)
        return [packed.linear(x)]
    if packed is None:
        linear, tile = (lambda rows: F.linear(rows, weight, bias)), ROW_TILE
    else:
        linear, tile = packed.linear, PREPACKED_ROW_TILE
    n = x.shape[0]
    if n == 1:
        return [linear(x.expand(2, -1).contiguous())[:1]]
    if n <= tile:
        return [linear(x)]
    tiles = [linear(x[i : i + tile]) for i in range(0, n - 1 if n % tile == 1 else n, tile)]
    if n % tile == 1:  # the last row with its predecessor: no one-row call
        tiles.append(linear(x[n - 2 :])[1:])
    return tiles


def release_weight(module: nn.Linear) -> int:
    """Replaces ``module.weight`` by an empty tensor of its dtype and device, its shape kept for
    :func:`restore_weight`: a product that reads it by mistake raises (``F.linear``: a size mismatch;
    ``stacked_weight_and_bias``: no [out, in] matrix) instead of computing garbage. Returns the bytes
    released (freed once nothing else holds the tensor)."""
    weight = module.weight
    module.released_weight_shape = tuple(weight.shape)
    module.weight = nn.Parameter(weight.detach().new_empty(0), requires_grad=False)
    return weight.numel() * weight.element_size()


def weight_released(module: nn.Module) -> bool:
    """Whether ``module.weight`` was released by :func:`release_weight` (and not restored since)."""
    return getattr(module, "released_weight_shape", None) is not None


def restore_weight(module: nn.Linear) -> None:
    """Gives a released ``module.weight`` storage of its shape again, uninitialized: the caller loads it."""
    shape = module.__dict__.pop("released_weight_shape")
    module.weight = nn.Parameter(module.weight.new_empty(shape), requires_grad=False)


FIXED_ROW_TILE = 16  # rows of every call of fixed_tile_linear


def fixed_tile_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` as calls of exactly :data:`FIXED_ROW_TILE` rows, the last tile padded with zero rows,
    so each row's bits are the same in any batch, in float32.

    MKL's sgemm gives a row other bits for another number of rows in the call (:func:`row_tiled_linear`'s
    2-32-row tiles hold for oneDNN's bf16 GEMM only: in float32 a row differs between a 2-row and a 17-row
    call), but the same bits in every call of one fixed row count, whatever its position and the other
    rows. 16 rows: a 1,500-row product takes 2-5x a plain call's time and a one-row decode product 3-7x
    (padded to 16), against 32 rows' 1.7-3x and 5-10x (Gemma 3 270M's shapes on AVX-512).

    Args:
        x: shape = [num_tokens, in_features].
        weight: shape = [out_features, in_features]; bias: [out_features] or None.

    Returns:
        shape = [num_tokens, out_features].
    """
    n = x.shape[0]
    padded = -(-n // FIXED_ROW_TILE) * FIXED_ROW_TILE
    if padded != n:
        x = torch.cat([x, x.new_zeros(padded - n, x.shape[1])])
    if padded == FIXED_ROW_TILE:
        return F.linear(x, weight, bias)[:n]
    tiles = [F.linear(x[i : i + FIXED_ROW_TILE], weight, bias) for i in range(0, padded, FIXED_ROW_TILE)]
    return torch.cat(tiles)[:n]


class FixedTileLinear(nn.Linear):
    """``nn.Linear`` whose product is :func:`fixed_tile_linear` (same parameters and checkpoint names):
    a float32 model's batch-invariant projections (Gemma 3's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x shape = [num_tokens, in_features]. Returns: [num_tokens, out_features]."""
        return fixed_tile_linear(x, self.weight, self.bias)


class StackedLinear:
    """Linear layers that share an input, run as one product stacked by output rows (q|k|v, gate|up;
    one module for o, down, lm_head) under the model's :class:`LinearMethod`.

    Not an ``nn.Module``: the modules stay where the checkpoint's names put them, and this holds only
    what the method derives from them.

    Attributes:
        modules: the linear layers, in output order (``LoRALinear``, or the lm_head's ``nn.Linear``).
        sizes: each module's out_features.
        gate_up: [gate; up] (the prepacked AMX form fuses silu(gate) * up into the product).
        logits: the lm_head (the int4 formats' generated rows use Q8_0's grid for it, not Q4_1's).
        method: the method that runs the products (:func:`linear_method`; dense until set).
        weight: the method's copy of the stacked weights (``Int8Weight``, ``PrepackedWeight``), or None
            where the method reads the modules' own.
        decode_weight: the int4 formats' copy for generated rows (``Int4Weight``; ``GroupInt8Weight``
            for the lm_head), or None.
    """

    def __init__(self, modules: list[nn.Linear], gate_up: bool = False, logits: bool = False) -> None:
        self.modules, self.gate_up, self.logits = modules, gate_up, logits
        self.sizes = [m.out_features for m in modules]
        self.method: LinearMethod = DENSE
        self.weight: object | None = None
        self.decode_weight: object | None = None

    def set_method(self, method: LinearMethod) -> None:
        """Runs the products through ``method`` from now on, its weights derived from the modules' now.

        Raises:
            RuntimeError: a module's float weight was released (:meth:`release_float_weights`).
        """
        released = [m for m in self.modules if weight_released(m)]
        if released:
            raise RuntimeError(f"{len(released)} float weight(s) of this layer were released after loading; "
                               "restore and load them again (restore_weight) before deriving a method's copy")
        self.method, self.weight, self.decode_weight = method, None, None
        method.process_weights_after_loading(self)

    def release_float_weights(self, keep: frozenset[int] = frozenset()) -> int:
        """Releases the modules' float weights where the method multiplies by its own copy
        (:attr:`LinearMethod.reads_module_weights` False), each to an empty tensor (:func:`release_weight`);
        a weight whose ``id`` is in ``keep`` (a tied lm_head's, the embedding's matrix) stays. Where our
        AVX2 or AVX-VNNI int8 kernel runs, the int8 matrix's plain layout goes too
        (:meth:`Int8Weight.release_qweight`).

        Returns:
            The bytes released (0 where the method reads the modules' weights: they are its copy).
        """
        if self.method.reads_module_weights:
            return 0
        released = 0
        if isinstance(self.weight, PrepackedWeight):
            self.weight.detach_modules()
        elif isinstance(self.weight, Int8Weight):  # where our AVX2 kernel runs, its layout is the int8 copy read
            released = self.weight.release_qweight()
        return released + sum(release_weight(m) for m in self.modules
                              if id(m.weight) not in keep and not weight_released(m))

    def stacked(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """The stacked product without LoRA deltas, [num_tokens, sum(sizes)] (``out_dtype``: the
        dtype of ``x`` unless given), or None where the method runs the modules one by one."""
        return self.method.apply(self, x, out_dtype)

    def stacked_tiles(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """:meth:`stacked` as row tiles in order (:func:`row_tiles`), or None as :meth:`stacked`."""
        return self.method.apply_tiles(self, x)

    def split(self, x: torch.Tensor, lora: LoRABatch | None = None,
              stacked: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Each module's output, [num_tokens, size], LoRA deltas added: column slices of the stacked
        product (``stacked`` when the caller has it already), or the modules' own products."""
        y = self.stacked(x) if stacked is None else stacked
        if y is None:
            return self.method.apply_each(self, x, lora)
        parts = y.split(self.sizes, dim=-1) if len(self.sizes) > 1 else [y]
        return [m.add_lora(part, x, lora, self.method.lora_linear) if isinstance(m, LoRALinear) else part
                for m, part in zip(self.modules, parts, strict=True)]

    def __call__(self, x: torch.Tensor, lora: LoRABatch | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The stacked product with LoRA deltas added: [num_tokens, sum(sizes)], ``out_dtype`` (the
        dtype of ``x`` unless given)."""
        y = self.stacked(x, out_dtype)
        if y is None:
            parts = self.method.apply_each(self, x, lora)
            y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
            return y if out_dtype is None else y.to(out_dtype)
        if lora is not None:
            self.split(x, lora, y)  # the deltas in place, on y's column slices
        return y

    def tiles(self, x: torch.Tensor, lora: LoRABatch | None = None) -> list[torch.Tensor]:
        """:meth:`__call__` as row tiles in order (several only where the method tiles and no LoRA runs)."""
        if lora is None and (tiles := self.stacked_tiles(x)) is not None:
            return tiles
        return [self(x, lora)]

    def silu_linear(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of a gate|up product, fused into the product where the method can
        (:meth:`PrepackedWeight.silu_linear`): [num_tokens, size / 2]; None elsewhere."""
        return self.method.silu_linear(self, x)


class StackedLinearModel:
    """Mixin for a causal LM (an ``nn.Module``) whose products are :class:`StackedLinear` groups: sets
    their method and releases and restores their float weights, the one way every model does.

    The host provides ``linear_groups()`` (every :class:`StackedLinear`, in a fixed order) and
    ``model.embed_tokens`` (the input embedding: a tied lm_head's weight is its matrix, which the
    embedding reads, so it is never released).

    Attributes:
        linear_method: the method every group runs (:meth:`apply_linear_method` sets it).
    """

    linear_method: LinearMethod

    def apply_linear_method(self, method: LinearMethod) -> None:
        """Runs every group's products through ``method`` from now on, each deriving its copy now
        (:meth:`StackedLinear.set_method`)."""
        self.linear_method = method
        for group in self.linear_groups():
            group.set_method(method)

    def check_float_weights_loaded(self, scheme: str) -> None:
        """Raises RuntimeError where the float weights were released (:meth:`release_float_weights`)
        and not loaded again: ``quantize(scheme)`` derives its copies from them."""
        if self.released_weight_names():
            raise RuntimeError(f"quantize({scheme!r}): the projections' float weights were released after loading "
                               "(load_model(keep_float_weights=False)); load the weights again first")

    def release_float_weights(self) -> int:
        """Releases the projections' float weights that the linear method no longer reads (it multiplies
        by its own copy: prepacked bf16, int8, the int4 formats over those), so each weight is held
        once; a tied lm_head keeps the embedding's matrix. LoRA still runs (its deltas read the adapter's
        matrices); deriving copies again needs the weights loaded again (:meth:`restore_float_weights`).

        Returns:
            The bytes released.
        """
        keep = frozenset({id(self.model.embed_tokens.weight)})
        return sum(group.release_float_weights(keep) for group in self.linear_groups())

    def released_weight_names(self) -> list[str]:
        """The parameter names (``model.layers.0.self_attn.q_proj.weight``, ...) of the released float weights."""
        return [f"{name}.weight" for name, module in self.named_modules() if weight_released(module)]

    def restore_float_weights(self) -> list[str]:
        """Gives every released float weight storage of its shape again, uninitialized, for a load to
        fill (then ``quantize``); returns their parameter names."""
        names = self.released_weight_names()
        for module in self.modules():
            if weight_released(module):
                restore_weight(module)
        return names


class LinearMethod:
    """How :class:`StackedLinear` products compute (one instance per model, chosen by
    :func:`linear_method`). The base runs each module on its own weights with :attr:`linear`.

    Attributes:
        name: what the start-up log and A/B runs call it.
        reads_module_weights: whether the products read the modules' float weights (then their one
            copy, never released), rather than a copy the method derived.
        lora_linear: the float product ``(x, weight, bias=None) -> y`` LoRA's A and B run with (on the
            adapter's matrices only: LoRA never reads the modules' weights).
        decodes: whether generated rows run the int4 decoder (the groups then hold ``decode_weight``).
        smoothed: whether the weights take SmoothQuant's calibration (:meth:`calibrate`).
    """

    name = "dense"
    reads_module_weights = True
    decodes = False
    smoothed = False
    lora_linear = staticmethod(F.linear)

    def process_weights_after_loading(self, group: StackedLinear) -> None:
        """Derives ``group.weight`` (and ``decode_weight``) from the modules' float weights: once at
        load and again after they change. Nothing to derive here."""

    def calibrate(self, group: StackedLinear, act_amax: dict[int, torch.Tensor] | None) -> None:
        """Re-derives the int8 weights smoothed by the calibration maxima ``act_amax`` (by ``id`` of the
        current ``Int8Weight``; None: the plain rule). A no-op for a method without int8 weights."""

    def int8_weight(self, group: StackedLinear) -> Int8Weight | None:
        """The group's int8 matrix, or None for a method without one."""
        return None

    def apply(self, group: StackedLinear, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """The stacked product [num_tokens, sum(sizes)], or None where the modules run one by one."""
        return None

    def apply_tiles(self, group: StackedLinear, x: torch.Tensor) -> list[torch.Tensor] | None:
        """:meth:`apply` as row tiles, or None where the modules run one by one."""
        y = self.apply(group, x)
        return None if y is None else [y]

    def apply_each(self, group: StackedLinear, x: torch.Tensor, lora: LoRABatch | None) -> list[torch.Tensor]:
        """Each module's own product, LoRA deltas added: a ``LoRALinear`` is called (its hooks run)."""
        return [m(x, lora) if isinstance(m, LoRALinear) else m(x) for m in group.modules]

    def silu_linear(self, group: StackedLinear, x: torch.Tensor) -> torch.Tensor | None:
        """A fused silu(gate) * up of a gate|up group, or None where the method has none."""
        return None


class DenseLinearMethod(LinearMethod):
    """float32 (any float dtype but bf16): torch's product per module, transformers' numbers; its
    GEMMs (MKL) round by the number of rows, so it is not batch-invariant."""


class RowTiledLinearMethod(LinearMethod):
    """bf16 without oneDNN's prepacked ops: torch's product per module in calls of 2 to
    :data:`ROW_TILE` rows (:func:`row_tiled_linear`), LoRA's products too, so each row's bits do not
    depend on its batch."""

    name = "bf16-row-tiled"

    @staticmethod
    def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return row_tiled_linear(x, weight, bias)

    def apply_each(self, group: StackedLinear, x: torch.Tensor, lora: LoRABatch | None) -> list[torch.Tensor]:
        return [m(x, lora, row_tiled_linear) if isinstance(m, LoRALinear) else row_tiled_linear(x, m.weight, m.bias)
                for m in group.modules]


class PrepackedLinearMethod(RowTiledLinearMethod):
    """bf16 with oneDNN's prepacked ops: each group one :class:`PrepackedWeight` (q|k|v and gate|up
    stacked), on our AMX kernel where it packs the shape, else oneDNN's in row tiles of 2 to
    :data:`PREPACKED_ROW_TILE`; LoRA's products as :class:`RowTiledLinearMethod`'s."""

    name = "bf16-prepacked"
    reads_module_weights = False  # the PrepackedWeight only; LoRA's products read the adapter's matrices

    def process_weights_after_loading(self, group: StackedLinear) -> None:
        group.weight = packed = PrepackedWeight(group.modules, gate_up=group.gate_up)
        if group.modules[0].weight.device.type != "meta":
            packed.pack()  # now, not in the first request (~0.5 s for SmolLM2)

    def apply(self, group: StackedLinear, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        y = row_tiled_linear(x, None, packed=group.weight)
        return y if out_dtype is None else y.to(out_dtype)

    def apply_tiles(self, group: StackedLinear, x: torch.Tensor) -> list[torch.Tensor]:
        return row_tiles(x, None, packed=group.weight)

    def silu_linear(self, group: StackedLinear, x: torch.Tensor) -> torch.Tensor | None:
        return group.weight.silu_linear(x)


class Int8LinearMethod(LinearMethod):
    """W8A8 (:mod:`prefixcache.layers.quant`): each group one int8 matrix (q|k|v and gate|up stacked:
    their own copies would only take memory), SmoothQuant-smoothed once calibrated; exact int32 sums,
    so batch-invariant. Only the int8 copy is read once calibrated: the float weights can be released."""

    name = "int8"
    reads_module_weights = False
    smoothed = True

    def process_weights_after_loading(self, group: StackedLinear) -> None:
        self.calibrate(group, None)

    def calibrate(self, group: StackedLinear, act_amax: dict[int, torch.Tensor] | None) -> None:
        weight, bias = stacked_weight_and_bias(group.modules)  # [sum(out), in], [sum(out)] | None
        old = group.weight
        amax = None if act_amax is None or old is None else act_amax.get(id(old))
        group.weight = quantize_weight(weight, bias, _smoothing(amax, weight))

    def int8_weight(self, group: StackedLinear) -> Int8Weight:
        return group.weight

    def apply(self, group: StackedLinear, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return int8_product(x, group.weight, x.dtype if out_dtype is None else out_dtype)


class Int4LinearMethod(LinearMethod):
    """int4, int4-int8: prompt rows run ``prompt``'s products (bf16's for int4, int8's for int4-int8);
    generated rows run :class:`~prefixcache.layers.decode_layers.DecodeLayers` on each group's
    ``decode_weight`` (Q4_1's grid; the lm_head's on Q8_0's, per row by
    :class:`~prefixcache.layers.quant.RowSplit`)."""

    decodes = True

    def __init__(self, prompt: LinearMethod, name: str) -> None:
        self.prompt, self.name = prompt, name
        self.lora_linear, self.smoothed = prompt.lora_linear, prompt.smoothed
        self.reads_module_weights = prompt.reads_module_weights  # the generated rows read their 4-bit copies

    def process_weights_after_loading(self, group: StackedLinear) -> None:
        self.prompt.process_weights_after_loading(group)
        if group.logits:
            group.decode_weight = quantize_weight_group_int8(group.modules[0].weight)
        else:  # exact stacked: groups run along the input features, each output row is quantized alone
            group.decode_weight = quantize_weight_int4(*stacked_weight_and_bias(group.modules))

    def calibrate(self, group: StackedLinear, act_amax: dict[int, torch.Tensor] | None) -> None:
        self.prompt.calibrate(group, act_amax)

    def int8_weight(self, group: StackedLinear) -> Int8Weight | None:
        return self.prompt.int8_weight(group)

    def apply(self, group: StackedLinear, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
        return self.prompt.apply(group, x, out_dtype)

    def apply_tiles(self, group: StackedLinear, x: torch.Tensor) -> list[torch.Tensor] | None:
        return self.prompt.apply_tiles(group, x)

    def apply_each(self, group: StackedLinear, x: torch.Tensor, lora: LoRABatch | None) -> list[torch.Tensor]:
        return self.prompt.apply_each(group, x, lora)

    def silu_linear(self, group: StackedLinear, x: torch.Tensor) -> torch.Tensor | None:
        return self.prompt.silu_linear(group, x)


DENSE = DenseLinearMethod()


def linear_method(dtype: torch.dtype, quantization: str) -> LinearMethod:
    """The method of a model whose float weights are ``dtype``, under ``quantization``: int8's for the
    W8A8 formats, else bf16's prepacked products where oneDNN's run on this CPU (row-tiled plain ones
    elsewhere), else dense; the int4 formats wrap the prompt rows' one.

    Raises:
        ValueError: an unknown quantization, or int4(-int8) with weights that are not bfloat16.
        CpuKernelsUnavailable: int4(-int8) where its kernels can't be built or run.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    int4 = quantization in INT4_DECODER_FORMATS
    if int4 and dtype != torch.bfloat16:
        raise ValueError(f"quantization {quantization!r} needs a bfloat16 model, got {dtype}")
    if int4:
        load_int4_kernels()  # now, with its reason, rather than at the first generated token
    if quantization in W8A8_FORMATS:
        prompt: LinearMethod = Int8LinearMethod()
    elif dtype == torch.bfloat16:
        prompt = PrepackedLinearMethod() if prepacked_linear_supported() else RowTiledLinearMethod()
    else:
        prompt = DENSE
    return Int4LinearMethod(prompt, f"{quantization}+{prompt.name}") if int4 else prompt


def _smoothing(amax: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor | None:
    """:func:`~prefixcache.layers.quant.smooth_factors` of a matrix whose calibration maxima are all
    finite; None (no smoothing) without maxima or with a NaN / infinity among them (an input that
    overflowed in calibration would make every multiplier 0 or NaN)."""
    if amax is None or not bool(torch.isfinite(amax).all()):
        return None
    return smooth_factors(amax, weight)
