"""The first hour with the ``prefixcache`` command (issue 17): --version, --help that shows defaults
and choices, errors that list what is accepted, vLLM habits (``serve --model X``, a Hub id), and a
busy port found before the model loads. No test here loads a model."""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

import prefixcache
from prefixcache.bench.workloads import WORKLOAD_NAMES
from prefixcache.cache.eviction import EVICTION_POLICIES
from prefixcache.engine import llm_engine
from prefixcache.entrypoints import cli
from prefixcache.entrypoints.cli_args import add_cli_args, check_serve_args
from prefixcache.models.model_path import check_model_arg

REPO = Path(__file__).resolve().parents[2]
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``prefixcache ARGV`` in-process: (exit status, stdout, stderr)."""
    try:
        code = cli.main(argv)
    except SystemExit as e:  # --help, --version and argparse errors exit
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture
def no_model_load(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(llm_engine, "LLMEngine", load)
    monkeypatch.setattr("prefixcache.models.loader.load_model", load)
    monkeypatch.setattr("prefixcache.entrypoints.demo.load_model", load)


# ---------------------------------------------------------------------------- --version, --help
def test_version_prints_the_package_version_which_matches_pyproject(capsys):
    code, out, _ = run_cli(["--version"], capsys)
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert (code, out) == (0, f"prefixcache {pyproject}\n")
    assert prefixcache.__version__ == pyproject


def test_serve_help_shows_defaults_and_choices(capsys):
    code, out, _ = run_cli(["serve", "--help"], capsys)
    text = flat(out)
    assert code == 0
    policies = ",".join(sorted(EVICTION_POLICIES))
    assert re.search(rf"--eviction-policy {{{policies}}} which free cached block is evicted first .*?\(default: lru\)",
                     text)
    assert "--log-level {critical,error,warning,info,debug} server log level: info logs the start-up summary and " \
           "one line per finished request (default: info)" in text
    assert "--served-model-name SERVED_MODEL_NAME name clients send (default: MODEL)" in text
    assert "--model MODEL the same as the positional MODEL" in text
    assert "--dtype {float32,bfloat16,float16} weights and KV dtype (default: float32)" in text
    assert "--port PORT TCP port, 0-65535 (default: 8000)" in text


def test_every_flag_with_a_default_says_it_in_help():
    parser = argparse.ArgumentParser(formatter_class=cli.DefaultsHelpFormatter)
    add_cli_args(parser)
    formatter = parser._get_formatter()
    checked = 0
    for action in parser._actions:
        d = action.default
        if not action.option_strings or d is None or d is False or d == [] or d is argparse.SUPPRESS:
            continue
        assert "default" in formatter._expand_help(action), action.option_strings
        checked += 1
    assert checked >= 20


@pytest.mark.parametrize("argv,expected", [
    (["fetch", "--help"], "--home HOME cache folder the model is stored in (default: $PREFIXCACHE_HOME, else "
                          "~/.cache/prefixcache)"),
    (["demo", "--help"], "local .gguf file; never downloaded from the Hub (default: smollm2-135m)"),
    (["demo", "--help"], "--block-size BLOCK_SIZE tokens per KV block (default: 16)"),
    (["demo", "--help"], "--num-threads NUM_THREADS torch CPU threads (default: the available cores; on a shared"),
    (["bench", "--help"], "local .gguf file; never downloaded from the Hub (default: smollm2-135m)"),
    (["bench", "--help"], "--max-tokens MAX_TOKENS tokens generated per request (default: 16)"),
    (["bench", "--help"], "'trace' (eviction-policy trace simulation, no model), 'restart' (TTFT after a restart"),
    (["bench", "--help"], "--queue-rate-rps QUEUE_RATE_RPS arrivals per virtual second (Poisson; a 640-block pool "
                          "serves about 13/s) (default: 20.0)"),
    (["bench", "--help"], "--queue-num-blocks QUEUE_NUM_BLOCKS KV pool blocks of 16 tokens (1200 requests allocate "
                          "under 24,000: 30000 never evicts) (default: 640)"),
    (["bench", "--help"], "'queue' (scheduling policies under a queue and memory pressure: scheduler replay, no "
                          "model) and 'cluster' (replicas behind the SGLang gateway: cache_aware vs round_robin vs "
                          "random vs one replica; see --cluster-*) (default: all)"),
])
def test_subcommand_help_documents_flags_and_defaults(capsys, argv, expected):
    code, out, _ = run_cli(argv, capsys)
    assert code == 0 and expected in flat(out)


def test_bench_queue_flags_set_the_replay_and_bad_values_name_the_field(capsys):
    """--queue-num-blocks / --queue-rate-rps reach the replay (a pool that never evicts: fcfs and lpm
    rows equal but for the wall time per step); an out-of-range value is one line naming the field."""
    code, out, err = run_cli(["bench", "--workload", "queue", "--num-requests", "40", "--queue-rate-rps", "30",
                              "--queue-num-blocks", "30000"], capsys)
    assert code == 0, err
    assert "## Queue workload" in out
    fcfs_row, lpm_row = (next(line for line in out.splitlines() if line.startswith(f"| {p} | 0.")).split(" | ")
                         for p in ("fcfs", "lpm"))  # hit rate first (the goal rows have none)
    assert fcfs_row[1:-1] == lpm_row[1:-1] and fcfs_row[8] == "0"  # all but µs/step; 0 evictions
    code, out, err = run_cli(["bench", "--workload", "queue", "--queue-rate-rps", "0"], capsys)
    assert (code, out) == (2, "")
    assert err == "prefixcache: error: rate_rps must be a finite number > 0, got 0.0\n"


def test_bench_unknown_workload_lists_every_workload(capsys):
    code, out, err = run_cli(["bench", "--workload", "foo,seed"], capsys)
    listed = ", ".join((*WORKLOAD_NAMES, "speed", "trace", "restart", "queue", "cluster"))
    assert (code, out) == (2, "")
    assert err == f"prefixcache: error: --workload: unknown workload 'foo'; choose 'all' or a comma-separated list " \
                  f"of {listed}\n"


# ---------------------------------------------------------------------------- the model argument
def serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(argv)


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A directory that passes the pre-load check (config.json + a .safetensors file)."""
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    return d


