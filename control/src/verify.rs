//! Verification of everything that arrives over MQTT. The broker is not trusted: every message
//! that matters is signed, and checked here against a pinned key (announcements, rollout notices,
//! receipts) or the allow-list key of the device the topic names (status, update headers).

use std::collections::HashMap;

use crate::exchange::SignedAnswer;
use crate::rejection::SignedRejection;
use crate::sealed::{SealError, Sealed, SealedBody};
use ed25519_dalek::VerifyingKey;
use fedfleet_certs::{AllowList, DeviceStatus as KeyStatus};
use fedfleet_protocol::{
    DeviceId, DeviceStatus, EnvelopeError, FleetId, Receipt, RejectReason, RolloutNotice, RoundAnnouncement, Signable, Signed, SignedUpdate,
};

/// Where a device's public key comes from: the fleet allow-list in production, a map in tests.
pub trait DeviceKeys: Send + Sync {
    /// Unknown, revoked or enrolled with its key.
    fn lookup(&self, device: &DeviceId) -> KeyStatus;
}

impl DeviceKeys for AllowList {
    fn lookup(&self, device: &DeviceId) -> KeyStatus {
        self.status(device)
    }
}

impl DeviceKeys for HashMap<DeviceId, VerifyingKey> {
    fn lookup(&self, device: &DeviceId) -> KeyStatus {
        match self.get(device) {
            Some(k) => KeyStatus::Enrolled(*k),
            None => KeyStatus::Unknown,
        }
    }
}

/// A message refused, with its named reason. Counted in [`crate::ControlStats`] and delivered as
/// [`crate::ControlEvent::Rejected`]; never fatal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    pub topic: String,
    /// The device the topic names, if it names one.
    pub device: Option<DeviceId>,
    pub reason: RejectReason,
    pub detail: String,
}

impl Rejected {
    pub fn new(topic: &str, device: Option<&DeviceId>, reason: RejectReason, detail: impl Into<String>) -> Self {
        Rejected { topic: topic.to_owned(), device: device.cloned(), reason, detail: detail.into() }
    }
}

impl std::fmt::Display for Rejected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} on {}: {}", self.reason, self.topic, self.detail)
    }
}

fn envelope_err(topic: &str, device: Option<&DeviceId>, e: EnvelopeError) -> Rejected {
    Rejected::new(topic, device, e.reason(), e.to_string())
}

fn decode_verify<T: Signable>(topic: &str, device: Option<&DeviceId>, bytes: &[u8], key: &VerifyingKey) -> Result<Signed<T>, Rejected> {
    let signed = Signed::<T>::decode(bytes).map_err(|e| envelope_err(topic, device, e))?;
    signed.verify(key).map_err(|e| envelope_err(topic, device, e))?;
    Ok(signed)
}

fn check_fleet(topic: &str, device: Option<&DeviceId>, ours: &FleetId, theirs: &FleetId) -> Result<(), Rejected> {
    if ours != theirs {
        return Err(Rejected::new(topic, device, RejectReason::WrongFleet, format!("message names fleet {theirs}, this is fleet {ours}")));
    }
    Ok(())
}

/// The key of the device named in the topic, or why there is none.
pub fn device_key(topic: &str, device: &DeviceId, keys: &dyn DeviceKeys) -> Result<VerifyingKey, Rejected> {
    match keys.lookup(device) {
        KeyStatus::Enrolled(k) => Ok(k),
        KeyStatus::Revoked => Err(Rejected::new(topic, Some(device), RejectReason::Revoked, format!("device {device} is revoked"))),
        KeyStatus::Unknown => {
            Err(Rejected::new(topic, Some(device), RejectReason::UnknownDevice, format!("device {device} is not enrolled")))
        }
    }
}

/// A round announcement signed by the aggregator key pinned at enrollment, for our fleet.
pub fn announcement(topic: &str, bytes: &[u8], fleet: &FleetId, aggregator: &VerifyingKey) -> Result<Signed<RoundAnnouncement>, Rejected> {
    let signed = decode_verify::<RoundAnnouncement>(topic, None, bytes, aggregator)?;
    check_fleet(topic, None, fleet, &signed.body().fleet)?;
    Ok(signed)
}

