"""Every manager method through the binding, against vLLM 0.33.0's documented semantics of the
CPU primary tier (ref counts, eviction order, events, failed stores, reset) and the step rules."""

import threading
import time

import pytest

import kvtier
from kvtier import LookupResult
from conftest import cpu_manager, key, keys, nums, store


def test_lookup_moves_from_miss_to_pending_to_hit(manager):
    a = kvtier.ReqContext("a")
    with manager.step() as s:
        assert s.on_new_request(a) is kvtier.OffloadPolicy.CHUNK_LEVEL
        assert s.lookup(key(1), a) is LookupResult.MISS
        out = s.prepare_store(keys(1, 2), a)
        assert nums(out.keys_to_store) == [1, 2]
        assert out.chunk_ids == [0, 1]
        assert out.evicted == [] and out.evicted_keys == []
        assert s.lookup(key(1), a) is LookupResult.HIT_PENDING
        s.complete_store(keys(1, 2), a)
        assert s.lookup(key(1), a) is LookupResult.HIT
        assert s.lookup(key(1, group=1), a) is LookupResult.MISS
        s.on_schedule_end(kvtier.ScheduleEndContext(["a"]))


def test_prepare_store_skips_resident_keys_and_reuses_freed_rows_lifo():
    m = cpu_manager(2)
    a = kvtier.ReqContext("a")
    with m.step() as s:
        s.on_new_request(a)
        store(s, a, [1, 2])
        out = s.prepare_store(keys(1, 2), a)
        assert out.keys_to_store == [] and out.chunk_ids == []
        # Two new keys evict 1 then 2 (LRU); freed rows are reused last-in first-out.
        out = s.prepare_store(keys(3, 4), a)
        assert nums(out.evicted) == [1, 2]
        assert out.chunk_ids == [1, 0]
        s.complete_store(out.keys_to_store, a)
    m.shutdown()


def test_lru_touch_takes_keys_in_reverse_so_the_first_is_most_recent():
    m = cpu_manager(4)
    a = kvtier.ReqContext("a")
    with m.step() as s:
        s.on_new_request(a)
        for n in (1, 2, 3, 4):
            store(s, a, [n])
        s.touch(keys(1, 2), a)
        order = []
        for n in (5, 6, 7, 8):
            out = store(s, a, [n])
            order += nums(out.evicted)
        assert order == [3, 4, 2, 1]
    m.shutdown()


def test_arc_evicts_from_t1_before_a_reused_key_lru_by_recency():
    evicted = {}
    for policy in ("lru", "arc"):
        m = cpu_manager(3, policy)
        a = kvtier.ReqContext("a")
        with m.step() as s:
            s.on_new_request(a)
            store(s, a, [1])
            s.touch(keys(1), a)
            store(s, a, [2])
            store(s, a, [3])
            evicted[policy] = nums(store(s, a, [4]).evicted)
        m.shutdown()
    assert evicted == {"lru": [1], "arc": [2]}


def test_finished_request_commits_its_keys_head_most_recent():
    m = cpu_manager(4)
    a, b = kvtier.ReqContext("a"), kvtier.ReqContext("b")
    with m.step() as s:
        s.on_new_request(a)
        s.on_new_request(b)
        store(s, a, [1, 2])
        store(s, b, [3, 4])
        s.on_request_finished(a)
        c = kvtier.ReqContext("c")
        s.on_new_request(c)
        order = []
        for n in (5, 6, 7, 8):
            order += nums(store(s, c, [n]).evicted)
        assert order == [3, 4, 2, 1]
    m.shutdown()


def test_loads_pin_per_call_and_pinned_keys_are_never_evicted():
    m = cpu_manager(2)
    a = kvtier.ReqContext("a")
    with m.step() as s:
        s.on_new_request(a)
        store(s, a, [1, 2])
        assert s.prepare_load(keys(1, 2), a) == [0, 1]
        assert s.prepare_load(keys(1), a) == [0]
        # Both rows pinned: no room, nothing changes.
        assert s.prepare_store(keys(3), a) is None
        s.complete_load(keys(1, 2), a)
        assert s.prepare_store(keys(3), a).evicted == keys(2)
        s.complete_load(keys(1), a)
        with pytest.raises(kvtier.KvtierError, match="not pinned"):
            s.complete_load(keys(1), a)
    m.shutdown()


