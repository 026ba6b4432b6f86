"""A hostile or damaged Hugging Face folder: the loader refuses it with an HFError naming the folder or
file and the entry, and never reads a byte outside the folder or past a file's end.

The folders are written by jaxgen's own `save_pretrained` (the format transformers writes and reads),
from a tiny random Llama, then damaged one way each. Without the checks each damaged folder loaded
(weights from outside the folder) or failed with a numpy, JSON, file-not-found or memory error.
"""

import json
import re
import shutil
from pathlib import Path
from unittest import mock

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from jaxgen import hf, model
from jaxgen.config import ModelConfig, ServeConfig
from jaxgen.inference.engine import Engine
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.tokenizer import Tokenizer

CFG = ModelConfig(vocab_size=257, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64, max_seq_len=64)
INDEX = "model.safetensors.index.json"


def _one_device():
    return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))


def _load(folder):
    return hf.load_pretrained(folder, mesh=_one_device())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(params, single-file folder, sharded folder with an index.json)."""
    params = model.init_params(CFG, jax.random.key(0))
    root = tmp_path_factory.mktemp("hostile")
    single = hf.save_pretrained(root / "single", params, CFG, Tokenizer.byte_level())
    sharded = hf.save_pretrained(root / "sharded", params, CFG, Tokenizer.byte_level(), max_shard_bytes=20_000)
    assert (sharded / INDEX).exists() and not (single / INDEX).exists()
    return params, single, sharded


def _copy(folder: Path, dst: Path) -> Path:
    shutil.copytree(folder, dst)
    return dst


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path: Path, header, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def _last_tensor(header: dict) -> str:
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])


def test_the_undamaged_folders_load(saved):
    params, single, sharded = saved
    for folder in (single, sharded):
        _, _, loaded = _load(folder)
        assert all(jax.tree.leaves(jax.tree.map(np.array_equal, loaded, params)))


# --- files outside the folder --------------------------------------------------------------------


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_weight_map_pointing_outside_the_folder_is_refused(saved, tmp_path, how):
    """A valid shard moved next to the folder: the loader would read it happily if it followed the map."""
    _, _, sharded = saved
    folder = _copy(sharded, tmp_path / "model")
    index = json.loads((folder / INDEX).read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    outside = tmp_path / "outside.safetensors"
    (folder / shard).rename(outside)
    if how == "symlink":
        name = "link.safetensors"
        (folder / name).symlink_to(Path("..") / outside.name)
    else:
        name = "../outside.safetensors" if how == "dotdot" else str(outside)
    index["weight_map"] = {k: name if f == shard else f for k, f in index["weight_map"].items()}
    (folder / INDEX).write_text(json.dumps(index))
    tensor = next(k for k, f in index["weight_map"].items() if f == name)
    want = f"{folder}: file {name!r} ({INDEX} maps tensor {tensor!r} to it) resolves to {outside}, outside the model"
    with pytest.raises(hf.HFError, match=re.escape(want)):
        _load(folder)


def test_symlinked_safetensors_file_outside_the_folder_is_refused(saved, tmp_path):
    _, single, _ = saved
    folder = _copy(single, tmp_path / "model")
    outside = tmp_path / "outside.safetensors"
    (folder / "model.safetensors").rename(outside)
    (folder / "model.safetensors").symlink_to(outside)
    want = f"{folder}: file 'model.safetensors' (matched *.safetensors) resolves to {outside}, outside the model"
    with pytest.raises(hf.HFError, match=re.escape(want)):
        _load(folder)


def test_hub_cache_snapshot_linking_into_its_blobs_loads(saved, tmp_path):
    """`huggingface-cli download` leaves snapshots/<rev>/ files as links to ../../blobs/: still allowed."""
    params, single, _ = saved
    repo = tmp_path / "models--tiny--llama"
    snapshot = _copy(single, repo / "snapshots" / "0123abc")
    (repo / "blobs").mkdir()
    (snapshot / "model.safetensors").rename(repo / "blobs" / "f00d")
    (snapshot / "model.safetensors").symlink_to(Path("../../blobs/f00d"))
    _, _, loaded = _load(snapshot)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, loaded, params)))


def test_weight_map_naming_a_missing_file_or_not_a_map(saved, tmp_path):
    _, _, sharded = saved
    folder = _copy(sharded, tmp_path / "model")
    index = json.loads((folder / INDEX).read_text())
    tensor = next(iter(index["weight_map"]))
    (folder / INDEX).write_text(json.dumps({"weight_map": index["weight_map"] | {tensor: "gone.safetensors"}}))
    with pytest.raises(
        hf.HFError, match=rf"'gone.safetensors' \({INDEX} maps tensor '{tensor}' to it\) does not exist"
    ):
        _load(folder)
    (folder / INDEX).write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    with pytest.raises(hf.HFError, match=r"weight_map is list, expected an object of tensor -> file"):
        _load(folder)


# --- damaged safetensors files -------------------------------------------------------------------


def test_truncated_file_names_the_file_and_the_tensor(saved, tmp_path):
    _, single, _ = saved
    path = _copy(single, tmp_path / "model") / "model.safetensors"
    header, data = _header(path)
    last = _last_tensor(header)
    path.write_bytes(path.read_bytes()[:-100])
    end = header[last]["data_offsets"][1]
    want = f"{path}: tensor {last!r} has data_offsets [{header[last]['data_offsets'][0]}, {end}], outside the "
    with pytest.raises(hf.HFError, match=re.escape(want) + rf"{len(data) - 100} data bytes .*truncated file"):
        _load(path.parent)


@pytest.mark.parametrize("size", [4, 20])
def test_file_cut_inside_its_header(saved, tmp_path, size):
    _, single, _ = saved
    path = _copy(single, tmp_path / "model") / "model.safetensors"
    path.write_bytes(path.read_bytes()[:size])
    want = "too short for the 8-byte header length" if size < 8 else f"bytes, but {size - 8} bytes follow it"
    with pytest.raises(hf.HFError, match=re.escape(f"{path}: ") + ".*" + re.escape(want)):
        _load(path.parent)


@pytest.mark.parametrize("length", ["past_the_end", "absurd"])
def test_header_length_larger_than_the_file(saved, tmp_path, length):
    _, single, _ = saved
    path = _copy(single, tmp_path / "model") / "model.safetensors"
    raw = path.read_bytes()
    n = len(raw) if length == "past_the_end" else 2**62
    path.write_bytes(n.to_bytes(8, "little") + raw[8:])
    want = f"{path}: header length {n} bytes, but {len(raw) - 8} bytes follow it and at most 100000000 are allowed"
    with pytest.raises(hf.HFError, match=re.escape(want)):
        _load(path.parent)


def _damage(single: Path, dst: Path, edit) -> tuple[Path, str]:
    """A copy whose safetensors header went through `edit(entry)` for its first tensor."""
    path = _copy(single, dst) / "model.safetensors"
    header, data = _header(path)
    name = next(k for k in header if k != "__metadata__")
    header[name] = edit(dict(header[name]))
    _write(path, header, data)
    return path, name


def test_offsets_out_of_range(saved, tmp_path):
    _, single, _ = saved
    size = len(_header(single / "model.safetensors")[1])
    for i, offsets in enumerate([[0, size + 1], [-4, 0], [8, 4], [0, "64"]]):
        path, name = _damage(single, tmp_path / str(i), lambda e, o=offsets: e | {"data_offsets": o})
        want = f"{path}: tensor {name!r} has data_offsets "
        with pytest.raises(hf.HFError, match=re.escape(want)):
            _load(path.parent)


def test_byte_size_that_does_not_match_shape_and_dtype(saved, tmp_path):
    """In range, but 4 bytes short of shape x itemsize; or F32 data relabelled F16 (half the bytes)."""
    _, single, _ = saved

    def shorter(entry):  # begin moved 4 bytes on
        begin, end = entry["data_offsets"]
        return entry | {"data_offsets": [begin + 4, end]}

    path, name = _damage(single, tmp_path / "short", shorter)
    info = _header(path)[0][name]
    (begin, end), shape = info["data_offsets"], tuple(info["shape"])
    want = f"{path}: tensor {name!r} has shape {shape} of F32 ({4 * np.prod(shape)} bytes), "
    with pytest.raises(
        hf.HFError, match=re.escape(want + f"but data_offsets [{begin}, {end}] hold {end - begin} bytes")
    ):
        _load(path.parent)
    path, name = _damage(single, tmp_path / "half", lambda e: e | {"dtype": "F16"})
    with pytest.raises(hf.HFError, match=re.escape(f"{path}: tensor {name!r} has shape") + r".* of F16 .* hold"):
        _load(path.parent)


def test_unknown_dtype_and_malformed_header(saved, tmp_path):
    _, single, _ = saved
    path, name = _damage(single, tmp_path / "fp8", lambda e: e | {"dtype": "F8_E4M3"})
    with pytest.raises(
        hf.HFError, match=re.escape(f"{path}: tensor {name!r} has dtype 'F8_E4M3', which jaxgen cannot")
    ):
        _load(path.parent)
    path, name = _damage(single, tmp_path / "shape", lambda e: e | {"shape": [-1, 32]})
    with pytest.raises(hf.HFError, match=re.escape(f"{path}: tensor {name!r} has shape [-1, 32]: expected a list")):
        _load(path.parent)
    path = _copy(single, tmp_path / "list") / "model.safetensors"
    _write(path, [], _header(path)[1])
    with pytest.raises(hf.HFError, match=re.escape(f"{path}: header is a JSON list, not an object of tensors")):
        _load(path.parent)
    raw = path.read_bytes()
    path.write_bytes(raw[:8] + b"{" * 2 + raw[10:])
    with pytest.raises(hf.HFError, match=re.escape(f"{path}: header is not valid JSON")):
        _load(path.parent)


# --- hostile config.json, generation_config.json, tokenizer_config.json and tokenizer.json -----------

MISSING = object()


def _edited(single: Path, dst: Path, name: str, edits: dict) -> Path:
    """A copy of the folder with the JSON file `name` edited (a MISSING value drops the key)."""
    folder = _copy(single, dst)
    data = json.loads((folder / name).read_text())
    for key, value in edits.items():
        data.pop(key, None) if value is MISSING else data.__setitem__(key, value)
    (folder / name).write_text(json.dumps(data))
    return folder


NO_ROPE = {"rope_parameters": MISSING}
GEMMA2 = {"model_type": "gemma2", "hidden_act": "gelu_pytorch_tanh"}
CONFIG_CASES = [  # (edits to config.json, what the one-line error says after "config.json: ")
    ({"eos_token_id": 10**12}, "eos_token_id=1000000000000 is not allowed: a token id in [0, 257)"),
    ({"eos_token_id": -1}, "eos_token_id=-1 is not allowed: a token id in [0, 257)"),
    ({"eos_token_id": [[1, 2]]}, "eos_token_id=[[1, 2]] is not allowed"),
    ({"eos_token_id": True}, "eos_token_id=True is not allowed"),
    ({"eos_token_id": []}, "eos_token_id=[] is not allowed"),
    ({"rms_norm_eps": "abc"}, "rms_norm_eps='abc' is not allowed: a finite number > 0"),
    ({"rms_norm_eps": -1}, "rms_norm_eps=-1 is not allowed: a finite number > 0"),
    ({"rms_norm_eps": 0}, "rms_norm_eps=0 is not allowed: a finite number > 0"),
    ({"rope_theta": 0}, "rope_theta=0 is not allowed: a finite number > 0"),
    ({"rope_parameters": {"rope_theta": -10000}}, "rope_parameters.rope_theta=-10000 is not allowed"),
    ({"vocab_size": 10**12}, "vocab_size=1000000000000 is not allowed: an integer in [1, 2147483647]"),
    ({"vocab_size": True}, "vocab_size=True is not allowed: an integer"),
    ({"vocab_size": "257"}, "vocab_size='257' is not allowed: an integer"),
    ({"vocab_size": 257.0}, "vocab_size=257.0 is not allowed: an integer"),
    ({"num_hidden_layers": 10**8}, "num_hidden_layers=100000000"),  # the weights outgrow any memory
    ({"max_position_embeddings": 10**12}, "max_position_embeddings=1000000000000 is not allowed: an integer in"),
    ({"num_attention_heads": 0, "head_dim": None}, "num_attention_heads=0 is not allowed: an integer in [1,"),
    ({"num_key_value_heads": "2"}, "num_key_value_heads='2' is not allowed: an integer"),
    ({"num_key_value_heads": 3}, "num_kv_heads=3 is not allowed: a divisor of num_heads=4 (1 = multi-query, "),
    ({"hidden_size": MISSING}, "hidden_size is missing or null; it is required: an integer"),
    ({"intermediate_size": None}, "intermediate_size is missing or null"),
    ({"rope_scaling": [1, 2]} | NO_ROPE, "rope_scaling=[1, 2] is not allowed: an object"),
    ({"rope_scaling": "llama3"} | NO_ROPE, "rope_scaling='llama3' is not allowed: an object"),
    ({"rope_scaling": {"rope_type": "linear"}} | NO_ROPE, "rope_scaling.factor is missing or null"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}} | NO_ROPE, "rope_scaling.factor=0 is not allowed"),
    ({"rope_scaling": {"type": "llama3", "factor": 8, "low_freq_factor": "x"}} | NO_ROPE, "low_freq_factor='x'"),
    ({"model_type": "mistral", "sliding_window": "x"}, "sliding_window='x' is not allowed: an integer"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window=0 is not allowed: an integer"),
    (GEMMA2 | {"attn_logit_softcapping": "x"}, "attn_logit_softcapping='x' is not allowed: a finite number > 0"),
    (GEMMA2 | {"final_logit_softcapping": -30}, "final_logit_softcapping=-30 is not allowed"),
    (GEMMA2 | {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar=0 is not allowed"),
    ({"model_type": "mixtral"}, "num_local_experts is missing or null; it is required"),
    ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 8}, "num_experts_per_tok)"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings='yes' is not allowed: true or false"),
    ({"vocab_size": 100}, "vocab_size=100 is smaller than the tokenizer's 257 tokens: ids 100..256 have no embedding"),
]  # fmt: skip


@pytest.mark.parametrize("edits, message", CONFIG_CASES, ids=lambda x: str(x)[:60] if isinstance(x, str) else None)
def test_hostile_config_json_is_refused_naming_file_field_and_value(saved, tmp_path, edits, message):
    """Each bad entry: one line naming config.json, the key and the value, before any weight is read
    (before: tracebacks naming nothing, MemoryError, or a model that loaded and failed every request)."""
    _, single, _ = saved
    folder = _edited(single, tmp_path / "model", "config.json", edits)
    with pytest.raises(ValueError, match=re.escape(f"{folder}/config.json: ") + ".*" + re.escape(message)) as e:
        _load(folder)
    assert "\n" not in str(e.value)


def test_legal_value_that_contradicts_the_weights_names_the_fields_that_set_the_shape(saved, tmp_path):
    """num_key_value_heads null means num_attention_heads (4), but the weights have 2 kv heads: refused
    before any parameter is allocated, naming the fields that size the tensor."""
    _, single, _ = saved
    folder = _edited(single, tmp_path / "model", "config.json", {"num_key_value_heads": None})
    want = (
        f"{folder}: tensor 'model.layers.0.self_attn.k_proj.weight' has shape (16, 32), but config.json implies "
        "(32, 32) (jaxgen layers/w_k_dkh; num_hidden_layers=2, hidden_size=32, num_key_value_heads=4, head_dim=8)"
    )
    no_allocation = mock.patch.object(np, "empty", side_effect=AssertionError("allocated"))
    with no_allocation, pytest.raises(hf.HFError, match=re.escape(want)):
        _load(folder)


def test_config_json_that_is_not_an_object(saved, tmp_path):
    _, single, _ = saved
    folder = _copy(single, tmp_path / "model")
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(hf.HFError, match=re.escape(f"{folder}/config.json: holds a JSON list, expected an object")):
        _load(folder)
    (folder / "config.json").write_bytes(b"{\xff}")
    with pytest.raises(hf.HFError, match=re.escape(f"{folder}/config.json: not a readable JSON file")):
        _load(folder)


@pytest.mark.parametrize("value", [10**12, -1, [[1, 2]], "256"])
def test_hostile_generation_config_eos_is_refused(saved, tmp_path, value):
    _, single, _ = saved
    folder = _edited(single, tmp_path / "model", "generation_config.json", {"eos_token_id": value})
    want = f"{folder}/generation_config.json: eos_token_id={value!r} is not allowed: a token id in [0, 257)"
    with pytest.raises(ValueError, match=re.escape(want)):
        _load(folder)


def _tokenizer_config_only(single: Path, dst: Path, eos_token) -> Path:
    """A folder whose end-of-sequence token comes from tokenizer_config.json's eos_token alone."""
    folder = _edited(single, dst, "config.json", {"eos_token_id": MISSING})
    (folder / "generation_config.json").unlink()
    data = json.loads((folder / "tokenizer_config.json").read_text()) | {"eos_token": eos_token}
    (folder / "tokenizer_config.json").write_text(json.dumps(data))
    return folder


