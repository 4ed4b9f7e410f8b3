//! The floors the fetch round trip is compared with, measured in the same run: a raw ZeroMQ
//! round trip (every control exchange) and a raw loopback-TCP transfer of one fetch's bytes
//! (its data).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use super::super::BenchError;

/// Round trips of one small message between a ZeroMQ DEALER and an echoing ROUTER on loopback,
/// in µs.
pub(super) fn control_rtt(n: usize) -> Result<Vec<f64>, BenchError> {
    let zerr = |e: zmq::Error| BenchError::Reference {
        reference: "raw ZeroMQ round trip".into(),
        error: std::io::Error::other(e.to_string()),
    };
    let ctx = zmq::Context::new();
    let router = ctx.socket(zmq::ROUTER).map_err(zerr)?;
    router.bind("tcp://127.0.0.1:*").map_err(zerr)?;
    let endpoint = router
        .get_last_endpoint()
        .map_err(zerr)?
        .map_err(|_| zerr(zmq::Error::EINVAL))?;
    let echo = std::thread::Builder::new()
        .name("kvtier-bench-echo".into())
        .spawn(move || -> Result<(), zmq::Error> {
            for _ in 0..n {
                let frames = router.recv_multipart(0)?;
                router.send_multipart(frames, 0)?;
            }
            Ok(())
        })
        .map_err(|e| BenchError::Reference {
            reference: "raw ZeroMQ round trip".into(),
            error: e,
        })?;
    let dealer = ctx.socket(zmq::DEALER).map_err(zerr)?;
    dealer.connect(&endpoint).map_err(zerr)?;
    let mut samples = Vec::with_capacity(n);
    let payload = [0u8; 64];
    for _ in 0..n {
        let t = Instant::now();
        dealer.send(&payload[..], 0).map_err(zerr)?;
        dealer.recv_bytes(0).map_err(zerr)?;
        samples.push(t.elapsed().as_secs_f64() * 1e6);
    }
    match echo.join() {
        Ok(r) => r.map_err(zerr)?,
        Err(_) => {
            return Err(BenchError::Reference {
                reference: "raw ZeroMQ round trip".into(),
                error: std::io::Error::other("the echo thread panicked"),
            });
        }
    }
    Ok(samples)
}

/// Transfers of `bytes` over one loopback TCP connection, each acknowledged by one byte once
/// the receiver read them all, in ms: what the data plane of one fetch cannot beat.
pub(super) fn transfer_time(bytes: usize, n: usize) -> Result<Vec<f64>, BenchError> {
    let ioerr = |error: std::io::Error| BenchError::Reference {
        reference: "raw loopback TCP transfer".into(),
        error,
    };
    let listener = TcpListener::bind("127.0.0.1:0").map_err(ioerr)?;
    let addr = listener.local_addr().map_err(ioerr)?;
    let sink = std::thread::Builder::new()
        .name("kvtier-bench-sink".into())
        .spawn(move || -> std::io::Result<()> {
            let (mut s, _) = listener.accept()?;
            s.set_nodelay(true)?;
            let mut buf = vec![0u8; bytes];
            for _ in 0..n {
                s.read_exact(&mut buf)?;
                s.write_all(&[1])?;
            }
            Ok(())
        })
        .map_err(ioerr)?;
    let mut s = TcpStream::connect(addr).map_err(ioerr)?;
    s.set_nodelay(true).map_err(ioerr)?;
    let payload: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    let mut ack = [0u8; 1];
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        s.write_all(&payload).map_err(ioerr)?;
        s.read_exact(&mut ack).map_err(ioerr)?;
        samples.push(t.elapsed().as_secs_f64() * 1e3);
    }
    match sink.join() {
        Ok(r) => r.map_err(ioerr)?,
        Err(_) => return Err(ioerr(std::io::Error::other("the sink thread panicked"))),
    }
    Ok(samples)
}
