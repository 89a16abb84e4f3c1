//! The versioned MQTT topic schema and the QoS of each topic.
//!
//! ```text
//! fedfleet/v1/<fleet>/rounds                   Signed<RoundAnnouncement>  aggregator -> devices  QoS1 retained
//! fedfleet/v1/<fleet>/rollouts                 Signed<RolloutNotice>      registry   -> devices  QoS1 retained
//! fedfleet/v1/<fleet>/devices/<id>/status      Signed<DeviceStatus>       device     -> services QoS1 retained
//! fedfleet/v1/<fleet>/devices/<id>/updates     upload frames (signed hdr) device     -> aggregator QoS1
//! fedfleet/v1/<fleet>/devices/<id>/receipts    Signed<Receipt>            aggregator -> device   QoS1
//! fedfleet/v1/<fleet>/devices/<id>/rejections  SignedRejection            aggregator -> device   QoS1
//! fedfleet/v1/<fleet>/devices/<id>/requests    request frames             device     -> aggregator QoS0
//! fedfleet/v1/<fleet>/devices/<id>/answers     SignedAnswer               aggregator -> device   QoS0
//! ```
//!
//! Fleet and device ids are `[A-Za-z0-9._-]{1,64}` (checked by the protocol crate), so they never
//! contain the MQTT separators or wildcards `/`, `+`, `#`. A breaking change to any payload gets a
//! `v2` prefix; `v1` subscribers never see it.

use fedfleet_certs::PeerIdentity;
use fedfleet_protocol::{DeviceId, FleetId};
use rumqttc::QoS;

/// First two levels of every topic.
pub const PREFIX: &str = "fedfleet/v1";

/// One topic of the schema, parsed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Topic {
    /// The current round announcement. **QoS 1, retained**: a device that connects (or
    /// reconnects) mid-round learns the open round from the retained message at once instead of
    /// waiting for the next one; QoS 1 because a lost announcement costs a device the round, and
    /// duplicates are harmless (announcements are idempotent by round id).
    Rounds { fleet: FleetId },
    /// The current rollout notice. **QoS 1, retained**, for the same reasons: a device that was
    /// offline when a phase started learns it on connect; repeats are idempotent by
    /// (rollout id, phase).
    Rollouts { fleet: FleetId },
    /// A device's signed heartbeat and status. **QoS 1, retained**: a rollout phase waits on
    /// install outcomes, so they must not be lost; retained so a restarted registry or aggregator
    /// sees every device's last status (its signed `reported_at` says how old it is). A
    /// duplicate is the same report twice.
    Status { fleet: FleetId, device: DeviceId },
    /// Upload frames of the MQTT fallback path (a signed update header, then payload chunks).
    /// **QoS 1, not retained**: chunks must arrive; a duplicate chunk is recognised by its index
    /// and dropped. Never retained: an upload is for the aggregator of the moment only.
    Updates { fleet: FleetId, device: DeviceId },
    /// The aggregator's signed receipts for updates accepted from this device. **QoS 1, not
    /// retained**: a device that misses one re-sends its update and gets the receipt again
    /// (ingest is idempotent), so nothing needs to wait in the broker.
    Receipts { fleet: FleetId, device: DeviceId },
    /// The aggregator's signed refusals of this device's MQTT uploads
    /// ([`crate::SignedRejection`]). **QoS 1, not retained**, like receipts: a device that
    /// misses one re-sends and is refused again.
    Rejections { fleet: FleetId, device: DeviceId },
    /// A device's requests of the aggregator ([`crate::exchange`]: today the secure-aggregation
    /// stages). **QoS 0, not retained**: a request with no answer is sent again (see
    /// [`Topic::Answers`] for why that is safe and why QoS 0).
    Requests { fleet: FleetId, device: DeviceId },
    /// The aggregator's signed answers to this device's requests ([`crate::SignedAnswer`]).
    /// **QoS 0, not retained**: a device whose answer is lost asks again (polls and rosters are
    /// idempotent; a stage message sent again is refused as a duplicate, which tells the device
    /// the first copy arrived). At QoS 0 a subscription costs a broker no queue: NATS keeps a
    /// JetStream consumer per QoS 1 subscription, and with this one at QoS 1 the devices of
    /// `control`'s NATS failover test did not reconnect within its minute; at QoS 0 they
    /// reconnect as fast as without it (52–126 s for the whole test either way).
    Answers { fleet: FleetId, device: DeviceId },
}

