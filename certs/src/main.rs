//! `fedfleet-certs`: the fleet's private CA on the command line.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use fedfleet_certs::{CA_DAYS, LEAF_DAYS, Pki, inspect};
use fedfleet_protocol::{DeviceId, FleetId};

/// Private CA of a fedfleet fleet: creates the fleet CA, issues server certificates for the
/// aggregator and the registry, enrolls and revokes devices, and inspects PKI files.
///
/// Everything lives in one directory (--dir, default ./pki): ca.crt, ca.key, servers/, devices/,
/// devices.json (allow-list of enrolled devices) and revoked.json (revocation list signed by the
/// CA). Private keys are ed25519, PKCS#8 PEM, mode 0600, and are never overwritten without --force.
#[derive(Parser, Debug)]
#[command(name = "fedfleet-certs", version, about, long_about)]
struct Cli {
    /// PKI directory.
    #[arg(long, global = true, env = "FEDFLEET_PKI", default_value = "./pki")]
    dir: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Create the fleet CA (ca.crt, ca.key) with an empty allow-list and an empty signed
    /// revocation list.
    ///
    /// With --force an existing CA is replaced, and with it every certificate it issued: devices
    /// and servers must be enrolled again.
    Init {
        /// Fleet name, written into the CA certificate (O=) and devices.json.
        #[arg(long, default_value = "default")]
        fleet: String,
        /// Validity of the CA certificate, in days.
        #[arg(long, default_value_t = CA_DAYS)]
        days: u32,
        /// Replace an existing CA, allow-list and revocation list.
        #[arg(long)]
        force: bool,
    },
    /// Issue a server certificate and key: servers/NAME.crt and servers/NAME.key.
    ///
    /// The certificate allows TLS server and client authentication (a service may present it to
    /// another service).
    IssueServer {
        /// Server name (the certificate CN and file name), e.g. aggregator or registry.
        #[arg(long)]
        name: String,
        /// Subject alternative name: a DNS name or an IP address. Repeat for several.
        /// Default: localhost and 127.0.0.1.
        #[arg(long = "san", value_name = "SAN")]
        sans: Vec<String>,
        /// Validity in days (never past the CA's).
        #[arg(long, default_value_t = LEAF_DAYS)]
        days: u32,
        /// Replace existing files.
        #[arg(long)]
        force: bool,
    },
    /// Enroll a device: a new ed25519 key, devices/ID.crt (CN = ID) and devices/ID.key, and an
    /// entry in devices.json.
    ///
    /// The device key is also the key the device signs its weight updates with.
    EnrollDevice {
        /// Device id: 1 to 64 of A-Z a-z 0-9 . _ -
        #[arg(long)]
        id: String,
        /// Validity in days (never past the CA's).
        #[arg(long, default_value_t = LEAF_DAYS)]
        days: u32,
        /// Replace existing files and the allow-list entry (the old key stops working).
        #[arg(long)]
        force: bool,
    },
    /// Revoke an enrolled device: adds it to revoked.json (re-signed by the CA) and to ca.crl.
    ///
    /// fedfleet's servers pick up the new list on their next handshake, without a restart; an
    /// MQTT broker reads ca.crl when it reloads (`broker-access --watch` reloads it).
    Revoke {
        /// Device id.
        #[arg(long)]
        id: String,
        /// Why, kept in the revocation list.
        #[arg(long, default_value = "unspecified")]
        reason: String,
    },
    /// Write ca.crl again from revoked.json: the revocation list as an X.509 CRL signed by the
    /// CA, for a broker's `crlfile` (init and revoke write it; this is for a PKI made before
    /// ca.crl existed, or a lost file).
    Crl,
    /// Copy the files one host needs into OUT, laid out as a PKI directory (point the host's
    /// `pki_dir` at it, or give a device's files to `fedfleet-agent enroll`).
    ///
    /// registry, aggregator: ca.crt, devices.json, revoked.json, servers/NAME.{crt,key};
    /// operator: ca.crt, servers/NAME.{crt,key}; broker: ca.crt, ca.crl, devices.json,
    /// revoked.json, servers/NAME.{crt,key}; device: ca.crt, devices/ID.{crt,key}. Every later
    /// `enroll-device` and `revoke` changes devices.json, revoked.json and ca.crl: copy them to
    /// every service and broker host again (services reread them by themselves).
    Bundle {
        /// registry, aggregator, operator, broker or device.
        #[arg(long, value_parser = ["registry", "aggregator", "operator", "broker", "device"])]
        role: String,
        /// The service identity's name (default: the role's name).
        #[arg(long)]
        name: Option<String>,
        /// The device id (role device).
        #[arg(long)]
        id: Option<String>,
        /// Also copy ca.key (role registry with `[renewal]`: it issues renewed device certificates).
        #[arg(long)]
        with_ca_key: bool,
        /// Where the files go.
        #[arg(long)]
        out: PathBuf,
        /// Replace files already in OUT.
        #[arg(long)]
        force: bool,
    },
    /// Describe a certificate, a private key (public half only), revoked.json (with a signature
    /// check) or devices.json.
    Inspect {
        /// The file.
        file: PathBuf,
        /// CA certificate to check revoked.json against (default: ca.crt next to the file).
        #[arg(long)]
        ca: Option<PathBuf>,
    },
}

