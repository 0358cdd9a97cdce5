"""``prefixcache serve``: flags generated from EngineConfig, every flag checked before the model
loads, and shutdown (SIGTERM within the grace period; a second Ctrl-C) of a real process."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import prefixcache.config
from prefixcache.config import EngineConfig
from prefixcache.kernels.cpu_features import auto_format, format_unavailable_reason
from prefixcache.engine import llm_engine
import prefixcache.entrypoints.cli.main as cli
from prefixcache import host_memory
from prefixcache.entrypoints.cli.preflight import ModelShape, check_writable_dir, kv_block_bytes, model_shape
from prefixcache.entrypoints.cli.serve import add_cli_args, check_serve_args, engine_config_from_args, flag_name
from prefixcache.entrypoints.openai.api_server import build_app
from tests.entrypoints.conftest import MODEL

REPO = Path(__file__).resolve().parents[2]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------- generated flags
def test_every_engine_field_has_one_flag_with_its_default():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    dests = {a.dest: a for a in parser._actions}
    for field in dataclasses.fields(EngineConfig):
        action = dests[field.name]
        assert action.default == field.metadata.get("cli_default", field.default)  # dtype, quantization: auto
        if field.name != "model":
            assert flag_name(field) in action.option_strings
            assert field.metadata["help"].split(" (")[0][:20] in action.help
    assert engine_config_from_args(parse([])) == EngineConfig.from_kwargs(dtype="auto", quantization="auto",
                                                                               attention_dtype="auto")
    assert EngineConfig.from_kwargs().dtype == "float32"  # the Python API's default stays transformers' numbers


def test_existing_flag_names_still_work():
    args = parse([
        "some-model", "--block-size", "32", "--num-blocks", "10", "--kv-cache-memory", "2GiB", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "512", "--max-model-len", "256", "--no-enable-prefix-caching",
        "--hash-algo", "sha256", "--dtype", "float16", "--device", "cuda", "--num-threads", "1", "--seed", "3",
        "--hash-seed", "7", "--eviction-policy", "ttl", "--cache-ttl-s", "5.5", "--no-enable-partial-block-reuse",
        "--cost-half-life-s", "9", "--cost-attention-tokens", "100"])
    assert engine_config_from_args(args) == EngineConfig(
        model="some-model", block_size=32, num_blocks=10, kv_cache_memory_bytes=2 << 30, max_num_seqs=4,
        max_num_batched_tokens=512, max_model_len=256, enable_prefix_caching=False, hash_algo="sha256",
        dtype="float16", device="cuda", num_threads=1, seed=3, hash_seed=7, eviction_policy="ttl", cache_ttl_s=5.5,
        enable_partial_block_reuse=False, cost_half_life_s=9.0, cost_attention_tokens=100.0)
    assert parse(["--kv-cache-memory", "512MiB"]).kv_cache_memory_bytes == 512 << 20
    sizes = {"2GB": 2 * 10**9, "2G": 2 << 30, "2Gi": 2 << 30, "1.5MB": 1_500_000, "3kB": 3000, "4KiB": 4096, "7B": 7}
    for text, expected in sizes.items():  # SI's decimal GB, binary GiB and bare G
        assert parse(["--kv-cache-memory", text]).kv_cache_memory_bytes == expected, text
    assert parse(["--max-request-body-bytes", "1e6"]).max_request_body_bytes == 1_000_000


@pytest.mark.parametrize("argv,message", [
    (["--port", "80000"], "argument --port: not a TCP port (0-65535): '80000'"),
    (["--port", "-1"], "argument --port: not a TCP port"),
    (["--eviction-policy", "fifo"], "argument --eviction-policy: invalid choice: 'fifo'"),
    (["--hash-algo", "md5"], "argument --hash-algo: invalid choice: 'md5'"),
    (["--kv-cache-memory", "1e400"], "argument --kv-cache-memory: not a memory size"),
    (["--kv-cache-memory", "lots"], "argument --kv-cache-memory: not a memory size"),
    (["--max-request-body-bytes", "0"], "argument --max-request-body-bytes: not a memory size >= 1 byte"),
    (["--timeout-request-header", "0"], "argument --timeout-request-header: must be > 0 seconds"),
    (["--timeout-graceful-shutdown", "inf"], "argument --timeout-graceful-shutdown: not a number of seconds"),
    (["--block-size", "x"], "argument --block-size: invalid int value: 'x'"),
])
def test_malformed_flags_are_argparse_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


# ---------------------------------------------------------------------------- checked before loading
@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if serve gets as far as loading a model."""

    def load(*args, **kwargs):
        raise AssertionError("serve loaded the model before finding the bad flag")

    monkeypatch.setattr(llm_engine, "LLMEngine", load)


