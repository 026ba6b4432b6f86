"""The JSONL batch generation job behind `serve.py generate --input ... --output ...`.

Input: one JSON object per line, `{"id": ..., "prompt": "...", <any SamplingConfig field>}` (a constraint as
`structured`, or as the HTTP server takes it: response_format, structured_outputs, guided_*; `model` names a
LoRA adapter the engine has loaded, serve.lora_modules, absent or null for the base model), read as a
stream of bytes split at b"\\n" only (U+2028 and the like inside a JSON string are text, not line ends).
Output: one JSON object per line, appended as each is known:
    {"id", "choices": [{"text", "finish_reason", "tokens", "logprobs"}], "prompt_tokens"}
(with "prompt_logprobs": [null, ...] beside "prompt_tokens" when a line asks for them, e.g. to score a
corpus: `{"id": 1, "prompt": "...", "max_new_tokens": 0, "prompt_logprobs": 0}`)
or {"id", "error"} for a line that can never give a result: not UTF-8, not JSON, a setting out of
range, or a request the engine failed (run again alone first, in case it only failed beside another).
A bad line costs only itself; the job goes on. Running the same command again skips ids already in
the output, so a killed job resumes with nothing lost or duplicated.
"""

from __future__ import annotations

import codecs
import dataclasses
import glob
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from tqdm import tqdm

from jaxgen.distributed import barrier, is_main
from jaxgen.inference.engine import Engine
from jaxgen.inference.sampling import SamplingConfig, SamplingError
from jaxgen.serving import structured_fields

log = logging.getLogger(__name__)
COMPLETE = ("stop", "length")  # finish reasons of a sample that completed
MAX_FAILED_STEPS = 3  # engine steps that raise in a row: the engine is broken, not a line; the job stops


@dataclasses.dataclass
class Line:
    id: str
    prompt_ids: list[int]
    sampling: SamplingConfig
    lora: str | None = None  # the LoRA adapter the line's `model` names (None: the base model)


@dataclasses.dataclass
class Output:
    """The output file and the job's counts: one flushed line per record, one bar tick per input line."""

    out: IO[str]
    bar: tqdm
    start: float
    requests: int = 0  # good lines read
    errors: int = 0
    tokens: int = 0
    failed_steps: int = 0  # engine steps that raised since the last one that did not

    def result(self, req: Line, completions) -> None:
        choices = [
            {"text": c.text, "finish_reason": c.finish_reason, "tokens": c.tokens, "logprobs": c.logprobs}
            for c in completions
        ]
        record = {"id": req.id, "choices": choices, "prompt_tokens": len(req.prompt_ids)}
        if completions and completions[0].prompt_logprobs is not None:
            record["prompt_logprobs"] = completions[0].prompt_logprobs
        self._write(record)
        self.tokens += sum(len(c.tokens) for c in completions)
        self.bar.set_postfix(tok_s=f"{self.tokens / max(time.perf_counter() - self.start, 1e-9):.0f}")

    def error(self, rid: str, message: str) -> None:
        self._write({"id": rid, "error": message})
        self.errors += 1

    def skip(self) -> None:
        self.bar.update(1)

    def _write(self, record: dict) -> None:
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()
        self.bar.update(1)


def read_done_ids(output: Path) -> set[str]:
    """Ids already written. A torn last line (killed mid-write) is cut off in place; the file is read
    as a stream, and a complete line that is not a record (a damaged disk block) is skipped."""
    if not output.exists():
        return set()
    cut_torn_tail(output)
    done = set()
    with output.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            try:
                rid = _record_id(line.decode("utf-8"))
            except UnicodeDecodeError:
                rid = None
            if rid is not None:
                done.add(rid)
            elif line.strip():
                log.warning("%s line %d is not a JSON record with an id; ignored", output, lineno)
    return done


def cut_torn_tail(path: Path, block: int = 1 << 16) -> None:
    """Truncates the file just after its last b"\\n": no complete line is rewritten or ever at risk."""
    with path.open("rb") as f:
        end = pos = f.seek(0, os.SEEK_END)
        keep = 0
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            i = f.read(pos - start).rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            pos = start
    if keep < end:
        log.warning("%s: cutting a torn last line (%d bytes) left by a killed job", path, end - keep)
        os.truncate(path, keep)


