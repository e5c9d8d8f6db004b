//! Who is calling, and what they may do.
//!
//! With `--auth-tokens FILE` every Flight call must carry `authorization: Bearer <token>`: a
//! token listed in the file (by its hash), or a session token that Flight's `Handshake` hands
//! out for Basic credentials of a user in the file. Over mutual TLS, a call without that header
//! may instead come from a client certificate the file names (`[[certificates]]`, matched by
//! its subject CN or a subject alternative name). Each principal has one [`Role`]; what each
//! method and action needs is one table ([`required_role`]), which the server checks before a
//! request's body is read, so a refused call costs nothing. Without a token file every caller
//! is [`Principal::anonymous`], with every role.
//!
//! The file is read again on SIGHUP ([`Authenticator::reload`]): revoked tokens stop working at
//! once, and sessions follow their user (a user removed from the file loses their sessions; a
//! changed role applies to the next call). A file that fails to load leaves the previous one in
//! force.
//!
//! Password checks (argon2) are slow on purpose; they run on blocking threads, a few at a time,
//! so a flood of logins cannot take the runtime's threads from data calls. Failed logins and
//! unknown tokens are counted per client address, and an address that keeps failing has its
//! logins refused for a while (`limiter`).

mod certificate;
mod file;
mod limiter;
mod roles;

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use tokio::sync::Semaphore;

pub use certificate::ClientCertificate;
use file::Credentials;
pub use file::{TokenFileError, hash_password, new_token};
use limiter::FailureLimiter;
pub use limiter::Origin;
pub use roles::{Action, Method, Operation, required_role};

/// What a principal may do. Each role includes the ones before it.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Deserialize, serde::Serialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Read datasets: GetFlightInfo, GetSchema, ListFlights, DoGet, `ipc-export`, `status`.
    Read,
    /// Also change them: DoPut (create, append, replace) and `drop`.
    Write,
    /// Also see everyone's `ipc-export` lease ids in `status`.
    Admin,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Read => "read",
            Self::Write => "write",
            Self::Admin => "admin",
        })
    }
}

/// The caller of one request, as the server's authentication layer found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub name: Arc<str>,
    pub role: Role,
}

impl Principal {
    /// Everyone, when the server has no token file.
    pub fn anonymous() -> Self {
        Self {
            name: Arc::from("anonymous"),
            role: Role::Admin,
        }
    }

    /// `Ok` if this principal's role includes `needed`.
    pub fn require(&self, needed: Role, what: &str) -> Result<(), AuthError> {
        if self.role >= needed {
            Ok(())
        } else {
            Err(AuthError::Denied {
                what: what.to_owned(),
                needed,
                principal: Arc::clone(&self.name),
                role: self.role,
            })
        }
    }
}

/// Why a call is refused: UNAUTHENTICATED for missing or bad credentials, PERMISSION_DENIED
/// for a role that does not allow it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum AuthError {
    #[error(
        "this server requires authentication: send `authorization: Bearer <token>`, with a \
         token from its token file or one that Handshake returns for Basic credentials"
    )]
    Missing,
    #[error("{0}")]
    Rejected(&'static str),
    #[error("too many failed authentication attempts from this address; try again in {seconds} s")]
    Throttled { seconds: u64 },
    #[error("{what} needs the {needed} role; principal {principal:?} has the {role} role")]
    Denied {
        what: String,
        needed: Role,
        principal: Arc<str>,
        role: Role,
    },
}

/// How a server authenticates its callers.
#[derive(Debug, Clone, Default)]
pub enum Auth {
    /// Every caller is [`Principal::anonymous`].
    #[default]
    Off,
    Tokens(Arc<Authenticator>),
}

impl Auth {
    pub fn is_on(&self) -> bool {
        matches!(self, Self::Tokens(_))
    }

    /// The caller of a request that presents `presented`.
    pub fn authenticate(&self, presented: &Presented<'_>) -> Result<Principal, AuthError> {
        match self {
            Self::Off => Ok(Principal::anonymous()),
            Self::Tokens(authenticator) => authenticator.authenticate(presented),
        }
    }
}

