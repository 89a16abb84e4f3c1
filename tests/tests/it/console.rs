//! The operator console in a real deployment (`init-local`: registry, aggregator and agents as
//! processes). One test opens every page in headless Chromium (Debian's `chromium` and
//! `chromium-driver`, driven over WebDriver with fantoccini) and checks that the numbers on the
//! page are the API's, and that the rollout page's Pause button pauses the rollout in the
//! registry. Another checks access: refusals (401/403) and actions are audited with who asked.
//!
//! `FEDFLEET_CONSOLE_SCREENSHOTS=DIR` writes a screenshot of each view into DIR (how
//! `docs/console/*.png` were made).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fantoccini::{ClientBuilder, Locator};
use serde_json::{Value, json};

use crate::deployment::Deployment;

/// Debian's chromedriver, or `None` (a skip, except under CI where `.ci/run` installs it).
fn chromedriver() -> Option<PathBuf> {
    let found = ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"].iter().map(PathBuf::from).find(|p| p.is_file());
    if found.is_none() {
        assert!(std::env::var_os("CI").is_none(), "chromedriver is missing (apt-get install chromium chromium-driver)");
        eprintln!("skipping: chromedriver not installed (apt-get install chromium chromium-driver)");
    }
    found
}

/// A child process killed on drop.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn consoles(d: &Deployment) -> (SocketAddr, SocketAddr) {
    let ip = [127, 0, 0, 1];
    ((ip, d.base_port + 4).into(), (ip, d.base_port + 5).into())
}

async fn get(addr: SocketAddr, path: &str) -> Value {
    let (status, body) =
        fedfleet_http::send(addr, &fedfleet_http::ClientRequest { method: "GET", path, ..Default::default() }).await.unwrap();
    assert_eq!(status, 200, "GET {path}: {}", String::from_utf8_lossy(&body));
    serde_json::from_slice(&body).unwrap()
}

