"""The native calls the vLLM plugin's block pool runs on (issue 12).

``Space.alloc_items(n, items)`` answers ``[items[id] ...]`` for the ids it
allocates, ``Space.free_items(items, attr)`` frees the ids read as each
item's ``attr``, ``Space.free`` also takes a list of ints, and ``available()``
answers with the GIL held unless the space's mutex is taken. Each is
all-or-nothing: bad input is a typed error and changes nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvpool import Geometry, InvalidBlocks, KVSpace
from kvpool import _core

from .conftest import KiB

G = Geometry(1, 1, 4 * KiB, 256, page_bytes=64 * KiB)  # 16 blocks a page


@dataclass
class Block:
    block_id: object


@pytest.fixture
def space() -> Iterator[KVSpace]:
    sp = KVSpace(G, null_block=True, reserve=(0, 16))
    yield sp
    sp.close()


def used(sp: KVSpace) -> int:
    return sp.stats().used_blocks


def test_alloc_items_answers_the_items_of_the_ids_it_allocated(space: KVSpace) -> None:
    blocks = [Block(i) for i in range(G.num_blocks)]
    got = space._space.alloc_items(20, blocks)
    assert type(got) is list and len(got) == 20
    assert all(any(b is x for x in blocks) for b in got)  # the very objects, not copies
    ids = [b.block_id for b in got]
    assert len(set(ids)) == 20 and 0 not in ids  # distinct, never the null block
    assert used(space) == 20
    # The ids really are held: freeing them as ints works once, then is a double free.
    assert space._space.free_items(got, "block_id") == space.available()
    assert used(space) == 0
    with pytest.raises(InvalidBlocks):
        space.free(ids)


def test_alloc_items_refusals_change_nothing(space: KVSpace) -> None:
    blocks = [Block(i) for i in range(G.num_blocks)]
    space._space.alloc_items(5, blocks)
    with pytest.raises(TypeError):
        space._space.alloc_items(1, tuple(blocks))
    with pytest.raises(ValueError, match="every block"):
        space._space.alloc_items(1, blocks[:-1])
    f = space._space.alloc_items(G.capacity + 1, blocks)
    assert isinstance(f, _core.native.Failure) and f.code == _core.CODE_UNSATISFIABLE
    f = space._space.alloc_items(-1, blocks)
    assert isinstance(f, _core.native.Failure) and f.code == _core.CODE_INVALID
    assert space._space.alloc_items(0, blocks) == []
    assert used(space) == 5


@pytest.mark.parametrize("bad", [[True], [2**70], ["3"], [3.0], [1, None]], ids=["bool", "huge", "str", "float", "none"])
def test_free_of_a_list_with_a_non_int_is_a_type_error_and_frees_nothing(space: KVSpace, bad: list[object]) -> None:
    ids = space.alloc(3).tolist()
    with pytest.raises(TypeError):
        space._space.free(ids + bad)
    assert used(space) == 3
    # KVSpace.free sends such a list through the checked path: a typed error.
    with pytest.raises((InvalidBlocks, ValueError, TypeError)):
        space.free(ids + bad)
    assert used(space) == 3
    space.free(ids)  # a list of ints: the native call
    assert used(space) == 0


def test_free_items_validates_every_item_before_freeing_any(space: KVSpace) -> None:
    blocks = [Block(i) for i in range(G.num_blocks)]
    got = space._space.alloc_items(4, blocks)
    with pytest.raises(AttributeError):
        space._space.free_items(got + [object()], "block_id")
    with pytest.raises(TypeError):
        space._space.free_items(got + [Block("7")], "block_id")
    with pytest.raises(TypeError):
        space._space.free_items(tuple(got), "block_id")
    f = space._space.free_items(got + [Block(0)], "block_id")  # the null block: refused, nothing freed
    assert isinstance(f, _core.native.Failure) and list(f.bad_ids) == [0]
    f = space._space.free_items(got + got[:1], "block_id")  # a repeat
    assert isinstance(f, _core.native.Failure) and list(f.bad_ids) == [got[0].block_id]
    assert used(space) == 4
    assert isinstance(space._space.free_items(got, "block_id"), int)
    assert used(space) == 0


def test_available_alloc_and_free_from_several_threads_agree_with_the_books(space: KVSpace) -> None:
    # available() and alloc/free from several threads at once: every answer
    # consistent with the books (the GIL-held fast path and the blocking one
    # must agree), and no block lost.
    blocks = [Block(i) for i in range(G.num_blocks)]
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            for _ in range(2000):
                got = space._space.alloc_items(7, blocks)
                assert type(got) is list
                assert 0 <= space._space.available() <= G.capacity - 1
                assert isinstance(space._space.free_items(got, "block_id"), int)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert used(space) == 0 and space.available() == G.capacity - 1
