"""Multi-LoRA serving: rows with different adapters (and none) in one batch, against each row alone and against
the adapter merged into the base weights (W + A @ B * scale, an independent computation); loading at run time
without recompiling; speculative decoding; the prefix cache kept apart per adapter; the HTTP doors."""

import dataclasses
import json
import pickle
import re
import time

import httpx
import jax
import numpy as np
import openai
import pytest

from jaxgen import model
from jaxgen.config import LoraConfig, ModelConfig, ServeConfig
from jaxgen.hf.export import save_pretrained
from jaxgen.hf.peft import write_peft_adapter
from jaxgen.inference.adapters import LoraError, LoraNotFound, LoraRegistry
from jaxgen.inference.engine import Engine
from jaxgen.inference.llm import LLM
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.model import lora
from jaxgen.serving.server import create_app
from jaxgen.tokenizer import Tokenizer
from tests.live import live_server

CFG = ModelConfig(vocab_size=257, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, max_seq_len=256)
SERVE = ServeConfig(slots=8, page_size=16, num_pages=96, chunk_steps=4, prefill_chunk=32, max_loras=3, max_lora_rank=8)
# name: (rank, targets, seed); ranks below max_lora_rank are padded with zeros
ADAPTERS = {
    "a1": (2, ("q", "v"), 1),
    "a2": (4, ("q", "k", "v", "o", "gate", "up", "down"), 2),
    "a3": (8, ("o", "down"), 3),
}
WEIGHT = {"q": ("w_q_dnh",), "k": ("w_k_dkh",), "v": ("w_v_dkh",), "o": ("w_o_nhd",), "gate": ("mlp", "w_gate_df"),
          "up": ("mlp", "w_up_df"), "down": ("mlp", "w_down_fd")}  # fmt: skip
ALPHA = 16.0


def _lora_cfg(name: str) -> ModelConfig:
    rank, targets, _ = ADAPTERS[name]
    return dataclasses.replace(CFG, lora=LoraConfig(rank=rank, alpha=ALPHA, targets=targets))


def _adapter(name: str) -> dict:
    """Random A and B (B is zero at init: nothing would change), float32 host arrays of `lora_specs`' shapes."""
    rng = np.random.default_rng(ADAPTERS[name][2])
    specs = lora.lora_specs(_lora_cfg(name))
    return {
        target: {k: (rng.uniform(-0.2, 0.2, s.shape) if k.startswith("a") else rng.normal(0, 0.05, s.shape)).astype(
            np.float32) for k, s in pair.items()}
        for target, pair in specs.items()
    }  # fmt: skip


def _merged(params: dict, name: str) -> dict:
    """The base weights with adapter `name` merged in: W + A @ B * alpha / rank, per target and layer."""
    cfg, adapters = _lora_cfg(name), _adapter(name)
    layers_ = jax.tree.map(np.asarray, params["layers"])  # a copy of the dict structure, on the host
    for target, pair in adapters.items():
        a, b = (pair[k] for k in sorted(pair))
        num_layers, r = a.shape[0], a.shape[-1]
        delta = (a.reshape(num_layers, -1, r) @ b.reshape(num_layers, r, -1)) * cfg.lora.scale
        *path, leaf = WEIGHT[target]
        holder = layers_
        for key in path:
            holder = holder[key]
        holder[leaf] = holder[leaf] + delta.reshape(holder[leaf].shape)
    return params | {"layers": layers_}


@pytest.fixture(scope="module")
def params():
    def init(key):  # sharper logits: no near-ties in argmax
        return jax.tree.map(lambda w: w * 5 if w.ndim > 1 else w, model.init_params(CFG, key))

    return jax.jit(init)(jax.random.key(0))


@pytest.fixture(scope="module")
def engine(params):
    engine = Engine(params, CFG, Tokenizer.byte_level(), SERVE)
    for name in ADAPTERS:
        engine.load_lora(name, _adapter(name), _lora_cfg(name).lora.scale)
    return engine


@pytest.fixture(scope="module")
def score(params):
    """Teacher-forced log-probabilities (T - 1,) of a sequence under params merged with an adapter (or none)."""
    merged = {None: params} | {name: jax.device_put(_merged(params, name)) for name in ADAPTERS}
    forward = jax.jit(lambda p, t, pos: jax.nn.log_softmax(model.forward(p, t, pos, cfg=CFG)[0], -1))

    def run(seq: list[int], name: str | None):
        tokens = np.zeros((1, 128), np.int32)
        tokens[0, : len(seq)] = seq
        positions = np.where(np.arange(128) < len(seq), np.arange(128), -1)[None].astype(np.int32)
        return np.asarray(forward(merged[name], tokens, positions))[0, : len(seq) - 1]

    return run


