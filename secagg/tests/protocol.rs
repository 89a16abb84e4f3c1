//! SecAgg+ rounds run through the client and server cores, devices as values: exactness with
//! drop-outs, the threshold, privacy of what the aggregator holds, and every tampering refused by
//! name.

use std::collections::BTreeSet;

use ed25519_dalek::SigningKey;
use fedfleet_protocol::envelope::Signed;
use fedfleet_protocol::{DeviceId, RoundId};
use fedfleet_secagg::{
    Aggregate, Body, Client, Deadlines, Failure, Message, Params, Refusal, Roster, SecAggError, Server, Stage, UnmaskRequest, encode,
};
use rand::{Rng, SeedableRng};

const DIM: usize = 300;
const T0: u64 = 1_000_000;
const DEADLINES: Deadlines = Deadlines { keys: T0 + 10_000, shares: T0 + 20_000, masked: T0 + 30_000, unmask: T0 + 40_000 };

fn params(threshold: u16, degree: u16) -> Params {
    Params { threshold, degree, frac_bits: 24, clip: 1024.0 }
}

fn device(i: usize) -> DeviceId {
    DeviceId::new(format!("dev-{i:03}")).unwrap()
}

fn key(i: usize) -> SigningKey {
    SigningKey::from_bytes(&[i as u8 + 1; 32])
}

/// A round of `n` devices: the roster, the server, each device's client and its update.
struct Round {
    roster: Roster,
    server: Server,
    clients: Vec<Client>,
    updates: Vec<(Vec<f32>, u64)>,
    /// Each device's masked vector as it sent it.
    sent: Vec<Option<Vec<u64>>>,
}

impl Round {
    fn new(n: usize, p: Params, round: u64) -> Round {
        let devices = (0..n).map(|i| (device(i), key(i).verifying_key().to_bytes())).collect();
        let roster = Roster::new(RoundId(round), p, DIM as u32, [round as u8; 32], devices).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(round);
        let updates = (0..n).map(|_| ((0..DIM).map(|_| rng.gen_range(-0.05f32..0.05)).collect(), rng.gen_range(1..500u64))).collect();
        Round { server: Server::new(roster.clone(), DEADLINES), roster, clients: Vec::new(), updates, sent: vec![None; n] }
    }

    fn n(&self) -> usize {
        self.roster.len()
    }

    /// Stage 1 for every device.
    fn keys(&mut self) {
        for i in 0..self.n() {
            let (c, msg) = Client::new(self.roster.clone(), &device(i), key(i), [i as u8 + 100; 32]).unwrap();
            self.server.handle(&msg, None).unwrap();
            self.clients.push(c);
        }
        assert_eq!(self.server.stage(), Stage::Shares);
    }

    /// Stage 2 for every device not in `silent`; closes the stage at its deadline if needed.
    fn shares(&mut self, silent: &[usize]) -> Vec<Signed<Message>> {
        let mut out = Vec::new();
        for i in (0..self.n()).filter(|i| !silent.contains(i)) {
            let adverts = self.server.keys_for(&device(i));
            let msg = self.clients[i].on_keys(&adverts).unwrap();
            self.server.handle(&msg, None).unwrap();
            out.push(msg);
        }
        self.server.handle_timeout(DEADLINES.shares);
        out
    }

    /// Stage 3 for every device that shared and is not in `silent`.
    fn masked(&mut self, silent: &[usize]) {
        for i in (0..self.n()).filter(|i| !silent.contains(i)) {
            if self.clients[i].stage() != Stage::Shares {
                continue;
            }
            let shares = self.server.shares_for(&device(i));
            let (update, weight) = &self.updates[i];
            let (msg, y) = self.clients[i].on_shares(&shares, update, *weight).unwrap();
            self.server.handle(&msg, Some(&y)).unwrap();
            self.sent[i] = Some(y);
        }
        self.server.handle_timeout(DEADLINES.masked);
    }

