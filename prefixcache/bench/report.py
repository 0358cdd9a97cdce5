"""The benchmark's outputs: ``bench.json``, ``bench.md`` (tables), one ``{part}.md`` per part that ran
(``sharing``, ``speed``, ``hash``: the sections ``--report`` fills) and PNG plots (Agg backend): three for
the prefix-sharing workloads, ``speed.png`` for the speed table."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path


def _f(x, spec: str = ".2f", none: str = "–") -> str:
    return none if x is None else format(x, spec)


def _ms(x) -> str:
    return "–" if x is None else f"{x * 1e3:.0f}"


def _table(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
    """A ``## title`` section with one Markdown table."""
    return ["", f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows)]


def _header(result: dict) -> list[str]:
    """The run's title and machine line (cores, threads, torch, load average, command)."""
    m = result["machine"]
    return [
        f"# prefixcache bench — {result['model']}, {result['date']}",
        "",
        f"Machine: {m['cpu_cores']} CPU cores, {m['threads']} torch threads, torch {m['torch']}; load average "
        f"{_f(m['load_average_start'][0])} at start, {_f(m['load_average_end'][0])} at end."
        + (f" Command: `{result['command']}`." if result.get("command") else ""),
    ]


def _micro_table(micro: list[dict]) -> list[str]:
    rows = [[str(mm["block_size"]), f"{mm['hash_tokens_per_s'] / 1e6:.1f}",
             f"{mm['lookup_verify_tokens_per_s'] / 1e6:.1f}", f"{mm['total_tokens_per_s'] / 1e6:.1f}"]
            for mm in micro]
    return _table("Chain hash + verify + lookup (fully cached 4096-token prompt)", [
        "block size", "hash (M tok/s)", "lookup + verify (M tok/s)", "total (M tok/s)"], rows)


def _goals_table(goals: list[dict]) -> list[str]:
    rows = []
    for g in goals:
        met = "–" if g["met"] is None else ("yes" if g["met"] else "**no**")
        value = g["value"]
        shown = "–" if value is None else (f"{value / 1e6:.1f} M" if value >= 1e5 else f"{value:.3f}")
        rows.append([g["workload"], g["goal"], str(g["target"]), shown, met])
    return _table("Goals", ["workload", "goal", "target", "measured", "met"], rows)


def markdown(result: dict) -> str:
    """All tables of a run as one Markdown document (``bench.md``)."""
    lines = _header(result)
    if result["workloads"]:
        lines += _workload_tables(result)
    if result.get("speed"):
        lines += speed_markdown(result["speed"])
    if result.get("micro"):
        lines += _micro_table(result["micro"])
    lines += _goals_table(result["goals"])
    return "\n".join(lines) + "\n"


MICRO_GOALS = "micro"  # the goals' workload name of the hash + lookup micro-benchmark (runner.run_bench)


def part_markdowns(result: dict) -> dict[str, str]:
    """The run's tables split by what ran, each part with its own goals: ``sharing`` (the prefix-sharing
    workloads), ``speed`` (the side-by-side table), ``hash`` (the hash + lookup micro-benchmark); only the parts
    that ran. Each becomes ``{part}.md``, the page section ``--report`` fills (``report_page.section_name``), so a
    speed run and a sharing run never replace each other's tables."""
    goals = result["goals"]
    parts = {}
    if result["workloads"]:
        names = {w["name"] for w in result["workloads"]}
        parts["sharing"] = _header(result) + _workload_tables(result) + _goals_table(
            [g for g in goals if g["workload"] in names])
    if result.get("speed"):
        parts["speed"] = _header(result) + speed_markdown(result["speed"]) + _goals_table(
            [g for g in goals if g["workload"] == "speed"])
        parts["summary"] = speed_summary(result["speed"])
    if result.get("micro"):  # the cache's bookkeeping alone, timed before the model loads: no model line
        parts["hash"] = (["The cache's bookkeeping alone, no model (`prefixcache.bench.runner.hash_lookup_throughput`), "
                          "timed before the model loads, with the garbage collector paused."]
                         + _micro_table(result["micro"])
                         + _goals_table([g for g in goals if g["workload"] == MICRO_GOALS]))
    return {name: "\n".join(lines) + "\n" for name, lines in parts.items()}


