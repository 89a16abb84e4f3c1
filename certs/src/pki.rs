//! The fleet PKI directory: creating the CA, issuing server certificates, enrolling and revoking
//! devices.

use fedfleet_protocol::{Clock, SystemClock};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use ed25519_dalek::SigningKey;
use fedfleet_protocol::{DeviceId, FleetId};
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyUsagePurpose, SanType, SerialNumber};
use time::{Duration, OffsetDateTime};

use crate::allowlist::{AllowEntry, AllowListFile};
use crate::error::CertError;
use crate::identity::{CaCert, DeviceIdentity};
use crate::revocation::{RevocationEntry, RevocationList};
use crate::{crl, fsutil, keys, layout, x509};

/// Default CA validity.
pub const CA_DAYS: u32 = 3650;
/// Default server and device certificate validity.
pub const LEAF_DAYS: u32 = 365;
/// Backdating of `not_before`, for devices whose clocks run a little behind.
const BACKDATE: Duration = Duration::minutes(5);

/// A fleet PKI directory with its CA certificate loaded. The CA private key is read only when
/// something is signed.
#[derive(Debug, Clone)]
pub struct Pki {
    dir: PathBuf,
    fleet: FleetId,
    ca: CaCert,
}

/// A server certificate just issued.
#[derive(Debug, Clone)]
pub struct IssuedServer {
    pub name: String,
    pub cert_path: PathBuf,
    pub key_path: PathBuf,
    /// Lowercase hex.
    pub serial: String,
    /// DNS names and IP addresses, as given.
    pub sans: Vec<String>,
    pub not_after: OffsetDateTime,
}

/// A device just enrolled.
#[derive(Debug, Clone)]
pub struct EnrolledDevice {
    pub device_id: DeviceId,
    pub cert_path: PathBuf,
    pub key_path: PathBuf,
    /// The allow-list entry written to `devices.json`.
    pub entry: AllowEntry,
    pub not_after: OffsetDateTime,
}

/// What [`Pki::issue_device`] made.
struct IssuedDevice {
    cert: rustls_pki_types::CertificateDer<'static>,
    key: SigningKey,
    entry: AllowEntry,
    not_after: OffsetDateTime,
}

/// A revocation just recorded.
#[derive(Debug, Clone)]
pub struct Revocation {
    pub entry: RevocationEntry,
    /// Version of the new `revoked.json`.
    pub list_version: u64,
    pub list_path: PathBuf,
}

/// Unix seconds on the wall clock (the PKI's operator commands stamp lists and enrollments).
fn unix_now() -> u64 {
    SystemClock.now_secs() as u64
}

/// Signs leaf `params` for `subject` with the CA key, valid from `now` (backdated a little) for
/// `days`, clamped to the CA's own validity.
pub(crate) fn sign_leaf_at(
    ca: &CaCert,
    ca_key: &SigningKey,
    mut params: CertificateParams,
    subject: &impl rcgen::PublicKeyData,
    days: u32,
    now: OffsetDateTime,
) -> Result<(rcgen::Certificate, String, OffsetDateTime), CertError> {
    let (issuer, ca_not_after) = ca_issuer(ca, ca_key)?;
    params.not_before = now - BACKDATE;
    params.not_after = (now + Duration::days(days.max(1) as i64)).min(ca_not_after);
    let (serial, serial_hex) = random_serial();
    params.serial_number = Some(serial);
    params.use_authority_key_identifier_extension = true;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    let not_after = params.not_after;
    let cert = params.signed_by(subject, &issuer)?;
    Ok((cert, serial_hex, not_after))
}

