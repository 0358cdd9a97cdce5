"""RoPE: our roll form gives transformers' rotate-half formula's exact bits."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from prefixcache.layers.rotary import RotaryEmbedding, apply_rotary_emb


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_roll_form_equals_rotate_half_bits(dtype):
    torch.manual_seed(0)
    rope = RotaryEmbedding(64, 10000.0, None)
    positions = torch.arange(0, 9000, 7)
    cos, sin_rot = rope(positions, dtype)
    freqs = positions[:, None].float() * rope.inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin().to(dtype)  # [num_tokens, head_dim]
    assert torch.equal(sin_rot[:, 0, 32:], sin[:, 32:]) and torch.equal(sin_rot[:, 0, :32], -sin[:, :32])
    q, k = torch.randn(len(positions), 9, 64).to(dtype), torch.randn(len(positions), 3, 64).to(dtype)
    # transformers' function on [batch, heads, tokens, head_dim], cos/sin [batch, tokens, head_dim]
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None, :, 0],
                                        sin[None])
    assert torch.equal(apply_rotary_emb(q, cos, sin_rot), q_ref[0].transpose(0, 1))
    assert torch.equal(apply_rotary_emb(k, cos, sin_rot), k_ref[0].transpose(0, 1))