def _workload_tables(result: dict) -> list[str]:
    """The prefix-sharing workloads' tables."""
    ws = result["workloads"]
    lines = []
    rows = []
    for w in ws:
        p, kv = w["prefill"], w["kv"]
        rows.append([
            w["name"], str(w["num_requests"]), str(w["prompt_tokens"]), str(p["computed_cache_off"]),
            str(p["computed_cache_on"]), str(p["ideal"]), _f(p["computed_over_ideal"]), f"{p['hit_rate']:.1%}",
            f"{p['hit_requests']}/{w['num_requests']}",
            f"{kv['peak_blocks_cache_on']} / {kv['ideal_peak_blocks']} / {kv['peak_blocks_cache_off']}",
            "yes" if w["outputs_equal_on_off"] else "NO",
        ])
    lines += _table("Prefill and cache", [
        "workload", "requests", "prompt tok", "computed, off", "computed, on", "ideal", "on / ideal", "hit rate",
        "hit requests", "peak blocks on / ideal / off", "outputs on = off"], rows)
    rows = []
    for w in ws:
        z = w["prefill"].get("zero_hits")
        if z and z["count"]:
            reasons = ", ".join(f"{r} {v['count']}" for r, v in z["by_reason"].items())
            rows.append([w["name"], f"{z['count']}/{w['num_requests']}", reasons, z["explanation"]])
    if rows:
        lines += _table("Requests that served no cached token, and why (the latest explanation)", [
            "workload", "requests", "by reason", "latest"], rows)
    rows = []
    for w in ws:
        t, th = w["ttft"], w["throughput"]
        rows.append([
            w["name"], f"{_ms(t['cold_median_s'])} / {_ms(t['cold_p90_s'])}",
            f"{_ms(t['warm_median_s'])} / {_ms(t['warm_p90_s'])}", _f(t["warm_over_cold"]),
            f"{th['wall_s_cache_off']:.2f} / {th['wall_s_cache_on']:.2f}",
            f"{th['output_tokens_per_s_cache_off']:.1f} / {th['output_tokens_per_s_cache_on']:.1f}",
            f"{th['on_over_off']:.2f}",
        ])
    lines += _table("Latency and throughput (TTFT of a request alone; throughput of all requests at once)", [
        "workload", "TTFT cold med / p90 (ms)", "TTFT warm med / p90 (ms)", "warm / cold", "wall off / on (s)",
        "out tok/s off / on", "on / off"], rows)
    if any("hf" in w for w in ws):
        rows = []
        for w in (w for w in ws if "hf" in w):
            h = w["hf"]
            rows.append([
                w["name"], f"{w['throughput']['output_tokens_per_s_cache_on']:.1f}",
                f"{h['no_reuse']['output_tokens_per_s']:.1f}", f"{h['prefix_copy']['output_tokens_per_s']:.1f}",
                f"{h['batched']['output_tokens_per_s']:.1f}", f"{h['ours_over_best']:.2f}× ({h['best_variant']})",
                f"{_ms(w['ttft']['warm_median_s'])} / {_ms(h['prefix_copy']['ttft_median_s'])}",
                f"{h['same_outputs_as_no_reuse']:.0%}",
            ])
        lines += _table("Versus transformers (same weights, threads, prompts; output tokens/s over the workload)", [
            "workload", "ours, cache on", "HF no reuse", "HF DynamicCache copy", "HF batched", "ours / best HF",
            "TTFT warm ours / HF copy (ms)", "same tokens as HF"], rows)
    rows = []
    for w in ws:
        v = w["worth"]
        rows.append([
            w["name"], f"**{v['verdict']}**", f"{v['block_repeat_rate']:.2f}", f"{v['mean_hit_tokens']:.0f}",
            f"{v['saved_prefill_s_per_request'] * 1e3:.0f}", f"{v['saved_prefill_s_per_s']:.3f}",
            f"{v['kv_bytes_held'] / 2**20:.1f}", v["reason"],
        ])
    lines += _table("Is prefix caching worth enabling?", [
        "workload", "verdict", "block repeat rate", "mean hit (tok)", "prefill saved / request (ms)",
        "saved s per s of traffic", "KV held (MiB)", "reason"], rows)
    return lines