def _workload(n: int, seed: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 256, int(k)).tolist() for k in rng.integers(3, 40, n)]
    configs = [
        SamplingConfig(max_new_tokens=int(rng.integers(8, 24)), temperature=float(rng.choice([0.0, 0.8])),
                       seed=int(rng.integers(1000)))
        for _ in range(n)
    ]  # fmt: skip
    names = [[None, "a1", "a2", "a3"][i % 4] for i in range(n)]
    return prompts, configs, names


def _same(a, b):
    assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_a_mixed_batch_equals_each_row_alone_and_the_merged_weights(engine, score):
    prompts, configs, names = _workload(10, seed=0)
    together = engine.generate(prompts, configs, lora=names)  # 10 rows, 3 adapters and none, through 8 slots
    for p, c, name, out in zip(prompts, configs, names, together, strict=True):
        (alone,) = engine.generate([p], c, lora=name)
        _same(out, alone)
        # an independent computation: the whole sequence through the merged weights, no cache, no bank
        logp = score(p + out.tokens, name)[len(p) - 1 :]
        chosen = logp[np.arange(len(out.tokens)), out.tokens]
        np.testing.assert_allclose(out.logprobs, chosen, atol=2e-4)
        if c.temperature == 0:
            assert all(logp[i].max() - chosen[i] < 1e-4 for i in range(len(out.tokens)))
    # the adapters matter: one prompt, greedy, under each adapter and none gives 4 different outputs
    greedy = SamplingConfig(max_new_tokens=16, temperature=0.0)
    outs = engine.generate([prompts[0]] * 4, greedy, lora=[None, "a1", "a2", "a3"])
    assert len({tuple(o.tokens) for o in outs}) == 4


def test_speculative_decoding_equals_plain_decoding_with_adapters(engine):
    rng = np.random.default_rng(1)
    prompts = [(rng.integers(0, 256, 6).tolist() * 5)[: int(k)] for k in rng.integers(12, 30, 8)]  # repetitive
    plain = [SamplingConfig(max_new_tokens=20, temperature=float(t), seed=i) for i, t in enumerate([0.0, 0.7] * 4)]
    spec = [dataclasses.replace(c, num_speculative_tokens=4) for c in plain]
    names = [None, "a1", "a2", "a3"] * 2
    for a, b in zip(engine.generate(prompts, plain, lora=names), engine.generate(prompts, spec, lora=names),
                    strict=True):  # fmt: skip
        _same(a, b)


def test_the_prefix_cache_keeps_adapters_apart(engine):
    prompt = list(range(40, 90))  # 3 whole pages of 16 tokens can be shared
    c = SamplingConfig(max_new_tokens=6, temperature=0.0)
    engine.pool.clear_cache()
    first = {}
    for name in ("a1", "a2", None):
        [req] = engine.submit(prompt, c, lora=name)
        engine.run_until_idle()
        assert req.cached_tokens == 0  # the same tokens cached under another adapter: not shared
        first[name] = req.result().tokens
    for name in ("a1", "a2", None):
        [req] = engine.submit(prompt, c, lora=name)
        engine.run_until_idle()
        assert req.cached_tokens == 48  # its own adapter's pages: shared
        assert req.result().tokens == first[name]
    assert len({tuple(t) for t in first.values()}) == 3


def test_load_use_unload_reload_without_recompiling(engine):
    prompt, c = list(range(60, 75)), SamplingConfig(max_new_tokens=8, temperature=0.0)
    (before,) = engine.generate([prompt], c, lora="a3")
    compiled = engine.compilations
    engine.unload_lora("a3")
    assert sorted(engine.lora_names()) == ["a1", "a2"]
    with pytest.raises(LoraNotFound, match="a3"):
        engine.submit(prompt, c, lora="a3")
    engine.load_lora("b", _adapter("a1"), _lora_cfg("a1").lora.scale)  # a1's weights under another name
    (b,) = engine.generate([prompt], c, lora="b")
    (a1,) = engine.generate([prompt], c, lora="a1")
    assert b.tokens == a1.tokens and b.tokens != before.tokens
    engine.unload_lora("b")
    engine.load_lora("a3", _adapter("a3"), _lora_cfg("a3").lora.scale)
    (again,) = engine.generate([prompt], c, lora="a3")
    assert again.tokens == before.tokens
    assert engine.compilations == compiled  # loads write a slot of the fixed bank: nothing recompiled


