//! The token file (`--auth-tokens`): who may call, with which role, and how they prove it.
//!
//! ```toml
//! # A bearer token: clients send `authorization: Bearer <token>` with every call.
//! [[tokens]]
//! principal = "etl"
//! role = "write"
//! sha256 = "<hex SHA-256 of the token>"      # `gpu-flight new-token` prints one
//!
//! # A user for Flight's Handshake with Basic credentials (pyarrow's
//! # `client.authenticate_basic_token(user, password)`), answered with a session token.
//! [[users]]
//! name = "alice"
//! role = "read"
//! password = "$argon2id$v=19$..."             # `gpu-flight hash-password` prints one
//!
//! # A client certificate (mutual TLS, `--tls-client-ca`) whose subject CN, or one of whose
//! # subject alternative names, is the one given: exactly one of `common_name`, `dns_name`,
//! # `uri`, `email`.
//! [[certificates]]
//! principal = "loader"
//! role = "write"
//! uri = "spiffe://example.com/loader"
//! ```
//!
//! Only hashes are stored, so the file is no use to whoever reads it. Tokens are long random
//! strings, for which SHA-256 is enough; passwords are chosen by people, so they are stored as
//! argon2 hashes, which are slow to guess. Unknown keys are errors: a misspelt `role` must not
//! silently grant a default.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use argon2::password_hash::rand_core::OsRng;
use argon2::password_hash::{PasswordHash, PasswordHasher, SaltString};
use argon2::{Argon2, PasswordVerifier};
use sha2::{Digest, Sha256};

use super::Role;
use super::certificate::{CertificateRule, NameKind};

