"""OpenVINO GenAI as a speed-table baseline, from its own venv (``.venv-field/openvino``).

Optional: ``PREFIXCACHE_BASELINES=openvino bash scripts/setup.sh`` installs it (torch, optimum-intel and
openvino-genai, never into ``.venv``) and exports the default model. Without it the table says so, with
that command, and measures the rest.

The model runs as OpenVINO IR: ``optimum-cli export openvino --task text-generation-with-past
--weight-format fp32`` of the same HF directory our engine loads, once, offline, into
``$PREFIXCACHE_HOME/models/openvino/<directory name>-fp32`` (:func:`export_dir`). It is served by
``ContinuousBatchingPipeline`` with ``SchedulerConfig(enable_prefix_caching=True)``, fp32 compute
(``INFERENCE_PRECISION_HINT=f32``) on ``num_threads`` threads (``INFERENCE_NUM_THREADS``); its KV cache
keeps the CPU plugin's default precision, u8 (per-token scale and zero point), which the column's label says.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from prefixcache.bench.venv_engine import BaselineFailed, VenvEngine, venv_dir, venv_missing

NAME = "openvino"  # the venv's folder in .venv-field
VERSION = "2026.4.1.0"
INSTALL_HINT = f"PREFIXCACHE_BASELINES={NAME} bash scripts/setup.sh (a venv with openvino-genai=={VERSION})"
KV_CACHE_GB = 1  # u8 K/V of SmolLM2-135M: ~12 KB per token, so ~90,000 tokens
_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def openvino_missing() -> str | None:
    """Why OpenVINO GenAI can't run here (a sentence with the install command), or None."""
    return venv_missing(NAME, INSTALL_HINT)


def export_dir(model_dir: Path, home: Path | None = None) -> Path:
    """Where the fp32 OpenVINO IR of the HF directory ``model_dir`` lives."""
    from prefixcache.models.fetch import default_home

    return (home or default_home()) / "models" / "openvino" / f"{Path(model_dir).name}-fp32"


def export_model(model_dir: Path, home: Path | None = None, timeout_s: float = 900.0) -> Path:
    """Exports ``model_dir`` to OpenVINO IR (fp32 weights, its tokenizer and detokenizer) unless done; returns
    the folder. A minute or two: optimum traces the model through torch.

    Raises:
        BaselineFailed: ``optimum-cli`` failed or ran out of time (its output's tail in the message).
    """
    out = export_dir(model_dir, home)
    if (out / "openvino_model.xml").is_file() and (out / "openvino_tokenizer.xml").is_file():
        return out
    cmd = [str(venv_dir(NAME) / "bin" / "optimum-cli"), "export", "openvino", "--model", str(model_dir),
           "--task", "text-generation-with-past", "--weight-format", "fp32", str(out)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **_OFFLINE})
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BaselineFailed(f"exporting {model_dir} to OpenVINO IR failed: {e}") from e
    if done.returncode != 0 or not (out / "openvino_model.xml").is_file():
        tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-3:])
        raise BaselineFailed(f"`{' '.join(cmd)}` failed (exit {done.returncode}): {tail}")
    return out


def make_openvino_engine(model_dir: Path, num_threads: int, log_path: Path,
                         home: Path | None = None) -> VenvEngine:
    """A running OpenVINO GenAI pipeline on the HF directory ``model_dir``, exported first when needed.

    Raises:
        ValueError: ``num_threads`` below 1.
        BaselineFailed: the export, the child or its pipeline failed.
    """
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    settings = {"backend": NAME, "ov_dir": str(export_model(model_dir, home)), "num_threads": num_threads,
                "kv_cache_gb": KV_CACHE_GB}
    env = {**_OFFLINE, "OMP_NUM_THREADS": str(num_threads)}
    return VenvEngine(venv_dir(NAME) / "bin" / "python", settings, env, log_path)
