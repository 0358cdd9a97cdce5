"""Helpers for the model tests: tiny random HF checkpoints and a small paged-pool driver."""

import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

from prefixcache.config import EngineConfig
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.layers.attention.metadata import build_attention_metadata
from prefixcache.layers.grouped_attention import build_grouped_attention_metadata
from prefixcache.models.loader import LoadedModel, load_model
from prefixcache.runner.kv_pool import allocate_kv_caches, kv_cache_groups_of
from prefixcache.sampling_params import SamplingParams

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


def tiny_gemma3_config(layer_types: list[str], sliding_window: int, **overrides) -> Gemma3TextConfig:
    """A Gemma 3 text config small enough to build in a test: 64 wide, 4 query heads and 1 KV head of 32 dims,
    a 256-token vocabulary (ids < 256 of any tokenizer fit), one layer per entry of ``layer_types``, Gemma 3's
    two RoPE bases (global 1e6, local 1e4); ``overrides`` set or replace any field."""
    return Gemma3TextConfig(**{
        **dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types),
               num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
               rms_norm_eps=1e-6, sliding_window=sliding_window, query_pre_attn_scalar=24, layer_types=layer_types,
               rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
               architectures=["Gemma3ForCausalLM"], tie_word_embeddings=True,
               bos_token_id=1, eos_token_id=2, pad_token_id=0),
        **overrides})


def save_tiny_gemma3(out_dir: Path, layer_types: list[str], sliding_window: int, seed: int,
                     **overrides) -> torch.nn.Module:
    """Saves a random tiny Gemma 3 (:func:`tiny_gemma3_config`, logit soft-capping 30, weights drawn with
    std 0.1, norm weights moved off Gemma's 0: a factor 1 would hide them) with the default model's
    tokenizer files beside it (an engine decodes what it generates; ids stay < 256); returns the
    transformers model (eval, fp32)."""
    from prefixcache.models.fetch import default_model_dir

    config = tiny_gemma3_config(layer_types, sliding_window, **{
        "final_logit_softcapping": 30.0, "initializer_range": 0.1, **overrides})
    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in ref.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    ref.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, Path(out_dir) / name)
    return ref


# The tiny Gemma 3 of the engine tests (test_gemma3_engine, _tiers, _partial_and_events): 6 layers, local
# local global local local global, window 8, blocks of 4 tokens, so the engine makes one full group {2, 5}
# and two sliding groups {0, 1}, {3, 4} of two layers each.
GEMMA3_BLOCK_SIZE = 4
GEMMA3_WINDOW = 8  # sliding_window: a query at p reads keys p - 7 .. p
GEMMA3_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
GEMMA3_SEED = 1  # the weights' seed: the engine tests' modules build the same checkpoint


def save_engine_gemma3(out_dir: Path) -> torch.nn.Module:
    """Saves the engine tests' tiny Gemma 3 (:func:`save_tiny_gemma3` of the constants above, eager
    attention in the transformers reference); returns the transformers model."""
    return save_tiny_gemma3(out_dir, GEMMA3_LAYER_TYPES, GEMMA3_WINDOW, seed=GEMMA3_SEED,
                            attn_implementation="eager")


def load_engine_gemma3(out_dir: Path) -> LoadedModel:
    """:func:`save_engine_gemma3` into ``out_dir``, then our load of it."""
    save_engine_gemma3(out_dir)
    return load_model(str(out_dir))


def make_gemma3_engine(loaded: LoadedModel, num_blocks: int = 200, **options) -> LLMEngine:
    """An engine over ``loaded`` with blocks of :data:`GEMMA3_BLOCK_SIZE`, one thread; ``options`` are
    further ``EngineConfig`` fields."""
    return LLMEngine(EngineConfig(model=str(loaded.model_dir), block_size=GEMMA3_BLOCK_SIZE, num_blocks=num_blocks,
                                  num_threads=1, **options), loaded=loaded)


def token_ids(n: int, seed: int) -> list[int]:
    """``n`` token ids in [3, 256) drawn from ``seed`` (past the tiny vocabulary's special ids 0-2)."""
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy sampling of exactly ``max_tokens`` tokens (EOS ignored)."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


