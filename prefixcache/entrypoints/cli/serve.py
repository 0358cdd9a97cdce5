"""``prefixcache serve``'s command line (vLLM's ``openai/cli_args.py``) and its entry point
:func:`run_cli` (vLLM's ``cli/serve.py``).

The engine flags are generated from :class:`~prefixcache.config.EngineConfig`'s fields, so each
option is declared once: ``--kebab-case`` of the field name (or ``metadata["flag"]``), the type
from the annotation (``bool`` → ``--x`` / ``--no-x``; ``int | None`` → int), the choices from
:meth:`EngineConfig.choices`, the help from ``metadata["help"]`` with the default, and memory
sizes (``metadata["memory"]``) parsed from ``2GiB``-style text. The model is positional.

Every flag is checked before the model loads (then the port is bound, then the model loaded), so
a typo or a busy port fails in a second with one line naming the flag, not after a long load. That
includes what a flag names (:func:`~prefixcache.entrypoints.cli.preflight.check_engine_resources`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import sys
import threading
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixcache.config import INT4_DECODER_FORMATS, EngineConfig
from prefixcache.entrypoints.cli.num_threads import NUM_THREADS_HELP, choose_num_threads
from prefixcache.entrypoints.cli.preflight import check_engine_resources
from prefixcache.entrypoints.openai.http_limits import DEFAULT_MAX_REQUEST_BODY_BYTES
from prefixcache.entrypoints.openai.launcher import HTTPOptions
from prefixcache.errors import InvalidInputError
from prefixcache.kernels.cpu_features import auto_format, describe_cpu

# binary for KiB, MiB, ... and the bare K, M, G, T; decimal for kB, KB, MB, GB, TB (SI: "2GB" is 2 * 10^9
# bytes, as vLLM's sizes read it)
_MEMORY_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40,
                 "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "Ki": 1 << 10, "Mi": 1 << 20,
                 "Gi": 1 << 30, "Ti": 1 << 40, "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


# ---------------------------------------------------------------------------- argparse types
def memory_bytes(text: str) -> int:
    """``"2GiB"``, ``"512MiB"``, ``"16M"`` (binary), ``"2GB"`` (decimal: 2 * 10^9), ``"1e9"`` or
    ``"1073741824"`` → bytes (>= 1).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]i?B?|kB|B)?\s*", text)
    value = None
    if m is not None:
        try:
            value = float(m.group(1)) * _MEMORY_UNITS[m.group(2) or ""]
        except ValueError:
            value = None
    if value is None or not 1 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"not a memory size >= 1 byte: {text!r} (e.g. 2GiB, 512MiB, 1073741824)")
    return int(value)