def test_serve_model_option_is_the_positional(model_dir):
    assert check_serve_args(serve_args(["--model", str(model_dir)])).config.model == str(model_dir)
    assert check_serve_args(serve_args([str(model_dir)])).config.model == str(model_dir)
    assert check_serve_args(serve_args([str(model_dir), "--model", str(model_dir)])).config.model == str(model_dir)
    settings = check_serve_args(serve_args(["--model", str(model_dir)]))
    assert settings.served_model_name == str(model_dir)
    with pytest.raises(ValueError, match=r"^MODEL given twice \('a' and --model 'b'\); give one of the two$"):
        check_serve_args(serve_args(["a", "--model", "b"]))


@pytest.mark.parametrize("argv", [["serve", "--port", "0", HUB_ID], ["serve", "--port", "0", "--model", HUB_ID],
                                  ["demo", "--model", HUB_ID]])
def test_hub_id_explains_local_directory_or_gguf_and_loads_nothing(no_model_load, capsys, argv):
    start = time.monotonic()
    code, out, err = run_cli(argv, capsys)
    assert (code, out) == (2, "")
    assert err == (f"prefixcache: error: model '{HUB_ID}' looks like a Hugging Face Hub id, and no local path has that "
                   "name; prefixcache never downloads from the Hub. Download it yourself where the network is "
                   f"reachable (e.g. `huggingface-cli download {HUB_ID} --local-dir DIR`) and pass DIR (config.json "
                   "+ *.safetensors), or pass a local .gguf file, or use the built-in 'smollm2-135m'\n")
    assert time.monotonic() - start < 5


def test_a_local_directory_named_like_a_hub_id_is_used(tmp_path, monkeypatch):
    d = tmp_path / "HuggingFaceTB" / "SmolLM2-135M-Instruct"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    check_model_arg(HUB_ID)  # exists here: a path, not a Hub id
    with pytest.raises(ValueError, match=r"^model 'missing-dir' is neither the built-in name"):
        check_model_arg("missing-dir")
    (d / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"has no \*\.safetensors weights"):
        check_model_arg(HUB_ID)


def test_serve_checks_the_model_path_before_binding_or_loading(no_model_load, tmp_path, capsys):
    code, _, err = run_cli(["serve", "--port", "0", str(tmp_path / "nothing")], capsys)
    assert code == 2 and err.startswith(f"prefixcache: error: model '{tmp_path / 'nothing'}' is neither the built-in")


# ---------------------------------------------------------------------------- a real process
def test_serve_on_a_busy_port_exits_at_once_naming_it_without_loading():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "prefixcache", "serve", "--port", str(port)], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        took_s = time.monotonic() - start
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"prefixcache: error: --host 127.0.0.1 --port {port}: cannot bind (Address already in "
                           "use); is another server using this port?\n")  # no "loading model" line, no traceback
    assert took_s < 30  # imports only (torch): a model load would add its own seconds and log a line


def test_serve_out_of_range_port_is_an_argparse_error(no_model_load, capsys):
    code, out, err = run_cli(["serve", "--port", "70000"], capsys)
    assert (code, out) == (2, "") and "Traceback" not in err
    assert err.endswith("prefixcache serve: error: argument --port: not a TCP port (0-65535): '70000'\n")
