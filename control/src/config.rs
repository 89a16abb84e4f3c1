//! The one MQTT client configuration: the part of `[mqtt]` that the agent, the aggregator and
//! the registry share, and how it becomes [`ClientOptions`].
//!
//! Each program flattens [`MqttClientConfig`] into its own `[mqtt]` section beside what only it
//! has (the agent's upload path, the aggregator's embedded broker, the services' presence TTL),
//! so a config file names these keys the same way everywhere:
//!
//! ```toml
//! [mqtt]
//! host = "broker.fleet.example"   # must match the broker certificate
//! port = 8883                     # default 8883 (MQTT over TLS)
//! # brokers = ["nats-1.fleet.example:8883", "nats-2.fleet.example:8883"]
//! #                               # instead of host/port: a broker cluster, tried in this order;
//! #                               # a lost or refused connection moves on to the next one
//! # fleet = "acme"                # the fleet on the topics: must be the PKI's (default: the PKI's)
//! # client_id = "registry"        # services only (default: the service's name); a device
//! #                               # always connects under its own id
//! # reconnect_max_secs = 5        # ceiling of the reconnect backoff (default: 30 s for a
//! #                               # device, 5 s for a service)
//! ```
//!
//! serde cannot deny unknown fields across a flattened struct, so each section also flattens
//! [`UnknownKeys`] and calls [`UnknownKeys::check`]: a misspelt key is still an error.

use std::collections::BTreeMap;
use std::time::Duration;

use fedfleet_protocol::FleetId;
use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};

use crate::client::ClientOptions;

/// The MQTT-over-TLS port every `[mqtt]` section defaults to.
pub const DEFAULT_PORT: u16 = 8883;

/// Reconnect backoff ceiling (seconds) for a device: a fleet reconnecting after a broker
/// outage spreads out instead of arriving at once.
pub const DEVICE_RECONNECT_MAX_SECS: u64 = 30;

/// Reconnect backoff ceiling (seconds) for a service's client: a service is one client, not a
/// fleet, so it may come back within seconds of a broker outage without a thundering herd.
pub const SERVICE_RECONNECT_MAX_SECS: u64 = 5;

/// Which side of the fleet a client is on; decides the client id and the backoff defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientKind<'a> {
    /// A device, which connects under its own id (the broker holds it to it).
    Device(&'a str),
    /// A service, connecting as `client_id` or else under this name.
    Service(&'a str),
}

/// Where an MQTT client finds the broker and what it calls itself (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MqttClientConfig {
    /// Broker host name or IP address (must match the broker certificate's SAN).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Broker port (default [`DEFAULT_PORT`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// The nodes of a broker cluster as `host:port` (port default [`DEFAULT_PORT`]), in place of
    /// `host`/`port`: the client connects to the first and fails over to the next whenever a
    /// connection is lost or refused, round the list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub brokers: Option<Vec<String>>,
    /// The fleet id on the broker's topics; must be the PKI's (default: the PKI's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fleet: Option<String>,
    /// MQTT client id of a service (default: its name). A device connects under its own id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_id: Option<String>,
    /// Ceiling of the reconnect backoff after the broker is lost, doubling from 200 ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reconnect_max_secs: Option<u64>,
}

impl MqttClientConfig {
    /// A broker at `host:port`, everything else default.
    pub fn broker(host: impl Into<String>, port: u16) -> Self {
        MqttClientConfig { host: Some(host.into()), port: Some(port), ..Self::default() }
    }

    /// The broker to connect to first: `host`/`port`, or the first of `brokers` (one of the
    /// two is required, not both).
    pub fn address(&self) -> Result<(String, u16), String> {
        Ok(self.addresses()?.swap_remove(0))
    }

    /// Every configured broker address, in the order a client tries them.
    pub fn addresses(&self) -> Result<Vec<(String, u16)>, String> {
        match (&self.host, &self.brokers) {
            (Some(_), Some(_)) => Err("[mqtt] names both host and brokers: give one (brokers for a cluster)".into()),
            (None, None) => Err("[mqtt] host is missing: name the broker (or brokers = [\"host:port\", ...] for a cluster)".into()),
            (Some(host), None) => Ok(vec![(host.clone(), self.port.unwrap_or(DEFAULT_PORT))]),
            (None, Some(_)) if self.port.is_some() => Err("[mqtt] port goes with host; each of brokers names its own port".into()),
            (None, Some(list)) if list.is_empty() => Err("[mqtt] brokers is empty: name at least one broker".into()),
            (None, Some(list)) => list.iter().map(|b| parse_broker(b)).collect(),
        }
    }

    /// The fleet on the topics: `fleet` if given (it must be `expected`), else `expected`.
    pub fn fleet(&self, expected: &FleetId) -> Result<FleetId, String> {
        match &self.fleet {
            Some(f) if f != expected.as_str() => Err(format!("[mqtt] fleet {f:?} is not the PKI's fleet {expected}")),
            _ => Ok(expected.clone()),
        }
    }

    /// Options for a `kind` client of the broker at `host:port` on `fleet`.
    pub fn options(&self, kind: ClientKind<'_>, host: String, port: u16, fleet: FleetId) -> Result<ClientOptions, String> {
        let (client_id, reconnect_max) = match kind {
            ClientKind::Device(id) => {
                if let Some(c) = self.client_id.as_deref().filter(|c| *c != id) {
                    return Err(format!("[mqtt] client_id {c:?}: a device connects under its own id {id:?}"));
                }
                (id.to_owned(), DEVICE_RECONNECT_MAX_SECS)
            }
            ClientKind::Service(name) => (self.client_id.clone().unwrap_or_else(|| name.to_owned()), SERVICE_RECONNECT_MAX_SECS),
        };
        let mut o = ClientOptions::new(host, port, client_id, fleet);
        if self.brokers.is_some() {
            o.failover = self.addresses()?.split_off(1);
        }
        o.backoff_max = Duration::from_secs(self.reconnect_max_secs.unwrap_or(reconnect_max).max(1));
        Ok(o)
    }
}

