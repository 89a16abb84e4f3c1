use crate::support::unix_ms;
use fedfleet_certs::{ALPN_V1, tls};
use fedfleet_protocol::{DeviceId, DeviceState, DeviceStatus, FleetId, RejectReason};
use fedfleet_registry::client::ClientError;
use fedfleet_registry::store::NewVersion;
use fedfleet_registry::wire::AdminRequest;

use crate::support::{Harness, bytes, deadline};

fn idle(dev: &str, fleet: &str) -> DeviceStatus {
    DeviceStatus {
        fleet: FleetId::new(fleet).unwrap(),
        device: DeviceId::new(dev).unwrap(),
        reported_at_unix_ms: unix_ms(),
        state: DeviceState::Idle,
        active: None,
        staged: None,
        rollout_id: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identities_are_enforced() {
    deadline(60, async {
        let h = Harness::start().await;
        h.publish("m", &bytes(20, 1000));

        // No client certificate: the handshake is refused; it shows on the first request.
        let mut anon = h.client(tls::anonymous_client_config(h.pki.ca(), &[ALPN_V1]).unwrap());
        anon.max_retries = 1;
        let e = anon.metadata(0).await.unwrap_err();
        assert!(e.is_transport(), "{e}");

        // A device cannot send operator commands; a non-operator service neither.
        let dev = h.device("dev-1");
        let e = dev.admin(AdminRequest::List).await.unwrap_err();
        assert!(matches!(e, ClientError::Denied(_)), "{e}");
        let intruder = h.client(h.service_tls("intruder"));
        assert!(matches!(intruder.admin(AdminRequest::List).await.unwrap_err(), ClientError::Denied(_)));
        // A service cannot report as a device or ask for an assignment.
        let op = h.client(h.service_tls("operator"));
        assert!(matches!(op.report(&idle("dev-1", "test-fleet")).await.unwrap_err(), ClientError::Denied(_)));
        assert!(matches!(op.assignment("m").await.unwrap_err(), ClientError::Denied(_)));
        // The operator can.
        let list = serde_json::to_value(op.admin(AdminRequest::List).await.unwrap()).unwrap();
        assert_eq!(list["models"][0]["name"], "m");

        // A device reporting as another device, or for another fleet, is refused by name.
        match dev.report(&idle("dev-2", "test-fleet")).await.unwrap_err() {
            ClientError::Rejected(r) => assert_eq!(r.reason, RejectReason::IdentityMismatch),
            e => panic!("{e}"),
        }
        match dev.report(&idle("dev-1", "other-fleet")).await.unwrap_err() {
            ClientError::Rejected(r) => assert_eq!(r.reason, RejectReason::WrongFleet),
            e => panic!("{e}"),
        }
        dev.report(&idle("dev-1", "test-fleet")).await.unwrap();

        // Unknown things are named as such.
        assert!(matches!(dev.manifest("nope", fedfleet_protocol::ModelVersion(1)).await.unwrap_err(), ClientError::NotFound(_)));

        // Revocation takes effect on the next handshake, named from the TLS alert.
        h.pki.revoke(&DeviceId::new("dev-1").unwrap(), "stolen").unwrap();
        let mut again = h.client(h.device_tls_no_enroll("dev-1"));
        again.max_retries = 1;
        match again.metadata(0).await.unwrap_err() {
            ClientError::Rejected(r) => assert_eq!(r.reason, RejectReason::Revoked, "{}", r.detail),
            e => panic!("expected a revoked refusal, got {e}"),
        }

        let m = h.reg.metrics();
        assert!(m.get("fedfleet_registry_rejections_total", "denied") >= 4);
        assert_eq!(m.get("fedfleet_registry_rejections_total", "identity_mismatch"), 1);
        h.stop().await;
    })
    .await;
}

/// A publish the registry refuses before reading its artifact keeps the registry's reason, though
/// the client's writes then fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_refused_before_its_artifact_is_read_names_the_reason() {
    deadline(60, async {
        let h = Harness::start().await;
        let intruder = h.client(h.service_tls("intruder"));
        // Far more than a stream's receive window (1.25 MB), so the writes outlast the refusal.
        let artifact = bytes(7, 8 << 20);
        let new = NewVersion {
            name: "m".into(),
            spec: serde_json::json!({"arch": "mlp"}).into(),
            parent: None,
            metrics: Default::default(),
            created_at_unix_ms: 1,
            publisher: String::new(),
            adapter: None,
        };
        match intruder.publish(AdminRequest::Publish(new), &artifact[..]).await.unwrap_err() {
            ClientError::Denied(d) => assert!(d.contains("intruder is not an operator"), "{d}"),
            e => panic!("expected the registry's denial, got {e}"),
        }
        let op = h.client(h.service_tls("operator"));
        let list = serde_json::to_value(op.admin(AdminRequest::List).await.unwrap()).unwrap();
        assert_eq!(list["models"], serde_json::json!([]), "nothing published: {list}");
        h.stop().await;
    })
    .await;
}
