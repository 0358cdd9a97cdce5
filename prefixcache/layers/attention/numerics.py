"""The cache key's name for the rules that decide the bits of the pool's K/V.

Two attention paths compute the pool's K/V, and they round differently: our paged kernel (a
batch-invariant model on a CPU with AVX2, ``paged_kernel``, which the model's ``paged_attention``
decides: :mod:`prefixcache.kernels.prefill_attention`, a row's bits fixed by construction, no padding;
faster than the padded flash calls, as ``benchmarks/prefill_attention.py`` compares), and torch's flash
calls padded as :mod:`prefixcache.layers.attention.metadata` says (float32 without int8, head shapes the
kernel doesn't take, CPUs without AVX2). The cache key names which one computed the K/V
(:func:`kv_numerics`), and the kernel's form: AMX tiles on a CPU with AMX-BF16, float32 FMAs on one with
AVX2 but no AVX512-BF16 (:func:`prefixcache.kernels.prefill_attention.prefill_form`), the float32 FMA
form wherever a float32 pool or a sliding window needs it (:func:`prefixcache.kernels.prefill_attention.kernel_form`),
and its int8 products where a model asks for them (``attention_dtype="int8"``).
"""

from prefixcache.kernels.amx_gemm import amx_gemm_supported
from prefixcache.kernels.cpu_kernels import kernels_compiler
from prefixcache.kernels import prefill_attention

# Part of every cache key (engine.input_processor.model_key): names the rules that decide the bits of
# every K/V the pool holds (layers.attention.metadata's padding, layers.linear.row_tiled_linear's row
# counts); changed with them, so a disk or Redis tier filled under an older rule is never read as if
# computed now (query rows padded to 4..16 or a multiple of 16; no one-row GEMM call).
KV_NUMERICS = "attention-rows:4-16-x16|gemm-rows:2+"
# the same for our kernel's prompt rows, with the fused element-wise ops of kernels.prompt_ops around it
# (their RMSNorm sum order and SiLU exp are ours, not torch's; the kernel's softmax is in base 2)
PAGED_KV_NUMERICS = "paged-bf16-attention:keys32-exp2|gemm-rows:2+|prompt-ops:1"
# the same kernel for a model whose element-wise ops stay torch's (float32 pools, Gemma 3), the pool's dtype in
# the key beside it
PAGED_ATTENTION_NUMERICS = "paged-attention:keys32-exp2|gemm-rows:2+"
# added where our kernel runs its products on AMX tiles (prefill_attention.prefill_form() == "amx"); its softmax
# is p = 2^(s * scale - m) by a floor-reduced polynomial, a -inf score making its row NaN
PAGED_AMX_NUMERICS = "|prompt-products:amx-tiles|softmax:exp2-floor"
# added where it runs its AVX2 form (prefill_form() == "avx2"): float32 FMAs in dim and key order, p in float32
PAGED_AVX2_NUMERICS = "|prompt-products:avx2-fp32"
# added where it runs the AVX2 form's int8 products (attention_dtype "int8"): q to 7 bits and K to 8 per row,
# p * v_scale to 7 bits per row and 32-key block, V to 8 bits per row, exact int32 sums
PAGED_AVX2_INT8_NUMERICS = "|prompt-products:avx2-int8-q7k8-w7v8"
_FORM_NUMERICS = {"amx": PAGED_AMX_NUMERICS, "avx512": "", "avx2": PAGED_AVX2_NUMERICS,
                  prefill_attention.INT8_FORM: PAGED_AVX2_INT8_NUMERICS}
# added where a bf16 model's prepacked linear layers run on our AMX kernel (amx_gemm.amx_gemm_supported)
AMX_GEMM_NUMERICS = "|gemm:amx-tiles-k32"


def kv_numerics(paged_kernel: bool, bf16_gemms: bool, int4: bool = False, form: str | None = None,
                prompt_ops: bool = True, sliding_form: str | None = None) -> str:
    """The cache key's name for the rules that decide the bits of the pool's K/V: our paged kernel
    (:mod:`prefixcache.kernels.prefill_attention`), in its AMX, AVX-512 or AVX2 form (``form``; None: this
    machine's :func:`~prefixcache.kernels.prefill_attention.prefill_form`), with our fused element-wise ops
    around it (``prompt_ops``: :mod:`prefixcache.kernels.prompt_ops`) or torch's, and the form of a model's
    sliding-window layers (``sliding_form``), or torch's padded flash calls; for a model whose linear
    layers run in bf16 (``bf16_gemms``), whose GEMMs those are (our AMX kernel or oneDNN's in row tiles; a
    float32 or int8 model's never run on it); and, wherever our C++ kernels compute K/V (the paged kernel,
    the AMX GEMM, ``int4``'s generated rows), the compiler that built them
    (:func:`prefixcache.kernels.cpu_kernels.kernels_compiler`)."""
    if not paged_kernel:
        key = KV_NUMERICS
    else:
        key = ((PAGED_KV_NUMERICS if prompt_ops else PAGED_ATTENTION_NUMERICS)
               + _FORM_NUMERICS[form or prefill_attention.prefill_form()])
        if sliding_form is not None:  # named as a form, "avx2" included, so that its absence can't be confused
            key += f"|sliding-layers:{sliding_form}"
    amx_gemm = bf16_gemms and amx_gemm_supported()
    key += AMX_GEMM_NUMERICS if amx_gemm else ""
    return key + (f"|cc:{kernels_compiler()}" if paged_kernel or amx_gemm or int4 else "")