/// The CA as rcgen's signer (its subject, its key), and the CA's expiry.
pub(crate) fn ca_issuer(ca: &CaCert, ca_key: &SigningKey) -> Result<(Issuer<'static, rcgen::KeyPair>, OffsetDateTime), CertError> {
    let ca_parsed = x509::parse(ca.der())?;
    let mut ca_params = CertificateParams::default();
    ca_params.distinguished_name = x509::to_rcgen_dn(ca_parsed.subject())?;
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let ca_not_after = OffsetDateTime::from_unix_timestamp(ca_parsed.validity().not_after.timestamp())
        .map_err(|e| CertError::BadCertificate(format!("CA not_after: {e}")))?;
    Ok((Issuer::new(ca_params, keys::to_rcgen(ca_key)?), ca_not_after))
}

/// The subject of a device certificate of `fleet`: O = fleet, OU = device, CN = id.
pub(crate) fn device_dn(fleet: &FleetId, id: &DeviceId) -> rcgen::DistinguishedName {
    let mut dn = rcgen::DistinguishedName::new();
    dn.push(DnType::OrganizationName, fleet.as_str());
    dn.push(DnType::OrganizationalUnitName, x509::OU_DEVICE);
    dn.push(DnType::CommonName, id.as_str());
    dn
}

fn random_serial() -> (SerialNumber, String) {
    let mut bytes = [0u8; 16];
    rand_core::RngCore::fill_bytes(&mut rand_core::OsRng, &mut bytes);
    bytes[0] &= 0x7f; // positive
    bytes[0] |= 0x01; // no leading zero byte, so the DER INTEGER keeps all 16 bytes
    (SerialNumber::from_slice(&bytes), hex::encode(bytes))
}

impl Pki {
    /// Creates a new fleet CA in `dir`: `ca.crt`, `ca.key` (0600), an empty `devices.json` and an
    /// empty signed `revoked.json`. Refuses to replace any of them unless `force` (which also
    /// resets the allow-list and the revocation list: they belong to the old CA).
    pub fn init(dir: impl AsRef<Path>, fleet: &FleetId, days: u32, force: bool) -> Result<Pki, CertError> {
        let dir = dir.as_ref().to_path_buf();
        let (crt, key, allow, revoked, crl) =
            (layout::ca_cert(&dir), layout::ca_key(&dir), layout::allow_list(&dir), layout::revocation_list(&dir), layout::crl(&dir));
        fsutil::refuse_existing(&[&key, &crt, &allow, &revoked, &crl], force)?;
        fsutil::create_dir(&dir)?;

        let ca_key = keys::generate();
        let mut params = CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(DnType::OrganizationName, fleet.as_str());
        params.distinguished_name.push(DnType::CommonName, format!("fedfleet {fleet} CA"));
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - BACKDATE;
        params.not_after = now + Duration::days(days.max(1) as i64);
        params.serial_number = Some(random_serial().0);
        let cert = params.self_signed(&keys::to_rcgen(&ca_key)?)?;

        fsutil::write_atomic(&key, keys::to_pem(&ca_key)?.as_bytes(), true)?;
        fsutil::write_atomic(&crt, cert.pem().as_bytes(), false)?;
        let empty = AllowListFile { fleet: fleet.clone(), devices: BTreeMap::new() };
        fsutil::write_atomic(&allow, &empty.to_json(), false)?;
        let list = RevocationList::signed(1, unix_now(), Vec::new(), &ca_key);
        fsutil::write_atomic(&revoked, &list.to_json(), false)?;
        let pki = Pki::open(&dir)?;
        crl::write(&dir, &pki.ca, &ca_key, &list)?;
        Ok(pki)
    }