GEMMA3_PREFIX = token_ids(40, seed=1)  # 10 full blocks, well past the window
GEMMA3_TAILS = [token_ids(3, seed=2), token_ids(5, seed=3), token_ids(2, seed=4)]


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
    A model with KV-cache groups (``uses_kv_cache_groups``, Gemma 3) gets what the runner gives it:
    ``layers_per_group`` pool tensors, one block table per group (``group_tables``; group 0's is
    ``block_tables``) and a ``GroupedAttentionMetadata``; after each step a sliding group's blocks
    outside every later window become block 0 in its table, as the engine's released blocks do.
    ``grouped=False`` runs such a model on one table and one tensor per layer instead.
    """

    loaded: LoadedModel
    block_size: int = 4
    num_blocks: int = 96
    seed: int = 0
    grouped: bool | None = None  # None: as the model asks (uses_kv_cache_groups)
    kv_caches: list[torch.Tensor] = field(init=False)
    free_blocks: list[int] = field(init=False)
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    group_tables: dict[str, list[list[int]]] = field(default_factory=dict)
    num_computed: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        cfg = self.loaded.config
        dtype = next(self.loaded.model.parameters()).dtype
        if self.grouped is None:
            self.grouped = bool(getattr(self.loaded.model, "uses_kv_cache_groups", False))
        self.groups = kv_cache_groups_of(self.loaded.model, cfg) if self.grouped else None
        num_tensors = self.groups.layers_per_group if self.grouped else cfg.num_hidden_layers
        self.kv_caches = allocate_kv_caches(
            num_tensors, self.num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim, dtype, "cpu"
        )
        self._allocated: dict[str, list[list[int]]] = {}  # every group's blocks, released ones included
        self.free_blocks = list(range(self.num_blocks))
        random.Random(self.seed).shuffle(self.free_blocks)

    def add(self, seq_id: str, num_tokens: int, shared_blocks: list[int] = (), num_computed: int = 0) -> None:
        """Registers a sequence with room for `num_tokens`, optionally starting with shared (cached)
        blocks: group 0's, a prefix of another sequence's table (every group's then shared)."""
        num_blocks = -(-num_tokens // self.block_size)
        n_shared = len(shared_blocks)
        if not self.grouped:
            own = [self.free_blocks.pop() for _ in range(num_blocks - n_shared)]
            self.block_tables[seq_id] = list(shared_blocks) + own
        else:
            source = next((s for s, t in self.block_tables.items() if t[:n_shared] == list(shared_blocks)), None)
            assert n_shared == 0 or source is not None, "shared_blocks must be a prefix of a sequence's table"
            # a released block keeps its K/V here (the driver never reuses a block), as a cached one does
            self._allocated[seq_id] = [
                (self._allocated[source][g][:n_shared] if n_shared else [])
                + [self.free_blocks.pop() for _ in range(num_blocks - n_shared)]
                for g in range(self.groups.num_groups)]
            self.group_tables[seq_id] = [list(t) for t in self._allocated[seq_id]]
            self.block_tables[seq_id] = self.group_tables[seq_id][0]
        self.num_computed[seq_id] = num_computed

    def metadata(self, seqs: list[tuple[str, int]]):
        """The runner's metadata for (seq_id, num_new_tokens) pairs: ``(metadata, positions)``."""
        model = self.loaded.model

        options = dict(batch_invariant=model.batch_invariant, dtype=self.kv_caches[0].dtype,
                       paged_kernel=model.paged_attention)
        if not self.grouped:
            return build_attention_metadata([(self.num_computed[s], n, self.block_tables[s]) for s, n in seqs],
                                            self.block_size, "cpu", sliding_window=self.loaded.config.sliding_window,
                                            **options)
        return build_grouped_attention_metadata(
            self.groups, lambda g: [(self.num_computed[s], n, self.group_tables[s][g]) for s, n in seqs],
            self.block_size, "cpu", **options)

    def step(self, batch: list[tuple[str, list[int]]]) -> dict[str, torch.Tensor]:
        """One forward over the new tokens of each (seq_id, token_ids); returns float32 logits per seq."""
        md, positions = self.metadata([(s, len(toks)) for s, toks in batch])
        input_ids = torch.tensor([t for _, toks in batch for t in toks], dtype=torch.int64)
        with torch.inference_mode():
            model = self.loaded.model
            logits = model.compute_logits(model(input_ids, positions, md, self.kv_caches))
        out, start = {}, 0
        for s, toks in batch:
            out[s] = logits[start : start + len(toks)]
            start += len(toks)
            self.num_computed[s] += len(toks)
            self._release(s)
        return out

    def _release(self, seq_id: str) -> None:
        """Sliding groups' blocks no later query of the sequence reads: block 0 in their tables."""
        if not self.grouped:
            return
        for group in self.groups.groups:
            skipped = group.num_skipped_blocks(self.num_computed[seq_id], self.block_size)
            table = self.group_tables[seq_id][group.group_id]
            table[:skipped] = [0] * min(skipped, len(table))


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
