"""Output text per step: the whole output decoded again (before 2026-12-02) vs grown by each new
token's bytes (prefixcache/engine/detokenizer.py), over a 4,000-token output of random ids.

    .venv/bin/python scripts/time_detokenize.py [--tokens 4000]

Measured 2026-12-02 (AMD EPYC, SmolLM2's tokenizer): whole 3.44 s over 4,000 steps (438 us per step
at 1,000 tokens, 1,988 us at 4,000); incremental 0.027 s (6.1 us, 8.6 us).
"""

import argparse
import random
import time
from types import SimpleNamespace

from transformers import AutoTokenizer

from prefixcache.engine.output_processor import OutputProcessor
from prefixcache.models.loader import resolve_model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"), local_files_only=True)
    processor = OutputProcessor(tok, [], 10**6)
    rng = random.Random(0)
    ids = [rng.randrange(17, len(tok)) for _ in range(args.tokens)]
    whole = lambda r, n: tok.decode(r.output_token_ids[:n], skip_special_tokens=True)  # noqa: E731
    for name, text in [("whole", whole), ("incremental", processor.output_text)]:
        request = SimpleNamespace(output_token_ids=[], detokenizer=None)
        per_step = []
        for token_id in ids:
            request.output_token_ids.append(token_id)
            start = time.perf_counter()
            text(request, len(request.output_token_ids))
            per_step.append(time.perf_counter() - start)
        mid = min(1000, len(ids) // 2)
        print(f"{name}: {sum(per_step):.3f} s over {len(ids)} steps; per step at {mid} tokens "
              f"{1e6 * sum(per_step[mid - 10:mid + 10]) / 20:.1f} us, at {len(ids)}: {1e6 * sum(per_step[-20:]) / 20:.1f} us")


if __name__ == "__main__":
    main()
