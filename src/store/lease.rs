//! Leases on exported datasets: what keeps device memory mapped by other processes alive.
//!
//! An `ipc-export` hands out IPC handles, which are capabilities to device memory the server
//! would otherwise free when the dataset is dropped or replaced. A [`Lease`] holds the
//! exported [`Dataset`] (an `Arc`, like a running read), so `drop` and `replace` still remove
//! the name from the catalog at once, while the memory (and its budget reservation) stays
//! until the last lease on it ends: released by its consumer, or expired. Expiry needs no
//! client: the reaper task ends leases whose time is up, so a consumer that crashed holds
//! memory for at most its lease.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime};

use super::dataset::Dataset;
use super::error::StoreError;
use super::memfile::StagedFile;
use super::slot::{Resident, StoredPartition};

/// One consumer's hold on an exported dataset.
#[derive(Debug, Clone)]
pub struct Lease {
    pub id: String,
    pub dataset: Arc<Dataset>,
    /// What was exported under it, kept as granted when it is renewed.
    pub terms: LeaseTerms,
    /// The principal it was granted to: with the admins, the only one `status` shows its id.
    pub owner: String,
    /// When the lease ends unless renewed, on the wall clock (reported) and the monotonic one
    /// (enforced).
    pub expires_at: SystemTime,
    deadline: Instant,
    /// How long it was last granted or renewed for: what a renewal that names no length
    /// extends it by.
    term: Duration,
}

/// What a lease exports.
#[derive(Debug, Clone)]
pub struct LeaseTerms {
    /// The exported columns.
    pub columns: Vec<String>,
    /// The device the consumer said it computes on.
    pub consumer: Option<u32>,
    /// Whether partitions on other devices were replicated onto the consumer's.
    pub copy: bool,
    /// Per partition of the dataset, the device memory exported: held so that no spill frees
    /// it while consumers may have it mapped.
    pub(crate) held: Arc<Vec<Arc<Resident>>>,
    /// Per partition of the dataset, its replica on the consumer's device, if one was made
    /// ([`replica_held`]): held by the lease alone, so its memory returns when the lease ends,
    /// and never spilled before, since consumers may have it mapped.
    pub(crate) replicas: Arc<Vec<Option<Arc<Resident>>>>,
    /// A shared-memory read's files (`shm-read`), held by the lease alone: their memory
    /// returns when the lease ends, and they are revoked then (emptied, whoever maps them).
    pub(crate) staged: Option<Arc<Vec<StagedFile>>>,
}

impl LeaseTerms {
    /// Backend memory the lease's replicas hold.
    pub fn replica_bytes(&self) -> u64 {
        self.replicas
            .iter()
            .flatten()
            .map(|replica| replica.reservation.bytes())
            .sum()
    }

    /// Bytes of the lease's shared-memory files, if it has any.
    pub fn staged_bytes(&self) -> u64 {
        self.staged
            .as_ref()
            .map_or(0, |staged| staged.iter().map(|file| file.bytes).sum())
    }
}

/// A replica made for a lease (`tiers.hold` of its copy), as the lease holds it: its memory,
/// not its place in the tiers. A partition in the tiers that nobody holds may be spilled to
/// make room, which would free device memory the lease's consumers have mapped; the
/// memory held alone is in no tier, so nothing moves it, and it goes when the lease does.
pub(crate) fn replica_held(replica: StoredPartition) -> Arc<Resident> {
    replica.slot.resident()
}

impl Lease {
    pub(crate) fn new(
        dataset: Arc<Dataset>,
        terms: LeaseTerms,
        duration: Duration,
        owner: String,
    ) -> Self {
        Self {
            id: new_lease_id(),
            dataset,
            terms,
            owner,
            expires_at: SystemTime::now() + duration,
            deadline: Instant::now() + duration,
            term: duration,
        }
    }

    fn renew(&mut self, duration: Duration) {
        self.expires_at = SystemTime::now() + duration;
        self.deadline = Instant::now() + duration;
        self.term = duration;
    }
}

