"""The JSONL batch generation job behind `serve.py generate --input ... --output ...`.

Input: one JSON object per line, `{"id": ..., "prompt": "...", <any SamplingConfig field>}`.
Output: one JSON object per request, appended as it finishes:
    {"id", "choices": [{"text", "finish_reason", "tokens", "logprobs"}], "prompt_tokens"}
or, for a bad line, {"id", "error"} (the job goes on). Running the same command again skips ids
already in the output, so a killed job resumes with nothing lost or duplicated.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from tqdm import tqdm

from jaxgen.engine import Engine
from jaxgen.generate import Generator
from jaxgen.sampling import SamplingConfig, SamplingError


@dataclasses.dataclass
class Request:
    id: str
    prompt_ids: list[int]
    sampling: SamplingConfig


def read_done_ids(output: Path) -> set[str]:
    """Ids already written; a torn last line (killed mid-write) is cut off."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        output.write_bytes(complete)
    return {json.loads(line)["id"] for line in complete.decode().splitlines() if line.strip()}


def parse_line(line: str, lineno: int, gen: Generator, defaults: SamplingConfig) -> Request:
    """A request, or SamplingError naming what is wrong with the line."""
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
    settings = {k: v for k, v in record.items() if k not in ("id", "prompt")}
    sampling = SamplingConfig.from_dict(dataclasses.asdict(defaults) | settings)
    (ids,) = gen.encode_prompts([record["prompt"]])
    if hasattr(gen, "check"):  # the engine: a request that can never run is this line's error
        gen.check(ids, sampling)
    return Request(str(record["id"]), ids, sampling)


def run_job(gen, input_path: Path, output_path: Path, defaults: SamplingConfig, batch_size: int = 16):
    """Runs every request of `input_path` not yet in `output_path`; returns the summary dict.

    gen: an `Engine` (every request queued at once: slots refill as sequences finish, and results are
    written as they complete) or a `Generator` (batches of `batch_size`, sorted by prompt length).
    """
    done = read_done_ids(output_path)
    requests, errors = [], []
    seen = set(done)
    for lineno, line in enumerate(input_path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            req = parse_line(line, lineno, gen, defaults)
        except SamplingError as e:
            rid = _id_of(line, lineno)
            if rid not in seen:
                errors.append({"id": rid, "error": str(e)})
                seen.add(rid)
            continue
        if req.id in seen:
            if req.id not in done:
                errors.append({"id": f"line-{lineno}", "error": f"duplicate id {req.id!r}"})
            continue
        seen.add(req.id)
        requests.append(req)
    start = time.perf_counter()
    compiled_before = gen.compilations
    with output_path.open("a") as out, tqdm(total=len(requests), desc="generate", unit="req") as bar:
        for e in errors:
            out.write(json.dumps(e) + "\n")
        out.flush()
        run = _run_on_engine if isinstance(gen, Engine) else _run_in_batches
        tokens = run(gen, requests, out, bar, start, batch_size)
    elapsed = time.perf_counter() - start
    return {
        "requests": len(requests), "errors": len(errors), "skipped_done": len(done), "tokens": tokens,
        "seconds": round(elapsed, 2), "tokens_per_s": round(tokens / max(elapsed, 1e-9), 1),
        "compilations": gen.compilations - compiled_before,
    }  # fmt: skip


def _record(req: Request, completions) -> dict:
    choices = [
        {"text": c.text, "finish_reason": c.finish_reason, "tokens": c.tokens, "logprobs": c.logprobs}
        for c in completions
    ]
    return {"id": req.id, "choices": choices, "prompt_tokens": len(req.prompt_ids)}


def _write(out, record: dict, bar, start: float, tokens: int) -> int:
    out.write(json.dumps(record) + "\n")
    out.flush()
    tokens += sum(len(c["tokens"]) for c in record["choices"])
    bar.update(1)
    bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.0f}")
    return tokens


def _run_on_engine(engine: Engine, requests: list[Request], out, bar, start: float, _batch_size: int) -> int:
    pending = {req.id: (req, engine.submit(req.prompt_ids, req.sampling)) for req in requests}
    tokens = 0
    while pending:
        engine.step()
        for rid, (req, seqs) in list(pending.items()):
            if all(s.done_event.is_set() for s in seqs):
                tokens = _write(out, _record(req, [s.result() for s in seqs]), bar, start, tokens)
                del pending[rid]
    return tokens


def _run_in_batches(gen: Generator, requests: list[Request], out, bar, start: float, batch_size: int) -> int:
    requests = sorted(requests, key=lambda r: len(r.prompt_ids))  # similar lengths batch together
    tokens = 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        results = gen.generate([r.prompt_ids for r in batch], [r.sampling for r in batch])
        by_prompt: dict[int, list] = {}
        for c in results:
            by_prompt.setdefault(c.prompt_index, []).append(c)
        for j, req in enumerate(batch):
            tokens = _write(out, _record(req, by_prompt[j]), bar, start, tokens)
    return tokens


def _id_of(line: str, lineno: int) -> str:
    try:
        record = json.loads(line)
        if isinstance(record, dict) and "id" in record:
            return str(record["id"])
    except json.JSONDecodeError:
        pass
    return f"line-{lineno}"
