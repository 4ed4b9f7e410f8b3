"""Two vLLM schedulers in two processes sharing chunks over kvtier's p2p tier: the consumer's
requests name the producer (``remote_kv_source`` in their ``kv_transfer_params``), find the
prefixes the producer computed and load them bit-exact while the producer holds no step (its
control thread serves); off-step completions on and off. A producer killed mid-run turns the
consumer's peer lookups into misses: every request still finishes, every token right."""

import multiprocessing
import os

import pytest

import harness
import peer_engine
from conftest import PATIENCE_S, assert_clean, chain, free_port, kvtier_engine, tier_stats

SHAPE = dict(num_gpu_blocks=24)


def start_producer(model_dir, tmp_path, work, off_step):
    port = free_port()
    path = chain(tmp_path, peer_engine.p2p_tier(port), capacity=64, off_step=off_step, name="producer")
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=peer_engine.main, args=(child, model_dir, path, work, SHAPE), daemon=True)
    proc.start()
    assert parent.poll(10 * PATIENCE_S), "the producer engine never finished its workload"
    msg = parent.recv()
    assert msg[0] == "stored" and msg[1] == 0 and msg[2] == 0, f"producer: {msg}"
    return proc, parent, port


def consumer_params(port):
    # Every consumer request names the producer; its kv_request_id is only a label here (the
    # peer is probed per chunk).
    return {"remote_kv_source": {"kv_request_id": "producer", "host": "127.0.0.1", "port": port}}


@pytest.mark.parametrize("off_step", [True, False], ids=["off_step", "on_step"])
def test_consumer_loads_the_producers_prefixes_over_p2p(model_dir, tmp_path, off_step):
    shape = harness.EngineShape(**SHAPE)
    work = harness.waves_workload(5, prefixes=8, waves=3, per_wave=4, block_size=shape.block_size)
    proc, pipe, port = start_producer(model_dir, tmp_path, work, off_step)
    consumer = kvtier_engine(
        model_dir, chain(tmp_path, peer_engine.p2p_tier(free_port()), capacity=64, off_step=off_step, name="consumer"), shape
    )
    try:
        stats = harness.drive(consumer, work, kv_transfer_params=consumer_params(port))
        p2p = tier_stats(consumer, "p2p")
        load_sources = consumer.manager.kvtier_stats()["manager"]
    finally:
        consumer.shutdown()
        pipe.send("done")
        proc.join(PATIENCE_S)
        if proc.is_alive():
            proc.kill()
    assert_clean(stats, "consumer")
    assert p2p["hits"] > 0 and load_sources["promoted_keys"] > 0, (p2p, load_sources)
    assert stats.connector_tokens > 0


def test_a_killed_producer_turns_peer_lookups_into_misses(model_dir, tmp_path):
    shape = harness.EngineShape(**SHAPE)
    work = harness.waves_workload(5, prefixes=8, waves=6, per_wave=4, block_size=shape.block_size)
    proc, pipe, port = start_producer(model_dir, tmp_path, work[: len(work) // 2] + work[len(work) // 2 :], True)
    consumer = kvtier_engine(
        model_dir, chain(tmp_path, peer_engine.p2p_tier(free_port()), capacity=64, name="consumer"), shape
    )
    killed = []

    def kill_producer(engine, step):
        if step == 20 and proc.is_alive():
            proc.kill()
            proc.join(PATIENCE_S)
            killed.append(step)

    try:
        stats = harness.drive(consumer, work, kv_transfer_params=consumer_params(port), on_step=kill_producer)
    finally:
        consumer.shutdown()
        if proc.is_alive():
            proc.kill()
    assert killed
    assert_clean(stats, "consumer after the producer died")