def port(text: str) -> int:
    """A TCP port, 0 (any free port) to 65535.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    if not text.strip().isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port (0-65535): {text!r}")
    return int(text)


def seconds(text: str) -> float:
    """A finite number of seconds >= 0.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"not a number of seconds >= 0: {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """:func:`seconds`, but > 0."""
    value = seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds: {text!r}")
    return value


# ---------------------------------------------------------------------------- engine flags
def flag_name(field: dataclasses.Field) -> str:
    """The ``serve`` flag of an :class:`EngineConfig` field."""
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def _field_help(field: dataclasses.Field, shown_default: object) -> str:
    text = field.metadata.get("help", "").replace("%", "%%")
    return text if "default" in text else f"{text} (default: {shown_default})"


def add_engine_args(group: argparse._ActionsContainer) -> None:
    """One flag per :class:`EngineConfig` field but ``model`` (see the module docstring).

    Raises:
        TypeError: a field whose type has no flag form (a new field needs a rule here).
    """
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        if field.name == "model":
            continue
        kind = hints[field.name]
        if isinstance(kind, types.UnionType) and type(None) in typing.get_args(kind):
            kind = next(t for t in typing.get_args(kind) if t is not type(None))
        # a field may default otherwise on the command line than in the Python API (dtype, quantization: auto)
        default = field.metadata.get("cli_default", field.default)
        kwargs: dict[str, Any] = {"dest": field.name, "default": default, "choices": EngineConfig.choices(field.name)}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif field.metadata.get("json"):  # parsed by the config (--kv-events-config)
            kwargs.update(type=str, metavar="JSON")
        elif field.metadata.get("memory"):
            kwargs.update(type=memory_bytes, metavar="BYTES")
        elif kind in (int, float, str):
            kwargs["type"] = kind
        else:
            raise TypeError(f"EngineConfig.{field.name}: no command-line form for type {kind!r}")
        action = group.add_argument(flag_name(field), **kwargs)
        action.help = _field_help(field, default)  # BooleanOptionalAction may append its own


def engine_config_from_args(args: argparse.Namespace, model_flag: str = "MODEL",
                            overrides: dict[str, Any] | None = None) -> EngineConfig:
    """The validated :class:`EngineConfig` of the parsed flags, for every subcommand that loads a
    model (``serve`` and ``cluster`` have a flag per field; ``demo`` and ``bench`` a few): each
    field whose name is an attribute of ``args`` and not None (None = the field's default), then
    ``overrides`` (fields a subcommand spells its own way, e.g. ``bench --no-partial-block-reuse``).

    Args:
        model_flag: how the error names the model (``serve``'s positional MODEL, else ``--model``).

    Raises:
        ValueError: an invalid value, naming its flag (``--num-threads: num_threads must be ...``).
    """
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    given = {name: getattr(args, name) for name in fields if getattr(args, name, None) is not None}
    try:
        return EngineConfig.from_kwargs(**{**given, **(overrides or {})})
    except InvalidInputError as e:
        flag = model_flag if e.field == "model" else flag_name(fields[e.field]) if e.field in fields else e.field
        raise ValueError(f"{flag}: {e.message}") from e


# ---------------------------------------------------------------------------- all flags
def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Adds ``prefixcache serve``'s options (server and engine) to ``parser``."""
    model = next(f for f in dataclasses.fields(EngineConfig) if f.name == "model")
    parser.add_argument("model", nargs="?", default=_DefaultModel(model.default),
                        help=_field_help(model, model.default))
    parser.add_argument("--model", dest="model_option", default=None, metavar="MODEL", action=_GivenOnce,
                        help="the same as the positional MODEL (vLLM's `serve --model` habit); give one of the two")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=port, default=8000, help="TCP port, 0-65535 (default: %(default)s)")
    parser.add_argument("--served-model-name", default=None, help="name clients send (default: MODEL)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/*, /reset_prefix_cache, /tokenize, "
                             "/detokenize and /dashboard")
    t = parser.add_argument_group("tenants")
    t.add_argument("--tenant-api-key", action="append", default=[], metavar="TENANT=KEY",
                   help="accept KEY as tenant TENANT (repeat for more keys/tenants)")
    t.add_argument("--api-keys-file", default=None, metavar="PATH",
                   help='JSON {"TENANT": "KEY" or ["KEY", ...], ...}: keys out of the process list')
    t.add_argument("--tenant-isolation", action="store_true",
                   help="a cache namespace per tenant; only approved prefixes are shared across tenants")
    t.add_argument("--dashboard-previews", choices=("auto", "on", "off"), default="auto",
                   help="decoded text of cached prefixes and breakers on /dashboard and /v1/cache/stats "
                        "(a tenant sees only its own): auto = on, off under --tenant-isolation")
    t.add_argument("--approved-prefix", action="append", default=[], metavar="TEXT",
                   help="public prompt text every tenant may share (repeatable)")
    t.add_argument("--approved-system-prompt", action="append", default=[], metavar="TEXT",
                   help="public chat system message every tenant may share (repeatable)")
    t.add_argument("--approved-prefixes-file", default=None, metavar="PATH",
                   help='JSON [{"text": ...} or {"system": ...}, ...]: long approved prefixes')
    parser.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH",
                        help="LoRA adapters (PEFT directories) clients select with the model field")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        help="server log level: info logs the start-up summary and one line per finished request "
                             "(default: %(default)s)")
    _add_http_args(parser.add_argument_group("HTTP limits"))
    add_engine_args(parser.add_argument_group("engine"))
    next(a for a in parser._actions if a.dest == "num_threads").help = NUM_THREADS_HELP  # the CLI's default