    /// Opens an existing PKI directory (reads `ca.crt`).
    pub fn open(dir: impl AsRef<Path>) -> Result<Pki, CertError> {
        let dir = dir.as_ref().to_path_buf();
        let crt = layout::ca_cert(&dir);
        if !crt.exists() {
            return Err(CertError::NoPki { path: dir });
        }
        let ca = CaCert::load(&crt)?;
        let fleet = match ca.fleet() {
            Some(f) => f.clone(),
            None => {
                return Err(CertError::malformed(&crt, "CA subject carries no fleet name (O=)"));
            }
        };
        Ok(Pki { dir, fleet, ca })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
    pub fn fleet(&self) -> &FleetId {
        &self.fleet
    }
    pub fn ca(&self) -> &CaCert {
        &self.ca
    }
    pub fn ca_cert_path(&self) -> PathBuf {
        layout::ca_cert(&self.dir)
    }
    pub fn allow_list_path(&self) -> PathBuf {
        layout::allow_list(&self.dir)
    }
    pub fn revocation_list_path(&self) -> PathBuf {
        layout::revocation_list(&self.dir)
    }
    /// `ca.crl`: the revocation list as an X.509 CRL, for brokers (see [`crate::crl`]).
    pub fn crl_path(&self) -> PathBuf {
        layout::crl(&self.dir)
    }

    /// Writes `ca.crl` again from `revoked.json` (a PKI made before the CRL existed, or a lost
    /// file). [`Pki::init`] and [`Pki::revoke`] write it themselves.
    pub fn write_crl(&self) -> Result<PathBuf, CertError> {
        let list = RevocationList::load(&self.revocation_list_path(), self.ca.public_key())?;
        crl::write(&self.dir, &self.ca, &self.ca_signing_key()?, &list)
    }

    pub(crate) fn ca_signing_key(&self) -> Result<SigningKey, CertError> {
        let path = layout::ca_key(&self.dir);
        let key = keys::load_signing_key(&path)?;
        if key.verifying_key() != *self.ca.public_key() {
            return Err(CertError::malformed(&path, "CA key does not match ca.crt"));
        }
        Ok(key)
    }

    /// Signs leaf `params` for `subject_key` with the CA. Validity is clamped to the CA's.
    fn sign_leaf(
        &self,
        params: CertificateParams,
        subject_key: &SigningKey,
        days: u32,
    ) -> Result<(rcgen::Certificate, String, OffsetDateTime), CertError> {
        let ca_key = self.ca_signing_key()?;
        let subject = crate::renewal::Ed25519Public(subject_key.verifying_key());
        sign_leaf_at(&self.ca, &ca_key, params, &subject, days, OffsetDateTime::now_utc())
    }

    fn leaf_dn(&self, ou: &str, cn: &str) -> rcgen::DistinguishedName {
        let mut dn = rcgen::DistinguishedName::new();
        dn.push(DnType::OrganizationName, self.fleet.as_str());
        dn.push(DnType::OrganizationalUnitName, ou);
        dn.push(DnType::CommonName, cn);
        dn
    }

    /// A fresh PKI for a deployment on one host: the CA in `dir`, one service identity per name
    /// in `services` (each naming `localhost` and `127.0.0.1`), one device identity per device,
    /// all valid for `days`. What `fedfleet-init-local` and the test kit start from.
    pub fn init_loopback(
        dir: impl AsRef<Path>,
        fleet: &FleetId,
        services: &[&str],
        devices: &[DeviceId],
        days: u32,
    ) -> Result<Pki, CertError> {
        let pki = Pki::init(dir, fleet, days, false)?;
        let sans = ["localhost".to_owned(), "127.0.0.1".to_owned()];
        for name in services {
            pki.issue_server(name, &sans, days, false)?;
        }
        pki.enroll_devices(devices, days, true)?;
        Ok(pki)
    }

    /// Issues `servers/<name>.crt|.key` (EKU serverAuth and clientAuth, so a service can also
    /// present it to another service). `sans` are DNS names or IP addresses; empty means
    /// `localhost` and `127.0.0.1`.
    pub fn issue_server(&self, name: &str, sans: &[String], days: u32, force: bool) -> Result<IssuedServer, CertError> {
        layout::validate_name(name)?;
        let sans: Vec<String> = if sans.is_empty() { vec!["localhost".into(), "127.0.0.1".into()] } else { sans.to_vec() };
        let mut san_types = Vec::new();
        for s in &sans {
            san_types.push(match s.parse::<IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => {
                    let valid = !s.is_empty()
                        && s.split('.').all(|l| {
                            !l.is_empty() && l.len() <= 63 && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '*')
                        });
                    if !valid {
                        return Err(CertError::InvalidSan(s.clone()));
                    }
                    SanType::DnsName(s.clone().try_into().map_err(|_| CertError::InvalidSan(s.clone()))?)
                }
            });
        }
        let (crt, key_path) = layout::server_paths(&self.dir, name);
        fsutil::refuse_existing(&[&key_path, &crt], force)?;