def test_swapped_weights_keep_the_adapters_loaded(engine, params):
    prompt, c = list(range(30, 45)), SamplingConfig(max_new_tokens=8, temperature=0.0)
    before = [o.tokens for o in engine.generate([prompt] * 2, c, lora=["a1", None])]
    compiled = engine.compilations
    engine.update_params(params)  # the same weights again (as an RL step would swap new ones in)
    assert [o.tokens for o in engine.generate([prompt] * 2, c, lora=["a1", None])] == before
    assert sorted(engine.lora_names()) == ["a1", "a2", "a3"] and engine.compilations == compiled


def test_unloading_lets_running_requests_finish(engine):
    prompt, c = list(range(5, 25)), SamplingConfig(max_new_tokens=8, temperature=0.0)
    (want,) = engine.generate([prompt], c, lora="a2")
    [queued] = engine.submit(prompt, c, lora="a2")
    engine.unload_lora("a2")
    with pytest.raises(LoraError, match="slots is taken"):  # a2's slot is held while its request lives
        engine.load_lora("c", _adapter("a1"), 1.0)
    engine.run_until_idle()
    assert queued.result().tokens == want.tokens
    engine.load_lora("a2", _adapter("a2"), _lora_cfg("a2").lora.scale)  # its slot is free again


def test_bad_adapters_are_refused_naming_the_value(engine):
    with pytest.raises(LoraError, match=r"rank 16 is above serve\.max_lora_rank=8"):
        engine.load_lora("x", {"q": {"a_dr": np.zeros((2, 64, 16)), "b_rnh": np.zeros((2, 16, 4, 16))}})
    dora = {"a_dr": np.zeros((2, 64, 4)), "b_rnh": np.zeros((2, 4, 4, 16)), "m_nh": np.ones((2, 4, 16))}
    with pytest.raises(LoraError, match=r"lora_name='x': it is a DoRA adapter .* serves plain LoRA only"):
        engine.load_lora("x", {"q": dora})  # its magnitudes would need a factor per slot: merge it instead
    with pytest.raises(LoraError, match="target experts is not served"):
        engine.load_lora("x", {"experts": {}})
    with pytest.raises(LoraError, match="is loaded already"):
        engine.load_lora("a1", _adapter("a1"))
    with pytest.raises(LoraError, match=r"serve\.max_loras=3"):
        engine.load_lora("x", _adapter("a1"))
    with pytest.raises(LoraError, match="printable characters"):  # it would be listed and logged as it is
        engine.load_lora("x\n200 OK", _adapter("a1"))
    with pytest.raises(LoraError, match="not a folder"):
        engine.load_lora_folder("x", "/nonexistent")
    with pytest.raises(LoraNotFound, match="'nope'"):
        engine.generate([[1, 2, 3]], SamplingConfig(max_new_tokens=2), lora="nope")
    assert engine.idle() and sorted(engine.lora_names()) == ["a1", "a2", "a3"]