impl Topic {
    /// The topic string.
    pub fn path(&self) -> String {
        match self {
            Topic::Rounds { fleet } => rounds(fleet),
            Topic::Rollouts { fleet } => rollouts(fleet),
            Topic::Status { fleet, device } => status(fleet, device),
            Topic::Updates { fleet, device } => updates(fleet, device),
            Topic::Receipts { fleet, device } => receipts(fleet, device),
            Topic::Rejections { fleet, device } => rejections(fleet, device),
            Topic::Requests { fleet, device } => requests(fleet, device),
            Topic::Answers { fleet, device } => answers(fleet, device),
        }
    }

    /// QoS to publish and subscribe with (see each variant for why).
    pub fn qos(&self) -> QoS {
        match self {
            Topic::Requests { .. } | Topic::Answers { .. } => QoS::AtMostOnce,
            _ => QoS::AtLeastOnce,
        }
    }

    /// Whether publishers set the retain flag.
    pub fn retained(&self) -> bool {
        matches!(self, Topic::Rounds { .. } | Topic::Rollouts { .. } | Topic::Status { .. })
    }

    pub fn fleet(&self) -> &FleetId {
        match self {
            Topic::Rounds { fleet }
            | Topic::Rollouts { fleet }
            | Topic::Status { fleet, .. }
            | Topic::Updates { fleet, .. }
            | Topic::Receipts { fleet, .. }
            | Topic::Rejections { fleet, .. }
            | Topic::Requests { fleet, .. }
            | Topic::Answers { fleet, .. } => fleet,
        }
    }

    /// The device named in the topic, if any.
    pub fn device(&self) -> Option<&DeviceId> {
        match self {
            Topic::Rounds { .. } | Topic::Rollouts { .. } => None,
            Topic::Status { device, .. }
            | Topic::Updates { device, .. }
            | Topic::Receipts { device, .. }
            | Topic::Rejections { device, .. }
            | Topic::Requests { device, .. }
            | Topic::Answers { device, .. } => Some(device),
        }
    }
}

/// Whether `client` (by the identity in its certificate) may publish on `topic` in `fleet` — the
/// embedded broker's access rule. A device publishes only its own status, updates and requests; a fleet
/// service named in `publishers` (the aggregator, the registry) anything of the fleet's schema;
/// any other service certificate (an operator's) nothing. So no device can forge another's
/// status, and no one but the services can plant a retained announcement that later devices
/// would see instead of the real one (the same rules as [`mosquitto_acl`] with `publishers` as
/// its services).
pub fn may_publish(client: &PeerIdentity, fleet: &FleetId, publishers: &[String], topic: &str) -> bool {
    match client {
        PeerIdentity::Service(name) => publishers.contains(name) && in_fleet(fleet, topic),
        PeerIdentity::Device(me) => matches!(parse(topic),
            Ok(Topic::Status { fleet: f, device } | Topic::Updates { fleet: f, device } | Topic::Requests { fleet: f, device })
                if &f == fleet && &device == me),
    }
}

/// Whether `client` may subscribe to `filter` in `fleet`. A device hears the fleet's
/// announcements and rollout notices and its own receipts, refusals and answers, never another
/// device's topics (no wildcards); a service any filter under the fleet's prefix.
pub fn may_subscribe(client: &PeerIdentity, fleet: &FleetId, filter: &str) -> bool {
    match client {
        PeerIdentity::Service(_) => in_fleet(fleet, filter),
        PeerIdentity::Device(me) => match parse(filter) {
            Ok(Topic::Rounds { fleet: f } | Topic::Rollouts { fleet: f }) => &f == fleet,
            Ok(Topic::Receipts { fleet: f, device } | Topic::Rejections { fleet: f, device } | Topic::Answers { fleet: f, device }) => {
                &f == fleet && &device == me
            }
            _ => false,
        },
    }
}

