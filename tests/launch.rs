//! What the binary does before it serves, called as library code: listen addresses resolved and
//! bound, protected mode, the token file reloaded on a hangup, and a whole server started from
//! its flags and stopped by its shutdown future.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use common::datadir::TempDataDir;
use gpu_flight::auth::{Authenticator, DEFAULT_SESSION_TTL, new_token};
use gpu_flight::config::Cli;
use gpu_flight::launch::bind::{self, ListenAddresses};
use gpu_flight::launch::exposure::{self, Exposure};
use gpu_flight::launch::{self, Failure, reload};

fn address(text: &str) -> SocketAddr {
    text.parse().expect("a socket address")
}

#[tokio::test]
async fn listen_values_resolve_in_order_without_repeats() {
    let specs = [
        "127.0.0.1:7001",
        "grpc://127.0.0.1:7001",
        "[::1]:7002",
        "unix:///tmp/a.sock",
        "grpc+unix:///tmp/a.sock",
        "unix:///tmp/b.sock",
    ]
    .map(String::from);
    let resolved = ListenAddresses::resolve(&specs).await.expect("resolves");
    assert_eq!(
        resolved.tcp,
        [address("127.0.0.1:7001"), address("[::1]:7002")]
    );
    assert_eq!(
        resolved.unix,
        [
            std::path::PathBuf::from("/tmp/a.sock"),
            "/tmp/b.sock".into()
        ]
    );
    let only_unix = ListenAddresses::resolve(&["unix:///tmp/c.sock".to_owned()])
        .await
        .expect("resolves");
    assert!(only_unix.tcp.is_empty());
}

#[tokio::test]
async fn an_address_without_a_port_is_refused_saying_what_one_looks_like() {
    let error = bind::resolve(&["127.0.0.1".to_owned()])
        .await
        .expect_err("no port");
    assert!(
        error.contains("\"127.0.0.1\"") && error.contains("HOST:PORT"),
        "{error}"
    );
    let error = bind::bind_side(Some("localhost"), "--metrics-listen")
        .await
        .expect_err("no port");
    assert!(error.starts_with("--metrics-listen: "), "{error}");
}

#[tokio::test]
async fn listeners_bind_tcp_and_unix_and_name_the_flag_of_an_address_in_use() {
    let dir = TempDataDir::new("launch-bind");
    std::fs::create_dir_all(dir.path()).expect("dir");
    let socket = dir.path().join("flight.sock");
    let specs = [
        "127.0.0.1:0".to_owned(),
        format!("unix://{}", socket.display()),
    ];
    let addresses = ListenAddresses::resolve(&specs).await.expect("resolves");
    let listeners = addresses.bind().await.expect("binds");
    assert_eq!(listeners.len(), 2);
    assert!(!listeners[0].is_unix() && listeners[1].is_unix());
    assert!(socket.exists());

    let side = bind::bind_side(Some("127.0.0.1:0"), "--health-listen")
        .await
        .expect("binds")
        .expect("a listener");
    let taken = side.local_addr().expect("address").to_string();
    let error = bind::bind_side(Some(&taken), "--metrics-listen")
        .await
        .expect_err("in use");
    assert!(
        error.contains(&taken) && error.contains("--metrics-listen") && error.contains("port 0"),
        "{error}"
    );
    assert_eq!(
        bind::bind_side(None, "--metrics-listen")
            .await
            .map(|l| l.is_none()),
        Ok(true)
    );
}

#[test]
fn protected_mode_refuses_other_hosts_without_authentication() {
    let loopback = [address("127.0.0.1:8815"), address("[::1]:8815")];
    let exposed = [address("127.0.0.1:8815"), address("0.0.0.0:8815")];
    assert_eq!(
        exposure::check(&loopback, false, false, false),
        Ok(Exposure::Safe)
    );
    let error = exposure::check(&exposed, false, false, false).expect_err("refused");
    assert!(
        error.starts_with("refusing to listen on 0.0.0.0:8815 without authentication")
            && error.contains("--allow-unauthenticated"),
        "{error}"
    );
    assert_eq!(
        exposure::check(&exposed, false, true, true),
        Ok(Exposure::Unauthenticated {
            addresses: "0.0.0.0:8815".to_owned()
        })
    );
    assert_eq!(
        exposure::check(&exposed, true, false, false),
        Ok(Exposure::Cleartext {
            addresses: "0.0.0.0:8815".to_owned()
        })
    );
    assert_eq!(
        exposure::check(&exposed, true, true, false),
        Ok(Exposure::Safe)
    );
}

fn token_file(principals: &[&str]) -> String {
    principals
        .iter()
        .map(|principal| {
            let (_, digest) = new_token().expect("token");
            format!(
                "[[tokens]]\nprincipal = {principal:?}\nrole = \"read\"\nsha256 = \"{digest}\"\n"
            )
        })
        .collect()
}