def test_eos_token_as_an_added_token_dict_is_read(saved, tmp_path):
    """transformers writes eos_token as an AddedToken dict ({"content": ..., "lstrip": ...}) too."""
    _, single, _ = saved
    folder = _tokenizer_config_only(single, tmp_path / "model", {"content": "<|endoftext|>", "special": True})
    assert Tokenizer.from_folder(folder).eos_ids == (256,)


@pytest.mark.parametrize("eos_token", [{"special": True}, {"content": 5}, 5, ["<|endoftext|>"], "<|nope|>"])
def test_bad_eos_token_is_refused(saved, tmp_path, eos_token):
    _, single, _ = saved
    folder = _tokenizer_config_only(single, tmp_path / "model", eos_token)
    want = f"{folder}/tokenizer_config.json: eos_token={eos_token!r} is not allowed: a token of tokenizer.json"
    with pytest.raises(ValueError, match=re.escape(want)):
        Tokenizer.from_folder(folder)


@pytest.mark.parametrize("text", ["{nope", "{}", "[1]", "\xff"])
def test_broken_tokenizer_json_is_refused_naming_the_file(saved, tmp_path, text):
    _, single, _ = saved
    folder = _copy(single, tmp_path / "model")
    (folder / "tokenizer.json").write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"{folder}/tokenizer.json: not a tokenizer")):
        _load(folder)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json"])
