//! # tier-kit
//!
//! The plumbing every secondary tier with a worker pool needs (work in progress).
