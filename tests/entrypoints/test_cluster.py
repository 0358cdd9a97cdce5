"""``prefixcache cluster``: 2 real ``prefixcache serve`` replicas behind the real SGLang model
gateway (sglang-router), on loopback.

The module's cluster serves the routing, honesty, ``manual`` policy and failover tests in order
(the last kills a replica). What the gateway's ``cache_aware`` policy does (sglang-router 0.3.2): a
request whose text matches a worker's tree by more than ``--cache-threshold`` (0.3 of its
characters) goes to that worker; otherwise to the least loaded one (ties: the first). So a second
system prompt is sent while the first one's request runs, to land on the other replica.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.entrypoints.cli.cluster import (ROUTING_KEY_HEADER, Cluster, ClusterOptions, ClusterStartError,
                                                 add_cli_args, healthy_workers, serve_argv)
from prefixcache.entrypoints.cli.serve import add_cli_args as add_serve_args

MODEL = "smollm2-135m"
BLOCK = 16
SERVE = (MODEL, "--num-blocks", "128", "--num-threads", "1", "--no-enable-partial-block-reuse",
         "--log-level", "warning", "--timeout-graceful-shutdown", "2")
SYSTEMS = ("You are the support assistant of a small public library. Answer briefly and politely. " * 3,
           "You are a terse assistant for a bicycle repair shop in Lyon; always quote prices in euros. " * 3)
QUESTIONS = ("When do you open on Sunday?", "Can I renew a book online?", "Do you lend e-readers?")


def messages(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def chat(url: str, system: str, question: str, max_tokens: int = 2) -> dict:
    body = {"model": MODEL, "messages": messages(system, question), "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def counters(replica_url: str) -> dict[str, float]:
    """The replica's prefix-cache queries and hits (tokens) and running requests."""
    text = httpx.get(replica_url + "/metrics", timeout=10).text
    wanted = {"prefixcache:prefix_cache_queries_total": "queries", "prefixcache:prefix_cache_hits_total": "hits",
              "prefixcache:num_requests_running": "running"}
    return {wanted[s.name]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name in wanted}


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(ClusterOptions(2, "cache_aware", SERVE, startup_timeout_s=300, stop_timeout_s=20,
                               health_check_interval_s=1))
    c.start()
    yield c
    c.stop()


def served(cluster: Cluster, send) -> tuple[int, dict, dict]:
    """Runs ``send()`` (one request through the gateway); returns the index of the replica whose
    queries grew, the usage, and that replica's counter deltas."""
    before = [counters(r.url) for r in cluster.replicas]
    usage = send()
    after = [counters(r.url) for r in cluster.replicas]
    (k,) = [k for k in range(len(before)) if after[k]["queries"] > before[k]["queries"]]
    return k, usage, {name: after[k][name] - before[k][name] for name in ("queries", "hits")}


@pytest.mark.slow
def test_shared_system_prompts_stay_on_the_replica_that_cached_them(cluster):
    gateway, replicas = cluster.url, cluster.replicas
    # 1st system prompt, a long answer: it runs while the 2nd system prompt's first request arrives
    first = threading.Thread(target=chat, args=(gateway, SYSTEMS[0], QUESTIONS[0], 48))
    before = [counters(r.url)["queries"] for r in replicas]
    first.start()
    while not any(counters(r.url)["running"] for r in replicas):
        time.sleep(0.02)
    (home_a,) = [k for k, r in enumerate(replicas) if counters(r.url)["queries"] > before[k]]
    home_b, usage, delta = served(cluster, lambda: chat(gateway, SYSTEMS[1], QUESTIONS[0]))
    first.join()
    assert home_b != home_a  # the new prompt went to the idle replica
    assert usage["prompt_tokens_details"]["cached_tokens"] == delta["hits"] == 0
    homes = {0: home_a, 1: home_b}
    for s, system in enumerate(SYSTEMS):
        tokens = [tokenize(replicas[0].url, system, q) for q in QUESTIONS]
        for j, question in enumerate(QUESTIONS[1:], start=1):
            k, usage, delta = served(cluster, lambda: chat(gateway, system, question))
            assert k == homes[s], f"system prompt {s}, question {j}: went to replica {k}"
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert usage["prompt_tokens"] == delta["queries"] == len(tokens[j])
            assert cached == delta["hits"]  # what the gateway passes on is the replica's own count
            # the longest common prefix with an earlier request of this system prompt, in whole blocks
            assert cached == max(common_prefix_len(tokens[j], tokens[i]) for i in range(j)) // BLOCK * BLOCK > 0


def tokenize(replica_url: str, system: str, question: str) -> list[int]:
    body = {"model": MODEL, "messages": messages(system, question)}
    return httpx.post(replica_url + "/tokenize", json=body, timeout=30).json()["tokens"]


@pytest.mark.slow
def test_streamed_usage_through_the_gateway_is_the_replicas_count(cluster):
    body = {"model": MODEL, "messages": messages(SYSTEMS[0], "Is there parking nearby?"), "max_tokens": 3,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}

    def send() -> dict:
        import json

        with httpx.stream("POST", cluster.url + "/v1/chat/completions", json=body, timeout=120) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        return chunks[-1]["usage"]

    chat(cluster.url, SYSTEMS[0], QUESTIONS[0])  # the system prompt is cached (again, if the order differs)
    _, usage, delta = served(cluster, send)
    assert usage["prompt_tokens_details"]["cached_tokens"] == delta["hits"] > 0
    assert usage["prompt_tokens"] == delta["queries"]


