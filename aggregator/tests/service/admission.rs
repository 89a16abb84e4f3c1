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
    // The flood was turned away and counted, not served.
    assert!(svc.agg.metrics().rejected_count(fedfleet_protocol::RejectReason::Overloaded) > 0);
    svc.stop().await;
}
