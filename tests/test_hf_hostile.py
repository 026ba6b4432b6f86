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

import jax
import numpy as np
import pytest

from jaxgen import hf, model
from jaxgen.config import ModelConfig
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
