//! Authentication, roles and TLS, against an in-process server on the host backend.
//!
//! Every Flight method and action is called as each kind of caller (none, a bad token, and
//! each role): allowed calls must get exactly what an admin gets, refused ones UNAUTHENTICATED
//! or PERMISSION_DENIED with a message naming the role needed. TLS and mutual TLS use
//! certificates made here with rcgen; nothing secret is committed.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_flight::error::FlightError;
use arrow_flight::{Action, FlightClient, PollInfo, Ticket};
use base64::Engine;
use common::datadir::TempDataDir;
use common::{TestServer, cmd, code_of, int64_batch, path, put};
use futures::TryStreamExt;
use gpu_flight::auth::{Auth, Authenticator, DEFAULT_SESSION_TTL, hash_password, new_token};
use gpu_flight::backend::HostBackend;
use gpu_flight::server::{ServeOptions, TlsFiles};
use gpu_flight::store::StoreOptions;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

/// One bearer token per role, and a user `carol` (password `pa55`) with the write role.
struct Tokens {
    read: String,
    write: String,
    admin: String,
}

fn token_file(scratch: &TempDataDir) -> (PathBuf, Tokens) {
    let mut text = String::new();
    let mut token = |principal: &str, role: &str| {
        let (token, digest) = new_token().expect("token");
        text.push_str(&format!(
            "[[tokens]]\nprincipal = \"{principal}\"\nrole = \"{role}\"\nsha256 = \"{digest}\"\n"
        ));
        token
    };
    let tokens = Tokens {
        read: token("reader", "read"),
        write: token("writer", "write"),
        admin: token("boss", "admin"),
    };
    text.push_str(&format!(
        "[[users]]\nname = \"carol\"\nrole = \"write\"\npassword = \"{}\"\n",
        hash_password("pa55").expect("hash")
    ));
    (scratch.write("tokens.toml", &text), tokens)
}

async fn start_with_auth(file: &Path) -> TestServer {
    let authenticator = Authenticator::load(file, DEFAULT_SESSION_TTL).expect("token file");
    TestServer::start_with(
        Arc::new(HostBackend::new()),
        StoreOptions::default(),
        ServeOptions {
            auth: Auth::Tokens(Arc::new(authenticator)),
            ..ServeOptions::default()
        },
    )
    .await
}

async fn client_with(server: &TestServer, authorization: Option<String>) -> FlightClient {
    let mut client = server.client().await;
    if let Some(value) = authorization {
        client.add_header("authorization", &value).expect("header");
    }
    client
}

fn bearer(token: &str) -> Option<String> {
    Some(format!("Bearer {token}"))
}

/// Every Flight method and action a client can call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Handshake,
    ListFlights,
    GetFlightInfo,
    PollFlightInfo,
    GetSchema,
    DoGet,
    DoPut,
    DoExchange,
    ListActions,
    Status,
    Drop,
    Move,
    Copy,
    IpcExport,
    IpcExportCopy,
    IpcRelease,
}

const OPS: [Op; 16] = [
    Op::Handshake,
    Op::ListFlights,
    Op::GetFlightInfo,
    Op::PollFlightInfo,
    Op::GetSchema,
    Op::DoGet,
    Op::DoPut,
    Op::DoExchange,
    Op::ListActions,
    Op::Status,
    Op::Drop,
    Op::Move,
    Op::Copy,
    Op::IpcExport,
    Op::IpcExportCopy,
    Op::IpcRelease,
];

impl Op {
    /// The least role that may make the call.
    fn needs(self) -> &'static str {
        match self {
            Op::DoPut | Op::DoExchange | Op::Drop | Op::Move | Op::Copy | Op::IpcExportCopy => {
                "write"
            }
            _ => "read",
        }
    }
}

fn action(name: &str, body: serde_json::Value) -> Action {
    Action::new(name, body.to_string())
}

