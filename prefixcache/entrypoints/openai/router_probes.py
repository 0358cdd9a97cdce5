"""What a router asks a replica before routing to it: the bodies of ``GET /server_info`` and
``GET /model_info`` (SGLang's names; ``/get_server_info`` and ``/get_model_info`` are the older
names, answered the same).

Observed from the SGLang model gateway (``sglang-router`` 0.3.2, its HTTP "regular" router) when a
worker is added: ``GET /health`` (200 = healthy; then every ``--health-check-interval-secs``),
``GET /server_info`` (on 404: ``/get_server_info``), ``GET /model_info`` (on 404:
``/get_model_info``). A 404 or an empty body still registers the worker, but under the model id
``unknown`` and without a tokenizer; from these bodies it takes the model id
(``served_model_name``, else ``model_path``), loads the tokenizer from ``model_path`` /
``tokenizer_path`` (a local directory here: no hub access) and keeps ``tp_size``, ``dp_size``,
``model_type`` and ``architectures`` as worker labels. Requests then go to ``/v1/completions`` and
``/v1/chat/completions`` unchanged but for SGLang's extra sampling fields with their no-op values
(``no_stop_trim``, ``skip_special_tokens``, ``return_hidden_states``, ...), which we ignore or
accept; a chat body is re-serialized from the gateway's own schema, so vLLM extras such as
``cache_salt`` are dropped on the chat route (completions keep them).

Both bodies are small JSON objects of facts fixed at start-up; they carry no key or secret and,
like ``/health``, need no API key.
"""

from __future__ import annotations

import json
from typing import Any

from prefixcache import __version__
from prefixcache.engine.llm_engine import LLMEngine


def server_info(engine: LLMEngine, served_model_name: str) -> dict[str, Any]:
    """SGLang's ``/server_info`` fields that describe this replica.

    Returns:
        ``model_path`` / ``tokenizer_path`` (the local HF directory the weights came from),
        ``served_model_name``, ``context_length`` (tokens), ``max_total_tokens`` (KV pool size in
        tokens), ``max_running_requests``, ``page_size`` (= block size, tokens),
        ``disable_radix_cache`` (prefix caching off), ``tp_size`` / ``dp_size`` / ``pp_size`` (1),
        ``is_embedding`` (False), ``version``.
    """
    config = engine.config
    model_dir = str(engine.loaded.model_dir)
    return {
        "model_path": model_dir,
        "tokenizer_path": model_dir,
        "served_model_name": served_model_name,
        "context_length": engine.max_model_len,
        "max_total_tokens": engine.num_blocks * config.block_size,
        "max_running_requests": config.max_num_seqs,
        "page_size": config.block_size,
        "disable_radix_cache": not config.enable_prefix_caching,
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "is_embedding": False,
        "version": __version__,
    }


def model_info(engine: LLMEngine) -> dict[str, Any]:
    """SGLang's ``/model_info``: ``model_path``, ``tokenizer_path``, ``is_generation`` (True),
    ``has_image_understanding`` / ``has_audio_understanding`` (False), and the ``model_type`` and
    ``architectures`` of the model's ``config.json`` (None where it has none)."""
    model_dir = engine.loaded.model_dir
    try:
        hf_config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        hf_config = {}
    return {
        "model_path": str(model_dir),
        "tokenizer_path": str(model_dir),
        "is_generation": True,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": hf_config.get("model_type"),
        "architectures": hf_config.get("architectures"),
    }