def parse_line(raw: bytes | str, lineno: int, engine: Engine, defaults: SamplingConfig) -> Line:
    """A request, or an exception (SamplingError for the expected cases) saying what is wrong with the line."""
    line = _decode(raw, lineno) if isinstance(raw, bytes) else raw
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise SamplingError(f"line {lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise SamplingError(f"line {lineno}: expected a JSON object, got {type(record).__name__}")
    if "id" not in record:
        raise SamplingError(f"line {lineno}: missing field 'id'")
    if not isinstance(record.get("prompt"), str):
        raise SamplingError("field 'prompt' is missing or not a string")
    settings = {k: v for k, v in record.items() if k not in ("id", "prompt", "model", *structured_fields.FIELDS)}
    adapter = _adapter(record.get("model"), engine)
    field = _constraint(record, settings)
    sampling = _sampling(settings, defaults)
    (ids,) = engine.encode_prompts([record["prompt"]])
    try:
        engine.check(ids, sampling)  # a request that can never run is this line's error
    except SamplingError as e:
        if e.field == "structured" and field != "structured":  # named as the line named it
            raise SamplingError(f"{field}: {e}", field) from None
        raise
    return Line(str(record["id"]), ids, sampling, adapter)


def _adapter(name, engine: Engine) -> str | None:
    """The LoRA adapter a line's `model` names (None: the base model); a SamplingError for one not loaded."""
    if name is None or name in engine.lora_names():
        return name
    loaded = ", ".join(map(repr, engine.lora_names())) or "none (serve.lora_modules)"
    raise SamplingError(f"model={name!r} names no loaded LoRA adapter (loaded: {loaded})", "model")


def _constraint(record: dict, settings: dict) -> str:
    """Puts the line's constraint into `settings` as `structured`, from whichever field carried it
    (`structured`, or OpenAI's response_format, or vLLM's structured_outputs / guided_*); returns that field."""
    try:
        structured, field = structured_fields.requested(record)
    except structured_fields.ConstraintError as e:
        raise SamplingError(str(e), e.field) from None
    if field is None:
        return "structured"
    if "structured" in record:
        raise SamplingError(f"structured and {field} both constrain the output; give at most one", field)
    settings["structured"] = structured
    return field


def _decode(raw: bytes, lineno: int) -> str:
    if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8) :]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SamplingError(f"line {lineno}: not UTF-8 (byte {e.start}: {e.reason})") from None


def _sampling(settings: dict, defaults: SamplingConfig) -> SamplingConfig:
    """The line's settings over the defaults; a value of the wrong shape (logit_bias {"abc": 1}) is
    a SamplingError naming its field."""
    try:
        return SamplingConfig.from_dict(dataclasses.asdict(defaults) | settings)
    except SamplingError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        bad = [k for k in settings if _fails(lambda k=k: SamplingConfig.from_dict({k: settings[k]}))]
        name = bad[0] if bad else ", ".join(settings)
        raise SamplingError(f"{name}={settings.get(name)!r} is not allowed: {type(e).__name__}: {e}") from None


def run_job(
    engine: Engine, input_path: Path, output_path: Path, defaults: SamplingConfig,
    lines: tuple[int, int] = (0, 1), done: set[str] | None = None,
):  # fmt: skip
    """Runs every request of `input_path` not yet in `output_path` on the engine; returns the summary dict.

    Lines stream in, a few per slot queued ahead: slots refill as sequences finish, and results are
    written as they complete. lines=(i, n): only lines i, i + n, i + 2n, ... (counted from 0) are this
    job's (`run_split`). done: the ids to skip (default: those in `output_path`).
    """
    done = read_done_ids(output_path) if done is None else done
    with input_path.open("rb") as f:
        total = sum(1 for j, _ in enumerate(f) if j % lines[1] == lines[0])
    start = time.perf_counter()
    compiled_before = engine.compilations
    bar = tqdm(total=total, desc="generate", unit="line", disable=not is_main())
    with output_path.open("a", encoding="utf-8") as out, bar:
        sink = Output(out, bar, start)
        _run_on_engine(engine, _read_requests(input_path, engine, defaults, done, sink, lines), sink)
    elapsed = time.perf_counter() - start
    return {
        "requests": sink.requests, "errors": sink.errors, "skipped_done": len(done), "tokens": sink.tokens,
        "seconds": round(elapsed, 2), "tokens_per_s": round(sink.tokens / max(elapsed, 1e-9), 1),
        "compilations": engine.compilations - compiled_before,
    }  # fmt: skip


