"""Two managers with p2p tiers in two processes: the consumer finds the producer's chunks on
the peer, and the fetch is served while the producer's Python "model step" runs with no step
held (by the producer's control-plane thread)."""

import multiprocessing
import socket
import time

import kvtier
from kvtier import LookupResult

import peer_producer

PATIENCE_S = 60


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_fetch_is_served_while_the_producer_holds_no_step():
    port = free_port()
    keys = [kvtier.make_offload_key(bytes([7, i]) * 16) for i in range(3)]
    ctx_mp = multiprocessing.get_context("spawn")
    parent, child = ctx_mp.Pipe()
    producer = ctx_mp.Process(target=peer_producer.main, args=(port, keys, child), daemon=True)
    producer.start()
    consumer = kvtier.TieringManager.from_toml(peer_producer.chain(0), peer_producer.CHUNK)
    try:
        assert parent.poll(PATIENCE_S) and parent.recv() == "stored"
        req = kvtier.ReqContext(
            "consumer-req",
            {"remote_kv_source": {"kv_request_id": "producer-req", "host": "127.0.0.1", "port": port}},
        )
        with consumer.step() as s:
            s.on_new_request(req)
        seen = set()
        deadline = time.monotonic() + PATIENCE_S
        rows = None
        while rows is None:
            assert time.monotonic() < deadline, f"no hit from the peer; verdicts seen {seen}"
            with consumer.step() as s:
                verdicts = [s.lookup(k, req) for k in keys]
                seen.update(verdicts)
                if all(v is LookupResult.HIT for v in verdicts):
                    rows = s.prepare_load(keys, req)
                s.on_schedule_end()
            time.sleep(0.002)
        for key, row in zip(keys, rows):
            assert consumer.read_row(row) == peer_producer.payload(key)
        with consumer.step() as s:
            s.complete_load(keys, req)
            s.on_request_finished(req)
            s.on_schedule_end()
        assert LookupResult.HIT_PENDING in seen or LookupResult.RETRY in seen
        assert consumer.stats()["manager"]["promoted_keys"] == 3
        parent.send("done")
        assert parent.poll(PATIENCE_S)
        producer_stats = parent.recv()
        assert producer_stats["name"] == "p2p"
    finally:
        consumer.shutdown()
        producer.join(timeout=10)
        if producer.is_alive():
            producer.kill()