def test_side_json_that_is_not_an_object_is_refused(saved, tmp_path, name):
    _, single, _ = saved
    folder = _copy(single, tmp_path / "model")
    (folder / name).write_text('"eos"')
    with pytest.raises(ValueError, match=re.escape(f"{folder / name} holds a JSON str, expected an object")):
        _load(folder)


def test_a_huge_max_position_embeddings_serves_without_allocating_for_it(saved, tmp_path):
    """Real configs say 10**6 and more; the engine's page tables and n-gram histories were (slots,
    max_seq_len) arrays, a MemoryError at start-up for 10**12 (now refused: positions are int32) and
    gigabytes for 10**9. They are sized by the page pool now, which no sequence can outgrow."""
    _, single, _ = saved
    folder = _edited(single, tmp_path / "model", "config.json", {"max_position_embeddings": 10**7})
    cfg, tokenizer, params = _load(folder)
    serve = ServeConfig(slots=2, page_size=8, num_pages=16, chunk_steps=4, prefill_chunk=16)
    engine = Engine(params, cfg, tokenizer, serve)
    assert cfg.max_seq_len == 10**7 and engine.max_pages <= 16 and engine.spec.history.shape[1] < 16 * 8 + 16
    (done,) = engine.generate(["hello"], SamplingConfig(max_new_tokens=3))
    assert 1 <= len(done.tokens) <= 3 and np.isfinite(done.logprobs).all()