/// Why a token file cannot be used. Loading fails as a whole: a server never runs on half of a
/// file.
#[derive(Debug, thiserror::Error)]
pub enum TokenFileError {
    #[error("cannot read the token file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the token file {path} is not valid: {reason}")]
    Invalid { path: PathBuf, reason: String },
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Document {
    #[serde(default)]
    tokens: Vec<TokenEntry>,
    #[serde(default)]
    users: Vec<UserEntry>,
    #[serde(default)]
    certificates: Vec<CertificateEntry>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenEntry {
    principal: String,
    role: Role,
    sha256: String,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct UserEntry {
    name: String,
    role: Role,
    password: String,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct CertificateEntry {
    principal: String,
    role: Role,
    common_name: Option<String>,
    dns_name: Option<String>,
    uri: Option<String>,
    email: Option<String>,
}

impl CertificateEntry {
    /// The one name the entry matches.
    fn name(&self) -> Result<(NameKind, &str), String> {
        let given: Vec<(NameKind, &str)> = [
            (NameKind::CommonName, &self.common_name),
            (NameKind::DnsName, &self.dns_name),
            (NameKind::Uri, &self.uri),
            (NameKind::Email, &self.email),
        ]
        .into_iter()
        .filter_map(|(kind, value)| value.as_deref().map(|value| (kind, value)))
        .collect();
        match given[..] {
            [(_, "")] => Err("the name to match is empty".to_owned()),
            [one] => Ok(one),
            _ => Err("give exactly one of common_name, dns_name, uri, email".to_owned()),
        }
    }
}

/// A user who may log in with a password.
#[derive(Debug, Clone)]
pub(super) struct User {
    pub(super) role: Role,
    /// An argon2 hash in PHC form, checked to parse when the file was loaded.
    pub(super) password_hash: String,
}

/// A parsed token file.
#[derive(Debug, Default)]
pub(super) struct Credentials {
    /// SHA-256 of each bearer token → its principal and role.
    pub(super) tokens: HashMap<[u8; 32], (String, Role)>,
    pub(super) users: HashMap<String, User>,
    /// Client certificates' names → principals, in file order (the first match wins).
    pub(super) certificates: Vec<CertificateRule>,
}

impl Credentials {
    pub(super) fn load(path: &Path) -> Result<Self, TokenFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| TokenFileError::Read {
            path: path.to_owned(),
            source,
        })?;
        warn_if_readable_by_others(path);
        Self::parse(&text).map_err(|reason| TokenFileError::Invalid {
            path: path.to_owned(),
            reason,
        })
    }

    pub(super) fn parse(text: &str) -> Result<Self, String> {
        let document: Document = toml::from_str(text).map_err(|e| e.to_string())?;
        let mut credentials = Self::default();
        let mut principals = HashMap::new();
        for (index, entry) in document.tokens.into_iter().enumerate() {
            let where_ = format!("tokens[{index}] (principal {:?})", entry.principal);
            check_name(&entry.principal).map_err(|e| format!("{where_}: {e}"))?;
            let digest = parse_digest(&entry.sha256).map_err(|e| format!("{where_}: {e}"))?;
            // One principal, one role: two entries disagreeing would make the role depend on
            // which token a client happened to use.
            if let Some(role) = principals.insert(entry.principal.clone(), entry.role)
                && role != entry.role
            {
                return Err(format!("{where_}: this principal appears with two roles"));
            }
            if credentials
                .tokens
                .insert(digest, (entry.principal, entry.role))
                .is_some()
            {
                return Err(format!("{where_}: the same token appears twice"));
            }
        }
        for (index, entry) in document.users.into_iter().enumerate() {
            let where_ = format!("users[{index}] (name {:?})", entry.name);
            check_name(&entry.name).map_err(|e| format!("{where_}: {e}"))?;
            PasswordHash::new(&entry.password).map_err(|e| {
                format!(
                    "{where_}: password is not an argon2 hash in PHC form ({e}); \
                     `gpu-flight hash-password` prints one"
                )
            })?;
            if principals
                .get(&entry.name)
                .is_some_and(|role| *role != entry.role)
            {
                return Err(format!(
                    "{where_}: a token entry gives this principal another role"
                ));
            }
            let user = User {
                role: entry.role,
                password_hash: entry.password,
            };
            if credentials.users.insert(entry.name, user).is_some() {
                return Err(format!("{where_}: this user appears twice"));
            }
        }
        for (index, entry) in document.certificates.into_iter().enumerate() {
            let where_ = format!("certificates[{index}] (principal {:?})", entry.principal);
            check_name(&entry.principal).map_err(|e| format!("{where_}: {e}"))?;
            let (kind, value) = entry.name().map_err(|e| format!("{where_}: {e}"))?;
            let role_elsewhere = principals.get(&entry.principal).copied().or_else(|| {
                credentials
                    .users
                    .get(&entry.principal)
                    .map(|user| user.role)
            });
            if role_elsewhere.is_some_and(|role| role != entry.role) {
                return Err(format!(
                    "{where_}: another entry gives this principal another role"
                ));
            }
            principals.insert(entry.principal.clone(), entry.role);
            let rule = CertificateRule {
                kind,
                value: value.to_owned(),
                principal: entry.principal,
                role: entry.role,
            };
            if credentials
                .certificates
                .iter()
                .any(|r| r.kind == rule.kind && r.value == rule.value)
            {
                return Err(format!("{where_}: the same name appears twice"));
            }
            credentials.certificates.push(rule);
        }
        Ok(credentials)
    }
}

/// Principal names appear in logs, metrics and `status`: printable and short.
fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 128 || name.chars().any(|c| c.is_control()) {
        return Err("names are 1 to 128 printable characters".to_owned());
    }
    if name.contains(':') {
        // Basic credentials are `name:password`; a colon in the name cannot be sent.
        return Err("names cannot contain ':'".to_owned());
    }
    Ok(())
}

fn parse_digest(hex_digest: &str) -> Result<[u8; 32], String> {
    let mut digest = [0u8; 32];
    hex::decode_to_slice(hex_digest.trim(), &mut digest).map_err(|_| {
        "sha256 must be 64 hex digits (`gpu-flight new-token` prints it)".to_owned()
    })?;
    Ok(digest)
}

pub(super) fn token_digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// Whether `password` matches a PHC hash from a loaded file.
pub(super) fn password_matches(password: &str, hash: &str) -> bool {
    PasswordHash::new(hash)
        .map(|hash| {
            Argon2::default()
                .verify_password(password.as_bytes(), &hash)
                .is_ok()
        })
        .unwrap_or(false)
}

/// An argon2id hash of `password` in PHC form, with a fresh salt, for the token file.
pub fn hash_password(password: &str) -> Result<String, String> {
    let salt = SaltString::generate(&mut OsRng);
    Argon2::default()
        .hash_password(password.as_bytes(), &salt)
        .map(|hash| hash.to_string())
        .map_err(|e| e.to_string())
}

/// A new random bearer token (256 bits, URL-safe base64) and the hex SHA-256 the token file
/// stores for it.
pub fn new_token() -> Result<(String, String), String> {
    let token = super::random_token()?;
    let digest = hex::encode(token_digest(&token));
    Ok((token, digest))
}

#[cfg(unix)]
fn warn_if_readable_by_others(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(metadata) = std::fs::metadata(path)
        && metadata.permissions().mode() & 0o004 != 0
    {
        tracing::warn!(
            path = %path.display(),
            "the token file is readable by every user; it holds only hashes, but `chmod 600` it"
        );
    }
}

#[cfg(not(unix))]
fn warn_if_readable_by_others(_path: &Path) {}

#[cfg(test)]
mod tests {
    use super::*;