@pytest.fixture
def busy_port():
    with socket.socket() as other_server:
        other_server.bind(("127.0.0.1", 0))
        other_server.listen()
        yield other_server.getsockname()[1]


def test_startup_errors_come_before_the_model_loads(no_model_load, busy_port, tmp_path, capsys):
    not_adapter = tmp_path / "not-an-adapter"
    not_adapter.mkdir()
    cases = [
        (["--port", str(busy_port)], f"--host 127.0.0.1 --port {busy_port}: cannot bind (Address already in use)"),
        (["--host", "no-such-host.invalid"], "--host 'no-such-host.invalid': not a usable address"),
        (["--host", ""], "--host must not be empty (give 0.0.0.0 to listen on every interface)"),  # was 0.0.0.0
        (["--host", "192.0.2.1"], "--host 192.0.2.1 --port 0: cannot bind (Cannot assign requested address); is it an "
                                  "address of this machine?"),
        (["--lora-modules", f"legal={tmp_path / 'missing'}"], f"--lora-modules legal={tmp_path / 'missing'}: cannot "
                                                              "read the adapter directory (No such file or directory)"),
        (["--lora-modules", f"legal={not_adapter}"], f"--lora-modules legal={not_adapter}: not a PEFT LoRA adapter "
                                                     "directory (no adapter_config.json, adapter_model.safetensors)"),
        (["--served-model-name", "m", "--lora-modules", "m=/x"], "--lora-modules: the adapter name 'm' is the "
                                                                  "served model's name"),  # unreachable: 'm' ran the base
        (["--block-size", "0"], "--block-size: block_size must be an integer >= 1, got 0"),
        (["--cache-ttl-s", "-1"], "--cache-ttl-s: cache_ttl_s must be a finite number > 0, got -1.0"),
        (["--tenant-isolation"], "--tenant-isolation needs API keys"),
        (["--served-model-name", ""], "--served-model-name must not be empty"),
        (["--api-key", "clé"], "--api-key / --tenant-api-key / --api-keys-file: API keys must be"),
    ]
    for argv, message in cases:
        start = time.monotonic()
        assert cli.main(["serve", "--port", "0", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"prefixcache serve: error: {message}") and err.count("\n") == 2, err
        assert err.endswith("\nrun 'prefixcache serve --help' for all options\n"), err
        assert time.monotonic() - start < 5



# ---------------------------------------------------------------------------- what the flags name, before the load
def default_model_fetched() -> bool:
    from prefixcache.models import fetch

    return fetch.is_complete(fetch.default_model_dir())


@pytest.mark.parametrize("flags,line", [
    pytest.param(["--kv-disk-dir", "/proc/nope", "--hash-seed", "1"],
                 "--kv-disk-dir: cannot create or write the directory '/proc/nope' (No such file or directory)",
                 marks=pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc")),
    (["--kv-disk-dir", "{file}", "--hash-seed", "1"], "--kv-disk-dir: '{file}' is an existing file, not a directory"),
    (["--hash-seed-file", "/nonexistent"], "--hash-seed-file: cannot read '/nonexistent': No such file or directory"),
    (["--device", "tpu"], "--device: must be 'cpu' or 'cuda[:N]', got 'tpu'"),
    pytest.param(["--dtype", "bfloat16", "--quantization", "int4", "--lora-modules", "legal={tmp}"],
                 "--lora-modules: adapters need --quantization none or int8; int4 runs generated tokens in fused "
                 "kernels without LoRA deltas",  # it used to start, list the adapter, then 400 on every request
                 marks=pytest.mark.requires_format("bfloat16", "int4")),
    pytest.param(["--dtype", "bfloat16", "--quantization", "int4-int8", "--lora-modules", "legal={tmp}"],
                 "--lora-modules: adapters need --quantization none or int8; int4-int8 runs generated tokens in fused "
                 "kernels without LoRA deltas", marks=pytest.mark.requires_format("bfloat16", "int4-int8")),
    pytest.param(["--quantization", "int8"], "--quantization: quantization='int8' needs fast int8 products",
                 marks=pytest.mark.skipif(format_unavailable_reason("float32", "int8") is None,
                                          reason="int8 runs here")),
    pytest.param(["--dtype", "bfloat16", "--quantization", "none"], "--dtype: dtype='bfloat16' needs a CPU with AVX-512",
                 marks=pytest.mark.skipif(format_unavailable_reason("bfloat16", "none") is None,
                                          reason="bfloat16 runs here")),
    (["--num-blocks", "99999999999"], "--num-blocks: a KV pool of 99999999999 blocks needs "),
    pytest.param(["--block-size", "99999"], "--block-size: block_size 99999 is more than the model's context of 8192 "
                                            "tokens (its max_position_embeddings): such a block never fills",
                 marks=pytest.mark.skipif(not default_model_fetched(), reason="the default model's config")),
])
def test_flags_naming_bad_things_fail_in_a_real_process_before_the_model_loads(tmp_path, flags, line):
    """Each failed after the model loaded (a traceback, or for --num-blocks memory growing without a
    word); now one line naming the flag, exit status 2, before "loading model"."""
    afile = tmp_path / "a-file"
    afile.write_text("x")
    flags = [f.replace("{file}", str(afile)).replace("{tmp}", str(tmp_path)) for f in flags]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "prefixcache", "serve", "--num-threads", "1", "--port", "0", *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    took_s = time.monotonic() - start
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    first, hint = proc.stderr.splitlines()
    assert first.startswith("prefixcache serve: error: " + line.replace("{file}", str(afile))), proc.stderr
    assert hint == "run 'prefixcache serve --help' for all options"
    assert "Traceback" not in proc.stderr and "loading model" not in proc.stderr
    assert took_s < 30  # the imports (torch, for --num-blocks: is the pool bound for CUDA?), not a load


@pytest.fixture
def tiny_model(tmp_path) -> Path:
    """A model directory whose config sizes a KV block: 2 layers x 1 KV head x dim 4, context 64 tokens
    (float32, 16-token blocks: 2 x 2 x 16 x 1 x 4 x 4 = 1024 bytes)."""
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 2,
                                               "num_key_value_heads": 1, "hidden_size": 8,
                                               "max_position_embeddings": 64}))
    (d / "model.safetensors").write_bytes(b"")
    return d