/// A rollout notice signed by the pinned registry key, for our fleet.
pub fn rollout(topic: &str, bytes: &[u8], fleet: &FleetId, registry: &VerifyingKey) -> Result<Signed<RolloutNotice>, Rejected> {
    let signed = decode_verify::<RolloutNotice>(topic, None, bytes, registry)?;
    check_fleet(topic, None, fleet, &signed.body().fleet)?;
    Ok(signed)
}

/// A receipt for `device`, signed by the pinned aggregator key.
pub fn receipt(
    topic: &str,
    bytes: &[u8],
    fleet: &FleetId,
    device: &DeviceId,
    aggregator: &VerifyingKey,
) -> Result<Signed<Receipt>, Rejected> {
    let signed = decode_verify::<Receipt>(topic, Some(device), bytes, aggregator)?;
    check_fleet(topic, Some(device), fleet, &signed.body().fleet)?;
    addressed_to(topic, device, &signed.body().device, "receipt")?;
    Ok(signed)
}

/// A refusal of one of `device`'s MQTT uploads, signed by the pinned aggregator key.
pub fn rejection(
    topic: &str,
    bytes: &[u8],
    fleet: &FleetId,
    device: &DeviceId,
    aggregator: &VerifyingKey,
) -> Result<SignedRejection, Rejected> {
    sealed_for(topic, bytes, fleet, device, aggregator)
}

/// An answer to one of `device`'s requests, signed by the pinned aggregator key.
pub fn answer(topic: &str, bytes: &[u8], fleet: &FleetId, device: &DeviceId, aggregator: &VerifyingKey) -> Result<SignedAnswer, Rejected> {
    sealed_for(topic, bytes, fleet, device, aggregator)
}

/// A sealed message for `device` in our fleet, signed by the pinned aggregator key.
fn sealed_for<T: SealedBody>(
    topic: &str,
    bytes: &[u8],
    fleet: &FleetId,
    device: &DeviceId,
    aggregator: &VerifyingKey,
) -> Result<Sealed<T>, Rejected> {
    let err = |e: SealError| Rejected::new(topic, Some(device), e.reason(), e.to_string());
    let signed = Sealed::<T>::decode(bytes).map_err(err)?;
    signed.verify(aggregator).map_err(err)?;
    check_fleet(topic, Some(device), fleet, signed.body().fleet())?;
    addressed_to(topic, device, signed.body().device(), T::NAME)?;
    Ok(signed)
}

/// An answer (`what`) on `device`'s topic must name that device.
fn addressed_to(topic: &str, device: &DeviceId, named: &DeviceId, what: &str) -> Result<(), Rejected> {
    if named != device {
        return Err(Rejected::new(topic, Some(device), RejectReason::BadSignature, format!("{what} names device {named}")));
    }
    Ok(())
}

fn same_device(topic: &str, on_topic: &DeviceId, signed: &DeviceId) -> Result<(), Rejected> {
    if on_topic != signed {
        return Err(Rejected::new(
            topic,
            Some(on_topic),
            RejectReason::BadSignature,
            format!("signed body names device {signed}, the topic names {on_topic}"),
        ));
    }
    Ok(())
}

/// A device status on `devices/<device>/status`: signed by that device's enrolled key, naming
/// that device and our fleet.
pub fn status(
    topic: &str,
    bytes: &[u8],
    fleet: &FleetId,
    device: &DeviceId,
    keys: &dyn DeviceKeys,
) -> Result<Signed<DeviceStatus>, Rejected> {
    let key = device_key(topic, device, keys)?;
    let signed = decode_verify::<DeviceStatus>(topic, Some(device), bytes, &key)?;
    same_device(topic, device, &signed.body().device)?;
    check_fleet(topic, Some(device), fleet, &signed.body().fleet)?;
    Ok(signed)
}

/// An update header on `devices/<device>/updates`: signed by that device's enrolled key (returned
/// with it), naming that device and our fleet. The payload is checked against it by
/// [`crate::UpdateAssembler`].
pub fn update_header(
    topic: &str,
    bytes: &[u8],
    fleet: &FleetId,
    device: &DeviceId,
    keys: &dyn DeviceKeys,
) -> Result<(SignedUpdate, VerifyingKey), Rejected> {
    let key = device_key(topic, device, keys)?;
    let signed = decode_verify::<fedfleet_protocol::UpdateHeader>(topic, Some(device), bytes, &key)?;
    same_device(topic, device, &signed.body().device)?;
    check_fleet(topic, Some(device), fleet, &signed.body().fleet)?;
    Ok((signed, key))
}
