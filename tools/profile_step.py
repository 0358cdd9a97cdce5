"""Where a forward pass spends its time: torch.profiler over one cold prefill, a short decode, or the
speed bench's 10 prompts x 32 tokens with every prompt already cached (``--speed-batch``: its decode
steps), or its one step that prefills the 10 prompts' own tokens over the cached system prompt
(``--speed-suffixes``), or one such suffix alone, as the speed bench's warm TTFT has it (``--warm-suffix``).

    .venv/bin/python tools/profile_step.py [--quantization int8 | --dtype bfloat16] [--prefill-tokens 2000 | --decode-tokens 16 | --speed-batch | --speed-suffixes]
"""

import argparse

from torch.profiler import ProfilerActivity, profile, record_function

import prefixcache.layers.attention.torch_attention as attention
import prefixcache.layers.linear as linear
import prefixcache.models.llama as llama

from prefixcache import LLM, SamplingParams
from prefixcache.bench.workloads import build_speed_prompts
from prefixcache.layers.decode_layers import DecodeLayers
from prefixcache.sample_texts import SYSTEM_PROMPT

p = argparse.ArgumentParser()
p.add_argument("--quantization", default="none")
p.add_argument("--dtype", default="float32")
p.add_argument("--num-threads", type=int, default=2)
p.add_argument("--prefill-tokens", type=int, default=2000)
p.add_argument("--decode-tokens", type=int, default=0, help="profile this many decode steps instead")
p.add_argument("--speed-batch", action="store_true", help="profile the speed bench's 10 x 32 run, prompts cached")
p.add_argument("--speed-suffixes", action="store_true",
               help="profile the 10 x 32 run's step that prefills the 10 prompts' suffixes, the system prompt cached")
p.add_argument("--warm-suffix", action="store_true",
               help="profile one prompt's suffix over the cached system prompt (the warm TTFT's prefill)")
args = p.parse_args()


def recorded(module, name: str) -> None:
    """Wraps ``module.name`` (a module or class attribute) in a profiler range: our C++ kernels
    are not profiler events themselves, so their time shows under these names."""
    fn = getattr(module, name)

    def wrapper(*a, **kw):
        with record_function(f"prefixcache::{name}"):
            return fn(*a, **kw)

    setattr(module, name, wrapper)


recorded(DecodeLayers, "run")  # int4: generated rows' layers (C++: products, attention, norms in one call)
recorded(llama, "group_int8_linear")  # the lm head of generated rows (int4 formats)
recorded(linear, "int8_product")  # int8 / int4-int8 prompt rows' products (C++ or torch._int_mm)
recorded(linear, "amx_linear")  # bf16 linear layers on our AMX kernel (C++), where the CPU has AMX-BF16
recorded(attention, "paged_prefill_attention")  # bf16 prompt rows' attention (C++, one call per layer) ...
recorded(llama, "paged_prefill_attention")  # ... from the fused layers too
for fused_op in ("add_rms_norm", "rope_write_kv", "silu_mul"):  # bf16 prompt rows' element-wise ops (C++)
    recorded(llama, fused_op)
llm = LLM(quantization=args.quantization, dtype=args.dtype, num_threads=args.num_threads)
llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
if args.speed_batch:
    prompts = build_speed_prompts(llm.engine.tokenizer, 10).shared
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # every prompt's blocks cached: the profiled run decodes
elif args.speed_suffixes:
    prompts = build_speed_prompts(llm.engine.tokenizer, 10).shared
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # the prefix cached
    prompts, params = prompts[1:], SamplingParams(temperature=0, max_tokens=1)  # nine suffixes in one step
elif args.warm_suffix:
    prompts = build_speed_prompts(llm.engine.tokenizer, 10).shared
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # the prefix cached
    prompts, params = prompts[1:2], SamplingParams(temperature=0, max_tokens=1)
elif args.decode_tokens:
    prompts, params = ["The capital of France is"], SamplingParams(temperature=0, max_tokens=args.decode_tokens,
                                                                   ignore_eos=True)
else:
    ids = llm.engine.tokenizer((SYSTEM_PROMPT + " ") * 40).input_ids[: args.prefill_tokens]
    prompts, params = [ids], SamplingParams(temperature=0, max_tokens=1)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    llm.generate(prompts, params, use_tqdm=False)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