/// The same rules as [`may_publish`] and [`may_subscribe`] as a mosquitto `acl_file`, for a
/// fleet on an external broker run with `use_identity_as_username true` (the certificate's CN
/// is the user name: a device's id, a service's name). `services` are the service names
/// (e.g. `aggregator`, `registry`) that may use every topic of the fleet.
pub fn mosquitto_acl(fleet: &FleetId, services: &[&str]) -> String {
    let f = format!("{PREFIX}/{fleet}");
    let mut acl = format!(
        "# fedfleet access rules for fleet {fleet} (mosquitto acl_file; needs use_identity_as_username true)\n\
         # Devices: their own status, updates and requests; the fleet's announcements, their own receipts,\n\
         # refusals and answers.\n\
         pattern write {f}/devices/%u/status\n\
         pattern write {f}/devices/%u/updates\n\
         pattern write {f}/devices/%u/requests\n\
         pattern read {f}/devices/%u/receipts\n\
         pattern read {f}/devices/%u/rejections\n\
         pattern read {f}/devices/%u/answers\n\
         pattern read {f}/rounds\n\
         pattern read {f}/rollouts\n\
         # Services: every topic of the fleet.\n"
    );
    for s in services {
        acl.push_str(&format!("user {s}\ntopic readwrite {f}/#\n"));
    }
    acl
}

/// The same rules as [`may_publish`] and [`may_subscribe`] as the `authorization` block of a
/// NATS server's config (NATS's MQTT listener with `verify_and_map`: a client is the user whose
/// name is its certificate's subject, `CN=<id>,OU=device,O=<fleet>`). NATS has no per-user
/// pattern like mosquitto's `%u` in a config file, so every device gets its own entry: write it
/// again after enrolling or revoking devices (leave revoked devices out) and reload the servers
/// (`nats-server --signal reload`). MQTT topics are NATS subjects with `/` as `.`; the
/// `$MQTT.sub.>` delivery subjects are the server's own QoS 1 plumbing.
pub fn nats_authorization(fleet: &FleetId, services: &[&str], devices: &[DeviceId]) -> String {
    let subject = |topic: String| topic.replace('/', ".");
    let user = |cn: &str, ou: &str| format!("CN={cn},OU={ou},O={fleet}");
    let mut out =
        format!("# fedfleet access rules for fleet {fleet} (NATS MQTT listener with verify_and_map)\nauthorization {{\n  users = [\n");
    // One user: its subjects, and the server's QoS 1 delivery subjects, both ways as given.
    let mut entry = |name: String, publish: &[String], subscribe: &[String]| {
        let list = |l: &[String]| l.iter().map(|t| format!("\"{t}\"")).chain(["\"$MQTT.sub.>\"".into()]).collect::<Vec<_>>().join(", ");
        out.push_str(&format!(
            "    {{ user: \"{name}\", permissions: {{ publish: [{}], subscribe: [{}] }} }}\n",
            list(publish),
            list(subscribe)
        ));
    };
    let all = [subject(format!("{PREFIX}/{fleet}/>"))];
    for s in services {
        entry(user(s, fedfleet_certs::OU_SERVICE), &all, &all);
    }
    for d in devices {
        let publish = [status(fleet, d), updates(fleet, d), requests(fleet, d)].map(subject);
        let subscribe = [rounds(fleet), rollouts(fleet), receipts(fleet, d), rejections(fleet, d), answers(fleet, d)].map(subject);
        entry(user(d.as_str(), fedfleet_certs::OU_DEVICE), &publish, &subscribe);
    }
    out.push_str("  ]\n}\n");
    out
}

fn in_fleet(fleet: &FleetId, topic: &str) -> bool {
    topic
        .strip_prefix(PREFIX)
        .and_then(|r| r.strip_prefix('/'))
        .and_then(|r| r.strip_prefix(fleet.as_str()))
        .is_some_and(|r| r.starts_with('/'))
}

