//! Shared-memory reads (`shm-read`): rows staged in a sealed memory file (`memfile`) which a
//! process on this node maps without a copy, opened by a one-time token.
//!
//! The file has no path: the only ways to it are the server's descriptor and the copies the
//! server hands out, one per token, over its Unix side channel (`crate::server`). So who may
//! read it is decided by who holds a token, not by file permissions.
//!
//! The file lives under a lease in the store's [`Leases`], like an `ipc-export`'s memory, and
//! goes with it: on `ipc-release`, or on expiry (`lease-renew` extends it), and is revoked then
//! (`memfile`). Until its token is claimed the lease runs only
//! as long as the token is valid, so a file nobody comes for is freed when its token expires;
//! a claim extends it to the lease the caller asked for.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use arrow::datatypes::Schema;
use arrow::ipc::writer::IpcWriteOptions;
use sha2::{Digest, Sha256};

use super::dataset::Dataset;
use super::error::StoreError;
use super::lease::{Lease, LeaseTerms, Leases};
use super::memfile::{QuotaCharge, Quotas, SharedFileWriter, SharedLimits, StagedFile};
use super::tier::Tiers;

/// A token's claim: the lease whose file it opens, for whom, until when.
#[derive(Debug)]
struct Claim {
    lease: String,
    dataset: String,
    /// The user the file was asked for from, where the call came over a Unix socket.
    uid: Option<u32>,
    deadline: Instant,
    /// The lease's length once claimed.
    lease_duration: Duration,
}

/// Whom a staged file is granted to, and for how long.
#[derive(Debug, Clone)]
pub struct ShareTerms {
    /// The principal, whose quota pays for the file and who owns the lease.
    pub owner: String,
    /// The file's columns, as the lease lists them.
    pub columns: Vec<String>,
    /// The only user who may claim the token (where the call came over a Unix socket);
    /// `None`: whoever holds it.
    pub uid: Option<u32>,
    /// How long the lease lasts once the token is claimed (until then, the token's time).
    pub lease_duration: Duration,
}

/// A staged file granted: its lease and the one-time token that opens it.
#[derive(Debug, Clone)]
pub struct SharedGrant {
    pub lease: Lease,
    /// 256 random bits, hex; single use.
    pub token: String,
    pub token_expires_at: SystemTime,
    pub bytes: u64,
    pub rows: u64,
}

/// A claimed token: the descriptors of its files, in order, and its lease.
#[derive(Debug)]
pub struct ClaimedFile {
    pub fds: Vec<OwnedFd>,
    pub lease: String,
    /// The files' sizes, together.
    pub bytes: u64,
}

/// The writers of one `shm-read`'s files: one set on its principal's quota (`--shm-max-files`
/// counts reads, not files), each file on the memory budget as it is written.
pub struct FileSetWriter {
    tiers: Arc<Tiers>,
    quota: QuotaCharge,
    schema: Schema,
    options: IpcWriteOptions,
}

impl std::fmt::Debug for FileSetWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileSetWriter").finish_non_exhaustive()
    }
}

impl FileSetWriter {
    /// A new file of the set.
    pub fn file(&self) -> Result<SharedFileWriter, StoreError> {
        let reservation = self.tiers.reserve_host_copy(0)?;
        SharedFileWriter::create(
            reservation,
            Arc::clone(&self.tiers),
            self.quota.another(),
            &self.schema,
            self.options.clone(),
        )
    }
}

/// The shared-memory files of a store: the quotas, and the tokens not yet claimed.
#[derive(Debug)]
pub(crate) struct SharedFiles {
    tiers: Arc<Tiers>,
    leases: Arc<Leases>,
    quotas: Arc<Quotas>,
    /// By the SHA-256 of the token, so that looking one up says nothing of the others.
    tokens: Mutex<HashMap<[u8; 32], Claim>>,
}

impl SharedFiles {
    pub(crate) fn new(tiers: Arc<Tiers>, leases: Arc<Leases>) -> Self {
        Self {
            tiers,
            leases,
            quotas: Arc::default(),
            tokens: Mutex::default(),
        }
    }

