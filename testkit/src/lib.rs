//! fedfleet's test kit, for tests, examples and benchmarks (never linked by a device or a
//! service): the real registry and aggregator started in this process ([`services`]), in-memory
//! fakes of both ([`fakes`]), a fake clock ([`clock`]), fleets of real agents in one process
//! ([`sim`]), a big fleet of which each round samples a few ([`sampled`]), and the launchers of external brokers: Debian's mosquitto ([`mosquitto`]) a
//! `nats-server` cluster ([`nats`]), and a SeaweedFS S3 server ([`seaweedfs`]).

pub mod clock;
#[cfg(unix)]
pub mod daemon;
pub mod fakes;
#[cfg(unix)]
pub mod mosquitto;
#[cfg(unix)]
pub mod nats;
pub mod sampled;
#[cfg(unix)]
pub mod seaweedfs;
pub mod services;
pub mod sim;

pub use clock::FakeClock;
#[cfg(unix)]
pub use mosquitto::{Mosquitto, MosquittoConfig, MosquittoError};