/// Why a topic string is not part of the schema.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopicError {
    #[error("topic {0:?} is not under {PREFIX}/")]
    NotOurs(String),
    #[error("topic {0:?} has a bad fleet or device id")]
    BadId(String),
    #[error("topic {0:?} is not in the v1 schema")]
    Unknown(String),
}

/// Parses a topic string of the schema.
pub fn parse(topic: &str) -> Result<Topic, TopicError> {
    let rest = topic.strip_prefix(PREFIX).and_then(|r| r.strip_prefix('/')).ok_or_else(|| TopicError::NotOurs(topic.to_owned()))?;
    let parts: Vec<&str> = rest.split('/').collect();
    let bad_id = || TopicError::BadId(topic.to_owned());
    let fleet = FleetId::new(*parts.first().unwrap_or(&"")).map_err(|_| bad_id())?;
    match parts[1..] {
        ["rounds"] => Ok(Topic::Rounds { fleet }),
        ["rollouts"] => Ok(Topic::Rollouts { fleet }),
        ["devices", id, leaf] => {
            let device = DeviceId::new(id).map_err(|_| bad_id())?;
            match leaf {
                "status" => Ok(Topic::Status { fleet, device }),
                "updates" => Ok(Topic::Updates { fleet, device }),
                "receipts" => Ok(Topic::Receipts { fleet, device }),
                "rejections" => Ok(Topic::Rejections { fleet, device }),
                "requests" => Ok(Topic::Requests { fleet, device }),
                "answers" => Ok(Topic::Answers { fleet, device }),
                _ => Err(TopicError::Unknown(topic.to_owned())),
            }
        }
        _ => Err(TopicError::Unknown(topic.to_owned())),
    }
}

pub fn rounds(fleet: &FleetId) -> String {
    format!("{PREFIX}/{fleet}/rounds")
}
pub fn rollouts(fleet: &FleetId) -> String {
    format!("{PREFIX}/{fleet}/rollouts")
}
pub fn status(fleet: &FleetId, device: &DeviceId) -> String {
    format!("{PREFIX}/{fleet}/devices/{device}/status")
}
pub fn updates(fleet: &FleetId, device: &DeviceId) -> String {
    format!("{PREFIX}/{fleet}/devices/{device}/updates")
}
pub fn receipts(fleet: &FleetId, device: &DeviceId) -> String {
    format!("{PREFIX}/{fleet}/devices/{device}/receipts")
}
pub fn rejections(fleet: &FleetId, device: &DeviceId) -> String {
    format!("{PREFIX}/{fleet}/devices/{device}/rejections")
}
pub fn requests(fleet: &FleetId, device: &DeviceId) -> String {
    format!("{PREFIX}/{fleet}/devices/{device}/requests")
}
pub fn answers(fleet: &FleetId, device: &DeviceId) -> String {
    format!("{PREFIX}/{fleet}/devices/{device}/answers")
}