    const ZEROS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

    #[test]
    fn tokens_and_users_parse() {
        let hash = hash_password("secret").expect("hash");
        let text = format!(
            "[[tokens]]\nprincipal = \"etl\"\nrole = \"write\"\nsha256 = \"{}\"\n\
             [[users]]\nname = \"alice\"\nrole = \"read\"\npassword = \"{hash}\"\n",
            hex::encode(token_digest("t0ken"))
        );
        let credentials = Credentials::parse(&text).expect("parses");
        assert_eq!(
            credentials.tokens.get(&token_digest("t0ken")),
            Some(&("etl".to_owned(), Role::Write))
        );
        let alice = credentials.users.get("alice").expect("alice");
        assert_eq!(alice.role, Role::Read);
        assert!(password_matches("secret", &alice.password_hash));
        assert!(!password_matches("Secret", &alice.password_hash));
    }

    #[test]
    fn mistakes_are_refused_not_defaulted() {
        let cases = [
            // A misspelt key must not leave a default role.
            format!("[[tokens]]\nprincipal = \"a\"\nrole = \"write\"\nsha265 = \"{ZEROS}\""),
            format!("[[tokens]]\nprincipal = \"a\"\nrole = \"root\"\nsha256 = \"{ZEROS}\""),
            "[[tokens]]\nprincipal = \"a\"\nrole = \"read\"\nsha256 = \"abc\"".to_owned(),
            "[[users]]\nname = \"a\"\nrole = \"read\"\npassword = \"hunter2\"".to_owned(),
            format!("[[tokens]]\nprincipal = \"a:b\"\nrole = \"read\"\nsha256 = \"{ZEROS}\""),
            format!(
                "[[tokens]]\nprincipal = \"a\"\nrole = \"read\"\nsha256 = \"{ZEROS}\"\n\
                 [[tokens]]\nprincipal = \"a\"\nrole = \"admin\"\nsha256 = \"{}\"",
                "1".repeat(64)
            ),
            "[[token]]\nprincipal = \"a\"".to_owned(),
        ];
        for text in cases {
            assert!(Credentials::parse(&text).is_err(), "accepted:\n{text}");
        }
    }

    #[test]
    fn certificate_entries_name_exactly_one_name() {
        let credentials = Credentials::parse(
            "[[certificates]]\nprincipal = \"loader\"\nrole = \"write\"\n\
             uri = \"spiffe://example.com/loader\"\n\
             [[certificates]]\nprincipal = \"ops\"\nrole = \"admin\"\ncommon_name = \"ops\"\n",
        )
        .expect("parses");
        assert_eq!(
            credentials.certificates,
            [
                CertificateRule {
                    kind: NameKind::Uri,
                    value: "spiffe://example.com/loader".to_owned(),
                    principal: "loader".to_owned(),
                    role: Role::Write,
                },
                CertificateRule {
                    kind: NameKind::CommonName,
                    value: "ops".to_owned(),
                    principal: "ops".to_owned(),
                    role: Role::Admin,
                },
            ]
        );
        let cases = [
            "[[certificates]]\nprincipal = \"a\"\nrole = \"read\"".to_owned(),
            "[[certificates]]\nprincipal = \"a\"\nrole = \"read\"\ncommon_name = \"\"".to_owned(),
            "[[certificates]]\nprincipal = \"a\"\nrole = \"read\"\ncommon_name = \"a\"\n\
             dns_name = \"a\""
                .to_owned(),
            "[[certificates]]\nprincipal = \"a\"\nrole = \"read\"\nsubject = \"a\"".to_owned(),
            "[[certificates]]\nprincipal = \"a\"\nrole = \"read\"\ncommon_name = \"a\"\n\
             [[certificates]]\nprincipal = \"b\"\nrole = \"read\"\ncommon_name = \"a\""
                .to_owned(),
            format!(
                "[[tokens]]\nprincipal = \"a\"\nrole = \"read\"\nsha256 = \"{ZEROS}\"\n\
                 [[certificates]]\nprincipal = \"a\"\nrole = \"admin\"\ncommon_name = \"a\""
            ),
        ];
        for text in cases {
            assert!(Credentials::parse(&text).is_err(), "accepted:\n{text}");
        }
    }

    #[test]
    fn new_tokens_are_distinct_and_match_their_digest() {
        let (a, digest) = new_token().expect("token");
        let (b, _) = new_token().expect("token");
        assert_ne!(a, b);
        assert!(a.len() >= 43);
        assert_eq!(hex::encode(token_digest(&a)), digest);
    }
}