    /// Stage 4 for every survivor not in `silent`.
    fn unmask(&mut self, silent: &[usize]) {
        for i in (0..self.n()).filter(|i| !silent.contains(i)) {
            if self.clients[i].stage() != Stage::Masked {
                continue;
            }
            let request = self.server.unmask_request_for(&device(i));
            if !request.survivors.contains(&device(i)) {
                continue; // its masked input was refused
            }
            let msg = self.clients[i].on_unmask(&request).unwrap();
            self.server.handle(&msg, None).unwrap();
        }
        self.server.handle_timeout(DEADLINES.unmask);
    }

    /// The plain exact sum of the given devices' quantized updates (no masks at all).
    fn plain_sum(&self, devices: impl Iterator<Item = usize>) -> (Vec<i64>, u64) {
        let mut sum = vec![0i64; DIM];
        let mut weight = 0;
        for i in devices {
            let (u, w) = &self.updates[i];
            let q = encode(u, *w, &self.roster.params);
            for (s, x) in sum.iter_mut().zip(&q[..DIM]) {
                *s += *x as i64;
            }
            weight += q[DIM];
        }
        (sum, weight)
    }
}

fn done(r: &Round) -> &Aggregate {
    assert_eq!(r.server.stage(), Stage::Done, "{:?}", r.server.failure());
    r.server.result().unwrap()
}

#[test]
fn the_neighbour_graph_is_regular_and_symmetric() {
    let r = Round::new(40, params(4, 8), 1);
    for i in 0..40 {
        let n = r.roster.neighbours(i);
        assert_eq!(n.len(), 8, "device {i}");
        for j in n {
            assert!(r.roster.neighbours(j).contains(&i), "{i} -> {j} is one-way");
        }
    }
    // Fewer devices than the degree: everyone is everyone's neighbour.
    let small = Round::new(5, params(3, 8), 1);
    assert_eq!(small.roster.neighbours(2), vec![0, 1, 3, 4]);
}

/// The exactness case: 20 agents, SecAgg+ on, 3 of them drop out after sending their
/// shares (before their masked input): the unmasked aggregate is bit for bit the plain exact sum
/// of the 17 survivors' quantized updates, and the dropped devices' masks are gone from it.
#[test]
fn twenty_devices_three_dropping_out_unmask_to_the_exact_sum_of_the_survivors() {
    let mut r = Round::new(20, params(5, 10), 7);
    r.keys();
    r.shares(&[]);
    assert_eq!(r.server.stage(), Stage::Masked);
    let dropped = [3, 11, 16];
    r.masked(&dropped);
    assert_eq!(r.server.stage(), Stage::Unmask, "closed at the masked-input deadline");
    r.unmask(&[]);
    let agg = done(&r);
    let survivors: Vec<usize> = (0..20).filter(|i| !dropped.contains(i)).collect();
    let (sum, weight) = r.plain_sum(survivors.iter().copied());
    assert_eq!(agg.sums, sum);
    assert_eq!(agg.total_weight, weight);
    assert_eq!(agg.survivors, survivors.iter().map(|&i| device(i)).collect::<Vec<_>>());
    assert_eq!(agg.dropped, dropped.iter().map(|&i| device(i)).collect::<Vec<_>>());
    // On the round engine's 2^-48 grid the sum is the same integers, shifted.
    assert_eq!(agg.to_fixed(48).unwrap()[0], (sum[0] as i128) << 24);
}

/// Survivors that fall silent at the unmasking stage are still unmasked from their neighbours'
/// shares, as long as enough of those answer.
#[test]
fn survivors_silent_at_unmasking_are_unmasked_from_their_neighbours_shares() {
    let mut r = Round::new(20, params(4, 10), 8);
    r.keys();
    r.shares(&[5]);
    r.masked(&[9]);
    r.unmask(&[0, 13]);
    let agg = done(&r);
    let (sum, weight) = r.plain_sum((0..20).filter(|i| ![5, 9].contains(i)));
    assert_eq!((agg.sums.clone(), agg.total_weight), (sum, weight));
    assert_eq!(agg.dropped, vec![device(9)], "5 never shared: no mask of it is anywhere");
}