/// Makes the call; `tag` keeps the datasets of different callers apart.
async fn call(client: &mut FlightClient, op: Op, tag: &str) -> Result<(), FlightError> {
    match op {
        Op::Handshake => client.handshake(Vec::new()).await.map(drop),
        Op::ListFlights => client
            .list_flights("")
            .await?
            .try_collect::<Vec<_>>()
            .await
            .map(drop),
        Op::GetFlightInfo => client.get_flight_info(path("shared")).await.map(drop),
        Op::PollFlightInfo => client
            .poll_flight_info(path("shared"))
            .await
            .map(|_: PollInfo| ()),
        Op::GetSchema => client.get_schema(path("shared")).await.map(drop),
        Op::DoGet => client
            .do_get(Ticket::new("shared"))
            .await?
            .try_collect::<Vec<_>>()
            .await
            .map(drop),
        Op::DoPut => put(
            client,
            cmd(&format!("put-{tag}"), "replace"),
            vec![int64_batch(10, 2, 1)],
        )
        .await
        .map(drop),
        Op::DoExchange => client
            .do_exchange(futures::stream::empty())
            .await?
            .try_collect::<Vec<_>>()
            .await
            .map(drop),
        Op::ListActions => client
            .list_actions()
            .await?
            .try_collect::<Vec<_>>()
            .await
            .map(drop),
        Op::Status => run_action(client, action("status", serde_json::json!({}))).await,
        Op::Drop => {
            run_action(
                client,
                action("drop", serde_json::json!({"name": format!("victim-{tag}")})),
            )
            .await
        }
        Op::Move => {
            run_action(
                client,
                action("move", serde_json::json!({"name": "shared", "device": 0})),
            )
            .await
        }
        Op::Copy => {
            let body =
                serde_json::json!({"name": "shared", "as": format!("copy-{tag}"), "device": 0});
            run_action(client, action("copy", body)).await
        }
        Op::IpcExport => {
            run_action(
                client,
                action("ipc-export", serde_json::json!({"name": "shared"})),
            )
            .await
        }
        Op::IpcExportCopy => {
            let body =
                serde_json::json!({"name": "shared", "version": 2, "device": 0, "copy": true});
            run_action(client, action("ipc-export", body)).await
        }
        Op::IpcRelease => {
            run_action(
                client,
                action("ipc-release", serde_json::json!({"lease": "00ff"})),
            )
            .await
        }
    }
}

async fn run_action(client: &mut FlightClient, action: Action) -> Result<(), FlightError> {
    client
        .do_action(action)
        .await?
        .try_collect::<Vec<_>>()
        .await
        .map(drop)
}

fn code(result: &Result<(), FlightError>) -> Code {
    match result {
        Ok(()) => Code::Ok,
        Err(error) => code_of(error),
    }
}

