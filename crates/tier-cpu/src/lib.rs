//! The CPU primary tier of kvtier: ref-counted chunk slots over the `ChunkArena`, eviction
//! policies (vLLM-0.33-exact LRU and ARC, plus S3-FIFO), events and stats.
//!
//! Not implemented yet; tracked by the tier-cpu issue.