#[test]
fn below_the_threshold_the_round_fails_with_its_reason_and_no_sum() {
    // Too few masked inputs.
    let mut r = Round::new(10, params(6, 8), 9);
    r.keys();
    r.shares(&[]);
    r.masked(&[0, 1, 2, 3, 4]);
    assert_eq!(r.server.stage(), Stage::Failed);
    assert_eq!(r.server.failure(), Some(&Failure::BelowThreshold { stage: Stage::Masked, have: 5, threshold: 6 }));
    assert!(r.server.result().is_none());
    assert_eq!(r.server.failure().unwrap().name(), "below_threshold");

    // Enough unmasking answers overall, but too few of one survivor's holders: that survivor's
    // self-mask cannot be removed, so there is no sum rather than a wrong one.
    let mut r = Round::new(12, params(3, 4), 10);
    r.keys();
    r.shares(&[]);
    r.masked(&[]);
    let holders_of_0 = r.roster.neighbours(0);
    r.unmask(&holders_of_0[..2]);
    assert_eq!(r.server.stage(), Stage::Failed);
    assert!(
        matches!(r.server.failure(), Some(Failure::Unrecoverable { device: d, have: 2, need: 3 }) if *d == device(0)),
        "{:?}",
        r.server.failure()
    );
}

/// What the aggregator holds of a device is its masked vector: every coordinate of it differs
/// from the device's clear (quantized) update, and the stage messages carry no update at all.
#[test]
fn nothing_individual_is_in_the_clear() {
    let mut r = Round::new(12, params(3, 6), 11);
    r.keys();
    let share_msgs = r.shares(&[]);
    r.masked(&[]);
    for i in 0..12 {
        let clear = encode(&r.updates[i].0, r.updates[i].1, &r.roster.params);
        let masked = r.sent[i].as_ref().unwrap();
        let same = clear.iter().zip(masked).filter(|(a, b)| a == b).count();
        assert_eq!(same, 0, "device {i}: {same} coordinates in the clear");
        for m in &share_msgs {
            let bytes = m.encode();
            let needle: Vec<u8> = clear[..4].iter().flat_map(|x| x.to_le_bytes()).collect();
            assert!(!bytes.windows(needle.len()).any(|w| w == needle));
        }
    }
    r.unmask(&[]);
    done(&r);
}

#[test]
fn forged_replayed_duplicate_and_out_of_stage_messages_are_refused_by_name() {
    let mut r = Round::new(8, params(3, 4), 12);
    let (_, good) = Client::new(r.roster.clone(), &device(0), key(0), [1; 32]).unwrap();
    // Forged: device 0's message signed with another key.
    let forged = Signed::sign(good.body().clone(), &key(99));
    assert_eq!(r.server.handle(&forged, None), Err(Refusal::BadSignature));
    // Replayed from another round: a valid message of device 0 for round 11.
    let other = Round::new(8, params(3, 4), 11);
    let (_, old) = Client::new(other.roster.clone(), &device(0), key(0), [1; 32]).unwrap();
    assert_eq!(r.server.handle(&old, None), Err(Refusal::WrongSession));
    // Not in the roster.
    let stranger = Signed::sign(Message { device: device(50), ..good.body().clone() }, &key(50));
    assert_eq!(r.server.handle(&stranger, None), Err(Refusal::NotInRoster(device(50))));
    // Accepted once, then a duplicate.
    r.server.handle(&good, None).unwrap();
    assert_eq!(r.server.handle(&good, None), Err(Refusal::Duplicate(device(0))));
    // A later stage's message while keys are collected.
    let early = Signed::sign(Message { body: Body::Unmask { self_mask: vec![], key: vec![] }, ..good.body().clone() }, &key(0));
    assert_eq!(r.server.handle(&early, None), Err(Refusal::WrongStage { now: Stage::Keys, got: Stage::Unmask }));
    for name in [Refusal::BadSignature.name(), Refusal::WrongSession.name(), Refusal::Duplicate(device(0)).name()] {
        assert!(!name.contains(' '));
    }
}