@pytest.mark.slow
def test_manual_policy_keeps_each_routing_key_on_one_replica(cluster):
    """The gateway reads the key from the header only (the client copies ``prompt_cache_key``
    there). Under ``manual`` a request without the header goes to a random replica, so 12 requests
    that stay on their key's replica (chance: 1 in 1024) are the header's doing."""
    import openai

    policy = cluster.options.policy
    try:
        cluster.switch_policy("manual")
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def send(key: str, question: str) -> dict:
            response = client.chat.completions.create(
                model=MODEL, messages=messages(SYSTEMS[0], question), max_tokens=2, temperature=0,
                prompt_cache_key=key, extra_headers={ROUTING_KEY_HEADER: key})
            return response.usage.model_dump()

        homes: dict[str, list[int]] = {"A": [], "B": []}
        for i in range(6):  # interleaved, A B A B ...
            for key in homes:
                k, _, _ = served(cluster, lambda: send(key, QUESTIONS[i % len(QUESTIONS)]))
                homes[key].append(k)
        assert all(len(set(h)) == 1 for h in homes.values()), homes
    finally:
        cluster.switch_policy(policy)  # the tests below expect the module's cache_aware gateway


@pytest.mark.slow
def test_a_killed_replica_is_routed_around(cluster):
    victim, _, _ = served(cluster, lambda: chat(cluster.url, SYSTEMS[0], QUESTIONS[0]))
    survivor = 1 - victim
    cluster.replicas[victim].popen.kill()
    cluster.replicas[victim].popen.wait()
    for j, question in enumerate(QUESTIONS):  # at once, and after the gateway's health check saw it
        before = counters(cluster.replicas[survivor].url)["queries"]
        usage = chat(cluster.url, SYSTEMS[0], question)
        assert counters(cluster.replicas[survivor].url)["queries"] - before == usage["prompt_tokens"]
        if j == 0:
            deadline = time.monotonic() + 15
            while healthy_workers(cluster.url) != {cluster.replicas[survivor].url}:
                assert time.monotonic() < deadline, healthy_workers(cluster.url)
                time.sleep(0.2)


@pytest.mark.slow
def test_stop_ends_every_process(cluster):
    pids = [p.popen.pid for p in cluster.processes]
    assert len(pids) == 3
    cluster.stop()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_a_failed_start_stops_what_it_started(tmp_path):
    """The replica can't load its model: the start fails, naming it, and nothing is left running."""
    (tmp_path / "config.json").write_text("{}")  # a directory with no weights
    c = Cluster(ClusterOptions(1, "round_robin", (str(tmp_path), "--num-threads", "1"), startup_timeout_s=120,
                               stop_timeout_s=10))
    with pytest.raises(ClusterStartError, match="replica-0 exited with status 2"):
        c.start()
    assert [p.popen.returncode for p in c.processes] == [2]
    with pytest.raises(ProcessLookupError):
        os.kill(c.processes[0].popen.pid, 0)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cli_ctrl_c_stops_the_gateway_and_the_replicas():
    argv = [sys.executable, "-m", "prefixcache", "cluster", *SERVE, "--replicas", "1", "--port", "0",
            "--router-policy", "round_robin"]
    launcher = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in launcher.stderr:
            lines.append(line)
            if "prefixcache cluster: gateway on" in line:
                break
        assert "prefixcache cluster: gateway on" in lines[-1], "".join(lines[-20:])
        gateway = lines[-1].split("gateway on ")[1].split()[0]
        assert httpx.post(gateway + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                          timeout=60).status_code == 200
        children = _children(launcher.pid)
        assert len(children) == 2  # the replica and the gateway
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=60) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# ---------------------------------------------------------------------------- no processes
@pytest.mark.parametrize("argv", [
    [],
    ["/models/x", "--no-enable-prefix-caching", "--num-blocks", "64", "--kv-cache-memory", "2GiB"],
    ["--tenant-isolation", "--tenant-api-key", "a=k1", "--tenant-api-key", "b=k2", "--approved-prefix", "P"],
    ["--lora-modules", "a=/x", "b=/y", "--timeout-keep-alive", "2.5", "--served-model-name", "m", "--seed", "3"],
])
def test_serve_argv_reproduces_the_serve_flags(argv):
    cluster_parser, serve_parser = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_cli_args(cluster_parser)
    add_serve_args(serve_parser)
    cluster_args = cluster_parser.parse_args([*argv, "--host", "0.0.0.0", "--port", "9000", "--replicas", "3"])
    forwarded = serve_parser.parse_args(serve_argv(cluster_args))
    expected = serve_parser.parse_args(argv)
    assert vars(forwarded) == vars(expected)
    assert "--host" not in serve_argv(cluster_args) and "--port" not in serve_argv(cluster_args)


@pytest.mark.parametrize("options, message", [
    (ClusterOptions(0), "--replicas must be an integer >= 1"),
    (ClusterOptions(2, policy="power_of_two"), "--router-policy must be one of"),
    (ClusterOptions(2, serve_args=("--port", "1")), "--port of the replicas is chosen by the cluster"),
    (ClusterOptions(2, serve_args=("--host=0.0.0.0",)), "--host of the replicas is chosen by the cluster"),
])
def test_bad_options_start_nothing(options, message):
    c = Cluster(options)
    with pytest.raises(ValueError, match=message):
        c.start()
    assert c.processes == []


def test_a_busy_gateway_port_starts_nothing():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        c = Cluster(ClusterOptions(1, port=busy.getsockname()[1]))
        with pytest.raises(ValueError, match="--port .*cannot bind"):
            c.start()
    assert c.processes == []


def test_kv_events_on_several_replicas_are_refused():
    from prefixcache.entrypoints.cli.cluster import run_cli

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(["--replicas", "2", "--kv-events-config", '{"enable_kv_cache_events": true}'])
    with pytest.raises(ValueError, match="--kv-events-config: every replica would bind the same endpoints"):
        run_cli(args)