async fn wait_until<T>(what: &str, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The page's text of `#id` once the view `view` has rendered.
async fn text(c: &fantoccini::Client, id: &str) -> Option<String> {
    let e = c.find(Locator::Id(id)).await.ok()?;
    e.text().await.ok()
}

async fn open(c: &fantoccini::Client, url: &str, view: &str) {
    c.goto(url).await.unwrap();
    c.wait().at_most(Duration::from_secs(20)).for_element(Locator::Css(&format!("body[data-loaded='{view}']"))).await.unwrap();
}

async fn screenshot(c: &fantoccini::Client, name: &str) {
    let png = c.screenshot().await.unwrap();
    assert!(png.starts_with(b"\x89PNG"), "{name}: not a PNG");
    if let Some(dir) = std::env::var_os("FEDFLEET_CONSOLE_SCREENSHOTS") {
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(PathBuf::from(dir).join(format!("{name}.png")), png).unwrap();
    }
}

#[test]
fn console_pages_show_the_apis_numbers_and_pause_a_rollout_in_the_registry() {
    let Some(driver) = chromedriver() else { return };
    let mut d = Deployment::init(3);
    d.set("aggregator.toml", "rounds", "2");
    // The promotion gate: round 1's model becomes stable (no champion yet); round 2's must beat
    // it by 50 points of accuracy, which it cannot: it stays a candidate.
    d.append("aggregator.toml", "[promotion]\nmetric = \"accuracy\"\nmargin = 0.5\n");
    d.start("fedfleet-agent");
    d.cli("fedfleet-aggregator", &["campaign", "start", "--config", "aggregator.toml", "--wait"]);
    // The operator overrides the gate by hand: v3 (the second round's model) to the `canary`
    // cohort (agent-1) first; the phase soaks an hour, so the rollout is still running when the
    // page pauses it.
    let rollout = ["--config", "registry.toml", "rollout", "start", "--model", "digits", "--version", "3", "--id", "console-test"];
    let phases = ["--cohort", "canary=agent-1", "--phases", "50,100", "--soak", "1h", "--min-healthy", "1"];
    d.cli("fedfleet-registry", &[&rollout[..], &phases].concat());
    let (registry, aggregator) = consoles(&d);

    let port = crate::procs::free_tcp_port();
    let log = std::fs::File::create(d.log("chromedriver")).unwrap();
    let _driver = Child(
        std::process::Command::new(driver)
            .arg(format!("--port={port}"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start chromedriver"),
    );
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            json!({"binary": "/usr/bin/chromium", "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,900"]}),
        );
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        let c = wait_until("chromedriver", async || {
            ClientBuilder::new(connector.clone()).capabilities(caps.clone()).connect(&format!("http://127.0.0.1:{port}")).await.ok()
        })
        .await;

        // Campaign: rounds completed and the last round's accuracy, as the API says.
        let status = get(aggregator, "/api/v1/campaign").await;
        // The campaign finished: the status names no running campaign, the history its rounds.
        assert_eq!((&status["rounds_completed"], &status["history"]["rounds_published"]), (&Value::Null, &json!(2)), "{status}");
        let rounds = get(aggregator, "/api/v1/rounds").await;
        let last = &rounds["rounds"][0];
        assert_eq!(last["outcome"], json!("published"), "{rounds}");
        let accuracy = last["metrics"]["accuracy"].as_f64().expect("the last round was evaluated");
        assert!(accuracy > 0.5, "{rounds}");
        open(&c, &format!("http://{aggregator}/#campaign"), "campaign").await;
        assert_eq!(text(&c, "rounds-completed").await.unwrap(), "2");
        assert_eq!(text(&c, "last-accuracy").await.unwrap(), format!("{:.2} %", accuracy * 100.0));
        assert_eq!(text(&c, "global-version").await.unwrap(), "v3");
        screenshot(&c, "campaign").await;

        // Fleet: devices per version, page against API (both move while agents install v3:
        // wait until the page shows what the API says at the same moment).
        open(&c, &format!("http://{registry}/#fleet"), "fleet").await;
        let shown = wait_until("the fleet page to match the API", async || {
            let api = get(registry, "/api/v1/devices").await;
            let by_version = api["by_version"].as_object().unwrap().clone();
            let total: u64 = by_version.values().filter_map(Value::as_u64).sum();
            if total < 3 || !by_version.contains_key("v3") {
                return None;
            }
            for (version, n) in &by_version {
                if text(&c, &format!("devices-on-{version}")).await?.parse::<u64>().ok() != n.as_u64() {
                    return None;
                }
            }
            Some(by_version)
        })
        .await;
        eprintln!("devices by version, page = API: {shown:?}");
        // The rollout's cohort, on the device it names: in the API (and its filter) and the page.
        let canary = get(registry, "/api/v1/devices?cohort=canary").await;
        let named: Vec<&Value> = canary["devices"].as_array().unwrap().iter().map(|d| &d["device"]).collect();
        assert_eq!(named, [&json!("agent-1")], "{canary}");
        assert!(text(&c, "devices").await.unwrap().contains("canary"), "the fleet table shows the cohort");
        screenshot(&c, "fleet").await;

        // The gate: v2 promoted to stable, v3 a candidate, on the page as in the API.
        let models = get(registry, "/api/v1/models").await;
        let digits = &models["models"][0];
        assert_eq!(digits["aliases"]["stable"], json!(2), "the gate moved stable to round 1's model: {models}");
        assert_eq!(digits["versions"][2]["metrics"]["gate_passed"], json!(0.0), "{models}");
        assert_eq!(digits["versions"][1]["metrics"]["gate_passed"], json!(1.0), "{models}");
        assert!(rounds["rounds"][0]["promotion"].as_str().unwrap().starts_with("candidate: accuracy"), "{rounds}");
        open(&c, &format!("http://{registry}/#versions"), "versions").await;
        assert!(text(&c, "gate-digits-3").await.unwrap().starts_with("candidate vs v2"));
        assert!(text(&c, "gate-digits-2").await.unwrap().starts_with("promoted vs none"));
        screenshot(&c, "versions").await;

        // Rollouts: the phase as the API says; Pause pauses it in the registry.
        let rollout = get(registry, "/api/v1/rollouts/console-test").await;
        assert_eq!(rollout["status"], json!("running"), "{rollout}");
        open(&c, &format!("http://{registry}/#rollouts"), "rollouts").await;
        let phase = (rollout["phase"].as_u64().unwrap() + 1).to_string();
        assert_eq!(text(&c, "rollout-console-test-phase").await.unwrap(), phase);
        assert_eq!(text(&c, "rollout-console-test-status").await.unwrap(), "running");
        screenshot(&c, "rollouts").await;
        wait_until("a click on Pause", async || c.find(Locator::Id("rollout-console-test-pause")).await.ok()?.click().await.ok()).await;
        wait_until("the registry to pause the rollout", async || {
            (get(registry, "/api/v1/rollouts/console-test").await["status"] == json!("paused")).then_some(())
        })
        .await;
        wait_until("the page to show it paused", async || (text(&c, "rollout-console-test-status").await? == "paused").then_some(())).await;
        let audit = get(registry, "/api/v1/audit").await;
        let entry = audit["entries"].as_array().unwrap().iter().find(|e| e["action"] == json!("POST /api/v1/rollouts/console-test/pause"));
        let entry = entry.unwrap_or_else(|| panic!("the pause is not audited: {audit}"));
        assert_eq!((entry["identity"].as_str(), entry["status"].as_u64()), (Some("loopback"), Some(200)), "{entry}");
        c.close().await.unwrap();
    });
    d.stop_agents();
}

