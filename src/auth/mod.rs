//! Who is calling, and what they may do.
//!
//! With `--auth-tokens FILE` every Flight call must carry `authorization: Bearer <token>`: a
//! token listed in the file (by its hash), or a session token that Flight's `Handshake` hands
//! out for Basic credentials of a user in the file. Each principal has one [`Role`]; the
//! router checks it before a request's body is read, so a refused call costs nothing. Without
//! a token file every caller is [`Principal::anonymous`], with every role.
//!
//! The file is read again on SIGHUP ([`Authenticator::reload`]): revoked tokens stop working at
//! once, and sessions follow their user (a user removed from the file loses their sessions; a
//! changed role applies to the next call). A file that fails to load leaves the previous one in
//! force.
//!
//! Password checks (argon2) are slow on purpose; they run on blocking threads, a few at a time,
//! so a flood of logins cannot take the runtime's threads from data calls.

mod file;

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use tokio::sync::Semaphore;

use file::Credentials;
pub use file::{TokenFileError, hash_password, new_token};

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

/// The caller of one request, as the router found it.
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

    /// The caller of a request with this `authorization` header.
    pub fn authenticate(&self, authorization: Option<&[u8]>) -> Result<Principal, AuthError> {
        match self {
            Self::Off => Ok(Principal::anonymous()),
            Self::Tokens(authenticator) => authenticator.authenticate(authorization),
        }
    }
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

    /// The principal a bearer token stands for.
    pub fn authenticate(&self, authorization: Option<&[u8]>) -> Result<Principal, AuthError> {
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
                None => return Err(AuthError::Rejected("unknown or revoked bearer token")),
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
    /// token); a valid bearer token is handed back as it is.
    pub async fn handshake(
        &self,
        authorization: Option<&[u8]>,
    ) -> Result<(Principal, String), AuthError> {
        let (user, password) = match parse_authorization(authorization)? {
            Credential::Basic(user, password) => (user, password),
            Credential::Bearer(token) => {
                return Ok((self.authenticate(authorization)?, token.to_owned()));
            }
        };
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

enum Credential<'a> {
    Bearer(&'a str),
    Basic(String, String),
}

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
        let decoded = STANDARD
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

    fn bearer(token: &str) -> Vec<u8> {
        format!("Bearer {token}").into_bytes()
    }

    fn basic(user: &str, password: &str) -> Vec<u8> {
        format!("Basic {}", STANDARD.encode(format!("{user}:{password}"))).into_bytes()
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
        let principal = auth.authenticate(Some(&bearer("t0ken"))).expect("valid");
        assert_eq!(&*principal.name, "svc");
        assert_eq!(principal.role, Role::Write);
        assert!(matches!(auth.authenticate(None), Err(AuthError::Missing)));
        for bad in [
            bearer("t0ken2"),
            b"t0ken".to_vec(),
            b"Token t0ken".to_vec(),
            basic("alice", "pw"),
            vec![0xff, 0xfe],
        ] {
            assert!(
                matches!(auth.authenticate(Some(&bad)), Err(AuthError::Rejected(_))),
                "accepted {bad:?}"
            );
        }
    }

    #[tokio::test]
    async fn logins_open_sessions_that_follow_the_file() {
        let (file, auth) = authenticator(&file_with("t0ken", "write", "alice", "pw"));
        assert!(
            auth.handshake(Some(&basic("alice", "wrong")))
                .await
                .is_err()
        );
        assert!(auth.handshake(Some(&basic("mallory", "pw"))).await.is_err());
        let (principal, session) = auth
            .handshake(Some(&basic("alice", "pw")))
            .await
            .expect("ok");
        assert_eq!(principal.role, Role::Read);
        assert_eq!(
            auth.authenticate(Some(&bearer(&session))).expect("session"),
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
        assert!(auth.authenticate(Some(&bearer(&session))).is_err());
        assert!(auth.authenticate(Some(&bearer("t0ken"))).is_err());
        assert_eq!(
            auth.authenticate(Some(&bearer("n3w"))).expect("new").role,
            Role::Admin
        );

        // A broken file leaves the last good one in force.
        std::fs::write(&file.0, "[[tokens]]\nprincipal = 1").expect("rewrite");
        assert!(auth.reload().is_err());
        assert!(auth.authenticate(Some(&bearer("n3w"))).is_ok());
    }

    #[tokio::test]
    async fn sessions_expire() {
        let (file, _) = authenticator(&file_with("t", "read", "alice", "pw"));
        let auth = Authenticator::load(&file.0, Duration::ZERO).expect("loads");
        let (_, session) = auth
            .handshake(Some(&basic("alice", "pw")))
            .await
            .expect("ok");
        let refused = auth.authenticate(Some(&bearer(&session)));
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
                header.extend(STANDARD.encode(&tail).into_bytes());
            } else {
                header.extend(tail);
            }
            assert!(auth.authenticate(Some(&header)).is_err(), "{header:?}");
        }
        // Basic logins are slow on purpose: fewer of them.
        for _ in 0..20 {
            let tail: Vec<u8> = (0..rng.random_range(0..24)).map(|_| rng.random()).collect();
            let mut header = b"Basic ".to_vec();
            header.extend(STANDARD.encode(&tail).into_bytes());
            assert!(auth.handshake(Some(&header)).await.is_err(), "{header:?}");
        }
    }
}
