"""What our model code needs from a checkpoint's config.json (parsed once, frozen).

Its own module so the model classes and the loader both import it at run time, without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from prefixcache.layers.rotary import compute_inv_freq


@dataclass(frozen=True)
class ModelConfig:
    """What our model code needs from a checkpoint's config.json."""

    architecture: str  # config.json architectures[0], e.g. "LlamaForCausalLM"
    vocab_size: int  # rows of the embedding and lm_head
    hidden_size: int  # residual stream width
    intermediate_size: int  # MLP inner width
    num_hidden_layers: int  # decoder layers
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # KV heads (GQA when fewer than query heads)
    head_dim: int  # dimension per head (Qwen3 may differ from hidden_size / heads)
    rms_norm_eps: float  # epsilon of every RMSNorm
    rope_theta: float  # RoPE base wavelength
    rope_scaling: dict | None  # rope_parameters of a scaled RoPE (with "rope_type"), None for plain RoPE
    max_position_embeddings: int  # longest sequence the model supports, in tokens
    tie_word_embeddings: bool  # lm_head shares the embedding weight
    attention_bias: bool  # q/k/v projections have a bias
    o_proj_bias: bool  # the output projection has a bias
    mlp_bias: bool  # gate/up/down projections have a bias
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)

    @classmethod
    def from_hf_config(cls, hf_config: PretrainedConfig) -> "ModelConfig":
        """Parses a transformers config (rope parameters standardized by transformers).

        Raises:
            ValueError: Unsupported activation, sliding window, partial rotary or rope type;
                the message names the config field.
        """
        architectures = getattr(hf_config, "architectures", None) or []
        if not architectures:
            raise ValueError("config.json has no `architectures` entry")
        architecture = architectures[0]  # the loader checked it against the registry
        hidden_act = getattr(hf_config, "hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; only 'silu' is supported")
        if "sliding_attention" in (getattr(hf_config, "layer_types", None) or []):
            raise ValueError("sliding-window attention (use_sliding_window / layer_types) is not supported")
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        if "rope_theta" not in rope:
            rope["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
        rope.setdefault("rope_type", rope.pop("type", "default"))
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("rope_parameters.partial_rotary_factor != 1.0 is not supported")
        if rope["rope_type"] == "llama3":
            rope.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        if architecture == "Qwen2ForCausalLM":  # Qwen2: q/k/v always biased, o_proj never
            attention_bias, o_proj_bias = True, False
        else:
            attention_bias = o_proj_bias = bool(getattr(hf_config, "attention_bias", False))
        config = cls(
            architecture=architecture,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=hf_config.num_attention_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=float(rope.pop("rope_theta")),
            rope_scaling=None if rope["rope_type"] == "default" else rope,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
        )
        compute_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)  # validates rope_type early
        return config
