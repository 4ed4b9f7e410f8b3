//! Benchmarks behind `kvtier bench`.
