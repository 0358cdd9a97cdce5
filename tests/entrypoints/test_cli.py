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
import prefixcache.entrypoints.cli.main as cli
from prefixcache.entrypoints.cli.serve import add_cli_args, check_serve_args
from prefixcache.models.model_path import check_model_arg

REPO = Path(__file__).resolve().parents[2]
BENCH_HINT = "run 'prefixcache bench --help' for all options\n"
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
    monkeypatch.setattr("prefixcache.entrypoints.cli.demo.load_model", load)


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
    assert "--dtype {auto,float32,bfloat16,float16} weights and KV dtype; auto: this CPU's fastest format within 1 % " \
           "perplexity of float32, with --quantization auto (docs/weight-formats-and-kernels.md); float16 on CUDA, or " \
           "a CPU with AVX512-FP16 (default: auto)" in text
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
    (["demo", "--help"], "--num-threads NUM_THREADS torch CPU threads (default: the free cores, i.e. the cores minus "
                         "those busy now, measured over a quarter second, at least 1;"),
    (["serve", "--help"], "--num-threads NUM_THREADS torch CPU threads (default: the free cores, i.e. the cores "
                          "minus those busy now, measured over a quarter second, at least 1;"),
    (["bench", "--help"], "local .gguf file; never downloaded from the Hub (default: smollm2-135m)"),
    (["bench", "--help"], "--max-tokens MAX_TOKENS tokens generated per request (default: 16)"),
    (["bench", "--help"], "'trace' (eviction-policy trace simulation, no model), 'restart' (TTFT after a restart"),
    (["bench", "--help"], "--queue-rate-rps QUEUE_RATE_RPS arrivals per virtual second (Poisson; a 640-block pool "
                          "serves about 13/s) (default: 20.0)"),
    (["bench", "--help"], "--queue-num-blocks QUEUE_NUM_BLOCKS KV pool blocks of 16 tokens (1200 requests allocate "
                          "under 24,000: 30000 never evicts) (default: 640)"),
    (["bench", "--help"], "'queue' (scheduling policies under a queue and memory pressure: scheduler replay, no "
                          "model), 'cluster' (replicas behind the SGLang gateway: cache_aware vs round_robin vs "
                          "random vs one replica; see --cluster-*), 'flood' (an agent's system prompt under a "
                          "cache breakpoint against one-off prompts, per eviction policy: cache replay, no model), "
                          "'field' (GuideLLM, SGLang's bench_serving and AIPerf, whichever "
                          "--install-field-tools installed, against `prefixcache serve` and, when installed, "
                          "llama.cpp's server; 20 requests unless --num-requests) and 'memory' (each weight "
                          "format's resident memory in a `prefixcache serve` with its 1 GiB KV pool, a process "
                          "each; 1 thread unless --num-threads) (default: all)"),
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
    assert err == "prefixcache bench: error: --queue-rate-rps: rate_rps must be a finite number > 0, got 0.0\n" + BENCH_HINT


def test_bench_unknown_workload_lists_every_workload(capsys):
    code, out, err = run_cli(["bench", "--workload", "foo,seed"], capsys)
    listed = ", ".join((*WORKLOAD_NAMES, "speed", "trace", "restart", "queue", "cluster", "flood", "field", "memory"))
    assert (code, out) == (2, "")
    assert err == f"prefixcache bench: error: --workload: unknown workload 'foo'; choose 'all' or a " \
                  f"comma-separated list of {listed}\n" + BENCH_HINT


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