def test_kv_pool_is_sized_from_the_model_config_and_refused_beyond_memory(no_model_load, tiny_model, monkeypatch,
                                                                        capsys):
    monkeypatch.setattr(host_memory, "physical_memory_bytes", lambda: 1 << 20)  # 1 MiB: 1024 blocks of 1024 bytes
    model = [str(tiny_model), "--device", "cpu", "--dtype", "float32"]  # serve's default is auto
    assert model_shape(str(tiny_model)) == ModelShape(num_layers=2, num_kv_heads=1, head_dim=4, context=64)
    # float16: 2-byte K/V, twice the blocks (its products' speed on this CPU is another test's)
    monkeypatch.setattr(prefixcache.config, "format_unavailable_reason", lambda dtype, quantization: None)
    for ok in (["--num-blocks", "1024"], ["--num-blocks", "2048", "--dtype", "float16"], ["--kv-cache-memory", "1MiB"],
               ["--block-size", "64", "--max-model-len", "64", "--kv-cache-memory", "4096"]):
        assert check_serve_args(parse([*model, *ok])).config.model == str(tiny_model)
    cases = [
        (["--num-blocks", "1025"], "--num-blocks: a KV pool of 1025 blocks needs 1049600 bytes (1.0 MiB; 1024 bytes "
                                   "per block), more than the 1048576 bytes (1.0 MiB) of physical memory"),
        (["--kv-cache-memory", "2MiB"], "--kv-cache-memory: a KV pool budget of 2097152 bytes is more than the "
                                        "1048576 bytes (1.0 MiB) of physical memory"),
        (["--block-size", "65"], "--block-size: block_size 65 is more than the model's context of 64 tokens (its "
                                 "max_position_embeddings): such a block never fills"),
        (["--block-size", "64", "--kv-cache-memory", "4095"], "--block-size: one KV block of 64 tokens takes 4096 "
                                                              "bytes, more than the KV pool budget of 4095 bytes "
                                                              "(--kv-cache-memory); lower --block-size or raise "
                                                              "--kv-cache-memory"),
        (["--max-model-len", "65"], "--max-model-len: max_model_len 65 is more than the model's context of 64 tokens "
                                    "(its max_position_embeddings); positions beyond it were never trained"),
    ]
    for argv, line in cases:
        assert cli.main(["serve", "--port", "0", *model, *argv]) == 2, argv
        assert capsys.readouterr().err == (f"prefixcache serve: error: {line}\n"
                                           "run 'prefixcache serve --help' for all options\n")