def _add_http_args(h: argparse._ActionsContainer) -> None:
    d = HTTPOptions()
    h.add_argument("--max-request-body-bytes", type=memory_bytes, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   metavar="BYTES", help="larger request bodies get 413, e.g. 16MiB (default: 16MiB)")
    h.add_argument("--timeout-keep-alive", dest="timeout_keep_alive_s", type=positive_seconds, metavar="S",
                   default=d.timeout_keep_alive_s, help="close idle keep-alive connections after S seconds "
                                                        "(default: %(default)s)")
    h.add_argument("--timeout-request-header", dest="timeout_request_header_s", type=positive_seconds,
                   metavar="S", default=d.timeout_request_header_s,
                   help="a request head must arrive within S seconds, else 408 (default: %(default)s)")
    h.add_argument("--timeout-request-body", dest="timeout_request_body_s", type=positive_seconds, metavar="S",
                   default=d.timeout_request_body_s,
                   help="a request body must arrive within S seconds of its head, else 408 (default: %(default)s)")
    h.add_argument("--timeout-graceful-shutdown", dest="timeout_graceful_shutdown_s", type=seconds, metavar="S",
                   default=d.timeout_graceful_shutdown_s,
                   help="on SIGTERM / Ctrl-C, requests in flight get S seconds to finish (default: %(default)s)")


def http_options(args: argparse.Namespace) -> HTTPOptions:
    """The parsed HTTP flags."""
    return HTTPOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(HTTPOptions)})


# ---------------------------------------------------------------------------- lora and tenants
def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """``["name=path", ...]`` → ``{name: path}``.

    Raises:
        ValueError: an item without ``=``, an empty name, or a duplicate name.
    """
    modules: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path or name in modules:
            raise ValueError(f"--lora-modules expects distinct NAME=PATH entries, got {item!r}")
        modules[name] = path
    return modules


def check_adapter_dirs(modules: dict[str, str]) -> None:
    """Each adapter directory is readable and holds a PEFT adapter's two files (the weights are
    loaded, and checked against the model, once the model is loaded).

    Raises:
        ValueError: naming the ``--lora-modules`` entry.
    """
    for name, path in modules.items():
        where = f"--lora-modules {name}={path}"
        try:
            files = {p.name for p in Path(path).expanduser().iterdir()}
        except OSError as e:
            raise ValueError(f"{where}: cannot read the adapter directory ({e.strerror or e})") from e
        missing = sorted({"adapter_config.json", "adapter_model.safetensors"} - files)
        if missing:
            raise ValueError(f"{where}: not a PEFT LoRA adapter directory (no {', '.join(missing)})")


def parse_tenant_args(args: argparse.Namespace) -> tuple[dict[str, str], list[str], list[str]]:
    """``--tenant-api-key``, ``--api-keys-file`` and the approved-prefix flags → build_app inputs.

    Returns:
        ``(api_keys key -> tenant, approved prefix texts, approved system prompts)``.

    Raises:
        ValueError: a malformed flag or file, naming it.
    """
    api_keys = _tenant_keys(args)
    texts, systems = list(args.approved_prefix), list(args.approved_system_prompt)
    if any(not t for t in texts) or any(not t for t in systems):
        raise ValueError("--approved-prefix / --approved-system-prompt: must not be empty")
    if args.approved_prefixes_file:
        data = _read_json(args.approved_prefixes_file, "--approved-prefixes-file")
        if not isinstance(data, list):
            raise ValueError('--approved-prefixes-file must hold a JSON list of {"text": ...} / {"system": ...}')
        for entry in data:
            if not isinstance(entry, dict) or len(entry) != 1 or not isinstance(next(iter(entry.values())), str):
                raise ValueError(f"--approved-prefixes-file: each entry is {{'text': str}} or {{'system': str}}, "
                                 f"got {entry!r}"[:300])
            if "text" not in entry and "system" not in entry:
                raise ValueError(f"--approved-prefixes-file: unknown entry {entry!r} (use 'text' or 'system')"[:300])
            if not next(iter(entry.values())):
                raise ValueError(f"--approved-prefixes-file: empty prefix in {entry!r}")
            (texts if "text" in entry else systems).append(next(iter(entry.values())))
    if (texts or systems) and not args.tenant_isolation:
        raise ValueError("approved prefixes only matter with --tenant-isolation (without it every "
                         "request may share every cached block); add --tenant-isolation or drop them")
    return api_keys, texts, systems


