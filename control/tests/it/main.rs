//! Control-plane tests against the embedded rumqttd broker, a real mosquitto and a real NATS
//! cluster.

mod common;
mod embedded;
mod mosquitto;
mod nats;