def test_contract_violations_raise_and_change_nothing():
    m = cpu_manager(2)
    a = kvtier.ReqContext("a")
    with m.step() as s:
        s.on_new_request(a)
        store(s, a, [1])
        s.prepare_store(keys(2), a)  # in flight
        with pytest.raises(kvtier.KvtierError, match="not in the tier"):
            s.prepare_load(keys(1, 9), a)
        with pytest.raises(kvtier.KvtierError, match="not ready"):
            s.prepare_load(keys(1, 2), a)
        # Key 1 was not pinned by the failed calls: completing a load of it is refused.
        with pytest.raises(kvtier.KvtierError, match="not pinned"):
            s.complete_load(keys(1), a)
        with pytest.raises(kvtier.KvtierError, match="unknown request"):
            s.prepare_store(keys(5), kvtier.ReqContext("never-announced"))
        with pytest.raises(kvtier.KvtierError, match="unknown request"):
            s.complete_store(keys(5), kvtier.ReqContext("never-announced"))
    m.shutdown()


def test_events_report_evictions_at_prepare_time_and_stores_in_call_order():
    m = cpu_manager(2)
    a = kvtier.ReqContext("a")
    with m.step() as s:
        s.on_new_request(a)
        out = s.prepare_store(keys(1, 2), a)
        assert s.take_events() == []
        s.complete_store(keys(2), a)
        s.complete_store(keys(1), a)
        ev = s.take_events()
        assert [(e.removed, nums(e.keys)) for e in ev] == [(False, [2]), (False, [1])]
        assert ev[0].ownership is None and ev[0].medium == "CPU" and not ev[0].metadata_only
        assert not ev[0].removal_expected, "the primary promises no removal report (as vLLM's CPU manager)"
        out = s.prepare_store(keys(3), a)
        ev = s.take_events()
        assert [(e.removed, nums(e.keys)) for e in ev] == [(True, nums(out.evicted))]
        s.complete_store(keys(3), a)
    # The handle's take_events drains what the step left.
    assert [nums(e.keys) for e in m.take_events()] == [[3]]
    assert m.take_events() == []
    m.shutdown()


def test_failed_store_frees_the_rows_and_emits_a_metadata_only_removal():
    m = cpu_manager(2)
    a = kvtier.ReqContext("a")
    with m.step() as s:
        s.on_new_request(a)
        s.prepare_store(keys(1, 2), a)
        s.complete_store(keys(1, 2), a, success=False)
        assert s.lookup(key(1), a) is LookupResult.MISS
        ev = s.take_events()
        assert [(e.removed, e.metadata_only, nums(e.keys)) for e in ev] == [(True, True, [1, 2])]
        # The rows are free again: two new keys fit without eviction.
        assert store(s, a, [3, 4]).evicted == []
    m.shutdown()


def test_failed_store_removal_drops_keys_resident_again():
    m = cpu_manager(4)
    a = kvtier.ReqContext("a")
    with m.step() as s:
        s.on_new_request(a)
        s.prepare_store(keys(1), a)
        s.complete_store(keys(1), a, success=False)
        store(s, a, [1])
        ev = s.take_events()
        assert [(e.removed, nums(e.keys)) for e in ev] == [(False, [1])]
    m.shutdown()


def test_reset_cache_forgets_every_chunk_and_the_manager_keeps_working(manager):
    a = kvtier.ReqContext("a")
    with manager.step() as s:
        s.on_new_request(a)
        store(s, a, [1, 2, 3])
        s.on_request_finished(a)
        s.on_schedule_end()
    manager.reset_cache()
    b = kvtier.ReqContext("b")
    with manager.step() as s:
        assert s.lookup(key(1), b) is LookupResult.MISS
        s.on_new_request(b)
        out = store(s, b, [5, 6, 7, 8])
        assert out.evicted == []
        assert s.lookup(key(8), b) is LookupResult.HIT
    assert manager.stats()["primary"]["resident_chunks"] == 4


def test_stats_and_pending_work(manager):
    a = kvtier.ReqContext("a")
    with manager.step() as s:
        s.on_new_request(a)
        store(s, a, [1])
        s.lookup(key(1), a)
        s.lookup(key(2), a)
        assert s.has_pending_work() is False
        st = s.stats()
    assert st["primary"]["hits"] == 1 and st["primary"]["misses"] == 1
    assert st["primary"]["capacity_chunks"] == 4 and st["secondaries"] == []
    assert manager.has_pending_work() is False
    assert manager.get_stats()["jobs_in_flight"] == 0


