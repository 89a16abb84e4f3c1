//! Control-plane tests against the embedded rumqttd broker and a real mosquitto.

mod common;
mod embedded;
mod mosquitto;
