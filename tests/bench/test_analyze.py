"""``prefixcache analyze`` on a generated file with a known answer: chat requests whose system prompt starts
with a timestamp (one minute apart), two exact repeats and one completion prompt in another tenant.

The expected numbers are computed here independently, by brute force over the token ids: a prompt's
hit = its longest common prefix with any earlier prompt of its namespace, in full blocks, never its
last token; the breaker is the one differing minute digit; moving it to the end of every prompt
(token ids as they are) gives the "if moved" hit rate.
"""

from __future__ import annotations

import json

import pytest

from prefixcache.bench.analyze import analyze, read_prompts
from prefixcache.entrypoints.cli.main import main

BS = 16
SYSTEM = ("You are the support assistant of the ACME online store. Answer in two sentences, politely, and "
          "only about orders, shipping, returns and our product catalogue. Never invent prices.")
MINUTES = [0, 1, 2, 3, 4, 5, 2, 4]  # the last two are exact repeats of the 3rd and 5th


def chat_line(minute: int) -> dict:
    return {"messages": [{"role": "system", "content": f"Current time: 2026-11-30T10:0{minute}:00Z. {SYSTEM}"},
                         {"role": "user", "content": f"Question about minute {minute}: where is my order?"}]}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from prefixcache.models.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"), local_files_only=True)


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [json.dumps(chat_line(m)) for m in MINUTES]
    lines.insert(3, json.dumps({"prompt": "Hello from another tenant.", "tenant": "other"}))
    path.write_text("\n".join(lines) + "\n\n")
    return path


def brute_hits(seqs: list[list[int]]) -> int:
    total = 0
    for i, s in enumerate(seqs):
        best = 0
        for t in seqs[:i]:
            n = 0
            while n < min(len(s) - 1, len(t)) and s[n] == t[n]:
                n += 1
            best = max(best, n // BS * BS)
        total += best
    return total


def test_analyze_known_answer(prompts_file, tok):
    ids = [tok.encode(tok.apply_chat_template(chat_line(m)["messages"], tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False) for m in MINUTES]
    other = tok.encode("Hello from another tenant.")
    prompts = read_prompts(prompts_file, tok)
    assert [p.token_ids for p in prompts] == ids[:3] + [other] + ids[3:]
    report = analyze(prompts, BS, lambda t: tok.decode(list(t)))

    total = sum(map(len, ids)) + len(other)
    p = next(i for i, (a, b) in enumerate(zip(ids[0], ids[1])) if a != b)  # the minute digit
    assert tok.decode(ids[0][p : p + 1]) == "0" and tok.decode(ids[0][p - 4 : p]) == "10:0"
    assert report["num_prompts"] == 9 and report["prompt_tokens"] == total
    assert report["exact_repeat_rate"] == 2 / 9
    assert report["hit_tokens"] == brute_hits(ids) and report["hit_rate"] == brute_hits(ids) / total
    assert report["prefix_repeat_rate"] == sum(
        brute_hits(ids[: i + 1]) > brute_hits(ids[:i]) for i in range(len(ids))) / 9

    (b,) = report["breakers"]  # the minute: 5 prompts broke from the first at token p
    assert (b["kind"], b["position"], b["block"], b["count"]) == ("datetime", p, p // BS, 5)
    assert b["examples"][0] == {"request": "1", "chain": "0"}
    lost = [next(n for n, (x, y) in enumerate(zip(ids[0][p + 1 :], s[p + 1 :])) if x != y) for s in ids[1:6]]
    assert tok.decode(ids[1][p + 1 : p + 1 + lost[0]]).endswith("Question about minute ")
    assert b["tokens_lost"] == sum(lost)
    moved = [s[:p] + s[p + 1 :] + s[p : p + 1] for s in ids]
    expected_moved = brute_hits(moved) / total
    assert b["hit_rate_if_moved"] == pytest.approx(expected_moved, abs=0)
    assert report["hit_rate_if_all_moved"] == pytest.approx(expected_moved, abs=0)
    assert expected_moved > report["hit_rate"] + 0.3


def test_analyze_cli(prompts_file, capsys):
    assert main(["analyze", str(prompts_file), "--json", "--block-size", "16"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_prompts"] == 9 and report["breakers"][0]["kind"] == "datetime"
    assert main(["analyze", str(prompts_file)]) == 0
    text = capsys.readouterr().out
    assert "cache breakers:    5" in text and "datetime" in text


def test_analyze_bad_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"nope": 1}\n')
    assert main(["analyze", str(bad)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