def test_a_container_memory_limit_bounds_the_pool(no_model_load, tiny_model, tmp_path, monkeypatch, capsys):
    """cgroup v2's memory.max (a number or "max") and v1's memory.limit_in_bytes (~2**63: none) are
    read; the smaller of it and physical memory bounds the pool, named in the error."""
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    monkeypatch.setattr(host_memory, "CGROUP_MEMORY_LIMIT_FILES", (str(v2), str(v1)))
    monkeypatch.setattr(host_memory, "physical_memory_bytes", lambda: 1 << 30)
    assert host_memory.cgroup_memory_limit_bytes() is None  # neither file
    v1.write_text("9223372036854771712\n")
    assert host_memory.cgroup_memory_limit_bytes() is None
    assert host_memory.host_memory_limit() == (1 << 30, "physical memory")
    v2.write_text("max\n")
    assert host_memory.cgroup_memory_limit_bytes() is None  # v2 read first: no limit
    v2.write_text("1048576\n")
    assert host_memory.host_memory_limit() == (1 << 20, "this container's memory limit (cgroup)")
    model = [str(tiny_model), "--device", "cpu", "--dtype", "float32"]  # serve's default is auto
    assert check_serve_args(parse([*model, "--num-blocks", "1024"])).config.num_blocks == 1024
    assert cli.main(["serve", "--port", "0", *model, "--num-blocks", "1025"]) == 2
    assert capsys.readouterr().err.splitlines()[0] == (
        "prefixcache serve: error: --num-blocks: a KV pool of 1025 blocks needs 1049600 bytes (1.0 MiB; 1024 bytes "
        "per block), more than the 1048576 bytes (1.0 MiB) of this container's memory limit (cgroup)")


def test_cluster_checks_all_replicas_pools_together(no_model_load, tiny_model, monkeypatch, capsys):
    """Each replica allocates its own pool, loads the weights and runs a process on this machine:
    4 x (512 blocks of 1024 bytes + the weights + 512 MiB) > 2 GiB; 3 fit."""
    monkeypatch.setattr(host_memory, "physical_memory_bytes", lambda: 2 << 30)
    (tiny_model / "model.safetensors").write_bytes(bytes(1000))  # only its size is read
    weights = 1000
    model = [str(tiny_model), "--device", "cpu", "--dtype", "float32"]  # serve's default is auto
    assert cli.main(["cluster", "--replicas", "4", *model, "--num-blocks", "512"]) == 2
    need = 4 * (524288 + weights + (512 << 20))
    assert capsys.readouterr().err.splitlines()[0] == (
        "prefixcache cluster: error: --num-blocks: a KV pool of 512 blocks needs 524288 bytes (0.5 MiB; 1024 bytes "
        f"per block) plus the {weights} bytes of weights ({weights / (1 << 20):,.1f} MiB) plus 512.0 MiB for the "
        f"process x 4 replicas = {need} bytes ({need / (1 << 30):,.1f} GiB) is more than the 2147483648 bytes "
        "(2.0 GiB) of physical memory")
    assert cli.main(["cluster", "--replicas", "4", *model, "--kv-cache-memory", "768KiB"]) == 2
    assert capsys.readouterr().err.splitlines()[0].startswith(
        "prefixcache cluster: error: --kv-cache-memory: a KV pool budget of 786432 bytes plus the ")
    assert check_serve_args(parse([*model, "--num-blocks", "512"]), replicas=3).config.num_blocks == 512


