//! Client certificates as principals: the names a verified client certificate carries, and the
//! token file's `[[certificates]]` entries that map one of them to a principal and its role.
//!
//! rustls has checked the chain against `--tls-client-ca` before a certificate gets here; this
//! module only reads its names (with x509-parser) and looks them up.

use x509_parser::certificate::X509Certificate;
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::FromDer;

use super::Role;

/// The names of a verified client certificate, read once per connection.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientCertificate {
    /// The subject's common names (CN).
    pub common_names: Vec<String>,
    /// Subject alternative names.
    pub dns_names: Vec<String>,
    pub uris: Vec<String>,
    pub emails: Vec<String>,
}

impl ClientCertificate {
    /// The names in a DER certificate. Names that are not text (a CN in BMPString, say) are
    /// skipped: they can only fail to match.
    pub fn from_der(der: &[u8]) -> Result<Self, String> {
        let (_, certificate) =
            X509Certificate::from_der(der).map_err(|e| format!("unreadable certificate: {e}"))?;
        let mut names = Self {
            common_names: certificate
                .subject()
                .iter_common_name()
                .filter_map(|cn| cn.as_str().ok())
                .map(str::to_owned)
                .collect(),
            ..Self::default()
        };
        let alternatives = certificate
            .subject_alternative_name()
            .map_err(|e| format!("unreadable subject alternative names: {e}"))?;
        for name in alternatives.iter().flat_map(|san| &san.value.general_names) {
            match name {
                GeneralName::DNSName(dns) => names.dns_names.push((*dns).to_owned()),
                GeneralName::URI(uri) => names.uris.push((*uri).to_owned()),
                GeneralName::RFC822Name(email) => names.emails.push((*email).to_owned()),
                _ => {}
            }
        }
        Ok(names)
    }
}

/// Which name of a certificate an entry matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NameKind {
    CommonName,
    DnsName,
    Uri,
    Email,
}

/// One `[[certificates]]` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct CertificateRule {
    pub(super) kind: NameKind,
    pub(super) value: String,
    pub(super) principal: String,
    pub(super) role: Role,
}

impl CertificateRule {
    fn matches(&self, certificate: &ClientCertificate) -> bool {
        let names = match self.kind {
            NameKind::CommonName => &certificate.common_names,
            NameKind::DnsName => &certificate.dns_names,
            NameKind::Uri => &certificate.uris,
            NameKind::Email => &certificate.emails,
        };
        names.iter().any(|name| match self.kind {
            // Host names are case-insensitive; the others are compared as written.
            NameKind::DnsName => name.eq_ignore_ascii_case(&self.value),
            _ => *name == self.value,
        })
    }
}

/// The first entry, in file order, that one of the certificate's names matches.
pub(super) fn find<'a>(
    rules: &'a [CertificateRule],
    certificate: &ClientCertificate,
) -> Option<&'a CertificateRule> {
    rules.iter().find(|rule| rule.matches(certificate))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_read_from_the_subject_and_alternative_names() {
        let mut params =
            rcgen::CertificateParams::new(vec!["etl.example.com".to_owned()]).expect("params");
        params.subject_alt_names.extend([
            rcgen::SanType::URI("spiffe://example.com/etl".try_into().expect("uri")),
            rcgen::SanType::Rfc822Name("etl@example.com".try_into().expect("email")),
        ]);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "etl-client");
        let key = rcgen::KeyPair::generate().expect("key");
        let certificate = params.self_signed(&key).expect("certificate");
        let names = ClientCertificate::from_der(certificate.der()).expect("parses");
        assert_eq!(names.common_names, ["etl-client"]);
        assert_eq!(names.dns_names, ["etl.example.com"]);
        assert_eq!(names.uris, ["spiffe://example.com/etl"]);
        assert_eq!(names.emails, ["etl@example.com"]);
        assert!(ClientCertificate::from_der(b"not a certificate").is_err());
    }

    #[test]
    fn the_first_matching_entry_wins() {
        let rule = |kind, value: &str, principal: &str| CertificateRule {
            kind,
            value: value.to_owned(),
            principal: principal.to_owned(),
            role: Role::Read,
        };
        let rules = [
            rule(NameKind::Uri, "spiffe://example.com/etl", "by-uri"),
            rule(NameKind::DnsName, "ETL.example.com", "by-dns"),
            rule(NameKind::CommonName, "etl-client", "by-cn"),
        ];
        let certificate = ClientCertificate {
            common_names: vec!["etl-client".to_owned()],
            dns_names: vec!["etl.Example.com".to_owned()],
            ..ClientCertificate::default()
        };
        assert_eq!(
            find(&rules, &certificate).map(|r| r.principal.as_str()),
            Some("by-dns")
        );
        let other = ClientCertificate {
            common_names: vec!["ETL-CLIENT".to_owned()],
            emails: vec!["etl-client".to_owned()],
            ..ClientCertificate::default()
        };
        assert_eq!(find(&rules, &other), None, "CNs match exactly, by kind");
    }
}
