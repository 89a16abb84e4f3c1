//! fedfleet's control plane over MQTT: what a fleet needs to hear about (round announcements,
//! rollout notices, device status and heartbeats) and a fallback upload path for networks where
//! UDP (QUIC) is blocked. Bulk data stays on QUIC.
//!
//! - [`topics`]: the versioned topic schema and the QoS of each topic.
//! - [`broker`] (feature `broker`): the embedded rumqttd broker (TLS, client certificates
//!   required). Devices build without it.
//! - [`config`]: [`MqttClientConfig`], the `[mqtt]` keys every program shares.
//! - [`client`]: [`ControlClient`], typed signed publishing and verified [`ControlEvent`]s, with
//!   reconnect and backoff.
//! - [`upload`]: chunked update frames and the aggregator-side [`UpdateAssembler`].
//! - [`rejection`]: the aggregator's signed refusal of an MQTT upload ([`SignedRejection`]).
//! - [`sealed`]: the one framing and verification of what a service signs for one device
//!   (refusals and answers).
//! - [`exchange`]: a device's requests of the aggregator and its signed answers ([`SignedAnswer`]),
//!   for what QUIC carries as request and response (the secure-aggregation stages).
//! - [`verify`]: the checks every received message goes through; the broker is not trusted.
//! - [`presence`]: devices online and last seen, from verified status.
//!
//! **Crypto provider:** ring only. rumqttc is built with `use-rustls-no-provider` and gets its
//! rustls config from `fedfleet-certs` (built with the ring provider); rumqttd brings its own
//! rustls 0.22 on ring.

#[cfg(feature = "broker")]
pub mod access;
#[cfg(feature = "broker")]
pub mod broker;
pub mod client;
pub mod config;
pub mod exchange;
pub mod presence;
pub mod rejection;
pub mod sealed;
pub mod topics;
pub mod upload;
pub mod verify;

#[cfg(feature = "broker")]
pub use broker::{BrokerConfig, BrokerError, BrokerMetrics, EmbeddedBroker, Refusal, export_key_pkcs8_v1};
pub use client::{
    ClientOptions, ControlClient, ControlError, ControlEvent, ControlEvents, ControlStats, Inbound, Received, Role, device_tls, service_tls,
};
pub use config::{ClientKind, MqttClientConfig, UnknownKeys};
pub use exchange::{Answer, DeviceRequest, SignedAnswer};
pub use presence::Presence;
pub use rejection::{SignedRejection, UploadRejection};
pub use rumqttc::QoS;
pub use topics::Topic;
pub use upload::{Assembled, AssemblerLimits, UpdateAssembler, VerifiedUpload, encode_frames};
pub use verify::{DeviceKeys, Rejected};
