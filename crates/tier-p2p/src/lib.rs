//! The peer-to-peer secondary tier of kvtier: a ZeroMQ control plane and a TCP data plane that
//! lets peers share offloaded chunks, served from the manager's control-plane thread.
//!
//! Not implemented yet; tracked by the tier-p2p issue.