/// `host:port` or `host` (default port); an IPv6 address in brackets, `[::1]:8883`.
fn parse_broker(text: &str) -> Result<(String, u16), String> {
    let bad = || format!("[mqtt] brokers: {text:?} is not host:port");
    let (host, port) = match text.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') || (h.starts_with('[') && h.ends_with(']')) => (h, Some(p.parse::<u16>().map_err(|_| bad())?)),
        _ => (text, None),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() || host.contains(['/', ' ']) {
        return Err(bad());
    }
    Ok((host.to_owned(), port.unwrap_or(DEFAULT_PORT)))
}

/// Keys of a flattened `[mqtt]` section that no field took; [`UnknownKeys::check`] refuses them.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(transparent)]
pub struct UnknownKeys(BTreeMap<String, IgnoredAny>);

impl UnknownKeys {
    /// An error naming every unknown key of `section`.
    pub fn check(&self, section: &str) -> Result<(), String> {
        match self.0.keys().map(String::as_str).collect::<Vec<_>>().join(", ") {
            keys if keys.is_empty() => Ok(()),
            keys => Err(format!("[{section}]: unknown key(s) {keys}")),
        }
    }
}

impl PartialEq for UnknownKeys {
    fn eq(&self, other: &Self) -> bool {
        self.0.keys().eq(other.0.keys())
    }
}

impl Eq for UnknownKeys {}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize)]
    struct Section {
        #[serde(flatten)]
        client: MqttClientConfig,
        #[serde(default)]
        own: u32,
        #[serde(flatten)]
        unknown: UnknownKeys,
    }

    fn parse(text: &str) -> Section {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn the_shared_keys_and_a_programs_own_read_side_by_side() {
        let s = parse("host = \"b\"\nport = 1883\nown = 3\nreconnect_max_secs = 9");
        assert_eq!((s.client.address().unwrap(), s.own), (("b".to_owned(), 1883), 3));
        assert_eq!(s.unknown.check("mqtt"), Ok(()));
        let o = s.client.options(ClientKind::Service("registry"), "b".into(), 1883, FleetId::new("eu").unwrap()).unwrap();
        assert_eq!((o.client_id.as_str(), o.backoff_max), ("registry", Duration::from_secs(9)));
    }

    #[test]
    fn a_fleet_other_than_the_pkis_is_refused() {
        let eu = FleetId::new("eu").unwrap();
        assert_eq!(parse("host = \"b\"").client.fleet(&eu), Ok(eu.clone()));
        assert_eq!(parse("host = \"b\"\nfleet = \"eu\"").client.fleet(&eu), Ok(eu.clone()));
        assert_eq!(parse("host = \"b\"\nfleet = \"us\"").client.fleet(&eu).unwrap_err(), "[mqtt] fleet \"us\" is not the PKI's fleet eu");
    }

    #[test]
    fn a_broker_cluster_is_a_list_tried_in_order() {
        let fleet = FleetId::new("eu").unwrap();
        let c = parse("brokers = [\"n1:1883\", \"n2\", \"[::1]:8884\"]").client;
        assert_eq!(c.address().unwrap(), ("n1".to_owned(), 1883));
        let o = c.options(ClientKind::Device("cam-1"), "n1".into(), 1883, fleet).unwrap();
        assert_eq!(o.failover, vec![("n2".to_owned(), DEFAULT_PORT), ("::1".to_owned(), 8884)]);
        let err = |text: &str| parse(text).client.address().unwrap_err();
        assert!(err("host = \"a\"\nbrokers = [\"b:1\"]").contains("both host and brokers"));
        assert!(err("brokers = []").contains("brokers is empty"));
        assert!(err("brokers = [\"b:1\"]\nport = 2").contains("port goes with host"));
        assert!(err("brokers = [\"b:x\"]").contains("\"b:x\" is not host:port"));
        assert!(err("brokers = [\":1\"]").contains("is not host:port"));
    }

    #[test]
    fn a_misspelt_key_is_refused_by_name() {
        let s = parse("host = \"b\"\nprot = 1883\nclientid = \"x\"");
        assert_eq!(s.unknown.check("mqtt").unwrap_err(), "[mqtt]: unknown key(s) clientid, prot");
    }

    #[test]
    fn defaults_and_refusals() {
        let fleet = FleetId::new("eu").unwrap();
        let c = parse("host = \"b\"").client;
        assert_eq!(c.address().unwrap(), ("b".to_owned(), DEFAULT_PORT));
        let d = c.options(ClientKind::Device("cam-1"), "b".into(), 8883, fleet.clone()).unwrap();
        assert_eq!((d.client_id.as_str(), d.backoff_max), ("cam-1", Duration::from_secs(DEVICE_RECONNECT_MAX_SECS)));
        let s = c.options(ClientKind::Service("agg"), "b".into(), 8883, fleet.clone()).unwrap();
        assert_eq!(s.backoff_max, Duration::from_secs(SERVICE_RECONNECT_MAX_SECS));
        assert!(parse("port = 1").client.address().unwrap_err().contains("host is missing"));
        assert!(parse("fleet = \"us\"").client.fleet(&fleet).unwrap_err().contains("not the PKI's fleet eu"));
        let other = parse("client_id = \"cam-2\"").client;
        assert!(other.options(ClientKind::Device("cam-1"), "b".into(), 1, fleet).unwrap_err().contains("its own id"));
    }
}