def _tenant_keys(args: argparse.Namespace) -> dict[str, str]:
    api_keys: dict[str, str] = {}

    def add(tenant: object, key: object, where: str) -> None:
        if not isinstance(tenant, str) or not tenant or not isinstance(key, str) or not key:
            raise ValueError(f"{where}: tenant names and keys must be non-empty strings")
        if key in api_keys:
            raise ValueError(f"{where}: an API key is given twice")
        api_keys[key] = tenant

    for item in args.tenant_api_key:
        tenant, sep, key = item.partition("=")
        if not sep:
            raise ValueError(f"--tenant-api-key expects TENANT=KEY, got {item!r}")
        add(tenant, key, "--tenant-api-key")
    if args.api_keys_file:
        data = _read_json(args.api_keys_file, "--api-keys-file")
        if not isinstance(data, dict):
            raise ValueError('--api-keys-file must hold a JSON object {"TENANT": "KEY" or ["KEY", ...]}')
        for tenant, keys in data.items():
            for key in [keys] if isinstance(keys, str) else keys if isinstance(keys, list) else [None]:
                add(tenant, key, "--api-keys-file")
    return api_keys


def _read_json(path: str, flag: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag}: cannot read JSON from {path!r}: {e}") from e


# ---------------------------------------------------------------------------- serve
@dataclass(frozen=True)
class ServeSettings:
    """Everything ``serve`` needs, checked before the model loads."""

    config: EngineConfig
    served_model_name: str
    lora_modules: dict[str, str]
    api_keys: dict[str, str]
    approved_prefixes: list[str]
    approved_system_prompts: list[str]
    http: HTTPOptions


def check_serve_args(args: argparse.Namespace, replicas: int = 1) -> ServeSettings:
    """Checks every ``serve`` flag (nothing is loaded or bound); ``replicas``: how many serve
    processes will each allocate the KV pool on this machine (``cluster --replicas``).

    Raises:
        ValueError: the first bad flag, named.
    """
    from prefixcache.entrypoints.openai.auth import tenants_by_key
    from prefixcache.entrypoints.openai.serving_engine import check_lora_module_names
    from prefixcache.models.model_path import check_model_arg

    merge_model_option(args)
    if args.lora_modules and "auto" in (args.dtype, args.quantization):  # auto never picks a format refusing adapters
        args.dtype, args.quantization = auto_format(args.dtype, args.quantization, lora=True)
    config = engine_config_from_args(args)
    check_model_arg(config.model)  # a missing directory or a Hub id fails here, not after binding
    check_engine_resources(config, replicas=replicas)  # --device, --hash-seed-file, --kv-disk-dir, the pool
    lora_modules = parse_lora_modules(args.lora_modules)
    check_lora_module_names(args.served_model_name or args.model, lora_modules)
    if lora_modules and config.quantization in INT4_DECODER_FORMATS:  # every request naming one would be a 400
        raise ValueError(f"--lora-modules: adapters need --quantization none or int8; {config.quantization} runs "
                         f"generated tokens in fused kernels without LoRA deltas")
    check_adapter_dirs(lora_modules)
    api_keys, approved_texts, approved_systems = parse_tenant_args(args)
    try:
        tenants_by_key(args.api_key, api_keys)
    except ValueError as e:
        raise ValueError(f"--api-key / --tenant-api-key / --api-keys-file: {e}") from e
    if args.tenant_isolation and not (args.api_key or api_keys):
        raise ValueError("--tenant-isolation needs API keys: give --tenant-api-key TENANT=KEY or --api-keys-file")
    if args.served_model_name is not None and not args.served_model_name:
        raise ValueError("--served-model-name must not be empty")
    return ServeSettings(config, args.served_model_name or args.model, lora_modules, api_keys, approved_texts,
                         approved_systems, http_options(args))