/// What a request offers to say who sent it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Presented<'a> {
    /// The `authorization` header.
    pub authorization: Option<&'a [u8]>,
    /// The connection's verified client certificate (mutual TLS).
    pub certificate: Option<&'a ClientCertificate>,
    /// Where it came from, for counting failures; `None` where unknown (not counted).
    pub origin: Option<Origin>,
}

/// How long a session token from Handshake stays valid, unless `--session-hours` says otherwise.
pub const DEFAULT_SESSION_TTL: Duration = Duration::from_secs(12 * 3600);
/// Sessions kept at once; beyond it, the ones closest to expiry are forgotten first.
const MAX_SESSIONS: usize = 100_000;

/// Token-file authentication: bearer tokens, Basic logins and their sessions.
#[derive(Debug)]
pub struct Authenticator {
    path: PathBuf,
    credentials: RwLock<Arc<Credentials>>,
    /// SHA-256 of each session token → its user and expiry. Only digests are kept, like the
    /// file does, so a memory dump holds no usable token.
    sessions: Mutex<HashMap<[u8; 32], Session>>,
    session_ttl: Duration,
    /// Password checks running at once.
    logins: Arc<Semaphore>,
    failures: FailureLimiter,
}

#[derive(Debug)]
struct Session {
    user: String,
    expires: Instant,
}

/// What a (re)loaded token file holds, for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loaded {
    pub tokens: usize,
    pub users: usize,
}