def test_a_batch_line_names_its_adapter(engine, tmp_path):
    from jaxgen.serving.batch_job import run_job

    lines = [{"id": "x", "prompt": "abc", "model": "a1"}, {"id": "y", "prompt": "abc"}, {"id": "z", "prompt": "abc",
             "model": "nope"}]  # fmt: skip
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    greedy = SamplingConfig(max_new_tokens=6, temperature=0.0)
    run_job(engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl", greedy)
    out = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    want = {name: engine.generate(["abc"], greedy, lora=name)[0].text for name in ("a1", None)}
    assert out["x"]["choices"][0]["text"] == want["a1"] != want[None] == out["y"]["choices"][0]["text"]
    assert "nope" in out["z"]["error"]


def test_llm_names_an_adapter_per_prompt(engine):
    llm = object.__new__(LLM)  # LLM's doors over this module's engine (a new LLM would compile its own)
    llm.engine = engine
    greedy = SamplingConfig(max_new_tokens=6, temperature=0.0)
    outs = llm.generate(["abc", "abc"], greedy, lora=["a1", None])
    want = [engine.generate(["abc"], greedy, lora=name)[0].tokens for name in ("a1", None)]
    assert [o.outputs[0].tokens for o in outs] == want and want[0] != want[1]
    assert [o.outputs[0].tokens for o in llm.generate("abc", greedy, lora="a1")] == want[:1]
    with pytest.raises(LoraNotFound):
        llm.generate("abc", greedy, lora="nope")
    assert engine.idle()


def test_llm_scores_with_an_adapter_as_the_merged_weights_do(engine, score):
    """LLM.score(..., lora=name) (issue 44) equals the teacher-forced log-probabilities of the weights with that
    adapter merged in, an independent computation; `greedy` says whether each token is the most likely one."""
    llm = object.__new__(LLM)  # LLM's doors over this module's engine
    llm.engine, llm.tokenizer, llm.cfg = engine, engine.tokenizer, CFG
    prompts = [[5, 6, 7, 8], [40, 41, 42]]
    for name in ("a1", "a3"):
        greedy = engine.generate([prompts[0]], SamplingConfig(max_new_tokens=4, temperature=0.0), lora=name)[0]
        continuations = [greedy.tokens, [200, 3, 90, 17, 250]]
        got = llm.score(prompts, continuations, lora=name)
        for p, c, g in zip(prompts, continuations, got, strict=True):
            logp = score(p + c, name)[len(p) - 1 :]
            np.testing.assert_allclose(g["token_logprobs"], logp[np.arange(len(c)), c], atol=2e-4)
            assert g["tokens"] == len(c) and g["greedy"] == (logp.argmax(-1) == c).all()
        assert [g["greedy"] for g in got] == [True, False]
    with pytest.raises(LoraNotFound):
        llm.score(prompts, [[1], [2]], lora="nope")
    assert engine.idle()


def test_after_precompiles_bank_write_loading_an_adapter_compiles_nothing(params):
    """`precompile` writes zeros into an empty slot of the bank (`Runner.compile_bank`): the program an adapter
    load runs is then compiled before ready (issue 45), and the zeros change no output (slot 0 and 1 alike)."""
    engine = Engine(params, CFG, Tokenizer.byte_level(), dataclasses.replace(SERVE, max_loras=1))
    try:
        engine.runner.compile_bank()
        bank = lora.bank_of(engine.params)
        assert all(not np.any(np.asarray(w)) for w in jax.tree.leaves(bank))  # still all zeros
        compiled = engine.compilations
        engine.load_lora("a1", _adapter("a1"), _lora_cfg("a1").lora.scale)
        assert engine.compilations == compiled
    finally:
        engine.stop()


def test_a_replacement_takes_the_old_slot_only_when_no_request_holds_it():
    """LoraRegistry.reserve(replace=True): the loaded adapter's own slot counts as free unless a live request
    uses it; with no slot free it is refused and the old adapter stays (load_inplace lost it before issue 44)."""
    registry = LoraRegistry(max_loras=2)
    for name in ("a", "b"):
        registry.add(registry.reserve(name, set()))
    old = registry.resolve("a")
    with pytest.raises(LoraError, match="slots is taken"):
        registry.reserve("a", {old.slot}, replace=True)
    assert registry.resolve("a") == old
    new = registry.reserve("a", set(), replace=True)
    assert new.slot == old.slot and new.key != old.key and registry.resolve("a") == old  # swapped by add alone
    registry.add(new)
    assert registry.resolve("a") == new and registry.names() == ["a", "b"]


# --- the HTTP server, through the openai client ----------------------------------------------------------


ADMIN = "admin-secret"


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    """A live server whose clients may load adapter folders inside `root` (serve.lora_root), the admin any."""
    root = tmp_path_factory.mktemp("adapters")
    folder = write_peft_adapter(root / "a1", _adapter("a1"), _lora_cfg("a1"))
    serve = dataclasses.replace(SERVE, lora_root=str(root), admin_token=ADMIN)
    with live_server(engine, create_app(engine, "tiny", serve=serve)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, url, folder


def _settled(url: str, engine, baseline_s: float) -> None:
    """After a hostile case: a1..a3 loaded as before, no request holds a slot, a page or a place in the queue,
    and /health answers within 1 s or 10 times its time measured before the case (a busy machine)."""
    assert sorted(engine.lora_names()) == ["a1", "a2", "a3"]
    assert engine.idle() and engine.pool.in_use() == 0
    t = time.perf_counter()
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200
    assert time.perf_counter() - t < max(1.0, 10 * baseline_s)


def _health_time(url: str) -> float:
    times = []
    for _ in range(3):
        t = time.perf_counter()
        httpx.get(f"{url}/health", timeout=60)
        times.append(time.perf_counter() - t)
    return min(times)


def test_the_server_serves_adapters_by_model_name(server, engine):
    client, url, folder = server
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == "tiny" and sorted(ids[1:]) == ["a1", "a2", "a3"]
    prompt = "def fib(n):"
    want = {name: engine.generate([prompt], SamplingConfig(max_new_tokens=12, temperature=0.0), lora=name)[0].text
            for name in ("a1", None)}  # fmt: skip
    got = client.completions.create(model="a1", prompt=prompt, max_tokens=12, temperature=0)
    assert got.choices[0].text == want["a1"] and got.model == "a1"
    base = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert base.choices[0].text == want[None] != want["a1"]

    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt=prompt, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"

    # a PEFT folder inside serve.lora_root loaded at run time, as vLLM's endpoints take it: the same output as a1
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "peft1", "lora_path": str(folder)})
    assert r.status_code == 400 and "serve.max_loras=3" in r.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a3"}).status_code == 200
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "peft1", "lora_path": "a1"})  # in the root
    assert r.status_code == 200, r.text
    assert sorted(m.id for m in client.models.list().data) == ["a1", "a2", "peft1", "tiny"]
    chat = [{"role": "user", "content": "hi"}]
    same = [
        client.chat.completions.create(model=m, messages=chat, max_tokens=8, temperature=0) for m in ("a1", "peft1")
    ]
    assert same[0].choices[0].message.content == same[1].choices[0].message.content

    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(folder.parent / "nothing")})
    assert r.status_code == 400 and "nothing' is not a folder" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "peft1"}).status_code == 200
    engine.load_lora("a3", _adapter("a3"), _lora_cfg("a3").lora.scale)