def test_serve_model_option_is_the_positional(model_dir, capsys):
    assert check_serve_args(serve_args(["--model", str(model_dir)])).config.model == str(model_dir)
    assert check_serve_args(serve_args([str(model_dir)])).config.model == str(model_dir)
    assert check_serve_args(serve_args([str(model_dir), "--model", str(model_dir)])).config.model == str(model_dir)
    settings = check_serve_args(serve_args(["--model", str(model_dir)]))
    assert settings.served_model_name == str(model_dir)
    with pytest.raises(ValueError, match=r"^MODEL given twice \('a' and --model 'b'\); give one of the two$"):
        check_serve_args(serve_args(["a", "--model", "b"]))
    with pytest.raises(SystemExit) as exit_info:  # argparse would keep the last one silently
        serve_args(["--model", "a", "--model", "b"])
    assert exit_info.value.code == 2
    assert "--model given twice ('a' and 'b'); give one of the two" in capsys.readouterr().err
    assert serve_args(["--model", "a", "--model", "a"]).model_option == "a"
    # the default's own name typed is a choice too, not the default (a new user's `serve smollm2-135m --model X`)
    with pytest.raises(ValueError, match=r"^MODEL given twice \('smollm2-135m' and --model 'gemma3-270m'\)"):
        check_serve_args(serve_args(["smollm2-135m", "--model", "gemma3-270m"]))


@pytest.mark.parametrize("argv", [["serve", "--port", "0", HUB_ID], ["serve", "--port", "0", "--model", HUB_ID],
                                  ["demo", "--model", HUB_ID]])
def test_hub_id_explains_local_directory_or_gguf_and_loads_nothing(no_model_load, capsys, argv):
    start = time.monotonic()
    code, out, err = run_cli(argv, capsys)
    assert (code, out) == (2, "")
    assert err == (f"prefixcache {argv[0]}: error: model '{HUB_ID}' looks like a Hugging Face Hub id, and no local path has that "
                   "name; prefixcache never downloads from the Hub. Download it yourself where the network is "
                   f"reachable (e.g. `huggingface-cli download {HUB_ID} --local-dir DIR`) and pass DIR (config.json "
                   "+ *.safetensors), or pass a local .gguf file, or use a built-in model ('smollm2-135m', "
                   "'gemma3-270m')\n"
                   f"run 'prefixcache {argv[0]} --help' for all options\n")
    assert time.monotonic() - start < 5


def test_a_local_directory_named_like_a_hub_id_is_used(tmp_path, monkeypatch):
    d = tmp_path / "HuggingFaceTB" / "SmolLM2-135M-Instruct"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    check_model_arg(HUB_ID)  # exists here: a path, not a Hub id
    with pytest.raises(ValueError, match=r"^model 'missing-dir' is neither a built-in name"):
        check_model_arg("missing-dir")
    (d / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"has no \*\.safetensors weights"):
        check_model_arg(HUB_ID)


def test_serve_checks_the_model_path_before_binding_or_loading(no_model_load, tmp_path, capsys):
    code, _, err = run_cli(["serve", "--port", "0", str(tmp_path / "nothing")], capsys)
    assert code == 2 and err.startswith(f"prefixcache serve: error: model '{tmp_path / 'nothing'}' is neither a "
                                        "built-in")


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
    assert proc.stderr == (f"prefixcache serve: error: --host 127.0.0.1 --port {port}: cannot bind (Address already "
                           "in use); is another server using this port?\n"
                           "run 'prefixcache serve --help' for all options\n")  # no "loading model" line, no traceback
    assert took_s < 30  # imports only (torch): a model load would add its own seconds and log a line


def test_serve_out_of_range_port_is_an_argparse_error(no_model_load, capsys):
    code, out, err = run_cli(["serve", "--port", "70000"], capsys)
    assert (code, out) == (2, "")
    assert err == ("prefixcache serve: error: argument --port: not a TCP port (0-65535): '70000'\n"
                   "run 'prefixcache serve --help' for all options\n")  # no usage block before it


# ---------------------------------------------------------------------------- flags spelled in full
SUBCOMMANDS = ("demo", "fetch", "serve", "cluster", "bench", "analyze")


@pytest.fixture
def no_run(monkeypatch):
    """Fails the test if a subcommand gets past parsing."""

    def run(args, modules):
        raise AssertionError(f"`{args.command}` ran with {args}")

    monkeypatch.setattr(cli, "run_command", run)