#[tokio::test]
async fn every_call_is_checked_for_each_role() {
    let scratch = TempDataDir::new("roles");
    let (file, tokens) = token_file(&scratch);
    let server = start_with_auth(&file).await;
    let mut admin = client_with(&server, bearer(&tokens.admin)).await;
    put(&mut admin, path("shared"), vec![int64_batch(100, 3, 7)])
        .await
        .expect("seed");

    // What each call gets when allowed: an admin's answer (some are refusals of their own,
    // such as UNIMPLEMENTED for DoExchange or NOT_FOUND for an unknown lease).
    let mut allowed = Vec::new();
    for op in OPS {
        put(
            &mut admin,
            cmd("victim-admin", "replace"),
            vec![int64_batch(5, 1, 1)],
        )
        .await
        .ok();
        allowed.push(code(&call(&mut admin, op, "admin").await));
    }
    assert_eq!(
        allowed[OPS.iter().position(|o| *o == Op::DoPut).unwrap_or(0)],
        Code::Ok
    );
    assert_eq!(
        allowed[OPS.iter().position(|o| *o == Op::Drop).unwrap_or(0)],
        Code::Ok
    );

    let callers = [
        ("nobody", None, None),
        ("bad token", bearer("not-a-token"), None),
        ("garbage header", Some("Bearer".to_owned()), None),
        ("reader", bearer(&tokens.read), Some("read")),
        ("writer", bearer(&tokens.write), Some("write")),
    ];
    for (who, header, role) in callers {
        let mut client = client_with(&server, header).await;
        for (op, allowed_code) in OPS.iter().zip(&allowed) {
            let victim = format!("victim-{who}");
            put(
                &mut admin,
                cmd(&victim, "replace"),
                vec![int64_batch(5, 1, 1)],
            )
            .await
            .expect("victim");
            let result = call(&mut client, *op, who).await;
            let got = code(&result);
            let context = format!("{who} calling {op:?}: {result:?}");
            match role {
                None => assert_eq!(got, Code::Unauthenticated, "{context}"),
                Some("read") if op.needs() == "write" => {
                    assert_eq!(got, Code::PermissionDenied, "{context}");
                    let message = match &result {
                        Err(FlightError::Tonic(status)) => status.message().to_owned(),
                        other => panic!("{other:?}"),
                    };
                    assert!(message.contains("needs the write role"), "{context}");
                    assert!(
                        message.contains("\"reader\" has the read role"),
                        "{context}"
                    );
                }
                Some(_) => assert_eq!(got, *allowed_code, "{context}"),
            }
        }
    }

    // Refused puts and drops changed nothing.
    let names: Vec<String> = common::list_all(&mut admin)
        .await
        .into_iter()
        .filter_map(|info| info.flight_descriptor.map(|d| d.path.join("/")))
        .collect();
    for refused in ["put-nobody", "put-reader", "put-bad token"] {
        assert!(
            !names.iter().any(|n| n == refused),
            "{refused} in {names:?}"
        );
    }
    for kept in ["victim-nobody", "victim-reader"] {
        assert!(
            names.iter().any(|n| n == kept),
            "{kept} missing from {names:?}"
        );
    }
    assert!(names.iter().any(|n| n == "put-writer"));
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn basic_credentials_buy_a_session_token() {
    let scratch = TempDataDir::new("basic");
    let (file, _) = token_file(&scratch);
    let server = start_with_auth(&file).await;
    let basic = |user: &str, password: &str| {
        Some(format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
        ))
    };

    for (user, password) in [("carol", "wrong"), ("mallory", "pa55"), ("carol", "")] {
        let mut client = client_with(&server, basic(user, password)).await;
        let refused = client.handshake(Vec::new()).await.expect_err("refused");
        assert_eq!(
            code_of(&refused),
            Code::Unauthenticated,
            "{user}:{password}"
        );
    }
    // Basic credentials are for Handshake only.
    let mut client = client_with(&server, basic("carol", "pa55")).await;
    let refused = client
        .list_flights("")
        .await
        .map(drop)
        .expect_err("refused");
    assert_eq!(code_of(&refused), Code::Unauthenticated);

    let token = client.handshake(Vec::new()).await.expect("logged in");
    let token = String::from_utf8(token.to_vec()).expect("token is text");
    let mut session = client_with(&server, bearer(&token)).await;
    put(&mut session, path("by-carol"), vec![int64_batch(10, 1, 1)])
        .await
        .expect("carol may write");
    // The session's token is handed back by a handshake made with it.
    let echoed = session.handshake(Vec::new()).await.expect("valid session");
    assert_eq!(echoed.as_ref(), token.as_bytes());
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn puts_in_flight_are_listed_with_their_principal_to_it_and_admins() {
    let scratch = TempDataDir::new("progress");
    let (file, tokens) = token_file(&scratch);
    let server = start_with_auth(&file).await;
    let mut writer = client_with(&server, bearer(&tokens.write)).await;
    let mut same_writer = client_with(&server, bearer(&tokens.write)).await;
    let mut admin = client_with(&server, bearer(&tokens.admin)).await;
    let mut reader = client_with(&server, bearer(&tokens.read)).await;

    // A put whose stream stays open: its batches are received, its end is not.
    let (sender, receiver) = futures::channel::mpsc::unbounded();
    let data = arrow_flight::encode::FlightDataEncoderBuilder::new()
        .with_flight_descriptor(Some(path("slow")))
        .build(receiver);
    let running = tokio::spawn(async move {
        let results = writer.do_put(data).await?;
        results.try_collect::<Vec<_>>().await
    });
    sender
        .unbounded_send(Ok(int64_batch(1000, 2, 3)))
        .expect("send");
    let mut listed = serde_json::Value::Null;
    for _ in 0..200 {
        let status = common::status(&mut admin).await;
        if let Some(put) = status["puts"]
            .as_array()
            .and_then(|puts| puts.iter().find(|p| p["rows"] == 1000))
        {
            listed = put.clone();
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(listed["name"], "slow");
    assert_eq!(listed["principal"], "writer");
    assert_eq!(listed["mode"], "create");
    // Its owner sees it too; another principal sees no name it has not been shown.
    let own = common::status(&mut same_writer).await;
    assert_eq!(own["puts"].as_array().map(Vec::len), Some(1), "{own}");
    assert_eq!(own["puts"][0]["name"], "slow");
    let other = common::status(&mut reader).await;
    assert_eq!(other["puts"], serde_json::json!([]), "{other}");
    drop(sender);
    let results = running.await.expect("joined").expect("committed");
    let summary: serde_json::Value =
        serde_json::from_slice(&results[0].app_metadata).expect("summary");
    assert_eq!(listed["bytes"], summary["bytes"]);
    let status = common::status(&mut reader).await;
    assert_eq!(status["puts"], serde_json::json!([]));
    assert_eq!(status["datasets"], 1);
    server.shutdown_and_wait().await;
}

/// A CA, a server certificate for localhost signed by it, and client certificates signed by
/// it and by a stranger.
struct Pki {
    scratch: TempDataDir,
    ca_pem: String,
    client: (String, String),
    stranger: (String, String),
    /// Signed by the CA: DNS name `scanner`, and a CN `nobody` only.
    scanner: (String, String),
    nobody: (String, String),
}

fn pki() -> Pki {
    let scratch = TempDataDir::new("tls");
    let ca = authority("gpu-flight test CA");
    let stranger_ca = authority("someone else's CA");
    let leaf = |issuer: &CertifiedIssuer<'static, KeyPair>, names: Vec<String>| {
        let key = KeyPair::generate().expect("key");
        let cert = CertificateParams::new(names)
            .expect("params")
            .signed_by(&key, issuer)
            .expect("sign");
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf(&ca, vec!["localhost".into(), "127.0.0.1".into()]);
    scratch.write("server.pem", &server_cert);
    scratch.write("server.key", &server_key);
    scratch.write("ca.pem", &ca.pem());
    let nobody = {
        let key = KeyPair::generate().expect("key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "nobody");
        let cert = params.signed_by(&key, &ca).expect("sign");
        (cert.pem(), key.serialize_pem())
    };
    Pki {
        ca_pem: ca.pem(),
        client: leaf(&ca, vec!["client".into()]),
        stranger: leaf(&stranger_ca, vec!["client".into()]),
        scanner: leaf(&ca, vec!["scanner".into()]),
        nobody,
        scratch,
    }
}

fn authority(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    CertifiedIssuer::self_signed(params, KeyPair::generate().expect("key")).expect("CA")
}

async fn start_with_tls(pki: &Pki, mutual: bool) -> TestServer {
    start_with_tls_and(pki, mutual, Auth::Off).await
}

async fn start_with_tls_and(pki: &Pki, mutual: bool, auth: Auth) -> TestServer {
    let dir = pki.scratch.path();
    let ca = dir.join("ca.pem");
    let files = TlsFiles::load(
        &dir.join("server.pem"),
        &dir.join("server.key"),
        mutual.then_some(ca.as_path()),
    )
    .expect("TLS files");
    TestServer::start_with(
        Arc::new(HostBackend::new()),
        StoreOptions::default(),
        ServeOptions {
            tls: Some(files),
            auth,
            ..ServeOptions::default()
        },
    )
    .await
}

async fn tls_client(
    server: &TestServer,
    ca_pem: &str,
    identity: Option<&(String, String)>,
) -> Result<FlightClient, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .domain_name("localhost");
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    let channel = Channel::from_shared(format!("https://127.0.0.1:{}", server.addr.port()))
        .expect("uri")
        .tls_config(tls)?
        .connect()
        .await?;
    Ok(FlightClient::new(channel))
}

/// Whether a client can complete a call (a TLS refusal may surface at connect or at the
/// first call, depending on when the handshake finishes).
async fn can_call(client: Result<FlightClient, tonic::transport::Error>) -> bool {
    match client {
        Ok(mut client) => client.list_flights("").await.is_ok(),
        Err(_) => false,
    }
}

#[tokio::test]
async fn tls_serves_and_plain_text_is_refused() {
    let pki = pki();
    let server = start_with_tls(&pki, false).await;
    let mut client = tls_client(&server, &pki.ca_pem, None)
        .await
        .expect("TLS connect");
    let batch = int64_batch(1000, 4, 9);
    put(&mut client, path("secret"), vec![batch.clone()])
        .await
        .expect("put over TLS");
    let back = common::get_all(&mut client, "secret").await.expect("get");
    common::assert_same_data(&[batch], &back);

    // A client that does not speak TLS gets nothing.
    let plain = Channel::from_shared(format!("http://{}", server.addr))
        .expect("uri")
        .connect()
        .await;
    assert!(!can_call(plain.map(FlightClient::new)).await);
    // Nor does one that does not trust the server's CA.
    let other = authority("not the server's CA").pem();
    assert!(!can_call(tls_client(&server, &other, None).await).await);
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn mutual_tls_refuses_clients_without_a_valid_certificate() {
    let pki = pki();
    let server = start_with_tls(&pki, true).await;
    assert!(
        can_call(tls_client(&server, &pki.ca_pem, Some(&pki.client)).await).await,
        "a client with a certificate from the CA is served"
    );
    assert!(
        !can_call(tls_client(&server, &pki.ca_pem, None).await).await,
        "a client without a certificate is refused"
    );
    assert!(
        !can_call(tls_client(&server, &pki.ca_pem, Some(&pki.stranger)).await).await,
        "a client with a certificate from another CA is refused"
    );
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn client_certificates_map_to_principals() {
    let pki = pki();
    let (file, tokens) = token_file(&pki.scratch);
    let mut text = std::fs::read_to_string(&file).expect("token file");
    text.push_str(
        "[[certificates]]\nprincipal = \"loader\"\nrole = \"write\"\ndns_name = \"client\"\n\
         [[certificates]]\nprincipal = \"scanner\"\nrole = \"read\"\ndns_name = \"scanner\"\n\
         [[certificates]]\nprincipal = \"nobody\"\nrole = \"admin\"\ncommon_name = \"somebody\"\n",
    );
    std::fs::write(&file, text).expect("write token file");
    let authenticator = Authenticator::load(&file, DEFAULT_SESSION_TTL).expect("token file");
    let server = start_with_tls_and(&pki, true, Auth::Tokens(Arc::new(authenticator))).await;

    // The certificate alone authenticates, as the principal its name maps to.
    let mut loader = tls_client(&server, &pki.ca_pem, Some(&pki.client))
        .await
        .expect("connect");
    put(&mut loader, path("loaded"), vec![int64_batch(10, 1, 1)])
        .await
        .expect("loader may write");
    let mut scanner = tls_client(&server, &pki.ca_pem, Some(&pki.scanner))
        .await
        .expect("connect");
    assert_eq!(common::list_all(&mut scanner).await.len(), 1);
    let refused = put(&mut scanner, path("scanned"), vec![int64_batch(10, 1, 1)])
        .await
        .expect_err("scanner only reads");
    assert_eq!(code_of(&refused), Code::PermissionDenied);
    let message = refused.to_string();
    assert!(
        message.contains("scanner") && message.contains("has the read role"),
        "{message}"
    );

    // A certificate the file does not name authenticates nobody; a token still does.
    let mut nobody = tls_client(&server, &pki.ca_pem, Some(&pki.nobody))
        .await
        .expect("connect");
    let refused = nobody
        .list_flights("")
        .await
        .map(drop)
        .expect_err("refused");
    assert_eq!(code_of(&refused), Code::Unauthenticated);
    nobody
        .add_header("authorization", &format!("Bearer {}", tokens.read))
        .expect("header");
    assert_eq!(common::list_all(&mut nobody).await.len(), 1);
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn an_address_that_keeps_failing_to_authenticate_is_refused_for_a_while() {
    let scratch = TempDataDir::new("limit");
    let (file, tokens) = token_file(&scratch);
    let server = start_with_auth(&file).await;
    let mut guesser = client_with(&server, bearer("guess")).await;
    for _ in 0..6 {
        let refused = guesser
            .list_flights("")
            .await
            .map(drop)
            .expect_err("refused");
        assert_eq!(code_of(&refused), Code::Unauthenticated);
    }
    // The same address's password logins are now refused without being checked.
    let basic = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode("carol:pa55")
    );
    let mut carol = client_with(&server, Some(basic)).await;
    let refused = carol.handshake(Vec::new()).await.expect_err("refused");
    assert_eq!(code_of(&refused), Code::Unauthenticated);
    assert!(
        refused
            .to_string()
            .contains("too many failed authentication attempts"),
        "{refused}"
    );
    // Valid tokens are not slowed.
    let mut reader = client_with(&server, bearer(&tokens.read)).await;
    assert!(common::list_all(&mut reader).await.is_empty());
    server.shutdown_and_wait().await;
}

#[test]
fn unusable_tls_files_are_refused_at_start() {
    let pki = pki();
    let dir = pki.scratch.path();
    let garbage = pki.scratch.write("garbage.pem", "not a certificate");
    let error = TlsFiles::load(&garbage, &dir.join("server.key"), None).expect_err("refused");
    assert!(error.contains("--tls-cert"), "{error}");
    let missing = TlsFiles::load(&dir.join("absent.pem"), &dir.join("server.key"), None)
        .expect_err("refused");
    assert!(missing.contains("absent.pem"), "{missing}");
}