    fn tokens(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Claim>> {
        self.tokens.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new set of files for `owner`'s rows of `schema`, written as `options` say; fails
    /// where `owner` holds `limits.max_files` sets already.
    pub(crate) fn writer(
        &self,
        owner: &str,
        schema: &Schema,
        options: IpcWriteOptions,
        limits: &SharedLimits,
    ) -> Result<FileSetWriter, StoreError> {
        Ok(FileSetWriter {
            tiers: Arc::clone(&self.tiers),
            quota: QuotaCharge::open(&self.quotas, owner, limits)?,
            schema: schema.clone(),
            options,
        })
    }

    /// Grants `staged` (rows of `dataset`, in files read in this order) as `terms` say, under
    /// a lease and a new token.
    pub(crate) fn grant(
        &self,
        dataset: &Dataset,
        staged: Vec<StagedFile>,
        terms: ShareTerms,
        limits: &SharedLimits,
    ) -> Result<SharedGrant, StoreError> {
        let ShareTerms {
            owner,
            columns,
            uid,
            lease_duration,
        } = terms;
        let mut token = [0u8; 32];
        getrandom::fill(&mut token)
            .map_err(|e| StoreError::SharedMemory(format!("no randomness for the token: {e}")))?;
        let token = hex::encode(token);
        let bytes = staged.iter().map(|file| file.bytes).sum();
        let rows = staged.iter().map(|file| file.rows).sum();
        let ttl = limits.token_ttl.min(lease_duration);
        let terms = LeaseTerms {
            columns,
            consumer: None,
            copy: false,
            held: Arc::new(Vec::new()),
            replicas: Arc::new(Vec::new()),
            staged: Some(Arc::new(staged)),
        };
        // The lease names the version read, but holds none of its memory: the file is a copy.
        let lease = Lease::new(Arc::new(dataset.without_rows()), terms, ttl, owner);
        let now = Instant::now();
        let mut tokens = self.tokens();
        // Tokens nobody claimed in time go; their leases expire with them.
        tokens.retain(|_, claim| claim.deadline > now);
        tokens.insert(
            Sha256::digest(token.as_bytes()).into(),
            Claim {
                lease: lease.id.clone(),
                dataset: dataset.name().to_owned(),
                uid,
                deadline: now + ttl,
                lease_duration,
            },
        );
        drop(tokens);
        self.leases.insert(lease.clone());
        Ok(SharedGrant {
            lease,
            token,
            token_expires_at: SystemTime::now() + ttl,
            bytes,
            rows,
        })
    }

    /// The file `token` opens, presented by user `uid`: once, in time, by the user it was
    /// granted to. A token presented by another user is spent and its file freed.
    pub(crate) fn claim(&self, token: &str, uid: Option<u32>) -> Result<ClaimedFile, StoreError> {
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let claim = self.tokens().remove(&key);
        let unknown = || {
            StoreError::TokenRejected(
                "the token opens nothing: it was never issued, was used already, or expired \
                 (tokens are single use and last seconds: ask shm-read again)"
                    .to_owned(),
            )
        };
        let Some(claim) = claim else {
            return Err(unknown());
        };
        if claim.deadline <= Instant::now() {
            self.leases.release(&claim.lease);
            return Err(unknown());
        }
        if let Some(expected) = claim.uid
            && uid != Some(expected)
        {
            self.leases.release(&claim.lease);
            return Err(StoreError::TokenRejected(format!(
                "the token was issued to user {expected} and presented by {}: it is spent, and \
                 its file freed",
                uid.map_or_else(|| "an unknown user".to_owned(), |uid| format!("user {uid}"))
            )));
        }
        // The token stands for the lease's owner: its claim renews the lease as issued.
        let lease = self
            .leases
            .extend(&claim.lease, Some(claim.lease_duration), |lease| {
                if lease.dataset.name() == claim.dataset {
                    Ok(())
                } else {
                    Err(unknown())
                }
            })
            .map_err(|_| unknown())?;
        let staged = lease.terms.staged.as_ref().ok_or_else(unknown)?;
        Ok(ClaimedFile {
            fds: staged
                .iter()
                .map(StagedFile::share)
                .collect::<Result<_, _>>()?,
            lease: lease.id.clone(),
            bytes: lease.terms.staged_bytes(),
        })
    }
}
