//! The registry's QUIC wire protocol ([`wire`]) and its client ([`client`]): signed metadata,
//! resumable chunked downloads, assignments, reports, operator requests. Devices link this
//! crate, never the registry service.

pub mod admin;
pub mod client;
pub mod wire;

pub use admin::AdminAnswer;
pub use client::{ChunkCache, ClientError, DirChunkCache, DownloadReport, MemChunkCache, RegistryClient};