/// Tampering at the unmasking stage: a device that gives both shares of one neighbour (the
/// consistency check), shares it cannot hold, malformed shares, and a masked vector that does not
/// match its signature or masks other pairs — each refused with its reason; the round still
/// unmasks exactly from the honest answers.
#[test]
fn tampered_shares_and_vectors_are_refused_and_the_round_still_unmasks_exactly() {
    let mut r = Round::new(10, params(3, 6), 13);
    r.keys();
    r.shares(&[]);
    // Device 4 sends a vector that differs from the one it signed.
    let shares = r.server.shares_for(&device(4));
    let (msg4, mut y4) = r.clients[4].on_shares(&shares, &r.updates[4].0, r.updates[4].1).unwrap();
    y4[0] ^= 1;
    assert!(matches!(r.server.handle(&msg4, Some(&y4)), Err(Refusal::BadVector(_))));
    // Device 6 claims a mask set other than the shares it was forwarded.
    let shares = r.server.shares_for(&device(6));
    let (msg6, y6) = r.clients[6].on_shares(&shares[1..], &r.updates[6].0, r.updates[6].1).unwrap();
    assert_eq!(r.server.handle(&msg6, Some(&y6)), Err(Refusal::MaskSetMismatch(device(6))));
    r.masked(&[4, 6]);
    assert_eq!(r.server.stage(), Stage::Unmask);

    // A device with a dropped neighbour answers honestly; tampered versions of its answer first.
    let t = (0..10).find(|&i| ![4, 6].contains(&i) && r.roster.neighbours(i).iter().any(|j| [4, 6].contains(j))).unwrap();
    let request = r.server.unmask_request_for(&device(t));
    let honest = r.clients[t].on_unmask(&request).unwrap();
    let Body::Unmask { self_mask, key: key_shares } = honest.body().body.clone() else { panic!() };
    assert!(!self_mask.is_empty() && !key_shares.is_empty(), "device {t} has surviving and dropped neighbours");
    let resign = |self_mask: Vec<(DeviceId, Vec<u8>)>, key_shares: Vec<(DeviceId, Vec<u8>)>| {
        Signed::sign(Message { body: Body::Unmask { self_mask, key: key_shares }, ..honest.body().clone() }, &key(t))
    };
    // The consistency check: both shares of one neighbour (here a dropped one, claimed a survivor too).
    let (dropped, share) = key_shares[0].clone();
    let mut both = self_mask.clone();
    both.push((dropped.clone(), share));
    assert_eq!(r.server.handle(&resign(both, key_shares.clone()), None), Err(Refusal::InconsistentShares { about: dropped }));
    // A survivor's key share is never given out.
    let mut keyed = key_shares.clone();
    keyed.push(self_mask[0].clone());
    let refused = r.server.handle(&resign(self_mask[1..].to_vec(), keyed), None).unwrap_err();
    assert!(matches!(&refused, Refusal::MalformedShare { detail, .. } if detail.contains("key share of a survivor")), "{refused:?}");
    // Malformed: truncated, and a wrong x coordinate.
    let mut short = self_mask.clone();
    short[0].1.truncate(10);
    assert_eq!(r.server.handle(&resign(short, key_shares.clone()), None).unwrap_err().name(), "malformed_share");
    let mut shifted = self_mask.clone();
    shifted[0].1[0] = shifted[0].1[0].wrapping_add(1);
    assert_eq!(r.server.handle(&resign(shifted, key_shares.clone()), None).unwrap_err().name(), "malformed_share");
    // The honest answer is taken; the rest answer; the sum is exact.
    r.server.handle(&honest, None).unwrap();
    r.unmask(&[t]);
    let agg = done(&r);
    let (sum, weight) = r.plain_sum((0..10).filter(|i| ![4, 6].contains(i)));
    assert_eq!((agg.sums.clone(), agg.total_weight), (sum, weight));
}