def part_path(output_path: Path, index: int, count: int) -> Path:
    """Where process `index` of `count` writes its share of a split job, beside the output."""
    return output_path.with_name(f"{output_path.name}.part{index}-of-{count}")


def _parts(output_path: Path) -> list[Path]:
    return sorted(output_path.parent.glob(glob.escape(output_path.name) + ".part*-of-*"))


def run_split(engine: Engine, input_path: Path, output_path: Path, defaults: SamplingConfig) -> dict:
    """Data parallel over processes: process i of n runs input lines i, i + n, ... on its own engine into
    `part_path(output, i, n)`; once all are done, process 0 appends the parts to the output and deletes them.

    Killed at any point, the same command (with any number of processes) resumes: ids in the output or in
    any part are skipped, and the merge appends only ids the output does not hold yet. A single process
    merges what parts there are, then writes straight to the output (`run_job`).
    """
    import jax

    index, count = jax.process_index(), jax.process_count()
    if count == 1:  # one process writes straight to the output, after taking in what a split run left
        merged = merge_parts(output_path)
        return run_job(engine, input_path, output_path, defaults) | ({"merged": merged} if merged else {})
    done = read_done_ids(output_path)
    for part in _parts(output_path):
        done |= read_done_ids(part)
    barrier("jaxgen-batch-read")  # every process has read the parts before any writes to its own
    summary = run_job(engine, input_path, part_path(output_path, index, count), defaults, (index, count), done)
    barrier("jaxgen-batch-done", timeout_s=30 * 86400)  # the others may run for long: this only waits
    if is_main():
        summary["merged"] = merge_parts(output_path)
    barrier("jaxgen-batch-merged", timeout_s=30 * 86400)  # the others stay until the merge is done
    return summary


def merge_parts(output_path: Path) -> int:
    """Appends the records of every part file whose id the output lacks, then deletes the parts; returns
    how many were appended. A merge that is killed is done again by the next one, without duplicates."""
    parts = _parts(output_path)
    if not parts:
        return 0
    done = read_done_ids(output_path)
    added = 0
    with output_path.open("ab") as out:
        for part in parts:
            cut_torn_tail(part)
            with part.open("rb") as f:
                for line in f:
                    rid = _record_id(line.decode("utf-8", "replace"))
                    if rid is not None and rid not in done:
                        out.write(line)
                        done.add(rid)
                        added += 1
        out.flush()
        os.fsync(out.fileno())
    for part in parts:
        part.unlink()
    return added


def run_shared(engine: Engine, input_path: Path, output_path: Path, defaults: SamplingConfig) -> dict:
    """Model parallel over processes: every process runs every line on one engine over a mesh that spans them
    (the same schedule, so the same device programs in the same order); process 0 writes the output."""
    done = read_done_ids(output_path)
    barrier("jaxgen-batch-read")  # all start from the same ids done, before process 0 appends any
    return run_job(engine, input_path, output_path if is_main() else Path(os.devnull), defaults, done=done)


def _read_requests(
    input_path: Path, engine: Engine, defaults: SamplingConfig, done: set[str], sink: Output, lines=(0, 1)
) -> Iterator[Line]:
    """The good lines not done yet, streamed; every other line's error record is written on the way."""
    seen = set(done)
    with input_path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):  # binary lines end at b"\n" only
            if (lineno - 1) % lines[1] != lines[0]:
                continue  # another process's line
            if not raw.strip():
                sink.skip()
                continue
            try:
                req = parse_line(raw, lineno, engine, defaults)
            except Exception as e:  # whatever the line did wrong, it is this line's error alone
                rid = _id_of(raw, lineno)
                if rid in seen:
                    sink.skip()
                else:
                    sink.error(rid, _message(e))
                    seen.add(rid)
                continue
            if req.id in seen:
                if req.id in done:
                    sink.skip()
                else:
                    sink.error(f"line-{lineno}", f"duplicate id {req.id!r}")
                continue
            seen.add(req.id)
            sink.requests += 1
            yield req