class _GivenOnce(argparse.Action):
    """Stores an option's value and refuses a second, different one (argparse would keep the last silently: two
    ``--model`` would serve whichever came last, where MODEL with ``--model`` is refused)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        previous = getattr(namespace, self.dest, None)
        if previous is not None and previous != values:
            parser.error(f"{option_string} given twice ({previous!r} and {values!r}); give one of the two")
        setattr(namespace, self.dest, values)


class _DefaultModel(str):
    """The positional MODEL's default: told apart from the same name typed, so that ``serve smollm2-135m
    --model gemma3-270m`` is refused rather than read as ``--model`` alone (argparse, with no ``type``, hands
    an absent positional's default over as this same object)."""


def merge_model_option(args: argparse.Namespace) -> None:
    """``--model X`` (vLLM's form) sets the positional MODEL.

    Raises:
        ValueError: both given, with different values.
    """
    option = getattr(args, "model_option", None)
    if option is not None and not isinstance(args.model, _DefaultModel) and args.model != option:
        raise ValueError(f"MODEL given twice ({args.model!r} and --model {option!r}); give one of the two")
    args.model = str(args.model if option is None else option)  # a plain str from here on


@contextlib.contextmanager
def _exit_on_interrupt() -> Iterator[None]:
    """While the model loads, Ctrl-C exits at once with status 130 and one line: nothing needs
    cleaning up yet, and a KeyboardInterrupt raised inside a library's lazy import would surface
    as an unrelated traceback."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_now(signum: int, frame: object) -> None:
        print("prefixcache serve: interrupted while starting", file=sys.stderr, flush=True)
        os._exit(130)

    previous = signal.signal(signal.SIGINT, exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


_PREVIEWS = {"auto": None, "on": True, "off": False}  # --dashboard-previews -> DashboardOptions.previews


def run_cli(args: argparse.Namespace) -> int:
    """Checks the flags, binds the port, loads the model and serves until SIGINT / SIGTERM.

    Returns:
        The exit status: 0 after a shutdown (a Ctrl-C while starting exits 130 at once).

    Raises:
        ValueError: a bad flag, a busy port, or a model or adapter that can't be loaded (one line
            for ``prefixcache serve: error: ...``).
    """
    from prefixcache.entrypoints.openai.launcher import bind_socket, serve_http

    threads_note = choose_num_threads(args)
    auto_flags = " ".join(f"--{name.replace('_', '-')} auto" for name in ("dtype", "quantization", "attention_dtype")
                          if getattr(args, name, None) == "auto")
    s = check_serve_args(args)
    if s.api_keys and not args.tenant_isolation:
        print("prefixcache serve: tenant API keys authenticate, but without --tenant-isolation all tenants "
              "share one cache namespace", file=sys.stderr)
    sock = bind_socket(args.host, args.port)  # a busy port fails here, before the engine's imports and load
    try:
        with _exit_on_interrupt():
            from prefixcache.engine.llm_engine import LLMEngine
            from prefixcache.entrypoints.dashboard.state import DashboardOptions
            from prefixcache.entrypoints.openai.api_server import build_app
            from prefixcache.entrypoints.openai.server_log import configure_logging, log_startup, logger

            configure_logging(args.log_level)
            if threads_note:
                logger.info("%s", threads_note)
            if auto_flags:
                logger.info("format: %s chose %s + %s, %s attention for this CPU (%s; --dtype float32 --quantization "
                            "none --attention-dtype float for transformers' exact numbers)", auto_flags, s.config.dtype,
                            s.config.quantization, s.config.attention_dtype, describe_cpu())
            logger.info("loading model %s ...", s.config.model)
            engine = LLMEngine(s.config)
            log_startup(engine)
            app = build_app(engine, s.served_model_name, api_key=args.api_key,
                            lora_modules=s.lora_modules, api_keys=s.api_keys, tenant_isolation=args.tenant_isolation,
                            approved_prefixes=s.approved_prefixes, approved_system_prompts=s.approved_system_prompts,
                            max_request_body_bytes=args.max_request_body_bytes,
                            dashboard_options=DashboardOptions(previews=_PREVIEWS[args.dashboard_previews]))
        try:
            serve_http(app, sock, s.http)
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down for
            pass
        return 0
    finally:
        sock.close()