def abbreviations(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """``(flag, flag minus its last letter)`` for each long flag whose shortened form is a prefix of
    no other flag: exactly the abbreviations argparse's default (``allow_abbrev=True``) accepts."""
    flags = [f for a in parser._actions for f in a.option_strings if f.startswith("--")]
    return [(f, f[:-1]) for f in flags if [g for g in flags if g.startswith(f[:-1])] == [f]]


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_abbreviated_flag_of_every_subcommand_is_refused(no_run, capsys, command):
    _, parsers, _ = cli.build_parser(command)
    parser = parsers[command]
    assert parser.allow_abbrev is False and isinstance(parser, cli.CLIParser)
    positionals = ["x" for a in parser._actions if not a.option_strings and a.nargs is None]  # analyze's file
    cases = abbreviations(parser)
    for flag, short in cases:
        code, out, err = run_cli([command, *positionals, short], capsys)
        assert (code, out) == (2, ""), short
        assert err == (f"prefixcache {command}: error: unrecognized arguments: {short} (did you mean {flag}?)\n"
                       f"run 'prefixcache {command} --help' for all options\n")
    assert len(cases) >= {"fetch": 3, "demo": 6, "analyze": 5}.get(command, 20)  # --help among them


def test_num_block_was_taken_as_num_blocks_and_now_names_the_flag(no_run, capsys):
    plain = argparse.ArgumentParser()  # argparse's default: the abbreviation silently works
    add_cli_args(plain)
    assert plain.parse_args(["--num-block", "10"]).num_blocks == 10
    code, out, err = run_cli(["serve", "--num-block", "10"], capsys)
    assert (code, out) == (2, "")
    assert err == ("prefixcache serve: error: unrecognized arguments: --num-block (did you mean --num-blocks?)\n"
                   "run 'prefixcache serve --help' for all options\n")
    code, _, err = run_cli(["serve", "--no-enable"], capsys)
    assert code == 2 and err.splitlines()[0] == ("prefixcache serve: error: unrecognized arguments: --no-enable (did "
                                                 "you mean --no-enable-prefix-caching or --no-enable-partial-block-"
                                                 "reuse?)")


def test_a_misspelt_flag_gets_the_closest_one_and_a_wrong_one_none(no_run, capsys):
    code, _, err = run_cli(["demo", "--num-thread=2"], capsys)
    assert code == 2 and err.splitlines()[0] == ("prefixcache demo: error: unrecognized arguments: --num-thread=2 "
                                                 "(did you mean --num-threads?)")
    code, _, err = run_cli(["bench", "--workloads", "seed"], capsys)
    assert code == 2 and err.splitlines()[0] == ("prefixcache bench: error: unrecognized arguments: --workloads seed "
                                                 "(did you mean --workload?)")
    code, _, err = run_cli(["fetch", "--zzz"], capsys)
    assert code == 2 and err.splitlines()[0] == "prefixcache fetch: error: unrecognized arguments: --zzz"


# ---------------------------------------------------------------------------- one error line, then a hint
@pytest.mark.parametrize("argv,line", [
    (["serve", "--port", "70000"], "prefixcache serve: error: argument --port: not a TCP port (0-65535): '70000'"),
    (["serve", "--eviction-policy", "fifo"], "prefixcache serve: error: argument --eviction-policy: invalid choice: "
                                             f"'fifo' (choose from {', '.join(map(repr, sorted(EVICTION_POLICIES)))})"),
    (["cluster", "--replicas", "two"], "prefixcache cluster: error: argument --replicas: invalid int value: 'two'"),
    (["demo", "--block-size", "x"], "prefixcache demo: error: argument --block-size: invalid int value: 'x'"),
    (["bench", "--dtype", "float8"], "prefixcache bench: error: argument --dtype: invalid choice: 'float8' (choose "
                                     "from 'auto', 'float32', 'bfloat16', 'float16')"),
    (["analyze"], "prefixcache analyze: error: the following arguments are required: prompts"),
    (["fetch", "extra"], "prefixcache fetch: error: unrecognized arguments: extra"),
    (["serv"], "prefixcache: error: argument command: invalid choice: 'serv' (choose from 'demo', 'fetch', 'serve', "
               "'cluster', 'bench', 'analyze')"),
    (["--bogus", "serve"], "prefixcache: error: unrecognized arguments: --bogus (options go after the command: "
                           "prefixcache COMMAND [options])"),  # was "the following arguments are required: command"
])
def test_a_bad_flag_prints_its_error_line_and_a_hint_not_the_usage(no_run, capsys, argv, line):
    code, out, err = run_cli(argv, capsys)
    prog = line.split(": error:")[0]
    assert (code, out) == (2, "")
    assert err == f"{line}\nrun '{prog} --help' for all options\n"


# ---------------------------------------------------------------------------- engine options before the load
BLOCK_SIZE_99999 = ("--block-size: block_size 99999 is more than the model's context of 8192 tokens (its "
                    "max_position_embeddings): such a block never fills")  # the default model's config, not loaded


@pytest.mark.parametrize("argv,message", [
    (["demo", "--num-threads", "0"], "--num-threads: num_threads must be an integer >= 1, got 0"),
    (["demo", "--block-size", "0"], "--block-size: block_size must be an integer >= 1, got 0"),
    (["demo", "--model", ""], "--model: model must be a non-empty string, got ''"),
    (["bench", "--num-threads", "0"], "--num-threads: num_threads must be an integer >= 1, got 0"),
    (["bench", "--block-size", "-4", "--workload", "trace"], "--block-size: block_size must be an integer >= 1, "
                                                             "got -4"),
    (["bench", "--workload", "cluster", "--num-threads", "0"], "--num-threads: num_threads must be an integer >= 1, "
                                                               "got 0"),  # was silently 1
    (["bench", "--workload", "queue,seed", "--max-tokens", "0"], "--max-tokens must be a positive integer, got 0"),
    (["bench", "--workload", "cluster", "--num-requests", "0"], "--num-requests must be a positive integer, got 0"),
    (["bench", "--workload", "multi-turn", "--num-turns", "9"], "--num-turns: num_turns must be in [1, 8], got 9"),
    (["bench", "--text-scale", "0"], "--text-scale: text_scale must be in (0, 1], got 0.0"),
    (["bench", "--workload", "queue", "--queue-rate-rps", "nan"], "--queue-rate-rps: rate_rps must be a finite "
                                                                  "number > 0, got nan"),  # named the field only
    (["bench", "--workload", "queue", "--queue-num-blocks", "0"], "--queue-num-blocks: num_blocks must be an "
                                                                  "integer >= 1, got 0"),
    (["serve", "--port", "0", "--num-threads", "2147483648"], "--num-threads: num_threads must be at most 4096 "
                                                              "(torch CPU threads), got 2147483648"),  # after the load
    (["serve", "--port", "0", "--num-threads", "0"], "--num-threads: num_threads must be an integer >= 1, got 0"),
    (["serve", "--port", "0", "--hash-seed", "1", "--kv-redis-url", "redis://127.0.0.1:abc/0"],
     "--kv-redis-url: kv_redis_url 'redis://127.0.0.1:abc/0': Port could not be cast to integer value as 'abc'"),
    (["serve", "--port", "0", "--device", "tpu"], "--device: must be 'cpu' or 'cuda[:N]', got 'tpu'"),  # was after
    (["serve", "--port", "0", "--hash-seed-file", "/nonexistent"], "--hash-seed-file: cannot read '/nonexistent': "
                                                                   "No such file or directory"),  # the load, unnamed
    (["demo", "--block-size", "99999"], BLOCK_SIZE_99999),
    (["bench", "--workload", "seed", "--block-size", "99999"], BLOCK_SIZE_99999),
    pytest.param(["bench", "--workload", "queue", "--num-requests", "5", "--out", "/proc/nope"],
                 "--out: cannot create or write the directory '/proc/nope' (No such file or directory)",
                 marks=pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc")),  # was after the run
])
def test_bad_engine_options_fail_before_anything_loads_or_runs(no_model_load, monkeypatch, capsys, argv, message):
    def not_run(*args, **kwargs):
        raise AssertionError("a workload ran before the options were checked")

    from prefixcache.bench import cli as bench_cli
    from prefixcache.bench import runner

    for name in ("run_trace_cli", "run_queue_cli", "run_cluster_cli", "run_restart_cli"):
        monkeypatch.setattr(bench_cli, name, not_run)
    monkeypatch.setattr(runner, "run_bench", not_run)
    start = time.monotonic()
    code, out, err = run_cli(argv, capsys)
    assert (code, out, err) == (2, "", f"prefixcache {argv[0]}: error: {message}\n"
                                       f"run 'prefixcache {argv[0]} --help' for all options\n")
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("workload", ["queue", "trace", "seed"])
def test_bench_out_at_an_existing_file_is_refused_before_anything_runs(no_model_load, monkeypatch, tmp_path, capsys,
                                                                       workload):
    """FileExistsError tracebacks, after the whole run (queue: the report; trace: bench/cli.py)."""
    from prefixcache.bench import cli as bench_cli
    from prefixcache.bench import runner

    def not_run(*args, **kwargs):
        raise AssertionError("a workload ran before --out was checked")

    for name in ("run_trace_cli", "run_queue_cli"):
        monkeypatch.setattr(bench_cli, name, not_run)
    monkeypatch.setattr(runner, "run_bench", not_run)
    afile = tmp_path / "results"
    afile.write_text("x")
    code, out, err = run_cli(["bench", "--workload", workload, "--num-threads", "1", "--out", str(afile)], capsys)
    assert (code, out, err) == (2, "", f"prefixcache bench: error: --out: '{afile}' is an existing file, not a "
                                       f"directory\n{BENCH_HINT}")
    new_dir = tmp_path / "new" / "results"
    with pytest.raises(AssertionError, match="a workload ran"):  # a missing directory passes, then the run
        run_cli(["bench", "--workload", workload, "--num-threads", "1", "--out", str(new_dir)], capsys)
    assert not (tmp_path / "new").exists()  # the check leaves nothing; the report writer makes it


def test_bench_out_at_a_file_exits_at_once_in_a_real_process(tmp_path):
    afile = tmp_path / "results"
    afile.write_text("x")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "prefixcache", "bench", "--workload", "trace", "--out", str(afile)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == f"prefixcache bench: error: --out: '{afile}' is an existing file, not a directory\n" + BENCH_HINT
    assert time.monotonic() - start < 30  # the trace simulation did not run first


def test_run_demo_checks_its_engine_options_before_loading(no_model_load):
    from prefixcache.entrypoints.cli.demo import run_demo
    from prefixcache.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=r"^num_threads must be an integer >= 1, got 0$") as e:
        run_demo(num_threads=0)
    assert e.value.field == "num_threads"
    with pytest.raises(InvalidInputError, match=r"^unknown engine option\(s\) \['num_thread'\]") as e:
        run_demo(num_thread=2)


def test_demo_with_zero_threads_exits_at_once_in_a_real_process():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "prefixcache", "demo", "--num-threads", "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    took_s = time.monotonic() - start
    assert (proc.returncode, proc.stdout) == (2, "")
    # the whole stderr: no "loading smollm2-135m ..." line, no progress bar, no traceback
    assert proc.stderr == ("prefixcache demo: error: --num-threads: num_threads must be an integer >= 1, got 0\n"
                           "run 'prefixcache demo --help' for all options\n")
    assert took_s < 30  # the imports only; the demo itself takes minutes


def test_bare_prefixcache_prints_the_overview_like_pip(no_run, capsys):
    code, out, err = run_cli([], capsys)
    assert (code, err) == (0, "")
    assert out.startswith("usage: prefixcache [-h] [--version]")
    assert "LLM inference with automatic prefix caching" in out
    assert "serve               OpenAI-compatible HTTP server" in out


@pytest.mark.parametrize("argv", [["--version"], *([c, "--help"] for c in SUBCOMMANDS), ["bench", "--workload", "foo"],
                                  ["bench", "--workload", "seed", "--max-tokens", "0"], ["serve", "--port", "70000"],
                                  ["demo", "--num-threads", "0"]])
def test_version_help_and_flag_checks_import_neither_torch_nor_transformers(argv):
    """They answer in a fraction of a second (`--version` took 3 s and `bench --workload foo` 10 s
    when they imported torch): the model's libraries are imported when a command runs."""
    code = ("import sys\nimport prefixcache.entrypoints.cli.main as cli\ntry:\n    cli.main(sys.argv[1:])\n"
            "except SystemExit:\n    pass\nprint(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines()[-1] == "[]", proc.stderr