def test_load_source_on_a_cpu_only_chain_is_the_primary(manager):
    a = kvtier.ReqContext("a")
    with manager.step() as s:
        s.on_new_request(a)
        store(s, a, [1])
        assert s.lookup(key(1), a) is LookupResult.HIT
        src = s.load_source(key(1), a)
        with pytest.raises(ValueError, match="36 bytes"):
            s.load_source(b"short", a)
    assert (src.tier, src.tier_type, src.secondary) == ("cpu", "cpu", None)
    assert (src.medium, src.locality) == ("CPU", "LOCAL")
    assert 'tier="cpu"' in repr(src)


def test_a_second_step_on_one_thread_raises_instead_of_deadlocking(manager):
    with manager.step() as s:
        with pytest.raises(kvtier.StepError, match="holds a step"):
            manager.step()
        for call in (manager.has_pending_work, manager.take_events, manager.stats,
                     manager.reset_cache, manager.shutdown):
            with pytest.raises(kvtier.StepError):
                call()
        assert s.has_pending_work() is False
    assert manager.has_pending_work() is False


def test_a_step_left_by_an_exception_releases_the_lock(manager):
    a = kvtier.ReqContext("a")
    with pytest.raises(ZeroDivisionError):
        with manager.step() as s:
            s.on_new_request(a)
            1 / 0
    assert s.released
    with pytest.raises(kvtier.StepError, match="released"):
        s.lookup(key(1), a)
    # Another thread can take the lock, so it really was released.
    got = []
    t = threading.Thread(target=lambda: got.append(manager.step().release()))
    t.start()
    t.join(timeout=30)
    assert not t.is_alive() and got == [None]


def test_another_thread_waits_for_the_step_with_the_gil_released(manager):
    a = kvtier.ReqContext("a")
    order = []
    s = manager.step()
    acquired = threading.Event()

    def other():
        with manager.step() as s2:
            order.append("other acquired")
            acquired.set()
            assert s2.lookup(key(1), a) is LookupResult.HIT

    t = threading.Thread(target=other)
    t.start()
    # This thread keeps running Python code while the other waits on the lock.
    s.on_new_request(a)
    store(s, a, [1])
    order.append("holder released")
    s.release()
    assert acquired.wait(timeout=30)
    t.join(timeout=30)
    assert order == ["holder released", "other acquired"]


def test_arena_getters_inside_a_step_never_wait_for_a_waiting_teardown(tmp_path):
    """A step holder reading the arena's geometry while another thread's reset_cache waits for
    the step (holding the handle's write lock) gets its answer at once, and the reset then goes
    through: neither waits for the other."""
    m = kvtier.TieringManager.from_toml(
        f'[primary]\ntype = "cpu"\ncapacity = 4\nshared_memory = "{tmp_path}/arena"\n', 64
    )
    outcome = []
    with m.step():
        waiting = threading.Thread(target=lambda: outcome.append(m.reset_cache()))
        waiting.start()
        # Give the reset time to take the write lock and queue behind the step (if it has not
        # yet, the reads below pass trivially; they never fail).
        time.sleep(0.2)
        assert m.num_chunks == 4 and m.chunk_bytes == 64 and m.row_stride >= 64
        assert str(m.arena_path) == f"{tmp_path}/arena" and "4 chunks" in repr(m)
        with pytest.raises(kvtier.StepError, match="holds a step"):
            m.control_thread_running
    waiting.join(timeout=30)
    assert not waiting.is_alive() and outcome == [None]
    m.shutdown()
    assert m.control_thread_running is False
    with pytest.raises(kvtier.KvtierError, match="shut down"):
        m.num_chunks


def test_shut_down_manager_refuses_steps_and_hooks():
    m = cpu_manager(2)
    m.shutdown()
    m.shutdown()  # idempotent
    with pytest.raises(kvtier.KvtierError, match="shut down"):
        m.step()
    with pytest.raises(kvtier.KvtierError, match="shut down"):
        m.has_pending_work()