fn run(cli: Cli) -> Result<String> {
    let dir = &cli.dir;
    let mut out = String::new();
    match cli.command {
        Command::Init { fleet, days, force } => {
            let fleet = FleetId::new(&fleet).with_context(|| format!("invalid fleet name {fleet:?}"))?;
            let pki = Pki::init(dir, &fleet, days, force).with_context(|| format!("cannot create the fleet CA in {}", dir.display()))?;
            out += &format!(
                "created fleet {} CA in {}\n  certificate: {}\n  key:         {} (mode 0600)\n  allow-list:  {}\n  revocation:  {}\n  CRL:         {}\n",
                pki.fleet(),
                pki.dir().display(),
                pki.ca_cert_path().display(),
                fedfleet_certs::layout::ca_key(pki.dir()).display(),
                pki.allow_list_path().display(),
                pki.revocation_list_path().display(),
                pki.crl_path().display(),
            );
        }
        Command::IssueServer { name, sans, days, force } => {
            let pki = Pki::open(dir)?;
            let s = pki.issue_server(&name, &sans, days, force).with_context(|| format!("cannot issue server certificate {name:?}"))?;
            out += &format!(
                "issued server certificate {}\n  certificate: {}\n  key:         {} (mode 0600)\n  serial:      {}\n  SANs:        {}\n  not after:   {}\n",
                s.name,
                s.cert_path.display(),
                s.key_path.display(),
                s.serial,
                s.sans.join(", "),
                s.not_after.date(),
            );
        }
        Command::EnrollDevice { id, days, force } => {
            let pki = Pki::open(dir)?;
            let id = DeviceId::new(&id).with_context(|| format!("invalid device id {id:?}"))?;
            let d = pki.enroll_device(&id, days, force).with_context(|| format!("cannot enroll device {id}"))?;
            let entry = serde_json::to_string(&serde_json::json!({ d.device_id.as_str(): &d.entry }))?;
            out += &format!(
                "enrolled device {}\n  certificate: {}\n  key:         {} (mode 0600)\n  CA:          {}\n  not after:   {}\n  allow-list:  {} += {}\n",
                d.device_id,
                d.cert_path.display(),
                d.key_path.display(),
                pki.ca_cert_path().display(),
                d.not_after.date(),
                pki.allow_list_path().display(),
                entry,
            );
        }
        Command::Revoke { id, reason } => {
            let pki = Pki::open(dir)?;
            let id = DeviceId::new(&id).with_context(|| format!("invalid device id {id:?}"))?;
            let r = pki.revoke(&id, &reason).with_context(|| format!("cannot revoke device {id}"))?;
            out += &format!(
                "revoked device {} (serial {}, reason {:?})\n  {} is now version {}\n  {} lists it (CRL number {})\n",
                r.entry.device_id,
                r.entry.serial,
                r.entry.reason,
                r.list_path.display(),
                r.list_version,
                pki.crl_path().display(),
                r.list_version,
            );
        }
        Command::Crl => {
            let pki = Pki::open(dir)?;
            let path = pki.write_crl().context("cannot write the CRL")?;
            let s = fedfleet_certs::crl::summary(&path)?;
            out += &format!("wrote {} (CRL number {}, {} revoked certificates)\n", path.display(), s.number, s.revoked);
        }
        Command::Bundle { role, name, id, with_ca_key, out: to, force } => {
            use fedfleet_certs::bundle::{Role, write_bundle};
            let name = name.unwrap_or_else(|| role.clone());
            let role = match role.as_str() {
                "registry" => Role::Registry { name, ca_key: with_ca_key },
                "aggregator" => Role::Aggregator { name },
                "operator" => Role::Operator { name },
                "broker" => Role::Broker { name },
                _ => {
                    let id = id.context("--role device needs --id ID")?;
                    Role::Device(DeviceId::new(&id).with_context(|| format!("invalid device id {id:?}"))?)
                }
            };
            if with_ca_key && !matches!(role, Role::Registry { .. }) {
                anyhow::bail!("--with-ca-key is for --role registry only: the CA key stays on the CA host");
            }
            let files = write_bundle(dir, &role, &to, force).with_context(|| format!("cannot bundle {role:?} into {}", to.display()))?;
            out += &format!("wrote {} files for {role:?} into {}\n", files.len(), to.display());
            for f in files {
                out += &format!("  {}\n", f.display());
            }
        }
        Command::Inspect { file, ca } => {
            out += &inspect::describe(&file, ca.as_deref()).context("cannot inspect")?;
        }
    }
    Ok(out)
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(text) => {
            let mut stdout = std::io::stdout().lock();
            match stdout.write_all(text.as_bytes()).and_then(|_| stdout.flush()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: writing output: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Err(e) => {
            // One line: the context chain joined by ": ", no Debug, no backtrace.
            let msg = format!("{e:#}").replace('\n', " ");
            eprintln!("error: {msg}");
            ExitCode::from(1)
        }
    }
}
