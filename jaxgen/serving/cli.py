"""serve.py's command line: the `generate` and `http` commands, their flags, and what each runs.

A flag is a shortcut for one config field (`--slots` sets serve.slots): its type, its choices and the
default its help shows come from the field in `jaxgen.config.serve`, so each default is stated once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing
from pathlib import Path
from typing import Literal

from jaxgen.config import HttpConfig, ServeConfig
from jaxgen.distributed import add_distributed_flags, distributed_overrides

PRECEDENCE = (
    "Settings, later wins: the defaults (configs/serve.yaml lists them all), the --config file, the key=value "
    "overrides, then the flags given explicitly (each flag sets the config field it names)"
)
SECTIONS = {"serve": ServeConfig, "http": HttpConfig}

# flag -> (the config field it sets, what it does; "(default: ...)" where the field's default is None)
ENGINE_FLAGS = {
    "--slots": ("serve.slots", "sequences decoded together"),
    "--kv-memory-gb": ("serve.kv_memory_gb", "KV page pool in GB"),
    "--page-size": ("serve.page_size", "tokens per KV-cache page"),
    "--quantize": ("serve.quantize", "int8 holds the attention and MLP weights as int8"),
    "--cache-dtype": ("serve.cache_dtype", "the KV cache's dtype; int8 holds ~2x the tokens of bfloat16"),
    "--draft": (
        "serve.draft", "a run or Hugging Face folder whose smaller model (same tokenizer), or an EAGLE-3 head "
        "trained for this model (train.py draft.target=...), drafts for requests with num_speculative_tokens > 0 "
        "(generate: --num-speculative-tokens; default: n-gram lookup)",
    ),
}  # fmt: skip
HTTP_FLAGS = {
    "--host": ("http.host", "the address to bind (127.0.0.1: this machine only)"),
    "--port": ("http.port", "the port to listen on"),
    "--model-name": ("http.model_name", "the model id clients use (default: the folder's name)"),
    "--max-body-bytes": ("serve.max_body_bytes", "larger bodies get 413"),
    "--max-queue": ("serve.max_queue", "queued requests beyond get 429"),
    "--request-timeout": ("serve.request_timeout_s", "cancel requests running longer, in s (0 = off)"),
    "--shutdown-grace": ("serve.shutdown_grace_s", "on SIGTERM, seconds running requests get to finish"),
    "--metrics-need-key": ("http.metrics_need_key", "/metrics asks for the API key too"),
    "--lora-root": (
        "serve.lora_root",
        "POST /v1/load_lora_adapter reads adapter folders inside this folder only "
        "(default: only with serve.admin_token)",
    ),
}
# argparse dest -> the config field it sets
FLAG_FIELDS = {flag[2:].replace("-", "_"): key for flag, (key, _) in (ENGINE_FLAGS | HTTP_FLAGS).items()} | {
    "prefix_caching": "serve.prefix_caching"
}
LOOPBACK = ("localhost", "127.0.0.1", "::1")


def _add_field_flag(p, flag: str, key: str, what: str) -> None:
    """`flag` setting the config field `key`: typed, with choices and the default taken from the field."""
    section, name = key.split(".")
    cls = SECTIONS[section]
    tp = typing.get_type_hints(cls)[name]
    default = next(f.default for f in dataclasses.fields(cls) if f.name == name)
    kwargs = {}
    if tp is bool:  # a switch: given, it sets the field true
        kwargs["action"], kwargs["default"] = "store_true", None
    elif typing.get_origin(tp) is Literal:
        kwargs["choices"] = typing.get_args(tp)
    else:
        base = next((t for t in typing.get_args(tp) if t is not type(None)), tp)  # X | None -> X
        kwargs["type"] = base
    shown = what if default is None else f"{what} (default {default})"
    p.add_argument(flag, dest=flag[2:].replace("-", "_"), help=f"sets {key}: {shown}", **kwargs)


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        required=True,
        help="run folder written by train.py (its latest checkpoint), or a local Hugging Face model folder "
        "(config.json, *.safetensors, tokenizer.json)",
    )
    p.add_argument("--config", help="YAML with `serve` and `http` sections (e.g. configs/serve.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. serve.chunk_steps=16")
    for flag, (key, what) in ENGINE_FLAGS.items():
        _add_field_flag(p, flag, key, what)
    p.add_argument(
        "--no-prefix-caching", dest="prefix_caching", action="store_false", default=None,
        help="sets serve.prefix_caching=false: do not share pages of common prompt prefixes",
    )  # fmt: skip
    add_distributed_flags(p)


def parser() -> argparse.ArgumentParser:
    """serve.py's argument parser: the two commands, each with the engine's flags."""
    top = argparse.ArgumentParser(
        description="Generate text with a jaxgen run folder (written by train.py) or a Hugging Face model folder.",
        epilog=PRECEDENCE,
    )
    sub = top.add_subparsers(dest="command", required=True)
    g = sub.add_parser(
        "generate",
        help="generate for one prompt or a JSONL file of requests",
        description="Generate for --prompt, or for every line of --input (JSONL: id, prompt, optional sampling "
        "fields) into --output. Rerunning the same command resumes: ids already in --output are skipped. "
        "The engine reads the config's serve section.",
        epilog=PRECEDENCE,
    )
    _engine_args(g)
    what = g.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="one prompt; prints the completion")
    what.add_argument("--input", type=Path, help="JSONL requests")
    g.add_argument("--output", type=Path, help="JSONL results (required with --input)")
    # this command's sampling defaults (a request's own fields override them in --input lines)
    g.add_argument("--max-new-tokens", type=int, default=128, help="(default 128)")
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off (default 0)")
    g.add_argument("--top-p", type=float, default=0.95, help="(default 0.95)")
    g.add_argument("--seed", type=int, default=0, help="(default 0)")
    g.add_argument(
        "--num-speculative-tokens", type=int, default=0, metavar="N",
        help="speculative decoding: drafts checked per step, from --draft's model or else n-gram lookup; the "
        "output is the same as without (0 = off, at most 8; default 0)",
    )  # fmt: skip
    h = sub.add_parser(
        "http",
        help="an OpenAI-compatible HTTP server",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics.",
        epilog="examples:\n  python serve.py http --checkpoint runs/default --port 8000\n"
        "  python serve.py http --checkpoint runs/default --config configs/serve.yaml serve.chunk_steps=16\n"
        "  curl localhost:8000/v1/completions -H 'Content-Type: application/json' "
        '-d \'{"prompt": "def ", "max_tokens": 32}\'\n\n' + PRECEDENCE + ".",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _engine_args(h)
    for flag, (key, what) in HTTP_FLAGS.items():
        _add_field_flag(h, flag, key, what)
    h.add_argument(
        "--api-key", default=os.environ.get("JAXGEN_API_KEY"),
        help="require this bearer key (default: $JAXGEN_API_KEY; never read from a config file)",
    )  # fmt: skip
    return top


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """(the parser, its arguments): key=value overrides may stand anywhere among the flags (argparse alone
    takes one run of positionals); anything else it does not know is an error."""
    p = parser()
    args, extra = p.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray:
        p.error(f"unrecognized arguments: {' '.join(stray)}")
    args.overrides = args.overrides + extra
    return p, args


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """A warning when the server answers other machines without an API key."""
    if api_key or host in LOOPBACK or host.startswith("127."):
        return None
    return (f"warning: http.host={host} answers other machines and no API key is set: anyone who reaches this "
            "port can use the model (pass --api-key or set JAXGEN_API_KEY)")  # fmt: skip


def command_config(args):
    """The ServeCommandConfig of parsed arguments: --config, then the overrides, then explicit flags."""
    from jaxgen.config import load_serve_config

    flags = {field: getattr(args, dest) for dest, field in FLAG_FIELDS.items() if getattr(args, dest, None) is not None}
    return load_serve_config(args.config, args.overrides + distributed_overrides(args), flags)


def main(argv: list[str] | None = None) -> int:
    p, args = parse_args(argv)
    if args.command == "generate" and args.input is not None and args.output is None:
        p.error("--input needs --output")
    from jaxgen.config import ConfigError
    from jaxgen.distributed import describe, initialize

    try:
        settings = command_config(args)  # every setting is checked before anything loads
        _check_processes(args, settings)
        joined = initialize(settings.distributed)  # before anything else touches JAX
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if joined:
        print(describe(joined), file=sys.stderr)
    warning = exposure_warning(settings.http.host, args.api_key) if args.command == "http" else None
    if warning:
        print(warning, file=sys.stderr)
    from jaxgen.inference.sampling import SamplingConfig, SamplingError

    if args.command == "generate":
        try:
            defaults = SamplingConfig(
                max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, seed=args.seed, num_speculative_tokens=args.num_speculative_tokens,
            )  # fmt: skip
        except SamplingError as e:
            p.error(str(e))
        if settings.serve.draft and args.prompt is not None and not args.num_speculative_tokens:
            p.error(f"serve.draft={settings.serve.draft!r} (--draft) drafts only with --num-speculative-tokens N > 0")
    try:
        engine = _engine(args, settings)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.command == "http":
        return _http(engine, args, settings.http)
    if args.prompt is not None:
        return _one_prompt(engine, args.prompt, defaults)
    from jaxgen.serving import batch_job

    run = batch_job.run_shared if settings.serve.processes == "shared" else batch_job.run_split
    print(json.dumps(run(engine, args.input, args.output, defaults)))
    return 0


def _engine(args, settings):
    """The engine on the model of --checkpoint, as `settings` say (FileNotFoundError, ValueError if not).
    What each phase of the start took is in its /metrics (jaxgen_startup_seconds)."""
    import time

    from jaxgen.inference.engine import Engine
    from jaxgen.inference.loading import load_for_serving
    from jaxgen.runtime import enable_compilation_cache, process_seconds, quiet_libtpu_off_tpu

    quiet_libtpu_off_tpu()
    enable_compilation_cache()
    mesh = _engine_mesh(settings)  # a ConfigError is a ValueError
    imported = process_seconds()  # the interpreter, the imports, the backend's start
    t0 = time.perf_counter()
    m = load_for_serving(args.checkpoint, settings.serve, mesh)
    t1 = time.perf_counter()
    engine = Engine(m.params, m.cfg, m.tokenizer, settings.serve, mesh=mesh if mesh.size > 1 else None, draft=m.draft)
    phases = {"load": t1 - t0, "engine": time.perf_counter() - t1} | ({"import": imported} if imported else {})
    for phase, seconds in phases.items():
        engine.stats.startup(phase, seconds)
    return engine


def _check_processes(args, settings) -> None:
    """What runs as several processes: `generate --input` (split or shared), and --prompt when shared."""
    from jaxgen.config import ConfigError
    from jaxgen.distributed import detect

    if detect(settings.distributed) is None:
        return
    if args.command == "http":
        raise ConfigError("serve.py http runs as one process; for several processes use serve.py generate --input")
    if args.prompt is not None and settings.serve.processes != "shared":
        raise ConfigError(
            "--prompt as one of several processes needs serve.processes=shared (one engine over every process); "
            "serve.processes=split shares the lines of --input"
        )


def _engine_mesh(settings):
    """The engine's devices: `mesh` over this process's devices (split), or over every process's (shared)."""
    import jax

    from jaxgen.config import ConfigError
    from jaxgen.sharding import check_spans_processes, make_mesh

    s = settings.serve
    shared = s.processes == "shared"
    try:
        mesh = make_mesh(s.mesh, jax.devices() if shared else jax.local_devices())
    except ConfigError as e:  # it names the mesh: say which settings made it
        raise ConfigError(
            f"serve.data_parallel={s.data_parallel}, serve.tensor_parallel={s.tensor_parallel}: {e}"
        ) from None
    if shared and jax.process_count() > 1:
        try:
            what = f"serve.processes=shared with serve.tensor_parallel={s.tensor_parallel}: the engine"
            check_spans_processes(mesh, what)
        except ValueError as e:
            raise ConfigError(f"{e}; e.g. serve.tensor_parallel=-1") from None
    return mesh