def test_keys_are_validated():
    m = cpu_manager(2)
    a = kvtier.ReqContext("a")
    with m.step() as s:
        with pytest.raises(TypeError, match="bytes"):
            s.lookup("not bytes", a)
        with pytest.raises(ValueError, match="36 bytes"):
            s.lookup(b"short", a)
        with pytest.raises(TypeError, match="single bytes"):
            s.touch(key(1), a)
        # A bare 32-byte hash is group 0.
        s.on_new_request(a)
        store(s, a, [1])
        assert s.lookup(key(1)[:32], a) is LookupResult.HIT
        # Lists, tuples and iterators are batches alike; one bad key fails the whole call and
        # pins nothing.
        s.on_new_request(b := kvtier.ReqContext("b"))
        store(s, b, [2, 3])
        for batch in ([key(2), key(3)], (key(2), key(3)), iter([key(2), key(3)])):
            s.prepare_load(batch, b)
            s.complete_load([key(2), key(3)], b)
        with pytest.raises(ValueError, match="36 bytes"):
            s.prepare_load((key(2), b"short"), b)
        with pytest.raises(TypeError, match="bytes"):
            s.prepare_load([key(2), 7], b)
        with pytest.raises(kvtier.KvtierError, match="not pinned"):
            s.complete_load([key(2)], b)
    # The group is read big-endian.
    assert kvtier.split_offload_key(key(7, 0x01020304))[1] == 0x01020304
    h, g = kvtier.split_offload_key(key(7, 3))
    assert g == 3 and kvtier.make_offload_key(h, 3) == key(7, 3)
    with pytest.raises(ValueError):
        kvtier.make_offload_key(b"x" * 31)
    m.shutdown()


def test_bad_chains_raise_config_errors_with_the_rust_message(tmp_path):
    with pytest.raises(kvtier.ConfigError, match="no-such-tier"):
        kvtier.TieringManager.from_toml('[primary]\ntype = "no-such-tier"\n', 64)
    with pytest.raises(kvtier.ConfigError, match="capasity"):
        kvtier.TieringManager.from_toml('[primary]\ntype = "cpu"\ncapasity = 4\n', 64)
    with pytest.raises(kvtier.ConfigError, match="chunk_bytes"):
        kvtier.TieringManager.from_toml('[primary]\ntype = "cpu"\ncapacity = 4\n', 0)
    with pytest.raises(kvtier.ConfigError):
        kvtier.TieringManager.from_config(tmp_path / "missing.toml", 64)
    path = tmp_path / "chain.toml"
    path.write_text('[primary]\ntype = "cpu"\ncapacity = 3\n')
    m = kvtier.TieringManager.from_config(path, 64)
    assert m.num_chunks == 3 and m.chunk_bytes == 64 and m.arena_path is None
    m.shutdown()


def test_request_context_carries_positions_params_and_filter():
    ctx = kvtier.ReqContext("r", {"max_offload_tokens": 3}, [{"medium": "storage"}])
    assert ctx.req_id == "r"
    assert ctx.get_offload_key_position(key(1)) is None
    ctx.set_offload_key_position(key(1), 64)
    assert ctx.get_offload_key_position(key(1)) == 64
    with pytest.raises(ValueError, match="unknown medium"):
        kvtier.ReqContext("r", None, [{"medium": "tape"}])


def test_results_hand_back_the_callers_key_objects_and_build_lists_once():
    m = cpu_manager(3)
    a = kvtier.ReqContext("a")
    with m.step() as s:
        s.on_new_request(a)
        store(s, a, [1])
        offered = keys(1, 2, 3)
        out = s.prepare_store(offered, a)
        # Key 1 is resident: keys_to_store are the caller's own objects for 2 and 3, in order.
        assert nums(out.keys_to_store) == [2, 3]
        assert out.keys_to_store[0] is offered[1] and out.keys_to_store[1] is offered[2]
        # Lists are built on first access, then the same object is returned.
        assert out.keys_to_store is out.keys_to_store
        assert out.evicted == [] and out.evicted is out.evicted_keys
        s.complete_store(out.keys_to_store, a)
        events = s.take_events()
        assert [(e.removed, nums(e.keys)) for e in events] == [(False, [1]), (False, [2, 3])]
        assert events[1].keys is events[1].keys
        # A tuple works as well; an iterator's keys come back as new, equal objects. When
        # every offered key is new, the list is a new list of the caller's objects.
        offered = (key(4),)
        out = s.prepare_store(offered, a)
        assert nums(out.keys_to_store) == [4] and len(out.evicted_keys) == 1
        assert out.keys_to_store[0] is offered[0] and isinstance(out.keys_to_store, list)
        assert out.evicted is out.evicted_keys
        s.complete_store(out.keys_to_store, a)
        out = s.prepare_store(iter([key(5)]), a)
        assert nums(out.keys_to_store) == [5] and len(out.evicted) == 1
        s.complete_store(out.keys_to_store, a)
        offered = [key(6)]
        out = s.prepare_store(offered, a)
        assert out.keys_to_store == offered and out.keys_to_store is not offered
        assert out.keys_to_store[0] is offered[0]
        s.complete_store(out.keys_to_store, a)
        removed = [nums(e.keys) for e in s.take_events() if e.removed]
        assert len(removed) == 3 and all(len(r) == 1 for r in removed)
    m.shutdown()
