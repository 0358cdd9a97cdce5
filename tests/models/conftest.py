"""Fixtures for the model tests (helpers live in model_testlib.py)."""

from pathlib import Path

import pytest
import torch
from model_testlib import TINY_ARCHS, make_tiny_checkpoint

from prefixcache.models.loader import LoadedModel, load_model


@pytest.fixture(scope="session", params=sorted(TINY_ARCHS))
def tiny(request, tmp_path_factory) -> tuple[torch.nn.Module, LoadedModel]:
    """(transformers model, our loaded model) for each tiny architecture."""
    out_dir = tmp_path_factory.mktemp(f"tiny-{request.param}")
    ref = make_tiny_checkpoint(out_dir, request.param)
    return ref, load_model(str(out_dir), load_tokenizer=False)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("tiny-llama-files")
    make_tiny_checkpoint(out_dir, "llama")
    return out_dir
