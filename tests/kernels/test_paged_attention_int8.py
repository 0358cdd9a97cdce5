"""The paged prompt kernel's int8 products (``attention_dtype="int8"``, the "avx2-int8" form of
csrc/prefill_attention_avx2.cpp): values within int8 rounding of float64 attention, a row's exact bits whatever
its batch, chunking, decode or window, keys before every row's window never read, and the routing, refusals and
cache key."""

import pytest
import torch

from prefixcache.config import EngineConfig
from prefixcache.errors import InvalidInputError
from prefixcache.kernels.cpu_features import format_unavailable_reason
from prefixcache.kernels.prefill_attention import (INT8_FORM, build_paged_rows, form_supported, kernel_form,
                                                   paged_prefill_attention, prefill_kernel_supported)
from prefixcache.layers.attention.numerics import PAGED_AVX2_INT8_NUMERICS, PAGED_KV_NUMERICS, kv_numerics

from test_paged_attention_float32_and_window import BLOCK, DTYPES, Pool

pytestmark = pytest.mark.skipif(not form_supported(INT8_FORM), reason="the kernel's AVX2 form needs AVX2, FMA and F16C")

# q to 7 bits and K to 8 (a score off by ~1 % of its size), p * v_scale to 7 bits and V to 8: on unit-normal
# q, K and V an output is off by at most ~0.045 (the float forms: 2e-5 and bf16's 0.008); a row that sees one
# key outputs its V row to V's rounding, max|v| / 254
TOLERANCE = 0.06


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "window"), [((9, 3, 64), 0), ((4, 1, 256), 0), ((9, 3, 64), 40),
                                               ((8, 2, 128), 1), ((9, 3, 64), 100)])
