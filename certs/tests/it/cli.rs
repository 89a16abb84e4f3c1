//! The `fedfleet-certs` binary: exit codes, one-line errors, file modes, --force.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};

fn certs(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fedfleet-certs"))
        .arg("--dir")
        .arg(dir)
        .args(args)
        .env_remove("FEDFLEET_PKI")
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}
fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[track_caller]
fn ok(o: Output) -> String {
    assert!(o.status.success(), "exit {:?}, stderr: {}", o.status, stderr(&o));
    stdout(&o)
}

/// Exit 1 and exactly one line on stderr, starting with "error: ". Returns the line.
#[track_caller]
fn one_line_error(o: Output) -> String {
    assert_eq!(o.status.code(), Some(1), "stdout: {} stderr: {}", stdout(&o), stderr(&o));
    let err = stderr(&o);
    assert_eq!(err.lines().count(), 1, "not one line: {err:?}");
    assert!(err.starts_with("error: "), "{err:?}");
    assert!(!err.contains("Backtrace") && !err.contains("Caused by"), "{err:?}");
    err
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

#[test]
fn init_enroll_force_and_modes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("pki");
    let out = ok(certs(&dir, &["init", "--fleet", "demo"]));
    assert!(out.contains("ca.crt"), "{out}");
    assert_eq!(mode(&dir.join("ca.key")), 0o600);
    let ca_key = std::fs::read(dir.join("ca.key")).unwrap();

    let err = one_line_error(certs(&dir, &["init", "--fleet", "demo"]));
    assert!(err.contains("ca.key") && err.contains("--force"), "{err}");
    assert_eq!(std::fs::read(dir.join("ca.key")).unwrap(), ca_key, "refused init must not touch the key");

    ok(certs(&dir, &["init", "--fleet", "demo", "--force"]));
    assert_ne!(std::fs::read(dir.join("ca.key")).unwrap(), ca_key);
    assert_eq!(mode(&dir.join("ca.key")), 0o600);

    let out = ok(certs(&dir, &["issue-server", "--name", "aggregator", "--san", "localhost", "--san", "10.0.0.1"]));
    assert!(out.contains("servers/aggregator.crt") && out.contains("10.0.0.1"), "{out}");
    assert_eq!(mode(&dir.join("servers/aggregator.key")), 0o600);

    let out = ok(certs(&dir, &["enroll-device", "--id", "cam-7"]));
    assert!(out.contains("devices/cam-7.crt") && out.contains("devices/cam-7.key"), "{out}");
    assert!(out.contains("\"public_key\"") && out.contains("\"serial\""), "allow-list entry printed: {out}");
    let key = dir.join("devices/cam-7.key");
    assert_eq!(mode(&key), 0o600);
    let before = std::fs::read(&key).unwrap();

    let err = one_line_error(certs(&dir, &["enroll-device", "--id", "cam-7"]));
    assert!(err.contains("cam-7.key"), "{err}");
    assert_eq!(std::fs::read(&key).unwrap(), before);
    ok(certs(&dir, &["enroll-device", "--id", "cam-7", "--force"]));
    assert_ne!(std::fs::read(&key).unwrap(), before);
    assert_eq!(mode(&key), 0o600);

    let err = one_line_error(certs(&dir, &["enroll-device", "--id", "bad/id"]));
    assert!(err.contains("bad/id"), "{err}");

    let out = ok(certs(&dir, &["inspect", dir.join("devices/cam-7.crt").to_str().unwrap()]));
    assert!(out.contains("CN=cam-7") && out.contains("clientAuth"), "{out}");
    let out = ok(certs(&dir, &["inspect", key.to_str().unwrap()]));
    assert!(out.contains("public key") && !out.contains("PRIVATE KEY"), "{out}");

    ok(certs(&dir, &["revoke", "--id", "cam-7", "--reason", "stolen"]));
    let revoked = dir.join("revoked.json");
    let out = ok(certs(&dir, &["inspect", revoked.to_str().unwrap()]));
    assert!(out.contains("signature:   valid") && out.contains("cam-7") && out.contains("stolen"), "{out}");
    let out = ok(certs(&dir, &["inspect", dir.join("devices.json").to_str().unwrap()]));
    assert!(out.contains("cam-7") && out.contains("REVOKED"), "{out}");

    // A tampered revocation list shows as invalid.
    let text = std::fs::read_to_string(&revoked).unwrap().replace("stolen", "found");
    std::fs::write(&revoked, text).unwrap();
    let out = ok(certs(&dir, &["inspect", revoked.to_str().unwrap()]));
    assert!(out.contains("INVALID"), "{out}");
}

