use crate::support::unix_ms;
use fedfleet_protocol::{DeviceId, DeviceState, DeviceStatus, FleetId, ModelRef};
use fedfleet_registry::client::RegistryClient;
use fedfleet_registry::rollout::{Phase, Reason};
use fedfleet_registry::tuf::Root;
use fedfleet_registry::wire::{AdminRequest, AssignmentBody, AssignmentError, AssignmentSource, RolloutCommand, RolloutStart};

use crate::support::{Harness, bytes, deadline, v};

fn status(dev: &str, state: DeviceState, staged: Option<ModelRef>) -> DeviceStatus {
    DeviceStatus {
        fleet: FleetId::new("test-fleet").unwrap(),
        device: DeviceId::new(dev).unwrap(),
        reported_at_unix_ms: unix_ms(),
        state,
        active: None,
        staged,
        rollout_id: None,
    }
}

/// `device`'s assignment of model `m`, verified against `root`.
async fn assigned(c: &RegistryClient, root: &Root, device: &DeviceId) -> AssignmentBody {
    c.assignment("m").await.unwrap().verify(root, device, unix_ms()).unwrap()
}

/// The operator's view of rollout `id`.
async fn rollout_status(op: &RegistryClient, id: &str) -> serde_json::Value {
    serde_json::to_value(op.admin(AdminRequest::RolloutStatus { id: Some(id.into()) }).await.unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_assignments_follow_the_rollout() {
    deadline(60, async {
        let h = Harness::start().await;
        let m1 = h.publish("m", &bytes(10, 100_000));
        let m2 = h.publish("m", &bytes(11, 100_000));
        let root = h.root();
        let op = h.client(h.service_tls("operator"));
        let a = h.device("dev-a");
        let b = h.device("dev-b");
        let (ida, idb) = (DeviceId::new("dev-a").unwrap(), DeviceId::new("dev-b").unwrap());

        // Nothing aliased yet.
        let body = assigned(&a, &root, &ida).await;
        assert_eq!((body.target, body.source), (None, AssignmentSource::Nothing));

        op.admin(AdminRequest::AliasSet { name: "m".into(), alias: "stable".into(), version: v(1) }).await.unwrap();
        let body = assigned(&a, &root, &ida).await;
        assert_eq!(body.target.as_ref().map(|t| t.version), Some(v(1)));
        assert_eq!(body.target.as_ref().unwrap().digest, m1.model.digest);
        assert_eq!(body.length, Some(100_000));
        let notice = body.to_notice().unwrap();
        assert_eq!(notice.model.version, v(1));

        // A rollout: cohort [dev-a] first (soaks an hour), then everyone.
        let out = op
            .admin(AdminRequest::RolloutStart(RolloutStart {
                id: Some("r1".into()),
                model: "m".into(),
                alias: "stable".into(),
                target: v(2),
                phases: vec![Phase::cohort("canary", [ida.clone()], 3_600_000), Phase::percent(100.0, 0)],
                failure_threshold: 0.0,
                min_sample: 1,
            }))
            .await
            .unwrap();
        let fedfleet_registry_client::admin::AdminAnswer::Rollout(out) = out else { panic!("{out:?}") };
        assert_eq!(out.summary.status, fedfleet_rollout::Status::Running);
        let sa = a.assignment("m").await.unwrap();
        let body = sa.verify(&root, &ida, unix_ms()).unwrap();
        assert_eq!(body.target.as_ref().map(|t| (t.version, t.digest)), Some((v(2), m2.model.digest)));
        assert_eq!(body.source, AssignmentSource::Rollout { id: "r1".into(), reason: Reason::InRollout { phase: 0 } });
        let bb = assigned(&b, &root, &idb).await;
        assert_eq!(bb.target.map(|t| t.version), Some(v(1)));

        // Signed for dev-a only, by the timestamp key, and it expires.
        assert!(matches!(sa.verify(&root, &idb, unix_ms()), Err(AssignmentError::WrongDevice { .. })));
        assert!(matches!(sa.verify(&root, &ida, body.expires_unix_ms), Err(AssignmentError::Expired { .. })));
        let mut forged = sa.clone();
        let n = forged.body.len();
        forged.body[n - 3] ^= 1;
        assert!(matches!(forged.verify(&root, &ida, unix_ms()), Err(AssignmentError::UnderThreshold { .. })));

        let r2 = ModelRef { name: "m".into(), version: v(2), digest: m2.model.digest };
        // dev-a's disk is full: a deferred install is recorded, but it is no verdict on v2 (the
        // rollout runs on, nothing failed) and dev-a stays assigned v2, to retry.
        a.report(&status(
            "dev-a",
            DeviceState::InstallDeferred { fault: fedfleet_protocol::StorageFault::DiskFull, detail: "no space left on device".into() },
            Some(r2.clone()),
        ))
        .await
        .unwrap();
        let st = rollout_status(&op, "r1").await;
        assert_eq!((st["status"].as_str(), st["failed"].as_u64()), (Some("running"), Some(0)), "{st}");
        let body = assigned(&a, &root, &ida).await;
        assert_eq!(body.target.map(|t| t.version), Some(v(2)));

        // dev-a fails the health check: the failure rate (1/1) passes the threshold → auto-abort.
        a.report(&status("dev-a", DeviceState::Downloaded, Some(r2.clone()))).await.unwrap();
        a.report(&status("dev-a", DeviceState::Failed { reason: "nan in outputs".into() }, Some(r2.clone()))).await.unwrap();
        let st = rollout_status(&op, "r1").await;
        assert_eq!(st["status"], "aborted", "{st}");
        assert_eq!(st["failed"], 1);
        let body = assigned(&a, &root, &ida).await;
        assert_eq!(body.target.map(|t| t.version), Some(v(1)));
        assert_eq!(h.reg.metrics().get("fedfleet_registry_rollout_events_total", "auto_aborted"), 1);
        // Grafana's rollout panels: its phase, its devices by outcome, its failure rate, its status.
        let text = h.reg.metrics().render();
        for line in [
            "fedfleet_registry_rollout_phase{rollout=\"r1\"} 0",
            "fedfleet_registry_rollout_phases{rollout=\"r1\"} 2",
            "fedfleet_registry_rollout_devices{rollout=\"r1\",outcome=\"failed\"} 1",
            "fedfleet_registry_rollout_devices{rollout=\"r1\",outcome=\"healthy\"} 0",
            "fedfleet_registry_rollout_failure_rate{rollout=\"r1\"} 1.0",
            "fedfleet_registry_rollout_status{rollout=\"r1\",status=\"aborted\"} 1",
            "fedfleet_registry_rollout_status{rollout=\"r1\",status=\"running\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }

        // Operator views.
        let dev = serde_json::to_value(op.admin(AdminRequest::DeviceStatus { device: Some("dev-a".into()) }).await.unwrap()).unwrap();
        assert_eq!(dev["report"]["state"], "failed");
        assert_eq!(dev["report"]["reason"], "nan in outputs");
        let e = op.admin(AdminRequest::Rollout { id: "r1".into(), command: RolloutCommand::Pause }).await.unwrap_err();
        assert!(e.to_string().contains("cannot pause"), "{e}");

        // A second rollout that completes moves the alias; rollback moves it back.
        op.admin(AdminRequest::RolloutStart(RolloutStart {
            id: Some("r2".into()),
            model: "m".into(),
            alias: "stable".into(),
            target: v(2),
            phases: vec![Phase::percent(100.0, 0)],
            failure_threshold: 0.5,
            min_sample: 5,
        }))
        .await
        .unwrap();
        // No soak, but no evidence yet either: the alias stays until a device runs v2 healthy.
        assert_eq!(h.reg.store().alias("m", "stable").unwrap(), Some(v(1)));
        let mut healthy = status("dev-b", DeviceState::Healthy, None);
        healthy.active = Some(r2.clone());
        b.report(&healthy).await.unwrap();
        let t0 = std::time::Instant::now();
        while h.reg.store().alias("m", "stable").unwrap() != Some(v(2)) {
            assert!(t0.elapsed() < std::time::Duration::from_secs(20), "the alias did not move after a healthy report");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let bb = assigned(&b, &root, &idb).await;
        assert_eq!(bb.target.map(|t| t.version), Some(v(2)));
        op.admin(AdminRequest::Rollout { id: "r2".into(), command: RolloutCommand::Rollback }).await.unwrap();
        assert_eq!(h.reg.store().alias("m", "stable").unwrap(), Some(v(1)));
        h.stop().await;
    })
    .await;
}
