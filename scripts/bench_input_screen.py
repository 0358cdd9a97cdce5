"""How long the input processor takes to refuse two oversized inputs (run from the repo root).

    .venv/bin/python scripts/bench_input_screen.py

A 2.65 M-character prompt of emoji (just under the characters-per-context bound at
max_model_len 8192) and a conversation of 480,000 empty messages, on SmolLM2's tokenizer: both
must be refused (InvalidInputError), and the seconds to do so are printed.
"""

from __future__ import annotations

import time

from prefixcache.config import EngineConfig
from prefixcache.engine.input_processor import InputProcessor
from prefixcache.models.loader import load_model


def main() -> None:
    loaded = load_model("smollm2-135m")
    inputs = InputProcessor(EngineConfig(), loaded, max_model_len=8192, num_blocks=1024)
    cases = {
        "2.65 M emoji prompt": lambda: inputs.tokenize("\U0001F600" * 2_654_207),
        "480,000 empty chat messages": lambda: inputs.apply_chat_template([{"role": "user", "content": ""}] * 480_000),
    }
    for name, refuse in cases.items():
        start = time.perf_counter()
        try:
            refuse()
            outcome = "accepted (!)"
        except ValueError as e:
            outcome = f"refused: {str(e)[:70]}"
        print(f"{name}: {time.perf_counter() - start:.2f} s, {outcome}")


if __name__ == "__main__":
    main()