#[test]
fn bad_inputs_give_one_line_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("pki");

    let err = one_line_error(certs(&dir, &["enroll-device", "--id", "cam-1"]));
    assert!(err.contains("init"), "no PKI yet: {err}");

    let missing = tmp.path().join("nope.crt");
    let err = one_line_error(certs(&dir, &["inspect", missing.to_str().unwrap()]));
    assert!(err.contains("nope.crt"), "{err}");

    let corrupt = tmp.path().join("corrupt.crt");
    std::fs::write(&corrupt, "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n").unwrap();
    let err = one_line_error(certs(&dir, &["inspect", corrupt.to_str().unwrap()]));
    assert!(err.contains("corrupt.crt"), "{err}");

    let broken = tmp.path().join("broken.crt");
    std::fs::write(&broken, "-----BEGIN CERTIFICATE-----\n!!!!\n").unwrap();
    one_line_error(certs(&dir, &["inspect", broken.to_str().unwrap()]));

    let key = tmp.path().join("bad.key");
    std::fs::write(&key, "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n").unwrap();
    let err = one_line_error(certs(&dir, &["inspect", key.to_str().unwrap()]));
    assert!(err.contains("bad.key"), "{err}");

    let help = ok(certs(&dir, &["--help"]));
    for sub in ["init", "issue-server", "enroll-device", "revoke", "inspect"] {
        assert!(help.contains(sub), "{help}");
    }
    let help = ok(certs(&dir, &["enroll-device", "--help"]));
    assert!(help.contains("--force") && help.contains("--id"), "{help}");
}

/// Issue 31: each host's files, and only those, in a directory of its own laid out as a PKI
/// (the CA key never, unless a renewing registry asks for it).
#[test]
fn bundle_copies_exactly_the_files_a_role_needs() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("pki");
    ok(certs(&dir, &["init", "--fleet", "f1"]));
    ok(certs(&dir, &["issue-server", "--name", "aggregator"]));
    ok(certs(&dir, &["issue-server", "--name", "operator"]));
    ok(certs(&dir, &["enroll-device", "--id", "dev-1"]));
    let listing = |root: &Path| {
        let mut files: Vec<String> = walk(root).iter().map(|p| p.strip_prefix(root).unwrap().display().to_string()).collect();
        files.sort();
        files
    };
    fn walk(p: &Path) -> Vec<std::path::PathBuf> {
        std::fs::read_dir(p)
            .unwrap()
            .flat_map(|e| {
                let p = e.unwrap().path();
                if p.is_dir() { walk(&p) } else { vec![p] }
            })
            .collect()
    }
    let agg = tmp.path().join("agg-host");
    ok(certs(&dir, &["bundle", "--role", "aggregator", "--out", agg.to_str().unwrap()]));
    assert_eq!(listing(&agg), ["ca.crt", "devices.json", "revoked.json", "servers/aggregator.crt", "servers/aggregator.key"]);
    assert_eq!(std::fs::metadata(agg.join("servers/aggregator.key")).unwrap().permissions().mode() & 0o777, 0o600);
    let dev = tmp.path().join("dev-host");
    ok(certs(&dir, &["bundle", "--role", "device", "--id", "dev-1", "--out", dev.to_str().unwrap()]));
    assert_eq!(listing(&dev), ["ca.crt", "devices/dev-1.crt", "devices/dev-1.key"]);
    let op = tmp.path().join("op-host");
    ok(certs(&dir, &["bundle", "--role", "operator", "--out", op.to_str().unwrap()]));
    assert_eq!(listing(&op), ["ca.crt", "servers/operator.crt", "servers/operator.key"]);
    ok(certs(&dir, &["issue-server", "--name", "broker"]));
    let broker = tmp.path().join("broker-host");
    ok(certs(&dir, &["bundle", "--role", "broker", "--out", broker.to_str().unwrap()]));
    assert_eq!(listing(&broker), ["ca.crl", "ca.crt", "devices.json", "revoked.json", "servers/broker.crt", "servers/broker.key"]);
    // Not issued yet: named, nothing written. Again into a full directory: refused without --force.
    let reg = tmp.path().join("reg-host");
    let e = one_line_error(certs(&dir, &["bundle", "--role", "registry", "--out", reg.to_str().unwrap()]));
    assert!(e.contains("registry.crt"), "{e}");
    assert!(!reg.exists());
    one_line_error(certs(&dir, &["bundle", "--role", "aggregator", "--out", agg.to_str().unwrap()]));
    ok(certs(&dir, &["bundle", "--role", "aggregator", "--out", agg.to_str().unwrap(), "--force"]));
    let e = one_line_error(certs(&dir, &["bundle", "--role", "aggregator", "--with-ca-key", "--out", op.to_str().unwrap()]));
    assert!(e.contains("the CA key stays on the CA host"), "{e}");
}
