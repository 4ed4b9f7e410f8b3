"""ArenaView, Row grants as zero-copy numpy arrays, and WorkerReporter failure paths."""

import numpy as np
import pytest

import kvtier


@pytest.fixture
def shared(tmp_path):
    arena = tmp_path / "arena"
    m = kvtier.TieringManager.from_toml(
        f'[primary]\ntype = "cpu"\ncapacity = 4\nshared_memory = "{arena}"\n', 256
    )
    yield m
    m.shutdown()


def test_view_sees_the_owners_rows_both_ways(shared):
    view = kvtier.ArenaView(shared.arena_path, shared.num_chunks, shared.chunk_bytes)
    assert (view.num_chunks, view.chunk_bytes) == (4, 256)
    assert view.fingerprint == shared.arena_fingerprint
    assert view.owner_alive()
    view.write_row(2, b"\x01\x02\x03")
    assert shared.read_row(2)[:3] == b"\x01\x02\x03"
    shared.write_row(1, bytes(range(256)))
    assert view.read_row(1) == bytes(range(256))
    with pytest.raises(kvtier.KvtierError):
        view.write_row(9, b"x")
    with pytest.raises(kvtier.KvtierError, match="do not fit"):
        view.write_row(0, b"x" * 257)


def test_a_view_of_another_geometry_is_refused(shared):
    with pytest.raises(kvtier.KvtierError):
        kvtier.ArenaView(shared.arena_path, 5, 256)
    with pytest.raises(kvtier.KvtierError):
        kvtier.ArenaView(str(shared.arena_path) + ".missing")


def test_row_arrays_are_zero_copy_and_writes_land_in_the_arena(shared):
    view = kvtier.ArenaView(shared.arena_path)
    with view.row(3, write=True) as row:
        assert row.writable and row.chunk_id == 3
        a = row.array()
        assert a.dtype == np.uint8 and a.shape == (256,)
        a[:] = 9
        a[0] = 1
        # The arena itself changed (no copy): another reader path sees it after release.
        assert row.tobytes()[:2] == b"\x01\x09"
        del a
    assert shared.read_row(3)[:3] == b"\x01\x09\x09"


def test_a_row_is_not_released_while_an_array_uses_it(shared):
    view = kvtier.ArenaView(shared.arena_path)
    row = view.row(0, write=True)
    a = row.array()
    part = a[10:20]
    del a
    with pytest.raises(kvtier.KvtierError, match="still used by 1 array"):
        row.release()
    # The grant is still held: a second writer is refused.
    with pytest.raises(kvtier.KvtierError):
        view.row(0, write=True)
    part[:] = 5
    del part
    row.release()
    row.release()  # idempotent
    with pytest.raises(kvtier.KvtierError, match="released"):
        row.array()
    assert shared.read_row(0)[10:20] == b"\x05" * 10


def test_a_row_left_by_an_exception_keeps_the_exception_and_hands_the_grant_to_its_arrays(shared):
    view = kvtier.ArenaView(shared.arena_path)
    with pytest.raises(ZeroDivisionError):
        with view.row(2, write=True) as row:
            a = row.array()
            a[:] = 3
            1 / 0
    # The array outlived the block (as a traceback's frame would keep it): it holds the grant.
    with pytest.raises(kvtier.KvtierError):
        view.row(2, write=True)
    del a
    with view.row(2, write=True):
        pass
    assert shared.read_row(2)[:4] == b"\x03" * 4


def test_read_grants_are_shared_and_read_only(shared):
    view = kvtier.ArenaView(shared.arena_path)
    shared.write_row(1, b"\x07" * 256)
    with view.row(1) as r1, view.row(1) as r2:
        a = r1.array()
        assert not r1.writable and a[0] == 7 and r2.tobytes()[0] == 7
        with pytest.raises(ValueError):
            a[0] = 1
        with pytest.raises(kvtier.KvtierError):
            view.row(1, write=True)
        del a
    with view.row(1, write=True):
        pass


def test_reporter_failure_paths(shared, tmp_path):
    with pytest.raises(kvtier.KvtierError, match="cannot connect"):
        kvtier.WorkerReporter(tmp_path / "no-socket", 0, shared.arena_fingerprint)
    sock = tmp_path / "done.sock"
    shared.open_completion_channel(sock)
    with pytest.raises(kvtier.KvtierError, match="already open"):
        shared.open_completion_channel(tmp_path / "other.sock")
    r = kvtier.WorkerReporter(sock, 0, shared.arena_fingerprint)
    assert r.rank == 0
    with pytest.raises(TypeError):
        r.report([1, 2])
    r.close()
    r.close()
    with pytest.raises(kvtier.KvtierError, match="closed"):
        r.report([])