# --- fuzz: hostile values anywhere in the folder's JSON files ---------------------------------------

HOSTILE = st.sampled_from(
    [0, -1, 10**12, 2**40, 1.5, 1e-300, "x", "8", True, False, None, [1, 2], [[1]], {"a": 1}, MISSING]
)
CONFIG_KEYS = [
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
    "tie_word_embeddings", "eos_token_id", "attention_bias", "mlp_bias", "hidden_act", "sliding_window",
]  # fmt: skip
ROPE_KEYS = ["rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
EOS_TOKENS = st.sampled_from(["<|endoftext|>", {"content": "<|endoftext|>"}, {"x": 1}, 5, None, "<|nope|>", ""])
TEMPLATES = st.sampled_from([None, "{{ messages }}", 5, [{"name": "default", "template": "x"}], {"a": 1}])
TOKENIZER_JSON = st.sampled_from([None] * 6 + ["{nope", "{}", "[]"])  # None: the folder's own
_forward = jax.jit(model.forward, static_argnames="cfg")


@st.composite
def _hostile_folders(draw):
    """Edits to config.json, generation_config.json, tokenizer_config.json and tokenizer.json."""
    config = draw(st.dictionaries(st.sampled_from(CONFIG_KEYS), HOSTILE, max_size=2))
    if draw(st.booleans()):  # hostile values inside the RoPE settings
        kind = draw(st.sampled_from(["default", "linear", "llama3", "yarn", 5, None]))
        rope = {"rope_type": kind} | draw(st.dictionaries(st.sampled_from(ROPE_KEYS), HOSTILE, max_size=2))
        config["rope_parameters"] = {k: v for k, v in rope.items() if v is not MISSING}
    generation = draw(st.dictionaries(st.just("eos_token_id"), HOSTILE, max_size=1))
    tokenizer = {"eos_token": draw(EOS_TOKENS), "chat_template": draw(TEMPLATES)}
    return config, generation, tokenizer, draw(TOKENIZER_JSON)


@settings(derandomize=True, max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(edits=_hostile_folders())
def test_fuzz_hostile_folder_is_refused_naming_the_field_or_runs(saved, tmp_path_factory, edits):
    """Either one line naming a field (or file) that was edited, raised before any weight is read, or a
    model whose forward pass on a few tokens gives finite logits, with end-of-sequence ids it can emit."""
    config, generation, tokenizer, tokenizer_json = edits
    note(f"edits: {edits}")
    _, single, _ = saved
    folder = _copy(single, tmp_path_factory.mktemp("fuzz") / "model")
    for name, changes in [("config.json", config), ("generation_config.json", generation)]:
        data = json.loads((folder / name).read_text())
        for key, value in changes.items():
            data.pop(key, None) if value is MISSING else data.__setitem__(key, value)
        (folder / name).write_text(json.dumps(data))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "x"} | tokenizer))
    if tokenizer_json is not None:
        (folder / "tokenizer.json").write_text(tokenizer_json)
    read = []  # tensors read: after their parameter was allocated
    real_get = hf.safetensors._Checkpoint.get
    with mock.patch.object(hf.safetensors._Checkpoint, "get", lambda *a: read.append(1) or real_get(*a)):
        try:
            cfg, tok, params = _load(folder)
        except ValueError as e:
            named = [*config, *generation, *tokenizer, "tokenizer.json"]
            message = str(e)
            assert "\n" not in message and any(name in message for name in named), message
            assert not read, message
            event(f"refused: {message.split(': ')[1][:30]}")
            return
    event("loaded and ran")
    assert all(0 <= i < cfg.vocab_size for i in tok.eos_ids) and tok.vocab_size <= cfg.vocab_size
    tokens = np.array([tok.encode("hi there")], np.int32)
    logits, _ = _forward(params, tokens, np.arange(tokens.shape[1], dtype=np.int32)[None], cfg=cfg)
    assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("eos_ids", [257, -1, [256, 10**12], [True]])