/// An HTTPS request with `who`'s credentials: a bearer token, or a client certificate config.
async fn call(
    addr: SocketAddr,
    tls: &Arc<rustls::ClientConfig>,
    method: &str,
    path: &str,
    bearer: Option<&str>,
    body: Option<Value>,
) -> (u16, Value) {
    let r = fedfleet_http::ClientRequest {
        method,
        path,
        bearer,
        json: body.map(|b| serde_json::to_vec(&b).unwrap()),
        octets: None,
        tls: Some((tls.clone(), "localhost".into())),
    };
    let (status, body) = fedfleet_http::send(addr, &r).await.unwrap();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

#[test]
fn console_refusals_and_actions_are_audited_with_who_asked() {
    let mut d = Deployment::init(1);
    // The operator's token is in the file only as its hash.
    let ops_hash = fedfleet_protocol::Digest::of(b"ops-token-0123456789abc").to_hex(); // BLAKE3
    let tokens = format!(
        "[[token]]\nname = \"viewer\"\nrole = \"reader\"\ntoken = \"viewer-token-0123456789\"\n\n\
         [[token]]\nname = \"ops\"\nrole = \"operator\"\ntoken_blake3 = \"{ops_hash}\"\n"
    );
    std::fs::write(d.path("console-tokens.toml"), tokens).unwrap();
    // Both consoles over HTTPS, and loopback callers treated like remote ones (credentials needed).
    for file in ["registry.toml", "aggregator.toml"] {
        let text = std::fs::read_to_string(d.path(file)).unwrap();
        std::fs::write(d.path(file), format!("{text}tls = true\nloopback = \"none\"\ntokens = \"console-tokens.toml\"\n")).unwrap();
    }
    d.start_services();
    let (registry, aggregator) = consoles(&d);
    let pki = fedfleet_certs::Pki::open(d.path("pki")).unwrap();
    let anonymous = Arc::new(fedfleet_certs::tls::anonymous_client_config(pki.ca(), &[]).unwrap());
    let device = fedfleet_certs::DeviceIdentity::load(d.path("pki"), &fedfleet_protocol::DeviceId::new("agent-1").unwrap()).unwrap();
    let device = Arc::new(fedfleet_certs::tls::client_config(pki.ca(), &device, &[]).unwrap());
    let operator = fedfleet_certs::ServerIdentity::load(d.path("pki"), "operator").unwrap();
    let operator = Arc::new(fedfleet_certs::tls::service_client_config(pki.ca(), &operator, &[]).unwrap());

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        wait_until("the registry console", async || {
            tokio::net::TcpStream::connect(registry).await.ok()?;
            tokio::net::TcpStream::connect(aggregator).await.ok()
        })
        .await;
        // No credentials: 401. A reader's action: 403. A device certificate: 403.
        let (status, body) = call(registry, &anonymous, "GET", "/api/v1/rollouts", None, None).await;
        assert_eq!(status, 401, "{body}");
        let (status, body) = call(registry, &anonymous, "POST", "/api/v1/rollouts/any/pause", Some("viewer-token-0123456789"), None).await;
        assert_eq!(status, 403, "{body}");
        let (status, body) = call(registry, &anonymous, "GET", "/api/v1/rollouts", Some("viewer-token-0123456789"), None).await;
        assert_eq!((status, body["rollouts"].is_array()), (200, true), "a reader reads: {body}");
        let (status, body) = call(registry, &device, "GET", "/api/v1/devices", None, None).await;
        assert_eq!(status, 403, "{body}");
        assert!(body["error"].as_str().unwrap().contains("device certificate"), "{body}");
        let (status, _) = call(registry, &anonymous, "GET", "/api/v1/rollouts", Some("not-a-token-at-all-00000"), None).await;
        assert_eq!(status, 401);

        // An operator's action (client certificate of a service in `operators`), audited by name.
        let (status, body) = call(aggregator, &operator, "POST", "/api/v1/campaign/start", None, Some(json!({"rounds": 1}))).await;
        assert_eq!(status, 200, "{body}");
        assert!(body["campaign"].is_u64(), "{body}");
        let (status, body) = call(aggregator, &anonymous, "GET", "/api/v1/audit", Some("ops-token-0123456789abc"), None).await;
        assert_eq!(status, 200, "{body}");
        let entries = body["entries"].as_array().unwrap();
        assert!(
            entries.iter().any(|e| e["identity"] == json!("cert:operator")
                && e["action"] == json!("POST /api/v1/campaign/start")
                && e["status"] == json!(200)),
            "{body}"
        );

        let (status, body) = call(registry, &anonymous, "GET", "/api/v1/audit", Some("ops-token-0123456789abc"), None).await;
        assert_eq!(status, 200, "{body}");
        let entries = body["entries"].as_array().unwrap();
        let audited = |who: &str, action: &str, code: u64| {
            entries.iter().any(|e| e["identity"] == json!(who) && e["action"] == json!(action) && e["status"] == json!(code))
        };
        assert!(audited("anonymous", "GET /api/v1/rollouts", 401), "{body}");
        assert!(audited("token:viewer", "POST /api/v1/rollouts/any/pause", 403), "{body}");
        assert!(audited("device:agent-1", "GET /api/v1/devices", 403), "{body}");
        assert!(audited("token:unknown", "GET /api/v1/rollouts", 401), "{body}");
        // The reader's read is no action: not in the journal.
        assert!(!audited("token:viewer", "GET /api/v1/rollouts", 200), "{body}");

        // The OpenAPI document lists what the router serves.
        let (status, doc) = call(registry, &anonymous, "GET", "/api/v1/openapi.json", Some("viewer-token-0123456789"), None).await;
        assert_eq!(status, 200);
        for path in ["/api/v1/devices", "/api/v1/rollouts/{id}/pause", "/api/v1/models/{name}/versions/{version}"] {
            assert!(doc["paths"][path].is_object(), "{path} is not in the document: {doc}");
        }
    });
}