class _Runs:
    """Unpickled, it creates the file `marker`: proof that a loader read the pickle."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def _load(url: str, name: str, path, headers=None, **fields) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path), **fields}
    return httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=headers, timeout=120)


def test_loading_a_folder_needs_the_admin_token_or_the_lora_root(server, engine, tmp_path):
    """Issue 44, as a hostile client: a client loads only folders inside serve.lora_root, symlinks and `..`
    resolved (403 before the folder is looked at, the same for a path that exists and one that does not), the
    admin any folder; a pickle is never read, NaN weights and another model's shapes are refused, naming them.
    After each case the adapters, slots, pages and queue are as before and /health answers."""
    _, url, folder = server
    root, base = folder.parent, _health_time(url)
    outside = write_peft_adapter(tmp_path / "outside", _adapter("a1"), _lora_cfg("a1"))
    (root / "link").symlink_to(outside)  # a symlink in the root to a folder outside it
    (root / "half").mkdir()  # a folder in the root whose config is a symlink to a file outside
    (root / "half" / "adapter_config.json").symlink_to(outside / "adapter_config.json")
    (root / "half" / "adapter_model.safetensors").symlink_to(folder / "adapter_model.safetensors")
    for path in (outside, "/etc", "/nonexistent", "../" * 30 + "etc", f"../{tmp_path.name}/outside", root / "link",
                 root / "half", "a1\0"):  # fmt: skip
        for headers in (None, {"Authorization": "Bearer not-the-admin"}):
            r = _load(url, "x", path, headers)
            assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden_path", r.text
            assert f"lora_path={str(path)!r} is outside serve.lora_root" in r.json()["error"]["message"]
        _settled(url, engine, base)
    # what the admin may load: any folder, never a pickle
    auth = {"Authorization": f"Bearer {ADMIN}"}
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a3"}).status_code == 200
    assert _load(url, "x", outside, auth).status_code == 200
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 200
    engine.load_lora("a3", _adapter("a3"), _lora_cfg("a3").lora.scale)
    evil = root / "evil"
    evil.mkdir()
    (evil / "adapter_config.json").write_text((folder / "adapter_config.json").read_text())
    (evil / "adapter_model.bin").write_bytes(pickle.dumps(_Runs(tmp_path / "ran")))
    nan = _adapter("a1")
    nan["v"]["b_rkh"][1, 0, 0, 0] = np.nan
    write_peft_adapter(root / "nan", nan, _lora_cfg("a1"))
    other = dataclasses.replace(CFG, d_model=32, lora=_lora_cfg("a1").lora)
    write_peft_adapter(root / "other", jax.tree.map(np.ones_like, lora.init_lora(other, jax.random.key(0))), other)
    for path, message in (("evil", "adapter_model.bin: a pickle, never read"), ("nan", "NaN or infinite"),
                          ("other", r"do not fit this model: allowed \(r, 64\)")):  # fmt: skip
        for headers in (None, auth):
            r = _load(url, "x", path if headers is None else root / path, headers)
            assert r.status_code == 400 and r.json()["error"]["param"] in ("lora_path", "lora_name"), r.text
            assert re.search(message, r.json()["error"]["message"]), r.text
            _settled(url, engine, base)
    assert not (tmp_path / "ran").exists()


def test_load_inplace_replaces_an_adapter_only_once_the_new_one_loaded(server, engine):
    """Issue 44: load_inplace with a folder that does not load, or another model's, is a 400 and the adapter
    stays loaded as it was (it was unloaded first, and lost); with every slot taken, a replacement takes the
    adapter's own slot."""
    url = server[1]
    base = _health_time(url)
    prompt, greedy = "def fib(n):", SamplingConfig(max_new_tokens=10, temperature=0.0)
    want = {name: engine.generate([prompt], greedy, lora=name)[0].text for name in ("a1", "a2")}
    assert want["a1"] != want["a2"]
    for path in ("nothing", "other", "/etc"):
        assert _load(url, "a2", path, load_inplace=True).status_code in (400, 403)
        assert engine.generate([prompt], greedy, lora="a2")[0].text == want["a2"]
        _settled(url, engine, base)
    r = _load(url, "a2", "a1", load_inplace=True)  # a1's weights under the name a2; the 3 slots are all taken
    assert r.status_code == 200, r.text
    assert engine.generate([prompt], greedy, lora="a2")[0].text == want["a1"]
    engine.load_lora("a2", _adapter("a2"), _lora_cfg("a2").lora.scale, replace=True)
    assert engine.generate([prompt], greedy, lora="a2")[0].text == want["a2"]
    _settled(url, engine, base)


