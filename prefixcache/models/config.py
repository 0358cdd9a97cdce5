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
    # Gemma 3 only (the Llama family keeps the defaults):
    hidden_act: str = "silu"  # MLP activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU)
    layer_types: tuple[str, ...] = ()  # per layer "sliding_attention" or "full_attention"; () = all full
    sliding_window: int | None = None  # keys a local layer's query attends to, itself included; None: no local layer
    rope_local_theta: float | None = None  # RoPE base of the local layers (global layers: rope_theta)
    query_pre_attn_scalar: float | None = None  # attention scale = query_pre_attn_scalar ** -0.5 (None: head_dim)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) when set

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
        if architecture == "Gemma3ForCausalLM":
            return cls._from_gemma3(hf_config)
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

    @classmethod
    def _from_gemma3(cls, hf_config: PretrainedConfig) -> "ModelConfig":
        """A Gemma 3 text config (``Gemma3TextConfig``: ``rope_parameters`` per layer type).

        Raises:
            ValueError: an activation, rope type, layer type or attention feature our Gemma 3 code
                doesn't run (attention logit softcapping, bidirectional attention), naming the field.
        """
        hidden_act = getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh"
        if hidden_act != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported hidden_activation {hidden_act!r}; Gemma 3 runs 'gelu_pytorch_tanh'")
        if getattr(hf_config, "attn_logit_softcapping", None) is not None:
            raise ValueError("attn_logit_softcapping is not supported (Gemma 3 checkpoints leave it null)")
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is not supported (causal language models only)")
        layer_types = tuple(hf_config.layer_types)
        unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
        if unknown or len(layer_types) != hf_config.num_hidden_layers:
            raise ValueError(f"layer_types must name 'sliding_attention' or 'full_attention' for each of the "
                             f"{hf_config.num_hidden_layers} layers, got {list(layer_types)}")
        rope = getattr(hf_config, "rope_parameters", None) or {}
        thetas = {}
        for kind in ("full_attention", "sliding_attention"):
            params = rope.get(kind) or {}
            if params.get("rope_type", "default") != "default":
                raise ValueError(f"rope_parameters[{kind!r}].rope_type {params['rope_type']!r} is not supported "
                                 "for Gemma 3; only 'default'")
            thetas[kind] = float(params.get("rope_theta", 1_000_000.0 if kind == "full_attention" else 10_000.0))
        window = getattr(hf_config, "sliding_window", None)
        if "sliding_attention" in layer_types and (window is None or int(window) < 1):
            raise ValueError(f"sliding_window must be >= 1 for sliding_attention layers, got {window!r}")
        softcap = getattr(hf_config, "final_logit_softcapping", None)
        return cls(
            architecture="Gemma3ForCausalLM",
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=hf_config.num_attention_heads,
            num_key_value_heads=hf_config.num_key_value_heads,
            head_dim=hf_config.head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=thetas["full_attention"],
            rope_scaling=None,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)),
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            o_proj_bias=bool(getattr(hf_config, "attention_bias", False)),
            mlp_bias=False,
            qk_norm=True,
            hidden_act=hidden_act,
            layer_types=layer_types,
            sliding_window=int(window) if "sliding_attention" in layer_types else None,
            rope_local_theta=thetas["sliding_attention"],
            query_pre_attn_scalar=float(hf_config.query_pre_attn_scalar),
            final_logit_softcapping=None if softcap is None else float(softcap),
        )