        let key = keys::generate();
        let mut params = CertificateParams::default();
        params.distinguished_name = self.leaf_dn(x509::OU_SERVICE, name);
        params.subject_alt_names = san_types;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let (cert, serial, not_after) = self.sign_leaf(params, &key, days)?;

        fsutil::create_dir(&self.dir.join(layout::SERVERS_DIR))?;
        fsutil::write_atomic(&key_path, keys::to_pem(&key)?.as_bytes(), true)?;
        fsutil::write_atomic(&crt, cert.pem().as_bytes(), false)?;
        Ok(IssuedServer { name: name.to_string(), cert_path: crt, key_path, serial, sans, not_after })
    }

    /// Enrolls a device: a fresh ed25519 key, `devices/<id>.crt|.key` (CN = id, EKU clientAuth),
    /// and its entry in `devices.json`. Refuses a revoked id and existing files unless `force`.
    pub fn enroll_device(&self, id: &DeviceId, days: u32, force: bool) -> Result<EnrolledDevice, CertError> {
        let revoked = RevocationList::load(&self.revocation_list_path(), self.ca.public_key())?;
        if revoked.contains(id) {
            return Err(CertError::Revoked(id.to_string()));
        }
        let allow_path = self.allow_list_path();
        let mut allow = AllowListFile::read(&allow_path)?;
        let (crt, key_path) = layout::device_paths(&self.dir, id);
        fsutil::refuse_existing(&[&key_path, &crt], force)?;
        if !force && allow.devices.contains_key(id) {
            return Err(CertError::AlreadyEnrolled(id.to_string()));
        }
        let issued = self.issue_device(&self.ca_signing_key()?, id, days, OffsetDateTime::now_utc(), true)?;
        allow.devices.insert(id.clone(), issued.entry.clone());
        fsutil::write_atomic(&allow_path, &allow.to_json(), false)?;
        Ok(EnrolledDevice { device_id: id.clone(), cert_path: crt, key_path, entry: issued.entry, not_after: issued.not_after })
    }

    /// Enrolls a batch of devices with one `devices.json` write (one at a time rewrites the whole
    /// allow list each time: quadratic in the fleet, hours at 100,000). `files`: also write each
    /// `devices/<id>.crt|.key`; without, the identities exist only in what is returned (fleet
    /// simulators). Revoked, enrolled, repeated ids and existing files are refused before
    /// anything is issued.
    pub fn enroll_devices(&self, ids: &[DeviceId], days: u32, files: bool) -> Result<Vec<DeviceIdentity>, CertError> {
        let revoked = RevocationList::load(&self.revocation_list_path(), self.ca.public_key())?;
        let allow_path = self.allow_list_path();
        let mut allow = AllowListFile::read(&allow_path)?;
        let mut batch = std::collections::BTreeSet::new();
        for id in ids {
            if revoked.contains(id) {
                return Err(CertError::Revoked(id.to_string()));
            }
            if allow.devices.contains_key(id) || !batch.insert(id) {
                return Err(CertError::AlreadyEnrolled(id.to_string()));
            }
            if files {
                let (crt, key_path) = layout::device_paths(&self.dir, id);
                fsutil::refuse_existing(&[&key_path, &crt], false)?;
            }
        }
        let ca_key = self.ca_signing_key()?;
        let ca = std::sync::Arc::new(self.ca.clone());
        let now = OffsetDateTime::now_utc();
        let mut identities = Vec::with_capacity(ids.len());
        for id in ids {
            let issued = self.issue_device(&ca_key, id, days, now, files)?;
            allow.devices.insert(id.clone(), issued.entry);
            identities.push(DeviceIdentity::issued(id.clone(), issued.cert, issued.key, ca.clone()));
        }
        fsutil::write_atomic(&allow_path, &allow.to_json(), false)?;
        Ok(identities)
    }

    /// A fresh key and certificate for device `id` (written to `devices/` when `files`), and its
    /// allow-list entry (not written).
    fn issue_device(
        &self,
        ca_key: &SigningKey,
        id: &DeviceId,
        days: u32,
        now: OffsetDateTime,
        files: bool,
    ) -> Result<IssuedDevice, CertError> {
        let key = keys::generate();
        let mut params = CertificateParams::default();
        params.distinguished_name = self.leaf_dn(x509::OU_DEVICE, id.as_str());
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let subject = crate::renewal::Ed25519Public(key.verifying_key());
        let (cert, serial, not_after) = sign_leaf_at(&self.ca, ca_key, params, &subject, days, now)?;
        if files {
            let (crt, key_path) = layout::device_paths(&self.dir, id);
            fsutil::create_dir(&self.dir.join(layout::DEVICES_DIR))?;
            fsutil::write_atomic(&key_path, keys::to_pem(&key)?.as_bytes(), true)?;
            fsutil::write_atomic(&crt, cert.pem().as_bytes(), false)?;
        }
        let entry =
            AllowEntry { public_key: hex::encode(key.verifying_key().to_bytes()), serial, enrolled_at: unix_now(), revoked_at: None };
        Ok(IssuedDevice { cert: cert.der().clone(), key, entry, not_after })
    }

    /// Revokes an enrolled device: adds it to the signed `revoked.json` (version + 1) and marks its
    /// `devices.json` entry. Servers refuse it from their next handshake on.
    pub fn revoke(&self, id: &DeviceId, reason: &str) -> Result<Revocation, CertError> {
        self.revoke_signed_by(id, reason, || self.ca_signing_key())
    }

    /// [`Pki::revoke`] with the CA key from `ca_key` (read only once the device is known to be
    /// enrolled and not yet revoked).
    pub(crate) fn revoke_signed_by(
        &self,
        id: &DeviceId,
        reason: &str,
        ca_key: impl FnOnce() -> Result<SigningKey, CertError>,
    ) -> Result<Revocation, CertError> {
        let allow_path = self.allow_list_path();
        let mut allow = AllowListFile::read(&allow_path)?;
        let Some(allowed) = allow.devices.get_mut(id) else {
            return Err(CertError::NotEnrolled(id.to_string()));
        };
        let list_path = self.revocation_list_path();
        let old = RevocationList::load(&list_path, self.ca.public_key())?;
        if old.contains(id) {
            return Err(CertError::Revoked(id.to_string()));
        }
        let ca_key = ca_key()?;
        let now = unix_now();
        let entry = RevocationEntry { device_id: id.clone(), serial: allowed.serial.clone(), revoked_at: now, reason: reason.to_string() };
        let mut entries = old.entries.clone();
        entries.push(entry.clone());
        // Strictly after the last list, even within one second: the CRL's thisUpdate (crate::crl).
        let issued_at = now.max(old.issued_at + 1);
        let list = RevocationList::signed(old.version + 1, issued_at, entries, &ca_key);
        fsutil::write_atomic(&list_path, &list.to_json(), false)?;
        crl::write(&self.dir, &self.ca, &ca_key, &list)?;
        allowed.revoked_at = Some(now);
        fsutil::write_atomic(&allow_path, &allow.to_json(), false)?;
        Ok(Revocation { entry, list_version: list.version, list_path })
    }
}