def test_a_tokenizer_built_in_code_refuses_end_ids_outside_its_vocabulary(eos_ids):
    """Before: accepted, then every completion failed (OverflowError) or never ended."""
    with pytest.raises(ValueError, match=re.escape("is not allowed: token ids in [0, 257) of this tokenizer")):
        Tokenizer(Tokenizer.byte_level().tok, eos_ids)


@pytest.mark.parametrize("memory", ["small", "huge"])
def test_a_million_layers_is_refused_naming_num_hidden_layers(saved, tmp_path, memory):
    """Refused by the memory check where the weights (35 GiB) outgrow the memory, else by the shape check
    (the checkpoint has 2 layers): either way before any parameter is allocated (before: MemoryError)."""
    _, single, _ = saved
    folder = _edited(single, tmp_path / "model", "config.json", {"num_hidden_layers": 10**6})
    no_allocation = mock.patch.object(np, "empty", side_effect=AssertionError("allocated"))
    have = mock.patch.object(hf.load, "_memory_bytes", return_value=2**30 if memory == "small" else 2**50)
    want = "the weights would take" if memory == "small" else "is missing from the llama checkpoint"
    with no_allocation, have, pytest.raises(hf.HFError, match=want) as e:
        _load(folder)
    assert "num_hidden_layers=1000000" in str(e.value)