_UNIT_FORMAT = {"s": ".3f", "tok/s": ".1f", "ms/token": ".1f", "ratio": ".3f"}
_SPEED_COLORS = {"transformers": "#999999", "llama.cpp": "#d9822b", "vLLM CPU": "#7b52ab", "OpenVINO GenAI": "#3a9e5c",
                 "prefixcache": "#2b7bd9"}  # by speed.ENGINES' names (no import of the bench here)


def _speed_engines(speed: dict) -> list[str]:
    """The table's columns, in order (prefixcache last): the keys of its rows' values."""
    return list(speed["table"][0]["values"])


def speed_summary(speed: dict) -> list[str]:
    """The speed table alone (no headings, goals or notes): the one benchmark table of README.md, which
    ``--report`` fills only in a page that already has its markers (``report_page.MIRROR_STEMS``)."""
    return speed_markdown(speed)[3:5 + len(speed["table"])]  # _table's lines: "", title, "", header, rule, rows


def speed_markdown(speed: dict) -> list[str]:
    """The speed section: one row per measurement, one column per engine, ratios ours / theirs."""
    engines, shown = speed["engines"], _speed_engines(speed)
    theirs = shown[:-1]
    header = ["", *(engines[e]["label"] if e in engines else f"{e} (not measured)" for e in shown),
              *(f"ours / {e}" for e in theirs)]
    rows = []
    for r in speed["table"]:
        spec = _UNIT_FORMAT.get(r["unit"], ".3g")
        rows.append([f"{r['label']} ({r['unit']})", *(_f(r["values"][e], spec) for e in shown),
                     *(_f(r["ours_over"][e], ".2f") for e in theirs)])
    lines = _table(f"Speed, side by side ({speed['threads']} threads, same prompts, greedy, every engine "
                   "warmed up)", header, rows)
    lines += ["", f"Cache on / off: {speed['on_over_off_source']}."]
    same = [f"{e} {engines[e]['batch_same_tokens_as_ours']:.0%}" for e in theirs if e in engines]
    if same:
        lines.append("Batch run, requests with the same tokens as ours: " + ", ".join(same) + ".")
    lines += [f"{e}: {why}." for e, why in speed["skipped"].items()]
    return lines


def write_result_files(out_dir: str | Path, stem: str, result: dict, markdown_text: str,
                       plot: Callable[[Path], list[Path]] | None = None) -> list[Path]:
    """The one writer of a bench result: ``{stem}.json``, ``{stem}.md``, then the plots.

    Args:
        out_dir: the directory, created if missing.
        stem: the files' name without suffix (``bench``, ``cluster``, ``restart``).
        result: written as JSON, ``indent=2``.
        markdown_text: written as is.
        plot: writes the PNGs into the directory and returns their paths; ``None``: no plots.

    Returns:
        The paths written: the JSON, the Markdown, then ``plot``'s.

    Raises:
        ValueError: ``plot`` needs matplotlib and it is not installed (see :func:`pyplot`); the JSON
            and the Markdown are written by then.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    paths[0].write_text(json.dumps(result, indent=2))
    paths[1].write_text(markdown_text)
    if plot is not None:
        paths += plot(out)
    return paths


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (needs the ``bench`` extra).

    Raises:
        ValueError: matplotlib is not installed (the message says how to get it or skip plots).
    """
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        raise ValueError("plots need matplotlib: pip install 'prefixcache[bench]', or pass --no-plots") from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_outputs(result: dict, out_dir: str | Path, plots: bool = True) -> list[Path]:
    """Writes bench.json, bench.md, each part's ``{part}.md`` (:func:`part_markdowns`) and (with ``plots``) the
    PNGs; returns the paths written."""
    paths = write_result_files(out_dir, "bench", result, markdown(result))
    for name, text in part_markdowns(result).items():
        paths.append(Path(out_dir) / f"{name}.md")
        paths[-1].write_text(text)
    return paths + (write_plots(result, Path(out_dir)) if plots else [])


