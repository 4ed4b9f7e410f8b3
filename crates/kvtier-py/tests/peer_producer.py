"""The producer process of the peer test: a manager with a p2p tier that stores chunks, then
runs a "model step" (sleeps with no step held) while a consumer pulls them."""

import kvtier

CHUNK = 256


def chain(port):
    return f"""
[primary]
type = "cpu"
capacity = 8

[[secondary]]
type = "p2p"
name = "p2p"
bind = "127.0.0.1:{port}"
hash_seed = "py-peer-test"
layout_fingerprint = "py-peer-test"
insecure = true

[control_plane]
thread = true
idle_wait = "1ms"
"""


def payload(key):
    return bytes((key[0] + i) % 251 for i in range(CHUNK))


def main(port, keys, conn):
    m = kvtier.TieringManager.from_toml(chain(port), CHUNK)
    try:
        ctx = kvtier.ReqContext("producer-req")
        with m.step() as s:
            s.on_new_request(ctx)
            out = s.prepare_store(keys, ctx)
            for key, row in zip(out.keys_to_store, out.chunk_ids):
                m.write_row(row, payload(key))  # the "device copy"
            s.complete_store(out.keys_to_store, ctx)
            s.on_request_finished(ctx)
            s.on_schedule_end()
        conn.send("stored")
        # The "model step": no step is held for as long as the consumer needs, so only the
        # control-plane thread can serve the fetch.
        while not conn.poll(0.05):
            pass
        conn.recv()
        conn.send(m.stats()["secondaries"][0])
    finally:
        m.shutdown()