/// 128 random bits, hex: unguessable, so one consumer cannot release another's lease by
/// accident or on purpose.
fn new_lease_id() -> String {
    let mut bytes = [0u8; 16];
    if getrandom::fill(&mut bytes).is_err() {
        // No OS randomness (never seen in practice): fall back to time and a counter, which
        // are unique though guessable.
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        bytes[..8].copy_from_slice(&nanos.to_le_bytes());
        let count = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        bytes[8..].copy_from_slice(&count.to_le_bytes());
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The live leases of a store.
#[derive(Debug, Default)]
pub(crate) struct Leases {
    leases: Mutex<HashMap<String, Lease>>,
}

impl Leases {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Lease>> {
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts `lease`.
    pub(crate) fn insert(&self, lease: Lease) {
        self.lock().insert(lease.id.clone(), lease);
    }

    /// Fails where `owner` holds `max` `ipc-export` leases already (those of `shm-read`
    /// count against their own quota).
    pub(crate) fn check_exports(&self, owner: &str, max: u32) -> Result<(), StoreError> {
        Self::exports_within(&self.lock(), owner, max)
    }

    /// Starts `lease`, an `ipc-export`'s, where its owner holds fewer than `max` such.
    pub(crate) fn insert_export(&self, lease: Lease, max: u32) -> Result<(), StoreError> {
        let mut leases = self.lock();
        Self::exports_within(&leases, &lease.owner, max)?;
        leases.insert(lease.id.clone(), lease);
        Ok(())
    }

    fn exports_within(
        leases: &HashMap<String, Lease>,
        owner: &str,
        max: u32,
    ) -> Result<(), StoreError> {
        let now = Instant::now();
        // One whose time is up counts no more, whether or not the reaper has ended it.
        let held = leases
            .values()
            .filter(|lease| {
                lease.owner == owner && lease.terms.staged.is_none() && lease.deadline > now
            })
            .count();
        if held >= max as usize {
            return Err(StoreError::TooManyLeases {
                owner: owner.to_owned(),
                max,
            });
        }
        Ok(())
    }

    /// Extends lease `id`, which must be `owner`'s (checked first: another principal learns
    /// nothing of it), on dataset `name` and pass `check`, to end `duration` from now. A
    /// lease that fails any is left as it was.
    pub(crate) fn renew(
        &self,
        id: &str,
        name: &str,
        owner: &str,
        duration: Duration,
        check: impl FnOnce(&Lease) -> Result<(), StoreError>,
    ) -> Result<Lease, StoreError> {
        self.extend(id, Some(duration), |lease| {
            if lease.owner != owner {
                return Err(StoreError::LeaseNotYours {
                    lease: id.to_owned(),
                });
            }
            if lease.dataset.name() != name {
                return Err(StoreError::LeaseMismatch {
                    lease: id.to_owned(),
                    leased: lease.dataset.name().to_owned(),
                    requested: name.to_owned(),
                });
            }
            check(lease)
        })
    }

    /// Extends lease `id`, which must pass `check`, to end `duration` from now (`None`: its
    /// last term). A lease that fails `check` is left as it was.
    pub(crate) fn extend(
        &self,
        id: &str,
        duration: Option<Duration>,
        check: impl FnOnce(&Lease) -> Result<(), StoreError>,
    ) -> Result<Lease, StoreError> {
        let mut leases = self.lock();
        let not_found = || StoreError::LeaseNotFound {
            lease: id.to_owned(),
        };
        let lease = leases.get_mut(id).ok_or_else(not_found)?;
        if lease.deadline <= Instant::now() {
            let expired = leases.remove(id);
            drop(leases);
            // Its memory (a replica's, a file's) is freed here, outside the lock.
            drop(expired);
            return Err(not_found());
        }
        check(lease)?;
        lease.renew(duration.unwrap_or(lease.term));
        Ok(lease.clone())
    }

    /// Ends lease `id`; `None` if it had already ended.
    pub(crate) fn release(&self, id: &str) -> Option<Lease> {
        self.lock().remove(id)
    }

    /// Ends lease `id` if it passes `check`, which sees it first; a lease that fails is left
    /// as it was.
    pub(crate) fn release_if(
        &self,
        id: &str,
        check: impl FnOnce(&Lease) -> Result<(), StoreError>,
    ) -> Result<Lease, StoreError> {
        let mut leases = self.lock();
        let lease = leases.get(id).ok_or_else(|| StoreError::LeaseNotFound {
            lease: id.to_owned(),
        })?;
        check(lease)?;
        leases.remove(id).ok_or_else(|| StoreError::LeaseNotFound {
            lease: id.to_owned(),
        })
    }

    /// Ends every lease whose time is up; returns them (dropping them may free memory).
    pub(crate) fn expire(&self, now: Instant) -> Vec<Lease> {
        let mut leases = self.lock();
        let expired: Vec<String> = leases
            .iter()
            .filter(|(_, lease)| lease.deadline <= now)
            .map(|(id, _)| id.clone())
            .collect();
        expired.iter().filter_map(|id| leases.remove(id)).collect()
    }

    /// The live leases, soonest to expire first.
    pub(crate) fn list(&self) -> Vec<Lease> {
        let mut leases: Vec<Lease> = self.lock().values().cloned().collect();
        leases.sort_by_key(|l| l.deadline);
        leases
    }
}

/// Ends expired `leases` every `period` until they are gone (with their store).
pub(crate) fn spawn_reaper(leases: Weak<Leases>, period: Duration) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let Some(live) = leases.upgrade() else {
                return;
            };
            for lease in live.expire(Instant::now()) {
                tracing::info!(
                    lease = %lease.id,
                    dataset = lease.dataset.name(),
                    "lease expired without a release"
                );
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use arrow::datatypes::Schema;

    use super::*;

    fn dataset(name: &str) -> Arc<Dataset> {
        let budget = crate::store::memory::MemoryBudget::new(vec![None]);
        let schema_charge = Arc::new(budget.try_reserve(0, 0).expect("unlimited"));
        Arc::new(Dataset::new(
            name.to_owned(),
            Arc::new(Schema::empty()),
            crate::store::dataset::Version::new(1),
            Vec::new(),
            schema_charge,
        ))
    }

    /// An export's terms that hold nothing.
    fn terms() -> LeaseTerms {
        LeaseTerms {
            columns: vec![],
            consumer: None,
            copy: false,
            held: Arc::new(vec![]),
            replicas: Arc::new(vec![]),
            staged: None,
        }
    }

    fn grant(leases: &Leases, name: &str) -> Lease {
        let lease = Lease::new(dataset(name), terms(), Duration::from_secs(10), "o".into());
        leases.insert(lease.clone());
        lease
    }

    #[test]
    fn leases_renew_for_their_own_dataset_and_expire() {
        let leases = Leases::default();
        let lease = grant(&leases, "a");
        assert_eq!(lease.id.len(), 32);
        assert!(matches!(
            leases.renew(&lease.id, "b", "o", Duration::from_secs(60), |_| Ok(())),
            Err(StoreError::LeaseMismatch { .. })
        ));
        // Another principal learns nothing of it, not even its dataset.
        assert!(matches!(
            leases.renew(&lease.id, "b", "x", Duration::from_secs(60), |_| Ok(())),
            Err(StoreError::LeaseNotYours { .. })
        ));
        let renewed = leases
            .renew(&lease.id, "a", "o", Duration::from_secs(60), |_| Ok(()))
            .expect("renew");
        assert!(renewed.expires_at > lease.expires_at);
        assert!(
            leases
                .expire(Instant::now() + Duration::from_secs(30))
                .is_empty()
        );
        let expired = leases.expire(Instant::now() + Duration::from_secs(61));
        assert_eq!(expired.len(), 1);
        assert!(matches!(
            leases.renew(&lease.id, "a", "o", Duration::from_secs(1), |_| Ok(())),
            Err(StoreError::LeaseNotFound { .. })
        ));
        assert!(leases.release(&lease.id).is_none());
        let other = grant(&leases, "a");
        assert_ne!(other.id, lease.id);
        assert_eq!(leases.release(&other.id).map(|l| l.id), Some(other.id));
        assert!(leases.list().is_empty());
    }

    #[test]
    fn an_extension_keeps_the_term_unless_it_names_one() {
        let leases = Leases::default();
        let lease = grant(&leases, "a");
        let same = leases.extend(&lease.id, None, |_| Ok(())).expect("extend");
        assert_eq!(same.term, Duration::from_secs(10));
        let longer = leases
            .extend(&lease.id, Some(Duration::from_secs(60)), |_| Ok(()))
            .expect("extend");
        assert!(longer.expires_at > same.expires_at);
        let refused = leases.extend(&lease.id, Some(Duration::from_secs(1)), |l| {
            Err(StoreError::LeaseNotYours {
                lease: l.id.clone(),
            })
        });
        assert!(matches!(refused, Err(StoreError::LeaseNotYours { .. })));
        assert_eq!(leases.list()[0].term, Duration::from_secs(60), "unchanged");
    }

    /// A lease whose time is up no longer counts against its owner's limit, whether or not
    /// the reaper has ended it yet.
    #[test]
    fn expired_leases_do_not_count_against_the_limit() {
        let leases = Leases::default();
        let terms = terms();
        let expired = Lease::new(dataset("a"), terms.clone(), Duration::ZERO, "o".into());
        leases.insert_export(expired, 1).expect("the first");
        let live = Lease::new(
            dataset("a"),
            terms.clone(),
            Duration::from_secs(60),
            "o".into(),
        );
        leases
            .insert_export(live, 1)
            .expect("the first has expired");
        let more = Lease::new(dataset("a"), terms, Duration::from_secs(60), "o".into());
        assert!(matches!(
            leases.insert_export(more, 1),
            Err(StoreError::TooManyLeases { max: 1, .. })
        ));
    }
}