/// Filter for every device's status (registry, aggregator metrics).
pub fn all_status(fleet: &FleetId) -> String {
    format!("{PREFIX}/{fleet}/devices/+/status")
}
/// Filter for every device's upload frames (aggregator).
pub fn all_updates(fleet: &FleetId) -> String {
    format!("{PREFIX}/{fleet}/devices/+/updates")
}
/// Filter for every device's requests (aggregator).
pub fn all_requests(fleet: &FleetId) -> String {
    format!("{PREFIX}/{fleet}/devices/+/requests")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topics_round_trip_and_refuse_strangers() {
        let fleet = FleetId::new("demo").unwrap();
        let device = DeviceId::new("cam-1").unwrap();
        let all = [
            Topic::Rounds { fleet: fleet.clone() },
            Topic::Rollouts { fleet: fleet.clone() },
            Topic::Status { fleet: fleet.clone(), device: device.clone() },
            Topic::Updates { fleet: fleet.clone(), device: device.clone() },
            Topic::Receipts { fleet: fleet.clone(), device: device.clone() },
            Topic::Rejections { fleet: fleet.clone(), device: device.clone() },
            Topic::Requests { fleet: fleet.clone(), device: device.clone() },
            Topic::Answers { fleet: fleet.clone(), device: device.clone() },
        ];
        for t in all {
            assert_eq!(parse(&t.path()).unwrap(), t);
            let lossy = matches!(t, Topic::Requests { .. } | Topic::Answers { .. });
            assert_eq!(t.qos(), if lossy { QoS::AtMostOnce } else { QoS::AtLeastOnce });
        }
        assert_eq!(rounds(&fleet), "fedfleet/v1/demo/rounds");
        assert_eq!(status(&fleet, &device), "fedfleet/v1/demo/devices/cam-1/status");
        assert!(matches!(parse("fedfleet/v2/demo/rounds"), Err(TopicError::NotOurs(_))));
        assert!(matches!(parse("fedfleet/v1/demo/devices/+/status"), Err(TopicError::BadId(_))));
        assert!(matches!(parse("fedfleet/v1/demo/devices/a/other"), Err(TopicError::Unknown(_))));
        assert!(matches!(parse("fedfleet/v1/demo/rounds/x"), Err(TopicError::Unknown(_))));
        assert!(matches!(parse("fedfleet/v1//rounds"), Err(TopicError::BadId(_))));
    }

    #[test]
    fn devices_publish_only_their_own_topics_and_services_the_fleets() {
        use fedfleet_certs::PeerIdentity;
        let fleet = FleetId::new("demo").unwrap();
        let other = FleetId::new("other").unwrap();
        let me = DeviceId::new("cam-1").unwrap();
        let peer = DeviceId::new("cam-2").unwrap();
        let device = PeerIdentity::Device(me.clone());
        let service = PeerIdentity::Service("aggregator".into());
        let publishers = ["aggregator".to_owned(), "registry".to_owned()];
        let may_publish = |who: &PeerIdentity, fleet: &FleetId, topic: &str| may_publish(who, fleet, &publishers, topic);
        assert!(may_publish(&device, &fleet, &status(&fleet, &me)));
        assert!(may_publish(&device, &fleet, &updates(&fleet, &me)));
        assert!(may_publish(&device, &fleet, &requests(&fleet, &me)));
        for forbidden in [
            rounds(&fleet),
            rollouts(&fleet),
            status(&fleet, &peer),
            updates(&fleet, &peer),
            requests(&fleet, &peer),
            receipts(&fleet, &me),
            rejections(&fleet, &me),
            answers(&fleet, &me),
            status(&other, &me),
            "fedfleet/v1/demo/devices/cam-1/status/extra".into(),
            "fedfleet/v1/demo/#".into(),
            "elsewhere".into(),
        ] {
            assert!(!may_publish(&device, &fleet, &forbidden), "{forbidden}");
        }
        for topic in [rounds(&fleet), rollouts(&fleet), receipts(&fleet, &peer), status(&fleet, &peer)] {
            assert!(may_publish(&service, &fleet, &topic), "{topic}");
        }
        assert!(!may_publish(&service, &fleet, &rounds(&other)));
        assert!(!may_publish(&service, &fleet, "fedfleet/v1/demonstration/rounds"));
        // A service certificate that is not a publisher (an operator's) may publish nothing.
        assert!(!may_publish(&PeerIdentity::Service("operator".into()), &fleet, &rounds(&fleet)));

        for allowed in [rounds(&fleet), rollouts(&fleet), receipts(&fleet, &me), rejections(&fleet, &me), answers(&fleet, &me)] {
            assert!(may_subscribe(&device, &fleet, &allowed), "{allowed}");
        }
        for forbidden in [
            all_status(&fleet),
            all_updates(&fleet),
            all_requests(&fleet),
            receipts(&fleet, &peer),
            answers(&fleet, &peer),
            "#".into(),
            "fedfleet/v1/demo/#".into(),
        ] {
            assert!(!may_subscribe(&device, &fleet, &forbidden), "{forbidden}");
        }
        assert!(may_subscribe(&service, &fleet, &all_status(&fleet)));
        assert!(!may_subscribe(&service, &fleet, "#"));
    }
}
