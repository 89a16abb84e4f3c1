//! Defect 14 of issue 31: unfinished, unauthenticated QUIC handshakes must not hold what
//! devices and operators need.

use std::sync::Arc;
use std::time::Duration;

use fedfleet_aggregator::client::UploadOutcome;
use fedfleet_aggregator::wire::{CampaignOverrides, Request};
use fedfleet_protocol::{DType, RoundAnnouncement, RoundId};

use crate::support::*;

/// A QUIC client endpoint whose handshakes never finish: its datagrams reach the service from
/// 127.0.0.2 through a one-way relay, and nothing the service answers comes back. Returns the
/// handshakes started (kept alive so the client does not close them).
async fn start_unfinished_handshakes(service: std::net::SocketAddr, n: usize) -> (quinn::Endpoint, Vec<quinn::Connecting>) {
    let relay_in = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
    let relay_addr = relay_in.local_addr().unwrap();
    let flood = tokio::net::UdpSocket::bind("127.0.0.2:0").await.unwrap();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65536];
        while let Ok((len, _)) = relay_in.recv_from(&mut buf).await {
            let _ = flood.send_to(&buf[..len], service).await;
        }
    });
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let mut tls = tls;
    tls.alpn_protocols = vec![fedfleet_certs::ALPN_V1.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
    let cfg = quinn::ClientConfig::new(Arc::new(crypto));
    let ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    let pending = (0..n).map(|_| ep.connect_with(cfg.clone(), relay_addr, "localhost").unwrap()).collect();
    (ep, pending)
}

/// More unfinished handshakes than the old 1,024-connection limit, from one source, while an
/// operator starts a campaign and reads its status and a device uploads: both are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfinished_handshakes_do_not_lock_out_operators_or_devices() {
    let fleet = Fleet::new(2);
    let svc = start(fleet.config("agg", 100, 1)).await;
    let addr = svc.addr;
    let (_flood_endpoint, _pending) = start_unfinished_handshakes(addr, 1100).await;
    // Let the flood's Initial packets reach the service (and its retransmissions go on).
    tokio::time::sleep(Duration::from_secs(3)).await;

    let op = tokio::time::timeout(Duration::from_secs(10), fleet.operator(addr)).await.expect("operator connected in time");
    let st = op.campaign(Request::CampaignStart(CampaignOverrides { seed: Some(1), ..Default::default() })).await.unwrap();
    assert_eq!(st.open_round, Some(RoundId(1)));
    let d = tokio::time::timeout(Duration::from_secs(10), fleet.device_client(0, addr)).await.expect("device connected in time");
    let info = d.current_round().await.unwrap();
    let ann: RoundAnnouncement = info.announcement.expect("open round").verify(&info.receipt_key).unwrap().clone();
    let payload = delta(1).encode();
    let h = header(&fleet.fleet, &dev(0), ann.round, ann.base_model.digest, nonce(0, 1), 10, &payload, DType::F32, &fleet.device_key(0));
    assert!(matches!(d.upload(&h, &payload).await.unwrap(), UploadOutcome::Accepted(_)));
    assert_eq!(op.campaign(Request::CampaignStatus).await.unwrap().accepted, 1);
    svc.stop().await;
}

/// Issue 27: with `operator_listen`, operators have a socket of their own. While a flood of
/// unfinished handshakes fills the fleet's address, `campaign status` is answered there at once;
/// a device that connects there is refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_have_an_address_of_their_own_which_devices_are_refused_at() {
    let fleet = Fleet::new(2);
    let mut cfg = fleet.config("agg", 100, 1);
    cfg.operator_listen = Some("127.0.0.1:0".parse().unwrap());
    let svc = start(cfg).await;
    let operators = svc.operator_addr.expect("operator_listen is bound");
    assert_ne!(operators, svc.addr);
    let (_flood_endpoint, _pending) = start_unfinished_handshakes(svc.addr, 1100).await;
    tokio::time::sleep(Duration::from_secs(3)).await;

    let op = tokio::time::timeout(Duration::from_secs(5), fleet.operator(operators)).await.expect("operator connected in time");
    let st = op.campaign(Request::CampaignStart(CampaignOverrides { seed: Some(1), ..Default::default() })).await.unwrap();
    assert_eq!(st.open_round, Some(RoundId(1)));
    let d = fleet.device_client(0, operators).await;
    let refused = d.current_round().await.expect_err("a device is not served on the operators' address");
    assert!(refused.to_string().contains("not_permitted"), "{refused}");
    assert_eq!(op.campaign(Request::CampaignStatus).await.unwrap().open_round, Some(RoundId(1)));
    svc.stop().await;
}

