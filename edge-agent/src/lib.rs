//! fedfleet-agent: the edge agent.
//!
//! - [`lifecycle`]: the sans-IO core (`fedfleet-agent-core`: rounds, outbox, A/B slots,
//!   installs) joined to [`store`] by [`DurableLifecycle`], which writes what the core returns
//!   before every action. The core's crate cannot reach sockets, files, clocks or async.
//! - [`clients`]: the `Aggregator` and `Registry` traits the service clients implement (their
//!   in-memory fakes live in `fedfleet-testkit`).
//! - [`agent`]: the tokio shell executing the core's actions (same code for daemon and simulation).
//! - [`trainer`]: the `Trainer` trait a device team implements around its own burn model, and
//!   the built-in `GraphTrainer`; [`ml`] runs rounds, health checks and loading through it.
//! - [`inference`]: the local endpoint (unix socket, line-delimited JSON) and CSV input parsing.
//! - [`inbox`]: labelled examples the device's application pushes through that endpoint, kept
//!   bounded in the store and trained on from the next round.
//! - [`secagg`]: a securely aggregated round's stages, driving `fedfleet-secagg`'s device side.
//! - [`mirror`]: artifact downloads from HTTP(S) mirrors of the registry's object store
//!   (untrusted: the shell checks every artifact against its signed digest).
//! - [`config`], [`daemon`]: `agent.toml`, identity files, the `run`/`status`/`enroll` commands.

pub mod agent;
pub mod clients;
pub mod config;
pub mod daemon;
pub mod inbox;
pub mod inference;
pub mod lifecycle;
pub mod mirror;
pub mod ml;
pub mod mqtt;
pub mod remote;
pub mod renewal;
pub mod secagg;
pub mod store;
pub mod trainer;

pub use agent::{Agent, Clock, LocalData, MonotonicClock, Serving, ShellConfig, SystemClock, run_agent};
pub use clients::{Aggregator, BaseModel, Registry, TransportError, UploadReply};
pub use lifecycle::{Action, AgentError, CoreConfig, DurableLifecycle, HealthReport, Input, Lifecycle, LifecycleError, SlotModel};
pub use store::{AgentStore, OutboxEntry, StoreError};
pub use trainer::{Evaluation, GraphTrainer, LocalUpdate, ModelView, RoundJob, Serve, Trainer};
