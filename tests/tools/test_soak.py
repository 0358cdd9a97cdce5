"""``tools/soak.py``: a short real soak (slow) and its report logic on made-up outcomes (fast).

The slow tests run the script as a maintainer does, for 20 s with 6 clients against its own server
(and a fresh one for the greedy check), once per module.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "soak.py"


def load_soak():
    """tools/soak.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("soak_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def soak_run(tmp_path_factory):
    """(exit code, JSON report, printed report) of a 20 s soak with 6 clients."""
    out = tmp_path_factory.mktemp("soak")
    cmd = [sys.executable, str(SCRIPT), "--clients", "6", "--duration-s", "20", "--bad-interval-s", "0.5",
           "--max-tokens", "24", "--json", str(out / "report.json"), "--log-dir", str(out),
           "--num-threads", "1", "--num-blocks", "512", "--max-num-seqs", "8"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode in (0, 1), f"the soak itself failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc.returncode, json.loads((out / "report.json").read_text()), proc.stdout


@pytest.mark.slow
def test_report_accounts_for_every_request(soak_run):
    _, report, printed = soak_run
    soak = report["soak"]
    total = soak["requests"]["total"]
    assert total > 0 and soak["requests"]["good"] > 0 and soak["requests"]["bad"] > 0
    assert sum(soak["statuses"].values()) == total == sum(soak["requests"]["by_kind"].values())
    assert soak["requests"]["good"] + soak["requests"]["bad"] == total
    assert sum(b["sent"] for b in soak["bad_inputs"].values()) == soak["requests"]["bad"]
    assert report["greedy"]["num_prompts"] == 6
    assert set(report["checks"]) == {"no_5xx", "good_requests_ok", "bad_inputs_expected",
                                     "drained_no_blocks_in_use", "rss_growth", "greedy_equal"}
    assert report["rss_mib"]["before"] > 0 and report["rss_mib"]["after"] > 0
    assert report["server"]["exit_code"] is not None  # the soaked server was stopped
    assert ("PASSED" if report["passed"] else "FAILED") in printed


@pytest.mark.slow
def test_soak_passes(soak_run):
    rc, report, printed = soak_run
    assert report["drain"]["kv_blocks_in_use"] == 0, printed
    assert report["soak"]["num_5xx"] == 0, printed
    assert rc == 0 and report["passed"], printed


def test_summary_and_checks_on_made_up_outcomes():
    soak = load_soak()
    O = soak.Outcome
    outcomes = [
        O("chat_stream", 200, 0.0, 1.0, ttft_s=0.2, timed=True),
        O("completion_plain", 200, 0.5, 2.0, timed=True),
        O("chat_disconnect", 200, 1.0, 0.3, ttft_s=0.1),
        O("bad:top_p_1e-46", 200, 1.5, 0.1),
        O("bad:empty_prompt", 400, 2.0, 0.01),
        O("bad:empty_prompt", 503, 3.0, 0.01, problem="HTTP 503 (expected 4xx)"),
        O("chat_stream", 503, 3.1, 0.01, problem="HTTP 503: engine_dead"),
    ]
    s = soak.summarize(outcomes, ["top_p_1e-46", "empty_prompt", "n_1000"])
    assert s["requests"]["total"] == 7 == sum(s["statuses"].values())
    assert s["statuses"] == {"200": 4, "400": 1, "503": 2}
    assert s["num_5xx"] == 2 and s["num_good_failed"] == 1
    assert s["first_5xx"]["kind"] == "bad:empty_prompt" and s["first_5xx"]["answered_s"] == 3.01
    # The first 5xx is the first answered: the plain request sent at 0.5 s was answered at 2.5 s.
    outcomes.append(O("chat_plain", 503, 0.5, 2.0, problem="HTTP 503: engine_dead"))
    s = soak.summarize(outcomes, ["top_p_1e-46", "empty_prompt", "n_1000"])
    assert s["first_5xx"]["kind"] == "chat_plain" and s["first_5xx"]["answered_s"] == 2.5
    assert s["first_5xx"]["bad_inputs_sent_in_the_10_s_before"] == [
        "bad:top_p_1e-46 sent at 1.5 s -> 200", "bad:empty_prompt sent at 2.0 s -> 400"]
    assert [(g["kind"], g["count"]) for g in s["unexpected"]] == [
        ("chat_plain", 1), ("bad:empty_prompt", 1), ("chat_stream", 1)]
    assert s["bad_inputs"]["top_p_1e-46"]["ok"] and not s["bad_inputs"]["empty_prompt"]["ok"]
    assert s["bad_inputs"]["n_1000"]["sent"] == 0
    assert s["latency_s"]["num_ttft"] == 2 and s["latency_s"]["num_e2e"] == 2 and s["latency_s"]["e2e_p99"] == 2.0
    report = {"soak": s, "rss_mib": {"growth": 12.0}, "greedy": {"num_equal": 6, "num_prompts": 6},
              "drain": {"idle": True, "waited_s": 0.1, "kv_blocks_in_use": 0.0, "error": None}}
    checks = soak.checks(report, max_rss_growth_mib=50)
    assert {k: c["ok"] for k, c in checks.items()} == {
        "no_5xx": False, "good_requests_ok": False, "bad_inputs_expected": False,
        "drained_no_blocks_in_use": True, "rss_growth": True, "greedy_equal": True}
    assert "n_1000" in checks["bad_inputs_expected"]["detail"]


def test_bad_inputs_keep_a_lone_surrogate_on_the_wire():
    soak = load_soak()
    cases = {b.name: b for b in soak.bad_inputs("m", max_model_len=64, vocab_size=100)}
    assert b"\\ud800" in cases["lone_surrogate_prompt"].encoded()
    assert json.loads(cases["max_tokens_huge"].encoded())["stream"] is True
    assert json.loads(cases["token_id_eq_vocab"].encoded())["prompt"][-1] == 100
    with pytest.raises(ValueError):
        json.loads(cases["malformed_json"].encoded())
    assert all(b.also_ok == frozenset() for name, b in cases.items() if name != "top_p_1e-46")