def write_plots(result: dict, out: Path) -> list[Path]:
    """The report's PNG plots (needs the ``bench`` extra: ``pip install 'prefixcache[bench]'``).

    Raises:
        ValueError: matplotlib is not installed (the message says how to get it or skip plots).
    """
    plt = pyplot()
    import numpy as np

    paths = [_speed_plot(result["speed"], out, plt)] if result.get("speed") else []
    ws = result["workloads"]
    if not ws:
        return paths
    names = [w["name"] for w in ws]
    x = np.arange(len(ws))

    def bars(series: dict[str, list[float]], ylabel: str, title: str, filename: str, log: bool = False) -> None:
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(ws)), 4))
        width = 0.8 / len(series)
        for i, (label, ys) in enumerate(series.items()):
            ax.bar(x + (i - (len(series) - 1) / 2) * width, [np.nan if y is None else y for y in ys], width,
                   label=label)
        ax.set_xticks(x, names, rotation=15)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=110)
        plt.close(fig)
        paths.append(out / filename)

    ttft = {"cold (empty cache)": [w["ttft"]["cold_median_s"] for w in ws],
            "warm (prefix cached)": [w["ttft"]["warm_median_s"] for w in ws]}
    if all("hf" in w for w in ws):
        ttft["transformers no reuse"] = [w["hf"]["no_reuse"]["ttft_median_s"] for w in ws]
        ttft["transformers DynamicCache copy"] = [w["hf"]["prefix_copy"]["ttft_median_s"] for w in ws]
    bars(ttft, "median TTFT (s, log)", "TTFT of a request alone", "ttft_cold_vs_warm.png", log=True)
    bars({"caching off": [w["prefill"]["computed_cache_off"] for w in ws],
          "caching on": [w["prefill"]["computed_cache_on"] for w in ws],
          "ideal minimum": [w["prefill"]["ideal"] for w in ws]},
         "prompt tokens computed", "Prefill tokens computed vs ideal", "prefill_vs_ideal.png")
    tput = {"ours, caching on": [w["throughput"]["output_tokens_per_s_cache_on"] for w in ws],
            "ours, caching off": [w["throughput"]["output_tokens_per_s_cache_off"] for w in ws]}
    if all("hf" in w for w in ws):
        for v, label in (("no_reuse", "HF no reuse"), ("prefix_copy", "HF DynamicCache copy"),
                         ("batched", "HF batched, padded")):
            tput[label] = [w["hf"][v]["output_tokens_per_s"] for w in ws]
        bars(tput, "output tokens/s", "Throughput vs transformers", "throughput_vs_transformers.png")
    else:  # --skip-hf: no transformers bars, so not titled after them
        bars(tput, "output tokens/s", "Throughput, caching on vs off", "throughput.png")
    return paths


def _speed_plot(speed: dict, out: Path, plt) -> Path:
    """``speed.png``: one panel per measurement, a bar per engine (the issue's absolute target dashed)."""
    rows = [r for r in speed["table"] if r["metric"] != "on_over_off"]
    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3.8), squeeze=False)
    for ax, r in zip(axes[0], rows):
        names = [e for e in r["values"] if r["values"][e] is not None]
        ax.bar(names, [r["values"][e] for e in names], color=[_SPEED_COLORS[e] for e in names])
        if r["target"] is not None:  # "<= 0.08"
            ax.axhline(float(r["target"].split()[-1]), color="k", linestyle="--", linewidth=1,
                       label=f"goal {r['target']}")
            ax.legend(fontsize=7)
        ax.set_title(textwrap.fill(r["label"], 36), fontsize=8)
        ax.set_ylabel(r["unit"])
        ax.tick_params(axis="x", labelsize=7, rotation=15)
    fig.tight_layout()
    fig.savefig(out / "speed.png", dpi=110)
    plt.close(fig)
    return out / "speed.png"