/// This machine's address on a non-loopback interface (the one a packet to TEST-NET-1 would leave
/// from; nothing is sent), or `None` on a machine without a route.
fn non_loopback_ip() -> Option<std::net::IpAddr> {
    let socket = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    socket.connect("192.0.2.1:9").ok()?;
    Some(socket.local_addr().ok()?.ip()).filter(|ip| !ip.is_loopback() && !ip.is_unspecified())
}

/// A console listening on every interface, reached from this machine's non-loopback address: a
/// caller without credentials is refused (and audited with that address) although loopback
/// callers are operators here by default, and the operator CLI gets in from there with its
/// certificate; the CLI's publish, device status and revoke go through the API.
#[test]
fn a_console_reached_from_another_address_asks_for_credentials_and_the_cli_gets_in() {
    let Some(ip) = non_loopback_ip() else {
        eprintln!("skipping: this machine has no non-loopback address to call from");
        return;
    };
    let mut d = Deployment::init(1);
    let (registry, _) = consoles(&d);
    let text = std::fs::read_to_string(d.path("registry.toml")).unwrap();
    let wide = text.replace(&format!("listen = \"{registry}\""), &format!("listen = \"0.0.0.0:{}\"\ntls = true", registry.port()));
    assert_ne!(wide, text, "the registry's [console] listen line");
    std::fs::write(d.path("registry.toml"), wide).unwrap();
    d.start_services();
    let remote = SocketAddr::new(ip, registry.port());
    let pki = fedfleet_certs::Pki::open(d.path("pki")).unwrap();
    let anonymous = Arc::new(fedfleet_certs::tls::anonymous_client_config(pki.ca(), &[]).unwrap());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        wait_until("the registry console", async || tokio::net::TcpStream::connect(remote).await.ok()).await;
        let (status, body) = call(remote, &anonymous, "GET", "/api/v1/devices", None, None).await;
        assert_eq!(status, 401, "no credentials from {ip}: {body}");
        let (status, body) = call(registry, &anonymous, "GET", "/api/v1/devices", None, None).await;
        assert_eq!(status, 200, "loopback is an operator by default: {body}");
    });

    // The operator CLI from the non-loopback address: HTTPS with its certificate.
    let addr = remote.to_string();
    let registry_cli = |args: &[&str]| {
        let mut all = vec!["--config", "registry.toml", "--addr", &addr];
        all.extend_from_slice(args);
        d.cli("fedfleet-registry", &all)
    };
    std::fs::write(d.path("spec.json"), r#"{"arch":"mlp","input":[64],"hidden":[64],"classes":10}"#).unwrap();
    let published = registry_cli(&[
        "publish",
        "aggregator/initial.safetensors",
        "--model",
        "digits",
        "--spec",
        "spec.json",
        "--metrics",
        "accuracy=0.5",
    ]);
    assert!(published.starts_with("published digits v"), "{published}");
    let listed = registry_cli(&["--json", "list"]);
    assert!(listed.contains("\"digits\""), "{listed}");
    let shown: Value = serde_json::from_str(&registry_cli(&["--json", "show", "digits"])).unwrap();
    assert_eq!(shown["metrics"]["accuracy"], json!(0.5), "{shown}");
    let revoked = registry_cli(&["device", "revoke", "agent-1", "--reason", "lost"]);
    assert!(revoked.starts_with("revoked device agent-1"), "{revoked}");
    let list = std::fs::read_to_string(d.path("pki/revoked.json")).unwrap();
    assert!(list.contains("agent-1") && list.contains("lost"), "the CA-signed list names the device: {list}");
    let again = std::process::Command::new(crate::procs::bin("fedfleet-registry"))
        .args(["--config", "registry.toml", "--addr", &addr, "device", "revoke", "agent-1"])
        .current_dir(d.path(""))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(!again.status.success() && err.contains("409") && err.contains("on the revocation list"), "{err}");
    rt.block_on(async {
        let operator = fedfleet_certs::ServerIdentity::load(d.path("pki"), "operator").unwrap();
        let operator = Arc::new(fedfleet_certs::tls::service_client_config(pki.ca(), &operator, &[]).unwrap());
        let (status, body) = call(remote, &operator, "GET", "/api/v1/audit", None, None).await;
        assert_eq!(status, 200, "{body}");
        let entries = body["entries"].as_array().unwrap();
        let audited = |who: &str, action: &str, code: u64, peer_ip: Option<std::net::IpAddr>| {
            entries.iter().any(|e| {
                e["identity"] == json!(who)
                    && e["action"] == json!(action)
                    && e["status"] == json!(code)
                    && peer_ip.is_none_or(|ip| e["peer"].as_str().unwrap_or_default().starts_with(&ip.to_string()))
            })
        };
        assert!(audited("anonymous", "GET /api/v1/devices", 401, Some(ip)), "{body}");
        assert!(audited("cert:operator", "POST /api/v1/models/digits/versions", 200, Some(ip)), "{body}");
        assert!(audited("cert:operator", "POST /api/v1/devices/agent-1/revoke", 200, Some(ip)), "{body}");
        assert!(audited("cert:operator", "POST /api/v1/devices/agent-1/revoke", 409, Some(ip)), "{body}");
    });
}
