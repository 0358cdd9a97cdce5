"""The model runner on a tiny random Llama: slot copies before the forward pass, the prompt tokens
it counts as computed, sampling (forks share their parent's logits row), generators dropped."""

from __future__ import annotations

import pytest
import torch

from prefixcache.models.loader import load_model
from prefixcache.runner.model_runner import ModelRunner
from prefixcache.sampling_params import SamplingParams
from prefixcache.scheduler_output import CopyOp, ScheduledSeq, SchedulerOutput
from tests.models.model_testlib import make_tiny_checkpoint

B = 4
GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    out_dir = tmp_path_factory.mktemp("tiny-llama-runner")
    make_tiny_checkpoint(out_dir, "llama")
    return ModelRunner(load_model(str(out_dir), load_tokenizer=False), 16, B, torch.device("cpu"), seed=0)


def seq(rid: str, tokens: list[int], start: int, blocks: list[int], prompt_len: int, params=None, forks=()):
    return ScheduledSeq(rid, tokens, start, blocks, params, forks=list(forks), num_prompt_tokens=prompt_len)


def test_counts_the_prompt_tokens_it_runs(runner):
    before = runner.num_prompt_tokens_computed
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    runner.execute_model(SchedulerOutput([seq("a", prompt[:6], 0, [0, 1], 10)]))
    assert runner.num_prompt_tokens_computed - before == 6
    sampled = runner.execute_model(SchedulerOutput([seq("a", prompt[6:], 6, [0, 1, 2], 10, GREEDY)])).sampled_token_ids
    assert runner.num_prompt_tokens_computed - before == 10 and set(sampled) == {"a"}
    runner.execute_model(SchedulerOutput([seq("a", [sampled["a"]], 10, [0, 1, 2], 10, GREEDY)]))
    assert runner.num_prompt_tokens_computed - before == 10  # a decode is not a prompt token


def test_copies_run_before_the_forward_pass(runner):
    for kv in runner.kv_caches:  # [2, num_blocks, block_size, kv_heads, head_dim]
        kv[:, 5] = torch.randn_like(kv[:, 5])
    source = [kv[:, 5, :3].clone() for kv in runner.kv_caches]
    # Block 6 gets slots [0, 3) of block 5; the step then writes its slot 3 only.
    out = SchedulerOutput([seq("c", [42], 3, [6], 4, GREEDY)], copy_ops=[CopyOp(5, 6, 3)])
    runner.execute_model(out)
    for kv, src in zip(runner.kv_caches, source):
        assert torch.equal(kv[:, 6, :3], src)
        assert kv[:, 6, 3].abs().sum() > 0  # written by the forward pass


def test_forks_sample_from_their_parents_row_and_greedy_is_argmax(runner):
    tokens = [3, 1, 4, 1, 5]
    out = SchedulerOutput([seq("g", tokens, 0, [7, 8], 5, GREEDY, forks=[("g#1", GREEDY), ("g#2", GREEDY)])])
    sampled = runner.execute_model(out).sampled_token_ids
    assert set(sampled) == {"g", "g#1", "g#2"} and len(set(sampled.values())) == 1
    # The same prompt alone in other blocks gives the same greedy token (batch and block invariance).
    again = runner.execute_model(SchedulerOutput([seq("h", tokens, 0, [9, 10], 5, GREEDY)])).sampled_token_ids
    assert again["h"] == sampled["g"]


def test_seeded_generators_are_per_request_and_dropped_when_finished(runner):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=4)
    first = runner.execute_model(SchedulerOutput([seq("s", [9, 9, 9], 0, [11], 3, params)]))
    assert "s" in runner._generators
    runner.execute_model(SchedulerOutput(finished_req_ids=["s"]))
    assert "s" not in runner._generators
    again = runner.execute_model(SchedulerOutput([seq("s", [9, 9, 9], 0, [12], 3, params)]))
    assert again == first  # a fresh generator from the same seed


def test_every_bit_of_a_64_bit_seed_counts():
    """torch's CPU generator keeps 32 bits of a seed; the runner mixes all 64 into them."""
    from prefixcache.runner.model_runner import generator_seed

    seeds = [0, 1, 2**32, 2**32 + 1, 2**63, 2**64 - 1, -2, 12345, 12345 + 2**40]
    mixed = [generator_seed(s) for s in seeds]
    assert len(set(mixed)) == len(seeds) and all(0 <= m < 2**32 for m in mixed)
    assert generator_seed(-1) == generator_seed(2**64 - 1) and generator_seed(-(2**63)) == generator_seed(2**63)