/// The device side of the consistency check: it answers one unmasking request per round, never a
/// request that names a neighbour both survivor and dropped, drops itself, or leaves fewer
/// survivors than the threshold.
#[test]
fn a_device_answers_one_consistent_unmask_request_only() {
    let mut r = Round::new(8, params(3, 4), 14);
    r.keys();
    r.shares(&[]);
    r.masked(&[]);
    let request = r.server.unmask_request_for(&device(1));
    let neighbour = device(r.roster.neighbours(1)[0]);
    let mut both = request.clone();
    both.dropped.push(neighbour.clone());
    assert!(matches!(r.clients[1].on_unmask(&both), Err(SecAggError::BadRequest(m)) if m.contains("survivor and dropped")));
    let few = UnmaskRequest { survivors: vec![device(1), neighbour], dropped: vec![] };
    assert!(matches!(r.clients[1].on_unmask(&few), Err(SecAggError::BadRequest(m)) if m.contains("under the threshold")));
    let me_dropped = UnmaskRequest { survivors: request.survivors.clone(), dropped: vec![device(1)] };
    assert!(matches!(r.clients[1].on_unmask(&me_dropped), Err(SecAggError::BadRequest(_))));
    r.clients[1].on_unmask(&request).unwrap();
    // A second request (e.g. now naming a survivor dropped, to get its key share) is refused.
    let survivors: BTreeSet<_> = request.survivors.iter().cloned().collect();
    let second = UnmaskRequest { survivors: survivors.iter().skip(1).cloned().collect(), dropped: vec![request.survivors[0].clone()] };
    assert_eq!(r.clients[1].on_unmask(&second), Err(SecAggError::AlreadyAnswered));
}

#[test]
fn parameters_that_could_overflow_or_cannot_recover_are_refused() {
    let devices = |n: usize| (0..n).map(|i| (device(i), key(i).verifying_key().to_bytes())).collect::<Vec<_>>();
    let refused = |p: Params, n: usize| Roster::new(RoundId(1), p, 10, [0; 32], devices(n)).unwrap_err().to_string();
    assert!(refused(params(9, 8), 20).contains("threshold 9"));
    assert!(refused(params(3, 7), 20).contains("degree 7 must be even"));
    assert!(refused(Params { clip: 1e12, ..params(3, 4) }, 20).contains("overflow"));
    assert!(refused(Params { clip: f64::NAN, ..params(3, 4) }, 20).contains("clip"));
    let mut twice = devices(5);
    twice.push(twice[0].clone());
    assert!(Roster::new(RoundId(1), params(3, 4), 10, [0; 32], twice).unwrap_err().to_string().contains("twice"));
}

/// The seam to the round engine: on updates that lie on the SecAgg grid, the unmasked aggregate
/// is the very `PartialSum` the plain exact fold makes (same integers, same Σw, same count), so a
/// SecAgg round finalizes to the bit-identical model.
#[test]
fn the_unmasked_aggregate_is_the_plain_folds_partial_sum() {
    use fedfleet_rounds::PartialSum;
    use fedfleet_rounds::strategy::fixed::FRAC_BITS;
    let mut r = Round::new(15, params(4, 8), 21);
    let grid = (1u64 << r.roster.params.frac_bits) as f64;
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for (u, w) in r.updates.iter_mut() {
        for x in u.iter_mut() {
            *x = (rng.gen_range(-1_000_000i64..1_000_000) as f64 / grid) as f32;
        }
        *w = rng.gen_range(1..2_000);
    }
    r.keys();
    r.shares(&[]);
    r.masked(&[2, 7]);
    r.unmask(&[]);
    let agg = done(&r);
    let survivors: Vec<usize> = (0..15).filter(|i| ![2, 7].contains(i)).collect();
    let secure = PartialSum::from_raw(agg.to_fixed(FRAC_BITS).unwrap(), agg.total_weight, survivors.len() as u64).unwrap();
    let mut plain = PartialSum::new(DIM);
    for &i in &survivors {
        plain.fold(&r.updates[i].0, r.updates[i].1).unwrap();
    }
    assert_eq!(secure, plain);
    assert_eq!(secure.mean().unwrap(), plain.mean().unwrap());
}