def test_rows_match_float64_attention_to_int8_rounding(shape, window, dtype):
    pool = Pool(*shape, dtype=dtype)
    batch = [(0, 0, 130), (1, 517, 1), (1, 300, 77), (0, 40, 1)]
    out = pool.run(batch, window, form=INT8_FORM)
    exact = pool.run(batch, window, form="avx2")
    assert out.dtype == dtype and out.shape == exact.shape and not torch.equal(out, exact)
    start, worst = 0, 0.0
    for i, c, n in batch:
        for j in range(n):
            ref = pool.reference(i, c + j, window)
            worst = max(worst, (out[start + j].double() - ref).abs().max().item())
            if window == 1:  # p = 1 at the row's own key: its V row as rounded to int8
                v = pool.pool[1].view(-1, shape[1], shape[2])[pool.tables[i][(c + j) // BLOCK] * BLOCK + (c + j) % BLOCK]
                bound = v.float().abs().amax(-1).repeat_interleave(shape[0] // shape[1]) / 254 + 0.008
                assert ((out[start + j].float() - ref.float()).abs().amax(-1) <= bound).all()
        start += n
    assert 0.005 < worst < TOLERANCE, worst  # rounded, but not far


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 40, 5])
def test_a_row_has_the_same_bits_in_any_batch_chunking_or_decode(window, dtype):
    """Every rounding scale is a row's own (w's over the row's visible keys of a fixed 32-key block), so
    sequence 1's tokens 300..499 get the same bits in one chunk, in two beside other sequences, one by one as
    decodes and inside a cold 500-token prefill (cache on == off)."""
    pool = Pool(9, 3, 64, dtype=dtype)

    def run(batch):
        return pool.run(batch, window, form=INT8_FORM)

    whole = run([(1, 300, 200)])
    split = torch.cat([run([(1, 300, 37)]), run([(0, 5, 90), (1, 337, 163), (0, 10, 1)])[90:253]])
    assert torch.equal(whole, split)
    for pos in (300, 301, 331, 347, 352, 499):
        assert torch.equal(run([(0, 600, 1), (1, pos, 1)])[1], whole[pos - 300]), pos
    assert torch.equal(run([(1, 0, 500)])[300:], whole)


def test_keys_before_every_rows_window_are_never_read():
    """As the float form: released blocks (block 0) and the skipped head of the first 32-key block hold NaN
    and the outputs keep their bits; a NaN K row inside the first row's window makes that row NaN only."""
    pool = Pool(9, 3, 64, dtype=torch.bfloat16)
    batch = [(0, 590, 30), (0, 600, 1)]
    clean = pool.run(batch, window=40, form=INT8_FORM)
    table = list(pool.tables[0])
    pool.pool[:, 0] = float("nan")
    flat = pool.pool.view(2, -1, 3, 64)
    for pos in range(544, 551):
        flat[:, table[pos // BLOCK] * BLOCK + pos % BLOCK] = float("nan")
    released = [0] * 34 + table[34:]
    assert torch.equal(pool.run(batch, window=40, tables=[released, pool.tables[1]], form=INT8_FORM), clean)
    flat[0, table[551 // BLOCK] * BLOCK + 551 % BLOCK] = float("nan")
    poisoned = pool.run(batch, window=40, form=INT8_FORM)
    assert poisoned[0].isnan().all() and not poisoned[1:].isnan().any()


def test_zero_rows_and_a_nan_query_row():
    """An all-zero or tiny q row scores 0 everywhere (the mean of V); a NaN in a q row makes that row NaN, not
    others."""
    pool = Pool(9, 3, 64, dtype=torch.float32)
    pool.q[0][10].zero_()
    pool.q[0][11, 4, 7] = float("nan")
    pool.q[0][13] *= 1e-38  # below 2^-100: rounded against that floor, no 63 / max = inf
    out = pool.run([(0, 0, 20)], form=INT8_FORM)
    for row in (10, 13):
        mean_v = pool.pool[1].view(-1, 3, 64)[[pool.tables[0][p // BLOCK] * BLOCK + p % BLOCK for p in range(row + 1)]]
        assert torch.allclose(out[row], mean_v.mean(0).repeat_interleave(3, 0), atol=0.02), row
    assert out[11, 4].isnan().all() and not out[11, :4].isnan().any() and not out[12:].isnan().any()


def test_routing_and_the_cache_key():
    """int8 products: the "avx2-int8" form for either pool dtype and a window, named in the cache key apart from
    the float AVX2 form; the AMX and AVX-512 forms are never chosen for it."""
    assert kernel_form(torch.bfloat16, int8=True) == kernel_form(torch.float32, True, int8=True) == INT8_FORM
    assert kernel_form(torch.float16, int8=True) is None
    assert prefill_kernel_supported(9, 3, 64, torch.float32, int8=True)
    key = kv_numerics(True, True, form=INT8_FORM)
    assert key.startswith(PAGED_KV_NUMERICS + PAGED_AVX2_INT8_NUMERICS)
    assert key != kv_numerics(True, True, form="avx2")
    assert kv_numerics(True, False, form=INT8_FORM, prompt_ops=False, sliding_form=INT8_FORM) != kv_numerics(
        True, False, form=INT8_FORM, prompt_ops=False, sliding_form="avx2")
    rows = build_paged_rows([0], [4], torch.tensor([[1]]))
    with pytest.raises(ValueError, match="form must be one of"):
        paged_prefill_attention(torch.zeros(4, 9, 64), torch.zeros(2, 4, BLOCK, 3, 64), rows, 0.125, form="int8")


@pytest.mark.parametrize(("options", "match"), [
    (dict(dtype="float32", quantization="none"), "float32 model without int8 weights"),
    (dict(dtype="float32", quantization="int8", device="cuda"), "CPU's paged kernel only"),
])
def test_the_config_refuses_int8_attention_where_it_cant_run(options, match):
    with pytest.raises(InvalidInputError, match=match) as e:
        EngineConfig.from_kwargs(attention_dtype="int8", **options)
    assert e.value.field == "attention_dtype"
    with pytest.raises(InvalidInputError, match="attention_dtype must be one of"):
        EngineConfig.from_kwargs(attention_dtype="fp8", dtype="float32", quantization="int8")
    EngineConfig.from_kwargs(attention_dtype="int8", dtype="float32", quantization="int8")  # runs on every AVX2 CPU
    if format_unavailable_reason("bfloat16", "none") is None:  # bf16's products: refused on an AVX2-only CPU
        EngineConfig.from_kwargs(attention_dtype="int8", dtype="bfloat16", quantization="none")


@pytest.mark.parametrize(("features", "fmt", "expected"), [
    ({"avx2", "fma", "f16c"}, ("bfloat16", "int4-int8"), "int8"),  # a Zen 3: the AVX2 form runs anyway
    ({"avx2", "fma", "f16c"}, ("float32", "int8"), "float"),  # a float32 pool: greedy agreement lost (quality table)
    ({"avx2", "fma", "f16c"}, ("float32", "none"), "float"),  # not on the paged kernel
    ({"avx2", "fma", "f16c", "avx512_bf16"}, ("bfloat16", "int4-int8"), "float"),  # a faster bf16 form runs
    (set(), ("bfloat16", "int4"), "float"),
])
def test_auto_picks_int8_where_the_avx2_form_runs_anyway(monkeypatch, features, fmt, expected):
    import prefixcache.config as config

    monkeypatch.setattr(config, "cpu_has", lambda *names: set(names) <= features)
    dtype, quantization = fmt
    assert EngineConfig(dtype=dtype, quantization=quantization, attention_dtype="auto",
                        device="cpu").attention_dtype == expected
    assert EngineConfig(model="gemma3-270m", dtype=dtype, quantization=quantization, attention_dtype="auto",
                        device="cpu").attention_dtype == "float"  # a model kept in float32 by auto: not measured
    assert EngineConfig(dtype=dtype, quantization=quantization, device="cpu").attention_dtype == "float"  # the API's


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("last", [False, True])
def test_a_nan_v_row_at_a_key_a_row_does_not_see_leaves_its_bits(dtype, last):
    """A NaN V row at key 50 (a later position for rows 48 and 49, in their 32-key block: p = 0 there) makes the
    rows that see it NaN and no other: rows 0..49 keep the bits a 50-token chunk (which doesn't hold key 50) gives
    them, whether key 50 is the block's last key in the call (``last``: a 51-token prefill) or not."""
    pool = Pool(9, 3, 64, dtype=dtype)
    clean = pool.run([(0, 0, 50)], form=INT8_FORM)
    flat = pool.pool.view(2, -1, 3, 64)
    flat[1, pool.tables[0][50 // BLOCK] * BLOCK + 50 % BLOCK] = float("nan")
    out = pool.run([(0, 0, 51 if last else 100)], form=INT8_FORM)
    assert torch.equal(out[:50], clean)
    assert out[50:].isnan().all()
