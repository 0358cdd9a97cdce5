"""Helpers for the model tests: tiny random HF checkpoints and a small paged-pool driver."""

import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from prefixcache.layers.attention import build_attention_metadata
from prefixcache.models.loader import LoadedModel
from prefixcache.runner.kv_pool import allocate_kv_caches

TINY_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
TINY_ARCHS = {
    "llama": (LlamaConfig, dict(architectures=["LlamaForCausalLM"], tie_word_embeddings=False)),
    "qwen2": (Qwen2Config, dict(architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, dict(architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True, head_dim=32)),
}


def make_tiny_checkpoint(out_dir: Path, arch: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """Saves a random tiny checkpoint of `arch` to `out_dir`; returns the transformers model (eval, fp32)."""
    config_cls, arch_kwargs = TINY_ARCHS[arch]
    config = config_cls(**{**TINY_COMMON, **arch_kwargs, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # make biases and norm weights non-trivial so they are really tested
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(out_dir)
    return model


@dataclass
class PagedDriver:
    """Runs our model over a paged pool with random non-contiguous block tables.

    Each sequence id gets its own blocks, drawn from a shuffled pool; `step` runs one batched forward.
    """

    loaded: LoadedModel
    block_size: int = 4
    num_blocks: int = 96
    seed: int = 0
    kv_caches: list[torch.Tensor] = field(init=False)
    free_blocks: list[int] = field(init=False)
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    num_computed: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        cfg = self.loaded.config
        dtype = next(self.loaded.model.parameters()).dtype
        self.kv_caches = allocate_kv_caches(
            cfg.num_hidden_layers, self.num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim, dtype, "cpu"
        )
        self.free_blocks = list(range(self.num_blocks))
        random.Random(self.seed).shuffle(self.free_blocks)

    def add(self, seq_id: str, num_tokens: int, shared_blocks: list[int] = (), num_computed: int = 0) -> None:
        """Registers a sequence with room for `num_tokens`, optionally starting with shared (cached) blocks."""
        num_blocks = -(-num_tokens // self.block_size)
        own = [self.free_blocks.pop() for _ in range(num_blocks - len(shared_blocks))]
        self.block_tables[seq_id] = list(shared_blocks) + own
        self.num_computed[seq_id] = num_computed

    def step(self, batch: list[tuple[str, list[int]]]) -> dict[str, torch.Tensor]:
        """One forward over the new tokens of each (seq_id, token_ids); returns float32 logits per seq."""
        seqs = [(self.num_computed[s], len(toks), self.block_tables[s]) for s, toks in batch]
        model = self.loaded.model  # the metadata the runner builds for this model
        md, positions = build_attention_metadata(seqs, self.block_size, "cpu", batch_invariant=model.batch_invariant,
                                                 dtype=self.kv_caches[0].dtype, paged_kernel=model.paged_attention,
                                                 sliding_window=self.loaded.config.sliding_window)
        input_ids = torch.tensor([t for _, toks in batch for t in toks], dtype=torch.int64)
        with torch.inference_mode():
            model = self.loaded.model
            logits = model.compute_logits(model(input_ids, positions, md, self.kv_caches))
        out, start = {}, 0
        for s, toks in batch:
            out[s] = logits[start : start + len(toks)]
            start += len(toks)
            self.num_computed[s] += len(toks)
        return out


def chunked_then_decoded(loaded, ids: list[int], seed: int = 3) -> tuple[torch.Tensor, list[int]]:
    """Logits of `ids` run as a 6-token chunk, a 5-token chunk, then one decode step per token, on
    shuffled blocks: ([len(ids), vocab], the block table used)."""
    driver = PagedDriver(loaded, seed=seed)
    driver.add("a", len(ids))
    got = [driver.step([("a", ids[:6])])["a"], driver.step([("a", ids[6:11])])["a"]]
    got += [driver.step([("a", [t])])["a"] for t in ids[11:]]  # decode, one token per step
    return torch.cat(got), driver.block_tables["a"]


# ---------------------------------------------------------------------------- malformed LoRA adapters
def bad_copy(src, dst, config=None, tensors=None, weights_bytes=None):
    """A copy of the adapter dir ``src`` at ``dst`` with its config replaced by the JSON text
    ``config``, its tensors by ``tensors(tensors_of_src)``, or its weights file by raw bytes."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config is not None:
        (dst / "adapter_config.json").write_text(config)
    if tensors is not None:
        save_file(tensors(load_file(dst / "adapter_model.safetensors")), dst / "adapter_model.safetensors")
    if weights_bytes is not None:
        (dst / "adapter_model.safetensors").write_bytes(weights_bytes)
    return dst


def poisoned(value, which="lora_B"):
    """A tensors transform that writes ``value`` into one element of the first ``which`` tensor."""
    def transform(tensors):
        key = sorted(k for k in tensors if which in k)[0]
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[3] = value
        return tensors
    return transform
