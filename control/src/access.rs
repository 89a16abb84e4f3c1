//! An external broker's access rules kept in step with the fleet's PKI: what
//! `fedfleet-aggregator broker-access` writes once, or keeps writing under `--watch`.
//!
//! The rules come from [`topics::mosquitto_acl`] and [`topics::nats_authorization`]; devices
//! revoked in the CA-signed list (or marked in the allow-list) are left out. Under NATS every
//! enrolled device is a user of its own, so a device enrolled after the broker started is
//! refused until the rules are written again and the broker reloads them, and a revoked device
//! keeps its broker user until then: [`RulesWatch`] does both, each time the PKI changes.
//! mosquitto's ACL is one set of patterns for every device; it refuses revoked devices at the
//! TLS handshake from the CRL the CA writes (`crlfile …/ca.crl`, which it reads only when it
//! (re)loads): its rules name the CRL's number, so a revocation changes them and the watch
//! reloads the broker. A CRL behind `revoked.json` is an error, not rules.

use std::path::{Path, PathBuf};
use std::process::Command;

use fedfleet_certs::{AllowListFile, CaCert, CertError, RevocationList, layout};

use crate::topics;

/// Which broker the rules are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerKind {
    /// An `acl_file` (the broker runs with `use_identity_as_username true`).
    Mosquitto,
    /// The `authorization` block of each node's config (MQTT listener with `verify_and_map`).
    Nats,
}

#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    #[error("reading the PKI: {0}")]
    Pki(CertError),
    #[error("service name {name:?}: {detail}")]
    BadService { name: String, detail: String },
    #[error(
        "{path}: {detail}, so a broker reading it would let revoked devices in; run `fedfleet-certs crl` where the CA key is and copy ca.crl here"
    )]
    CrlNotCurrent { path: PathBuf, detail: String },
    #[error("writing {path}: {cause}")]
    Write { path: PathBuf, cause: std::io::Error },
}

// Printed in the message, so not also a `source`: a report of the chain would say it twice.
impl From<CertError> for AccessError {
    fn from(e: CertError) -> Self {
        AccessError::Pki(e)
    }
}

/// The access rules of `broker` for the fleet in `pki`, revoked devices left out; `services`
/// (certificate names) may publish on every topic of the fleet.
pub fn broker_rules(pki: &Path, broker: BrokerKind, services: &[String]) -> Result<String, AccessError> {
    for s in services {
        layout::validate_name(s).map_err(|e| AccessError::BadService { name: s.clone(), detail: e.to_string() })?;
    }
    let allow = AllowListFile::read(&layout::allow_list(pki))?;
    let ca = CaCert::load(layout::ca_cert(pki))?;
    let revoked = RevocationList::load(&layout::revocation_list(pki), ca.public_key())?;
    let services: Vec<&str> = services.iter().map(String::as_str).collect();
    Ok(match broker {
        BrokerKind::Mosquitto => {
            // The ACL's patterns hold for every certificate the broker lets in: a revoked device
            // is turned away at the handshake by `crlfile`, so the CRL must be the list's.
            let crl_path = layout::crl(pki);
            if !crl_path.exists() {
                return Err(AccessError::CrlNotCurrent { path: crl_path, detail: "missing".into() });
            }
            let crl = fedfleet_certs::crl::summary(&crl_path)?;
            if crl.number != revoked.version {
                let detail = format!("CRL number {} but revoked.json is version {}", crl.number, revoked.version);
                return Err(AccessError::CrlNotCurrent { path: crl_path, detail });
            }
            let mut acl = format!(
                "# Revoked devices: {} (revoked.json version {}), refused at the handshake by crlfile {}\n",
                crl.revoked,
                crl.number,
                layout::CA_CRL
            );
            acl.push_str(&topics::mosquitto_acl(&allow.fleet, &services));
            acl
        }
        BrokerKind::Nats => {
            let devices: Vec<_> =
                allow.devices.iter().filter(|(id, e)| e.revoked_at.is_none() && !revoked.contains(id)).map(|(id, _)| id.clone()).collect();
            topics::nats_authorization(&allow.fleet, &services, &devices)
        }
    })
}

/// What one [`RulesWatch::tick`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tick {
    /// The rules on disk are the PKI's, and the broker was told of the last change.
    Unchanged,
    /// The rules changed and were written; the reload command (if any) succeeded.
    Written,
    /// The rules are written, but the reload command failed; it runs again at the next tick.
    ReloadFailed(String),
    /// The PKI could not be read (a file mid-write, a bad signature): the rules on disk stay
    /// as they are, and the next tick reads the PKI again.
    PkiUnreadable(String),
}

/// Writes a broker's rules whenever the PKI's change, then runs the broker's reload command
/// (`nats-server --signal reload=…`, `systemctl reload mosquitto`, `kill -HUP …`).
pub struct RulesWatch {
    pki: PathBuf,
    broker: BrokerKind,
    services: Vec<String>,
    out: PathBuf,
    reload: Vec<String>,
    /// Written since the reload command last succeeded.
    reload_pending: bool,
}

impl RulesWatch {
    /// `reload` is a program and its arguments (empty: write the file only).
    pub fn new(pki: PathBuf, broker: BrokerKind, services: Vec<String>, out: PathBuf, reload: Vec<String>) -> RulesWatch {
        RulesWatch { pki, broker, services, out, reload, reload_pending: false }
    }

    /// Reads the PKI once; writes the rules (atomically) if they differ from the file's, and
    /// reloads the broker after a write (or after a reload that failed).
    pub fn tick(&mut self) -> Result<Tick, AccessError> {
        let rules = match broker_rules(&self.pki, self.broker, &self.services) {
            Ok(r) => r,
            Err(e @ AccessError::BadService { .. }) => return Err(e),
            Err(e) => return Ok(Tick::PkiUnreadable(e.to_string())),
        };
        if std::fs::read(&self.out).ok().as_deref() != Some(rules.as_bytes()) {
            fedfleet_durable::write_atomic(&self.out, rules.as_bytes(), fedfleet_durable::Mode::Public)
                .map_err(|cause| AccessError::Write { path: self.out.clone(), cause })?;
            self.reload_pending = true;
        }
        if !self.reload_pending {
            return Ok(Tick::Unchanged);
        }
        if let Some((program, args)) = self.reload.split_first() {
            let failed = match Command::new(program).args(args).output() {
                Ok(out) if out.status.success() => None,
                Ok(out) => {
                    Some(format!("{} exited with {}: {}", self.reload.join(" "), out.status, String::from_utf8_lossy(&out.stderr).trim()))
                }
                Err(e) => Some(format!("cannot run {program}: {e}")),
            };
            if let Some(why) = failed {
                return Ok(Tick::ReloadFailed(why));
            }
        }
        self.reload_pending = false;
        Ok(Tick::Written)
    }
}