def _one_prompt(engine, prompt: str, defaults) -> int:
    from jaxgen.distributed import is_main
    from jaxgen.inference.sampling import SamplingError
    from jaxgen.inference.textstream import TextDeltas

    if not is_main():  # the other processes of a shared engine run the same steps and print nothing
        try:
            engine.submit(prompt, defaults)
        except SamplingError:
            return 1  # process 0 says why
        engine.run_until_idle()
        return 0

    hold = max((len(s) for s in defaults.stop), default=1) - 1
    deltas = TextDeltas(engine.tokenizer, hold)  # exact text: no half characters, no half stop strings

    def show(seq):
        print(deltas.update(seq.text, final=bool(seq.finish_reason)), end="", flush=True)

    try:
        (seq,) = engine.submit(prompt, defaults, on_update=show)
    except SamplingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(prompt, end="", flush=True)
    engine.run_until_idle()
    print()
    if seq.error:
        print(f"error: {seq.error}", file=sys.stderr)
        return 1
    return 0


def _http(engine, args, http) -> int:
    import time

    from jaxgen.inference.precompile import precompile
    from jaxgen.serving.server import create_app, serve_forever

    if engine.serve.precompile:  # before ready: no request waits for a compilation (issue 45)
        t0 = time.perf_counter()
        precompile(engine, progress=True)
        engine.stats.startup("precompile", time.perf_counter() - t0)
    name = http.model_name or Path(args.checkpoint).resolve().name
    app = create_app(engine, name, args.api_key, metrics_need_key=http.metrics_need_key)
    serve_forever(engine, app, http.host, http.port, grace_s=engine.serve.shutdown_grace_s)
    return 0