def test_bench_cluster_checks_its_replicas_before_starting_any(capsys):
    """`bench --workload cluster --cluster-replicas 100000` started replicas one after another
    (192 processes, load average 194) until stopped; now refused before anything starts."""
    from prefixcache.entrypoints.cli.preflight import model_shape

    shape = model_shape("smollm2-135m")
    if shape is None:
        pytest.skip("the default model is not fetched")
    assert cli.main(["bench", "--workload", "cluster", "--cluster-replicas", "100000", "--skip-hf",
                     "--out", ""]) == 2
    pool = 256 * 737280  # the bench's 256 blocks per replica, float32 K/V of SmolLM2
    need = 100000 * (pool + shape.weights_bytes + (512 << 20))
    line = capsys.readouterr().err.splitlines()[0]
    assert line.startswith(f"prefixcache bench: error: --cluster-replicas: a KV pool of 256 blocks needs {pool} bytes "
                           f"(180.0 MiB; 737280 bytes per block) plus the {shape.weights_bytes} bytes of weights"), line
    assert f"x 100000 replicas = {need} bytes" in line and line.endswith("of physical memory")


def test_an_unreadable_model_config_still_bounds_the_pool_from_below(no_model_load, tmp_path, monkeypatch, capsys):
    d = tmp_path / "no-shape"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(host_memory, "physical_memory_bytes", lambda: 1 << 20)
    assert model_shape(str(d)) is None and kv_block_bytes(None, 16, "float32") == 2 * 16 * 4
    f32 = ["--device", "cpu", "--dtype", "float32"]  # the float32 pool's arithmetic (serve's default is auto)
    assert check_serve_args(parse([str(d), *f32, "--num-blocks", "8192"])).config.num_blocks == 8192
    assert cli.main(["serve", "--port", "0", str(d), *f32, "--num-blocks", "8193"]) == 2
    assert capsys.readouterr().err.startswith("prefixcache serve: error: --num-blocks: a KV pool of 8193 blocks needs "
                                              "at least 1048704 bytes (1.0 MiB; at least 128 bytes per block), more "
                                              "than the 1048576 bytes (1.0 MiB) of physical memory\n")


@pytest.mark.skipif(not default_model_fetched(), reason="the default model's config")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bytes_per_block_read_before_the_load_are_the_engines(dtype):
    import torch
    from transformers import AutoConfig

    from prefixcache.models import fetch
    from prefixcache.models.config import ModelConfig
    from prefixcache.runner.kv_pool import kv_cache_bytes_per_block

    c = ModelConfig.from_hf_config(AutoConfig.from_pretrained(fetch.default_model_dir(), local_files_only=True))
    shape = model_shape(MODEL)
    weights = (fetch.default_model_dir() / "model.safetensors").stat().st_size
    assert shape == ModelShape(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, c.max_position_embeddings,
                               weights)
    for block_size in (1, 16, 32):
        assert kv_block_bytes(shape, block_size, dtype) == kv_cache_bytes_per_block(
            c.num_hidden_layers, block_size, c.num_key_value_heads, c.head_dim, getattr(torch, dtype))


