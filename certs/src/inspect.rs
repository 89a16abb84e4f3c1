//! Human-readable descriptions of PKI files (`fedfleet-certs inspect`). Never prints private key
//! material.

use std::fmt::Write;
use std::path::{Path, PathBuf};

use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use x509_parser::extensions::GeneralName;

use crate::allowlist::AllowListFile;
use crate::error::CertError;
use crate::identity::CaCert;
use crate::revocation::RevocationList;
use crate::{fsutil, keys, layout, x509};

/// Unix seconds as an RFC 3339 time (UTC), for people reading operator output.
pub fn rfc3339(unix: i64) -> String {
    OffsetDateTime::from_unix_timestamp(unix).ok().and_then(|t| t.format(&Rfc3339).ok()).unwrap_or_else(|| unix.to_string())
}

/// Describes a certificate, private key, `revoked.json` or `devices.json`. For a revocation list
/// the signature is checked against `ca` or, by default, `ca.crt` in the same directory.
pub fn describe(path: &Path, ca: Option<&Path>) -> Result<String, CertError> {
    let bytes = fsutil::read(path)?;
    let text = std::str::from_utf8(&bytes).map_err(|_| CertError::malformed(path, "binary file; expected PEM or JSON"))?;
    let trimmed = text.trim_start();
    if trimmed.starts_with('{') {
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| CertError::malformed(path, format!("invalid JSON: {e}")))?;
        if value.get("signature").is_some() && value.get("entries").is_some() {
            return describe_revocations(path, ca);
        }
        if value.get("devices").is_some() {
            return describe_allow_list(path);
        }
        return Err(CertError::malformed(path, "JSON is neither a revocation list nor a device allow-list"));
    }
    if text.contains("-----BEGIN PRIVATE KEY-----") {
        let key = keys::parse_pem(path, text)?;
        return Ok(format!(
            "file:        {}\ntype:        ed25519 private key (PKCS#8)\npublic key:  {}\n",
            path.display(),
            hex::encode(key.verifying_key().to_bytes())
        ));
    }
    if text.contains("-----BEGIN") {
        return describe_certs(path, &bytes);
    }
    Err(CertError::malformed(path, "not a PEM certificate, PEM private key, revoked.json or devices.json"))
}

fn describe_certs(path: &Path, bytes: &[u8]) -> Result<String, CertError> {
    let certs = x509::parse_pem_certs(path, bytes)?;
    let mut out = String::new();
    for der in &certs {
        let c = x509::parse(der).map_err(|e| CertError::malformed(path, e.to_string()))?;
        let _ = writeln!(out, "file:        {}", path.display());
        let _ = writeln!(out, "subject:     {}", c.subject());
        let _ = writeln!(out, "issuer:      {}", c.issuer());
        let _ = writeln!(out, "serial:      {}", x509::serial_hex(&c));
        let v = c.validity();
        let _ = writeln!(out, "not before:  {}", rfc3339(v.not_before.timestamp()));
        let _ = writeln!(out, "not after:   {}{}", rfc3339(v.not_after.timestamp()), if v.is_valid() { "" } else { "  (NOT VALID NOW)" });
        let _ = writeln!(out, "CA:          {}", if c.is_ca() { "yes" } else { "no" });
        if let Ok(Some(san)) = c.subject_alternative_name() {
            let names: Vec<String> = san
                .value
                .general_names
                .iter()
                .map(|n| match n {
                    GeneralName::DNSName(d) => format!("DNS:{d}"),
                    GeneralName::IPAddress(ip) => match ip.len() {
                        4 => format!("IP:{}", std::net::Ipv4Addr::from(<[u8; 4]>::try_from(*ip).unwrap_or_default())),
                        16 => format!("IP:{}", std::net::Ipv6Addr::from(<[u8; 16]>::try_from(*ip).unwrap_or_default())),
                        _ => format!("IP:{}", hex::encode(ip)),
                    },
                    GeneralName::URI(u) => format!("URI:{u}"),
                    other => format!("{other:?}"),
                })
                .collect();
            let _ = writeln!(out, "SANs:        {}", names.join(", "));
        }
        if let Ok(Some(eku)) = c.extended_key_usage() {
            let mut usages = Vec::new();
            if eku.value.server_auth {
                usages.push("serverAuth");
            }
            if eku.value.client_auth {
                usages.push("clientAuth");
            }
            let _ = writeln!(out, "EKU:         {}", usages.join(", "));
        }
        match x509::ed25519_key(&c) {
            Ok(k) => {
                let _ = writeln!(out, "key type:    ed25519");
                let _ = writeln!(out, "public key:  {}", hex::encode(k.to_bytes()));
            }
            Err(_) => {
                let _ = writeln!(out, "key type:    {}", c.public_key().algorithm.algorithm.to_id_string());
            }
        }
        if let Ok(peer) = crate::peer_identity(std::slice::from_ref(der)) {
            let _ = writeln!(out, "identity:    {peer:?}");
        }
    }
    Ok(out)
}

fn describe_revocations(path: &Path, ca: Option<&Path>) -> Result<String, CertError> {
    let list = RevocationList::read_unverified(path)?;
    let ca_path: PathBuf = match ca {
        Some(p) => p.to_path_buf(),
        None => layout::ca_cert(path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))),
    };
    let sig = match CaCert::load(&ca_path) {
        Ok(ca) if list.verify(ca.public_key()) => format!("valid (CA {})", ca_path.display()),
        Ok(_) => format!("INVALID (does not verify against {})", ca_path.display()),
        Err(e) => format!("not checked ({e})"),
    };
    let mut out = String::new();
    let _ = writeln!(out, "file:        {}", path.display());
    let _ = writeln!(out, "type:        revocation list");
    let _ = writeln!(out, "version:     {}", list.version);
    let _ = writeln!(out, "issued at:   {}", rfc3339(list.issued_at as i64));
    let _ = writeln!(out, "signature:   {sig}");
    let _ = writeln!(out, "entries:     {}", list.entries.len());
    for e in &list.entries {
        let _ = writeln!(out, "  {}  serial {}  revoked {}  reason {:?}", e.device_id, e.serial, rfc3339(e.revoked_at as i64), e.reason);
    }
    Ok(out)
}

fn describe_allow_list(path: &Path) -> Result<String, CertError> {
    let file = AllowListFile::read(path)?;
    let mut out = String::new();
    let _ = writeln!(out, "file:        {}", path.display());
    let _ = writeln!(out, "type:        device allow-list");
    let _ = writeln!(out, "fleet:       {}", file.fleet);
    let _ = writeln!(out, "devices:     {}", file.devices.len());
    for (id, e) in &file.devices {
        let state = match e.revoked_at {
            Some(t) => format!("REVOKED {}", rfc3339(t as i64)),
            None => "enrolled".into(),
        };
        let _ = writeln!(out, "  {id}  key {}  serial {}  enrolled {}  {state}", e.public_key, e.serial, rfc3339(e.enrolled_at as i64));
    }
    Ok(out)
}