def _run_on_engine(engine: Engine, requests: Iterator[Line], sink: Output) -> None:
    window = 4 * engine.serve.slots  # lines queued ahead, so a freed slot refills at once
    for req in _drive(engine, requests, sink, window, alone=False):
        _drive(engine, iter([req]), sink, 1, alone=True)  # it failed beside others: alone, a failure is its own
    if not engine.idle():  # lines taken out after a step that raised are still queued, cancelled: drop them
        try:
            engine.step()
        except Exception:
            log.exception("engine step failed while dropping cancelled requests")


def _drive(engine: Engine, requests: Iterator[Line], sink: Output, window: int, alone: bool) -> list[Line]:
    """Runs the requests, at most `window` lines in the engine at once; returns the lines to run again alone."""
    pending: dict[str, tuple[Line, list]] = {}
    retry: list[Line] = []
    while True:
        while len(pending) < window and (req := next(requests, None)) is not None:
            try:
                pending[req.id] = (req, engine.submit(req.prompt_ids, req.sampling, lora=req.lora))
            except Exception as e:
                if not getattr(engine, "accepting", True):
                    raise  # the engine is closing: not this line's fault, and a rerun resumes here
                sink.error(req.id, _message(e))
        if not pending:
            return retry
        if not _step(engine, pending, sink, retry, alone):
            continue
        for rid, (req, seqs) in list(pending.items()):
            if all(s.done_event.is_set() for s in seqs):
                del pending[rid]
                completions, error, again = _outcome(seqs)
                if error is None:
                    sink.result(req, completions)
                elif again and not alone:
                    retry.append(req)
                else:
                    sink.error(req.id, error)


def _step(engine: Engine, pending: dict, sink: Output, retry: list[Line], alone: bool) -> bool:
    """One engine step. A step that raises blames no request: every line in flight leaves the engine,
    to run again alone (or, when it ran alone, gets the error). False after such a step."""
    try:
        engine.step()
        sink.failed_steps = 0
        return True
    except Exception as e:
        sink.failed_steps += 1
        if sink.failed_steps >= MAX_FAILED_STEPS:
            raise
        log.exception("engine step failed; the %d line(s) in flight run again alone", len(pending))
        for req, seqs in pending.values():
            for s in seqs:
                engine.cancel(s)
            if alone:
                sink.error(req.id, f"the engine failed on this request: {_message(e)}")
            else:
                retry.append(req)
        pending.clear()
        return False


def _outcome(seqs) -> tuple[list | None, str | None, bool]:
    """(completions, None) when every sample completed, else (None, the error, whether a rerun may succeed)."""
    completions = []
    for s in seqs:
        try:
            c = s.result(0)
        except Exception as e:
            return None, f"the engine failed on this request: {_message(e)}", True
        if c.finish_reason not in COMPLETE:
            why = getattr(s, "error", None) or c.finish_reason or "no finish reason"
            return None, f"the engine ended this request: {why}", c.finish_reason != "cancelled"
        completions.append(c)
    return completions, None, False


def _fails(fn) -> bool:
    try:
        fn()
    except Exception:
        return True
    return False


def _message(e: Exception) -> str:
    """An error record's text: a SamplingError speaks for itself; anything else says what it was."""
    text = str(e) if isinstance(e, SamplingError) else f"{type(e).__name__}: {e}"
    return text if len(text) <= 1000 else text[:1000] + "..."


def _record_id(line: str) -> str | None:
    """The id of a JSON record line, None for anything else."""
    try:
        record = json.loads(line)
    except Exception:  # not JSON, or nested past the recursion limit
        return None
    return str(record["id"]) if isinstance(record, dict) and "id" in record else None


def _id_of(raw: bytes | str, lineno: int) -> str:
    """The id of a bad line when it can still be read (bytes that are not UTF-8 replaced), else line-N."""
    rid = _record_id(raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw)
    return f"line-{lineno}" if rid is None else rid