def test_update_weights_refuses_nan_weights_and_keeps_the_old(server, engine, params, tmp_path):
    """Issue 44: POST /v1/admin/update_weights with a folder holding a NaN weight is a 400 naming it, and the
    engine keeps answering with its weights (it swapped them in and answered NUL bytes ever after)."""
    _, url, _ = server
    base = _health_time(url)
    prompt, greedy = [7, 8, 9, 10], SamplingConfig(max_new_tokens=6, temperature=0.0)
    want = engine.generate([prompt], greedy)[0].tokens
    bad = jax.tree.map(np.array, params)
    bad["layers"]["w_o_nhd"][1, 0, 0, 0] = np.nan
    folder = save_pretrained(tmp_path / "nan", bad, CFG, Tokenizer.byte_level())
    auth = {"Authorization": f"Bearer {ADMIN}"}
    r = httpx.post(f"{url}/v1/admin/update_weights", json={"path": str(folder)}, headers=auth, timeout=120)
    assert r.status_code == 400 and "NaN or infinite" in r.json()["error"]["message"], r.text
    assert "w_o_nhd" in r.json()["error"]["message"]
    assert engine.generate([prompt], greedy)[0].tokens == want
    _settled(url, engine, base)


@pytest.mark.parametrize("rows", [[2, 0, 2], [2, 0, 2, 1, 0, 2]])  # rows <= slots: gathered; more: every slot
def test_the_gathered_product_equals_the_single_adapter_path(rows):
    """lora.delta over a Bank (each row its slot) equals lora.delta with that row's adapter alone."""
    cfg = _lora_cfg("a2")
    adapters = _adapter("a2")
    stacked = jax.tree.map(np.asarray, lora.init_bank(CFG, 2, 8))
    stacked = jax.jit(lora.write_slot)(stacked, 2, lora.bank_entry(adapters, cfg.lora.scale, stacked))
    layer0 = jax.tree.map(lambda w: w[0], stacked)
    x = np.random.default_rng(5).normal(size=(len(rows), 5, 64)).astype(np.float32)
    got = jax.jit(lambda x, bank: lora.delta(x, bank, "q", cfg))(x, lora.Bank(layer0, np.array(rows, np.int32)))
    want = jax.jit(lambda x, a: lora.delta(x, a, "q", cfg))(x, jax.tree.map(lambda w: w[0], adapters))
    for i, slot in enumerate(rows):
        if slot == 2:
            np.testing.assert_allclose(got[i], want[i], atol=1e-5)
        else:  # slot 0: no adapter; slot 1: empty
            assert not np.asarray(got[i]).any()
