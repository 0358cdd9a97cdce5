"""The cache key's model part (``InputProcessor.model_key``) of the Llama family: the model's own
numerics hook (``numerics_key``) is empty, so the key is exactly the bytes it was before the hook
existed: sha256(fingerprint + "dtype|quantization=...|quantization_key|kv_numerics")."""

from __future__ import annotations

import hashlib
import shutil

import pytest

from prefixcache.config import EngineConfig
from prefixcache.engine.input_processor import InputProcessor
from prefixcache.layers.attention.numerics import KV_NUMERICS
from prefixcache.models.fetch import default_model_dir
from prefixcache.models.loader import load_model
from tests.models.model_testlib import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("tiny-llama-key")
    make_tiny_checkpoint(out_dir, "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, out_dir / name)
    return load_model(str(out_dir))


def test_llama_model_key_is_the_key_without_the_numerics_hook(tiny_llama):
    processor = InputProcessor(EngineConfig(model=str(tiny_llama.model_dir), block_size=4), tiny_llama, 256, 32)
    assert tiny_llama.model.numerics_key == "" and tiny_llama.model.quantization_key == ""
    # float32, no quantization: torch's flash path, no C++ kernel, so no compiler in the key
    expected = hashlib.sha256(tiny_llama.fingerprint + f"torch.float32|quantization=none||{KV_NUMERICS}".encode())
    assert processor.model_key == expected.digest()