#[tokio::test]
async fn each_hangup_reloads_the_token_file() {
    let dir = TempDataDir::new("launch-reload");
    std::fs::create_dir_all(dir.path()).expect("dir");
    let path = dir.path().join("tokens.toml");
    std::fs::write(&path, token_file(&["a"])).expect("write");
    let authenticator = Arc::new(Authenticator::load(&path, DEFAULT_SESSION_TTL).expect("loads"));
    let (hangup, hangups) = futures::channel::mpsc::unbounded::<()>();
    let reloader = tokio::spawn(reload::reload_on(Arc::clone(&authenticator), hangups));
    let tokens = || authenticator.loaded().tokens;

    std::fs::write(&path, token_file(&["a", "b", "c"])).expect("write");
    assert_eq!(tokens(), 1, "nothing is read before a hangup");
    hangup.unbounded_send(()).expect("send");
    common::wait_until(|| async { tokens() == 3 }).await;

    std::fs::write(&path, token_file(&["d", "e"])).expect("write");
    hangup.unbounded_send(()).expect("send");
    common::wait_until(|| async { tokens() == 2 }).await;

    drop(hangup);
    tokio::time::timeout(Duration::from_secs(10), reloader)
        .await
        .expect("the reloader ends with its hangups")
        .expect("no panic");
}

#[tokio::test]
async fn a_broken_token_file_stays_out_after_a_hangup() {
    let dir = TempDataDir::new("launch-reload-broken");
    std::fs::create_dir_all(dir.path()).expect("dir");
    let path = dir.path().join("tokens.toml");
    std::fs::write(&path, token_file(&["a", "b"])).expect("write");
    let authenticator = Arc::new(Authenticator::load(&path, DEFAULT_SESSION_TTL).expect("loads"));
    std::fs::write(&path, "tokens = 3").expect("write");
    let hangups = futures::stream::iter([()]);
    reload::reload_on(Arc::clone(&authenticator), hangups).await;
    assert_eq!(authenticator.loaded().tokens, 2);
}

fn serve_args(flags: &[&str]) -> gpu_flight::config::ServeArgs {
    Cli::try_parse_from(["gpu-flight", "serve"].iter().chain(flags))
        .expect("flags parse")
        .into_serve_args()
        .expect("serve")
}

#[tokio::test]
async fn a_server_starts_from_its_flags_and_stops_with_its_shutdown_future() {
    let dir = TempDataDir::new("launch-serve");
    std::fs::create_dir_all(dir.path()).expect("dir");
    let socket = dir.path().join("flight.sock");
    let listen = format!("unix://{}", socket.display());
    let args = serve_args(&["--backend", "host", "--listen", &listen]);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(launch::serve(args, || async {
        let _ = stopped.await;
    }));
    common::wait_until(|| async { tokio::net::UnixStream::connect(&socket).await.is_ok() }).await;
    assert!(!served.is_finished(), "serving");
    let _ = stop.send(());
    let result = tokio::time::timeout(Duration::from_secs(30), served)
        .await
        .expect("stops")
        .expect("no panic");
    assert_eq!(result, Ok(()));
}

/// What `serve` started it also stops: after it returns, the metrics endpoint's port is free
/// again (and the store it held is gone), so a second start in the same process works.
#[tokio::test]
async fn nothing_serve_started_outlives_it() {
    let dir = TempDataDir::new("launch-tasks");
    std::fs::create_dir_all(dir.path()).expect("dir");
    let socket = dir.path().join("flight.sock");
    let listen = format!("unix://{}", socket.display());
    let free = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let metrics = free.local_addr().expect("address").to_string();
    drop(free);
    let args = serve_args(&[
        "--backend",
        "host",
        "--listen",
        &listen,
        "--metrics-listen",
        &metrics,
    ]);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(launch::serve(args, || async {
        let _ = stopped.await;
    }));
    common::wait_until(|| async { tokio::net::TcpStream::connect(&metrics).await.is_ok() }).await;
    let _ = stop.send(());
    let result = tokio::time::timeout(Duration::from_secs(30), served)
        .await
        .expect("stops")
        .expect("no panic");
    assert_eq!(result, Ok(()));
    // An aborted task lets go of its listener when the runtime next polls it.
    common::wait_until(|| async { std::net::TcpListener::bind(&metrics).is_ok() }).await;
}

#[tokio::test]
async fn refusals_end_with_exit_code_2_and_server_faults_with_1() {
    let refused = launch::serve(
        serve_args(&["--backend", "host", "--listen", "0.0.0.0:0"]),
        || async {},
    )
    .await
    .expect_err("refused");
    let message = refused.to_string();
    assert!(
        message.starts_with("refusing to listen on 0.0.0.0:"),
        "{message}"
    );
    assert_eq!(refused, Failure::Start(message));
    assert_eq!(refused.exit_code(), std::process::ExitCode::from(2));
    let fault = Failure::Serve("transport error".to_owned());
    assert_eq!(fault.to_string(), "server failed: transport error");
    assert_eq!(fault.exit_code(), std::process::ExitCode::FAILURE);
}