def test_a_pool_bound_for_cuda_is_compared_with_the_device_memory(tiny_model, monkeypatch):
    """(No GPU here: torch.cuda faked.) A pool larger than physical memory may fit a GPU; one larger
    than the GPU is refused naming it; a device index the machine lacks is refused before the load."""
    import types

    import torch

    monkeypatch.setattr(host_memory, "physical_memory_bytes", lambda: 1 << 20)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=4 << 20))
    for device in ([], ["--device", "cuda"], ["--device", "cuda:0"]):
        assert check_serve_args(parse([str(tiny_model), *device, "--num-blocks", "4096"])).config.num_blocks == 4096
        with pytest.raises(ValueError, match=r"^--num-blocks: a KV pool of 4097 blocks needs 4195328 bytes \(4.0 MiB; "
                                             r"1024 bytes per block\), more than the 4194304 bytes \(4.0 MiB\) of "
                                             r"CUDA device 0's memory$"):
            check_serve_args(parse([str(tiny_model), *device, "--num-blocks", "4097"]))
    with pytest.raises(ValueError, match=r"^--num-blocks: .* of physical memory$"):  # --device cpu: host memory
        check_serve_args(parse([str(tiny_model), "--device", "cpu", "--num-blocks", "4096"]))
    with pytest.raises(ValueError, match=r"^--device 'cuda:1': this machine has 1 CUDA device \(cuda:0\)$"):
        check_serve_args(parse([str(tiny_model), "--device", "cuda:1"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^--device 'cuda': CUDA is not available on this machine$"):
        check_serve_args(parse([str(tiny_model), "--device", "cuda"]))


def test_a_gguf_model_path_takes_the_lower_bound(tmp_path):
    """A .gguf path's shape is not parsed before the load (no config.json): the pool check uses its
    lower bound (1 layer, 1 KV head of dimension 1)."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(20))
    assert model_shape(str(gguf)) is None


def test_a_creatable_directory_passes_without_a_trace_and_a_file_is_refused(tmp_path):
    nested = tmp_path / "a" / "b"
    assert check_writable_dir(str(nested), "--kv-disk-dir") == nested
    assert list(tmp_path.iterdir()) == []  # the check removes the directories it made (the writer makes them)
    (tmp_path / "kept").mkdir()
    assert check_writable_dir(str(tmp_path / "kept"), "--out") == tmp_path / "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"] and list((tmp_path / "kept").iterdir()) == []
    afile = tmp_path / "f"
    afile.write_text("x")
    with pytest.raises(ValueError, match=r"^--out: '.*/f' is an existing file, not a directory$"):
        check_writable_dir(str(afile), "--out")
    with pytest.raises(ValueError, match=r"^--out: cannot create or write the directory '.*/f/sub' "
                                         r"\(Not a directory\)$"):
        check_writable_dir(str(afile / "sub"), "--out")


def test_hash_seed_file_is_read_before_the_load(no_model_load, tmp_path, capsys):
    short = tmp_path / "short.key"
    short.write_text("tooshort")
    assert cli.main(["serve", "--port", "0", "--hash-seed-file", str(short)]) == 2
    assert capsys.readouterr().err.splitlines()[0] == (f"prefixcache serve: error: --hash-seed-file '{short}' must "
                                                       "hold a secret of at least 16 bytes")
    good = tmp_path / "good.key"
    good.write_text("0123456789abcdef0123")
    assert check_serve_args(parse(["--hash-seed-file", str(good), "--kv-disk-dir", str(tmp_path / "kv")])).config
    assert not (tmp_path / "kv").exists()  # the disk tier creates it when the engine starts


def test_adapter_that_does_not_fit_the_model_stops_startup(smollm2, tmp_path):
    bad = tmp_path / "bad-adapter"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    (bad / "adapter_model.safetensors").write_bytes(b"")
    engine = llm_engine.LLMEngine(EngineConfig(model=MODEL, num_blocks=8, num_threads=2), loaded=smollm2)
    with pytest.raises(ValueError, match=r"LoRA adapter legal=.*bad-adapter: lora: .* is a PREFIX_TUNING adapter"):
        build_app(engine, MODEL, lora_modules={"legal": str(bad)})


# ---------------------------------------------------------------------------- a real process
class ServeProcess:
    """``python -m prefixcache serve`` on a free port; its stderr collected by a thread."""

    def __init__(self, *flags: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prefixcache", "serve", "--port", "0", "--num-blocks", "64", "--num-threads", "1",
             "--max-model-len", "1024", *flags],
            cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.lines: list[str] = []
        self._listening = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._listening.wait(120):
            self.proc.kill()
            raise RuntimeError("serve did not start:\n" + self.stderr)
        url = re.search(r"listening on (http://\S+)", self.stderr).group(1)
        self.url = url
        self.health_attempts = 0  # /health calls until the first 200: 1 if "listening" was logged in time
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            self.health_attempts += 1
            try:
                if httpx.get(url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError("serve never became healthy:\n" + self.stderr)

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if "listening on" in line:
                self._listening.set()

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def stop_in(self, timeout_s: float) -> float:
        """Waits for the process to exit; seconds it took."""
        start = time.monotonic()
        try:
            self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        return time.monotonic() - start


def stream_in_thread(url: str, max_tokens: int, started: threading.Event, out: list) -> threading.Thread:
    def run() -> None:
        body = {"prompt": "Tell me a long story.", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
            out.append((r.status_code, events))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def assert_ended_by_shutdown(out: list) -> None:
    status, events = out[0]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"] == {"message": "server is shutting down", "type":
                                               "service_unavailable_error", "param": None, "code": "engine_dead"}


@pytest.mark.slow  # a real `serve` process / its own copy of the default model
def test_sigterm_waits_for_requests_at_most_the_grace_period():
    s = ServeProcess("--timeout-graceful-shutdown", "2")
    started, out = threading.Event(), []
    long_stream = stream_in_thread(s.url, 900, started, out)  # far longer than 2 s
    assert started.wait(60)
    short = []
    short_thread = threading.Thread(target=lambda: short.append(httpx.post(
        s.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True}, timeout=60)))
    short_thread.start()
    time.sleep(0.2)  # the short request is in flight when the signal comes
    s.proc.send_signal(signal.SIGTERM)
    took_s = s.stop_in(30)
    long_stream.join(10)
    short_thread.join(10)
    assert 1.5 < took_s < 2 + 5, s.stderr
    assert short[0].status_code == 200 and short[0].json()["usage"]["completion_tokens"] == 3
    assert_ended_by_shutdown(out)
    assert s.proc.returncode == -signal.SIGTERM  # uvicorn re-raises the signal it shut down for
    assert "Traceback" not in s.stderr and "ending the requests still in flight" in s.stderr


@pytest.mark.slow  # a real `serve` process / its own copy of the default model
def test_second_ctrl_c_exits_at_once_and_quietly():
    s = ServeProcess("--timeout-graceful-shutdown", "60")
    started, out = threading.Event(), []
    stream = stream_in_thread(s.url, 900, started, out)
    assert started.wait(60)
    s.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert s.proc.poll() is None  # the first Ctrl-C waits for the request
    s.proc.send_signal(signal.SIGINT)
    took_s = s.stop_in(30)
    stream.join(10)
    assert took_s < 10 and s.proc.returncode == 0, s.stderr
    assert_ended_by_shutdown(out)
    for noise in ("Traceback", "Event loop is closed", "CancelledError", "ERROR"):
        assert noise not in s.stderr, s.stderr


@pytest.mark.slow  # a real `serve` process / its own copy of the default model
def test_serve_logs_what_it_serves_then_the_url_then_each_request():
    s = ServeProcess()
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hello there", "max_tokens": 3, "ignore_eos": True},
                   timeout=60)
    deadline = time.monotonic() + 10
    while f"request {r.json()['id']} " not in s.stderr and time.monotonic() < deadline:
        time.sleep(0.05)
    s.proc.send_signal(signal.SIGTERM)
    s.stop_in(30)
    log = s.stderr
    u = r.json()["usage"]
    dtype, quantization = auto_format("auto", "auto")  # serve's default format: this CPU's choice
    attention = EngineConfig(dtype=dtype, quantization=quantization, attention_dtype="auto").attention_dtype
    per_block = 737_280 // (2 if dtype == "bfloat16" else 1)  # SmolLM2: 30 layers, K and V, 3 KV heads of 64, 16 tokens
    expected = [
        f"INFO:     format: --dtype auto --quantization auto --attention-dtype auto chose {dtype} + {quantization}, "
        f"{attention} attention for this CPU (cpu: ",
        "INFO:     loading model smollm2-135m ...",
        "INFO:     model smollm2-135m (",
        f"INFO:     dtype {dtype}, quantization {quantization}" + (", attention int8" if attention == "int8" else "")
        + ", device cpu, 1 thread",
        f"INFO:     KV pool 64 blocks x 16 tokens = 1024 tokens, {64 * per_block / 2**20:.1f} MiB ({per_block} bytes "
        "per block); max model len 1024 tokens",
        "INFO:     prefix caching on (hash xxh64, eviction lru, partial-block reuse on)",
        "INFO:     Application startup complete.",
        f"INFO:     prefixcache serve: listening on {s.url} (Ctrl-C to stop)",
        f"INFO:     request {r.json()['id']} length: prompt {u['prompt_tokens']} tokens (0 cached), completion 3 "
        "tokens, TTFT ",
    ]
    positions = [log.find(line) for line in expected]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), log
    assert "Traceback" not in log
    assert s.health_attempts == 1  # the URL is logged once the server accepts, not before


def test_the_server_logger_follows_the_stderr_of_its_latest_configure(monkeypatch):
    """A second configure (a second server in one process, or the next test) used to keep writing
    to the first stderr; once that was closed, each log line printed a "Logging error" traceback,
    and re-pointing it with setStream raised ValueError (it flushes the closed stream)."""
    import io
    import logging

    from prefixcache.entrypoints.openai.server_log import configure_logging, logger

    root = logging.getLogger("prefixcache")
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "propagate", root.propagate)
    monkeypatch.setattr(root, "level", root.level)
    first, second = io.TextIOWrapper(io.BytesIO()), io.StringIO()  # a closed TextIOWrapper's flush raises
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging("info")
    logger.info("one")
    first.close()
    monkeypatch.setattr(sys, "stderr", second)
    configure_logging("info")
    logger.info("two")
    assert second.getvalue() == "INFO:     two\n"
