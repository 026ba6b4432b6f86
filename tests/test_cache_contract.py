"""The cache contract (`jaxgen.model.cache.Cache`): both caches implement every member, nothing outside the
cache modules asks which cache it holds, and the speculative bookkeeping the caches now own."""

import ast
import inspect
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.config import ModelConfig
from jaxgen.model.cache import Cache
from jaxgen.model.kvcache import KVCache
from jaxgen.model.paged import PagedCache
from tests.conftest import ROOT

CACHES = [KVCache, PagedCache]  # a new cache type is listed here
CACHE_MODULES = {"cache.py", "kvcache.py", "paged.py"}
CFG = ModelConfig(vocab_size=64, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64, max_seq_len=64)


def _members() -> dict[str, object]:
    return {name: v for name, v in vars(Cache).items() if not name.startswith("_")}


def test_the_contract_names_what_the_model_and_the_decode_core_ask():
    asked = {"with_positions", "arrays", "write", "num_blocks", "blocks_to_visit", "key_block", "filled", "advance"}
    asked |= {"is_full", "room", "forget_rejected", "decode_kernel", "decode_inputs", "constrain"}
    asked |= {"context_split", "context_parts", "as_part"}  # context parallelism
    assert set(_members()) == asked


@pytest.mark.parametrize("cls", CACHES, ids=lambda c: c.__name__)
def test_each_cache_has_every_member_with_its_signature(cls):
    """Statically, on the class: a property where the contract has one, a method with the same parameters."""
    for name, member in _members().items():
        assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
        mine = inspect.getattr_static(cls, name)
        if isinstance(member, property):
            assert isinstance(mine, property), f"{cls.__name__}.{name} should be a property"
        else:
            want = list(inspect.signature(member).parameters)
            assert list(inspect.signature(mine).parameters) == want, f"{cls.__name__}.{name}"


def test_both_caches_are_caches_at_run_time():
    assert isinstance(KVCache.init(CFG, 2, 16), Cache)
    assert isinstance(PagedCache.init(CFG, num_pages=4, page_size=16, slots=2, max_pages=2), Cache)


def test_nothing_outside_the_cache_modules_asks_which_cache_it_holds():
    """No isinstance / issubclass / type() test naming a cache type anywhere in jaxgen but the cache modules."""
    found = []
    for path in sorted((Path(ROOT) / "jaxgen").rglob("*.py")):
        if path.parent.name == "model" and path.name in CACHE_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                continue
            if node.func.id in ("isinstance", "issubclass") and "Cache" in ast.unparse(node.args[1]):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
            if node.func.id == "type" and "Cache" in ast.unparse(node.args[0]):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)


def test_contiguous_cache_forgets_rejected_slots_and_rewinds():
    """A 4-token call from slot 3 on 2 rows: row 0 keeps 2 tokens, row 1 keeps 1; the slots past them are
    emptied (-1), `end` moves past the longest row's kept tokens, and the room left follows `end`."""
    before = KVCache.init(CFG, 2, 16).replace(end=jnp.int32(3))
    positions = jnp.asarray([[3, 4, 5, 6], [7, 8, 9, 10]], jnp.int32)
    after = before.with_positions(positions).replace(end=jnp.int32(7))
    keep = jnp.asarray([[True, True, False, False], [True, False, False, False]])
    given = after.forget_rejected(before, keep, jnp.where(keep, positions, -1))
    written = after.forget_rejected(before, keep)  # the positions the call wrote
    for cache in (given, written):
        np.testing.assert_array_equal(cache.pos[:, 3:7], [[3, 4, -1, -1], [7, -1, -1, -1]])
        assert int(cache.end) == 5
        np.testing.assert_array_equal(cache.room(positions[:, 0]), [11, 11])


def test_paged_cache_keeps_everything_and_counts_room_per_slot():
    cache = PagedCache.init(CFG, num_pages=4, page_size=16, slots=2, max_pages=2)
    cache = cache.replace(capacity=jnp.asarray([32, 16], jnp.int32))
    keep = jnp.zeros((2, 3), bool)
    assert cache.forget_rejected(cache, keep) is cache
    np.testing.assert_array_equal(cache.room(jnp.asarray([5, 15], jnp.int32)), [27, 1])
    assert int(cache.filled(jnp.asarray([[5], [15]], jnp.int32))) == 16
    assert cache.decode_kernel.name == "paged" and KVCache.init(CFG, 1, 16).decode_kernel is None