impl Authenticator {
    pub fn load(path: &Path, session_ttl: Duration) -> Result<Self, TokenFileError> {
        let credentials = Credentials::load(path)?;
        let concurrent = std::thread::available_parallelism()
            .map_or(1, |n| n.get() / 2)
            .max(1);
        Ok(Self {
            path: path.to_owned(),
            credentials: RwLock::new(Arc::new(credentials)),
            sessions: Mutex::new(HashMap::new()),
            session_ttl,
            logins: Arc::new(Semaphore::new(concurrent)),
            failures: FailureLimiter::default(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What the file in force holds.
    pub fn loaded(&self) -> Loaded {
        let credentials = self.credentials();
        Loaded {
            tokens: credentials.tokens.len(),
            users: credentials.users.len(),
        }
    }

    /// Reads the token file again. On error the file in force stays.
    pub fn reload(&self) -> Result<Loaded, TokenFileError> {
        let credentials = Arc::new(Credentials::load(&self.path)?);
        *self
            .credentials
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = credentials;
        Ok(self.loaded())
    }

    fn credentials(&self) -> Arc<Credentials> {
        Arc::clone(
            &self
                .credentials
                .read()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        )
    }

    /// The principal a request's bearer token stands for or, without an `authorization`
    /// header, its client certificate. A header decides alone: a bad token is not rescued by a
    /// certificate, so that what a client sends means one thing.
    pub fn authenticate(&self, presented: &Presented<'_>) -> Result<Principal, AuthError> {
        if presented.authorization.is_none()
            && let Some(certificate) = presented.certificate
        {
            let credentials = self.credentials();
            if let Some(rule) = certificate::find(&credentials.certificates, certificate) {
                return Ok(Principal {
                    name: Arc::from(rule.principal.as_str()),
                    role: rule.role,
                });
            }
        }
        self.authenticate_header(presented.authorization)
            .map_err(|error| self.count_failure(error, presented.origin))
    }

    /// `error` as the caller gets it: an unknown token counts as a failure of its address,
    /// and an address that is blocked is told so instead.
    fn count_failure(&self, error: AuthError, origin: Option<Origin>) -> AuthError {
        let (AuthError::Rejected(UNKNOWN_TOKEN), Some(origin)) = (&error, origin) else {
            return error;
        };
        let now = Instant::now();
        if let Some(wait) = self.failures.blocked(origin, now) {
            return throttled(wait);
        }
        if let Some(block) = self.failures.failed(origin, now) {
            log_block(origin, block);
        }
        error
    }

    fn authenticate_header(&self, authorization: Option<&[u8]>) -> Result<Principal, AuthError> {
        let token = match parse_authorization(authorization)? {
            Credential::Bearer(token) => token,
            Credential::Basic(..) => {
                return Err(AuthError::Rejected(
                    "Basic credentials are accepted by Handshake only, which answers with a \
                     bearer token for the other calls (pyarrow: client.authenticate_basic_token)",
                ));
            }
        };
        let digest = file::token_digest(token);
        let credentials = self.credentials();
        if let Some((name, role)) = credentials.tokens.get(&digest) {
            return Ok(Principal {
                name: Arc::from(name.as_str()),
                role: *role,
            });
        }
        let user = {
            let mut sessions = self.lock_sessions();
            match sessions.get(&digest) {
                None => return Err(AuthError::Rejected(UNKNOWN_TOKEN)),
                Some(session) if session.expires <= Instant::now() => {
                    sessions.remove(&digest);
                    return Err(AuthError::Rejected(
                        "the session has expired; call Handshake again",
                    ));
                }
                Some(session) => session.user.clone(),
            }
        };
        match credentials.users.get(&user) {
            Some(found) => Ok(Principal {
                name: Arc::from(user.as_str()),
                role: found.role,
            }),
            None => Err(AuthError::Rejected(
                "the session's user is no longer in the server's token file",
            )),
        }
    }

    /// Flight's Handshake: Basic credentials open a session (the principal and its bearer
    /// token); a valid bearer token is handed back as it is. From an address blocked for its
    /// failures, Basic credentials are refused unchecked.
    pub async fn handshake(
        &self,
        authorization: Option<&[u8]>,
        origin: Option<Origin>,
    ) -> Result<(Principal, String), AuthError> {
        let (user, password) = match parse_authorization(authorization)? {
            Credential::Basic(user, password) => (user, password),
            Credential::Bearer(token) => {
                let presented = Presented {
                    authorization,
                    certificate: None,
                    origin,
                };
                return Ok((self.authenticate(&presented)?, token.to_owned()));
            }
        };
        if let Some(wait) = origin.and_then(|origin| self.failures.blocked(origin, Instant::now()))
        {
            return Err(throttled(wait));
        }
        let found = self.credentials().users.get(&user).cloned();
        let permit = Arc::clone(&self.logins)
            .acquire_owned()
            .await
            .map_err(|_| AuthError::Rejected("the server is shutting down"))?;
        // An unknown user costs as much as a wrong password, so timing does not tell which
        // names exist.
        let hash = found
            .as_ref()
            .map_or_else(|| decoy_hash().to_owned(), |u| u.password_hash.clone());
        let matches = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            file::password_matches(&password, &hash)
        })
        .await
        .unwrap_or(false);
        let Some(found) = found.filter(|_| matches) else {
            if let Some(origin) = origin
                && let Some(block) = self.failures.failed(origin, Instant::now())
            {
                log_block(origin, block);
            }
            return Err(AuthError::Rejected("unknown user or wrong password"));
        };
        let token = random_token().map_err(|_| AuthError::Rejected("no randomness available"))?;
        self.open_session(&token, user.clone());
        Ok((
            Principal {
                name: Arc::from(user.as_str()),
                role: found.role,
            },
            token,
        ))
    }

    fn open_session(&self, token: &str, user: String) {
        let now = Instant::now();
        let mut sessions = self.lock_sessions();
        if sessions.len() >= MAX_SESSIONS {
            sessions.retain(|_, session| session.expires > now);
        }
        while sessions.len() >= MAX_SESSIONS {
            let soonest = sessions
                .iter()
                .min_by_key(|(_, session)| session.expires)
                .map(|(digest, _)| *digest);
            match soonest {
                Some(digest) => sessions.remove(&digest),
                None => break,
            };
        }
        sessions.insert(
            file::token_digest(token),
            Session {
                user,
                expires: now + self.session_ttl,
            },
        );
    }

    fn lock_sessions(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Session>> {
        self.sessions
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

const UNKNOWN_TOKEN: &str = "unknown or revoked bearer token";

fn throttled(wait: Duration) -> AuthError {
    AuthError::Throttled {
        seconds: wait.as_secs_f64().ceil() as u64,
    }
}

fn log_block(origin: Origin, block: Duration) {
    tracing::warn!(
        %origin,
        seconds = block.as_secs(),
        "repeated failed authentication: refusing this address's logins for a while"
    );
}

enum Credential<'a> {
    Bearer(&'a str),
    Basic(String, String),
}

/// Base64 as Basic credentials come: the standard alphabet, padded or not.
const BASIC: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    base64::engine::GeneralPurposeConfig::new()
        .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
);

fn parse_authorization(header: Option<&[u8]>) -> Result<Credential<'_>, AuthError> {
    let header = header.ok_or(AuthError::Missing)?;
    let header = std::str::from_utf8(header)
        .map_err(|_| AuthError::Rejected("the authorization header is not UTF-8"))?;
    let (scheme, value) = header.trim().split_once(' ').ok_or(AuthError::Rejected(
        "the authorization header is `Bearer <token>` or `Basic <base64 of user:password>`",
    ))?;
    let value = value.trim();
    if scheme.eq_ignore_ascii_case("bearer") {
        return Ok(Credential::Bearer(value));
    }
    if scheme.eq_ignore_ascii_case("basic") {
        // With or without padding: arrow-go (ADBC's Flight SQL driver) sends it without.
        let decoded = BASIC
            .decode(value)
            .ok()
            .and_then(|bytes| String::from_utf8(bytes).ok())
            .ok_or(AuthError::Rejected(
                "Basic credentials are base64 of UTF-8 `user:password`",
            ))?;
        let (user, password) = decoded.split_once(':').ok_or(AuthError::Rejected(
            "Basic credentials are base64 of `user:password`",
        ))?;
        return Ok(Credential::Basic(user.to_owned(), password.to_owned()));
    }
    Err(AuthError::Rejected(
        "unknown authorization scheme; use `Bearer <token>`, or Basic with Handshake",
    ))
}

/// A hash no password matches in practice, checked for unknown users.
fn decoy_hash() -> &'static str {
    static DECOY: OnceLock<String> = OnceLock::new();
    DECOY.get_or_init(|| {
        let secret = random_token().unwrap_or_else(|_| "decoy".repeat(8));
        hash_password(&secret).unwrap_or_default()
    })
}

/// 256 random bits, URL-safe base64.
fn random_token() -> Result<String, String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| e.to_string())?;
    Ok(URL_SAFE_NO_PAD.encode(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn authenticator(text: &str) -> (tempfile_path::TempPath, Authenticator) {
        let path = tempfile_path::TempPath::with(text);
        let authenticator = Authenticator::load(&path.0, DEFAULT_SESSION_TTL).expect("loads");
        (path, authenticator)
    }

    /// A file removed when dropped, for the token file under test.
    mod tempfile_path {
        use std::path::PathBuf;

        pub(super) struct TempPath(pub(super) PathBuf);

        impl TempPath {
            pub(super) fn with(text: &str) -> Self {
                let mut name = [0u8; 8];
                getrandom::fill(&mut name).expect("random");
                let path =
                    std::env::temp_dir().join(format!("gpu-flight-auth-{}", hex::encode(name)));
                std::fs::write(&path, text).expect("write token file");
                Self(path)
            }
        }

        impl Drop for TempPath {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
    }

    fn file_with(token: &str, role: &str, user: &str, password: &str) -> String {
        format!(
            "[[tokens]]\nprincipal = \"svc\"\nrole = \"{role}\"\nsha256 = \"{}\"\n\
             [[users]]\nname = \"{user}\"\nrole = \"read\"\npassword = \"{}\"\n",
            hex::encode(file::token_digest(token)),
            hash_password(password).expect("hash")
        )
    }

    fn check(auth: &Authenticator, authorization: Option<&[u8]>) -> Result<Principal, AuthError> {
        auth.authenticate(&Presented {
            authorization,
            ..Presented::default()
        })
    }

    fn bearer(token: &str) -> Vec<u8> {
        format!("Bearer {token}").into_bytes()
    }

    fn basic(user: &str, password: &str) -> Vec<u8> {
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
        )
        .into_bytes()
    }

    #[test]
    fn roles_are_ordered() {
        let reader = Principal {
            name: Arc::from("r"),
            role: Role::Read,
        };
        assert!(reader.require(Role::Read, "DoGet").is_ok());
        let denied = reader.require(Role::Write, "DoPut").expect_err("denied");
        assert_eq!(
            denied.to_string(),
            "DoPut needs the write role; principal \"r\" has the read role"
        );
        assert!(Principal::anonymous().require(Role::Admin, "x").is_ok());
    }

    #[test]
    fn bearer_tokens_from_the_file() {
        let (_file, auth) = authenticator(&file_with("t0ken", "write", "alice", "pw"));
        let principal = check(&auth, Some(&bearer("t0ken"))).expect("valid");
        assert_eq!(&*principal.name, "svc");
        assert_eq!(principal.role, Role::Write);
        assert!(matches!(check(&auth, None), Err(AuthError::Missing)));
        for bad in [
            bearer("t0ken2"),
            b"t0ken".to_vec(),
            b"Token t0ken".to_vec(),
            basic("alice", "pw"),
            vec![0xff, 0xfe],
        ] {
            assert!(
                matches!(check(&auth, Some(&bad)), Err(AuthError::Rejected(_))),
                "accepted {bad:?}"
            );
        }
    }

    #[tokio::test]
    async fn logins_open_sessions_that_follow_the_file() {
        let (file, auth) = authenticator(&file_with("t0ken", "write", "alice", "pw"));
        assert!(
            auth.handshake(Some(&basic("alice", "wrong")), None)
                .await
                .is_err()
        );
        assert!(
            auth.handshake(Some(&basic("mallory", "pw")), None)
                .await
                .is_err()
        );
        let (principal, session) = auth
            .handshake(Some(&basic("alice", "pw")), None)
            .await
            .expect("ok");
        assert_eq!(principal.role, Role::Read);
        // Unpadded, as arrow-go sends it ("alice:pw" is 8 bytes: padded, it ends in "=").
        let unpadded = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD_NO_PAD.encode("alice:pw")
        );
        auth.handshake(Some(unpadded.as_bytes()), None)
            .await
            .expect("unpadded Basic credentials");
        assert_eq!(
            check(&auth, Some(&bearer(&session))).expect("session"),
            principal
        );

        // Reloaded without alice and with the old token revoked: both stop working.
        std::fs::write(&file.0, file_with("n3w", "admin", "bob", "pw")).expect("rewrite");
        assert_eq!(
            auth.reload().expect("reloads"),
            Loaded {
                tokens: 1,
                users: 1
            }
        );
        assert!(check(&auth, Some(&bearer(&session))).is_err());
        assert!(check(&auth, Some(&bearer("t0ken"))).is_err());
        assert_eq!(
            check(&auth, Some(&bearer("n3w"))).expect("new").role,
            Role::Admin
        );

        // A broken file leaves the last good one in force.
        std::fs::write(&file.0, "[[tokens]]\nprincipal = 1").expect("rewrite");
        assert!(auth.reload().is_err());
        assert!(check(&auth, Some(&bearer("n3w"))).is_ok());
    }

    #[test]
    fn a_mapped_client_certificate_is_a_principal_unless_a_header_is_sent() {
        let (_file, auth) = authenticator(&format!(
            "{}[[certificates]]\nprincipal = \"loader\"\nrole = \"write\"\n\
             dns_name = \"loader.example.com\"\n",
            file_with("t0ken", "admin", "alice", "pw")
        ));
        let mapped = ClientCertificate {
            dns_names: vec!["loader.example.com".to_owned()],
            ..ClientCertificate::default()
        };
        let unmapped = ClientCertificate {
            common_names: vec!["loader.example.com".to_owned()],
            ..ClientCertificate::default()
        };
        let with = |authorization: Option<&[u8]>, certificate| {
            auth.authenticate(&Presented {
                authorization,
                certificate,
                origin: None,
            })
        };
        let principal = with(None, Some(&mapped)).expect("mapped");
        assert_eq!((&*principal.name, principal.role), ("loader", Role::Write));
        assert!(matches!(
            with(None, Some(&unmapped)),
            Err(AuthError::Missing)
        ));
        // A token still works beside a certificate, and decides alone.
        let token = bearer("t0ken");
        assert_eq!(
            with(Some(&token), Some(&unmapped)).expect("token").role,
            Role::Admin
        );
        let bad = bearer("wrong");
        assert!(with(Some(&bad), Some(&mapped)).is_err());
    }

    #[tokio::test]
    async fn an_address_that_keeps_failing_is_refused_and_others_are_not() {
        let (_file, auth) = authenticator(&file_with("t0ken", "read", "alice", "pw"));
        let attacker = Some(Origin::Ip([192, 0, 2, 1].into()));
        let neighbour = Some(Origin::Ip([192, 0, 2, 2].into()));
        let call = |header: &[u8], origin| {
            auth.authenticate(&Presented {
                authorization: Some(header),
                certificate: None,
                origin,
            })
        };
        let wrong = bearer("guess");
        for _ in 0..limiter::FREE_FAILURES {
            assert!(matches!(
                call(&wrong, attacker),
                Err(AuthError::Rejected(_))
            ));
        }
        // The failure past the free ones starts a block: logins are refused unchecked.
        let (_, session) = auth
            .handshake(Some(&basic("alice", "pw")), attacker)
            .await
            .expect("not blocked yet");
        assert!(matches!(
            call(&wrong, attacker),
            Err(AuthError::Rejected(_))
        ));
        let refused = auth
            .handshake(Some(&basic("alice", "pw")), attacker)
            .await
            .expect_err("blocked");
        assert!(matches!(refused, AuthError::Throttled { .. }), "{refused}");
        assert!(matches!(
            call(&wrong, attacker),
            Err(AuthError::Throttled { .. })
        ));
        // Valid tokens are not slowed, nor is anyone at another address.
        assert!(call(&bearer("t0ken"), attacker).is_ok());
        assert!(call(&bearer(&session), attacker).is_ok());
        assert!(
            auth.handshake(Some(&basic("alice", "pw")), neighbour)
                .await
                .is_ok()
        );
        assert!(matches!(
            call(&wrong, neighbour),
            Err(AuthError::Rejected(_))
        ));
    }

    #[tokio::test]
    async fn sessions_expire() {
        let (file, _) = authenticator(&file_with("t", "read", "alice", "pw"));
        let auth = Authenticator::load(&file.0, Duration::ZERO).expect("loads");
        let (_, session) = auth
            .handshake(Some(&basic("alice", "pw")), None)
            .await
            .expect("ok");
        let refused = check(&auth, Some(&bearer(&session)));
        assert!(matches!(refused, Err(AuthError::Rejected(m)) if m.contains("expired")));
    }

    /// Headers made of random bytes, random schemes and random base64 never panic and never
    /// authenticate.
    #[tokio::test]
    async fn random_headers_are_refused() {
        use rand::{Rng, SeedableRng};
        let (_file, auth) = authenticator(&file_with("t0ken", "admin", "alice", "pw"));
        let mut rng = rand::rngs::StdRng::seed_from_u64(20261122);
        let prefixes: [&[u8]; 6] = [
            b"",
            b"Bearer ",
            b"Basic ",
            b"bearer",
            b"BASIC  ",
            b"Bearer t0ke",
        ];
        for _ in 0..2000 {
            let mut header = prefixes[rng.random_range(0..prefixes.len())].to_vec();
            let tail: Vec<u8> = (0..rng.random_range(0..64)).map(|_| rng.random()).collect();
            if rng.random_bool(0.5) {
                header.extend(
                    base64::engine::general_purpose::STANDARD
                        .encode(&tail)
                        .into_bytes(),
                );
            } else {
                header.extend(tail);
            }
            assert!(check(&auth, Some(&header)).is_err(), "{header:?}");
        }
        // Basic logins are slow on purpose: fewer of them.
        for _ in 0..20 {
            let tail: Vec<u8> = (0..rng.random_range(0..24)).map(|_| rng.random()).collect();
            let mut header = b"Basic ".to_vec();
            header.extend(
                base64::engine::general_purpose::STANDARD
                    .encode(&tail)
                    .into_bytes(),
            );
            assert!(
                auth.handshake(Some(&header), None).await.is_err(),
                "{header:?}"
            );
        }
    }
}
