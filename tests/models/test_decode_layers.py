"""quantization="int4": generated tokens run through layers/decode_layers.py (kernels/csrc/decode_layers.cpp)
on tiny random Llama, Qwen2 (q/k/v bias) and Qwen3 (q/k norm) checkpoints: the same bits alone, beside
other decodes, beside prompt rows and recomputed in a prefill chunk; close to float32 math over the
same 4-bit weights; the same bits from its AVX2 and AVX-512 builds."""

import pytest
import torch
from model_testlib import TINY_ARCHS, make_tiny_checkpoint

from prefixcache.layers.attention.metadata import build_attention_metadata
from prefixcache.models.loader import load_model
from prefixcache.runner.kv_pool import allocate_kv_caches

pytestmark = pytest.mark.requires_isa("avx2")  # the decoder's AVX2 or AVX-512 build (cpu_kernels.load_int4_kernels)

BLOCK = 4


@pytest.fixture(scope="module", params=sorted(TINY_ARCHS))
def tiny_dir(request, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp(f"tiny-int4-{request.param}")
    make_tiny_checkpoint(out_dir, request.param, seed=7)
    return out_dir


class Runner:
    """Our model over a pool, sequences with fixed token ids (prompt then "generated"), any batch."""

    def __init__(self, loaded, tokens: dict[str, list[int]], prompt_lens: dict[str, int]):
        cfg = loaded.config
        self.model, self.tokens, self.prompt_lens = loaded.model, tokens, prompt_lens
        self.dtype = next(loaded.model.parameters()).dtype
        self.kv = allocate_kv_caches(cfg.num_hidden_layers, 64, BLOCK, cfg.num_key_value_heads, cfg.head_dim,
                                     self.dtype, "cpu")
        free = iter([5, 40, 2, 33, 17, 9, 60, 1, 22, 48, 13, 29, 55, 7, 38, 11, 26, 51])  # scattered blocks
        self.tables = {s: [next(free) for _ in range(-(-len(t) // BLOCK))] for s, t in tokens.items()}

    def step(self, batch: list[tuple[str, int, int]]) -> dict[tuple[str, int], torch.Tensor]:
        """batch: (seq, start, num_new); returns each new token's final hidden state by (seq, position)."""
        md, positions = build_attention_metadata(
            [(start, n, self.tables[s]) for s, start, n in batch], BLOCK, "cpu", batch_invariant=True,
            dtype=self.dtype, num_pool_blocks=64, num_prompt_tokens=[self.prompt_lens[s] for s, _, _ in batch])
        ids = torch.tensor([t for s, start, n in batch for t in self.tokens[s][start : start + n]])
        with torch.inference_mode():
            hidden = self.model(ids, positions, md, self.kv)
        keys = [(s, p) for s, start, n in batch for p in range(start, start + n)]
        return dict(zip(keys, hidden))


def _tokens(n, seed):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_generated_rows_get_the_same_bits_in_any_batch(tiny_dir):
    loaded = load_model(str(tiny_dir), load_tokenizer=False, dtype=torch.bfloat16, quantization="int4")
    assert loaded.model.model.decode_layers is not None
    tokens, prompt_lens = {"a": _tokens(19, 1), "b": _tokens(14, 2)}, {"a": 13, "b": 9}
    # a alone: prompt, then its generated positions 13..18 one decode at a time
    alone = Runner(loaded, tokens, prompt_lens)
    ref = alone.step([("a", 0, 13)])
    for p in range(13, 19):
        ref |= alone.step([("a", p, 1)])
    # a and b together: both prompts in one step, decodes together; b's prompt beside a's decodes
    both = Runner(loaded, tokens, prompt_lens)
    got = both.step([("a", 0, 13)])
    got |= both.step([("a", 13, 1), ("b", 0, 9)])  # a mixed step: a generated row beside prompt rows
    for i in range(1, 6):
        got |= both.step([("b", 8 + i, 1), ("a", 13 + i, 1)])
    # recomputed after a preemption: a's prompt tail and generated tokens in one chunk, beside b's decode
    again = Runner(loaded, tokens, prompt_lens)
    again.step([("b", 0, 9)])
    rec = again.step([("a", 0, 6)])
    rec |= again.step([("a", 6, 13), ("b", 9, 1)])
    for p in range(19):
        assert torch.equal(got[("a", p)], ref[("a", p)]), p
        assert torch.equal(rec[("a", p)], ref[("a", p)]), p
    b_alone = Runner(loaded, tokens, prompt_lens)
    b_ref = b_alone.step([("b", 0, 9)])
    for p in range(9, 14):
        b_ref |= b_alone.step([("b", p, 1)])
    assert all(torch.equal(got[("b", p)], b_ref[("b", p)]) for p in range(14))


def _dequantized(w) -> torch.Tensor:
    """An Int4Weight's weight as the kernel reads it: level * scale + min, float32 [out, in]."""
    blocks, k8, _ = w.packed.shape
    p = w.packed.view(blocks, k8, 16, 4)
    q = torch.stack([p & 15, p >> 4], dim=3)  # [blocks, k / 8, 16 outputs, half, 4]
    q = q.permute(0, 2, 1, 3, 4).reshape(blocks * 16, k8 * 8).float()
    groups = w.scale.shape[1]
    scale = w.scale.float().transpose(1, 2).reshape(blocks * 16, groups).repeat_interleave(32, dim=1)
    low = w.min.float().transpose(1, 2).reshape(blocks * 16, groups).repeat_interleave(32, dim=1)
    return q * scale + low


def _on_int8_grid(x: torch.Tensor) -> torch.Tensor:
    """x rounded as qgemm.cpp quantizes it: per row and 32 inputs, d = max|x| / 127, round(x / d) * d."""
    groups = x.reshape(*x.shape[:-1], -1, 32)
    d = groups.abs().amax(-1, keepdim=True) / 127
    return (torch.round(groups / torch.where(d > 0, d, 1)) * d).reshape(x.shape)


def test_generated_rows_follow_the_float_model_over_the_same_4bit_weights(tiny_dir):
    """A float32 model holding the dequantized 4-bit weights (and the bf16 model's other weights), its
    projections fed int8-grid activations as the kernel's, prefilled over the whole sequence, vs our
    generated rows (every position generated): apart from bf16 q, K, V and outputs, the same math, so
    a wrong norm, RoPE, attention or SwiGLU step would show (errors would grow with the position)."""
    loaded = load_model(str(tiny_dir), load_tokenizer=False, dtype=torch.bfloat16, quantization="int4")
    ref = load_model(str(tiny_dir), load_tokenizer=False)  # float32, quantization none
    with torch.no_grad():
        for name, param in ref.model.named_parameters():
            param.copy_(dict(loaded.model.named_parameters())[name].float())
        for ours, theirs in zip(loaded.model.model.layers, ref.model.model.layers):
            attn, ref_attn = ours.self_attn, theirs.self_attn
            qkv = _dequantized(attn.qkv.decode_weight)
            sizes = [m.weight.shape[0] for m in (ref_attn.q_proj, ref_attn.k_proj, ref_attn.v_proj)]
            for m, w in zip((ref_attn.q_proj, ref_attn.k_proj, ref_attn.v_proj), qkv.split(sizes)):
                m.weight.copy_(w)
            ref_attn.o_proj.weight.copy_(_dequantized(attn.o.decode_weight))
            gate, up = _dequantized(ours.mlp.gate_up.decode_weight).chunk(2)
            theirs.mlp.gate_proj.weight.copy_(gate)
            theirs.mlp.up_proj.weight.copy_(up)
            theirs.mlp.down_proj.weight.copy_(_dequantized(ours.mlp.down.decode_weight))
    for name, module in ref.model.named_modules():  # the kernels' int8 activations, per row and 32 inputs
        if name.endswith("_proj"):
            module.register_forward_pre_hook(lambda _, args: (_on_int8_grid(args[0]), *args[1:]))
    tokens, prompt_lens = {"a": _tokens(40, 3)}, {"a": 0}  # every position generated (also the first)
    ours = Runner(loaded, tokens, prompt_lens)
    got = {}
    for p in range(40):
        got |= ours.step([("a", p, 1)])
    floats = Runner(ref, tokens, {"a": 40})  # all prompt rows: the float model's one-call path
    want = floats.step([("a", 0, 40)])
    for p in range(40):
        g, w = got[("a", p)].float(), want[("a", p)].float()
        assert (g - w).norm() / w.norm() < 0.04, p  # measured 0.9-2.7 % (bf16 q, K, V, attention out, output)


@pytest.mark.requires_isa("avx512")  # both builds
def test_the_decoder_gives_the_same_bits_in_its_avx2_and_avx512_builds(tiny_dir):
    """Four generated rows (40 keys in scattered blocks, 1, 13, 29) through every layer and the final norm in each
    build, the AVX-512 one told the tier below AVX512-BF16 (its attention then takes the float32 form, the AVX2
    build's only one): the same residual stream, the same K/V written, the same final norm."""
    from prefixcache.kernels.avx2_kernels import load_avx2_kernels
    from prefixcache.kernels.cpu_features import TIERS, kernel_tier
    from prefixcache.kernels.cpu_kernels import load_cpu_kernels

    loaded = load_model(str(tiny_dir), load_tokenizer=False, dtype=torch.bfloat16, quantization="int4")
    cfg, args = loaded.config, loaded.model.model.decode_layers._args
    g = torch.Generator().manual_seed(5)
    pools = [torch.randn(2, 40, BLOCK, cfg.num_key_value_heads, cfg.head_dim, generator=g).to(torch.bfloat16)
             for _ in range(cfg.num_hidden_layers)]
    hidden = torch.randn(4, cfg.hidden_size, generator=g)
    table = torch.stack([torch.randperm(40, generator=g)[:10] for _ in range(4)]).to(torch.int32).contiguous()
    lens = torch.tensor([40, 1, 13, 29], dtype=torch.int32)
    avx512 = load_cpu_kernels()
    avx512.set_kernel_tier(list(TIERS).index("avx512"))
    try:
        results = []
        for kernels in (load_avx2_kernels(), avx512):
            impl = kernels.DecodeLayers(*args)
            h, kv = hidden.clone(), [p.clone() for p in pools]
            impl.run(h, table, lens, BLOCK, kv, 0, cfg.num_hidden_layers)
            results.append((h, kv, impl.final_norm(h)))
    finally:
        avx512.set_kernel_tier(list(TIERS).index(kernel_tier()))
    (h2, kv2, out2), (h5, kv5, out5) = results
    assert not torch.equal(h2, hidden) and torch.isfinite(h2).all()
    assert torch.equal(h2.view(torch.int32), h5.view(torch.int32))
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(kv2, kv5))
    assert torch.equal(out2.view(torch.int16), out5.view(torch.int16))