/// Issue 27: more devices upload at once than the bytes-in-flight budget takes. Those past it
/// are told `overloaded` with a retry-after before their payload is read; each resends after a
/// jittered pause, and every update gets in exactly once (the round closes at its target) while
/// the operator's status calls are answered throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_past_the_bytes_in_flight_get_in_after_backing_off_and_the_operator_is_answered() {
    const N: usize = 24;
    let fleet = Fleet::new(N);
    let mut cfg = fleet.config("bytes", N as u32, 1);
    let payload_len = delta(0).encode().len() as u64;
    // Room for about two payloads at once.
    cfg.admission.max_bytes_in_flight = 2 * payload_len;
    cfg.admission.retry_after_ms = 20;
    let svc = start(cfg).await;
    let addr = svc.addr;
    let op = fleet.operator(addr).await;
    op.campaign(Request::CampaignStart(CampaignOverrides { seed: Some(3), ..Default::default() })).await.unwrap();
    let info = fleet.device_client(0, addr).await.current_round().await.unwrap();
    let ann: RoundAnnouncement = info.announcement.expect("open round").verify(&info.receipt_key).unwrap().clone();

    let mut uploads = tokio::task::JoinSet::new();
    for i in 0..N {
        let d = fleet.device_client(i, addr).await;
        let payload = delta(i as u64).encode();
        let h =
            header(&fleet.fleet, &dev(i), ann.round, ann.base_model.digest, nonce(i, 1), 10, &payload, DType::F32, &fleet.device_key(i));
        uploads.spawn(async move {
            let mut overloaded = 0u32;
            loop {
                match d.upload(&h, &payload).await.unwrap() {
                    UploadOutcome::Accepted(_) => return overloaded,
                    UploadOutcome::Rejected(r) if r.reason == fedfleet_protocol::RejectReason::Overloaded => {
                        assert!(r.detail.contains("retry after 20 ms"), "{}", r.detail);
                        overloaded += 1;
                        // Jitter: devices do not come back in lockstep.
                        tokio::time::sleep(Duration::from_millis(20 + (i as u64 * 7) % 23)).await;
                    }
                    UploadOutcome::Rejected(r) => panic!("device {i}: {r:?}"),
                }
            }
        });
    }
    // The operator is answered while the uploads contend.
    let mut retried = 0;
    let mut answered = 0;
    while !uploads.is_empty() && answered < 1000 {
        let st =
            tokio::time::timeout(Duration::from_secs(5), op.campaign(Request::CampaignStatus)).await.expect("operator answered").unwrap();
        assert!(st.campaign.is_some() || st.last_outcome.as_deref() == Some("completed"));
        answered += 1;
        while let Some(r) = uploads.try_join_next() {
            retried += r.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    while let Some(r) = uploads.join_next().await {
        retried += r.unwrap();
    }
    // Every update counted once: the round closed at its target of N.
    let m = svc.agg.metrics();
    assert_eq!(
        m.render().lines().find(|l| l.starts_with("fedfleet_aggregator_updates_accepted_total")),
        Some(format!("fedfleet_aggregator_updates_accepted_total {N}").as_str())
    );
    assert_eq!(u64::from(retried), m.rejected_count(fedfleet_protocol::RejectReason::Overloaded));
    assert!(retried > 0, "the budget never bound: nothing was tested");
    svc.stop().await;
}

/// Issue 27: a device past the device connections is turned away after its handshake with the
/// named `overloaded` refusal and its retry-after (not a bare "connection lost"), which the
/// agent's upload retry reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_past_the_connection_pool_is_told_overloaded_with_a_retry_after() {
    let fleet = Fleet::new(2);
    let mut cfg = fleet.config("pool", 2, 1);
    cfg.admission.max_connections = 1;
    cfg.admission.retry_after_ms = 1_500;
    let svc = start(cfg).await;
    let holder = fleet.device_client(0, svc.addr).await;
    holder.current_round().await.unwrap();
    let turned_away = fleet.device_client(1, svc.addr).await;
    match turned_away.current_round().await {
        Err(fedfleet_aggregator::client::ClientError::Refused(r)) => {
            assert_eq!(r.reason, fedfleet_protocol::RejectReason::Overloaded, "{r:?}");
            assert_eq!(fedfleet_protocol::reject::retry_after_ms(&r.detail), Some(1_500), "{}", r.detail);
        }
        other => panic!("expected an overloaded refusal, got {other:?}"),
    }
    // Once the holder lets go, the other device gets in.
    drop(holder);
    let mut answered = false;
    for _ in 0..50 {
        if fleet.device_client(1, svc.addr).await.current_round().await.is_ok() {
            answered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(answered, "the freed slot was never taken");
    svc.stop().await;
}
